"""``swiglu_forward_and_per_channel_cast_and_transpose``: SwiGLU, bf16 rounding, per-channel FP8 cast.

``tile_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose`` (``spec/quant.md`` §3.10).
Each program loads ``[BM, BK]`` tiles of both halves of x, computes the (optionally clamped) SwiGLU
activation, rounds it to bf16 (as the reference's ``.bfloat16()``), and quantizes it with one scale
per (``npt`` rows x 1 column) block through the shared per-channel epilogue
(``_per_channel_common.per_channel_quant_tile``); the codes are stored transposed ``(H, M)`` or as
``(M, H)``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, exp_f32, f32_to_bf16_bits
from ..language.cast import EMULATE, f32_to_bf16_bits_sw, f32_to_e4m3_bits_sw
from ..language.grid import tile_grid, tile_ids
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_choice, check_device, check_inner_contiguous, check_tensor, custom_op, empty,
                       interpreter_configs, tuned)
from ..utils import ceil_div, next_power_of_two
from ..runtime.plan import planned
from ._per_channel_common import per_channel_quant_tile_bf16, per_channel_scale
from ._swiglu_jit import _div_neg_fast, _swiglu_act, _swiglu_clamp
from ._swiglu_ptx import ptx_abs_max, ptx_div_fast, ptx_one_plus_exp_neg, ptx_unpack_bf16_words
from .swiglu_forward_and_per_token_cast_kernel import _check_clamp_value, _check_int
from .types import QuantTensor

__all__ = ["swiglu_forward_and_per_channel_cast_and_transpose"]


@triton.jit
def _swiglu_forward_and_per_channel_cast_and_transpose_kernel(
        x_ptr, out_ptr, sf_ptr, num_rows, stride_xm, stride_om, stride_sm, clamp_value,
        H: tl.constexpr, NPT: tl.constexpr, ROUND_SF: tl.constexpr, HAS_CLAMP: tl.constexpr,
        TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FINITE_BRANCH: tl.constexpr,
        VEC: tl.constexpr = 0, FAST_DIV: tl.constexpr = False, SIGNED_ENC: tl.constexpr = 0,
        INT_POW2: tl.constexpr = False, PDL: tl.constexpr = False):
    """``VEC`` (> 0): the column offsets are declared contiguous in runs of ``VEC`` only, so Triton's
    coalescing gives each thread ``VEC`` columns (8: 16-byte bf16 loads, 8-byte code stores) and more
    rows: fewer shuffles in the column max.  The column max is taken on the activation's bf16 patterns.

    ``FAST_DIV``: ``l / (1 + exp(-l))`` through ``_div_neg_fast`` (the per-token kernel's default: the
    fast path of ``div.rn.f32`` per four elements without its per-element range check and branch; the
    same bits) with ``-l`` written ``l * -1`` (exp(+-0) = 1 either way).  ``SIGNED_ENC`` (1, or 2 with
    ``BM == NPT``): the e4m3 encode's NaN patch as a sign merge from the activation's bf16 patterns; 2 also
    unpacks and multiplies inside the per-four assembly (``_per_channel_common``; same bits).  ``INT_POW2``
    (round_sf): the power-of-two scales from amax's bits, no division (``per_channel_scale``; same bits)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    if VEC > 0:
        cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
    row_ok = rows < num_rows
    col_ok = cols < H
    m = row_ok[:, None] & col_ok[None, :]
    x_row = x_ptr + rows[:, None] * stride_xm
    l = bf16_bits_to_f32(tl.load(x_row + cols[None, :], mask=m, other=0))
    r = bf16_bits_to_f32(tl.load(x_row + (cols[None, :] + H), mask=m, other=0))
    if HAS_CLAMP:
        l, r = _swiglu_clamp(l, r, clamp_value)
    if FAST_DIV:
        nl = l * -1.0
        act = _div_neg_fast(nl, 1.0 + exp_f32(nl), HAS_CLAMP) * r  # HAS_CLAMP: l <= c, so -l > -inf
    else:
        act = _swiglu_act(l, r)
    # act rounded to bf16 before the amax and the cast; masked elements are +0
    codes, sf = per_channel_quant_tile_bf16(f32_to_bf16_bits(act), NPT, ROUND_SF, FINITE_BRANCH, SIGNED_ENC,
                                            INT_POW2)
    if TRANSPOSE:
        tl.store(out_ptr + cols[:, None] * stride_om + rows[None, :], tl.trans(codes),
                 mask=col_ok[:, None] & row_ok[None, :])
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], codes, mask=m)
    groups = pid_m * (BM // NPT) + tl.arange(0, BM // NPT)
    tl.store(sf_ptr + groups[:, None] * stride_sm + cols[None, :], sf,
             mask=(groups < num_rows // NPT)[:, None] & col_ok[None, :])


# ------------------------------------------------------------------------------------------------
# WORDS path (config key WORDS): the tile is held as int32 words of two bf16 (adjacent columns), one row
# group (NPT rows) per program.  Same bits as the kernel above; see _swiglu_channel_words_kernel.
# ------------------------------------------------------------------------------------------------
def _silu_words_ptx(nw: int) -> str:
    """PTX of the fused SwiGLU of ``2 * nw`` elements: ``nw`` words of l (``$nw+..``), ``nw`` words of r, to
    ``nw`` words of bf16 act (``$0..``; element 2i in the low half).  Per element, the same operations as
    the default kernel's ``l * -1`` -> libdevice ``expf`` -> ``1 + e`` -> ``_div_neg_fast`` -> ``* r`` -> bf16,
    with three exact rewrites (see ``_swiglu_channel_words_kernel``); one range guard per ``2 * nw``."""
    n = 2 * nw
    lw = [f"${nw + i}" for i in range(nw)]
    rw = [f"${2 * nw + i}" for i in range(nw)]
    unpack = ptx_unpack_bf16_words(lw, "l")
    exp = "".join(ptx_one_plus_exp_neg(f"l{i}", f"t{i}") for i in range(n))
    guard = ptx_abs_max([f"l{i}" for i in range(n)])
    fast = "".join(ptx_div_fast(f"l{i}", f"t{i}", f"q{i}", "y", "y", "y") for i in range(n))
    slow = "".join(f"div.rn.f32 q{i}, l{i}, t{i}; " for i in range(n))
    mul = "".join(f"shl.b32 r, {w}, 16; mul.rn.f32 q{2 * i}, q{2 * i}, r; and.b32 r, {w}, 0xFFFF0000; "
                  f"mul.rn.f32 q{2 * i + 1}, q{2 * i + 1}, r; " for i, w in enumerate(rw))
    pack = "".join(f"cvt.rn.bf16x2.f32 ${i}, q{2 * i + 1}, q{2 * i}; " for i in range(nw))
    return (f"{{ .reg .pred p; .reg .b32 l<{n}>, t<{n}>, q<{n}>, r, s, j, k, f, e, y, z, m, a; "
            + unpack + exp + guard + "setp.le.f32 p, m, 0f42240000; @!p bra SLOW; "
            + fast + "bra.uni DONE; SLOW: " + slow + "DONE: " + mul + pack + "}")


_SILU4_WORDS = tl.constexpr(_silu_words_ptx(2))
_SILU8_WORDS = tl.constexpr(_silu_words_ptx(4))
# Four e4m3 codes from two act words ($5, $6) and the four columns' float32 sf_inv ($1/$3: word 0's low
# and high column, $2/$4: word 1's): _per_channel_common's _ENC4_BF16 with a multiplier per column.
_ENC4_WORDS = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 x0, x1, x2, x3, c, s0; "
    "shl.b32 x0, $5, 16; and.b32 x1, $5, 0xFFFF0000; shl.b32 x2, $6, 16; and.b32 x3, $6, 0xFFFF0000; "
    "mul.rn.f32 x0, x0, $1; mul.rn.f32 x1, x1, $3; mul.rn.f32 x2, x2, $2; mul.rn.f32 x3, x3, $4; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, x1, x0; cvt.rn.satfinite.e4m3x2.f32 hi, x3, x2; mov.b32 c, {lo, hi}; "
    "prmt.b32 s0, $5, $6, 0x7531; lop3.b32 $0, c, s0, 0x7F7F7F7F, 0xE4; }")
# The same with power-of-two multipliers applied on the bf16 pairs: $1/$2 the bf16x2 sf_inv of word 0/1
# (low column in the low half), $3/$4 the act words.  One mul.rn.bf16x2 per two elements instead of two
# float32 multiplies (exact: see _swiglu_channel_words_kernel).
_ENC4_WORDS_HMUL = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 v0, v1, x0, x1, x2, x3, c, s0; "
    "mul.rn.bf16x2 v0, $3, $1; mul.rn.bf16x2 v1, $4, $2; "
    "shl.b32 x0, v0, 16; and.b32 x1, v0, 0xFFFF0000; shl.b32 x2, v1, 16; and.b32 x3, v1, 0xFFFF0000; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, x1, x0; cvt.rn.satfinite.e4m3x2.f32 hi, x3, x2; mov.b32 c, {lo, hi}; "
    "prmt.b32 s0, $3, $4, 0x7531; lop3.b32 $0, c, s0, 0x7F7F7F7F, 0xE4; }")


@triton.jit
def _max_u16x2(a, b):
    """Per 16-bit half: unsigned max (one ``VIMNMX.U16x2``)."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _words_lo_f32(w):
    return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _words_hi_f32(w):
    return (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pack_bf16_words(lo, hi):
    """Two float32 tensors -> int32 words of their bf16 (RNE) patterns, ``lo`` in the low half."""
    if EMULATE:
        blo = f32_to_bf16_bits_sw(lo).to(tl.int32) & 0xFFFF
        bhi = f32_to_bf16_bits_sw(hi).to(tl.int32)
    else:
        blo = f32_to_bf16_bits(lo).to(tl.int32) & 0xFFFF
        bhi = f32_to_bf16_bits(hi).to(tl.int32)
    return blo | (bhi << 16)


@triton.jit
def _act_f32(l, r, clamp_value, HAS_CLAMP: tl.constexpr):
    """The default kernel's element path (FAST_DIV) on float32 halves."""
    if HAS_CLAMP:
        l, r = _swiglu_clamp(l, r, clamp_value)
    nl = l * -1.0
    return _div_neg_fast(nl, 1.0 + exp_f32(nl), HAS_CLAMP) * r


@triton.jit
def _silu_words(lw, rw, clamp_value, HAS_CLAMP: tl.constexpr, FUSED: tl.constexpr):
    """int32 words of bf16 act (``bf16(silu(l) * r)``) from the words of l and r.  ``FUSED``: 0 = element
    ops, 2 / 4 = the fused PTX per 2 / 4 words (GPU, no clamp; needs that many contiguous words per thread)."""
    if FUSED == 2 and not HAS_CLAMP and not EMULATE:
        return tl.inline_asm_elementwise(_SILU4_WORDS, "=r,=r,r,r,r,r", [lw, rw], dtype=tl.int32, is_pure=True,
                                         pack=2)
    elif FUSED == 4 and not HAS_CLAMP and not EMULATE:
        return tl.inline_asm_elementwise(_SILU8_WORDS, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [lw, rw], dtype=tl.int32,
                                         is_pure=True, pack=4)
    else:
        a_lo = _act_f32(_words_lo_f32(lw), _words_lo_f32(rw), clamp_value, HAS_CLAMP)
        a_hi = _act_f32(_words_hi_f32(lw), _words_hi_f32(rw), clamp_value, HAS_CLAMP)
        return _pack_bf16_words(a_lo, a_hi)


@triton.jit
def _word_tile_index(BM: tl.constexpr, BKW: tl.constexpr, VECW: tl.constexpr, KFAST: tl.constexpr = False):
    """Program ``(pid_m, pid_k)``'s ``[BM, BKW]`` tile of int32 words: ``(pid_m, pid_k, r, c, rows, cw)`` with ``r``
    / ``c`` the in-tile row and word offsets (``c`` marked contiguous in runs of ``VECW`` words when ``VECW > 1``)
    and ``rows`` / ``cw`` the global ones (int32).  KFAST: the grid's first dimension is the column block
    (``tritile.language.grid``)."""
    pid_m, pid_k = tile_ids(KFAST, False)
    r = tl.arange(0, BM)
    c = tl.arange(0, BKW)
    if VECW > 1:
        c = tl.max_contiguous(tl.multiple_of(c, VECW), VECW)
    return pid_m, pid_k, r, c, pid_m * BM + r, pid_k * BKW + c


@triton.jit
def _column_max_words(a, PACKED_MAX: tl.constexpr):
    """Column max of the non-negative 16-bit halves of the words ``a [BM, BKW]`` -> ``[1, BKW]`` words."""
    if PACKED_MAX and not EMULATE:
        return tl.reduce(a, 0, _max_u16x2, keep_dims=True)
    else:
        lo = tl.max(a & 0xFFFF, axis=0, keep_dims=True)
        hi = tl.max(a >> 16, axis=0, keep_dims=True)
        return lo | (hi << 16)


@triton.jit
def _pow2_scale_bits(m):
    """``(sf, sf_inv)`` of ``round_sf`` e4m3 scales from a column's max bf16 magnitude pattern ``m``
    (int32 0..0x7FFF; NaN patterns above 0x7F80 count as inf), in integer ops only.

    With ``t = max((m - 993) >> 7, 105)`` (``t = 255`` for inf/NaN): ``sf = 2^(t - 127)``, ``sf_inv =
    2^(127 - t)`` (0 for t = 255).  Same bits as ``quant_scale(max(amax, 1e-4), ROUND_SF=True)``: for
    ``amax = 2^E (1 + m7/128)``, ``ceil(log2(amax / 448)) = E - 8 + (m7 > 96)``, i.e. ``((m + 31) >> 7) - 135``
    (the division's rounding cannot reach a power of two: 1.75 + 2^-7 is far above 1.75), and 1e-4 gives
    ``2^-22`` (t = 105).  Checked on all 32768 patterns (tests/quant/test_swiglu_forward_and_per_channel_...)."""
    t = tl.maximum((m - 993) >> 7, 105)
    t = tl.where(m >= 0x7F80, 255, t)
    sf = (t << 23).to(tl.float32, bitcast=True)
    sf_inv = tl.maximum((254 - t) << 23, 0).to(tl.float32, bitcast=True)
    return sf, sf_inv


@triton.jit
def _column_scale(m, ROUND_SF: tl.constexpr, SCALE_BITS: tl.constexpr):
    if ROUND_SF and SCALE_BITS:
        return _pow2_scale_bits(m)
    else:
        return per_channel_scale((tl.minimum(m, 0x7F80) << 16).to(tl.float32, bitcast=True), ROUND_SF, True)


@triton.jit
def _encode_half_sw(x, s, sign, HMUL: tl.constexpr):
    v = x * s
    if HMUL:  # the bf16 product of the GPU path (x * s is exact in float32 for these s)
        v = bf16_bits_to_f32(f32_to_bf16_bits_sw(v))
    return (f32_to_e4m3_bits_sw(v).to(tl.int32) & 0x7F) | sign


@triton.jit
def _encode_words(a, si_lo, si_hi, HMUL: tl.constexpr):
    """int16 words of two e4m3 codes (low column in the low byte) of the act words ``a [BM, BKW]`` with
    the columns' multipliers ``si_lo``/``si_hi [1, BKW]``; a NaN product takes the act's sign."""
    BM: tl.constexpr = a.shape[0]
    BKW: tl.constexpr = a.shape[1]
    if EMULATE:
        c_lo = _encode_half_sw(_words_lo_f32(a), si_lo, (a >> 8) & 0x80, HMUL)
        c_hi = _encode_half_sw(_words_hi_f32(a), si_hi, (a >> 24) & 0x80, HMUL)
        return (c_lo | (c_hi << 8)).to(tl.int16)
    else:
        if HMUL:
            s2 = ((si_hi.to(tl.int32, bitcast=True) & -65536)
                  | ((si_lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF))
            return tl.inline_asm_elementwise(_ENC4_WORDS_HMUL, "=r,r,r,r,r", [tl.broadcast_to(s2, (BM, BKW)), a],
                                             dtype=tl.int16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_ENC4_WORDS, "=r,f,f,f,f,r,r",
                                             [tl.broadcast_to(si_lo, (BM, BKW)), tl.broadcast_to(si_hi, (BM, BKW)),
                                              a], dtype=tl.int16, is_pure=True, pack=2)


@triton.jit
def _swiglu_channel_words_kernel(
        x_ptr, out_ptr, sf_ptr, num_rows, stride_xm, stride_om, stride_sm, clamp_value,
        HW: tl.constexpr, NPT: tl.constexpr, ROUND_SF: tl.constexpr, HAS_CLAMP: tl.constexpr,
        TRANSPOSE: tl.constexpr, BKW: tl.constexpr, VECW: tl.constexpr, EVEN: tl.constexpr,
        FUSED: tl.constexpr, SCALE_BITS: tl.constexpr, HMUL_ENC: tl.constexpr, PACKED_MAX: tl.constexpr,
        KFAST: tl.constexpr = False, PDL: tl.constexpr = False):
    """WORDS path: ``x_ptr`` int32 words (two bf16 each, ``stride_xm`` in words, H = 2 * HW columns per
    half), one row group of ``NPT`` rows x ``BKW`` words per program.  Codes are stored as int16 words
    (two codes; ``stride_om`` in int16) or, with TRANSPOSE, as bytes of the ``(H, M)`` output.  Same bits
    as the element kernel; the flags are instruction-count candidates:

    ``FUSED`` (2 or 4; no clamp, GPU): one PTX block per 2 or 4 words (``_silu_words_ptx``) from the loaded
    words to the packed bf16 act words (4: one range guard and branch per eight elements).  Per element it runs
    the default kernel's operations (libdevice ``expf`` of
    ``-l``, ``1 + e``, ``_div_neg_fast``, ``* r``, bf16 RNE) with three exact rewrites:
    (1) ``-l`` folded into the constants: ``fma(-l, c, d) == fma(l, -c, d)`` (the product is negated
        exactly), so no sign flip per element;
    (2) ``expf``'s ``cvt.sat`` folded into its first ``fma`` (``fma.sat`` rounds, then clamps to [0, 1]
        with NaN -> 0, the same as the separate ``cvt.ftz.sat``), and ``1 + e * 2^n`` (expf's last
        ``mul.rn``, then the add) as one ``fma(e, 2^n, 1)``: ``2^n`` is a normal power of two
        (n in [-126, 126]), so ``e * 2^n`` is exact whenever it is normal, and else it is below 2^-126
        (both give 1 + tiny -> 1), at least 2^128 (both give +inf) or NaN (both NaN);
    (3) the fast division's range guard on ``max |l| <= 41`` over the four (three ``FMNMX`` with ``|.|``)
        instead of ``-41 <= l < +inf`` from a max and a min: a narrower guard (the fast path is exact
        for each element with -41 <= l < +inf or NaN, ``_div_neg_fast``), with ``div.rn`` otherwise, which
        the fast path equals wherever it is taken; ``q = l * y``, ``e = fma(t, q, -l)``, ``q - y * e`` is
        ``_div_neg_fast``'s sequence with ``na = -l`` (signed zeros kept).
    The act pairs come out already packed as the encode wants them (no byte permutes between the
    column max, which Triton pairs by rows, and the encode, which pairs by columns).

    ``PACKED_MAX`` (GPU): the column max on the words with ``max.u16x2`` (two columns per op, shuffles
    included).  ``SCALE_BITS`` (round_sf): ``_pow2_scale_bits``, ~8 integer ops per column.
    ``HMUL_ENC`` (round_sf): the power-of-two multiply on the bf16 pairs (``mul.rn.bf16x2``): for bf16
    x and s = 2^-k (k in [-22, 120]) or 0, ``x * s`` is exact in bf16 unless below 2^-126, where both
    float32 and bf16 products encode to a zero code with x's sign (the sign is merged from x either way;
    |x * s| <= 448, so no overflow); inf/NaN x meet s = 0 and give NaN, patched to ``0x7F | sign`` in
    both.  ``EVEN``: no masks (M % NPT == 0 and HW % BKW == 0).  ``VECW``: words per thread run."""
    pdl_enter(PDL)
    pid_m, pid_k, r, c, rows, cw = _word_tile_index(NPT, BKW, VECW, KFAST)
    # a 64-bit base per program, int32 offsets inside the tile (the launcher checks NPT * stride < 2^31)
    x_tile = x_ptr + pid_m.to(tl.int64) * NPT * stride_xm + pid_k * BKW + r[:, None] * stride_xm + c[None, :]
    if EVEN:
        lw = tl.load(x_tile)
        rw = tl.load(x_tile + HW)
    else:
        m = (rows < num_rows)[:, None] & (cw < HW)[None, :]
        lw = tl.load(x_tile, mask=m, other=0)
        rw = tl.load(x_tile + HW, mask=m, other=0)
    act = _silu_words(lw, rw, clamp_value, HAS_CLAMP, FUSED)  # masked elements: +0
    mw = _column_max_words(act & 0x7FFF7FFF, PACKED_MAX)
    sf_lo, si_lo = _column_scale(mw & 0xFFFF, ROUND_SF, SCALE_BITS)
    sf_hi, si_hi = _column_scale(mw >> 16, ROUND_SF, SCALE_BITS)
    codes = _encode_words(act, si_lo, si_hi, HMUL_ENC and ROUND_SF)
    if TRANSPOSE:
        c32 = codes.to(tl.int32)
        c8 = tl.reshape(tl.join(c32 & 0xFF, (c32 >> 8) & 0xFF), (NPT, 2 * BKW)).to(tl.uint8)
        cols = pid_k * (2 * BKW) + tl.arange(0, 2 * BKW)
        dst = out_ptr + cols[:, None].to(tl.int64) * stride_om + rows[None, :]
        if EVEN:
            tl.store(dst, tl.trans(c8))
        else:
            tl.store(dst, tl.trans(c8), mask=(cols < 2 * HW)[:, None] & (rows < num_rows)[None, :])
    else:
        dst = out_ptr + pid_m.to(tl.int64) * NPT * stride_om + pid_k * BKW + r[:, None] * stride_om + c[None, :]
        if EVEN:
            tl.store(dst, codes)
        else:
            tl.store(dst, codes, mask=m)
    sf_row = sf_ptr + pid_m.to(tl.int64) * stride_sm + 2 * cw[None, :]
    if EVEN:
        tl.store(sf_row, sf_lo)
        tl.store(sf_row + 1, sf_hi)
    else:
        sm = (cw < HW)[None, :] & (pid_m * NPT < num_rows)
        tl.store(sf_row, sf_lo, mask=sm)
        tl.store(sf_row + 1, sf_hi, mask=sm)


def _config(H: int, npt: int):
    """(BM, BK, num_warps).  GPU: one scale block of rows per tile, 4096 elements of each half (32
    per thread with 4 warps; ptxas: 152 registers for [32, 128], no spills; [128, 128] with 8 warps
    spilled), i.e. ``[32, 128]`` for npt = 32 and ``[128, 32]`` for npt = 128.  Interpreter: 128 rows
    and one tile as wide as the row (up to 1024 columns).

    H200 sweep (2026-11-30, 4096 x 7168, npt 32, no transpose, VEC=8): [32, 32] x 1 warp (the same 32
    elements per thread) 66.7 us, [32, 64] x 2 warps 68.5 us, [32, 128] x 4 warps 77.8 us: npt 32 takes
    [32, 32] x 1 warp; npt 128 (not swept) keeps [128, 32] x 4 warps.  Sweep of 2026-11-30 (H200, commit 694bd6c;
    same shape): with SIGNED_ENC=2, FAST_DIV and INT_POW2 (same bits, fewer instructions), [32, 64] x 2 warps 54.7 us, [32, 32] x
    1 warp 55.6 us (TileKernels 45.1)."""
    if interpreter_configs():
        return max(128, npt), min(max(next_power_of_two(H), 16), 1024), 4
    if npt == 32:
        return 32, 64, 2
    return npt, 4096 // npt, 4


def _launch(x, npt, round_sf, without_transpose, clamp):
    m, two_h = x.shape
    H = two_h // 2
    dev = x.device
    out = empty((m, H) if without_transpose else (H, m), torch.float8_e4m3fn, dev)
    sf = empty((m // npt, H), torch.float32, dev)
    if m == 0 or H == 0:
        return out, sf
    bm, bk, num_warps = _config(H, npt)
    # WORDS by default where it was measured: npt 32 without a clamp (H200, 4096 x 7168, no transpose, CUPTI with L2
    # flushed: 41.98 us on [32 rows, 128 columns] x 2 warps with FUSED_SILU=4 and HMUL_ENC, against 56.53 for the
    # element kernel; TileKernels 45.09).  A clamp compiles to ~190 registers there, and npt 128 puts 4x the elements on
    # each thread.  H200, 2026-12-01, commit 4d49e57: KFAST (the grid's first dimension over the column blocks,
    # tritile.language.grid), three sweeps (CUPTI): 41.07 / 40.76 / 41.25 us against 41.96 / 42.55 / 41.59 (the last one
    # KFAST against itself) without transpose, 42.64 / 42.60 against 43.25 with it; without transpose 4 warps on the
    # same tile (16 words a thread instead of 32) 39.74 / 39.67, with it 43.45 / 43.51.
    words = not interpreter_configs() and npt == 32 and clamp is None
    if words:
        bk, num_warps = 128, 4 if without_transpose else 2
    # tritile.runtime.tuned("swiglu_forward_and_per_channel_cast_and_transpose", ...): BLOCK_M (a multiple of
    # npt), BLOCK_K (a power of two), num_warps, FINITE_BRANCH (GPU: a uniform branch drops the NaN patch of
    # the e4m3 encode when the tile is finite; fewer instructions, more registers), FAST_DIV, SIGNED_ENC, INT_POW2
    # (same bits, fewer instructions: see the kernel)
    # WORDS (the default above) selects _swiglu_channel_words_kernel (one row group per program, BLOCK_M ignored;
    # BLOCK_K and VEC count columns, both even): FUSED_SILU, PACKED_MAX, SCALE_BITS, HMUL_ENC, NO_MASK are
    # its same-bits instruction-count flags (see that kernel).  It needs 4-byte aligned rows of x, else
    # the element kernel runs.
    c = tuned("swiglu_forward_and_per_channel_cast_and_transpose",
              {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": num_warps, "FINITE_BRANCH": False,
               "VEC": 0 if interpreter_configs() else 8, "FAST_DIV": True, "SIGNED_ENC": 2,
               "INT_POW2": True, "WORDS": words, "FUSED_SILU": 4 if words else 2, "PACKED_MAX": True,
               "SCALE_BITS": True, "HMUL_ENC": words, "NO_MASK": True, "KFAST": words})
    if c["WORDS"] and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0:
        return _launch_words(x, out, sf, npt, round_sf, without_transpose, clamp, c)
    bm, bk, num_warps = c["BLOCK_M"], c["BLOCK_K"], c["num_warps"]
    if bm % npt or bm & (bm - 1) or bk < 1 or bk & (bk - 1):
        raise ValueError(f"bad swiglu_forward_and_per_channel_cast_and_transpose launch config {c}: BLOCK_M a "
                         f"power of two and a multiple of num_per_tokens={npt}, BLOCK_K a power of two")
    grid = (ceil_div(m, bm), ceil_div(H, bk))
    _swiglu_forward_and_per_channel_cast_and_transpose_kernel[grid](
        x.view(torch.int16), out.view(torch.uint8), sf, m, x.stride(0), out.stride(0), sf.stride(0),
        clamp if clamp is not None else 0.0,
        H=H, NPT=npt, ROUND_SF=round_sf, HAS_CLAMP=clamp is not None, TRANSPOSE=not without_transpose,
        BM=bm, BK=bk, FINITE_BRANCH=bool(c["FINITE_BRANCH"]), VEC=int(c["VEC"]), FAST_DIV=bool(c["FAST_DIV"]),
        SIGNED_ENC=int(c["SIGNED_ENC"]) if bm == npt else min(int(c["SIGNED_ENC"]), 1),
        INT_POW2=bool(c["INT_POW2"]), num_warps=num_warps,
        enable_fp_fusion=False,  # no FMA contraction of 1 + exp(-l) (see swiglu_forward_and_per_token_cast_kernel)
        **pdl_args(out.device))
    return out, sf


def _launch_words(x, out, sf, npt, round_sf, without_transpose, clamp, c):
    m, two_h = x.shape
    hw = two_h // 4
    bk, vec = int(c["BLOCK_K"]), int(c["VEC"])
    if bk < 2 or bk & (bk - 1) or vec < 0 or vec % 2 or (vec and bk % vec):
        raise ValueError(f"bad swiglu_forward_and_per_channel_cast_and_transpose WORDS config {c}: BLOCK_K a power "
                         f"of two >= 2, VEC 0 or an even divisor of BLOCK_K")
    bkw = bk // 2
    fused = 0 if interpreter_configs() else int(c["FUSED_SILU"])
    if fused not in (0, 2, 4) or (fused and npt * bkw // (32 * c["num_warps"]) % fused):
        fused = 0  # the fused PTX takes 2 or 4 words of one thread at a time
    if npt * max(x.stride(0), out.stride(0)) >= 2 ** 31:
        raise ValueError("swiglu_forward_and_per_channel_cast_and_transpose WORDS: row stride too large")
    even = bool(c["NO_MASK"]) and m % npt == 0 and hw % bkw == 0
    grid, kfast = tile_grid(ceil_div(m, npt), ceil_div(hw, bkw), c.get("KFAST", False))
    _swiglu_channel_words_kernel[grid](
        x.view(torch.int32), out.view(torch.uint8) if not without_transpose else out.view(torch.int16), sf, m,
        x.stride(0) // 2, out.stride(0) if not without_transpose else out.stride(0) // 2, sf.stride(0),
        clamp if clamp is not None else 0.0,
        HW=hw, NPT=npt, ROUND_SF=round_sf, HAS_CLAMP=clamp is not None, TRANSPOSE=not without_transpose,
        BKW=bkw, VECW=vec // 2, EVEN=even, FUSED=fused, SCALE_BITS=bool(c["SCALE_BITS"]),
        HMUL_ENC=bool(c["HMUL_ENC"]), PACKED_MAX=bool(c["PACKED_MAX"]), KFAST=kfast, num_warps=c["num_warps"],
        enable_fp_fusion=False, **pdl_args(out.device))
    return out, sf


def _launch_fake(x, npt, round_sf, without_transpose, clamp):
    m, H = x.shape[0], x.shape[1] // 2
    return (x.new_empty((m, H) if without_transpose else (H, m), dtype=torch.float8_e4m3fn),
            x.new_empty((m // npt, H), dtype=torch.float32))


@custom_op("swiglu_forward_and_per_channel_cast_and_transpose", fake=_launch_fake)
def _launch_op(x: torch.Tensor, npt: int, round_sf: bool, without_transpose: bool,
               clamp: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::swiglu_forward_and_per_channel_cast_and_transpose`` (validated arguments)."""
    return _launch(x, npt, round_sf, without_transpose, clamp)


@planned("swiglu_forward_and_per_channel_cast_and_transpose")
def swiglu_forward_and_per_channel_cast_and_transpose(
        x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False, without_transpose: bool = False,
        swiglu_clamp_value: Optional[float] = None) -> QuantTensor:
    """SwiGLU of ``x``, rounded to bf16, then an FP8 e4m3 cast with one scale per (npt rows x 1 column).

    Per element: ``l = x[m, j]``, ``r = x[m, j + H]``; with a clamp c, ``l = min(l, c)`` and ``r`` into
    ``[-c, c]``; ``act = bf16((l / (1 + exp(-l))) * r)``.  Per column j of each block of npt rows:
    ``amax = max |act|``, ``sf = max(amax, 1e-4) / 448`` (IEEE; ``round_sf`` rounds it up to a power of
    two), codes ``e4m3(act * sf_inv)``.  A block holding inf or NaN gets sf = +inf and codes
    ``e4m3(act * 0)`` (NaN for the non-finite elements), so it dequantizes to NaN.

    Args:
        x: bfloat16 ``(M, 2H)``, ``M % 128 == 0``, ``2H % 128 == 0``, unit column stride (rows may be
            strided).
        fmt: ``'e4m3'`` (the only format).
        num_per_tokens: npt, rows per scale block: 32 or 128.
        round_sf: round the scales up to powers of two.
        without_transpose: store the codes as ``(M, H)`` instead of transposed ``(H, M)``.
        swiglu_clamp_value: optional clamp c >= 0.

    Returns:
        ``(out, sf)``: out float8_e4m3fn ``(H, M)`` (or ``(M, H)``) contiguous; sf float32 ``(M/npt, H)``
        contiguous (never transposed).
    """
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    check_choice("fmt", fmt, ("e4m3",))
    npt = _check_int("num_per_tokens", num_per_tokens)
    check_choice("num_per_tokens", npt, (32, 128))
    for name, v in (("round_sf", round_sf), ("without_transpose", without_transpose)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    m, two_h = x.shape
    if m % 128 != 0:
        raise ValueError(f"x must have a multiple of 128 rows, got shape {tuple(x.shape)}")
    if two_h % 128 != 0 or two_h == 0:
        raise ValueError(f"x must have 2*H columns with 2*H a multiple of 128, got shape {tuple(x.shape)}")
    check_inner_contiguous("x", x)
    check_device("x", x)
    clamp = _check_clamp_value("swiglu_clamp_value", swiglu_clamp_value)
    return _launch_op(x, npt, round_sf, without_transpose, clamp)
