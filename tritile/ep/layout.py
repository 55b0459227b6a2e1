"""Dispatch layout: which ranks each token goes to, per-rank / per-expert counts and send slots.

Two launches, no atomics, no spin-waits (so the CPU interpreter, which runs programs one after another, computes
the same bits as the GPU):

1. ``_layout_count_kernel`` (one program per ``BLOCK_T`` tokens): the token-to-rank mask ``is_token_in_rank``
   (a token goes to rank ``r`` once, however many of its experts live there), the block's per-rank token counts
   and its per-expert histogram, and the number of expert ids outside ``[-1, E)`` (ignored for routing,
   reported so that ``Buffer.dispatch`` can raise on every rank);
2. ``_layout_scan_kernel`` (same grid): the exclusive prefix of the earlier blocks' per-rank counts plus the
   in-block inclusive scan gives ``send_slot[t, r]``, the position of token ``t`` among the tokens this rank
   sends to rank ``r`` (ascending ``t``; ``-1`` where not sent).  Each program also reduces a slice of the
   per-expert histogram table into ``num_tokens_per_expert``; program 0 writes ``num_tokens_per_rank``.

The two scratch tables share one int32 allocation.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language.pdl import pdl_enter
from ..runtime import check_tensor, checks_enabled, custom_op, empty, interpreter_configs, kernel_device_ok
from ..runtime.plan import planned
from ..utils import ceil_div, next_power_of_two

__all__ = ["dispatch_layout", "check_layout_args", "raise_on_bad_ids"]

_INTERPRET = interpreter_configs()


@triton.jit
def _layout_count_kernel(topk_ptr, stride_t, stride_k, mask_ptr, table_ptr, hist_ptr, num_tokens, num_experts,
                         experts_per_rank,
                         NUM_TOPK: tl.constexpr, NUM_RANKS: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    m = row_ok[:, None] & (cols[None, :] < NUM_TOPK)
    idx = tl.load(topk_ptr + rows[:, None] * stride_t + cols[None, :] * stride_k, mask=m, other=-1)
    # ranges on the loaded (int64) ids: a cast first would wrap ids past 2**31 into range
    valid = (idx >= 0) & (idx < num_experts) & m
    bad = tl.sum(tl.sum(((idx != -1) & m & ~valid).to(tl.int32), axis=1), axis=0)
    idx = tl.where(valid, idx, -1).to(tl.int32)
    rank = tl.where(valid, idx // experts_per_rank, -1)
    rr = tl.arange(0, BLOCK_R)
    hit = tl.max((rank[:, :, None] == rr[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, BLOCK_R]
    rmask = row_ok[:, None] & (rr[None, :] < NUM_RANKS)
    tl.store(mask_ptr + rows[:, None] * NUM_RANKS + rr[None, :], hit.to(tl.int8), mask=rmask)
    cnt = tl.sum(tl.where(rmask, hit, 0), axis=0)  # [BLOCK_R]
    # table row: per-rank counts, then the bad-id count in column NUM_RANKS
    tl.store(table_ptr + pid * (NUM_RANKS + 1) + rr, cnt, mask=rr < NUM_RANKS)
    tl.store(table_ptr + pid * (NUM_RANKS + 1) + NUM_RANKS, bad)
    flat = tl.reshape(tl.where(valid, idx, 0), [BLOCK_T * BLOCK_K])
    nvalid_off = tl.sum(tl.sum((~valid).to(tl.int32), axis=1), axis=0)
    ee = tl.arange(0, BLOCK_E)
    h = tl.histogram(flat, BLOCK_E)
    h = h - tl.where(ee == 0, nvalid_off, 0)  # invalid slots were counted as expert 0
    tl.store(hist_ptr + pid.to(tl.int64) * num_experts + ee, h, mask=ee < num_experts)


@triton.jit
def _layout_scan_kernel(mask_ptr, table_ptr, hist_ptr, slot_ptr, per_rank_ptr, per_expert_ptr, bad_ptr,
                        num_tokens, num_experts, num_blocks,
                        NUM_RANKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_P: tl.constexpr, EPB: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pp = tl.arange(0, BLOCK_P)
    rr = tl.arange(0, BLOCK_R)
    tmask = (pp[:, None] < num_blocks) & (rr[None, :] < NUM_RANKS + 1)
    table = tl.load(table_ptr + pp[:, None] * (NUM_RANKS + 1) + rr[None, :], mask=tmask, other=0)
    before = tl.sum(tl.where(pp[:, None] < pid, table, 0), axis=0)  # [BLOCK_R] exclusive prefix over blocks
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = (rows[:, None] < num_tokens) & (rr[None, :] < NUM_RANKS)
    hit = tl.load(mask_ptr + rows[:, None] * NUM_RANKS + rr[None, :], mask=rmask, other=0).to(tl.int32)
    pos = before[None, :] + tl.cumsum(hit, axis=0) - 1
    tl.store(slot_ptr + rows[:, None] * NUM_RANKS + rr[None, :], tl.where(hit != 0, pos, -1), mask=rmask)
    if pid == 0:
        total = tl.sum(table, axis=0)
        tl.store(per_rank_ptr + rr, total, mask=rr < NUM_RANKS)
        tl.store(bad_ptr + rr * 0, total, mask=rr == NUM_RANKS)
    # this program's slice of the expert histogram table
    ee = pid * EPB + tl.arange(0, EPB)
    emask = ee < num_experts
    hmask = (pp[:, None] < num_blocks) & emask[None, :]
    h = tl.load(hist_ptr + pp[:, None].to(tl.int64) * num_experts + ee[None, :], mask=hmask, other=0)
    tl.store(per_expert_ptr + ee, tl.sum(h, axis=0), mask=emask)


def check_layout_args(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> None:
    """Host checks shared by every layout entry point (no device work)."""
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), ndim=2)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts must be divisible by the number of ranks ({num_ranks}), got {num_experts}")
    if num_experts >= 2**31:
        raise ValueError(f"num_experts must be < 2**31, got {num_experts}")


def raise_on_bad_ids(topk_idx: torch.Tensor, num_experts: int, nbad: Optional[int] = None) -> None:
    """The ``TRITILE_CHECKS=1`` data check of expert ids (a host sync): ``ValueError`` when some id lies outside
    ``[-1, num_experts)``.  ``nbad``: the count when a kernel already made it."""
    if nbad is None:
        nbad = int(((topk_idx != -1) & ((topk_idx < 0) | (topk_idx >= num_experts))).sum())
    if nbad:
        raise ValueError(f"topk_idx must hold expert ids in [-1, {num_experts}), got {nbad} id(s) outside")


def _config(num_tokens: int, num_topk: int, num_ranks: int) -> dict:
    bk, br = next_power_of_two(num_topk), next_power_of_two(num_ranks + 1)
    if _INTERPRET:
        bt = 64
    else:
        bt = max(16, min(256, 8192 // (bk * br)))
    return dict(BLOCK_T=bt, BLOCK_K=bk, BLOCK_R=br, num_warps=4)


def _layout_kernels(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    num_tokens, num_topk = topk_idx.shape
    dev = topk_idx.device
    cfg = _config(num_tokens, num_topk, num_ranks)
    bt = cfg["BLOCK_T"]
    nblk = max(1, ceil_div(num_tokens, bt))
    is_in = empty((num_tokens, num_ranks), torch.bool, dev)
    slot = empty((num_tokens, num_ranks), torch.int32, dev)
    per_rank = empty((num_ranks,), torch.int32, dev)
    per_expert = empty((num_experts,), torch.int32, dev)
    bad = empty((1,), torch.int32, dev)
    scratch = empty((nblk * (num_ranks + 1 + num_experts),), torch.int32, dev)
    table, hist = scratch[:nblk * (num_ranks + 1)], scratch[nblk * (num_ranks + 1):]
    block_e = next_power_of_two(num_experts)
    _layout_count_kernel[(nblk,)](
        topk_idx, topk_idx.stride(0), topk_idx.stride(1), is_in.view(torch.int8), table, hist, num_tokens,
        num_experts, num_experts // num_ranks,
        NUM_TOPK=num_topk, NUM_RANKS=num_ranks, BLOCK_T=bt, BLOCK_K=cfg["BLOCK_K"], BLOCK_R=cfg["BLOCK_R"],
        BLOCK_E=block_e, PDL=False, num_warps=cfg["num_warps"])
    epb = next_power_of_two(ceil_div(num_experts, nblk))
    _layout_scan_kernel[(max(nblk, ceil_div(num_experts, epb)),)](
        is_in.view(torch.int8), table, hist, slot, per_rank, per_expert, bad, num_tokens, num_experts, nblk,
        NUM_RANKS=num_ranks, BLOCK_T=bt, BLOCK_R=cfg["BLOCK_R"], BLOCK_P=next_power_of_two(nblk), EPB=epb,
        PDL=False, num_warps=cfg["num_warps"])
    return per_rank, per_expert, is_in, slot, bad


def _dispatch_layout_fake(topk_idx, num_experts, num_ranks):
    t = topk_idx.shape[0]
    dev = topk_idx.device
    return (torch.empty((num_ranks,), dtype=torch.int32, device=dev),
            torch.empty((num_experts,), dtype=torch.int32, device=dev),
            torch.empty((t, num_ranks), dtype=torch.bool, device=dev),
            torch.empty((t, num_ranks), dtype=torch.int32, device=dev),
            torch.empty((1,), dtype=torch.int32, device=dev))


@custom_op("ep_dispatch_layout", fake=_dispatch_layout_fake)
def _dispatch_layout_op(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if topk_idx.shape[0] == 0 or not kernel_device_ok(topk_idx.device):
        from .ref import dispatch_layout_ref

        return dispatch_layout_ref(topk_idx, num_experts, num_ranks)
    return _layout_kernels(topk_idx, num_experts, num_ranks)


@planned("ep_dispatch_layout")
def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layout of one dispatch: the rank mask, counts and send slots.

    Args:
        topk_idx: int64 or int32 ``(T, k)`` (any strides): expert ids in ``[0, num_experts)``, ``-1`` = unused
            slot.  Ids outside ``[-1, num_experts)`` are ignored for routing and counted in ``num_bad_ids``
            (with ``TRITILE_CHECKS=1`` they raise ``ValueError`` here, a host sync).
        num_experts: ``E``, divisible by ``num_ranks``; expert ``e`` lives on rank ``e // (E / R)``.
        num_ranks: ``R``.

    Returns:
        ``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, send_slot, num_bad_ids)``:
        int32 ``(R,)`` tokens with at least one expert on each rank (deduplicated); int32 ``(E,)`` (token, slot)
        pairs per expert; bool ``(T, R)``; int32 ``(T, R)`` the position of token ``t`` among the tokens sent to
        rank ``r`` in ascending token order, ``-1`` where not sent; int32 ``(1,)``.  CPU tensors without the
        Triton interpreter run :func:`tritile.ep.ref.dispatch_layout_ref` (same bits).
    """
    check_layout_args(topk_idx, num_experts, num_ranks)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    out = _dispatch_layout_op(topk_idx, num_experts, num_ranks)
    if checks_enabled():
        raise_on_bad_ids(topk_idx, num_experts, int(out[4].item()))
    return out
