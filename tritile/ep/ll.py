"""Low-latency (fixed-capacity) receive layout: per-local-expert slabs ``[L, R*M, ...]`` without a host sync.

The low-latency path of :class:`tritile.ep.Buffer` sends each token once per destination rank (deduplicated, like
the high-throughput path) into fixed-capacity blocks of ``M`` rows per (source, destination) pair, so the
exchange is one equal-split ``all_to_all_single`` with no split lists, no host sync, and CUDA-graph capture works.
On the receiver the rows arrive as ``R`` blocks of ``M`` (valid rows first, in ascending source token order).

:func:`ll_positions` places them into per-expert slabs: one program per local expert scans the received rows in
order (ascending source rank, then source token) and gives every (row, slot) selecting the expert the next
position of the expert's slab; one more program marks the ``-1`` slots.  So, stronger than DeepEP's atomics,
block order across sources and row order inside a block are fixed.  It also writes ``recv_count``,
``src_info`` (``-1`` past the count) and ``layout_range`` (``(begin << 32) | count`` per source).

This is not DeepEP's zero-SM RDMA path: NCCL kernels occupy SMs while the exchange is in flight, and a
``return_recv_hook`` only defers the wait (see ``Buffer.low_latency_dispatch``).
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..language.pdl import pdl_enter
from ..runtime import check_tensor, custom_op, empty, interpreter_configs, kernel_device_ok
from ..runtime.plan import planned
from ..utils import next_power_of_two

__all__ = ["ll_positions"]

_INTERPRET = interpreter_configs()


@triton.jit
def _ll_positions_kernel(idx_ptr, src_ptr, pos_ptr, count_ptr, info_ptr, range_ptr,
                         NUM_LOCAL: tl.constexpr, NUM_RANKS: tl.constexpr, CAP: tl.constexpr,
                         NUM_TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    e = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    kin = kk[None, :] < NUM_TOPK
    RM: tl.constexpr = NUM_RANKS * CAP
    if e < NUM_LOCAL:
        running = tl.sum(tl.zeros([BLOCK_M], tl.int32), axis=0)
        for s in tl.static_range(NUM_RANKS):
            begin = running
            for c in tl.static_range(0, CAP, BLOCK_M):
                i = c + tl.arange(0, BLOCK_M)
                rows = (s * CAP + i).to(tl.int64)
                ok = i < CAP
                idx = tl.load(idx_ptr + rows[:, None] * NUM_TOPK + kk[None, :], mask=ok[:, None] & kin, other=-1)
                sel = (idx == e) & ok[:, None] & kin
                hit = tl.max(sel.to(tl.int32), axis=1)
                p = running + tl.cumsum(hit, axis=0) - 1
                tl.store(pos_ptr + rows[:, None] * NUM_TOPK + kk[None, :], (e * RM + p)[:, None] + kk[None, :] * 0,
                         mask=sel)
                src = tl.load(src_ptr + rows, mask=ok, other=-1)
                tl.store(info_ptr + e * RM + p, src, mask=hit != 0)
                running += tl.sum(hit, axis=0)
            tl.store(range_ptr + e * NUM_RANKS + s, (begin.to(tl.int64) << 32) | (running - begin).to(tl.int64))
        tl.store(count_ptr + e, running)
        for c in tl.static_range(0, RM, BLOCK_M):
            j = c + tl.arange(0, BLOCK_M)
            tl.store(info_ptr + e * RM + j, tl.full([BLOCK_M], -1, tl.int32), mask=(j < RM) & (j >= running))
    else:
        for c in tl.static_range(0, RM, BLOCK_M):
            rows = (c + tl.arange(0, BLOCK_M)).to(tl.int64)
            ok = rows < RM
            idx = tl.load(idx_ptr + rows[:, None] * NUM_TOPK + kk[None, :], mask=ok[:, None] & kin, other=0)
            bad = ok[:, None] & kin & ((idx < 0) | (idx >= NUM_LOCAL))
            tl.store(pos_ptr + rows[:, None] * NUM_TOPK + kk[None, :], tl.full([BLOCK_M, BLOCK_K], -1, tl.int32),
                     mask=bad)


def _ll_positions_fake(recv_idx, recv_src, num_local_experts, num_ranks, capacity):
    rm = num_ranks * capacity
    return (recv_idx.new_empty(recv_idx.shape, dtype=torch.int32),
            recv_idx.new_empty((num_local_experts,), dtype=torch.int32),
            recv_idx.new_empty((num_local_experts, rm), dtype=torch.int32),
            recv_idx.new_empty((num_local_experts, num_ranks), dtype=torch.int64))


@custom_op("ep_ll_positions", fake=_ll_positions_fake)
def _ll_positions_op(recv_idx: torch.Tensor, recv_src: torch.Tensor, num_local_experts: int, num_ranks: int,
                     capacity: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = recv_idx.device
    rm = num_ranks * capacity
    pos = empty(tuple(recv_idx.shape), torch.int32, dev)
    count = empty((num_local_experts,), torch.int32, dev)
    info = empty((num_local_experts, rm), torch.int32, dev)
    rng = empty((num_local_experts, num_ranks), torch.int64, dev)
    if not kernel_device_ok(dev) or rm == 0:
        from .ref import ll_positions_ref

        for o, r in zip((pos, count, info, rng), ll_positions_ref(recv_idx, recv_src, num_local_experts, num_ranks,
                                                                  capacity)):
            o.copy_(r)
        return pos, count, info, rng
    k = recv_idx.shape[1]
    bm = min(next_power_of_two(capacity), 256 if _INTERPRET else 128)
    _ll_positions_kernel[(num_local_experts + 1,)](
        recv_idx, recv_src, pos, count, info, rng,
        NUM_LOCAL=num_local_experts, NUM_RANKS=num_ranks, CAP=capacity, NUM_TOPK=k, BLOCK_M=bm,
        BLOCK_K=next_power_of_two(max(k, 1)), PDL=False, num_warps=4)
    return pos, count, info, rng


@planned("ep_ll_positions")
def ll_positions(recv_idx: torch.Tensor, recv_src: torch.Tensor, num_local_experts: int, num_ranks: int,
                 capacity: int):
    """Slab positions of the rows received in fixed-capacity blocks.

    Args:
        recv_idx: int32 or int64 ``(R*M, k)``, contiguous: local expert ids of each received row (``-1`` = other rank or
            padding row); row ``s*M + i`` is the ``i``-th row from source rank ``s``.
        recv_src: int32 ``(R*M,)``: source token index of each row.
        num_local_experts: ``L``; num_ranks: ``R``; capacity: ``M``.

    Returns:
        ``(pos, recv_count, src_info, layout_range)``: int32 ``(R*M, k)`` flat slab row ``e*R*M + j`` of each
        (row, slot) (``-1`` for ``-1`` slots); int32 ``(L,)`` rows per expert; int32 ``(L, R*M)`` source token of
        each slab row (``-1`` past the count); int64 ``(L, R)`` ``(begin << 32) | count`` per source rank.
    """
    check_tensor("recv_idx", recv_idx, dtypes=(torch.int32, torch.int64), ndim=2)
    check_tensor("recv_src", recv_src, dtypes=(torch.int32,), ndim=1)
    if recv_idx.shape[0] != num_ranks * capacity or recv_src.shape[0] != recv_idx.shape[0]:
        raise ValueError(f"recv_idx must have R*M = {num_ranks * capacity} rows and recv_src as many, got "
                         f"{tuple(recv_idx.shape)} and {tuple(recv_src.shape)}")
    return _ll_positions_op(recv_idx.contiguous(), recv_src.contiguous(), int(num_local_experts), int(num_ranks),
                            int(capacity))
