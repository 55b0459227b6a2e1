"""torch.distributed helpers of tritile.ep: backend/device choice, byte-level all-to-all, events and streams.

Collectives run with the process group's own timeout (``init_process_group(timeout=...)`` /
``new_group(timeout=...)``): a rank that fails (or never arrives) makes the others raise within it instead of
hanging.  With gloo, a peer whose process died raises at once ("Connection closed by peer").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["EventOverlap", "a2a_rows", "group_device", "CommContext"]


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


def a2a_rows(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]], in_splits: Optional[List[int]],
             group, async_op: bool = False):
    """``all_to_all_single`` of 2D row blocks through uint8 views (gloo has no FP8 / 16-bit integer support).

    ``out`` and ``inp`` are contiguous; splits count rows (None: equal splits).  A zero-byte exchange still
    runs (every rank must enter the collective).  Returns the ``Work`` with ``async_op=True``, else None."""
    o, i = _bytes2d(out), _bytes2d(inp)
    if o.shape[1] != i.shape[1] and o.shape[0] and i.shape[0]:
        raise ValueError(f"row widths differ: out has {o.shape[1]} bytes per row, inp {i.shape[1]}")
    if o.shape[1] == 0 or i.shape[1] == 0:
        # rows of zero bytes: keep the collective (all ranks enter it) on a one-byte view of nothing
        o = torch.empty((0,), dtype=torch.uint8, device=out.device)
        i = torch.empty((0,), dtype=torch.uint8, device=inp.device)
        out_splits = None if out_splits is None else [0] * len(out_splits)
        in_splits = None if in_splits is None else [0] * len(in_splits)
        if out_splits is None:
            out_splits = in_splits = [0] * dist.get_world_size(group)
    return dist.all_to_all_single(o, i, out_splits, in_splits, group=group, async_op=async_op)


class EventOverlap:
    """A completion event of an asynchronous ``Buffer`` call (DeepEP's ``EventOverlap``).

    On CUDA it wraps a ``torch.cuda.Event`` recorded on the buffer's communication stream; on the CPU (gloo)
    ``event`` is None and every method is a no-op.  ``current_stream_wait()`` makes the current stream wait for
    the event; ``with event:`` does the same when the block exits.  ``extra_tensors`` keeps tensors alive until
    the wait.
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()


class CommContext:
    """Runs a Buffer call on the communication stream (CUDA) or inline (CPU).

    ``previous_event``: the comm stream waits on it (else on the current stream).  On exit an event is recorded
    on the comm stream; without ``async_finish`` the current stream waits on it.  Tensors given to ``keep`` (inputs
    read on the comm stream) and to ``outputs`` (results used on the current stream) get ``record_stream`` so the
    caching allocator does not reuse them too early; with ``allocate_on_comm_stream`` outputs stay owned by the
    comm stream (the caller then waits on the event before freeing them).
    """

    def __init__(self, stream: Optional["torch.cuda.Stream"], previous_event: Optional[EventOverlap],
                 async_finish: bool, allocate_on_comm_stream: bool) -> None:
        self.stream = stream
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.event: Optional[EventOverlap] = None

    @contextmanager
    def run(self, keep=()):
        if self.stream is None:
            yield
            self.event = EventOverlap(None)
            return
        compute = torch.cuda.current_stream()
        if self.previous_event is not None and self.previous_event.event is not None:
            self.stream.wait_event(self.previous_event.event)
        else:
            self.stream.wait_stream(compute)
        self._capturing = torch.cuda.is_current_stream_capturing()
        if not self._capturing:  # a captured graph keeps its memory pool: no allocator bookkeeping needed
            for t in keep:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.event = EventOverlap(ev)
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
