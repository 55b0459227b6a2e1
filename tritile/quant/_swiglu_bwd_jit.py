"""``@triton.jit`` helpers of ``swiglu_backward_and_per_token_cast``: the chunk loads (``_bwd_chunk_loads``), a
chunk's backward, stores and row-sum update (``_bwd_chunk``), the element-wise backward (``_bwd_elements``) and its
fused PTX block (``_bwd_fused``, ``_bwd_fused_ptx``), the shared reciprocal / division (``_rcp_div_fast``) and the
per-group e4m3 cast of dx (``_quant_store``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..language import EMULATE, e4m3_bits_to_f32, exp_f32, f32_to_bf16_bits, quant_scale, ue8m0_to_f32
from ..language.cast import _libdevice, f32_to_e4m3_bits_satfinite
from ._swiglu_jit import (_encode_e4m3, _group_amax, _nan_as_inf_abs, _pow2_scale_f32_bits, _swiglu_clamp,
                          _swiglu_clamp_minmax)
from ._swiglu_ptx import ptx_abs_max, ptx_div_fast, ptx_one_plus_exp_neg


@triton.jit
def _e4m3_to_f32(bits):
    """e4m3fn bytes (uint8) -> float32, exact: the hardware conversion on GPUs (one cvt per pair
    instead of a dozen integer ops), the integer decode under the interpreter (whose fp8 upcast
    turns NaN codes into +-480)."""
    if EMULATE:
        return e4m3_bits_to_f32(bits)
    else:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _load_sf(sf_ptr, rows, gidx, stride_m, stride_k, m, SF_PACKED: tl.constexpr):
    """Input scales ``[R, G]`` of k-blocks ``gidx`` (mask ``m``): float32, or packed UE8M0 (byte k%4 of
    word k//4)."""
    if SF_PACKED:
        word = tl.load(sf_ptr + rows[:, None] * stride_m + (gidx[None, :] // 4) * stride_k, mask=m, other=0)
        return ue8m0_to_f32((word >> ((gidx[None, :] % 4) * 8)) & 0xFF)
    else:
        return tl.load(sf_ptr + rows[:, None] * stride_m + gidx[None, :] * stride_k, mask=m, other=0.0)


@triton.jit
def _quant_store(v, rows, cols, m, gidx, gm, q_ptr, stride_qm, sf_ptr, stride_sm,
                 ROUND_SF: tl.constexpr, BLOCK_R: tl.constexpr, CH: tl.constexpr, FAST_MAX: tl.constexpr,
                 FAST_ENC: tl.constexpr, INT_SCALE: tl.constexpr = False):
    """Per-group (last axis) e4m3 cast of ``v [R, G, NPC]`` (0 where masked): codes at ``cols`` (mask
    ``m``), float32 sf at ``gidx`` (mask ``gm``).  FAST_MAX / FAST_ENC: as in the forward kernel (a
    NaN-propagating group max; the plain encode, whose NaN codes' sign is free).  INT_SCALE (ROUND_SF): the
    power-of-two scale from amax's bits (``_pow2_scale_f32_bits`` of the forward kernel, exact for a clamp
    minimum >= 2^-118; here 1e-4), instead of ``div_rn(amax, 448)`` and its exponent (no FCHK / slow-path call)."""
    if FAST_MAX:
        amax = _group_amax(v)
    else:
        amax = tl.max(_nan_as_inf_abs(v), axis=2)
    if ROUND_SF and INT_SCALE:
        sf, sf_inv = _pow2_scale_f32_bits(amax, 1e-4)
    else:
        sf, sf_inv = quant_scale(amax, 1e-4, 448.0, ROUND_SF)
    if FAST_ENC:
        q = tl.reshape(f32_to_e4m3_bits_satfinite(v * sf_inv[:, :, None]), (BLOCK_R, CH))
    else:
        q = tl.reshape(_encode_e4m3(v, sf_inv[:, :, None]), (BLOCK_R, CH))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=m)
    tl.store(sf_ptr + rows[:, None] * stride_sm + gidx[None, :], sf, mask=gm)


_RCP_DIV4_CLAMPED = tl.constexpr("{ .reg .pred p; .reg .f32 m, n, r, s, e, q; max.f32 m, $8, $9; max.f32 n, $10, $11; max.f32 m, m, n; setp.le.f32 p, m, 0f42240000; @!p bra SLOW; rcp.approx.ftz.f32 r, $12; neg.f32 s, $12; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $0, r; neg.f32 s, $8; mul.rn.f32 q, s, r; fma.rn.f32 e, $12, q, $8; neg.f32 r, r; fma.rn.f32 $4, r, e, q; rcp.approx.ftz.f32 r, $13; neg.f32 s, $13; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $1, r; neg.f32 s, $9; mul.rn.f32 q, s, r; fma.rn.f32 e, $13, q, $9; neg.f32 r, r; fma.rn.f32 $5, r, e, q; rcp.approx.ftz.f32 r, $14; neg.f32 s, $14; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $2, r; neg.f32 s, $10; mul.rn.f32 q, s, r; fma.rn.f32 e, $14, q, $10; neg.f32 r, r; fma.rn.f32 $6, r, e, q; rcp.approx.ftz.f32 r, $15; neg.f32 s, $15; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $3, r; neg.f32 s, $11; mul.rn.f32 q, s, r; fma.rn.f32 e, $15, q, $11; neg.f32 r, r; fma.rn.f32 $7, r, e, q; bra.uni DONE; SLOW: rcp.rn.f32 $0, $12; div.rn.f32 $4, $8, $12; neg.f32 $4, $4; rcp.rn.f32 $1, $13; div.rn.f32 $5, $9, $13; neg.f32 $5, $5; rcp.rn.f32 $2, $14; div.rn.f32 $6, $10, $14; neg.f32 $6, $6; rcp.rn.f32 $3, $15; div.rn.f32 $7, $11, $15; neg.f32 $7, $7; DONE: }")
_RCP_DIV4_ANY = tl.constexpr("{ .reg .pred p; .reg .f32 m, n, r, s, e, q; max.f32 m, $8, $9; max.f32 n, $10, $11; max.f32 m, m, n; setp.le.f32 p, m, 0f42240000; min.f32 m, $8, $9; min.f32 n, $10, $11; min.f32 m, m, n; setp.gt.and.f32 p, m, 0fFF800000, p; @!p bra SLOW; rcp.approx.ftz.f32 r, $12; neg.f32 s, $12; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $0, r; neg.f32 s, $8; mul.rn.f32 q, s, r; fma.rn.f32 e, $12, q, $8; neg.f32 r, r; fma.rn.f32 $4, r, e, q; rcp.approx.ftz.f32 r, $13; neg.f32 s, $13; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $1, r; neg.f32 s, $9; mul.rn.f32 q, s, r; fma.rn.f32 e, $13, q, $9; neg.f32 r, r; fma.rn.f32 $5, r, e, q; rcp.approx.ftz.f32 r, $14; neg.f32 s, $14; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $2, r; neg.f32 s, $10; mul.rn.f32 q, s, r; fma.rn.f32 e, $14, q, $10; neg.f32 r, r; fma.rn.f32 $6, r, e, q; rcp.approx.ftz.f32 r, $15; neg.f32 s, $15; fma.rn.f32 e, s, r, 0f3F800000; fma.rn.f32 r, r, e, r; mov.b32 $3, r; neg.f32 s, $11; mul.rn.f32 q, s, r; fma.rn.f32 e, $15, q, $11; neg.f32 r, r; fma.rn.f32 $7, r, e, q; bra.uni DONE; SLOW: rcp.rn.f32 $0, $12; div.rn.f32 $4, $8, $12; neg.f32 $4, $4; rcp.rn.f32 $1, $13; div.rn.f32 $5, $9, $13; neg.f32 $5, $5; rcp.rn.f32 $2, $14; div.rn.f32 $6, $10, $14; neg.f32 $6, $6; rcp.rn.f32 $3, $15; div.rn.f32 $7, $11, $15; neg.f32 $7, $7; DONE: }")


@triton.jit
def _rcp_div_fast(nx, t, X_FINITE: tl.constexpr):
    """``(div_rn(1, t), div_rn(-nx, t))`` for ``t = 1 + exp(nx)`` (t >= 1, or NaN): the same bits as
    ``rcp.rn.f32`` / ``div.rn.f32``, sharing one refined reciprocal and without their per-element range
    checks and slow-path branches.

    GPU, per 4 elements of a thread: if every ``nx <= 41`` (x >= -41, so t <= 2^60; NaNs are skipped by
    the max and give NaN either way) and, unless X_FINITE (x <= clamp), ``nx > -inf``:
    ``r = rcp.approx(t)`` refined by one Newton step is ``rcp.rn(t)`` (the fast path of ``rcp.rn.f32``),
    and ``q0 = x * r``, ``q = q0 - r * fma(t, q0, -x)`` is the fast path of ``div.rn.f32`` (exact
    remainder: q0 normal, or t = 2 and r = 1/2 for |x| < 2^-100; -0 / t stays -0).  Otherwise the four
    take ``rcp.rn.f32`` and ``-div.rn.f32(nx, t)``.  Under EMULATE: ``div_rn``."""
    if EMULATE:
        return tl.math.div_rn(tl.full(t.shape, 1.0, tl.float32), t), tl.math.div_rn(nx * -1.0, t)
    else:
        if X_FINITE:
            return tl.inline_asm_elementwise(_RCP_DIV4_CLAMPED, "=f,=f,=f,=f,=f,=f,=f,=f,f,f,f,f,f,f,f,f", [nx, t],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_RCP_DIV4_ANY, "=f,=f,=f,=f,=f,=f,=f,=f,f,f,f,f,f,f,f,f", [nx, t],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def _bwd_elements(xf, yf, gbits, w3, clamp_value, HAS_CLAMP: tl.constexpr, MASK_FLAGS: tl.constexpr,
                  MINMAX_CLAMP: tl.constexpr, FAST_DIV: tl.constexpr, FAST_ENC: tl.constexpr,
                  BLOCK_R: tl.constexpr, G: tl.constexpr, NPC: tl.constexpr):
    """The element-wise backward of a chunk (the default path): ``(act * w, dx_x, dx_y, g * act)`` of the
    unclamped xf / yf ``[R, G, NPC]``, the grad_out bits ``[R, CH]`` and the weights ``w3 [R, 1, 1]``."""
    g = tl.reshape((gbits.to(tl.int32) << 16).to(tl.float32, bitcast=True), (BLOCK_R, G, NPC))
    if HAS_CLAMP:
        if MASK_FLAGS:
            # -1 keeps dx, 0 clears it to +0; |yf| > c is (yf > c) | (yf < -c) for c >= 0 (NaN: false)
            kx = tl.where(xf > clamp_value, 0, -1)
            ky = tl.where(tl.abs(yf) > clamp_value, 0, -1)
        else:
            cx = xf > clamp_value
            cy = (yf > clamp_value) | (yf < -clamp_value)
        if MINMAX_CLAMP:
            xf, yf = _swiglu_clamp_minmax(xf, yf, clamp_value)
        else:
            xf, yf = _swiglu_clamp(xf, yf, clamp_value)
    if FAST_DIV and FAST_ENC:
        nx = xf * -1.0  # exact negation, shared by the exp and the division
        t = 1.0 + exp_f32(nx)
        s, q = _rcp_div_fast(nx, t, HAS_CLAMP)
        act = q * yf
    else:
        if FAST_ENC:
            t = 1.0 + exp_f32(xf * -1.0)  # exact negation, folded into expf's first FMA
        else:
            t = 1.0 + exp_f32(-xf)
        s = tl.math.div_rn(tl.full(t.shape, 1.0, tl.float32), t)
        act = tl.math.div_rn(xf, t) * yf
    gws = (g * w3) * s
    # the one fused step of the reference: fma(xf, 1 - s, 1)
    dxx = (gws * yf) * tl.fma(xf, 1.0 - s, 1.0)
    dxy = gws * xf
    if HAS_CLAMP:
        if MASK_FLAGS:
            dxx = (dxx.to(tl.int32, bitcast=True) & kx).to(tl.float32, bitcast=True)
            dxy = (dxy.to(tl.int32, bitcast=True) & ky).to(tl.float32, bitcast=True)
        else:
            dxx = tl.where(cx, 0.0, dxx)
            dxy = tl.where(cy, 0.0, dxy)
    return act * w3, dxx, dxy, g * act


# ------------------------------------------------------------------------------------------------
# FUSED_BWD=4 (with XORSIGN_CLAMP; the GPU default): the per-element backward in one PTX block per four elements of
# a thread; same bits as the FAST_DIV path (see _swiglu_backward_and_per_token_cast_kernel)
# ------------------------------------------------------------------------------------------------
def _bwd_fused_ptx(clamp: bool, xorsign: bool) -> str:
    """PTX of the backward of four elements: outputs ``act * w`` ($0-3), dx of the x half ($4-7), dx of the y half
    ($8-11) and ``g * act`` ($12-15, the row-sum terms); inputs the dequantized, unclamped xf ($16-19) and yf
    ($20-23), the grad_out bf16 bits as two words ($24: elements 0 (low half) and 1; $25: 2 and 3), the routing
    weight ($26-29) and the clamp c ($30-33).

    Per element the FAST_DIV path's operations in its order (clamp flags, clamp, ``x * -1`` -> libdevice ``expf``
    -> ``1 + e`` -> ``rcp.rn`` / ``div.rn`` (``_rcp_div_fast``) -> ``(g * w) * s``, ``q * yf``, ``act * w``,
    ``g * act``, ``(gws * yf) * fma(xf, 1 - s, 1)``, ``gws * xf``, the flags clearing dx to +0), with these exact
    rewrites (no other rounding changes):
    (1) expf as the forward's FUSED_SILU block (``_silu_act_words_ptx``): ``-x`` folded into the constants,
        ``cvt.sat`` folded into the first ``fma``, ``1 + e * 2^n`` as one ``fma(e, 2^n, 1)``;
    (2) the reciprocal/division fast path guarded by ``max |x| <= 41`` over the four (x >= -41 and x < +inf,
        the fast path's range, for every non-NaN element; NaNs are skipped by ``max`` and give NaN either way),
        instead of ``max(-x) <= 41``: a narrower guard, ``rcp.rn`` / ``div.rn`` otherwise, which the fast path
        equals where taken;
    (3) the flags ``x > c`` / ``|y| > c`` (NaN: false) taken from the unclamped inputs at the end, each selecting
        +0 for dx (``setp`` + ``selp``; MASK_FLAGS' values);
    (4) grad_out widened from the loaded words by one ``shl`` / ``and`` per element;
    (5) (``xorsign``, c >= +0) ``y = min.NaN.xorsign.abs(y, c)``: ``min(|y|, c)`` with y's sign is y for |y| <= c
        (signed zeros kept), +-c beyond (+-inf included), NaN for NaN: the comparisons' values for every y (c = +0:
        +0 for y >= +0, -0 for y <= -0, as ``y > c ? c : y < -c ? -c : y``); else ``max.NaN`` / ``min.NaN``
        (MINMAX_CLAMP).  x is clamped by ``min.NaN`` (MINMAX_CLAMP; the launcher routes c = -0.0 away)."""
    one = "0f3F800000"
    b = ""
    for i in range(4):
        x, y, c = f"${16 + i}", f"${20 + i}", f"${30 + i}"
        if clamp:
            b += f"min.NaN.f32 x{i}, {x}, {c}; "
            if xorsign:
                b += f"min.NaN.xorsign.abs.f32 y{i}, {y}, {c}; "
            else:
                b += f"neg.f32 a, {c}; max.NaN.f32 y{i}, {y}, a; min.NaN.f32 y{i}, y{i}, {c}; "
        else:
            b += f"mov.b32 x{i}, {x}; mov.b32 y{i}, {y}; "
        b += ptx_one_plus_exp_neg(f"x{i}", f"t{i}")
    guard = ptx_abs_max([f"x{i}" for i in range(4)])
    fast = "".join(ptx_div_fast(f"x{i}", f"t{i}", f"q{i}", "r", f"s{i}", "r") for i in range(4))
    slow = "".join(f"rcp.rn.f32 s{i}, t{i}; div.rn.f32 q{i}, x{i}, t{i}; " for i in range(4))
    tail = ""
    for i in range(4):
        c, gw, w = f"${30 + i}", f"${24 + i // 2}", f"${26 + i}"
        tail += (f"shl.b32 g, {gw}, 16; " if i % 2 == 0 else f"and.b32 g, {gw}, 0xFFFF0000; ")
        tail += (f"mul.rn.f32 h, g, {w}; mul.rn.f32 h, h, s{i}; "             # gws = (g * w) * s
                 f"mul.rn.f32 a, q{i}, y{i}; mul.rn.f32 ${i}, a, {w}; mul.rn.f32 ${12 + i}, g, a; "
                 f"sub.rn.f32 d, {one}, s{i}; fma.rn.f32 d, x{i}, d, {one}; "
                 f"mul.rn.f32 u, h, y{i}; mul.rn.f32 u, u, d; mul.rn.f32 v, h, x{i}; ")
        if clamp:
            # the flags from the unclamped inputs (still live: no mask registers across the branch)
            tail += (f"setp.gt.f32 p, ${16 + i}, {c}; selp.b32 ${4 + i}, 0, u, p; "
                     f"abs.f32 a, ${20 + i}; setp.gt.f32 p, a, {c}; selp.b32 ${8 + i}, 0, v, p; ")
        else:
            tail += f"mov.b32 ${4 + i}, u; mov.b32 ${8 + i}, v; "
    regs = ".reg .pred p; .reg .b32 x<4>, y<4>, t<4>, s<4>, q<4>, a, s, j, k, f, e, m, r, z, g, h, d, u, v; "
    return ("{ " + regs + b + guard + "setp.le.f32 p, m, 0f42240000; @!p bra SLOW; " + fast + "bra.uni DONE; SLOW: "
            + slow + "DONE: " + tail + "}")


# the fused blocks by clamp mode: no clamp, clamp, clamp with XORSIGN (_bwd_fused picks one at compile time); the
# constraints: 16 float outputs, then x, y (4 each), two grad_out words, w, c (4 each)
_BWD_ASM = tl.constexpr(tuple(_bwd_fused_ptx(c, x) for c, x in ((False, False), (True, False), (True, True))))
_BWD_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 16 + ["f"] * 8 + ["r"] * 2 + ["f"] * 8))


@triton.jit
def _bwd_fused(xf, yf, gbits, w, c, HAS_CLAMP: tl.constexpr, XORSIGN: tl.constexpr):
    """``(act * w, dx_x, dx_y, g * act)`` of the unclamped xf / yf, grad_out bits ``gbits`` (int16) and the routing
    weight ``w`` (all the same shape): one ``_bwd_fused_ptx`` block per 4 elements on GPUs; under EMULATE the
    element-wise FAST_DIV path (MASK_FLAGS masks, comparison clamp, ``_rcp_div_fast``'s stand-in), whose values the
    block reproduces bit for bit."""
    if EMULATE:
        g = (gbits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        if HAS_CLAMP:
            kx = tl.where(xf > c, 0, -1)
            ky = tl.where(tl.abs(yf) > c, 0, -1)
            xf, yf = _swiglu_clamp(xf, yf, c)
        nx = xf * -1.0
        s, q = _rcp_div_fast(nx, 1.0 + exp_f32(nx), HAS_CLAMP)
        act = q * yf
        gws = (g * w) * s
        dxx = (gws * yf) * tl.fma(xf, 1.0 - s, 1.0)
        dxy = gws * xf
        if HAS_CLAMP:
            dxx = (dxx.to(tl.int32, bitcast=True) & kx).to(tl.float32, bitcast=True)
            dxy = (dxy.to(tl.int32, bitcast=True) & ky).to(tl.float32, bitcast=True)
        return act * w, dxx, dxy, g * act
    else:
        cc = tl.full(xf.shape, c, tl.float32)
        # the PTX block for the clamp mode
        MODE: tl.constexpr = (2 if XORSIGN else 1) if HAS_CLAMP else 0
        asm: tl.constexpr = _BWD_ASM[MODE]
        return tl.inline_asm_elementwise(asm, _BWD_CONSTRAINTS, [xf, yf, gbits, w, cc],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                         pack=4)


@triton.jit
def _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c0, row_ok, stride_qm, stride_sfm, stride_sfk, stride_gm,
                     H: tl.constexpr, NPC: tl.constexpr, SF_PACKED: tl.constexpr, CH: tl.constexpr):
    """One chunk's inputs of the rows (masked: 0): the codes of both halves ``[R, CH]``, their scales
    ``[R, CH/NPC]`` and the grad_out bf16 bits ``[R, CH]``."""
    G: tl.constexpr = CH // NPC
    cols = c0 + tl.arange(0, CH)
    gx = c0 // NPC + tl.arange(0, G)
    m = row_ok[:, None] & (cols < H)[None, :]
    gm = row_ok[:, None] & (gx < H // NPC)[None, :]
    qx = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=m, other=0)
    qy = tl.load(q_ptr + rows[:, None] * stride_qm + (cols[None, :] + H), mask=m, other=0)
    sfx = _load_sf(sfx_ptr, rows, gx, stride_sfm, stride_sfk, gm, SF_PACKED)
    sfy = _load_sf(sfx_ptr, rows, gx + H // NPC, stride_sfm, stride_sfk, gm, SF_PACKED)
    gbits = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :], mask=m, other=0)
    return qx, qy, sfx, sfy, gbits


