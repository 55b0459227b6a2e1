"""``tritile.ep.Buffer``: DeepEP v1-shaped expert-parallel dispatch / combine on torch.distributed.

See the package docstring (:mod:`tritile.ep`) for the contract, the supported arguments and the engine.  The
private ``_*_core`` methods are the engine that :class:`tritile.ep.ElasticBuffer` (DeepEP v2's API) reuses.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..runtime import check_inner_contiguous, check_tensor, checks_enabled, empty, kernel_device_ok
from ..utils import align, ceil_div
from ._dist import (HEADER_WORDS, CommContext, EventHandle, EventOverlap, Header, a2a_rows, exchange_header,
                    group_device, physical_domain)
from .layout import check_layout_args, dispatch_layout, raise_on_bad_ids
from .ll import ll_pack, ll_send_meta, ll_unpack
from .pack import (as_words, gather_rows, meta_width, pack_meta, pack_meta_into, pack_rows, scatter_rows_into,
                   unpack_meta)
from .reduce import combine_reduce

__all__ = ["Buffer", "Config", "DispatchHandle", "LowLatencyHandle", "EventOverlap", "EventHandle", "topk_idx_t"]

#: dtype of expert indices (DeepEP's ``topk_idx_t``); int32 ``topk_idx`` is accepted too.
topk_idx_t = torch.int64

_DTYPES = {torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float32: 3, torch.int32: 4, torch.float16: 5}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPES.items()}
_DTYPE_NAMES[0] = "none"
_NAMES = {"x dtype": _DTYPE_NAMES, "scale dtype": _DTYPE_NAMES,
          "mode": {0: "dispatch", 1: "cached dispatch (handle=)", 2: "fixed-capacity dispatch"},
          "payload": {0: "bf16", 1: "fp8 (float32 scales)", 2: "fp8 (UE8M0 scales)"}}
_MODE_PLAIN, _MODE_CACHED, _MODE_CAPACITY = 0, 1, 2
_ERRORS = (TypeError, ValueError, RuntimeError)
#: The context of a phase when no phase hook is set, and of a low-latency call run on the caller's stream.
_NO_PHASE = nullcontext()
#: The event of a call that ran on the caller's stream: already ordered there, nothing to wait for.
_NO_EVENT = EventHandle.wrap(None)


class _InlineContext:
    """A low-latency call without a hook or ``async_finish``: it runs on the caller's stream."""

    @staticmethod
    def run(keep=()) -> ContextManager:
        return _NO_PHASE


_INLINE = _InlineContext()


def _default_peer_checks() -> bool:
    return os.environ.get("TRITILE_EP_PEER_CHECKS", "1").strip().lower() not in ("0", "false", "no", "off")


def _version(t: Optional[torch.Tensor]) -> Optional[int]:
    """``t``'s version counter, or None for inference tensors (they keep none; caches keyed on it are skipped)."""
    if t is None or t.is_inference():
        return None
    return t._version


class Config:
    """DeepEP's tuning ``Config``, accepted for compatibility and **advisory only**: NCCL picks its own channels
    and SMs, so SM counts and chunk sizes change nothing here."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: tritile allocates per call from PyTorch's caching allocator."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: there is no RDMA buffer."""
        return 0


@dataclass
class DispatchHandle:
    """Routing of one high-throughput dispatch, reused by :meth:`Buffer.combine` and cached dispatch.

    Indexing and unpacking give DeepEP v1's intranode handle tuple (with one channel):
    ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)`` = int32 ``(R, R)``, int32 ``(R, 1)`` tokens sent to each rank, int32 ``(R, 1)`` first row of
    each source's block in ``recv_x``, int32 ``(N,)`` source token, bool ``(T, R)``, int32 ``(T, R)`` row of each
    token in the block sent to each rank (``-1`` = not sent).

    Send side (this rank's ``T`` tokens): ``is_token_in_rank``; ``send_slot`` int32 ``(T, R)``; ``send_base`` int32
    ``(R,)`` (first row of each block: the exclusive prefix of ``send_counts``, or ``r * capacity`` in
    fixed-capacity mode).  Receive side (``N`` rows, ascending source rank then source token): ``recv_src_idx``
    int32 ``(N,)``, ``recv_src_rank`` int32 ``(N,)``, ``recv_src_global`` int64 ``(N,)`` = ``src_rank * M + token``
    (v2 convention, ``M = num_max_tokens_per_rank``), ``rank_prefix_matrix`` int32 ``(R, R)`` (entry ``[i][j]``:
    tokens sent to rank ``j`` by ranks ``0..i``), ``recv_topk_idx`` int64 ``(N, k)`` local expert ids or None.
    Counts: ``send_counts`` / ``recv_counts`` (host lists; None in fixed-capacity mode), ``counts_t`` int32
    ``(R, R)`` (``[s][d]``: tokens rank ``s`` sends to rank ``d``), ``send_counts_t`` / ``recv_counts_t`` (its
    row / column of this rank), ``recv_expert_counts`` int32 ``(R, L)`` ((row, slot) pairs each source sends to
    each local expert); ``num_recv_tokens_per_expert_list`` (aligned, host; ``[]`` in fixed-capacity mode),
    ``psum_num_recv_tokens_per_expert`` int32 ``(L,)`` (non-expand: inclusive prefix of the aligned counts;
    expand: aligned segment start + real count), ``num_unaligned_recv_tokens_per_expert`` int32 ``(L,)``.
    Expand mode: ``token_topk_to_pos`` int32 ``(N, k)`` (expanded row of each (row, slot), ``-1`` = none),
    ``pos_to_token_topk`` int32 ``(N_exp,)``, ``num_expanded_tokens``.  Fixed-capacity mode: ``capacity`` ``M``
    rows per (source, destination) pair and ``recv_row_map`` / ``send_row_map`` int32 (receive compaction and its
    reverse).
    """

    num_experts: int
    expert_alignment: int
    num_ranks: int
    rank: int
    num_tokens: int
    num_topk: int
    num_max_tokens_per_rank: int
    is_token_in_rank: torch.Tensor
    send_slot: torch.Tensor
    send_base: torch.Tensor
    send_counts: Optional[List[int]]
    recv_counts: Optional[List[int]]
    counts_host: Optional[List[List[int]]]
    counts_dev: Optional[torch.Tensor]
    send_counts_t: torch.Tensor
    recv_expert_counts: torch.Tensor
    num_recv_tokens: Optional[int]
    num_recv_rows: int
    recv_src_idx: torch.Tensor
    recv_topk_idx: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: List[int]
    do_expand: bool = False
    token_topk_to_pos: Optional[torch.Tensor] = None
    pos_to_token_topk: Optional[torch.Tensor] = None
    pos_to_expert: Optional[torch.Tensor] = None
    num_expanded_tokens: int = 0
    capacity: int = 0
    recv_row_map: Optional[torch.Tensor] = None
    send_row_map: Optional[torch.Tensor] = None
    layout_id: int = 0
    extra: dict = field(default_factory=dict)

    # The inspection tensors below are computed on first use (a dispatch enqueues none of their kernels).
    def _lazy(self, name: str, make):
        v = self.extra.get(name)
        if v is None:
            v = make()
            self.extra[name] = v
        return v

    @property
    def counts_t(self) -> torch.Tensor:
        """int32 ``(R, R)``: ``[s][d]`` = tokens rank ``s`` sends to rank ``d``."""
        if self.counts_dev is not None:
            return self.counts_dev
        dev = self.send_slot.device
        return self._lazy("counts", lambda: torch.tensor(self.counts_host, dtype=torch.int32, device="cpu").to(dev))

    @property
    def recv_counts_t(self) -> torch.Tensor:
        """int32 ``(R,)``: rows received from each source rank."""
        return self._lazy("recv_counts_t", lambda: self.counts_t[:, self.rank].contiguous())

    @property
    def num_unaligned_recv_tokens_per_expert(self) -> torch.Tensor:
        """int32 ``(L,)``: (row, slot) pairs received per local expert."""
        return self._lazy("unaligned", lambda: self.recv_expert_counts.sum(0, dtype=torch.int32))

    @property
    def psum_num_recv_tokens_per_expert(self) -> torch.Tensor:
        """int32 ``(L,)``: non-expand, the inclusive prefix of the aligned counts; expand, each expert's aligned
        segment start plus its real count."""
        a = self.expert_alignment
        return self._lazy("psum", lambda: ((self.num_unaligned_recv_tokens_per_expert + a - 1) // a * a).cumsum(
            0, dtype=torch.int32))

    @property
    def rank_prefix_matrix(self) -> torch.Tensor:
        """int32 ``(R, R)``: entry ``[i][j]`` = tokens sent to rank ``j`` by ranks ``0..i``."""
        return self._lazy("prefix", lambda: self.counts_t.cumsum(0, dtype=torch.int32))

    @property
    def recv_src_rank(self) -> torch.Tensor:
        """int32 ``(rows,)``: source rank of each received row (``-1`` on padding rows)."""
        def make():
            dev = self.send_slot.device
            return torch.repeat_interleave(torch.arange(self.num_ranks, dtype=torch.int32, device=dev),
                                           self.recv_counts_t.to(torch.int64), output_size=self.num_recv_rows)
        return self._lazy("src_rank", make)

    @property
    def recv_src_global(self) -> torch.Tensor:
        """int64 ``(rows,)``: ``src_rank * M + source token`` (v2's source global id; ``-1`` on padding rows)."""
        def make():
            sr = self.recv_src_rank
            return torch.where(sr >= 0, sr.to(torch.int64) * self.num_max_tokens_per_rank + self.recv_src_idx, -1)
        return self._lazy("src_global", make)

    # DeepEP v1's intranode handle tuple
    def _as_tuple(self) -> tuple:
        def make():
            recv = self.recv_counts_t
            return (self.rank_prefix_matrix, self.send_counts_t.view(-1, 1),
                    (recv.cumsum(0, dtype=torch.int32) - recv).view(-1, 1), self.recv_src_idx,
                    self.is_token_in_rank, self.send_slot)
        return self._lazy("tuple", make)

    def __getitem__(self, i):
        return self._as_tuple()[i]

    def __iter__(self):
        return iter(self._as_tuple())

    def __len__(self) -> int:
        return 6


