"""``normalize_weight``: divide top-k weights by their sequential sum (``tile_kernels.moe.normalize_weight``)."""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from tritile.config import get_num_sms
from tritile.runtime import custom_op
from tritile.runtime import (check_contiguous, check_device, check_tensor, empty, interpreter_configs, is_interpreter,
                             tuned)
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.utils import ceil_div, next_power_of_two
from tritile.runtime.plan import planned

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["normalize_weight"]


@triton.jit
def _fma(a, b, c, EMU: tl.constexpr):
    """``a * b + c`` rounded once.  ``EMU`` (the interpreter, whose ``tl.fma`` rounds twice): in float64, exact
    for the remainders below (48-bit product, cancelling sum) and for the corrections except in double-rounding
    ties far rarer than the tests' inputs can reach."""
    if EMU:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _div_by_recip(w, d, r, EMU: tl.constexpr):
    """``w / d`` correctly rounded from ``r = div_rn(1, d)`` (broadcast like ``d``), for normal operands
    and quotients with margin (the caller's ``_recip_ok``).  q0 = w * r is within 2 ulps; one correction
    q1 = q0 + (w - q0 d) r makes it faithful; Markstein's theorem (r within half an ulp of 1/d, q1 faithful,
    no underflow) makes the remainder w - q1 d exact and q2 = RN(q1 + rem r) the correctly rounded quotient.
    A zero w keeps q0's signed zero (q2 would be +0 for w = -0)."""
    q0 = w * r
    q1 = _fma(_fma(-q0, d, w, EMU), r, q0, EMU)
    q2 = _fma(_fma(-q1, d, w, EMU), r, q1, EMU)
    return tl.where(w == 0, q0, q2)


@triton.jit
def _recip_ok(w, d_ok):
    """Where ``_div_by_recip`` is exact: |d| in [2^-20, 2^20] (``d_ok``) and w zero or |w| in [2^-80, 2^100], so
    1/d, every quotient (|q| in [2^-100, 2^120]) and the remainders (multiples of >= 2^-130) stay normal and
    nothing overflows.  NaN / inf / subnormal operands fail (comparisons with NaN are false)."""
    aw = tl.abs(w)
    return d_ok & (((aw >= 8.271806125530277e-25) & (aw <= 1.2676506002282294e30)) | (w == 0))