@triton.jit
def _bwd_chunk(q_ptr, sfx_ptr, g_ptr, c0, rows, row_ok, w3, rowsum, pend, clamp_value,
               out_ptr, dq_ptr, dsf_ptr, xg_ptr, stride_qm, stride_sfm, stride_sfk, stride_gm,
               stride_om, stride_dqm, stride_dsm, stride_xgm,
               H: tl.constexpr, NPC: tl.constexpr, SF_PACKED: tl.constexpr, HAS_CLAMP: tl.constexpr,
               ROUND_SF: tl.constexpr,
               BLOCK_R: tl.constexpr, CH: tl.constexpr, FAST_MAX: tl.constexpr, FAST_ENC: tl.constexpr,
               MINMAX_CLAMP: tl.constexpr, MASK_FLAGS: tl.constexpr, FAST_DIV: tl.constexpr,
               ROWSUM_PAIRS: tl.constexpr, FUSED_BWD: tl.constexpr,
               XORSIGN_CLAMP: tl.constexpr, INT_SCALE: tl.constexpr):
    """One chunk (columns ``[c0, c0 + CH)`` of the row block): its loads (``_bwd_chunk_loads``), the element-wise
    backward (FUSED_BWD: 0, or 4 for ``_bwd_fused``), the stores of out, x_grad, dx's codes and scales, and the row
    sum's update.  Returns the loop-carried ``(rowsum, pend)`` (``pend``: ROWSUM_PAIRS' last even chunk sum, passed
    through unchanged where that mode is off)."""
    qx, qy, sfx, sfy, gbits = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c0, row_ok, stride_qm, stride_sfm,
                                               stride_sfk, stride_gm, H, NPC, SF_PACKED, CH)
    G: tl.constexpr = CH // NPC
    HG: tl.constexpr = H // NPC  # k-blocks of one half
    cols = c0 + tl.arange(0, CH)
    gx = c0 // NPC + tl.arange(0, G)
    gy = gx + HG
    m = row_ok[:, None] & (cols < H)[None, :]
    gm = row_ok[:, None] & (gx < HG)[None, :]
    xf = tl.reshape(_e4m3_to_f32(qx), (BLOCK_R, G, NPC)) * sfx[:, :, None]
    yf = tl.reshape(_e4m3_to_f32(qy), (BLOCK_R, G, NPC)) * sfy[:, :, None]
    FUSED: tl.constexpr = FUSED_BWD > 0 and FAST_DIV and FAST_ENC and MASK_FLAGS and (
        MINMAX_CLAMP or not HAS_CLAMP)
    if FUSED:
        aw, dxx, dxy, ga = _bwd_fused(xf, yf, tl.reshape(gbits, (BLOCK_R, G, NPC)),
                                      tl.broadcast_to(w3, (BLOCK_R, G, NPC)), clamp_value, HAS_CLAMP,
                                      XORSIGN_CLAMP)
    else:
        aw, dxx, dxy, ga = _bwd_elements(xf, yf, gbits, w3, clamp_value, HAS_CLAMP, MASK_FLAGS,
                                         MINMAX_CLAMP, FAST_DIV, FAST_ENC, BLOCK_R, G, NPC)
    if ROWSUM_PAIRS:
        # the chunk sums of an even and the following odd chunk added first, then into the row sum:
        # the float32 order of one chunk twice as wide split over two warps (the two warps'
        # partials meet in one commutative add), e.g. CH=512 x 1 warp sums as CH=1024 x 2 warps
        s_c = tl.sum(tl.sum(ga, axis=2), axis=1)
        odd = (c0 // CH) % 2 == 1
        rowsum = tl.where(odd, rowsum + (pend + s_c), rowsum)
        pend = s_c
    else:
        rowsum += tl.sum(tl.sum(ga, axis=2), axis=1)
    out = tl.reshape(f32_to_bf16_bits(aw), (BLOCK_R, CH))
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=m)
    tl.store(xg_ptr + rows[:, None] * stride_xgm + cols[None, :],
             tl.reshape(f32_to_bf16_bits(dxx), (BLOCK_R, CH)), mask=m)
    tl.store(xg_ptr + rows[:, None] * stride_xgm + (cols[None, :] + H),
             tl.reshape(f32_to_bf16_bits(dxy), (BLOCK_R, CH)), mask=m)
    _quant_store(dxx, rows, cols, m, gx, gm, dq_ptr, stride_dqm, dsf_ptr, stride_dsm, ROUND_SF, BLOCK_R, CH,
                 FAST_MAX, FAST_ENC, INT_SCALE)
    _quant_store(dxy, rows, cols + H, m, gy, gm, dq_ptr, stride_dqm, dsf_ptr, stride_dsm, ROUND_SF,
                 BLOCK_R, CH, FAST_MAX, FAST_ENC, INT_SCALE)
    return rowsum, pend
