"""The ``@triton.jit`` helpers of the SwiGLU casts: loads, the clamp and activation, amax, the e4m3 encode and
the scales shared by the forward, backward and per-channel kernels, and the forward kernel's same-bits
instruction-count paths (bf16-pair words, packed counts, PTX SiLU)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, EMULATE, exp_f32, f32_to_e4m3_bits, quant_scale
from ..language.cast import f32_to_e4m3_bits_satfinite
from ._swiglu_ptx import ptx_div_fast, ptx_one_plus_exp_neg, ptx_unpack_bf16_words


# ------------------------------------------------------------------------------------------------
# Shared jit pieces (also used by the backward and per-channel SwiGLU kernels)
# ------------------------------------------------------------------------------------------------
@triton.jit
def _load_f32(ptr, offs, mask, X_BF16: tl.constexpr):
    """Load float32 values from a bf16 (given as an int16 pointer, exact for every code) or fp32 tensor."""
    if X_BF16:
        return bf16_bits_to_f32(tl.load(ptr + offs, mask=mask, other=0))
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _load_raw(ptr, offs, mask, X_BF16: tl.constexpr):
    """bf16 bit patterns (int16; masked: 0) or float32 values (masked: 0.0)."""
    if X_BF16:
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _raw_to_f32(v, X_BF16: tl.constexpr):
    if X_BF16:
        return bf16_bits_to_f32(v)
    else:
        return v


@triton.jit
def _swiglu_clamp(l, r, c):
    """``l = min(l, c)``, ``r`` into ``[-c, c]``, by comparisons so that NaN stays NaN on every backend."""
    # -c as torch computes it (c = +0 gives -0.0): Triton's ``-c`` is ``0 - c`` (+0), and under the interpreter a
    # scalar's -0.0 turns into +0 when it meets a tensor, so the negation is done on a tensor
    nc = tl.full(r.shape, -1.0, tl.float32) * c
    l = tl.where(l > c, c, l)
    r = tl.where(r > c, c, tl.where(r < nc, nc, r))
    return l, r


@triton.jit
def _swiglu_act(l, r):
    """``(l / (1 + exp(-l))) * r`` with IEEE division and torch's exp (no product feeds an add)."""
    t = 1.0 + exp_f32(-l)
    return tl.math.div_rn(l, t) * r


@triton.jit
def _nan_as_inf_abs(v):
    """|v| with NaN mapped to +inf, so the amax of a block holding NaN is +inf on every backend."""
    return tl.where(v == v, tl.abs(v), float("inf"))


