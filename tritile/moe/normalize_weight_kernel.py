"""``normalize_weight``: divide top-k weights by their sequential sum (``tile_kernels.moe.normalize_weight``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritile.runtime import check_contiguous, check_device, check_tensor, empty, interpreter_configs, tuned
from tritile.utils import ceil_div, next_power_of_two

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["normalize_weight"]


@triton.jit
def _normalize_weight_kernel(w_ptr, denom_ptr, out_ptr, num_tokens,
                             NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                             PER_COL: tl.constexpr, QUADS: tl.constexpr):
    """``QUADS`` (``NUM_TOPK <= 8``): the row as two ``[BLOCK_T, 4]`` tiles (columns 0-3 and 4-7), each a
    16-byte vector held by one thread (``BLOCK_T >= 32 * num_warps``), so the whole row sits in one thread:
    both loads go out at once, the sequential sum is 8 in-thread adds (no shuffles), one pass.
    ``PER_COL``: each column loaded as its own ``[BLOCK_T]`` vector (a row stays in one thread: the
    sequential sum needs no shuffles).  Otherwise one ``[BLOCK_T, BLOCK_K]`` tile, columns extracted by
    select-sums (a row may span lanes)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    if QUADS:
        q = tl.arange(0, 4)
        # Column masks only where a quad is partial: a mask that varies along the quad (even an always-true
        # `q < 8`) stops the 16-byte vectorisation (sm_90 SASS: 8 scalar LDG.E and 64 SHFL per thread with it,
        # 2 LDG.E.128 and no SHFL without).
        if NUM_TOPK >= 4:
            m0 = row_ok[:, None]  # broadcast by the load
        else:
            m0 = row_ok[:, None] & (q < NUM_TOPK)[None, :]
        offs0 = rows[:, None] * NUM_TOPK + q[None, :]
        w0 = tl.load(w_ptr + offs0, mask=m0, other=0.0)
        if NUM_TOPK > 4:  # compile-time: w1 exists only when used
            if NUM_TOPK == 8:
                m1 = m0
            else:
                m1 = row_ok[:, None] & (q + 4 < NUM_TOPK)[None, :]
            w1 = tl.load(w_ptr + offs0 + 4, mask=m1, other=0.0)
        # Strictly sequential float32 sum, left to right.  A column is extracted exactly by a select-sum of one
        # value and three zeros inside the thread (the running sum is never -0.0).
        denom = tl.full([BLOCK_T], 1e-20, tl.float32)
        for k in tl.static_range(4):
            if k < NUM_TOPK:
                denom = denom + tl.sum(tl.where(q[None, :] == k, w0, 0.0), axis=1)
        if NUM_TOPK > 4:
            for k in tl.static_range(4):
                if k + 4 < NUM_TOPK:
                    denom = denom + tl.sum(tl.where(q[None, :] == k, w1, 0.0), axis=1)
        tl.store(denom_ptr + rows, denom, mask=row_ok)
        tl.store(out_ptr + offs0, tl.math.div_rn(w0, denom[:, None]), mask=m0)
        if NUM_TOPK > 4:
            tl.store(out_ptr + offs0 + 4, tl.math.div_rn(w1, denom[:, None]), mask=m1)
    elif PER_COL:
        # Strictly sequential float32 sum, left to right.  Loads first (all in flight), then the adds.
        denom = tl.full([BLOCK_T], 1e-20, tl.float32)
        for k in tl.static_range(NUM_TOPK):
            denom = denom + tl.load(w_ptr + rows * NUM_TOPK + k, mask=row_ok, other=0.0)
        tl.store(denom_ptr + rows, denom, mask=row_ok)
        for k in tl.static_range(NUM_TOPK):
            w = tl.load(w_ptr + rows * NUM_TOPK + k, mask=row_ok, other=0.0)
            tl.store(out_ptr + rows * NUM_TOPK + k, tl.math.div_rn(w, denom), mask=row_ok)
    else:
        cols = tl.arange(0, BLOCK_K)
        m = row_ok[:, None] & (cols[None, :] < NUM_TOPK)
        offs = rows[:, None] * NUM_TOPK + cols[None, :]
        w = tl.load(w_ptr + offs, mask=m, other=0.0)
        # Strictly sequential float32 sum, left to right (tl.sum's tree order is unspecified).  Each
        # column is extracted exactly: a sum of one value and zeros (the running sum is never -0.0).
        denom = tl.full([BLOCK_T], 1e-20, tl.float32)
        for k in tl.static_range(NUM_TOPK):
            denom = denom + tl.sum(tl.where(cols[None, :] == k, w, 0.0), axis=1)
        tl.store(denom_ptr + rows, denom, mask=row_ok)
        tl.store(out_ptr + offs, tl.math.div_rn(w, denom[:, None]), mask=m)


def _config(num_topk: int, interpret: bool) -> dict:
    """Default launch config: ``[BLOCK_T, next_pow2(K)]`` tiles.  Launch configs go through
    ``tritile.runtime.tuned("normalize_weight", ...)``; keys ``BLOCK_T``, ``PER_COL``, ``QUADS`` (taken only
    when ``K <= 8``), ``num_warps``."""
    # H200 (2026-11-30): the per-column variant (64 rows, 2 warps) ran 4.2 us against 2.3 us for the tile
    # variant below (1024 / next_pow2(K) rows, 4 warps), which stays the default until a sweep says otherwise
    bt = max(16, 1024 // next_power_of_two(num_topk))
    if interpret:
        return dict(BLOCK_T=bt, PER_COL=False, QUADS=False, num_warps=1)
    return dict(BLOCK_T=bt, PER_COL=False, QUADS=False, num_warps=4)


def normalize_weight(topk_weights: torch.Tensor):
    """Normalise every token's top-k weights by their sum.

    Args:
        topk_weights: float32 ``(num_tokens, num_topk)``, contiguous.

    Returns:
        ``(denominator, normalized_weights)``: float32 ``(num_tokens,)`` with
        ``((1e-20 + w[t,0]) + w[t,1]) + ... + w[t,K-1]`` summed left to right in float32, and float32
        ``(num_tokens, num_topk)`` with ``w / denominator`` (IEEE round-to-nearest division).  Bitwise
        equal to ``tritile.torch.normalize_weight`` on every backend.
    """
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
    check_contiguous("topk_weights", topk_weights)
    check_device("topk_weights", topk_weights)
    num_tokens, num_topk = topk_weights.shape
    dev = topk_weights.device
    denom = empty((num_tokens,), torch.float32, dev)
    out = empty((num_tokens, num_topk), torch.float32, dev)
    if num_tokens == 0 or num_topk == 0:
        if num_topk == 0 and num_tokens:
            denom.fill_(1e-20)
        return denom, out
    cfg = tuned("normalize_weight", _config(num_topk, _INTERPRET))
    _normalize_weight_kernel[(ceil_div(num_tokens, cfg["BLOCK_T"]),)](
        topk_weights, denom, out, num_tokens,
        NUM_TOPK=num_topk, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=next_power_of_two(num_topk), PER_COL=bool(cfg["PER_COL"]),
        QUADS=bool(cfg.get("QUADS", False)) and num_topk <= 8, num_warps=cfg["num_warps"])
    return denom, out
