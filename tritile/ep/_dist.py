"""torch.distributed helpers of tritile.ep: backend/device choice, byte-level all-to-all, events and streams, the
fixed-size header exchange that checks arguments across ranks, and the physical domain of a group.

Collectives run with the process group's own timeout (``init_process_group(timeout=...)`` /
``new_group(timeout=...)``); the header exchange also takes a per-call timeout.  With gloo, a peer whose process
died raises at once ("Connection closed by peer").
"""

from __future__ import annotations

import socket
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["EventHandle", "EventOverlap", "a2a_rows", "group_device", "CommContext", "PeerFailure", "Header",
           "exchange_header", "physical_domain", "get_physical_domain_size", "get_logical_domain_size", "raw_event"]


def group_device(group) -> torch.device:
    """The device a group's collectives take: the current CUDA device when the group has NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()  # "nccl", "gloo", or e.g. "cpu:gloo,cuda:nccl"
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes2d(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():  # a copy would silently drop received bytes
        raise ValueError(f"collective buffers must be contiguous, got strides {tuple(t.stride())}")
    if t.dim() == 1:
        t = t.reshape(-1, 1)
    rows = t.shape[0]
    width = t.shape[1] * t.element_size()
    if t.dtype == torch.uint8:
        return t
    if t.numel() == 0:
        return torch.empty((rows, width), dtype=torch.uint8, device=t.device)
    return t.view(torch.uint8).reshape(rows, width)


class _DoneWork:
    """The completed work of a one-rank exchange (its copy is already ordered on the stream)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _DoneWork()


def a2a_rows(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]], in_splits: Optional[List[int]],
             group, async_op: bool = False):
    """``all_to_all_single`` of 2D row blocks through uint8 views (gloo has no FP8 / 16-bit integer support).

    ``out`` and ``inp`` are contiguous; splits count rows (None: equal splits).  A zero-byte exchange still
    runs (every rank must enter the collective).  Returns the ``Work`` with ``async_op=True``, else None.

    A one-rank group exchanges with itself: the rows are copied on the current stream (one copy kernel, no
    collective), and ``async_op=True`` returns a completed work."""
    o, i = _bytes2d(out), _bytes2d(inp)
    if o.shape[1] != i.shape[1] and o.shape[0] and i.shape[0]:
        raise ValueError(f"row widths differ: out has {o.shape[1]} bytes per row, inp {i.shape[1]}")
    if dist.get_world_size(group) == 1:
        n = i.shape[0] if in_splits is None else int(in_splits[0])
        if out_splits is not None and int(out_splits[0]) != n or n > o.shape[0] or n > i.shape[0]:
            raise ValueError(f"a one-rank exchange sends and receives the same rows, got splits {in_splits} and "
                             f"{out_splits} for {i.shape[0]} and {o.shape[0]} rows")
        if n and o.shape[1]:
            o[:n].copy_(i[:n])
        return _DONE if async_op else None
    if o.shape[1] == 0 or i.shape[1] == 0:
        # rows of zero bytes: keep the collective (all ranks enter it) on a one-byte view of nothing
        o = torch.empty((0,), dtype=torch.uint8, device=out.device)
        i = torch.empty((0,), dtype=torch.uint8, device=inp.device)
        out_splits = None if out_splits is None else [0] * len(out_splits)
        in_splits = None if in_splits is None else [0] * len(in_splits)
        if out_splits is None:
            out_splits = in_splits = [0] * dist.get_world_size(group)
    return dist.all_to_all_single(o, i, out_splits, in_splits, group=group, async_op=async_op)