@dataclass
class LowLatencyHandle:
    """Routing of one :meth:`Buffer.low_latency_dispatch`.  DeepEP's tuple fields: ``src_info`` int32
    ``(L, R*M)`` (source token of each slab row, ``-1`` past ``recv_count``), ``layout_range`` int64 ``(L, R)``
    (``(begin << 32) | count`` of the rows from each source), ``num_max_dispatch_tokens_per_rank`` ``M``,
    ``hidden``, ``num_experts``.  Internal: ``send_slot`` int32 ``(T, R)``, ``pos`` int32 ``(R*M, k)`` (slab row of
    each received (row, slot)), ``recv_weights`` float32 ``(R*M, k)`` or None (weights given to dispatch),
    ``topk_idx`` the routing actually sent (masked ranks' slots removed) or None (the caller's)."""

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    send_slot: torch.Tensor
    pos: torch.Tensor
    recv_weights: Optional[torch.Tensor]
    num_tokens: int
    num_topk: int
    weights_src: Optional[Tuple[torch.Tensor, int]] = None
    topk_idx: Optional[torch.Tensor] = None

    def __iter__(self):
        return iter((self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden,
                     self.num_experts))

    def __getitem__(self, i):
        return tuple(self)[i]

    def __len__(self) -> int:
        return 5


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_recv_stats(stats: Optional[torch.Tensor], num_local_experts: int) -> None:
    """``cumulative_local_expert_recv_stats``: None, or int32 ``(num_local_experts,)``."""
    if stats is None:
        return
    check_tensor("cumulative_local_expert_recv_stats", stats, dtypes=(torch.int32,), ndim=1)
    if stats.numel() != num_local_experts:
        raise ValueError(f"cumulative_local_expert_recv_stats must have {num_local_experts} elements, got "
                         f"{stats.numel()}")


def _unpack_bias(bias) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None or isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, (tuple, list)) and len(bias) == 2:
        return bias[0], bias[1]
    raise TypeError(f"bias must be None, a bfloat16 tensor or a pair of them, got {type(bias).__name__}"
                    + (f" of length {len(bias)}" if isinstance(bias, (tuple, list)) else ""))


