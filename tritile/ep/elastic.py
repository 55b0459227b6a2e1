"""``tritile.ep.ElasticBuffer``: DeepEP v2's ``ElasticBuffer`` API on torch.distributed.

Expert-parallel dispatch / combine (reusing :class:`tritile.ep.Buffer`'s engine), Engram storage sharded over the
ranks (``engram_write`` / ``engram_fetch``), pipeline-parallel send / recv to the ring neighbours (``pp_*``),
all-gather sessions (``create_agrs_session``, ``all_gather``, ...) and a deterministic reduce-scatter, ``barrier``,
the size hints, the domain sizes and the analytical SM / QP counts.  What differs from DeepEP, call by call, is
in ``docs/EP.md``.

Transfers are NCCL (CUDA tensors) or gloo (CPU tensors) collectives and point-to-point sends issued from the host:
no NVSHMEM, no NCCL device API ("Gin"), no GPU-initiated RDMA, no copy engine.  ``num_sms`` / ``num_qps`` and the
buffer sizes are accepted and checked but advisory: NCCL picks its own channels and SMs, and tensors come from
PyTorch's caching allocator.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..config import get_device_num_sms
from ..runtime import check_inner_contiguous, check_tensor
from ..utils import align
from ._dist import HEADER_WORDS, EventHandle, Header, a2a_rows, exchange_header, get_logical_domain_size
from .buffer import _DTYPES, _ERRORS, _MODE_CACHED, _NAMES, Buffer, DispatchHandle, _is_int
from .layout import check_layout_args
from .reduce import combine_reduce

__all__ = ["ElasticBuffer", "EPHandle"]

#: DeepEP's buffer-size granularity (2 MiB): the size hints are multiples of it.
BUFFER_ALIGNMENT = 2 << 20
#: NVLink bandwidth assumed by :meth:`ElasticBuffer.get_theoretical_num_sms` when none is given: 18 NVLink-4 links
#: of 25 GB/s (H100 / H200), at 90 % efficiency.
DEFAULT_NVLINK_GBS = 18 * 25 * 0.9


def _value_or(v, default):
    return default if v is None else v


def _check_count(name: str, v, minimum: int = 0) -> int:
    if not _is_int(v) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


class EPHandle:
    """The handle of :meth:`ElasticBuffer.dispatch` (DeepEP v2's ``EPHandle``), for combine and cached dispatch.

    Attributes (DeepEP's names; ``R`` ranks, ``L`` local experts, ``T`` tokens sent, ``N`` rows received):
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: ``(T, k)``: the dispatch's ``topk_idx`` (a copy with ``do_handle_copy=True``).
        num_recv_tokens: ``N`` (without a CPU sync: the worst case ``R * M``).
        num_expanded_tokens: expanded rows (the sum of ``num_recv_tokens_per_expert_list``; without a CPU sync:
            the worst case).
        num_recv_tokens_per_expert_list: host list ``[L]``, counts rounded up to ``expert_alignment`` (``[]``
            without a CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: int32 ``(R,)``: inclusive prefix of the rows received from each
            rank (one copy per token and rank); the last element is the number of valid rows.
        psum_num_recv_tokens_per_expert: int32 ``(L,)``: non-expand, the inclusive prefix of the aligned counts;
            expand, each expert's aligned segment start plus its real count.
        num_unaligned_recv_tokens_per_expert: int32 ``(L,)``: (row, slot) pairs received per local expert.
        recv_src_metadata: int32 ``(N, 2 + k)``: per received row the source global index
            ``src_rank * M + token`` (``-1`` on padding rows), then ``src_rank * k + j`` with ``j`` the row's last
            local top-k slot, then (expand mode) the expanded row of each slot (``-1`` = not local; ``-1``
            throughout in non-expand mode).
        dst_buffer_slot_idx: int32 ``(T, k)``: the row each (token, slot) occupies in its destination rank's
            receive block (a token's slots on one rank share it; ``-1`` = unused slot).
        token_metadata_at_forward, channel_linked_list: None (DeepEP's hybrid mode only).

    The tensors are computed on first access.  ``recv_src_metadata`` may be reassigned (DeepEP's tests slice it).
    """

    def __init__(self, core: DispatchHandle, topk_idx: torch.Tensor, num_max_tokens_per_rank: int, num_sms: int,
                 num_recv_tokens: int, num_expanded_tokens: int) -> None:
        self._core = core
        self.do_expand = core.do_expand
        self.num_experts = core.num_experts
        self.expert_alignment = core.expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = list(core.num_recv_tokens_per_expert_list)
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self._set: Dict[str, torch.Tensor] = {}

    def _get(self, name: str, make):
        v = self._set.get(name)
        if v is None:
            v = make()
            self._set[name] = v
        return v

    @property
    def psum_num_recv_tokens_per_scaleup_rank(self) -> torch.Tensor:
        c = self._core
        return self._get("psum_rank", lambda: c.recv_counts_t.cumsum(0, dtype=torch.int32))

    @psum_num_recv_tokens_per_scaleup_rank.setter
    def psum_num_recv_tokens_per_scaleup_rank(self, v: torch.Tensor) -> None:
        self._set["psum_rank"] = v

    @property
    def psum_num_recv_tokens_per_expert(self) -> torch.Tensor:
        return self._get("psum_expert", lambda: self._core.psum_num_recv_tokens_per_expert)

    @psum_num_recv_tokens_per_expert.setter
    def psum_num_recv_tokens_per_expert(self, v: torch.Tensor) -> None:
        self._set["psum_expert"] = v

    @property
    def num_unaligned_recv_tokens_per_expert(self) -> torch.Tensor:
        return self._get("unaligned", lambda: self._core.num_unaligned_recv_tokens_per_expert)

    @num_unaligned_recv_tokens_per_expert.setter
    def num_unaligned_recv_tokens_per_expert(self, v: torch.Tensor) -> None:
        self._set["unaligned"] = v

    @property
    def recv_src_metadata(self) -> torch.Tensor:
        return self._get("metadata", self._make_metadata)

    @recv_src_metadata.setter
    def recv_src_metadata(self, v: torch.Tensor) -> None:
        self._set["metadata"] = v

    @property
    def dst_buffer_slot_idx(self) -> torch.Tensor:
        return self._get("dst_slot", self._make_dst_slot)

    @dst_buffer_slot_idx.setter
    def dst_buffer_slot_idx(self, v: torch.Tensor) -> None:
        self._set["dst_slot"] = v

    def _ranks_of_slots(self) -> torch.Tensor:
        """int64 ``(T, k)``: the rank owning each slot's expert, ``-1`` for unused slots."""
        c = self._core
        idx = self.topk_idx.long()
        per = c.num_experts // c.num_ranks
        valid = (idx >= 0) & (idx < c.num_experts)
        return torch.where(valid, torch.div(idx, per, rounding_mode="floor"), -1)

    def _make_metadata(self) -> torch.Tensor:
        c = self._core
        n, k = c.num_recv_rows, c.num_topk
        dev = c.send_slot.device
        meta = torch.full((n, 2 + k), -1, dtype=torch.int32, device=dev)
        if n == 0:
            return meta
        src_rank = c.recv_src_rank
        meta[:, 0] = c.recv_src_global.to(torch.int32)
        if k:
            local = c.recv_topk_idx >= 0
            slots = torch.arange(k, device=dev)
            last = torch.where(local, slots, -1).amax(1)
            meta[:, 1] = torch.where((src_rank >= 0) & (last >= 0), src_rank * k + last, -1).to(torch.int32)
            if c.do_expand:
                meta[:, 2:] = c.token_topk_to_pos
        return meta

    def _make_dst_slot(self) -> torch.Tensor:
        c = self._core
        ranks = self._ranks_of_slots()
        t, k = ranks.shape
        if t == 0 or k == 0:
            return torch.full((t, k), -1, dtype=torch.int32, device=c.send_slot.device)
        r = ranks.clamp(min=0)
        slot = c.send_slot.long().gather(1, r)
        row = c.send_base.long()[r] + slot
        return torch.where((ranks >= 0) & (slot >= 0), row, -1).to(torch.int32)

    def _row_table(self) -> torch.Tensor:
        """int32 ``(T, R)``: per token, the rows of the returned blocks in DeepEP v2's reduction order (each
        rank's partial sum at the position of its last top-k slot, the slots summed in order), ``-1`` = none."""
        def make():
            c = self._core
            ranks = self._ranks_of_slots()
            t, k = ranks.shape
            R = c.num_ranks
            dev = c.send_slot.device
            if t == 0 or k == 0:
                return torch.full((t, R), -1, dtype=torch.int32, device=dev)
            hit = ranks[:, :, None] == torch.arange(R, device=dev)
            last = torch.where(hit, torch.arange(k, device=dev)[None, :, None], -1).amax(1)
            order = torch.argsort(last, dim=1, stable=True)
            slot = c.send_slot.long().gather(1, order)
            row = c.send_base.long()[order] + slot
            return torch.where(slot >= 0, row, -1).to(torch.int32)
        return self._get("row_table", make)


class ElasticBuffer:
    """DeepEP v2's ``ElasticBuffer`` on a ``torch.distributed`` group (NCCL: CUDA tensors, gloo: CPU tensors).

    Args:
        group: the process group (None: the default group).
        num_bytes, num_cpu_bytes: DeepEP's buffer sizes: checked (ints, multiples of 2 MiB, ``num_cpu_bytes <=
            num_bytes``) and advisory (tensors come from PyTorch's caching allocator; Engram keeps a copy of each
            rank's table in device memory).
        num_max_tokens_per_rank: ``M``: the default of :meth:`dispatch`'s argument, the same on every rank.
        hidden, num_topk, use_fp8_dispatch: sizing hints (accepted).
        deterministic: accepted: the receive order is deterministic by construction (ascending source rank, then
            source token).
        allow_hybrid_mode: accepted; there is one exchange level (the logical domain is ``(1, R)``).
        allow_multiple_reduction: expand-mode combine: True sums each token's local rows first (one bf16 rounding
            per rank, one row per token back); False sends every (token, slot) row back and sums them once, in
            slot order (one host sync for the split sizes).
        prefer_overlap_with_compute: used by :meth:`get_theoretical_num_sms` only.
        sl_idx, num_allocated_qps: accepted (no RDMA queue pairs); ``num_allocated_qps`` bounds ``num_qps``.
        num_cpu_timeout_secs: how long a call's header exchange waits for the other ranks (gloo; NCCL groups use
            their own timeout).  num_gpu_timeout_secs: accepted.
        explicitly_destroy: accepted; :meth:`destroy` works either way.
        peer_checks: as for :class:`tritile.ep.Buffer` (None: ``TRITILE_EP_PEER_CHECKS``, default on).
    """

    def __init__(self, group=None, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, peer_checks: Optional[bool] = None) -> None:
        for name, v in (("num_cpu_bytes", num_cpu_bytes), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("hidden", hidden), ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps),
                        ("num_cpu_timeout_secs", num_cpu_timeout_secs), ("num_gpu_timeout_secs", num_gpu_timeout_secs),
                        ("sl_idx", sl_idx)):
            _check_count(name, v)
        if num_bytes is not None:
            _check_count("num_bytes", num_bytes)
            if num_bytes % BUFFER_ALIGNMENT:
                raise ValueError(f"num_bytes must be a multiple of 2 MiB ({BUFFER_ALIGNMENT}), got {num_bytes}")
            if num_cpu_bytes > num_bytes:
                raise ValueError(f"num_cpu_bytes ({num_cpu_bytes}) must not exceed num_bytes ({num_bytes})")
        elif num_cpu_bytes:
            raise ValueError("num_cpu_bytes needs num_bytes (DeepEP: the total includes the CPU bytes)")
        if num_cpu_bytes % BUFFER_ALIGNMENT:
            raise ValueError(f"num_cpu_bytes must be a multiple of 2 MiB ({BUFFER_ALIGNMENT}), got {num_cpu_bytes}")
        if num_cpu_timeout_secs == 0:
            raise ValueError("num_cpu_timeout_secs must be positive")
        self._engine = Buffer(group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                              num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch, peer_checks=peer_checks)
        eng = self._engine
        eng._timeout_s = float(num_cpu_timeout_secs)
        self.group = eng.group
        self.rank_idx = eng.rank
        self.num_ranks = eng.group_size
        self.device = eng.device
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_bytes = num_bytes if num_bytes is not None else ElasticBuffer.get_buffer_size_hint(
            self.group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
            allow_multiple_reduction)
        self.num_cpu_bytes = num_cpu_bytes
        self.sl_idx = sl_idx
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_allocated_qps = num_allocated_qps or (129 if self.allow_hybrid_mode else 17)
        self.num_scaleout_ranks, self.num_scaleup_ranks = get_logical_domain_size(self.group)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = eng.num_rdma_ranks, eng.num_nvl_ranks
        self._sms_cache: Dict[tuple, int] = {}
        self._engram = None
        self._pp = None
        self._pp_sends: Dict[int, deque] = {}
        self._pp_local: deque = deque()
        self._agrs = None
        self.barrier()

    @property
    def peer_checks(self) -> bool:
        return self._engine.peer_checks

    # ----------------------------------------------------------------------------------------------------------
    # lifetime, streams, domains
    # ----------------------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the cached tensors (Engram table, AGRS buffer, pending sends); the buffer cannot be used
        afterwards."""
        for q in self._pp_sends.values():
            while q:
                q.popleft()[0].wait()
        self._pp_sends.clear()
        self._pp_local.clear()
        self._engram = None
        self._agrs = None
        self._engine.destroy()

    def _alive(self) -> None:
        self._engine._alive()

    @staticmethod
    def capture() -> EventHandle:
        """An :class:`EventHandle` recorded on the current stream (pass it as ``previous_event``)."""
        return EventHandle()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream (CUDA), or None on the CPU."""
        return self._engine.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: hosts in the group, and ranks per host."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)`` = ``(1, R)``: one exchange level reaches every rank."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """All ranks meet: an all-reduce of one element on the communication stream (``use_comm_stream``) or the
        current one, which the current stream then waits for; ``with_cpu_sync`` synchronizes the device before and
        after.  On the CPU (gloo) a blocking ``dist.barrier``.  ``sequential``: accepted."""
        self._alive()
        if self.device.type != "cuda":
            dist.barrier(group=self.group)
            return
        if with_cpu_sync:
            torch.cuda.synchronize()
        one = torch.ones((1,), dtype=torch.int32, device=self.device)
        stream = self.get_comm_stream() if use_comm_stream else torch.cuda.current_stream()
        compute = torch.cuda.current_stream()
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            dist.all_reduce(one, group=self.group)
        compute.wait_stream(stream)
        if with_cpu_sync:
            torch.cuda.synchronize()

    # ----------------------------------------------------------------------------------------------------------
    # size hints and analytical counts (advisory)
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of one worst-case dispatch's send and receive staging (``2 * R * M`` rows of payload, scales,
        ids, weights and source index; ``num_topk=0`` counts 32), rounded up to 2 MiB.  Advisory: tritile takes
        them from PyTorch's caching allocator per call."""
        world = dist.get_world_size(group if group is not None else dist.group.WORLD)
        k = num_topk or 32
        row = hidden * (1 if use_fp8_dispatch else 2) + (4 * ((hidden + 127) // 128) if use_fp8_dispatch else 0)
        row += 4 * (1 + 2 * k)
        return align(max(2 * world * num_max_tokens_per_rank * row, 1), BUFFER_ALIGNMENT)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """``(num_gpu_bytes, num_cpu_bytes)``: the fetched rows (``M`` rows of ``hidden`` elements, each rounded
        up to 32 bytes) and the table (``num_entries`` such rows), each rounded up to 2 MiB."""
        row = align(hidden * dtype.itemsize, 32)
        return (align(row * num_max_tokens_per_rank, BUFFER_ALIGNMENT), align(row * num_entries, BUFFER_ALIGNMENT))

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Send and receive staging for both ring neighbours: ``align(bytes, 32) * inflight * 4``, rounded up to
        2 MiB."""
        return align(align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4, BUFFER_ALIGNMENT)

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype: torch.dtype) -> int:
        """Bytes one session's gathered tensors take: per shape ``R * numel * itemsize`` rounded up to 32."""
        world = dist.get_world_size(group if group is not None else dist.group.WORLD)
        if not _is_batch(shapes):
            shapes = (shapes,)
        return sum(align(world * math.prod(s) * dtype.itemsize, 32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int) -> int:
        """``num_max_session_bytes`` rounded up to 2 MiB."""
        return align(num_max_session_bytes, BUFFER_ALIGNMENT)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """DeepEP's analytical SM count for balanced routing (advisory: NCCL decides how many SMs its kernels
        take; tritile passes the count nowhere).

        With ``d`` the expected number of distinct ranks a token reaches, ``R * (1 - C(E - E/R, k) / C(E, k))``,
        a received token costs ``1 / d`` token reads and ``nvl / R`` token writes per SM-visible byte, and crosses
        NVLink with probability ``(nvl - 1) / R``; the count is the larger of the SMs that keep the NVLink busy
        reading and writing, times 1.25, even, at least 4 (64 without ``prefer_overlap_with_compute``), at most
        the device's SMs (all of them when nothing crosses).  ``nvlink_gbs=0``: 405 GB/s (18 NVLink-4 links);
        ``rdma_gbs``: accepted (one exchange level: NVLink bounds)."""
        _check_count("num_experts", num_experts, 1)
        _check_count("num_topk", num_topk, 1)
        if num_scaleout_topk != 0:
            raise ValueError(f"num_scaleout_topk must be 0 (reserved), got {num_scaleout_topk!r}")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts must be divisible by the group size {self.num_ranks}, got {num_experts}")
        key = (num_experts, num_topk, float(nvlink_gbs), float(sm_read_gbs), float(sm_write_gbs))
        got = self._sms_cache.get(key)
        if got is not None:
            return got
        R, nvl = self.num_ranks, self.num_nvlink_ranks
        device_sms = get_device_num_sms()
        outside = num_experts - num_experts // R
        miss = math.comb(outside, num_topk) / math.comb(num_experts, num_topk) if num_topk <= num_experts else 0.0
        distinct = R * (1.0 - miss)
        reads = 1.0 / distinct
        writes = nvl / R + ((1.0 / distinct) if self.num_rdma_ranks > 1 else 0.0)
        traffic = (nvl / R) * (1.0 - 1.0 / nvl)
        gbs = nvlink_gbs or DEFAULT_NVLINK_GBS
        sms = float(device_sms)
        if traffic > 0:
            per_sm = gbs / traffic
            sms = max(per_sm * reads / sm_read_gbs, per_sm * writes / sm_write_gbs)
        n = align(max(4, math.ceil(sms * 1.25)), 2)
        if not self.prefer_overlap_with_compute:
            n = max(n, 64)
        n = min(n, device_sms)
        self._sms_cache[key] = n
        return n

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's QP count for ``num_sms`` SMs (advisory: there are no queue pairs here): one per SM up to 9,
        or 16 per SM plus one with ``allow_hybrid_mode``; at most ``num_allocated_qps``."""
        _check_count("num_sms", num_sms, 1)
        n = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(n, self.num_allocated_qps)

    def _sms_qps(self, num_sms, num_qps, num_experts, num_topk) -> Tuple[int, int]:
        _check_count("num_sms", num_sms)
        _check_count("num_qps", num_qps)
        if num_sms == 0:
            num_sms = self.get_theoretical_num_sms(num_experts, max(num_topk, 1))
        if num_qps == 0:
            num_qps = self.get_theoretical_num_qps(num_sms)
        if num_qps > self.num_allocated_qps:
            raise ValueError(f"num_qps must be at most num_allocated_qps ({self.num_allocated_qps}), got {num_qps}")
        return num_sms, num_qps

    # ----------------------------------------------------------------------------------------------------------
    # expert-parallel dispatch / combine
    # ----------------------------------------------------------------------------------------------------------
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None,
                 do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token once to every rank owning one of its experts (DeepEP v2's ``dispatch``).

        Args:
            x: bfloat16 ``(T, H)``, or ``(float8_e4m3fn (T, H), scales (T, S))`` with ``S`` opaque 4-byte packs per
                token (float32 scales or int32 packed UE8M0), any strides for the scales; ``T <= M``.
            topk_idx: ``(T, k)`` int64 (or int32), ``-1`` = unused; None with ``handle``.
            topk_weights: float32 ``(T, k)`` or None (with ``handle``: sent again, for the expanded backward).
            cumulative_local_expert_recv_stats: int32 ``(L,)``, incremented by the unaligned per-expert counts.
            num_experts, num_max_tokens_per_rank, expert_alignment: ``E`` (required without a handle), ``M`` (the
                constructor's by default; the source global ids are ``src_rank * M + token``), the alignment
                (default 1); with a handle they default to, and must equal, the handle's.
            num_sms, num_qps: advisory (0: the analytical counts); ``num_qps <= num_allocated_qps``.
            previous_event, previous_event_before_epilogue: events (an :class:`EventHandle` from :meth:`capture`
                or an :class:`EventOverlap`) the communication stream waits for first (both at the start: there is
                no separate epilogue).
            async_with_compute_stream: return without making the current stream wait (wait on the event).
            allocate_on_comm_stream: outputs stay owned by the communication stream.
            handle: a previous dispatch's :class:`EPHandle`: cached dispatch (no layout, no count exchange, no host
                sync), same routing.
            do_handle_copy: the handle keeps a copy of ``topk_idx`` (False: the tensor itself).
            do_cpu_sync: True (default without a handle): exact row counts (one host sync).  False: sync-free,
                outputs sized for the worst case (``R * M`` rows; expand: ``R*M*min(k, L) + (a-1)*L`` rounded to
                ``a``), valid rows first; ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]`` counts them.
            do_expand: one row per (token, local expert): expert segments, each starting at a multiple of ``a``, in
                receive order inside.  do_zero_padding: (expand only) padding rows are zero (always true here).
            use_tma_aligned_col_major_sf: received scales column-major with strides ``(1, align(rows, 4))``.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` ``(N, H)`` (expand:
            ``(N_exp, H)``; a tuple with the scales for FP8) in ascending source rank then source token order;
            ``recv_topk_idx`` ``(N, k)`` local expert ids, ``-1`` where the expert lives elsewhere (None in expand
            mode); ``recv_topk_weights`` float32 ``(N, k)``, 0 at ``-1`` slots (expand: ``(N_exp,)``; None without
            weights); the :class:`EPHandle`; an :class:`EventOverlap`.
        """
        eng = self._engine
        cached = handle is not None
        always = not cached and (do_cpu_sync is None or bool(do_cpu_sync))
        try:
            eng._alive()
            data, sf, sf_1d = eng._check_x(x, strict_sf=False)
            if do_zero_padding and not do_expand:
                raise ValueError("do_zero_padding=True needs do_expand=True")
            if cached:
                if not isinstance(handle, EPHandle):
                    raise TypeError(f"handle must be an EPHandle from ElasticBuffer.dispatch, got "
                                    f"{type(handle).__name__}")
                if topk_idx is not None:
                    raise ValueError("topk_idx must be None with a handle (cached dispatch: the handle's routing)")
                if do_cpu_sync:
                    raise ValueError("do_cpu_sync=True is not allowed with a handle (cached dispatch never syncs)")
                for nm, v, hv in (("num_experts", num_experts, handle.num_experts),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment),
                                  ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                   handle.num_max_tokens_per_rank)):
                    if v is not None and v != hv:
                        raise ValueError(f"{nm} must match the handle's ({hv}), got {v!r}")
                if bool(do_expand) != handle.do_expand:
                    raise ValueError(f"do_expand must match the handle's ({handle.do_expand}), got {do_expand!r}")
                core = handle._core
                eng._check_cached(data, core)
                E, M, a, k = handle.num_experts, handle.num_max_tokens_per_rank, handle.expert_alignment, core.num_topk
                if topk_weights is not None:
                    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
                    eng._check_device("topk_weights", topk_weights)
                    if tuple(topk_weights.shape) != (core.num_tokens, k):
                        raise ValueError(f"topk_weights must have shape {(core.num_tokens, k)}, got "
                                         f"{tuple(topk_weights.shape)}")
                if cumulative_local_expert_recv_stats is not None:
                    raise ValueError("cumulative_local_expert_recv_stats must be None with a handle (the counts "
                                     "were added by the first dispatch)")
            else:
                if topk_idx is None:
                    raise ValueError("topk_idx is required without a handle")
                if num_experts is None:
                    raise ValueError("num_experts is required without a handle")
                E = num_experts
                check_layout_args(topk_idx, E, self.num_ranks)
                M = _value_or(num_max_tokens_per_rank, self.num_max_tokens_per_rank)
                _check_count("num_max_tokens_per_rank", M, 1)
                if data.shape[0] > M:
                    raise ValueError(f"x has {data.shape[0]} tokens, more than num_max_tokens_per_rank={M}")
                a = _value_or(expert_alignment, 1)
                _check_count("expert_alignment", a, 1)
                k = topk_idx.shape[1]
                eng._check_uncached(x, topk_idx, topk_weights, None, None, E, do_expand,
                                    cumulative_local_expert_recv_stats)
            num_sms, num_qps = self._sms_qps(num_sms, num_qps, E, k)
            ctx = eng._ctx(previous_event, async_with_compute_stream, allocate_on_comm_stream,
                           previous_event_before_epilogue)
        except _ERRORS as e:
            eng._fail("dispatch", e, always)
        if cached:
            core = handle._core
            fields = eng._dispatch_fields(_MODE_CACHED, data, sf, core.num_topk, topk_weights is not None, E,
                                          core.capacity, M)
            hdr = Header("dispatch", fields, _NAMES)
            with ctx.run(keep=(data, sf, topk_weights)):
                eng._agree(hdr)
                recv_x, recv_idx, recv_w = eng._cached_core(data, sf, sf_1d, core, use_tma_aligned_col_major_sf,
                                                            handle.topk_idx, topk_weights)
            ctx.own(recv_x, recv_w)
            return recv_x, recv_idx, recv_w, handle, ctx.event
        sync = do_cpu_sync is None or bool(do_cpu_sync)
        R, per = self.num_ranks, E // self.num_ranks
        capacity = 0 if sync else M
        with ctx.run(keep=(data, sf, topk_idx, topk_weights)):
            recv_x, recv_idx, recv_w, lst, core = eng._dispatch_core(
                data, sf, sf_1d, topk_idx, topk_weights, None, None, E, a, capacity, R * M if capacity else 0,
                do_expand, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats, M)
            if recv_idx is not None and recv_idx.dtype != topk_idx.dtype:
                recv_idx = recv_idx.to(topk_idx.dtype)
            kept = topk_idx.clone() if do_handle_copy else topk_idx
        if sync:
            n_recv, n_exp = core.num_recv_rows, sum(lst)
        else:
            n_recv = R * M
            n_exp = align(R * M * min(k, per) + (a - 1) * per, a)
        h = EPHandle(core, kept, M, num_sms, n_recv, n_exp)
        ctx.own(recv_x, recv_idx, recv_w, kept)
        return recv_x, recv_idx, recv_w, h, ctx.event

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Send the rows back to their source ranks and sum them per token (DeepEP v2's ``combine``).

        The sum is DeepEP v2's reference order, bit for bit: per token ``f32(bias0) + f32(bias1)``, then each
        destination rank's row in the order of that rank's last top-k slot, in float32, one bf16 rounding.  Expand
        mode first sums each token's local rows in slot order (float32, one bf16 rounding per rank) with
        ``allow_multiple_reduction``; without it every (token, slot) row comes back and the sum runs over the
        slots in order.  Gate weights are not applied.

        Args:
            x: bfloat16 ``(N, H)`` in the dispatch's receive order (expand: ``(N_exp, H)``), contiguous; rows past
                the valid count (sync-free dispatch) are ignored.
            handle: the dispatch's :class:`EPHandle`.
            topk_weights: float32 ``(N, k)`` (expand: ``(N_exp,)``) or None: each slot's value is taken from the
                rank owning its expert (other ranks' values at that slot are ignored) and returned per token.
            bias: None, a bfloat16 ``(T, H)`` tensor, or a pair of them.
            num_sms, num_qps: advisory (0: the dispatch's / analytical).
            previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream: as
                for :meth:`dispatch`.

        Returns:
            ``(combined_x, combined_topk_weights, event)``: bfloat16 ``(T, H)``, float32 ``(T, k)`` or None,
            :class:`EventOverlap`.
        """
        eng = self._engine
        try:
            eng._alive()
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be an EPHandle from ElasticBuffer.dispatch, got {type(handle).__name__}")
            core = handle._core
            wshape = (core.num_expanded_tokens,) if core.do_expand else (core.num_recv_rows, core.num_topk)
            b0, b1 = eng._check_combine(x, core, topk_weights, bias, wshape)
            pairs = core.do_expand and not self.allow_multiple_reduction
            if pairs and topk_weights is not None:
                raise ValueError("topk_weights in expand-mode combine needs allow_multiple_reduction=True")
            self._sms_qps(num_sms or handle.num_sms, num_qps, core.num_experts, core.num_topk)
            ctx = eng._ctx(previous_event, async_with_compute_stream, allocate_on_comm_stream,
                           previous_event_before_epilogue)
        except _ERRORS as e:
            eng._fail("combine", e)
        hdr = Header("combine", eng._combine_fields(x, core, topk_weights) + [("pairs", int(pairs), True)], _NAMES)
        with ctx.run(keep=(x, topk_weights, b0, b1)):
            eng._agree(hdr)
            if pairs:
                out, wout = self._combine_pairs(x, handle, b0, b1), None
            else:
                w = None
                if topk_weights is not None:
                    if core.do_expand:
                        ttp = core.token_topk_to_pos
                        flat = topk_weights
                        w = torch.where(ttp >= 0, flat[ttp.clamp(min=0).long()], 0.0) if flat.numel() else \
                            torch.zeros(ttp.shape, dtype=torch.float32, device=self.device)
                    else:
                        w = torch.where(core.recv_topk_idx >= 0, topk_weights, 0.0)
                out, wout = eng._combine_core(x, core, w, b0, b1, row_table=handle._row_table())
        ctx.own(out, wout)
        return out, wout, ctx.event

    def _combine_pairs(self, x: torch.Tensor, handle: EPHandle, b0, b1) -> torch.Tensor:
        """Expand-mode combine without local reduction: every (token, slot) row goes back and the source sums
        them in slot order."""
        eng, core = self._engine, handle._core
        R, dev = self.num_ranks, self.device
        ranks = handle._ranks_of_slots()
        t, k = ranks.shape
        hit = (ranks.reshape(-1, 1) == torch.arange(R, device=dev)).to(torch.int32)
        ttp = core.token_topk_to_pos
        n = core.num_recv_rows
        # split sizes: pairs each source sent to me (back to it), pairs I sent to each rank (coming back)
        valid = core.recv_src_rank >= 0
        from_src = torch.zeros((R,), dtype=torch.int64, device=dev)
        if n:
            per_row = ((ttp >= 0) & valid[:, None]).sum(1)
            from_src.index_add_(0, core.recv_src_rank.clamp(min=0).long(), per_row)
        sizes = torch.cat([from_src, hit.sum(0).to(torch.int64)]).tolist()
        send_counts, recv_counts = sizes[:R], sizes[R:]
        sel = (ttp >= 0) & valid[:, None] if n else torch.zeros((0, k), dtype=torch.bool, device=dev)
        rows = ttp[sel].long()
        send = x[rows].contiguous() if rows.numel() else x.new_empty((0, x.shape[1]))
        with eng._phase("exchange"):
            back = eng._exchange(send, recv_counts, send_counts)
        with eng._phase("reduce"):
            start = torch.tensor([0] + recv_counts[:-1], dtype=torch.int64, device="cpu").cumsum(0).to(dev)
            before = (hit.cumsum(0) - hit).gather(1, ranks.clamp(min=0).reshape(-1, 1)).reshape(t, k)
            table = torch.where(ranks >= 0, start[ranks.clamp(min=0)] + before, -1).to(torch.int32)
            out, _ = combine_reduce(back, table, eng._zeros_int32(k), b0, b1)
        return out

    # ----------------------------------------------------------------------------------------------------------
    # Engram: a table sharded over the ranks
    # ----------------------------------------------------------------------------------------------------------
    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        """Store this rank's share of the Engram table (a copy).  Global entry ``i`` lives on rank
        ``i // num_entries``, row ``i % num_entries``; every rank passes the same ``num_entries``, hidden size and
        dtype (checked).  A collective (all ranks call it): it is the barrier before the write; no barrier is
        needed after it (fetches are collectives).

        Args:
            storage: ``(num_entries, hidden)`` bfloat16 or float8_e4m3fn, unit inner stride.
            sf: FP8 only (required then): ``(R * num_entries, num_sf_packs)`` float32 or int32 scale packs of every
                global entry, the same on every rank (fetches read them locally).
        """
        eng = self._engine
        try:
            self._alive()
            check_tensor("storage", storage, dtypes=(torch.bfloat16, torch.float8_e4m3fn), ndim=2)
            eng._check_device("storage", storage)
            check_inner_contiguous("storage", storage)
            fp8 = storage.dtype == torch.float8_e4m3fn
            if fp8 != (sf is not None):
                raise ValueError("sf must be given exactly when storage is float8_e4m3fn" +
                                 (", got None" if fp8 else f", got a tensor for {storage.dtype} storage"))
            if sf is not None:
                check_tensor("sf", sf, dtypes=(torch.float32, torch.int32), ndim=2)
                eng._check_device("sf", sf)
                want = self.num_ranks * storage.shape[0]
                if sf.shape[0] != want:
                    raise ValueError(f"sf must have R * num_entries = {want} rows (every global entry), got shape "
                                     f"{tuple(sf.shape)}")
        except _ERRORS as e:
            eng._fail("engram_write", e, always=True)
        fields = [("num_entries", storage.shape[0], True), ("hidden", storage.shape[1], True),
                  ("dtype", _DTYPES[storage.dtype], True), ("sf packs", 0 if sf is None else sf.shape[1], True),
                  ("sf dtype", 0 if sf is None else _DTYPES[sf.dtype], True)]
        exchange_header(self.group, self.device, Header("engram_write", fields, {"dtype": _NAMES["x dtype"],
                                                                                  "sf dtype": _NAMES["x dtype"]}),
                        timeout_s=eng._timeout_s)
        self._engram = (storage.contiguous().clone(), None if sf is None else sf.contiguous().clone())

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0,
                     use_tma_aligned_col_major_sf: bool = False) -> Callable[[], Tuple[torch.Tensor, Optional[
                         torch.Tensor]]]:
        """Fetch global Engram entries from the ranks that hold them.  A collective (all ranks call it, each with
        its own ``indices``).

        One exchange of request counts (with the header; one host sync), one all-to-all of the requested rows'
        indices, then the owners' rows are sent back asynchronously; the returned hook waits for them.

        Args:
            indices: int32 (or int64) ``(T, n)`` global entry indices in ``[0, R * num_entries)``.
            num_qps: advisory.
            use_tma_aligned_col_major_sf: the fetched FP8 scales column-major (strides ``(1, align(T, 4))``).

        Returns:
            A hook: ``hook()`` waits and returns ``(data, sf)``: ``data`` ``(T, n * hidden)`` (each token's ``n``
            entries side by side) in the table's dtype; ``sf`` ``(T, n * num_sf_packs)`` (FP8), else None.
        """
        eng = self._engine
        try:
            self._alive()
            if self._engram is None:
                raise ValueError("engram_fetch needs engram_write first")
            check_tensor("indices", indices, dtypes=(torch.int32, torch.int64), ndim=2)
            eng._check_device("indices", indices)
            _check_count("num_qps", num_qps)
        except _ERRORS as e:
            eng._fail("engram_fetch", e, always=True)
        table, sf = self._engram
        R, me, dev = self.num_ranks, self.rank_idx, self.device
        entries, hidden = table.shape
        t, n = indices.shape
        flat = indices.reshape(-1).long()
        total = R * entries
        ok = (flat >= 0) & (flat < total)
        owner = torch.where(ok, torch.div(flat, max(entries, 1), rounding_mode="floor"), R)
        counts = torch.bincount(owner, minlength=R + 1)
        host_counts = counts.cpu()
        hdr = Header("engram_fetch", [("hidden", hidden, True), ("dtype", _DTYPES[table.dtype], True),
                                      ("indices out of range", int(host_counts[R]), False)],
                     {"dtype": _NAMES["x dtype"]})
        host = exchange_header(self.group, dev, hdr, extra=host_counts[:R], timeout_s=eng._timeout_s)
        bad = host[:, 3 + 2].tolist()
        if any(bad):
            raise ValueError(f"indices must be in [0, R * num_entries) = [0, {total}): rank(s) "
                             + ", ".join(f"{r} ({c} outside)" for r, c in enumerate(bad) if c) + " passed others")
        send_counts = host[me, HEADER_WORDS:HEADER_WORDS + R].tolist()
        recv_counts = host[:, HEADER_WORDS + me].tolist()
        order = torch.argsort(owner, stable=True)
        local_rows = (flat - owner.clamp(max=R - 1) * entries)[order].to(torch.int32)
        wanted = eng._exchange(local_rows, recv_counts, send_counts)
        words = table.view(torch.uint8)
        reply = words[wanted.long()] if wanted.numel() else words.new_empty((0, words.shape[1]))
        got = torch.empty((t * n, words.shape[1]), dtype=torch.uint8, device=dev)
        work = a2a_rows(got, reply.contiguous(), send_counts, recv_counts, self.group, async_op=True)
        sf_out = None
        if sf is not None:
            sfs = sf[flat.clamp(0, total - 1)].reshape(t, n * sf.shape[1])
            if use_tma_aligned_col_major_sf:
                from .buffer import _col_major

                sfs = _col_major(sfs)
            sf_out = sfs
        state: List = []

        def hook():
            """Wait for the rows and return ``(data, sf)`` (idempotent)."""
            if not state:
                work.wait()
                data = torch.empty_like(got)
                data[order] = got
                state.append((data.view(table.dtype).reshape(t, n * hidden), sf_out))
            return state[0]

        return hook

    # ----------------------------------------------------------------------------------------------------------
    # pipeline-parallel send / recv (ring neighbours)
    # ----------------------------------------------------------------------------------------------------------
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Set the largest tensor and the number of sends that may be in flight per neighbour.  A collective
        (the barrier that flushes earlier sends; every rank passes the same values)."""
        eng = self._engine
        try:
            self._alive()
            _check_count("num_max_tensor_bytes", num_max_tensor_bytes, 1)
            _check_count("num_max_inflight_tensors", num_max_inflight_tensors, 1)
        except _ERRORS as e:
            eng._fail("pp_set_config", e, always=True)
        for q in self._pp_sends.values():
            while q:
                q.popleft()[0].wait()
        exchange_header(self.group, self.device, Header("pp_set_config", [
            ("num_max_tensor_bytes", num_max_tensor_bytes, True),
            ("num_max_inflight_tensors", num_max_inflight_tensors, True)]), timeout_s=eng._timeout_s)
        self._pp = (num_max_tensor_bytes, num_max_inflight_tensors)

    def _pp_check(self, name: str, t: torch.Tensor, peer: int, peer_name: str) -> None:
        self._alive()
        if self._pp is None:
            raise ValueError(f"{name} needs pp_set_config first")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a tensor, got {type(t).__name__}")
        self._engine._check_device("t", t)
        if not t.is_contiguous():
            raise ValueError(f"t must be contiguous, got strides {tuple(t.stride())}")
        nbytes = t.numel() * t.element_size()
        if nbytes > self._pp[0]:
            raise ValueError(f"t has {nbytes} bytes, more than num_max_tensor_bytes={self._pp[0]}")
        R = self.num_ranks
        ring = {(self.rank_idx + 1) % R, (self.rank_idx - 1) % R}
        if not _is_int(peer) or peer not in ring:
            raise ValueError(f"{peer_name} must be the previous or next rank in the ring ({sorted(ring)}), "
                             f"got {peer!r}")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send ``t`` (contiguous, at most ``num_max_tensor_bytes``) to the next or previous rank.  Returns at once
        (a copy is sent); once ``num_max_inflight_tensors`` sends to one neighbour are pending, the oldest must
        have been received first.  The receiver passes a tensor of the same size to :meth:`pp_recv`; sends and
        receives between two ranks match in order."""
        self._pp_check("pp_send", t, dst_rank_idx, "dst_rank_idx")
        _check_count("num_sms", num_sms)
        staged = t.detach().clone().view(-1).view(torch.uint8)
        if dst_rank_idx == self.rank_idx:  # a one-rank ring: the neighbour is this rank
            self._pp_local.append(staged)
            return
        q = self._pp_sends.setdefault(dst_rank_idx, deque())
        while len(q) >= self._pp[1]:
            q.popleft()[0].wait()
        q.append((dist.isend(staged, dst_rank_idx if self.group is dist.group.WORLD else
                             dist.get_global_rank(self.group, dst_rank_idx), group=self.group), staged))

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receive the next tensor sent by ``src_rank_idx`` (the next or previous rank) into ``t`` (contiguous,
        the sent size)."""
        self._pp_check("pp_recv", t, src_rank_idx, "src_rank_idx")
        _check_count("num_sms", num_sms)
        view = t.view(-1).view(torch.uint8) if t.numel() else torch.empty((0,), dtype=torch.uint8, device=t.device)
        if src_rank_idx == self.rank_idx:
            if not self._pp_local:
                raise ValueError("pp_recv from this rank with nothing sent (one-rank ring)")
            got = self._pp_local.popleft()
            if got.numel() != view.numel():
                raise ValueError(f"t has {view.numel()} bytes, the tensor sent had {got.numel()}")
            view.copy_(got)
            return
        dist.irecv(view, src_rank_idx if self.group is dist.group.WORLD else
                   dist.get_global_rank(self.group, src_rank_idx), group=self.group).wait()

    # ----------------------------------------------------------------------------------------------------------
    # all-gather / reduce-scatter sessions
    # ----------------------------------------------------------------------------------------------------------
    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Allocate the session buffer (``num_max_session_bytes``) and set how many tensors one session may
        gather.  A collective (every rank passes the same values); no session may be open."""
        eng = self._engine
        try:
            self._alive()
            _check_count("num_max_session_bytes", num_max_session_bytes, 1)
            _check_count("num_max_all_gathers_per_session", num_max_all_gathers_per_session, 1)
            if self._agrs is not None and self._agrs["active"]:
                raise ValueError("agrs_set_config inside an open AGRS session: destroy it first")
        except _ERRORS as e:
            eng._fail("agrs_set_config", e, always=True)
        exchange_header(self.group, self.device, Header("agrs_set_config", [
            ("num_max_session_bytes", num_max_session_bytes, True),
            ("num_max_all_gathers_per_session", num_max_all_gathers_per_session, True)]), timeout_s=eng._timeout_s)
        self._agrs = dict(buf=torch.empty((num_max_session_bytes,), dtype=torch.uint8, device=self.device),
                          limit=num_max_all_gathers_per_session, active=False, used=0, count=0, inplace={},
                          works=[])

    def create_agrs_session(self) -> None:
        """Open a session: its gathers allocate from the session buffer until :meth:`destroy_agrs_session`."""
        self._alive()
        if self._agrs is None:
            raise ValueError("create_agrs_session needs agrs_set_config first")
        if self._agrs["active"]:
            raise ValueError("an AGRS session is already open: destroy_agrs_session first")
        self._agrs.update(active=True, used=0, count=0, inplace={}, works=[])

    def destroy_agrs_session(self) -> None:
        """Close the session: wait for its transfers; its tensors' memory is reused by the next session."""
        self._alive()
        if self._agrs is None or not self._agrs["active"]:
            raise ValueError("destroy_agrs_session without an open session")
        for w in self._agrs["works"]:
            w.wait()
        self._agrs.update(active=False, works=[], inplace={})

    @contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """``with buffer.agrs_new_session():``: create / destroy a session around the block (no-op if not
        ``enabled``)."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def _agrs_alloc(self, nbytes: int) -> int:
        s = self._agrs
        size = align(nbytes, 32)
        if s["used"] + size > s["buf"].numel():
            raise ValueError(f"the AGRS session needs {s['used'] + size} bytes, more than num_max_session_bytes="
                             f"{s['buf'].numel()}")
        off = s["used"]
        s["used"] += size
        return off

    def _agrs_open(self, name: str, count: int) -> None:
        self._alive()
        s = self._agrs
        if s is None or not s["active"]:
            raise ValueError(f"{name} must be called inside an open AGRS session (create_agrs_session)")
        if s["count"] + count > s["limit"]:
            raise ValueError(f"the session would hold {s['count'] + count} gathered tensors, more than "
                             f"num_max_all_gathers_per_session={s['limit']}")

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """This rank's slot of the next gather's output, to fill in place and pass to :meth:`all_gather` (no
        copy).  ``shapes``: one shape, or a sequence of shapes (then a tuple of tensors is returned)."""
        batched = _is_batch(shapes)
        seq = tuple(shapes) if batched else (shapes,)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        for shape in seq:  # before any allocation: a bad shape leaves the session as it was
            if not isinstance(shape, (tuple, list, torch.Size)) or not all(_is_int(d) and d >= 0 for d in shape):
                raise ValueError(f"shapes must hold shapes of non-negative ints, got {shape!r}")
        self._agrs_open("agrs_get_inplace_tensor", 0)
        s, R = self._agrs, self.num_ranks
        out = []
        for shape in seq:
            nbytes = math.prod(shape) * dtype.itemsize
            off = self._agrs_alloc(R * nbytes)
            slot = s["buf"][off + self.rank_idx * nbytes:off + (self.rank_idx + 1) * nbytes]
            t = slot.view(dtype).view(tuple(shape))
            s["inplace"][(slot.data_ptr(), nbytes)] = off
            out.append(t)
        return tuple(out) if batched else out[0]

    def all_gather(self, t: Union[torch.Tensor, Sequence[torch.Tensor]]):
        """Gather ``t`` (one contiguous tensor, or a sequence of them) from every rank, inside a session.

        Returns ``(gathered, hook)`` for one tensor, ``(*gathered, hook)`` for a sequence: ``gathered`` has a
        leading dimension ``R`` (rank ``r``'s tensor at index ``r``) and lives in the session buffer until the
        session ends; it is valid after ``hook()``."""
        eng = self._engine
        single = isinstance(t, torch.Tensor)
        try:
            tensors = (t,) if single else tuple(t)
            for i, x in enumerate(tensors):
                nm = "t" if single else f"t[{i}]"
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"{nm} must be a tensor, got {type(x).__name__}")
                eng._check_device(nm, x)
                if not x.is_contiguous():
                    raise ValueError(f"{nm} must be contiguous, got strides {tuple(x.stride())}")
            self._agrs_open("all_gather", len(tensors))
        except _ERRORS as e:
            eng._fail("all_gather", e)
        eng._agree(Header("all_gather", _sizes_fields(tensors)))
        s, R, me = self._agrs, self.num_ranks, self.rank_idx
        outs, works = [], []
        for x in tensors:
            nbytes = x.numel() * x.element_size()
            src = x.view(-1).view(torch.uint8) if x.numel() else torch.empty((0,), dtype=torch.uint8,
                                                                              device=x.device)
            off = s["inplace"].pop((src.data_ptr(), nbytes), None) if nbytes else None
            if off is None:
                off = self._agrs_alloc(R * nbytes)
            region = s["buf"][off:off + R * nbytes]
            if self.device.type == "cpu" and region.numel() and src.data_ptr() == region[me * nbytes:].data_ptr():
                src = src.clone()  # gloo copies the input into the output: no aliasing
            works.append(dist.all_gather_into_tensor(region, src, group=self.group, async_op=True))
            outs.append(region.view(x.dtype).view((R,) + tuple(x.shape)))
        s["count"] += len(tensors)
        s["works"].extend(works)
        state: List[bool] = []

        def hook() -> None:
            """Wait for the gathered data (idempotent)."""
            if not state:
                for w in works:
                    w.wait()
                state.append(True)

        return (outs[0], hook) if single else (*outs, hook)

    def reduce_scatter(self, t: Union[torch.Tensor, Sequence[torch.Tensor]]):
        """tritile's addition to AGRS (DeepEP has no reduce-scatter call at dd758ca): ``t`` ``(R, *shape)`` per
        rank; rank ``r`` gets the sum over ranks of their ``t[r]``, deterministic: float32 in ascending rank order,
        one rounding to ``t``'s dtype.  Inside a session; returns ``(reduced, hook)`` (``(*reduced, hook)`` for a
        sequence), valid after ``hook()``."""
        eng = self._engine
        single = isinstance(t, torch.Tensor)
        try:
            tensors = (t,) if single else tuple(t)
            for i, x in enumerate(tensors):
                nm = "t" if single else f"t[{i}]"
                check_tensor(nm, x, dtypes=(torch.bfloat16, torch.float16, torch.float32))
                eng._check_device(nm, x)
                if x.dim() < 1 or x.shape[0] != self.num_ranks or not x.is_contiguous():
                    raise ValueError(f"{nm} must be a contiguous ({self.num_ranks}, ...) tensor, got shape "
                                     f"{tuple(x.shape)}")
            self._agrs_open("reduce_scatter", 0)
        except _ERRORS as e:
            eng._fail("reduce_scatter", e)
        eng._agree(Header("reduce_scatter", _sizes_fields(tensors)))
        outs, pending = [], []
        for x in tensors:
            got = torch.empty_like(x)
            work = a2a_rows(got.view(self.num_ranks, -1), x.view(self.num_ranks, -1), None, None, self.group,
                            async_op=True)
            out = torch.empty(tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            outs.append(out)
            pending.append((work, got, out))
        self._agrs["works"].extend(w for w, _, _ in pending)
        state: List[bool] = []

        def hook() -> None:
            """Wait and reduce (idempotent)."""
            if not state:
                for work, got, out in pending:
                    work.wait()
                    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
                    for r in range(self.num_ranks):
                        acc += got[r].float()
                    out.copy_(acc)
                state.append(True)

        return (outs[0], hook) if single else (*outs, hook)


def _sizes_fields(tensors) -> List[Tuple[str, int, bool]]:
    """Header fields every rank must agree on for a gather or reduce-scatter of ``tensors``: their count, their total
    bytes and a fingerprint of each one's bytes (equal totals of different splits would reach the backend with
    mismatched sizes)."""
    sizes = [x.numel() * x.element_size() for x in tensors]
    return [("tensors", len(sizes), True), ("bytes", sum(sizes), True),
            ("per-tensor bytes (fingerprint)", zlib.crc32(repr(sizes).encode()), True)]


def _is_batch(shapes) -> bool:
    """True for a sequence of shapes, False for one shape (a tuple / ``torch.Size`` of ints)."""
    if isinstance(shapes, torch.Size):
        return False
    if not isinstance(shapes, (tuple, list)) or len(shapes) == 0:
        raise TypeError(f"shapes must be a shape or a sequence of shapes, got {shapes!r}")
    first = shapes[0]
    if isinstance(first, (tuple, list, torch.Size)):
        return True
    if _is_int(first):
        return False
    raise TypeError(f"shapes must be a shape or a sequence of shapes, got {shapes!r}")