@triton.jit
def _encode_e4m3(x, sf_inv):
    """e4m3 code of ``f32(x * sf_inv)``; where that product is NaN the code is ``0x7F | sign(x)``
    (backends disagree on the sign of ``inf * 0``, so it is taken from x, as the reference does)."""
    v = x * sf_inv
    nan_code = (((x.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
    return tl.where(v != v, nan_code, f32_to_e4m3_bits(v))


# ------------------------------------------------------------------------------------------------
# The forward kernel's helpers
# ------------------------------------------------------------------------------------------------
@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _swiglu_clamp_minmax(l, r, c):
    """``_swiglu_clamp`` without predicates on GPUs: NaN-propagating min/max (``FMNMX.NAN``; IEEE
    754-2019 minimum/maximum order -0 below +0, so every result, signed zeros and NaN included,
    equals the comparisons' for every c except -0.0, which the launchers route to the comparisons:
    ``_minmax_clamp_ok``).  The interpreter's numpy min/max break ties by operand order (c = 0
    would lose a -0), so it keeps the comparisons."""
    if EMULATE:
        return _swiglu_clamp(l, r, c)
    else:
        l = tl.minimum(l, c, propagate_nan=tl.PropagateNan.ALL)
        r = tl.minimum(tl.maximum(r, tl.full(r.shape, -1.0, tl.float32) * c, propagate_nan=tl.PropagateNan.ALL),
                       c, propagate_nan=tl.PropagateNan.ALL)
        return l, r


@triton.jit
def _swiglu_act_neg_mul(l, r):
    """``_swiglu_act`` with ``-l`` written as ``l * -1`` (an exact negation the GPU folds into expf's
    first FMA; ``0 - l`` is not foldable).  The two differ only for l = +0, where exp gives 1 either way."""
    t = 1.0 + exp_f32(l * -1.0)
    return tl.math.div_rn(l, t) * r


_DIV4_CLAMPED = tl.constexpr("{ .reg .pred p; .reg .f32 m, n, r, s, e, q; max.f32 m, $4, $5; max.f32 n, $6, $7; max.f32 m, m, n; setp.le.f32 p, m, 0f42240000; @!p bra SLOW; rcp.approx.ftz.f32 r, $8; neg.f32 s, $8; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $4; mul.rn.f32 q, s, r; fma.rn.f32 e, $8, q, $4; neg.f32 r, r; fma.rn.f32 $0, r, e, q; rcp.approx.ftz.f32 r, $9; neg.f32 s, $9; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $5; mul.rn.f32 q, s, r; fma.rn.f32 e, $9, q, $5; neg.f32 r, r; fma.rn.f32 $1, r, e, q; rcp.approx.ftz.f32 r, $10; neg.f32 s, $10; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $6; mul.rn.f32 q, s, r; fma.rn.f32 e, $10, q, $6; neg.f32 r, r; fma.rn.f32 $2, r, e, q; rcp.approx.ftz.f32 r, $11; neg.f32 s, $11; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $7; mul.rn.f32 q, s, r; fma.rn.f32 e, $11, q, $7; neg.f32 r, r; fma.rn.f32 $3, r, e, q; bra.uni DONE; SLOW: div.rn.f32 $0, $4, $8; neg.f32 $0, $0; div.rn.f32 $1, $5, $9; neg.f32 $1, $1; div.rn.f32 $2, $6, $10; neg.f32 $2, $2; div.rn.f32 $3, $7, $11; neg.f32 $3, $3; DONE: }")
_DIV4_ANY = tl.constexpr("{ .reg .pred p; .reg .f32 m, n, r, s, e, q; max.f32 m, $4, $5; max.f32 n, $6, $7; max.f32 m, m, n; setp.le.f32 p, m, 0f42240000; min.f32 m, $4, $5; min.f32 n, $6, $7; min.f32 m, m, n; setp.gt.and.f32 p, m, 0fFF800000, p; @!p bra SLOW; rcp.approx.ftz.f32 r, $8; neg.f32 s, $8; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $4; mul.rn.f32 q, s, r; fma.rn.f32 e, $8, q, $4; neg.f32 r, r; fma.rn.f32 $0, r, e, q; rcp.approx.ftz.f32 r, $9; neg.f32 s, $9; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $5; mul.rn.f32 q, s, r; fma.rn.f32 e, $9, q, $5; neg.f32 r, r; fma.rn.f32 $1, r, e, q; rcp.approx.ftz.f32 r, $10; neg.f32 s, $10; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $6; mul.rn.f32 q, s, r; fma.rn.f32 e, $10, q, $6; neg.f32 r, r; fma.rn.f32 $2, r, e, q; rcp.approx.ftz.f32 r, $11; neg.f32 s, $11; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; neg.f32 s, $7; mul.rn.f32 q, s, r; fma.rn.f32 e, $11, q, $7; neg.f32 r, r; fma.rn.f32 $3, r, e, q; bra.uni DONE; SLOW: div.rn.f32 $0, $4, $8; neg.f32 $0, $0; div.rn.f32 $1, $5, $9; neg.f32 $1, $1; div.rn.f32 $2, $6, $10; neg.f32 $2, $2; div.rn.f32 $3, $7, $11; neg.f32 $3, $3; DONE: }")


@triton.jit
def _div_neg_fast(na, t, A_FINITE: tl.constexpr):
    """``div_rn(-na, t)`` for ``t = 1 + exp(na)`` (so t >= 1, or NaN): the same bits as ``div.rn.f32`` without
    its per-element range check (FCHK) and slow-path branch.  Taking the negated dividend lets the kernel
    share ``na = -l`` with the exp (one sign flip per bf16 pair on words).

    GPU, per 4 elements of a thread: if every ``na <= 41`` (l >= -41, so t <= 2^60; NaNs are skipped by the
    max and give NaN either way) and, unless A_FINITE (l <= clamp), ``na > -inf``: ``r = rcp.approx(t)``
    refined by one Newton step, ``q0 = l * r``, ``q = q0 - r * fma(t, q0, -l)``, the fast path of
    ``div.rn.f32``: correctly rounded, its remainder being exact (q0 is normal, or for |l| < 2^-100
    t = 2 and r = 1/2 exactly); the negated remainder keeps the sign of a zero quotient (-0 / t = -0).
    Otherwise the four take ``-div.rn.f32(na, t)``.  Under EMULATE: ``div_rn``."""
    if EMULATE:
        return tl.math.div_rn(na * -1.0, t)
    else:
        if A_FINITE:
            return tl.inline_asm_elementwise(_DIV4_CLAMPED, "=f,=f,=f,=f,f,f,f,f,f,f,f,f", [na, t], dtype=tl.float32,
                                             is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_DIV4_ANY, "=f,=f,=f,=f,f,f,f,f,f,f,f,f", [na, t], dtype=tl.float32,
                                             is_pure=True, pack=4)


@triton.jit
def _group_amax(v):
    """Max |v| over the last axis; a group holding NaN gives +inf (as ``max(_nan_as_inf_abs(v))``):
    a NaN-propagating max (one ``FMNMX.NAN`` per element on GPUs) and one fix-up per group."""
    a = tl.reduce(tl.abs(v), 2, _max_nan)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _bf16x2_count(acc, w, cb, GT: tl.constexpr):
    """Per bf16 half of the int32 words ``w`` (two bf16 each): ``acc + (x > cb)`` (GT) or ``acc + (x < cb)``,
    with ``acc`` and ``cb`` int32 words of two bf16 as well; ``acc`` holds small integer counts (exact up
    to 256).  GPU: one ``set.{gt,lt}.bf16x2.bf16x2`` (1.0 where true; NaN compares false; no flush of
    subnormals) and one ``add.rn.bf16x2`` per word, instead of a float32 compare, a select and an
    integer add per element."""
    if EMULATE:
        cf_lo = (cb << 16).to(tl.float32, bitcast=True)
        cf_hi = (cb & -65536).to(tl.float32, bitcast=True)
        x_lo = (w << 16).to(tl.float32, bitcast=True)
        x_hi = (w & -65536).to(tl.float32, bitcast=True)
        if GT:
            h_lo = x_lo > cf_lo
            h_hi = x_hi > cf_hi
        else:
            h_lo = x_lo < cf_lo
            h_hi = x_hi < cf_hi
        a_lo = (acc << 16).to(tl.float32, bitcast=True) + tl.where(h_lo, 1.0, 0.0)
        a_hi = (acc & -65536).to(tl.float32, bitcast=True) + tl.where(h_hi, 1.0, 0.0)
        # small integers: exact in bf16 (the low 16 bits of the float32 patterns are zero)
        return ((a_lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (a_hi.to(tl.int32, bitcast=True) & -65536)
    else:
        if GT:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 m; set.gt.bf16x2.bf16x2 m, $2, $3; add.rn.bf16x2 $0, $1, m; }", "=r,r,r,r",
                [acc, w, cb], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 m; set.lt.bf16x2.bf16x2 m, $2, $3; add.rn.bf16x2 $0, $1, m; }", "=r,r,r,r",
                [acc, w, cb], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_clamp(lw, rw, cw, ncw):
    """``l = min(l, c)``, ``r`` into ``[-c, c]`` on int32 words of two bf16, for a clamp ``c > 0`` that
    is a bf16 value (``cw``/``ncw``: c / -c in both halves): the same values as the float32 clamp (c > 0:
    no signed-zero ties; NaN stays NaN).  GPU: ``min.NaN.bf16x2`` / ``max.NaN.bf16x2``, 1.5 instructions
    per element instead of 3."""
    if EMULATE:
        c = (cw << 16).to(tl.float32, bitcast=True)
        l_lo, r_lo = _swiglu_clamp((lw << 16).to(tl.float32, bitcast=True), (rw << 16).to(tl.float32, bitcast=True), c)
        l_hi, r_hi = _swiglu_clamp((lw & -65536).to(tl.float32, bitcast=True),
                                   (rw & -65536).to(tl.float32, bitcast=True), c)
        # bf16 values (or NaN, whose payload does not matter): the low 16 bits are zero
        lw = ((l_lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (l_hi.to(tl.int32, bitcast=True) & -65536)
        rw = ((r_lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (r_hi.to(tl.int32, bitcast=True) & -65536)
        return lw, rw
    else:
        lw = tl.inline_asm_elementwise("min.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [lw, cw], dtype=tl.int32,
                                       is_pure=True, pack=1)
        rw = tl.inline_asm_elementwise("{ .reg .b32 t; max.NaN.bf16x2 t, $1, $3; min.NaN.bf16x2 $0, t, $2; }",
                                       "=r,r,r,r", [rw, cw, ncw], dtype=tl.int32, is_pure=True, pack=1)
        return lw, rw


@triton.jit
def _words_count_sum(acc):
    """Row sums ``[R]`` (int32) of the bf16 counts held in both halves of the words ``acc [R, W]``."""
    lo = (acc << 16).to(tl.float32, bitcast=True).to(tl.int32)
    hi = (acc & -65536).to(tl.float32, bitcast=True).to(tl.int32)
    return tl.sum(lo + hi, axis=1)


@triton.jit
def _load_half(x_row, c0, off, active, H: tl.constexpr, CH: tl.constexpr, X_BF16: tl.constexpr,
               X_WORDS: tl.constexpr):
    """Columns ``off + c0 .. off + c0 + CH`` of the rows (masked: 0): int32 words of two bf16 ``[R, CH/2]``
    (X_WORDS; ``x_row`` an int32 row pointer), else bf16 bits (int16) or float32 ``[R, CH]``."""
    if X_WORDS:
        cw = c0 // 2 + tl.arange(0, CH // 2)
        m = active[:, None] & (cw < H // 2)[None, :]
        return tl.load(x_row + (cw[None, :] + off // 2), mask=m, other=0)
    else:
        cols = c0 + tl.arange(0, CH)
        m = active[:, None] & (cols < H)[None, :]
        return _load_raw(x_row, cols[None, :] + off, m, X_BF16)


@triton.jit
def _packed_count_inc(l, r, c):
    """The PACKED_COUNT increments: ``l > c`` in bits 0-9, ``r > c`` in bits 10-19, ``r < -c`` from bit 20."""
    return tl.where(l > c, 1, 0) + tl.where(r > c, 1 << 10, 0) + tl.where(r < -c, 1 << 20, 0)


@triton.jit
def _act_of(l, nl, r, w, active, c, HAS_CLAMP: tl.constexpr, MINMAX_CLAMP: tl.constexpr, FAST_ENC: tl.constexpr,
            HAS_WEIGHTS: tl.constexpr, HAS_P2E: tl.constexpr, FAST_DIV: tl.constexpr, A_FINITE: tl.constexpr,
            NL_GIVEN: tl.constexpr):
    """float32 act ``[R, N]`` of the halves: clamp (HAS_CLAMP), SwiGLU, routing weight, padding rows -> 0.
    NL_GIVEN (only without HAS_CLAMP): ``nl`` is ``-l``, used by FAST_DIV."""
    if HAS_CLAMP:
        if MINMAX_CLAMP:
            l, r = _swiglu_clamp_minmax(l, r, c)
        else:
            l, r = _swiglu_clamp(l, r, c)
    if FAST_DIV:
        if not NL_GIVEN:
            nl = l * -1.0
        act = _div_neg_fast(nl, 1.0 + exp_f32(nl), A_FINITE) * r  # = _swiglu_act_neg_mul(l, r)
    elif FAST_ENC:
        act = _swiglu_act_neg_mul(l, r)
    else:
        act = _swiglu_act(l, r)
    if HAS_WEIGHTS:
        act = act * w[:, None]
    if HAS_P2E or not FAST_ENC:
        # padding rows (pos_to_expert < 0) are all-zero activations (rows past num_rows are never
        # stored: nothing to clear there)
        act = tl.where(active[:, None], act, 0.0)
    return act


@triton.jit
def _amax3(v, FAST_MAX: tl.constexpr):
    """Group amax over the last axis of ``v [R, G, N]``, NaN counted as +inf."""
    if FAST_MAX:
        return _group_amax(v)
    else:
        return tl.max(_nan_as_inf_abs(v), axis=2)


@triton.jit
def _amax3_pair(lo, hi, FAST_MAX: tl.constexpr):
    """``_amax3`` of the interleaved ``lo``/``hi`` groups: an elementwise max first (one
    ``FMNMX.NAN |a|, |b|`` per pair on GPUs), then one reduction."""
    if FAST_MAX:
        a = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 2, _max_nan)
        return tl.where(a == a, a, float("inf"))
    else:
        return tl.max(tl.maximum(_nan_as_inf_abs(lo), _nan_as_inf_abs(hi)), axis=2)


@triton.jit
def _encode_pair(lo, hi, sf_inv, FAST_ENC: tl.constexpr):
    """int16 words of two e4m3 codes: ``lo * sf_inv`` in the low byte, ``hi * sf_inv`` in the high byte
    (the even and the odd column of a little-endian uint8 output).  FAST_ENC: one
    ``cvt.rn.satfinite.e4m3x2.f32`` per word on GPUs (NaN codes' sign free), else ``_encode_e4m3``."""
    if FAST_ENC:
        a = lo * sf_inv
        b = hi * sf_inv
        if EMULATE:
            return ((f32_to_e4m3_bits_satfinite(a).to(tl.int32) & 0xFF)
                    | (f32_to_e4m3_bits_satfinite(b).to(tl.int32) << 8)).to(tl.int16)
        else:
            return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [a, b],
                                             dtype=tl.int16, is_pure=True, pack=1)
    else:
        return ((_encode_e4m3(lo, sf_inv).to(tl.int32) & 0xFF) | (_encode_e4m3(hi, sf_inv).to(tl.int32) << 8)).to(tl.int16)


# ------------------------------------------------------------------------------------------------
# Instruction-count candidates (config keys FUSED_SILU, INT_COUNT, XORSIGN_CLAMP, INT_SCALE; same bits)
# ------------------------------------------------------------------------------------------------
def _silu_act_words_ptx(nw: int) -> str:
    """PTX of the SwiGLU of ``2 * nw`` elements: ``nw`` words of (clamped) l (``$2nw..``) and ``nw`` words of r
    (``$3nw..``) to float32 act: ``$0..$nw-1`` the low halves (even columns), ``$nw..$2nw-1`` the high halves.
    Per element the FAST_DIV path's operations (``l * -1`` -> libdevice ``expf`` -> ``1 + e`` ->
    ``_div_neg_fast`` -> ``* r``) with the per-channel op's three exact rewrites (``_silu_words_ptx`` in
    swiglu_forward_and_per_channel_cast_and_transpose_kernel: the sign flip folded into expf's constants, expf's
    ``cvt.sat`` folded into its first fma and ``1 + e * 2^n`` as one fma, the division's fast path guarded by
    ``max |l| <= 41``); the guard here is taken on the bf16 words (``max.xorsign.abs.bf16x2`` keeps
    ``max(|a|, |b|)`` in the magnitude, NaN skipped; ``abs``; one ``setp.le.bf16x2`` against 41 in both halves):
    three bf16x2 max per four words instead of seven float32 max per eight elements."""
    n = 2 * nw
    lw = [f"${n + i}" for i in range(nw)]
    rw = [f"${n + nw + i}" for i in range(nw)]
    unpack = ptx_unpack_bf16_words(lw, "l")
    exp = "".join(ptx_one_plus_exp_neg(f"l{i}", f"t{i}") for i in range(n))
    guard = f"max.xorsign.abs.bf16x2 m, {lw[0]}, {lw[1 % nw]}; " + "".join(
        f"max.xorsign.abs.bf16x2 m, m, {w}; " for w in lw[2:]) + (
        "abs.bf16x2 m, m; mov.b32 a, 0x42244224; setp.le.bf16x2 p|q, m, a; and.pred p, p, q; ")
    fast = "".join(ptx_div_fast(f"l{i}", f"t{i}", f"q{i}", "y", "y", "y") for i in range(n))
    slow = "".join(f"div.rn.f32 q{i}, l{i}, t{i}; " for i in range(n))
    mul = "".join(f"shl.b32 r, {w}, 16; mul.rn.f32 ${i}, q{2 * i}, r; and.b32 r, {w}, 0xFFFF0000; "
                  f"mul.rn.f32 ${nw + i}, q{2 * i + 1}, r; " for i, w in enumerate(rw))
    return (f"{{ .reg .pred p, q; .reg .b32 l<{n}>, t<{n}>, q<{n}>, r, s, j, k, f, e, y, z, m, a; "
            + unpack + exp + guard + "@!p bra SLOW; " + fast + "bra.uni DONE; SLOW: " + slow + "DONE: " + mul + "}")


_SILU_ACT4 = tl.constexpr(_silu_act_words_ptx(4))


@triton.jit
def _silu_act_words(lw, rw):
    """float32 act ``(lo, hi)`` of the words of (clamped) l and r: one ``_silu_act_words_ptx(4)`` block per four
    words of a thread (GPU only: the caller runs the element path under EMULATE)."""
    return tl.inline_asm_elementwise(_SILU_ACT4, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r", [lw, rw],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def _u32_mask_emu(w, cb, GT: tl.constexpr):
    """``set.{gt,lt}.u32.bf16x2 w, cb`` under EMULATE: 0xFFFF in each half where the bf16 compare holds."""
    x_lo = (w << 16).to(tl.float32, bitcast=True)
    x_hi = (w & -65536).to(tl.float32, bitcast=True)
    c_lo = (cb << 16).to(tl.float32, bitcast=True)
    c_hi = (cb & -65536).to(tl.float32, bitcast=True)
    if GT:
        return tl.where(x_lo > c_lo, 0xFFFF, 0) | tl.where(x_hi > c_hi, -65536, 0)
    else:
        return tl.where(x_lo < c_lo, 0xFFFF, 0) | tl.where(x_hi < c_hi, -65536, 0)


@triton.jit
def _u32_count2(acc, w0, w1, cb, GT: tl.constexpr):
    """``acc + m(w0) + m(w1)`` (int32, wrapping) with ``m`` the 16-bit compare masks of the bf16 pairs against
    ``cb`` (``x > cb`` (GT) or ``x < cb``; 0xFFFF per true half, NaN false).  GPU: two ``HSET2`` (integer
    result) and one ``IADD3`` per two words: 0.75 instructions per element and count instead of 1
    (``_bf16x2_count``).  ``_u32_count_decode`` turns the sums back into counts."""
    if EMULATE:
        return acc + _u32_mask_emu(w0, cb, GT) + _u32_mask_emu(w1, cb, GT)
    else:
        if GT:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 m, n; set.gt.u32.bf16x2 m, $2, $4; set.gt.u32.bf16x2 n, $3, $4; add.u32 m, m, n; "
                "add.u32 $0, $1, m; }", "=r,r,r,r,r", [acc, w0, w1, cb], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 m, n; set.lt.u32.bf16x2 m, $2, $4; set.lt.u32.bf16x2 n, $3, $4; add.u32 m, m, n; "
                "add.u32 $0, $1, m; }", "=r,r,r,r,r", [acc, w0, w1, cb], dtype=tl.int32, is_pure=True, pack=1)



@triton.jit
def _u32_clamp_counts(i_l, i_rp, i_rn, l_raw, r_raw, cb_pos2, cb_neg2):
    """INT_COUNT: add a chunk's words ``[R, CH / 2]`` of l and r to the mask sums of ``l > c``, ``r > c``, ``r < -c``
    (``_u32_count2`` on pairs of words)."""
    R: tl.constexpr = l_raw.shape[0]
    W: tl.constexpr = l_raw.shape[1]
    l0, l1 = tl.split(tl.reshape(l_raw, (R, W // 2, 2)))
    r0, r1 = tl.split(tl.reshape(r_raw, (R, W // 2, 2)))
    return (_u32_count2(i_l, l0, l1, cb_pos2, True), _u32_count2(i_rp, r0, r1, cb_pos2, True),
            _u32_count2(i_rn, r0, r1, cb_neg2, False))

@triton.jit
def _u32_count_decode(acc):
    """Row sums ``[R]`` (int64) of the counts held in the mask sums ``acc [R, W]`` (see ``_u32_count2``).

    A word that summed ``a`` true low halves and ``b`` true high halves holds ``a * 0xFFFF + b * 0xFFFF0000``
    mod 2^32, so ``v = -acc = a + (b - a) * 2^16`` mod 2^32: ``a`` is the low 16 bits of v, ``b - a`` the high
    16 bits (mod 2^16), and ``a + b = ((v >> 16) + 2 v) mod 2^16``, exact while ``a + b < 2^16`` (the kernel
    flushes every CNT_FLUSH row blocks)."""
    v = 0 - acc
    return tl.sum(((v >> 16) + (v << 1)) & 0xFFFF, axis=1).to(tl.int64)


@triton.jit
def _bf16x2_clamp_xorsign(lw, rw, cw, ncw):
    """``_bf16x2_clamp`` with ``r`` clamped by one ``min.NaN.xorsign.abs.bf16x2 r, r, c`` (c > 0 in both
    halves): ``min(|r|, c)`` with r's sign (c's is +), i.e. r for |r| <= c (signed zeros kept), +-c beyond,
    +-inf -> +-c, NaN -> NaN: the comparisons' values for every bf16 r.  One instruction per two r instead of
    two."""
    if EMULATE:
        return _bf16x2_clamp(lw, rw, cw, ncw)
    else:
        lw = tl.inline_asm_elementwise("min.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [lw, cw], dtype=tl.int32,
                                       is_pure=True, pack=1)
        rw = tl.inline_asm_elementwise("min.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [rw, cw],
                                       dtype=tl.int32, is_pure=True, pack=1)
        return lw, rw


@triton.jit
def _pow2_scale_f32_bits(amax, sf_clamp_min):
    """``quant_scale(amax, sf_clamp_min, 448, ROUND_SF=True)`` in integer ops, for ``sf_clamp_min >= 2^-118``
    (the host checks) and amax >= 0 or +inf (NaN already mapped to +inf).

    ``a = max(amax, cmin) = 2^E (1 + m / 2^23)`` with E >= -118: ``a / 448 = 2^(E-8) (1 + m / 2^23) / 1.75``
    is a normal float32, and ``ceil(log2(div_rn(a, 448)))`` is ``E - 8`` for ``m <= 0x600000`` (the quotient
    lies in (2^(E-9), 2^(E-8)]: 1.75 gives exactly 2^(E-8)) and ``E - 7`` above (the quotient exceeds 2^(E-8)
    by at least 2^-23 / 1.75 of it, more than half an ulp, so its rounding stays above).  So the sf bits are
    ``(bits(a) + 0x1FFFFF - 8 * 2^23) & 0xFF800000`` and sf_inv's ``0x7F000000`` minus them; +inf gives
    ``sf = +inf``, ``sf_inv = 0``.  (Checked against the division for every mantissa at several exponents in
    tests/quant/test_swiglu_forward_and_per_token_cast.py.)"""
    a = tl.maximum(amax, sf_clamp_min)
    t = a.to(tl.int32, bitcast=True)
    s = (t + (0x1FFFFF - (8 << 23))) & -8388608
    fin = t < 0x7F800000
    sf = tl.where(fin, s, 0x7F800000).to(tl.float32, bitcast=True)
    sf_inv = tl.where(fin, 0x7F000000 - s, 0).to(tl.float32, bitcast=True)
    return sf, sf_inv


@triton.jit
def _scale(amax, sf_clamp_min, ROUND_SF: tl.constexpr, INT_SCALE: tl.constexpr):
    if ROUND_SF and INT_SCALE:
        return _pow2_scale_f32_bits(amax, sf_clamp_min)
    else:
        return quant_scale(amax, sf_clamp_min, 448.0, ROUND_SF)