class Buffer:
    """Expert-parallel dispatch / combine for one process group, with DeepEP v1's methods and return tuples.

    Args:
        group: a ``torch.distributed`` process group (None: the default group).  NCCL groups take CUDA tensors,
            gloo groups CPU tensors.  Every collective inherits the group's timeout.
        num_nvl_bytes, num_rdma_bytes: the size of :meth:`get_local_buffer_tensor`'s scratch buffer (allocated on
            its first call); no transfer uses them.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: accepted and ignored (there are no
            NVLink/RDMA buffers or queue pairs: NCCL moves the bytes).
        low_latency_mode: accepted; both paths are always available.
        explicitly_destroy: accepted; :meth:`destroy` releases the cached tensors either way.
        enable_shrink: accepted: the low-latency mask calls (:meth:`low_latency_update_mask_buffer`, ...) work
            with or without it.  Masking is manual only: no timeout marks a rank as failed, and a masked rank must
            keep making the calls (the collectives need every rank).
        num_max_tokens_per_rank: ``M`` of the v2 source global id ``src_rank * M + token`` and the default
            capacity of fixed-capacity dispatch (0: the largest token count over the ranks, per call).
        hidden, num_topk, use_fp8_dispatch: accepted (sizing hints).
        peer_checks: every call first exchanges a fixed-size header with the arguments that must agree across
            ranks (hidden size, dtypes, top-k, experts, capacity) and a status, so that a mismatch raises the same
            ``ValueError`` on every rank, and a rank that fails locally before the exchange makes its peers raise
            :class:`tritile.ep.PeerFailure` naming its error.  Uncached dispatch always exchanges it (its host
            sync pays for it anyway).  Combine, cached dispatch, fixed-capacity dispatch and the low-latency calls
            pay one tiny all-gather and a host sync for it, only with ``peer_checks`` (default: True, or the
            ``TRITILE_EP_PEER_CHECKS`` environment variable, 0 / 1) and never during CUDA-graph capture.
            Without it those paths are sync-free; arguments that differ across ranks are then undefined behaviour
            of the collective (gloo aborts the process, NCCL may hang until the group's timeout), and a rank
            that raises locally leaves its peers waiting until the group's timeout.  The value must be the same
            on every rank (checked here).

    Attributes:
        phase_hook: None or a callable ``name -> context manager`` wrapped around each phase of a call
            (``"layout"``, ``"notify"``, ``"pack"``, ``"exchange"``, ``"unpack"``, ``"expand"``, ``"prereduce"``,
            ``"reduce"``), e.g. CUDA-event timers for benchmarks.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 1, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 peer_checks: Optional[bool] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed must be initialized (init_process_group) before Buffer()")
        if comm is not None:
            raise ValueError("comm (an mpi4py communicator) is not supported by tritile.ep: pass a torch.distributed "
                             "group")
        for name, v in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("num_nvl_bytes", num_nvl_bytes),
                        ("num_rdma_bytes", num_rdma_bytes)):
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.device = group_device(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.hidden, self.num_topk, self.use_fp8_dispatch = hidden, num_topk, use_fp8_dispatch
        self.peer_checks = _default_peer_checks() if peer_checks is None else bool(peer_checks)
        self.phase_hook: Optional[Callable[[str], ContextManager]] = None
        self._timeout_s: Optional[float] = None
        self._comm_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._last_layout = None
        self._cache: dict = {}
        self._layout_counter = 0
        self._destroyed = False
        self._mask = [False] * self.group_size
        self._local_buffers: dict = {}
        self._ll_parity: dict = {}
        self.num_rdma_ranks, self.num_nvl_ranks, _ = physical_domain(self.group)
        # the constructor's collective: every rank must pass the same peer_checks (it decides which calls
        # exchange headers)
        exchange_header(self.group, self.device, Header("constructor", [("peer_checks", int(self.peer_checks), True)]))

    # ----------------------------------------------------------------------------------------------------------
    # DeepEP compatibility shims
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: every path (FP8 included) is available on every device tritile runs on."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Accepted and recorded; advisory only (NCCL chooses its own SMs)."""
        if not _is_int(new_num_sms) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"new_num_sms must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """0: there is no RDMA buffer."""
        return 0

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                                 num_experts: int = 0) -> None:
        """No-op: the low-latency path keeps no state between calls that needs cleaning."""

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream (CUDA), or None on the CPU."""
        return self._comm_stream

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream (to pass as ``previous_event``); a no-op event without CUDA."""
        return EventOverlap(EventHandle())

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of a scratch byte buffer of ``num_nvl_bytes`` (or ``num_rdma_bytes``) bytes, allocated on the
        first call: elements of ``dtype`` from element ``offset``, the first ``size.numel()`` of them shaped
        ``size`` (None: all).  Unlike DeepEP's, no transfer reads it: it is plain device memory."""
        self._alive()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        name = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        if nbytes == 0:
            raise ValueError(f"the local buffer is empty: pass {name} > 0 to Buffer()")
        buf = self._local_buffers.get(bool(use_rdma_buffer))
        if buf is None:
            buf = torch.zeros((nbytes,), dtype=torch.uint8, device=self.device)
            self._local_buffers[bool(use_rdma_buffer)] = buf
        item = dtype.itemsize
        if not _is_int(offset) or offset < 0 or offset * item > nbytes:
            raise ValueError(f"offset must be an int in [0, {nbytes // item}] elements, got {offset!r}")
        avail = (nbytes - offset * item) // item
        t = buf[offset * item:offset * item + avail * item].view(dtype)
        if size is None:
            return t
        size = torch.Size(size)
        if size.numel() > avail:
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements, the buffer holds {avail} from "
                             f"offset {offset}")
        return t[:size.numel()].view(size)

    def destroy(self) -> None:
        """Release cached tensors; the buffer cannot be used afterwards."""
        self._cache.clear()
        self._local_buffers.clear()
        self._last_layout = None
        self._destroyed = True

    # ----------------------------------------------------------------------------------------------------------
    # low-latency rank masking (DeepEP's shrink mode, without failure detection)
    # ----------------------------------------------------------------------------------------------------------
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank for the low-latency calls: no (token, expert) pair goes to or
        comes from a masked rank (its slots count as ``-1``).  Every rank must apply the same masks, and every
        rank (masked ones too) keeps making the calls."""
        self._alive()
        if not _is_int(rank_to_mask) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.group_size}), got {rank_to_mask!r}")
        self._mask[rank_to_mask] = bool(mask)
        self._drop_mask_tables()

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask (1 = masked) into int32 ``mask_status`` ``(R,)``."""
        self._alive()
        check_tensor("mask_status", mask_status, dtypes=(torch.int32,), ndim=1)
        if mask_status.numel() != self.group_size:
            raise ValueError(f"mask_status must have {self.group_size} elements, got {mask_status.numel()}")
        mask_status.copy_(torch.tensor([int(m) for m in self._mask], dtype=torch.int32, device="cpu"))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._alive()
        self._mask = [False] * self.group_size
        self._drop_mask_tables()

    def _drop_mask_tables(self) -> None:
        """Forget the cached per-expert mask tables (one per expert count) after the mask changed."""
        for key in [key for key in self._cache if isinstance(key, tuple) and key[0] == "mask_table"]:
            del self._cache[key]

    def _masked_topk(self, topk_idx: torch.Tensor, num_experts: int) -> Optional[torch.Tensor]:
        """``topk_idx`` with the slots of masked ranks (and every slot, if this rank is masked) set to ``-1``; None
        when no rank is masked."""
        if not any(self._mask):
            return None
        per = num_experts // self.group_size
        key = ("mask_table", num_experts)
        table = self._cache.get(key)
        if table is None:
            owner_masked = torch.tensor(self._mask, dtype=torch.bool, device="cpu").repeat_interleave(per)
            table = torch.cat([owner_masked, torch.ones(1, dtype=torch.bool, device="cpu")]).to(self.device)
            self._cache[key] = table
        idx = topk_idx.long()
        e = torch.where((idx >= 0) & (idx < num_experts), idx, num_experts)
        drop = table[e] | bool(self._mask[self.rank])
        return torch.where(drop & (idx >= 0), torch.full_like(topk_idx, -1), topk_idx)

    # ----------------------------------------------------------------------------------------------------------
    # helpers
    # ----------------------------------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this buffer was destroyed (destroy()); make a new one")

    def _phase(self, name: str):
        """The phase hook's context for ``name`` (a shared no-op context when no hook is set)."""
        if self.phase_hook is None:
            return _NO_PHASE
        return self.phase_hook(name)

    def _ctx(self, previous_event, async_finish, allocate_on_comm_stream, extra_event=None) -> CommContext:
        ok = (EventOverlap, EventHandle)
        for nm, ev in (("previous_event", previous_event), ("previous_event_before_epilogue", extra_event)):
            if ev is not None and not isinstance(ev, ok):
                raise TypeError(f"{nm} must be an EventOverlap, an EventHandle or None, got {type(ev).__name__}")
        return CommContext(self._comm_stream, previous_event, bool(async_finish), bool(allocate_on_comm_stream),
                           extra_event)

    def _check_device(self, name: str, t: torch.Tensor) -> None:
        if t.device.type != self.device.type:
            raise ValueError(f"{name} must be on {self.device.type} for this {dist.get_backend(self.group)} group, "
                             f"got {t.device}")

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _checks_on(self, always: bool = False) -> bool:
        """Whether this call exchanges its header (see ``peer_checks``)."""
        return (always or self.peer_checks or checks_enabled()) and not self._capturing()

    def _fail(self, op: str, error: BaseException, always: bool = False):
        """Raise a local error; first tell the peers through the header exchange when they expect one."""
        try:
            if self._checks_on(always):
                exchange_header(self.group, self.device, Header(op, []), error=error, timeout_s=self._timeout_s)
            raise error
        finally:
            error = None  # no frame -> exception -> traceback -> frame cycle holding the buffer (exchange_header's)

    def _agree(self, header: Header, always: bool = False, extra: Optional[torch.Tensor] = None):
        """The header exchange of a call whose local checks passed (see ``peer_checks``): the host table, or None
        when this call exchanges none."""
        if not self._checks_on(always):
            return None
        with self._phase("notify"):
            return exchange_header(self.group, self.device, header, extra=extra, timeout_s=self._timeout_s)

    def _arange_base(self, capacity: int) -> torch.Tensor:
        key = ("base", capacity)
        t = self._cache.get(key)
        if t is None:
            t = torch.arange(self.group_size, dtype=torch.int32, device=self.device) * capacity
            self._cache[key] = t
        return t

    def _check_x(self, x, name: str = "x", strict_sf: bool = True):
        """Local checks of a dispatch payload: ``(data, sf, sf_1d)``.  ``strict_sf``: float32 scales must be one per
        128 channels (``(T, ceil(H/128))`` or ``(T,)``), int32 ones packed UE8M0 of those (``(T, ceil(H/512))``);
        else any number of 4-byte packs (DeepEP v2's opaque scale packs)."""
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise TypeError(f"{name} must be a bf16 tensor or an (fp8 data, scales) tuple, got a "
                                f"{type(x).__name__} of length {len(x)}")
            data, sf = x
            check_tensor(f"{name}[0]", data, dtypes=(torch.float8_e4m3fn,), ndim=2)
            check_tensor(f"{name}[1]", sf, dtypes=(torch.float32, torch.int32), ndim=(1, 2) if strict_sf else 2)
            self._check_device(f"{name}[1]", sf)
            if sf.shape[0] != data.shape[0]:
                raise ValueError(f"{name}[1] (scales) must have {data.shape[0]} rows, got shape {tuple(sf.shape)}")
            sf_1d = sf.dim() == 1
            if sf_1d:
                if sf.dtype != torch.float32:
                    raise ValueError(f"{name}[1] (scales) of one scale per token must be float32, got {sf.dtype}")
                sf = sf[:, None]
            elif strict_sf:
                groups = ceil_div(data.shape[1], 128)
                want = groups if sf.dtype == torch.float32 else ceil_div(groups, 4)
                kind = "float32 scales, one per 128 channels" if sf.dtype == torch.float32 else \
                    "int32 scales, 4 packed UE8M0 exponents of 128 channels each"
                if sf.shape[1] != want:
                    raise ValueError(f"{name}[1] must be ({data.shape[0]}, {want}) ({kind}, for hidden "
                                     f"{data.shape[1]}) or a float32 ({data.shape[0]},) per-token scale, got shape "
                                     f"{tuple(sf.shape)}")
            elif sf.shape[1] < 1:
                raise ValueError(f"{name}[1] (scales) must have at least one 4-byte pack per token, got shape "
                                 f"{tuple(sf.shape)}")
        else:
            data, sf, sf_1d = x, None, False
            check_tensor(name, data, dtypes=(torch.bfloat16,), ndim=2)
        self._check_device(name, data)
        check_inner_contiguous(name if sf is None else f"{name}[0]", data)
        return data, sf, sf_1d

    def _dispatch_fields(self, mode, data, sf, num_topk, has_w, num_experts, capacity, max_tokens):
        return [("mode", mode, True), ("hidden", data.shape[1], True), ("x dtype", _DTYPES.get(data.dtype, 0), True),
                ("scale words", 0 if sf is None else sf.shape[1], True),
                ("scale dtype", 0 if sf is None else _DTYPES.get(sf.dtype, 0), True), ("num_topk", num_topk, True),
                ("topk_weights given", int(has_w), True), ("num_experts", num_experts, True),
                ("capacity", capacity, True), ("num_max_tokens_per_rank", max_tokens, True),
                ("num_tokens", data.shape[0], False)]

    def _exchange(self, send: torch.Tensor, recv_counts: Optional[List[int]] = None,
                  send_counts: Optional[List[int]] = None) -> torch.Tensor:
        """All-to-all of ``send``'s row blocks (``send_counts[r]`` rows to rank ``r``, ``recv_counts[r]`` from it;
        None: equal blocks) into a new contiguous tensor of ``send``'s dtype and row width."""
        rows = send.shape[0] if recv_counts is None else sum(recv_counts)
        recv = torch.empty((rows,) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        a2a_rows(recv, send, recv_counts, send_counts, self.group)
        return recv

    # ----------------------------------------------------------------------------------------------------------
    # layout
    # ----------------------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Layout of a dispatch (no collective, no host sync).

        Args:
            topk_idx: int64 / int32 ``(T, k)``, ``-1`` = unused slot.
            num_experts: ``E``, divisible by the group size.

        Returns:
            ``(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event)``:
            int32 ``(R,)`` (deduplicated per rank), int32 ``(num_rdma_ranks,)`` (deduplicated per host: the
            ranks of one host form DeepEP's NVLink domain), int32 ``(E,)``, bool ``(T, R)``, EventOverlap.
        """
        self._alive()
        check_layout_args(topk_idx, num_experts, self.group_size)
        self._check_device("topk_idx", topk_idx)
        ctx = self._ctx(previous_event, async_finish, allocate_on_comm_stream)
        with ctx.run(keep=(topk_idx,)):
            with self._phase("layout"):
                per_rank, per_expert, is_in, slot, bad = dispatch_layout(topk_idx, num_experts, self.group_size)
                nvl = self.num_nvl_ranks
                per_rdma = is_in.view(is_in.shape[0], self.num_rdma_ranks, nvl).any(2).sum(0, dtype=torch.int32)
        ctx.own(per_rank, per_rdma, per_expert, is_in)
        ver = _version(topk_idx)
        self._last_layout = None if ver is None else (topk_idx, ver, num_experts, is_in, per_rank, per_expert, slot,
                                                      bad)
        return per_rank, per_rdma, per_expert, is_in, ctx.event

    def _layout_for(self, topk_idx, num_experts, is_token_in_rank):
        last = self._last_layout
        if (last is not None and topk_idx is last[0] and _version(topk_idx) == last[1] and num_experts == last[2]
                and (is_token_in_rank is None or is_token_in_rank is last[3])):
            return last[4], last[5], last[3], last[6], last[7]
        with self._phase("layout"):
            return dispatch_layout(topk_idx, num_experts, self.group_size)

    # ----------------------------------------------------------------------------------------------------------
    # high-throughput dispatch
    # ----------------------------------------------------------------------------------------------------------
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[DispatchHandle] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 num_experts: Optional[int] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, use_fp8: bool = False,
                 round_scale: bool = False, use_ue8m0: bool = False):
        """Send each token once to every rank that owns one of its experts (see :mod:`tritile.ep`).

        Args:
            x: bfloat16 ``(T, H)`` (unit inner stride), or ``(fp8 float8_e4m3fn (T, H), scales)`` with scales
                float32 ``(T, ceil(H/128))`` (one per 128 channels), int32 ``(T, ceil(H/512))`` (packed UE8M0) or
                float32 ``(T,)``; scales may have any strides.
            handle: the handle of an earlier dispatch: cached dispatch (same routing, no layout, no host sync);
                ``topk_idx`` / ``topk_weights`` / layout tensors must then be None.
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from :meth:`get_dispatch_layout`
                (optional: recomputed from ``topk_idx`` unless they are that call's outputs for this same
                ``topk_idx``).  ``num_tokens_per_rdma_rank``, ``config``: ignored.
            topk_idx: int64 / int32 ``(T, k)``, ``-1`` = unused; required without a handle unless
                ``is_token_in_rank`` is given (a dispatch without top-k).
            topk_weights: float32 ``(T, k)`` or None.
            expert_alignment: ``a >= 1``: reported per-expert counts are rounded up to multiples of ``a``; in
                expand mode every expert segment starts at a multiple of ``a``.
            num_worst_tokens: ``> 0``: sync-free fixed-capacity mode: every row output has exactly this many rows
                (padding rows: ids ``-1``, weights 0, zero data), the per-expert list is ``[]``.  Capacity
                ``M = num_max_tokens_per_rank`` of the Buffer, else ``num_worst_tokens // R``; needs ``T <= M``
                and ``num_worst_tokens >= R * M``.
            previous_event, async_finish, allocate_on_comm_stream: the async model (:class:`EventOverlap`).
            num_experts: ``E`` (default: ``num_tokens_per_expert.numel()``).
            do_expand: one row per (token, local expert), experts in contiguous ``a``-aligned segments.
            do_zero_padding: accepted; padding rows of expand mode are always zero.
            use_tma_aligned_col_major_sf: return the received scales column-major (strides ``(1, align(N, 4))``).
            cumulative_local_expert_recv_stats: int32 ``(L,)``, incremented by the unaligned per-expert counts.
            use_fp8, round_scale, use_ue8m0: with a bfloat16 ``x``, cast it first to e4m3 with per-128 scales
                (``tritile.quant.per_token_cast``, a separate launch), power-of-two scales, packed UE8M0.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:
            ``recv_x`` ``(N, H)`` (expand: ``(N_exp, H)``; a tuple with scales for FP8), rows ordered by source
            rank then source token; ``recv_topk_idx`` int64 ``(N, k)`` local expert ids, ``-1`` elsewhere (None in
            expand mode or without top-k); ``recv_topk_weights`` float32 ``(N, k)`` zero at ``-1`` slots (expand:
            ``(N_exp,)``, one weight per row; None without weights); ``list[L]`` aligned counts; the
            :class:`DispatchHandle` (indexable as DeepEP's handle tuple); an :class:`EventOverlap`.
        """
        always = handle is None and not (_is_int(num_worst_tokens) and num_worst_tokens > 0)
        try:
            self._alive()
            if use_fp8:
                if isinstance(x, (tuple, list)):
                    raise ValueError("use_fp8=True needs a bfloat16 x, got an (fp8, scales) tuple")
                check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
                self._check_device("x", x)
            else:
                self._check_x(x)
            if not _is_int(expert_alignment) or expert_alignment < 1:
                raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
            if not _is_int(num_worst_tokens) or num_worst_tokens < 0:
                raise ValueError(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
            if handle is not None:
                if not isinstance(handle, DispatchHandle):
                    raise TypeError(f"handle must be the handle of Buffer.dispatch, got {type(handle).__name__}")
                for nm, v in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                              ("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                              ("num_tokens_per_expert", num_tokens_per_expert)):
                    if v is not None:
                        raise ValueError(f"{nm} must be None with a handle (cached dispatch), got a tensor")
                data0 = x if not isinstance(x, (tuple, list)) else x[0]
                self._check_cached(data0, handle)
            else:
                num_experts = self._check_uncached(x, topk_idx, topk_weights, is_token_in_rank,
                                                   num_tokens_per_expert, num_experts, do_expand,
                                                   cumulative_local_expert_recv_stats)
                capacity = self._capacity_for(x, num_worst_tokens)
        except _ERRORS as e:
            self._fail("dispatch", e, always)
        if use_fp8:
            x = _cast_e4m3(x, bool(round_scale or use_ue8m0), bool(use_ue8m0))
        data, sf, sf_1d = self._check_x(x)
        if handle is not None:
            hdr = Header("dispatch", self._dispatch_fields(_MODE_CACHED, data, sf, handle.num_topk, False,
                                                           handle.num_experts, handle.capacity,
                                                           handle.num_max_tokens_per_rank), _NAMES)
            ctx = self._ctx(previous_event, async_finish, allocate_on_comm_stream)
            with ctx.run(keep=(data, sf)):
                self._agree(hdr)
                recv_x, recv_idx, _ = self._cached_core(data, sf, sf_1d, handle, use_tma_aligned_col_major_sf)
            ctx.own(recv_x)
            return recv_x, recv_idx, None, list(handle.num_recv_tokens_per_expert_list), handle, ctx.event
        ctx = self._ctx(previous_event, async_finish, allocate_on_comm_stream)
        with ctx.run(keep=(data, sf, topk_idx, topk_weights)):
            outs = self._dispatch_core(data, sf, sf_1d, topk_idx, topk_weights, is_token_in_rank,
                                       num_tokens_per_expert, num_experts, expert_alignment, capacity,
                                       num_worst_tokens, do_expand, use_tma_aligned_col_major_sf,
                                       cumulative_local_expert_recv_stats, self.num_max_tokens_per_rank)
        ctx.own(outs[0], outs[1], outs[2])
        return (*outs, ctx.event)

    def _check_cached(self, data: torch.Tensor, h: DispatchHandle) -> None:
        if data.shape[0] != h.num_tokens:
            raise ValueError(f"x must have the handle's {h.num_tokens} tokens, got {data.shape[0]}")
        if h.num_ranks != self.group_size or h.rank != self.rank:
            raise ValueError("handle comes from a buffer of another group")

    def _check_uncached(self, x, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, num_experts,
                        do_expand, stats) -> int:
        num_tokens = (x[0] if isinstance(x, (tuple, list)) else x).shape[0]
        if num_experts is None:
            if num_tokens_per_expert is None:
                raise ValueError("num_experts is required (or num_tokens_per_expert from get_dispatch_layout)")
            num_experts = num_tokens_per_expert.numel()
        if topk_idx is None:
            if is_token_in_rank is None:
                raise ValueError("topk_idx (or is_token_in_rank for a dispatch without top-k) is required "
                                 "without a handle")
            if topk_weights is not None:
                raise ValueError("topk_weights needs topk_idx")
            if do_expand:
                raise ValueError("do_expand=True needs topk_idx")
            check_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), ndim=2)
            self._check_device("is_token_in_rank", is_token_in_rank)
            if tuple(is_token_in_rank.shape) != (num_tokens, self.group_size):
                raise ValueError(f"is_token_in_rank must have shape {(num_tokens, self.group_size)}, "
                                 f"got {tuple(is_token_in_rank.shape)}")
            if num_tokens_per_expert is not None:
                check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtypes=(torch.int32, torch.int64),
                             ndim=1)
                if num_tokens_per_expert.numel() != num_experts:
                    raise ValueError(f"num_tokens_per_expert must have {num_experts} elements, got "
                                     f"{num_tokens_per_expert.numel()}")
        else:
            check_layout_args(topk_idx, num_experts, self.group_size)
            self._check_device("topk_idx", topk_idx)
            if topk_idx.shape[0] != num_tokens:
                raise ValueError(f"topk_idx must have {num_tokens} rows (x's tokens), got shape "
                                 f"{tuple(topk_idx.shape)}")
        if not _is_int(num_experts) or num_experts < 1 or num_experts % self.group_size:
            raise ValueError(f"num_experts must be a positive multiple of the group size {self.group_size}, "
                             f"got {num_experts!r}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
            self._check_device("topk_weights", topk_weights)
            if tuple(topk_weights.shape) != tuple(topk_idx.shape):
                raise ValueError(f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got "
                                 f"{tuple(topk_weights.shape)}")
        _check_recv_stats(stats, num_experts // self.group_size)
        return num_experts

    def _capacity_for(self, x, num_worst_tokens: int) -> int:
        if not num_worst_tokens:
            return 0
        num_tokens = (x[0] if isinstance(x, (tuple, list)) else x).shape[0]
        capacity = self.num_max_tokens_per_rank or num_worst_tokens // self.group_size
        if num_tokens > capacity:
            raise ValueError(f"x has {num_tokens} tokens, more than the fixed capacity {capacity} per rank "
                             f"(num_max_tokens_per_rank, or num_worst_tokens // group size)")
        if num_worst_tokens < self.group_size * capacity:
            raise ValueError(f"num_worst_tokens must be >= group size * capacity = "
                             f"{self.group_size * capacity}, got {num_worst_tokens}")
        return capacity

    def _dispatch_core(self, data, sf, sf_1d, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                       num_experts, alignment, capacity, num_worst, do_expand, col_major_sf, stats, max_tokens):
        """Uncached dispatch after the local checks.  ``capacity`` > 0: fixed-capacity (sync-free unless the
        header is exchanged) with ``num_worst`` output rows.  ``max_tokens``: ``M`` of the source global ids (0:
        the largest ``T`` over the ranks, or the capacity).  The header is exchanged always without a capacity
        (the host needs the counts anyway), else only when :meth:`_checks_on`."""
        R, me, dev = self.group_size, self.rank, self.device
        per = num_experts // R
        num_tokens = data.shape[0]
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        if topk_idx is not None:
            per_rank, per_expert, is_in, slot, bad = self._layout_for(topk_idx, num_experts, is_token_in_rank)
        else:
            is_in = is_token_in_rank
            slot = torch.where(is_in, is_in.to(torch.int32).cumsum(0, dtype=torch.int32) - 1, -1).to(torch.int32)
            per_rank = is_in.sum(0, dtype=torch.int32)
            per_expert = (num_tokens_per_expert.to(torch.int32) if num_tokens_per_expert is not None else
                          torch.zeros((num_experts,), dtype=torch.int32, device=dev))
            bad = torch.zeros((1,), dtype=torch.int32, device=dev)
        fields = self._dispatch_fields(_MODE_CAPACITY if capacity else _MODE_PLAIN, data, sf, num_topk,
                                       topk_weights is not None, num_experts, capacity, max_tokens)
        host = None
        with self._phase("notify"):
            if not capacity or self._checks_on():
                counts = torch.cat([per_rank, bad]).cpu()
                hdr = Header("dispatch", fields + [("bad ids", int(counts[R]), False)], _NAMES)
                host = exchange_header(self.group, dev, hdr, extra=counts[:R], timeout_s=self._timeout_s)
                nbad = host[:, 3 + len(hdr.fields) - 1].tolist()
                if any(nbad):
                    raise ValueError("topk_idx must hold expert ids in [-1, num_experts): rank(s) "
                                     + ", ".join(f"{r} ({n} bad id(s))" for r, n in enumerate(nbad) if n)
                                     + " passed ids outside")
            if capacity:
                # per-rank counts (every rank's row) and my counts of the destination's experts, on the device
                table = torch.cat([per_rank.view(1, R).expand(R, R), per_expert.view(R, per)], dim=1)
                recv_table = self._exchange(table.contiguous())
                counts_dev = recv_table[:, :R]
                recv_pe = recv_table[:, R:]
                counts_host = None
            else:
                counts_host = host[:, HEADER_WORDS:HEADER_WORDS + R].tolist()
                counts_dev = None
                recv_pe = self._exchange(per_expert.view(R, per).contiguous())
                pe_host, pe_event = _start_d2h(recv_pe)
        if stats is not None:
            stats.add_(recv_pe.sum(0, dtype=torch.int32))
        x_words = as_words(data)
        sf_words = None if sf is None else (sf.view(torch.int32) if sf.dtype == torch.float32 else sf)
        sw = 0 if sf is None else sf.shape[1]
        has_w = topk_weights is not None
        if capacity:
            M = capacity
            base = self._arange_base(M)
            recv_counts_t = counts_dev[:, me]
            with self._phase("pack"):
                send_x = pack_rows(x_words, slot, base, R * M)
                send_meta = pack_meta(topk_idx, topk_weights, sf_words, slot, base, R * M, per, num_topk)
            with self._phase("exchange"):
                stage_x = self._exchange(send_x)
                stage_meta = self._exchange(send_meta)
            with self._phase("unpack"):
                incl = recv_counts_t.cumsum(0, dtype=torch.int32)
                excl = incl - recv_counts_t
                o = torch.arange(num_worst, dtype=torch.int32, device=dev)
                s = torch.searchsorted(incl, o, right=True).clamp_(max=R - 1)
                row_map = torch.where(o < incl[-1], s * M + (o - excl[s]), -1).to(torch.int32)
                j = torch.arange(R * M, dtype=torch.int32, device=dev)
                js, ji = j // M, j % M
                send_row_map = torch.where(ji < recv_counts_t[js], excl[js] + ji, -1).to(torch.int32)
                recv_xw = gather_rows(stage_x, row_map)
                r_idx, r_w, r_src, r_sf = unpack_meta(stage_meta, row_map, num_topk, topk_idx is not None, has_w, sw)
            n_rows, n_recv, send_counts, recv_counts = num_worst, None, None, None
            src_rank = torch.where(o < incl[-1], s, -1).to(torch.int32)
            mt = max_tokens or M
            lazy = dict(src_rank=src_rank, recv_counts_t=recv_counts_t)
        else:
            recv_counts = [row[me] for row in counts_host]
            # row r of the header table came from rank r and carries r's per-rank counts: my sends are row `me`
            send_counts = list(counts_host[me])
            n_recv = sum(recv_counts)
            s_total = sum(send_counts)
            excl, acc = [], 0
            for c in send_counts:
                excl.append(acc)
                acc += c
            base = torch.tensor(excl, dtype=torch.int32, device="cpu").to(dev, non_blocking=True)
            with self._phase("pack"):
                send_x = pack_rows(x_words, slot, base, s_total)
                send_meta = pack_meta(topk_idx, topk_weights, sf_words, slot, base, s_total, per, num_topk)
            with self._phase("exchange"):
                recv_xw = self._exchange(send_x, recv_counts, send_counts)
                recv_meta = self._exchange(send_meta, recv_counts, send_counts)
            with self._phase("unpack"):
                r_idx, r_w, r_src, r_sf = unpack_meta(recv_meta, None, num_topk, topk_idx is not None, has_w, sw)
            n_rows, row_map, send_row_map, M = n_recv, None, None, 0
            tcol = [n for n, _, _ in fields].index("num_tokens")
            mt = max_tokens or int(host[:, 3 + tcol].max())
            lazy = {}
        recv_data = recv_xw.view(data.dtype).reshape(n_rows, data.shape[1])
        recv_sf = None
        if sf is not None:
            recv_sf = r_sf.view(sf.dtype) if sf.dtype == torch.float32 else r_sf
        recv_idx = r_idx if topk_idx is not None else None
        recv_w = r_w if has_w else None
        # per-expert counts
        if capacity:
            lst = []
        else:
            unaligned = _finish_d2h(pe_host, pe_event).sum(0).tolist()
            lst = [align(int(c), alignment) for c in unaligned]
        token_topk_to_pos = pos_to_token_topk = pos_to_expert = None
        n_exp = 0
        if do_expand:
            with self._phase("expand"):
                if capacity:
                    n_exp = align(n_rows * min(num_topk, per) + (alignment - 1) * per, alignment)
                else:
                    n_exp = sum(lst)
                (recv_data, recv_sf, recv_w, token_topk_to_pos, pos_to_token_topk, pos_to_expert,
                 lazy["psum"]) = self._expand(recv_data, recv_sf, recv_idx, r_w if has_w else None, per, alignment,
                                              n_exp)
            recv_idx_out = None
        else:
            recv_idx_out = recv_idx
        if recv_sf is not None:
            if col_major_sf:
                recv_sf = _col_major(recv_sf)
            if sf_1d:
                recv_sf = recv_sf[:, 0]
        self._layout_counter += 1
        h = DispatchHandle(
            num_experts=num_experts, expert_alignment=alignment, num_ranks=R, rank=me, num_tokens=num_tokens,
            num_topk=num_topk, num_max_tokens_per_rank=mt, is_token_in_rank=is_in, send_slot=slot, send_base=base,
            send_counts=send_counts, recv_counts=recv_counts, counts_host=counts_host, counts_dev=counts_dev,
            send_counts_t=per_rank, recv_expert_counts=recv_pe, num_recv_tokens=n_recv, num_recv_rows=n_rows,
            recv_src_idx=r_src, recv_topk_idx=recv_idx, num_recv_tokens_per_expert_list=lst,
            do_expand=do_expand, token_topk_to_pos=token_topk_to_pos, pos_to_token_topk=pos_to_token_topk,
            pos_to_expert=pos_to_expert, num_expanded_tokens=n_exp, capacity=M, recv_row_map=row_map,
            send_row_map=send_row_map, layout_id=self._layout_counter,
            extra=dict(lazy, hidden=data.shape[1], x_dtype=data.dtype))
        recv_x = recv_data if sf is None else (recv_data, recv_sf)
        return recv_x, recv_idx_out, recv_w, lst, h

    def _expand(self, recv_data, recv_sf, recv_idx, recv_w, per, alignment, n_exp):
        """Per-expert aligned segments (``tritile.moe.get_fused_mapping`` + ``expand_to_fused``, or their twins
        for CPU tensors without the Triton interpreter)."""
        dev = recv_data.device
        n, k = recv_idx.shape
        if n_exp == 0 or n == 0:
            ttp = torch.full((n, k), -1, dtype=torch.int32, device=dev)
            p2tt = torch.full((n_exp,), -1, dtype=torch.int32, device=dev)
            psum = torch.zeros((per,), dtype=torch.int32, device=dev)
            data = torch.zeros((n_exp, recv_data.shape[1]), dtype=recv_data.dtype, device=dev)
            sf = None if recv_sf is None else torch.zeros((n_exp, recv_sf.shape[1]), dtype=recv_sf.dtype, device=dev)
            w = None if recv_w is None else torch.zeros((n_exp,), dtype=torch.float32, device=dev)
            return data, sf, w, ttp, p2tt, p2tt, psum
        if kernel_device_ok(dev):
            from ..moe import get_fused_mapping

            p2e, _, p2tt, ttp, start, _, _, _ = get_fused_mapping(recv_idx.contiguous(), per, n_exp, alignment)
        else:
            from .ref import fused_mapping_ref

            p2e, p2tt, ttp, start = fused_mapping_ref(recv_idx, per, n_exp, alignment)
        data = _expand_rows(recv_data, ttp, p2e)
        sf = None if recv_sf is None else _expand_rows(recv_sf, ttp, p2e)
        w = None if recv_w is None else _expand_weights(recv_w, p2tt)
        # psum: aligned start + real count (v2 expand convention)
        real = (recv_idx[:, :, None] == torch.arange(per, device=dev)).any(1).sum(0, dtype=torch.int32)
        psum = (start + real).to(torch.int32)
        return data, sf, w, ttp, p2tt, p2e, psum

    def _cached_core(self, data, sf, sf_1d, h: DispatchHandle, col_major_sf, topk_idx=None, topk_weights=None):
        """Cached dispatch after the checks: ``(recv_x, recv_topk_idx, recv_topk_weights)``.  With
        ``topk_weights`` (and the dispatch's ``topk_idx``) the weights travel too (v2's cached dispatch)."""
        R = self.group_size
        per = h.num_experts // R
        x_words = as_words(data)
        sf_words = None if sf is None else (sf.view(torch.int32) if sf.dtype == torch.float32 else sf)
        sw = 0 if sf is None else sf.shape[1]
        has_w = topk_weights is not None
        meta_needed = sf is not None or has_w
        k = h.num_topk if has_w else 0

        def pack(rows):
            with self._phase("pack"):
                send_x = pack_rows(x_words, h.send_slot, h.send_base, rows)
                send_m = None
                if meta_needed:
                    send_m = pack_meta(topk_idx if has_w else None, topk_weights, sf_words, h.send_slot, h.send_base,
                                       rows, per, k)
            return send_x, send_m

        r_w = None
        if h.capacity:
            M = h.capacity
            send_x, send_m = pack(R * M)
            with self._phase("exchange"):
                stage_x = self._exchange(send_x)
                stage_m = None if send_m is None else self._exchange(send_m)
            with self._phase("unpack"):
                recv_xw = gather_rows(stage_x, h.recv_row_map)
                r_sf = None
                if stage_m is not None:
                    _, r_w, _, r_sf = unpack_meta(stage_m, h.recv_row_map, k, has_w, has_w, sw)
        else:
            send_x, send_m = pack(sum(h.send_counts))
            with self._phase("exchange"):
                recv_xw = self._exchange(send_x, h.recv_counts, h.send_counts)
                r_sf = None
                if send_m is not None:
                    recv_m = self._exchange(send_m, h.recv_counts, h.send_counts)
                    with self._phase("unpack"):
                        _, r_w, _, r_sf = unpack_meta(recv_m, None, k, has_w, has_w, sw)
        recv_data = recv_xw.view(data.dtype).reshape(h.num_recv_rows, data.shape[1])
        recv_sf = None if sf is None else (r_sf.view(sf.dtype) if sf.dtype == torch.float32 else r_sf)
        if not has_w:
            r_w = None
        if h.do_expand:
            with self._phase("expand"):
                if h.num_expanded_tokens == 0 or h.num_recv_rows == 0:
                    recv_data = recv_data.new_zeros((h.num_expanded_tokens, data.shape[1]))
                    recv_sf = None if recv_sf is None else recv_sf.new_zeros((h.num_expanded_tokens,
                                                                              recv_sf.shape[1]))
                    r_w = None if r_w is None else torch.zeros((h.num_expanded_tokens,), dtype=torch.float32,
                                                               device=data.device)
                else:
                    recv_data = _expand_rows(recv_data, h.token_topk_to_pos, h.pos_to_expert)
                    if recv_sf is not None:
                        recv_sf = _expand_rows(recv_sf, h.token_topk_to_pos, h.pos_to_expert)
                    if r_w is not None:
                        r_w = _expand_weights(r_w, h.pos_to_token_topk)
        if recv_sf is not None:
            if col_major_sf:
                recv_sf = _col_major(recv_sf)
            if sf_1d:
                recv_sf = recv_sf[:, 0]
        recv_x = recv_data if sf is None else (recv_data, recv_sf)
        recv_idx = None if h.do_expand else h.recv_topk_idx
        return recv_x, recv_idx, r_w

    # ----------------------------------------------------------------------------------------------------------
    # high-throughput combine
    # ----------------------------------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send rows back to their source ranks and sum them per token (unweighted), plus biases.

        Args:
            x: bfloat16 ``(N, H)`` in the dispatch receive order (expand mode: ``(N_exp, H)``; each token's rows
                are first summed in top-k slot order in float32 and rounded to bf16 once), contiguous.
            handle: the handle of the dispatch.
            topk_weights: float32 ``(N, k)`` or None: sent back and summed the same way.
            bias: None, a bfloat16 ``(T, H)`` tensor, or a pair ``(bias0, bias1)`` (either may be None).
            config: ignored.  previous_event, async_finish, allocate_on_comm_stream: the async model.

        Returns:
            ``(combined_x, combined_topk_weights, event)``: bfloat16 ``(T, H)`` =
            ``bf16(f32(0 + bias0 + bias1) + rows of the destination ranks in ascending rank order)``, float32
            ``(T, k)`` (None without ``topk_weights``), :class:`EventOverlap`.
        """
        try:
            self._alive()
            b0, b1 = self._check_combine(x, handle, topk_weights, bias)
        except _ERRORS as e:
            self._fail("combine", e)
        hdr = Header("combine", self._combine_fields(x, handle, topk_weights), _NAMES)
        ctx = self._ctx(previous_event, async_finish, allocate_on_comm_stream)
        with ctx.run(keep=(x, topk_weights, b0, b1)):
            self._agree(hdr)
            out, wout = self._combine_core(x, handle, topk_weights, b0, b1)
        ctx.own(out, wout)
        return out, wout, ctx.event

    def _combine_fields(self, x, h: DispatchHandle, topk_weights):
        return [("hidden", x.shape[1], True), ("num_topk", h.num_topk, True),
                ("topk_weights given", int(topk_weights is not None), True), ("num_experts", h.num_experts, True),
                ("capacity", h.capacity, True), ("expand", int(h.do_expand), False)]

    def _check_combine(self, x, handle, topk_weights, bias, weights_shape=None):
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the handle of Buffer.dispatch, got {type(handle).__name__}")
        if handle.num_ranks != self.group_size or handle.rank != self.rank:
            raise ValueError("handle comes from a buffer of another group")
        check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
        self._check_device("x", x)
        if not x.is_contiguous():
            raise ValueError(f"x must be contiguous, got strides {tuple(x.stride())} for shape {tuple(x.shape)}")
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_rows
        if x.shape[0] != rows:
            raise ValueError(f"x must have {rows} rows (the handle's {'expanded ' if handle.do_expand else ''}"
                             f"receive rows), got {x.shape[0]}")
        b0, b1 = _unpack_bias(bias)
        for nm, b in (("bias[0]", b0), ("bias[1]", b1)):
            if b is not None:
                check_tensor(nm, b, dtypes=(torch.bfloat16,), ndim=2)
                self._check_device(nm, b)
                if tuple(b.shape) != (handle.num_tokens, x.shape[1]):
                    raise ValueError(f"{nm} must have shape {(handle.num_tokens, x.shape[1])}, got {tuple(b.shape)}")
                check_inner_contiguous(nm, b)
        if topk_weights is not None:
            want = weights_shape or (handle.num_recv_rows, handle.num_topk)
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=len(want))
            self._check_device("topk_weights", topk_weights)
            if tuple(topk_weights.shape) != tuple(want):
                raise ValueError(f"topk_weights must have shape {tuple(want)}, got {tuple(topk_weights.shape)}")
        return b0, b1

    def _combine_core(self, x, h: DispatchHandle, topk_weights, b0, b1, row_table: Optional[torch.Tensor] = None):
        """Combine after the checks.  ``row_table`` int32 ``(T, R)``: per token, the rows of ``back`` to add in
        column order (``-1`` = none), replacing the ascending-rank order of ``send_slot``."""
        R, dev = self.group_size, self.device
        if h.do_expand:
            with self._phase("prereduce"):
                if h.num_recv_rows == 0 or x.shape[0] == 0:
                    x = torch.zeros((h.num_recv_rows, x.shape[1]), dtype=torch.bfloat16, device=dev)
                else:
                    x = _reduce_fused(x, None, h.token_topk_to_pos)
        hidden = x.shape[1]
        w32 = None if topk_weights is None else topk_weights.contiguous()
        if h.capacity:
            M = h.capacity
            with self._phase("pack"):
                send_x = gather_rows(as_words(x), h.send_row_map)
                send_w = None if w32 is None else gather_rows(w32.view(torch.int32), h.send_row_map)
            with self._phase("exchange"):
                back = self._exchange(send_x)
                wback = None if send_w is None else self._exchange(send_w)
            back = back.view(torch.bfloat16).reshape(R * M, hidden)
        else:
            with self._phase("exchange"):
                back = self._exchange(x, h.send_counts, h.recv_counts)
                wback = None if w32 is None else self._exchange(w32, h.send_counts, h.recv_counts)
        with self._phase("reduce"):
            if row_table is None:
                slot, base = h.send_slot, h.send_base
            else:
                slot, base = row_table, self._zeros_int32(R)
            out, wout = combine_reduce(back, slot, base, b0, b1, None if wback is None else wback.view(torch.float32))
        return out, wout

    def _zeros_int32(self, n: int) -> torch.Tensor:
        key = ("zeros", n)
        z = self._cache.get(key)
        if z is None:
            z = torch.zeros((n,), dtype=torch.int32, device=self.device)
            self._cache[key] = z
        return z

    def _scratch(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, capturing: bool) -> torch.Tensor:
        """An internal buffer of the low-latency path, reused across calls: two sets alternate per call (a call's
        buffers stay untouched until the call after next, so one exchange may wait behind its hook while the next
        call runs); fresh during CUDA-graph capture (``capturing``: a graph keeps its own)."""
        if capturing:
            return torch.empty(shape, dtype=dtype, device=self.device)
        key = (name, self._ll_parity.get(name[:2], 0), shape, dtype)
        t = self._cache.get(key)
        if t is None:
            self._drop_scratch(name)
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._cache[key] = t
        return t

    def _drop_scratch(self, name: str) -> None:
        """Free the other shapes' buffers of ``name`` at this parity (a new shape replaces them)."""
        parity = self._ll_parity.get(name[:2], 0)
        for key in [k for k in self._cache if len(k) == 4 and k[0] == name and k[1] == parity]:
            del self._cache[key]

    def _ll_exchange(self, name: str, send: torch.Tensor, async_op: bool, capturing: bool):
        """The equal-split exchange of a low-latency staging buffer: ``(received, work)``.  In a one-rank group the
        received rows are the sent ones (no copy, no collective)."""
        if self.group_size == 1:
            return send, None
        stage = self._scratch(name, tuple(send.shape), send.dtype, capturing)
        return stage, a2a_rows(stage, send, None, None, self.group, async_op=async_op)

    def _ll_next(self, kind: str) -> None:
        self._ll_parity[kind] = 1 - self._ll_parity.get(kind, 0)

    # ----------------------------------------------------------------------------------------------------------
    # DeepEP's internode entry points: the same engine
    # ----------------------------------------------------------------------------------------------------------
    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config: Optional[Config] = None, previous_event=None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """:meth:`dispatch` (one exchange level reaches every rank, on or across hosts)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None,
                          previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """:meth:`combine` (one exchange level reaches every rank, on or across hosts)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # ----------------------------------------------------------------------------------------------------------
    # low-latency (fixed capacity, sync-free, graph-capturable)
    # ----------------------------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *, topk_weights: Optional[torch.Tensor] = None):
        """Fixed-capacity dispatch into per-local-expert slabs (no host sync without ``peer_checks``; CUDA-graph
        capturable).

        Each token goes once to each destination rank (deduplicated) inside a block of ``M`` rows per
        (source, destination) pair: one equal-split ``all_to_all_single`` for the rows and one for the metadata.
        The receiver scatters rows into the slabs of the experts they selected, in ascending source rank then
        source token order (:mod:`tritile.ep.ll`).  Not zero-SM: NCCL's kernels run on SMs.

        Args:
            x: bfloat16 ``(T, H)``, ``T <= M``, unit inner stride.
            topk_idx: int64 / int32 ``(T, k)``, ``-1`` = unused (ids outside ``[-1, E)`` are dropped; with
                ``TRITILE_CHECKS=1`` they raise).
            num_max_dispatch_tokens_per_rank: ``M``, the same on every rank.
            num_experts: ``E``, divisible by the group size.
            cumulative_local_expert_recv_stats: int32 ``(L,)`` incremented by ``recv_count``.
            dispatch_wait_recv_cost_stats: not supported (must be None).
            use_fp8, round_scale, use_ue8m0: cast to e4m3 with per-128 scales (``tritile.quant.per_token_cast``),
                power-of-two scales, packed UE8M0 exponents.
            async_finish: the async model.
            return_recv_hook: issue the exchange asynchronously and return; the returned ``hook()`` waits for it
                and places the rows (on the comm stream; the current stream then waits).  ``recv_x``,
                ``recv_count`` and the handle's ``src_info`` / ``layout_range`` are valid after ``hook()``.  An
                "async hook", not DeepEP's zero-SM receive: NCCL kernels occupy SMs while the exchange is in flight.
            topk_weights: float32 ``(T, k)``: sent with the rows, so :meth:`low_latency_combine` may take
                ``topk_weights=None``.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` bfloat16 ``(L, R*M, H)``, or with FP8
            ``(float8_e4m3fn (L, R*M, H), scales)`` with scales float32 ``(L, R*M, ceil(H/128))`` (or int32
            ``(L, R*M, ceil(H/512))`` with ``use_ue8m0``) column-major in the last two dims; only the first
            ``recv_count[e]`` rows of slab ``e`` are valid.  ``recv_count`` int32 ``(L,)``;
            :class:`LowLatencyHandle`; :class:`EventOverlap`; the hook (``return_recv_hook``) or None.
        """
        try:
            self._alive()
            check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
            self._check_device("x", x)
            check_inner_contiguous("x", x)
            check_layout_args(topk_idx, num_experts, self.group_size)
            self._check_device("topk_idx", topk_idx)
            if checks_enabled():  # the data check (a host sync) before the header exchange: every rank raises
                raise_on_bad_ids(topk_idx, num_experts)
            M = num_max_dispatch_tokens_per_rank
            if not _is_int(M) or M < 1:
                raise ValueError(f"num_max_dispatch_tokens_per_rank must be an int >= 1, got {M!r}")
            t, hidden = x.shape
            if t > M:
                raise ValueError(f"x has {t} tokens, more than num_max_dispatch_tokens_per_rank={M}")
            if topk_idx.shape[0] != t:
                raise ValueError(f"topk_idx must have {t} rows, got shape {tuple(topk_idx.shape)}")
            if dispatch_wait_recv_cost_stats is not None:
                raise ValueError("dispatch_wait_recv_cost_stats is not supported by tritile.ep (must be None)")
            k = topk_idx.shape[1]
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
                if tuple(topk_weights.shape) != (t, k):
                    raise ValueError(f"topk_weights must have shape {(t, k)}, got {tuple(topk_weights.shape)}")
            _check_recv_stats(cumulative_local_expert_recv_stats, num_experts // self.group_size)
        except _ERRORS as e:
            self._fail("low_latency_dispatch", e)
        R = self.group_size
        per = num_experts // R
        payload = (2 if use_ue8m0 else 1) if use_fp8 else 0
        sw = (ceil_div(hidden, 512) if use_ue8m0 else ceil_div(hidden, 128)) if use_fp8 else 0
        capturing = self._capturing()
        if self._checks_on():
            self._agree(Header("low_latency_dispatch", [
                ("hidden", hidden, True), ("payload", payload, True), ("num_topk", k, True),
                ("topk_weights given", int(topk_weights is not None), True), ("num_experts", num_experts, True),
                ("num_max_dispatch_tokens_per_rank", M, True), ("num_tokens", t, False)], _NAMES))
        # Without a hook or async_finish the call runs on the caller's stream (nothing to overlap): no stream switch,
        # no events, no allocator bookkeeping
        ctx = self._ctx(None, async_finish, False) if async_finish or return_recv_hook else _INLINE
        masked = self._masked_topk(topk_idx, num_experts)
        route = topk_idx if masked is None else masked
        with ctx.run(keep=(x, topk_idx, topk_weights)):
            self._ll_next("d:")
            with self._phase("pack"):
                # the send slots and the metadata rows in one launch (padding rows marked), then the rows: with FP8
                # cast straight into the send buffer (their scales into the metadata rows), else copied
                width = meta_width(k, True, topk_weights is not None, sw)
                send_meta = self._scratch("d:send_meta", (R * M, width), torch.int32, capturing)
                if use_fp8:
                    send8 = self._scratch("d:send_x8", (R * M, hidden), torch.float8_e4m3fn, capturing)
                    slot = ll_pack(route, topk_weights, x, num_experts, R, M, bool(round_scale or use_ue8m0),
                                   bool(use_ue8m0), send_meta, send8)
                    send_x = as_words(send8.view(torch.uint8))
                    data_dtype = torch.float8_e4m3fn
                else:
                    slot = ll_send_meta(route, topk_weights, num_experts, R, M, send_meta)
                    x_words = as_words(x)
                    send_x = scatter_rows_into(x_words, slot, self._arange_base(M),
                                               self._scratch("d:send_x", (R * M, x_words.shape[1]), x_words.dtype,
                                                             capturing))
                    data_dtype = x.dtype
            with self._phase("exchange"):
                stage_x, work_x = self._ll_exchange("d:stage_x", send_x, return_recv_hook, capturing)
                stage_meta, work_meta = self._ll_exchange("d:stage_meta", send_meta, return_recv_hook, capturing)
            # the outputs exist now; with a hook they are filled when it runs
            slab = empty((per * R * M, send_x.shape[1]), send_x.dtype, self.device)
            recv_data = slab.view(data_dtype).view(per, R * M, hidden)
            recv_x = recv_data
            if use_fp8:
                # DeepEP layout: column-major in the last two dims
                sf_dtype = torch.int32 if use_ue8m0 else torch.float32
                recv_x = (recv_data, empty((per, sw, R * M), sf_dtype, self.device).transpose(1, 2))
            recv_count = empty((per,), torch.int32, self.device)
            ver = _version(topk_weights)
            handle = LowLatencyHandle(
                src_info=None, layout_range=None, num_max_dispatch_tokens_per_rank=M, hidden=hidden,
                num_experts=num_experts, send_slot=slot, pos=None, recv_weights=None, num_tokens=t, num_topk=k,
                weights_src=None if topk_weights is None or ver is None else (topk_weights, ver), topk_idx=masked)
            stats = cumulative_local_expert_recv_stats

            def finish() -> None:
                """Wait for the exchange and place the rows (on the caller's stream, or with a hook or async_finish
                on the comm stream, which the current stream then waits for)."""
                if work_x is not None:
                    work_x.wait()
                    work_meta.wait()
                with self._phase("unpack"):
                    # slab positions, counts and scales from the metadata (one launch), then the rows: received
                    # row -> slab row pos[row, j] for every slot j that selected a local expert
                    pos, src_info, layout_range, r_w = ll_unpack(
                        stage_meta, stage_x, k, topk_weights is not None, sw, per, R, M, recv_count,
                        recv_x[1].view(torch.int32) if use_fp8 else None, self._zeros_int32(k), slab)
                if stats is not None:
                    stats.add_(recv_count)
                handle.src_info, handle.layout_range, handle.pos = src_info, layout_range, pos
                handle.recv_weights = r_w if topk_weights is not None else None

            if not return_recv_hook:
                finish()
        if ctx is _INLINE:
            return recv_x, recv_count, handle, EventOverlap(_NO_EVENT), None
        ctx.own(recv_x, recv_count)
        if not return_recv_hook:
            ctx.own(handle.src_info, handle.layout_range)
            return recv_x, recv_count, handle, ctx.event, None
        done: List[bool] = []

        def hook() -> None:
            if done:
                return
            done.append(True)
            hctx = self._ctx(None, False, False)
            with hctx.run():
                finish()
            hctx.own(handle.src_info, handle.layout_range)

        return recv_x, recv_count, handle, ctx.event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The bfloat16 ``(L, R*M, H)`` buffer that ``low_latency_combine(..., zero_copy=True)`` reads."""
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
        per = handle.num_experts // self.group_size
        shape = (per, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._cache.get(("ll_combine", shape))
        if buf is None:
            buf = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
            self._cache[("ll_combine", shape)] = buf
        return buf

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Weighted combine of the low-latency slabs: ``out[t] = sum over valid slots j of w[t, j] * y(e_j, t)``.

        Each expert rank first sums, per received row, its local slots in slot order (float32 ``fma``, the
        weights sent from the source), rounds to bf16 once and returns one row per (token, rank); the source
        then sums the ranks in ascending order in float32 and rounds once (one more bf16 rounding than DeepEP's
        LL combine).

        Args:
            x: bfloat16 ``(L, R*M, H)`` expert outputs in the dispatch slab layout (ignored with ``zero_copy``:
                the buffer of :meth:`get_next_low_latency_combine_buffer` is read).
            topk_idx: ``(T, k)`` as given to dispatch (only its shape is checked; the routing is the handle's).
            topk_weights: float32 ``(T, k)``, or None to use the weights given to dispatch.  The weights travel to
                the expert ranks in one extra small exchange, skipped when they were given to
                ``low_latency_dispatch`` (None here, or that same, unmodified tensor).
            handle: the :class:`LowLatencyHandle`.
            use_logfmt, combine_wait_recv_cost_stats: not supported (must be False / None).
            out: optional bfloat16 ``(T, H)`` output.

        Returns:
            ``(combined_x, event, hook)``: bfloat16 ``(T, H)``, :class:`EventOverlap`, a no-op callable or None.
        """
        try:
            self._alive()
            if use_logfmt:
                raise ValueError("use_logfmt=True (LogFMT) is not supported by tritile.ep")
            if combine_wait_recv_cost_stats is not None:
                raise ValueError("combine_wait_recv_cost_stats is not supported by tritile.ep (must be None)")
            if not isinstance(handle, LowLatencyHandle):
                raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
            if handle.pos is None:
                raise ValueError("handle comes from a low_latency_dispatch(return_recv_hook=True) whose hook has not "
                                 "run yet: call the hook before combining")
            R, M, hidden = self.group_size, handle.num_max_dispatch_tokens_per_rank, handle.hidden
            per = handle.num_experts // R
            if zero_copy:
                x = self.get_next_low_latency_combine_buffer(handle)
            check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=3)
            if tuple(x.shape) != (per, R * M, hidden) or not x.is_contiguous():
                raise ValueError(f"x must be a contiguous ({per}, {R * M}, {hidden}) tensor, got shape "
                                 f"{tuple(x.shape)}")
            check_tensor("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), ndim=2)
            if tuple(topk_idx.shape) != (handle.num_tokens, handle.num_topk):
                raise ValueError(f"topk_idx must have shape {(handle.num_tokens, handle.num_topk)}, got "
                                 f"{tuple(topk_idx.shape)}")
            if topk_weights is None and handle.recv_weights is None:
                raise ValueError("topk_weights is required unless they were given to low_latency_dispatch")
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
                if tuple(topk_weights.shape) != tuple(topk_idx.shape):
                    raise ValueError(f"topk_weights must have shape {tuple(topk_idx.shape)}, got "
                                     f"{tuple(topk_weights.shape)}")
            if out is not None:
                check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=2)
                if tuple(out.shape) != (handle.num_tokens, hidden):
                    raise ValueError(f"out must have shape {(handle.num_tokens, hidden)}, got {tuple(out.shape)}")
        except _ERRORS as e:
            self._fail("low_latency_combine", e)
        capturing = self._capturing()
        if self._checks_on():
            self._agree(Header("low_latency_combine", [
                ("hidden", hidden, True), ("num_topk", handle.num_topk, True),
                ("topk_weights given", int(topk_weights is not None), True),
                ("num_experts", handle.num_experts, True), ("num_max_dispatch_tokens_per_rank", M, True)], _NAMES))
        ctx = self._ctx(None, async_finish, False) if async_finish else _INLINE
        with ctx.run(keep=(x, topk_idx, topk_weights, out)):
            base = self._arange_base(M)
            same = (handle.weights_src is not None and topk_weights is handle.weights_src[0]
                    and _version(topk_weights) == handle.weights_src[1])
            self._ll_next("c:")
            if topk_weights is not None and not same:
                route = topk_idx if handle.topk_idx is None else handle.topk_idx
                kk = handle.num_topk
                with self._phase("pack"):
                    # rows no token targets stay unwritten: the slab positions of the handle skip them
                    send_w = self._scratch("c:send_w", (R * M, meta_width(kk, True, True, 0)), torch.int32, capturing)
                    pack_meta_into(route, topk_weights, None, handle.send_slot, base, per, kk, send_w)
                with self._phase("exchange"):
                    stage_w, _ = self._ll_exchange("c:stage_w", send_w, False, capturing)
                # the received rows' weight words ([t, ids..., weights...]), read in place by the reduction
                recv_w = stage_w.view(torch.float32)[:, 1 + kk:1 + 2 * kk]
            else:
                recv_w = handle.recv_weights
            with self._phase("prereduce"):
                part = _reduce_fused(x.view(per * R * M, hidden), recv_w, handle.pos)
            with self._phase("exchange"):
                back, _ = self._ll_exchange("c:back", part, False, capturing)
            with self._phase("reduce"):
                res, _ = combine_reduce(back, handle.send_slot, base)
            if out is not None:
                out.copy_(res)
                res = out
        hook = (lambda: None) if return_recv_hook else None
        if ctx is _INLINE:
            return res, EventOverlap(_NO_EVENT), hook
        ctx.own(res)
        return res, ctx.event, hook


def _start_d2h(t: torch.Tensor):
    """Start copying a small device tensor to the host without waiting for later work on the stream: ``(host
    tensor, event)`` for :func:`_finish_d2h`."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


def _finish_d2h(host: torch.Tensor, ev) -> torch.Tensor:
    if ev is not None:
        ev.synchronize()
    return host


def _expand_rows(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """``tritile.moe.expand_to_fused`` (zero rows where no slot lands), or its ``tritile.torch`` twin for CPU
    tensors without the Triton interpreter."""
    if kernel_device_ok(x.device):
        from ..moe import expand_to_fused
    else:
        from ..torch import expand_to_fused
    return expand_to_fused(x, token_topk_to_pos, pos_to_expert)


def _expand_weights(w: torch.Tensor, pos_to_token_topk: torch.Tensor) -> torch.Tensor:
    """float32 ``(N_exp,)``: the weight of each expanded row (``w.flatten()[pos_to_token_topk]``), 0 on padding."""
    flat = w.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(pos_to_token_topk.shape, dtype=torch.float32, device=w.device)
    return torch.where(pos_to_token_topk >= 0, flat[pos_to_token_topk.clamp(min=0).long()], 0.0)


def _cast_e4m3(x: torch.Tensor, round_sf: bool, ue8m0: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``tritile.quant.per_token_cast(x, "e4m3", 128, ...)`` (UE8M0: packed, TMA-aligned column-major), or its
    ``tritile.torch`` twin (bitwise the same) for CPU tensors without the Triton interpreter."""
    if kernel_device_ok(x.device):
        from ..quant import per_token_cast

        return tuple(per_token_cast(x, "e4m3", 128, round_sf=round_sf, use_tma_aligned_col_major_sf=ue8m0,
                                    use_packed_ue8m0=ue8m0))
    from ..torch.cast import cast

    return tuple(cast(x, "e4m3", (1, 128), round_sf=round_sf, use_tma_aligned_col_major_sf=ue8m0,
                      use_packed_ue8m0=ue8m0))


def _reduce_fused(x: torch.Tensor, w: Optional[torch.Tensor], pos: torch.Tensor) -> torch.Tensor:
    """``tritile.moe.reduce_fused`` (float32 slot-order sum, one bf16 rounding), or its ``tritile.torch`` twin for
    CPU tensors without the Triton interpreter."""
    if kernel_device_ok(x.device):
        from ..moe import reduce_fused
    else:
        from ..torch import reduce_fused
    return reduce_fused(x, w, pos)


def _col_major(sf: torch.Tensor) -> torch.Tensor:
    """A copy of ``sf`` ``(N, S)`` with strides ``(1, align(N, 4))`` (TMA-aligned column-major)."""
    n, s = sf.shape
    store = torch.zeros((s, align(max(n, 1), 4)), dtype=sf.dtype, device=sf.device)
    store[:, :n] = sf.t()
    return store[:, :n].t()