# ---------------------------------------------------------------------------------------------------------------
# events
# ---------------------------------------------------------------------------------------------------------------
class EventHandle:
    """DeepEP's ``EventHandle``: an event recorded on the current CUDA stream when it is made.

    Without CUDA (gloo ranks on the CPU) it holds no event and :meth:`current_stream_wait` is a no-op: CPU work
    is already complete when a call returns.
    """

    def __init__(self) -> None:
        self.event: Optional["torch.cuda.Event"] = None
        if torch.cuda.is_available():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.event = ev

    @classmethod
    def wrap(cls, event: Optional["torch.cuda.Event"]) -> "EventHandle":
        """An EventHandle around an already recorded ``torch.cuda.Event`` (or none)."""
        h = cls.__new__(cls)
        h.event = event
        return h

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no-op without one)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def raw_event(ev) -> Optional["torch.cuda.Event"]:
    """The ``torch.cuda.Event`` inside an EventOverlap / EventHandle / torch event, or None."""
    if ev is None:
        return None
    if isinstance(ev, EventOverlap):
        ev = ev.event
    if isinstance(ev, EventHandle):
        return ev.event
    if hasattr(ev, "record") and hasattr(ev, "synchronize"):
        return ev
    return None


class EventOverlap:
    """A completion event of an asynchronous call (DeepEP's ``EventOverlap``).

    ``event`` is an :class:`EventHandle` (CUDA: an event on the buffer's communication stream; CPU: a completed
    no-op).  ``current_stream_wait(release_handle=False)`` makes the current stream wait for it, then runs the
    hook given to :meth:`register_hook_after_wait` (once); ``release_handle=True`` drops the event afterwards.
    ``with event:`` waits when the block exits (``with event(release_handle=True):`` releases too).
    ``extra_tensors`` keeps tensors alive until the wait.
    """

    def __init__(self, event=None, extra_tensors: Optional[tuple] = None) -> None:
        if event is not None and not isinstance(event, EventHandle):
            event = EventHandle.wrap(raw_event(event))
        self.event: Optional[EventHandle] = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable[[], None]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is None:
            raise ValueError("this EventOverlap has no event (it was released by current_stream_wait("
                             "release_handle=True))")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """Run ``hook_after_wait()`` after the next :meth:`current_stream_wait` (one hook at a time)."""
        if self.hook_after_wait is not None:
            raise ValueError("a hook is already registered on this EventOverlap")
        if not callable(hook_after_wait):
            raise TypeError(f"hook_after_wait must be callable, got {type(hook_after_wait).__name__}")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = bool(release_handle)
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class CommContext:
    """Runs a call on the communication stream (CUDA) or inline (CPU).

    ``previous_event``: the comm stream waits on it (else on the current stream).  On exit an event is recorded
    on the comm stream; without ``async_finish`` the current stream waits on it.  Tensors given to ``keep`` (inputs
    read on the comm stream) and to ``outputs`` (results used on the current stream) get ``record_stream`` so the
    caching allocator does not reuse them too early; with ``allocate_on_comm_stream`` outputs stay owned by the
    comm stream (the caller then waits on the event before freeing them).
    """

    def __init__(self, stream: Optional["torch.cuda.Stream"], previous_event, async_finish: bool,
                 allocate_on_comm_stream: bool, extra_event=None) -> None:
        self.stream = stream
        self.previous_event = raw_event(previous_event)
        self.extra_event = raw_event(extra_event)
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.event: Optional[EventOverlap] = None
        self._capturing = False

    @contextmanager
    def run(self, keep=()):
        if self.stream is None:
            yield
            self.event = EventOverlap(EventHandle.wrap(None))
            return
        compute = torch.cuda.current_stream()
        if self.previous_event is not None:
            self.stream.wait_event(self.previous_event)
        else:
            self.stream.wait_stream(compute)
        if self.extra_event is not None:
            self.stream.wait_event(self.extra_event)
        self._capturing = torch.cuda.is_current_stream_capturing()
        if not self._capturing:  # a captured graph keeps its memory pool: no allocator bookkeeping needed
            for t in keep:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.event = EventOverlap(EventHandle.wrap(ev))
        if not self.async_finish:
            compute.wait_event(ev)
        self._compute = compute

    def own(self, *outputs) -> None:
        """Mark outputs as used on the caller's stream."""
        if self.stream is None or self.allocate_on_comm_stream or self._capturing:
            return
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self._compute)
            elif isinstance(t, (tuple, list)):
                self.own(*t)