@triton.jit
def _halves(x):
    """``[R, N]`` -> its columns ``[0, N/2)`` and ``[N/2, N)`` as two ``[R, N/2]`` tensors."""
    R: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [R, 2, N // 2]), [0, 2, 1]))


@triton.jit
def _add4(acc, x4, BASE: tl.constexpr, K: tl.constexpr):
    """``acc + x4[:, 0] + x4[:, 1] + ...`` left to right over the columns ``BASE + j < K`` of a ``[R, 4]`` tile."""
    p, q = _halves(x4)
    c0, c1 = tl.split(p)
    c2, c3 = tl.split(q)
    if BASE < K:
        acc = acc + c0
    if BASE + 1 < K:
        acc = acc + c1
    if BASE + 2 < K:
        acc = acc + c2
    if BASE + 3 < K:
        acc = acc + c3
    return acc


@triton.jit
def _row_sums_split(w, acc, K: tl.constexpr):
    """The sequential row sums ``acc + w[:, 0] + ... + w[:, K-1]`` of a ``[R, BK]`` tile (BK in 4, 8, 16), the
    columns taken apart by reshapes and splits (a relayout) instead of one lane reduction per column."""
    BK: tl.constexpr = w.shape[1]
    if BK == 4:
        acc = _add4(acc, w, 0, K)
    elif BK == 8:
        a0, a1 = _halves(w)
        acc = _add4(acc, a0, 0, K)
        acc = _add4(acc, a1, 4, K)
    else:
        tl.static_assert(BK == 16)
        a, b = _halves(w)
        a0, a1 = _halves(a)
        b0, b1 = _halves(b)
        acc = _add4(acc, a0, 0, K)
        acc = _add4(acc, a1, 4, K)
        acc = _add4(acc, b0, 8, K)
        acc = _add4(acc, b1, 12, K)
    return acc


@triton.jit
def _normalize_weight_kernel(w_ptr, denom_ptr, out_ptr, num_tokens,
                             NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                             PER_COL: tl.constexpr, RCP: tl.constexpr, EMU: tl.constexpr, PDL: tl.constexpr,
                             SPLIT: tl.constexpr = False):
    """``PER_COL``: each column loaded as its own ``[BLOCK_T]`` vector (a row stays in one thread: the
    sequential sum needs no shuffles).  Otherwise one ``[BLOCK_T, BLOCK_K]`` tile, columns extracted by
    select-sums (a row may span lanes), or with ``SPLIT`` by reshapes and splits (``_row_sums_split``).
    ``RCP`` (the tile path): one ``div_rn(1, d)`` per row and three multiply-adds per element
    instead of a full division per element (MUFU.RCP, Newton step, FCHK check and slow-path branch each), same
    bits; the block falls back to ``div_rn`` when any of its elements is outside ``_recip_ok``'s range (one
    block-wide max, uniform branch).  ``EMU``: emulated fused multiply-adds (interpreter only)."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    if PER_COL:
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
        if SPLIT:
            denom = _row_sums_split(w, denom, NUM_TOPK)
        else:
            for k in tl.static_range(NUM_TOPK):
                denom = denom + tl.sum(tl.where(cols[None, :] == k, w, 0.0), axis=1)
        tl.store(denom_ptr + rows, denom, mask=row_ok)
        # the fast path's names exist only inside the constexpr RCP branch: the GPU compiler (unlike the
        # interpreter) does not let a later run-time `if` read a name a constexpr-false branch never defined
        if RCP:
            r = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), denom)[:, None]
            ad = tl.abs(denom)
            d_ok = ((ad >= 9.5367431640625e-07) & (ad <= 1048576.0)) | (rows >= num_tokens)  # padded rows: w = 0
            if tl.max(tl.where(_recip_ok(w, d_ok[:, None]), 0, 1)) == 0:
                tl.store(out_ptr + offs, _div_by_recip(w, denom[:, None], r, EMU), mask=m)
            else:
                tl.store(out_ptr + offs, tl.math.div_rn(w, denom[:, None]), mask=m)
        else:
            tl.store(out_ptr + offs, tl.math.div_rn(w, denom[:, None]), mask=m)


def _config(num_tokens: int, num_topk: int, num_sms: int, interpret: bool) -> dict:
    """Default launch config: ``[BLOCK_T, next_pow2(K)]`` tiles.  Launch configs go through
    ``tritile.runtime.tuned("normalize_weight", ...)``; keys ``BLOCK_T``, ``PER_COL``, ``RCP`` (reciprocal +
    corrections; not with ``PER_COL``), ``SPLIT`` (the tile's columns taken apart by reshapes and splits for the
    row sums, for 3 to 16 columns: at K = 9 the select-sums' lane reductions are 288 SHFL of a 1496-instruction
    program on sm_90, SPLIT has none in 904; the GPU default where K is not a power of two), ``num_warps``, ``PDL``
    (programmatic dependent launch where supported; default on).  A row-per-thread variant (two 16-byte halves, no
    shuffles) measured 3.03-5.56 us graph against 2.66 us on the H200 (H200 @ 694bd6c) and was removed."""
    # H200 (2026-11-30, T=21876, K=8, CUPTI with L2 flushed): RCP on [32, 8] tiles x 1 warp 2.02 us, RCP on
    # [128, 8] x 4 warps 2.10, the plain division on [128, 8] x 4 warps (the previous default) 2.32, the
    # per-column variant (64 rows, 2 warps) 4.2 (graph).  The interpreter keeps the plain division (its
    # emulated FMAs round in float64).
    # Rows a program: at most 256 elements of the tile (8 a lane), fewer when that leaves SMs idle: at least two
    # programs per SM where the rows allow (K = 2, T = 8037: [32, 2] tiles, 252 programs, where [128, 2] gave 63).
    if interpret:
        return dict(BLOCK_T=max(16, 1024 // next_power_of_two(num_topk)), PER_COL=False, RCP=False, SPLIT=False,
                    num_warps=1)
    cap = max(4, 256 // next_power_of_two(num_topk))
    block_t = min(cap, max(4, next_power_of_two(ceil_div(num_tokens, 2 * max(num_sms, 1)))))
    # SPLIT where a row does not fill its tile row (K not a power of two).  H200, 2026-12-02, commit be9d783 (CUPTI
    # with L2 flushed, same bits): K = 9 5.79 -> 3.01 us (T = 23381), 5.81 -> 3.08, 6.51 -> 3.60 (T = 36056); K = 6
    # 2.14 -> 2.06 (T = 18663, TileKernels 1.88), 2.24 -> 2.18
    split = num_topk & (num_topk - 1) != 0
    return dict(BLOCK_T=block_t, PER_COL=False, RCP=True, SPLIT=split, num_warps=1)


def _normalize_weight_fake(topk_weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return topk_weights.new_empty(topk_weights.shape[:1]), topk_weights.new_empty(topk_weights.shape)


@planned("normalize_weight")
@custom_op("moe_normalize_weight", fake=_normalize_weight_fake)
def normalize_weight(topk_weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
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
    cfg = tuned("normalize_weight", _config(num_tokens, num_topk, get_num_sms(), _INTERPRET))
    _normalize_weight_kernel[(ceil_div(num_tokens, cfg["BLOCK_T"]),)](
        topk_weights, denom, out, num_tokens,
        NUM_TOPK=num_topk, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=next_power_of_two(num_topk), PER_COL=bool(cfg["PER_COL"]),
        RCP=bool(cfg["RCP"]) and not cfg["PER_COL"], EMU=is_interpreter(),
        SPLIT=bool(cfg["SPLIT"]) and not cfg["PER_COL"] and next_power_of_two(num_topk) in (4, 8, 16),
        num_warps=cfg["num_warps"], **pdl_args(dev, cfg.get("PDL", True)))
    return denom, out
