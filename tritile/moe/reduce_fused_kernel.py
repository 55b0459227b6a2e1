"""``reduce_fused``: sum each token's expert outputs back from the fused layout (weighted, in slot order).

One launch; one program per ``BT`` tokens and ``COL_ITERS`` chunks of ``BH`` columns (GPU default: one token,
its whole row).  The program loads the ``K`` positions and scales ``s = w[t, k] (* x_sf[pos])`` once, then per
chunk gathers the slots' rows ``x[token_topk_to_pos[t, k]]`` in one ``[NS, BT, BH]`` load (all in flight
before the first FMA; the next chunks are prefetched) and accumulates ``acc = fma(x, s, acc)`` in float32 over
the valid slots in order ``k = 0..K-1``; slots with ``-1`` leave ``acc`` untouched.  Then ``acc *= sf`` (fp8
output) and one exact conversion (bf16 RNE / e4m3 clamp + RNE) on store.  With ``NG``, a tile whose tokens
hold at most NG valid slots gathers only those (compacted, in order): at the anchor (ep 64, 4 local experts)
a token holds ~1 of its 6 slots, so summing all six (zeros included) cost ~22 SASS instructions per output
element where the compacted path takes ~5.  bf16 rows are read as int32 pairs (one integer op to widen each
value).  Launch configs go through ``tritile.runtime.tuned("reduce_fused", ...)``.

``tl.fma`` is one rounding on GPUs and two under the CPU interpreter; ``tritile.torch.reduce_fused``
computes the same way on each backend, so results are bit-exact on both.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, f32_to_bf16_bits, f32_to_e4m3_bits

try:  # no clamp before the GPU's satfinite conversion; same bits except the sign of a NaN code
    from ..language.cast import f32_to_e4m3_bits_satfinite as _f32_to_e4m3_bits_fast
except ImportError:  # pragma: no cover - older tritile.language
    _f32_to_e4m3_bits_fast = f32_to_e4m3_bits
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_inner_contiguous, check_no_overlap, check_same_device, check_shape, check_tensor, \
    checks_enabled, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div, next_power_of_two
from tritile.runtime.plan import planned

__all__ = ["reduce_fused"]

_OUT_F32, _OUT_BF16, _OUT_E4M3 = 0, 1, 2


@triton.jit
def _reduce_fused_kernel(x_ptr, xsf_ptr, w_ptr, pos_ptr, sf_ptr, out_ptr,
                         num_tokens, num_expanded, hidden,
                         stride_x, stride_xsf, stride_w0, stride_w1, stride_p0, stride_p1, stride_out,
                         num_col_groups,
                         K: tl.constexpr, IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr, WITH_W: tl.constexpr,
                         WITH_XSF: tl.constexpr, WITH_SF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                         COL_ITERS: tl.constexpr, EVEN_H: tl.constexpr, KP: tl.constexpr, GATHER: tl.constexpr,
                         WORDS: tl.constexpr, PREFETCH: tl.constexpr,
                         SATFINITE: tl.constexpr, SKIP: tl.constexpr, NG: tl.constexpr,
                         PREFETCH_DENSE: tl.constexpr, PDL: tl.constexpr = False):
    """One program per ``[BT tokens, COL_ITERS * BH columns]``.

    ``GATHER``: the ``K`` positions / scales are loaded once as ``[KP, BT]`` tiles and each ``BH``-wide
    chunk is gathered as one ``[KP, BT, BH]`` load (every row load in flight before the first FMA); the
    FMAs then run over ``k = 0..K-1`` in order on rows extracted in registers (a select-sum whose other
    terms are the additive identity: ``0`` for integer bits, ``-0.0`` for floats, so it is exactly the
    selected value).  Otherwise (the first version) slot by slot, loads interleaved with the FMAs.

    Invalid slots (``-1`` / out of range) contribute ``x = +0`` and ``s = -0.0``: ``fma(+0, -0.0, acc)``
    is ``-0.0 + acc == acc`` for every ``acc`` (``-0.0`` included), exactly the reference's ``where``, so no
    select is needed.

    ``NG > 0``: tiles whose rows hold at most ``NG`` valid slots gather only those (the j-th valid slot of
    each row, in order); the others gather all ``K`` (``PREFETCH_DENSE``).  ``SKIP``: a slot that no row of
    the tile holds is skipped by a uniform branch (its loads are masked off anyway).
    """
    pdl_enter(PDL)
    pid = tl.program_id(0)
    tb = pid // num_col_groups
    cg = pid % num_col_groups
    rows = tb.to(tl.int64) * BT + tl.arange(0, BT)
    rm = rows < num_tokens
    if WITH_SF:
        sfv = tl.load(sf_ptr)
    else:
        sfv = 1.0
    if GATHER:
        ks = tl.arange(0, KP)
        m2 = (ks < K)[:, None] & rm[None, :]  # [KP, BT]
        p = tl.load(pos_ptr + rows[None, :] * stride_p0 + ks[:, None] * stride_p1, mask=m2, other=-1)
        ok = m2 & (p >= 0) & (p < num_expanded)
        p64 = tl.where(ok, p, 0).to(tl.int64)
        if WITH_W:
            s = tl.load(w_ptr + rows[None, :] * stride_w0 + ks[:, None] * stride_w1, mask=ok, other=0.0)
        else:
            s = tl.where(ok, 1.0, 0.0)
        if WITH_XSF:
            s = s * tl.load(xsf_ptr + p64 * stride_xsf, mask=ok, other=0.0)
        # invalid slots: x = +0 (masked loads) and s = -0.0, so fma(x, s, acc) = -0.0 + acc == acc for every
        # acc (-0.0 included), exactly the reference's where
        s = tl.where(ok, s, -0.0)
        if NG > 0:
            # compaction: the j-th valid slot of each row (ascending k, so the FMA order is kept).  Tiles whose
            # rows hold at most NG valid slots (at the anchor 97 % of tokens hold one) gather only those NG
            # rows per chunk; the others take the full gather (a uniform branch per program).
            nvmax = tl.max(tl.sum(ok.to(tl.int32), axis=0), axis=0)
            if nvmax <= NG:
                rank = tl.cumsum(ok.to(tl.int32), axis=0) - 1  # [KP, BT]
                js = tl.arange(0, NG)
                sel = ok[None, :, :] & (rank[None, :, :] == js[:, None, None])  # [NG, KP, BT]
                gp = tl.sum(tl.where(sel, p64[None, :, :], 0), axis=1)  # [NG, BT]
                gs = tl.sum(tl.where(sel, s[None, :, :], -0.0), axis=1)
                gok = tl.max(sel.to(tl.int32), axis=1) > 0
                _reduce_chunks(x_ptr + gp[:, :, None] * stride_x, gok, gs, js, sfv, out_ptr, rows, rm, hidden,
                               stride_out, cg, NG, IN_BF16, OUT_KIND, WITH_SF, BT, BH, COL_ITERS, EVEN_H, WORDS,
                               PREFETCH, SATFINITE, SKIP, 1)
            else:
                _reduce_chunks(x_ptr + p64[:, :, None] * stride_x, ok, s, ks, sfv, out_ptr, rows, rm, hidden,
                               stride_out, cg, K, IN_BF16, OUT_KIND, WITH_SF, BT, BH, COL_ITERS, EVEN_H, WORDS,
                               PREFETCH_DENSE, SATFINITE, True, 0)
        else:
            _reduce_chunks(x_ptr + p64[:, :, None] * stride_x, ok, s, ks, sfv, out_ptr, rows, rm, hidden,
                           stride_out, cg, K, IN_BF16, OUT_KIND, WITH_SF, BT, BH, COL_ITERS, EVEN_H, WORDS,
                           PREFETCH, SATFINITE, SKIP, 0)
    else:
        for c in tl.static_range(COL_ITERS):
            cols = (cg * COL_ITERS + c) * BH + tl.arange(0, BH)
            cm = cols < hidden
            acc = tl.zeros([BT, BH], dtype=tl.float32)
            for k in tl.static_range(K):
                p = tl.load(pos_ptr + rows * stride_p0 + k * stride_p1, mask=rm, other=-1)
                ok = rm & (p >= 0) & (p < num_expanded)
                p64 = tl.where(ok, p, 0).to(tl.int64)
                if WITH_W:
                    s = tl.load(w_ptr + rows * stride_w0 + k * stride_w1, mask=ok, other=0.0)
                else:
                    s = tl.full([BT], 1.0, dtype=tl.float32)
                if WITH_XSF:
                    s = s * tl.load(xsf_ptr + p64 * stride_xsf, mask=ok, other=0.0)
                if SKIP:
                    if tl.max(ok.to(tl.int32), axis=0) > 0:
                        acc = _slot_fma(x_ptr, p64, ok, s, cols, cm, acc, stride_x, IN_BF16)
                else:
                    acc = _slot_fma(x_ptr, p64, ok, s, cols, cm, acc, stride_x, IN_BF16)
            if WITH_SF:
                acc = acc * sfv
            _store_rows(out_ptr, acc, rows, rm, cols, hidden, stride_out, OUT_KIND, EVEN_H, SATFINITE)


@triton.jit
def _slot_fma(x_ptr, p64, ok, s, cols, cm, acc, stride_x, IN_BF16: tl.constexpr):
    """``acc = fma(x[p], s, acc)`` on the rows where the slot is valid (the others keep ``acc``)."""
    m2 = ok[:, None] & cm[None, :]
    if IN_BF16:
        bits = tl.load(x_ptr + p64[:, None] * stride_x + cols[None, :], mask=m2, other=0)
        xv = bf16_bits_to_f32(bits)
    else:
        xv = tl.load(x_ptr + p64[:, None] * stride_x + cols[None, :], mask=m2, other=0.0)
    return tl.where(ok[:, None], tl.fma(xv, s[:, None], acc), acc)


@triton.jit
def _reduce_chunks(xrow, gok, gs, gk, sfv, out_ptr, rows, rm, hidden, stride_out, cg, NS: tl.constexpr,
                   IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr, WITH_SF: tl.constexpr, BT: tl.constexpr,
                   BH: tl.constexpr, COL_ITERS: tl.constexpr, EVEN_H: tl.constexpr, WORDS: tl.constexpr,
                   PREFETCH: tl.constexpr, SATFINITE: tl.constexpr, SKIP: tl.constexpr, SKIP_FROM: tl.constexpr):
    """Sum the ``NS`` gathered slots (row pointers ``xrow`` ``[NS, BT, 1]``, validity ``gok`` and scales ``gs``
    ``[NS, BT]``, in FMA order) over the program's ``COL_ITERS`` chunks, scale, convert and store.

    Software pipelining, PREFETCH (0..3) chunks ahead: chunks ``c + 1 .. c + PREFETCH`` are in flight while
    chunk ``c`` is summed (``n0`` = chunk c, ``n1`` = c + 1, ``n2`` = c + 2).  ``SKIP``: slots ``j >= SKIP_FROM``
    valid in no row of the tile are skipped (bit j of ``vmask``)."""
    vmask = tl.sum(tl.max(gok.to(tl.int32), axis=1) << gk, axis=0)
    c0 = cg * COL_ITERS
    if PREFETCH >= 1:
        n0 = _gather_chunk(xrow, gok, c0, hidden, IN_BF16, BH, EVEN_H, WORDS)
    if PREFETCH >= 2 and COL_ITERS > 1:
        n1 = _gather_chunk(xrow, gok, c0 + 1, hidden, IN_BF16, BH, EVEN_H, WORDS)
    if PREFETCH >= 3 and COL_ITERS > 2:
        n2 = _gather_chunk(xrow, gok, c0 + 2, hidden, IN_BF16, BH, EVEN_H, WORDS)
    for c in tl.static_range(COL_ITERS):
        if PREFETCH == 0:
            xt = _gather_chunk(xrow, gok, c0 + c, hidden, IN_BF16, BH, EVEN_H, WORDS)
        else:
            xt = n0
            if PREFETCH >= 2:
                if c + 1 < COL_ITERS:
                    n0 = n1
                if PREFETCH >= 3:
                    if c + 2 < COL_ITERS:
                        n1 = n2
                    if c + 3 < COL_ITERS:
                        n2 = _gather_chunk(xrow, gok, c0 + c + 3, hidden, IN_BF16, BH, EVEN_H, WORDS)
                elif c + 2 < COL_ITERS:
                    n1 = _gather_chunk(xrow, gok, c0 + c + 2, hidden, IN_BF16, BH, EVEN_H, WORDS)
            elif c + 1 < COL_ITERS:
                n0 = _gather_chunk(xrow, gok, c0 + c + 1, hidden, IN_BF16, BH, EVEN_H, WORDS)
        acc = _sum_slots(xt, gs, vmask, gk, NS, IN_BF16, BT, BH, WORDS, SKIP, SKIP_FROM)
        if WITH_SF:
            acc = acc * sfv
        cols = (c0 + c) * BH + tl.arange(0, BH)
        _store_rows(out_ptr, acc, rows, rm, cols, hidden, stride_out, OUT_KIND, EVEN_H, SATFINITE)


@triton.jit
def _gather_chunk(xrow, ok, chunk, hidden, IN_BF16: tl.constexpr, BH: tl.constexpr, EVEN_H: tl.constexpr,
                  WORDS: tl.constexpr):
    """The ``[KP, BT, BH]`` tile (``[KP, BT, BH // 2]`` int32 words of bf16 pairs with ``WORDS``) of column
    chunk ``chunk`` of every slot's row; masked slots read ``0``."""
    if WORDS:
        cols = chunk * (BH // 2) + tl.arange(0, BH // 2)
        lim = hidden // 2
    else:
        cols = chunk * BH + tl.arange(0, BH)
        lim = hidden
    if EVEN_H:
        lm = ok[:, :, None]
    else:
        lm = ok[:, :, None] & (cols < lim)[None, None, :]
    if IN_BF16:
        return tl.load(xrow + cols[None, None, :], mask=lm, other=0)
    else:
        return tl.load(xrow + cols[None, None, :], mask=lm, other=0.0)


@triton.jit
def _sum_slots(xt, s, vmask, ks, K: tl.constexpr, IN_BF16: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
               WORDS: tl.constexpr, SKIP: tl.constexpr, SKIP_FROM: tl.constexpr):
    """``acc = fma(x_k, s_k, acc)`` for ``k = 0..K-1`` in order (float32 ``[BT, BH]``).  Slot k is taken out
    of the ``[KP, ...]`` tiles by a select-sum whose other terms are the additive identity (integer 0,
    float -0.0): exactly the selected value, and folded away by the compiler (the KP axis is in-thread).
    ``SKIP``: slots ``k >= SKIP_FROM`` valid in no row of the tile (bit k of ``vmask`` clear) are skipped by
    a uniform branch;
    ``s_k`` is extracted outside the branch, so the extraction (shuffles) is shared by all chunks."""
    if WORDS:
        acc_lo = tl.zeros([BT, BH // 2], dtype=tl.float32)
        acc_hi = tl.zeros([BT, BH // 2], dtype=tl.float32)
        for k in tl.static_range(K):
            sk = tl.sum(tl.where((ks == k)[:, None], s, -0.0), axis=0)[:, None]
            if SKIP and k >= SKIP_FROM:
                if (vmask >> k) & 1 != 0:
                    wk = tl.sum(tl.where((ks == k)[:, None, None], xt, 0), axis=0)
                    acc_lo = tl.fma(bf16_bits_to_f32(wk), sk, acc_lo)
                    acc_hi = tl.fma(bf16_bits_to_f32(wk >> 16), sk, acc_hi)
            else:
                wk = tl.sum(tl.where((ks == k)[:, None, None], xt, 0), axis=0)
                acc_lo = tl.fma(bf16_bits_to_f32(wk), sk, acc_lo)
                acc_hi = tl.fma(bf16_bits_to_f32(wk >> 16), sk, acc_hi)
        acc = tl.join(acc_lo, acc_hi).reshape([BT, BH])
    else:
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        for k in tl.static_range(K):
            sk = tl.sum(tl.where((ks == k)[:, None], s, -0.0), axis=0)[:, None]
            if SKIP and k >= SKIP_FROM:
                if (vmask >> k) & 1 != 0:
                    acc = tl.fma(_slot_values(xt, ks, k, IN_BF16), sk, acc)
            else:
                acc = tl.fma(_slot_values(xt, ks, k, IN_BF16), sk, acc)
    return acc


@triton.jit
def _slot_values(xt, ks, k: tl.constexpr, IN_BF16: tl.constexpr):
    """Slot ``k``'s ``[BT, BH]`` float32 values out of the gathered ``[KP, BT, BH]`` tile."""
    if IN_BF16:
        return bf16_bits_to_f32(tl.sum(tl.where((ks == k)[:, None, None], xt, 0), axis=0))
    else:
        return tl.sum(tl.where((ks == k)[:, None, None], xt, -0.0), axis=0)


@triton.jit
def _store_rows(out_ptr, acc, rows, rm, cols, hidden, stride_out, OUT_KIND: tl.constexpr, EVEN_H: tl.constexpr,
                SATFINITE: tl.constexpr):
    if EVEN_H:
        om = rm[:, None]
    else:
        om = rm[:, None] & (cols < hidden)[None, :]
    optr = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if OUT_KIND == 0:
        tl.store(optr, acc, mask=om)
    elif OUT_KIND == 1:
        tl.store(optr, f32_to_bf16_bits(acc), mask=om)
    elif SATFINITE:
        tl.store(optr, _f32_to_e4m3_bits_fast(acc), mask=om)
    else:
        tl.store(optr, f32_to_e4m3_bits(acc), mask=om)


def _config(num_tokens: int, num_topk: int, hidden: int, interp: bool) -> dict:
    """Default launch config (deterministic in the shape).

    GPU: one token per program, 1024-column chunks (4 warps, 8 columns = 16 bytes of bf16 per thread and
    slot), the whole row in one program when it has at most 8 chunks (positions and weights loaded once per
    token).  The token's valid slots are compacted: a token holding one (97 % at the anchor, ep 64 with 4
    local experts) gathers only that row, 3 chunks ahead (``PREFETCH=3``: 4 x 16 bytes in flight per thread);
    tokens holding more take the full gather of all K slots (``PREFETCH_DENSE`` chunks ahead, 0: fewer
    registers for the whole kernel).  sm_90 SASS at the anchor (K = 6, bf16 -> e4m3): ~5 instructions per
    output element on the one-slot path, 62 registers (the previous default, all 6 slots gathered and
    summed: 22 per element, 62 registers, 1 x 16 bytes ahead per thread).  Interpreter: big tiles.

    Keys: ``BT`` tokens and ``BH`` columns per chunk (powers of two), ``COL_ITERS`` chunks per program,
    ``GATHER`` (all slots' rows of a chunk in one gather; else slot by slot), ``WORDS`` (bf16 read as int32
    pairs; GATHER only), ``PREFETCH`` / ``PREFETCH_DENSE`` (0..3 chunks ahead; GATHER only), ``NG`` (0 or a
    power of two: tiles whose rows hold at most NG valid slots gather only those, compacted; 0: always all
    K), ``SKIP`` (skip by a uniform branch the FMAs of slots that no row of the tile holds), ``num_warps``,
    ``num_stages``, ``SATFINITE`` (e4m3 output through ``tritile.language.cast.f32_to_e4m3_bits_satfinite``:
    no clamp before the hardware's satfinite conversion, 3 fewer instructions per element; on the GPU the
    same bits as the clamped conversion for every input: satfinite already maps overflow and +-inf to
    +-448, and a NaN passes the clamp unchanged into the same conversion; the interpreter's software path
    is shared).
    """
    if interp:
        bh = max(16, min(next_power_of_two(hidden), 4096))
        bt = max(1, min(32768 // bh, next_power_of_two(num_tokens)))
        return dict(BT=bt, BH=bh, COL_ITERS=1, GATHER=True, WORDS=True, PREFETCH=0, PREFETCH_DENSE=0, NG=1,
                    SKIP=True, SATFINITE=True, num_warps=4)
    # Rows below 4096 columns: 512-column chunks on 2 warps, tiles of tokens holding up to 2 valid slots compacted
    # (NG=2).  H200, CUPTI, the grid's K = 6 points (2026-12-02): hidden 2048 1.09-1.27x faster (fp32 99.2 -> 89.8
    # us), 2560 1.09-1.35x, 3072 1.02-1.13x; at 4096 0.97-1.05x (fp32 outputs lose), so 4096 and up keep 1024-column
    # chunks on 4 warps.  Several tokens a program (BT = 2, 4) lost 4-12 % at 2048.
    short = hidden < 4096
    bh = max(16, min(next_power_of_two(hidden), 512 if short else 1024))
    chunks = ceil_div(hidden, bh)
    return dict(BT=1, BH=bh, COL_ITERS=chunks if chunks <= 8 else 1, GATHER=True, WORDS=True,
                PREFETCH=3, PREFETCH_DENSE=0, NG=2 if short else 1, SKIP=True, SATFINITE=True,
                num_warps=max(1, min(4, bh // 256)))


@planned("reduce_fused")
def reduce_fused(
    x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    topk_weights: Optional[torch.Tensor],
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = "",
    sf: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce the fused (expert-major) rows back to tokens: ``out[t] = sf * sum_k s[t, k] * x[pos[t, k]]``.

    Args:
        x: ``(N, H)`` float32 or bfloat16 with unit stride along ``H``, or a tuple ``(x, x_sf)`` with
            ``x_sf`` float32 ``(N,)``, a per-row multiplier.  Any ``H`` (TileKernels needs ``H % 256 == 0``).
        topk_weights: float32 ``(T, K)`` or None (weight 1).
        token_topk_to_pos: int32 ``(T, K)``; ``-1`` = skip.  Positions ``>= N`` are skipped too (with
            ``TRITILE_CHECKS=1`` they raise ``ValueError``).
        fp8_format: ``''`` (output dtype = ``x.dtype``) or ``'e4m3'`` (float8_e4m3fn output: clamp to
            +-448, then round to nearest even; torch's bare CUDA cast would give NaN on overflow).  A NaN sum
            (NaN/inf inputs, unspecified by TileKernels) gives the hardware conversion's NaN code on the GPU
            (the canonical e4m3 NaN, 0x7F: its sign is not kept) and ``0x7F | sign`` under the CPU
            interpreter; finite and infinite sums give the same bits on both.
        sf: float32 ``(1,)``, multiplies the sum once at the end (even for tokens without a slot, so a
            negative ``sf`` gives ``-0.0``); only with ``fp8_format='e4m3'``.
        out: optional ``(T, H)`` output of the output dtype (unit stride along ``H``), written in place; it must
            not overlap any input (``ValueError``).

    Returns:
        ``(T, H)`` tensor (``out`` when given).  Accumulation: float32, slots ``k = 0..K-1`` in order,
        ``acc = fma(x, s, acc)`` with ``s = w * x_sf`` rounded first.
    """
    x_sf = None
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"x must be a tensor or an (x, x_sf) tuple, got a {type(x).__name__} of length {len(x)}")
        x, x_sf = x
    check_tensor("x", x, dtypes=(torch.float32, torch.bfloat16), ndim=2)
    check_inner_contiguous("x", x)
    num_expanded, hidden = x.shape
    check_tensor("token_topk_to_pos", token_topk_to_pos, dtypes=(torch.int32,), ndim=2)
    num_tokens, num_topk = token_topk_to_pos.shape
    if x_sf is not None:
        check_tensor("x_sf", x_sf, dtypes=(torch.float32,), ndim=1)
        check_shape("x_sf", x_sf, (num_expanded,))
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
        check_shape("topk_weights", topk_weights, (num_tokens, num_topk))
    if not isinstance(fp8_format, str) or fp8_format not in ("", "e4m3"):
        raise ValueError(f"fp8_format must be '' or 'e4m3', got {fp8_format!r}")
    out_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
    if sf is not None:
        if fp8_format == "":
            raise ValueError("sf is only supported with an FP8 output (fp8_format='e4m3'), got fp8_format=''")
        check_tensor("sf", sf, dtypes=(torch.float32,))
        if sf.numel() != 1:
            raise ValueError(f"sf must hold one float32 value (shape (1,)), got shape {tuple(sf.shape)}")
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), ndim=2)
        check_shape("out", out, (num_tokens, hidden))
        check_inner_contiguous("out", out)
        if not torch.compiler.is_compiling():  # addresses: eager only (fake tensors have none)
            check_no_overlap({"out": out}, {"x": x, "x_sf": x_sf, "topk_weights": topk_weights,
                                            "token_topk_to_pos": token_topk_to_pos, "sf": sf})
    device = check_same_device(x=x, x_sf=x_sf, topk_weights=topk_weights, token_topk_to_pos=token_topk_to_pos,
                               sf=sf, out=out)
    if checks_enabled() and token_topk_to_pos.numel() > 0 and not torch.compiler.is_compiling():
        lo, hi = int(token_topk_to_pos.min()), int(token_topk_to_pos.max())
        if lo < -1 or hi >= num_expanded:
            raise ValueError(f"token_topk_to_pos values must be in [-1, {num_expanded}) (the rows of x), "
                             f"got values in [{lo}, {hi}]")
    if out is None:
        out = empty((num_tokens, hidden), out_dtype, device)
    if num_tokens == 0 or hidden == 0:
        return out
    _reduce_fused_into(x, x_sf, topk_weights, token_topk_to_pos, fp8_format, sf, out)
    return out


@custom_op("moe_reduce_fused", mutates_args=("out",),
           fake=lambda x, x_sf, topk_weights, token_topk_to_pos, fp8_format, sf, out: None)
def _reduce_fused_into(x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                       token_topk_to_pos: torch.Tensor, fp8_format: str, sf: Optional[torch.Tensor],
                       out: torch.Tensor) -> None:
    """``reduce_fused`` after its checks (the registered op): the launch into ``out``."""
    num_tokens, num_topk = token_topk_to_pos.shape
    num_expanded, hidden = x.shape
    cfg = tuned("reduce_fused", _config(num_tokens, num_topk, hidden, interpreter_configs()))
    bt, bh, col_iters = cfg["BT"], cfg["BH"], cfg["COL_ITERS"]
    num_col_groups = ceil_div(ceil_div(hidden, bh), col_iters)
    out_kind = _OUT_E4M3 if fp8_format == "e4m3" else (_OUT_BF16 if x.dtype == torch.bfloat16 else _OUT_F32)
    # bf16 read as int32 words (two columns each) when the rows allow it
    words = bool(cfg["WORDS"]) and bool(cfg["GATHER"]) and x.dtype == torch.bfloat16 and bh >= 2 \
        and hidden % 2 == 0 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
    xk = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    if words:
        xk = xk.view(torch.int32)
    if out_kind == _OUT_E4M3:
        ok_ = out.view(torch.uint8)
    elif out_kind == _OUT_BF16:
        ok_ = out.view(torch.int16)
    else:
        ok_ = out
    w = topk_weights if topk_weights is not None else token_topk_to_pos
    kp = next_power_of_two(max(num_topk, 1))
    ng = int(cfg.get("NG", 0)) if cfg["GATHER"] else 0
    if ng < 0 or ng & (ng - 1):
        raise ValueError(f"bad reduce_fused launch config {cfg}: NG must be 0 or a power of two")
    ng = min(ng, kp)
    _reduce_fused_kernel[(ceil_div(num_tokens, bt) * num_col_groups,)](
        xk, x_sf if x_sf is not None else x, w, token_topk_to_pos, sf if sf is not None else x, ok_,
        num_tokens, num_expanded, hidden,
        xk.stride(0), x_sf.stride(0) if x_sf is not None else 0,
        w.stride(0), w.stride(1), token_topk_to_pos.stride(0), token_topk_to_pos.stride(1), ok_.stride(0),
        num_col_groups,
        K=num_topk, IN_BF16=x.dtype == torch.bfloat16, OUT_KIND=out_kind, WITH_W=topk_weights is not None,
        WITH_XSF=x_sf is not None, WITH_SF=sf is not None, BT=bt, BH=bh, COL_ITERS=col_iters,
        EVEN_H=hidden % (bh * col_iters) == 0, KP=kp, GATHER=bool(cfg["GATHER"]),
        WORDS=words, PREFETCH=min(3, int(cfg.get("PREFETCH", 0))) if col_iters > 1 else 0, SATFINITE=bool(cfg.get("SATFINITE", False)),
        SKIP=bool(cfg.get("SKIP", False)), NG=ng, PREFETCH_DENSE=min(3, int(cfg.get("PREFETCH_DENSE", 0))) if col_iters > 1 else 0,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3), **pdl_args(out.device))