# ---------------------------------------------------------------------------------------------------------------
# the header exchange
# ---------------------------------------------------------------------------------------------------------------
#: Words of every header: magic, status, op, then up to ``_FIELDS`` argument fields (zero-padded).
_MAGIC = 0x7E9D15
_FIELDS = 13
HEADER_WORDS = 3 + _FIELDS
_OPS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_combine", "engram_write", "engram_fetch",
        "all_gather", "reduce_scatter", "barrier", "pp_set_config", "agrs_set_config", "constructor")


class PeerFailure(ValueError):
    """Raised on every rank whose peer failed locally before a call's collectives (the peer raises its own
    error)."""


class Header:
    """The fixed-size header of one call: ``op`` and named integer fields.

    ``agree``: the fields every rank must pass equal values for (the others, e.g. token counts, may differ).
    ``names`` maps codes back to text for messages (e.g. dtype codes)."""

    def __init__(self, op: str, fields: Sequence[Tuple[str, int, bool]], names: Optional[Dict[str, Dict]] = None):
        if op not in _OPS:
            raise ValueError(f"unknown header op {op!r}")
        if len(fields) > _FIELDS:
            raise ValueError(f"a header holds at most {_FIELDS} fields, got {len(fields)}")
        self.op = op
        self.fields = list(fields)
        self.names = names or {}

    def words(self, status: int) -> List[int]:
        vals = [int(v) for _, v, _ in self.fields]
        return [_MAGIC, status, _OPS.index(self.op)] + vals + [0] * (_FIELDS - len(vals))


def _fmt(header: Header, name: str, value: int) -> str:
    return str(header.names.get(name, {}).get(value, value))


def exchange_header(group, device: torch.device, header: Header, extra: Optional[torch.Tensor] = None,
                    error: Optional[BaseException] = None, timeout_s: Optional[float] = None) -> torch.Tensor:
    """All-gather ``header`` (plus ``R`` extra int64 words per rank, e.g. per-rank counts) and check it.

    Every call's first collective: it has the same size for every op and argument, so ranks that disagree
    never enter collectives of different sizes.  Raises, the same way on every rank:

    * a rank passed ``error`` (it failed locally): that rank re-raises ``error``; the others raise
      :class:`PeerFailure` (a ValueError) naming the rank and its error;
    * ranks are in different calls, or disagree on a field of ``header.agree``: ``ValueError`` with the values
      of every rank.

    Returns the int64 table ``(R, HEADER_WORDS + R)`` on the host (one host sync).  ``timeout_s``: wait at most
    this long for the other ranks (then ``RuntimeError`` naming the call), else the group's timeout.  A one-rank
    group exchanges nothing: its table is its own header (no collective; a host sync only to read ``extra``).
    """
    host = _exchange(group, device, header, extra, None if error is None else (type(error).__name__, str(error)),
                     timeout_s)
    if error is None:
        return host
    try:
        raise error
    finally:
        # the exception's traceback holds this frame: dropping the name breaks the cycle that would keep the
        # caller's objects (a buffer, its process group) alive until a garbage collection, possibly at interpreter
        # exit, where gloo's teardown aborts the process
        error = None


def _exchange(group, device: torch.device, header: Header, extra: Optional[torch.Tensor],
              failed_msg: Optional[Tuple[str, str]], timeout_s: Optional[float]) -> Optional[torch.Tensor]:
    """:func:`exchange_header` without the exception object (so no frame of it holds one): ``failed_msg`` is
    ``(type name, message)`` of this rank's local error.  Returns None where this rank must raise its own error."""
    world = dist.get_world_size(group)
    mine = torch.zeros((HEADER_WORDS + world,), dtype=torch.int64, device="cpu")
    mine[:HEADER_WORDS] = torch.tensor(header.words(0 if failed_msg is None else 1), dtype=torch.int64, device="cpu")
    if extra is not None and failed_msg is None:
        mine[HEADER_WORDS:] = extra.to(torch.int64).cpu()
    if world == 1:  # a one-rank group: nothing to exchange or to agree on (the counts above were its one sync)
        if failed_msg is not None:
            return None
        return mine.view(1, HEADER_WORDS + 1)
    mine = mine.to(device)
    table = torch.empty((world * (HEADER_WORDS + world),), dtype=torch.int64, device=device)
    try:
        work = dist.all_gather_into_tensor(table, mine, group=group, async_op=True)
        if timeout_s is not None and device.type == "cpu":
            work.wait(timeout=timedelta(seconds=float(timeout_s)))
        else:
            work.wait()
        host = table.cpu().view(world, HEADER_WORDS + world)
    except RuntimeError as e:
        if failed_msg is not None:
            return None
        raise RuntimeError(f"tritile.ep {header.op}: the header exchange with the other ranks failed or timed out "
                           f"(a peer failed before this call, or is not making it): {e}") from e
    rows = host.tolist()
    failed = [r for r, row in enumerate(rows) if row[1] != 0]
    if failed:
        msg = failed_msg if failed_msg is not None else ("", "")
        msgs: List = [None] * world
        try:
            dist.all_gather_object(msgs, msg, group=group)
        except RuntimeError:
            msgs = [("Error", "(message unavailable)")] * world
        text = "; ".join(f"rank {r} raised {msgs[r][0]}: {msgs[r][1]}" for r in failed)
        if failed_msg is not None:
            return None
        raise PeerFailure(f"tritile.ep {header.op}: another rank failed before the exchange: {text}")
    bad_magic = [r for r, row in enumerate(rows) if row[0] != _MAGIC]
    if bad_magic:
        raise ValueError(f"tritile.ep {header.op}: rank(s) {bad_magic} sent a corrupt header")
    ops = [row[2] for row in rows]
    if len(set(ops)) > 1:
        desc = ", ".join(f"rank {r}: {_OPS[o] if 0 <= o < len(_OPS) else o}" for r, o in enumerate(ops))
        raise ValueError(f"ranks are in different calls ({desc}); every rank must make the same collective calls in "
                         "the same order")
    for f, (name, _, agree) in enumerate(header.fields):
        if not agree:
            continue
        vals = [row[3 + f] for row in rows]
        if len(set(vals)) > 1:
            desc = ", ".join(f"rank {r}: {_fmt(header, name, v)}" for r, v in enumerate(vals))
            raise ValueError(f"tritile.ep {header.op}: ranks disagree on {name} ({desc}); every rank must pass the "
                             "same value")
    return host


# ---------------------------------------------------------------------------------------------------------------
# physical / logical domains
# ---------------------------------------------------------------------------------------------------------------
_DOMAINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def physical_domain(group) -> Tuple[int, int, List[str]]:
    """``(num_rdma_ranks, num_nvlink_ranks, hosts)``: ranks sharing a host form an NVLink domain (ranks are
    expected in blocks of ``num_nvlink_ranks`` per host, else every rank is its own domain); ``hosts`` holds
    every rank's host name.

    A collective (``all_gather_object``) on the first call per group: every rank must make it."""
    group = group if group is not None else dist.group.WORLD
    try:
        got = _DOMAINS.get(group)
    except TypeError:  # a group object that cannot be weakly referenced: not cached
        got = None
    if got is not None:
        return got
    world = dist.get_world_size(group)
    hosts: List = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    per_host: Dict[str, int] = {}
    for h in hosts:
        per_host[h] = per_host.get(h, 0) + 1
    nvl = min(per_host.values())
    blocks_ok = world % nvl == 0 and all(len(set(hosts[i:i + nvl])) == 1 for i in range(0, world, nvl))
    if not blocks_ok:
        nvl = 1
    res = (world // nvl, nvl, hosts)
    try:
        _DOMAINS[group] = res
    except TypeError:  # a group object that cannot be weakly referenced: do not cache
        pass
    return res


def get_physical_domain_size(group) -> Tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)`` of ``group``: hosts, and ranks per host (DeepEP's
    ``deep_ep.get_physical_domain_size``).  A collective on the first call per group."""
    r, n, _ = physical_domain(group)
    return r, n


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: always ``(1, R)`` in tritile.ep, whose one exchange level
    reaches every rank directly (DeepEP's "direct" mode; its hybrid RDMA-then-NVLink mode does not exist here, so
    ``allow_hybrid_mode`` changes nothing)."""
    group = group if group is not None else dist.group.WORLD
    return 1, dist.get_world_size(group)
