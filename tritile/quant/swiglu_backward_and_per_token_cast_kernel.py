"""``swiglu_backward_and_per_token_cast``: SwiGLU backward with routing weights, fused with an FP8 cast of dx.

``tile_kernels.quant.swiglu_backward_and_per_token_cast`` (``spec/quant.md`` §3.9).  One pass over the
FP8 input: each program dequantizes ``[BLOCK_R, CH]`` tiles of both halves, recomputes the forward
activation, writes ``out`` (bf16), ``x_grad`` (bf16), the e4m3 codes and scales of the **float32**
dx, and the per-row sum ``sum_j g * act`` (on GPUs a row's chunks go to two programs, each writing its part's
sum: ``SPLIT``, for a shorter launch tail).  A second, tiny launch gathers those row sums into
``weight_grad[t, k]`` through ``token_topk_to_pos`` (0 where it is -1), so every element of
``weight_grad`` is written, whatever the maps hold, and no zero-fill is needed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import config
from ..language import EMULATE, e4m3_bits_to_f32, exp_f32, f32_to_bf16_bits, quant_scale, ue8m0_to_f32
from ..language.cast import _libdevice, f32_to_e4m3_bits_satfinite
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor,
                       custom_op, empty, interpreter_configs, tuned)
from ..utils import ceil_div, next_power_of_two
from .common import SFInfo, alloc_sf, sf_info
from ._swiglu_jit import (_encode_e4m3, _group_amax, _nan_as_inf_abs, _pow2_scale_f32_bits, _swiglu_clamp,
                          _swiglu_clamp_minmax)
from ._swiglu_ptx import ptx_abs_max, ptx_div_fast, ptx_one_plus_exp_neg
from .swiglu_forward_and_per_token_cast_kernel import _check_clamp_value, _check_int, _minmax_clamp_ok
from .types import QuantTensor

__all__ = ["swiglu_backward_and_per_token_cast"]


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
                 FAST_ENC: tl.constexpr, INT_SCALE: tl.constexpr = False, ST_CACHE: tl.constexpr = ""):
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
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=m, cache_modifier=ST_CACHE)
    tl.store(sf_ptr + rows[:, None] * stride_sm + gidx[None, :], sf, mask=gm)


@triton.jit
def _store_bf16_split(ptr, rows, stride, c0, v, row_ok, H: tl.constexpr, BLOCK_R: tl.constexpr, CH: tl.constexpr):
    """``tl.store`` of the bf16 bits ``v [R, CH]`` at columns ``c0 + [0, CH)`` of the rows (mask ``row_ok`` and
    column < H), as ``[CH/16, 2, R, 8]``: element ``(t, h, r, j)`` is column ``16 t + 8 h + j``.  Triton's store
    coalescing (at most 128 bits per thread; lanes along the first dimension after the contiguous one) then lays
    it out as the tile's 16-column layout holds it, so a thread stores its two 16-byte halves from its own registers
    (two 128-bit stores over the warp, each writing every other 16 bytes), where the plain ``[R, CH]`` store moves
    half of each thread's columns to the neighbouring lane first (warp shuffles and selects).  Same bytes written."""
    T: tl.constexpr = CH // 16
    vs = tl.permute(tl.reshape(v, (BLOCK_R, T, 2, 8)), (1, 2, 0, 3))
    cols = (c0 + tl.arange(0, T) * 16)[:, None, None, None] + (tl.arange(0, 2) * 8)[None, :, None, None] \
        + tl.arange(0, 8)[None, None, None, :]
    m = row_ok[None, None, :, None] & (cols < H)
    tl.store(ptr + rows[None, None, :, None] * stride + cols, vs, mask=m)


@triton.jit
def _recip_rn(t):
    """``div_rn(1, t)``: the IEEE reciprocal ``rcp.rn`` on GPUs (correctly rounded, so identical)."""
    if EMULATE:
        return tl.math.div_rn(tl.full(t.shape, 1.0, tl.float32), t)
    else:
        return _libdevice.rcp_rn(t)


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
                  MINMAX_CLAMP: tl.constexpr, FAST_DIV: tl.constexpr, FAST_ENC: tl.constexpr, RCP: tl.constexpr,
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
        if RCP:
            s = _recip_rn(t)
        else:
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
# Instruction-count candidate FUSED_BWD (with XORSIGN_CLAMP): the per-element backward in one PTX block per four
# elements of a thread; same bits as the FAST_DIV path (see _swiglu_backward_and_per_token_cast_kernel)
# ------------------------------------------------------------------------------------------------
def _bwd_fused_ptx(clamp: bool, xorsign: bool, n: int = 4) -> str:
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
        (MINMAX_CLAMP).  x is clamped by ``min.NaN`` (MINMAX_CLAMP; the launcher routes c = -0.0 away).

    ``n`` = 8 or 16 (FUSED_BWD=8 / 16): the same per element for n elements of a thread in one block, with one
    guard (``max |x|`` over the n, as a tree) and one branch: operands numbered as for four (outputs ``$0 ..
    $4n-1`` in the four groups of n, then x, y, n/2 grad_out words, w, c), so the compiler may interleave the
    n elements' expf / reciprocal chains.  The guard's group changes which elements take the slow path, never a
    value: ``rcp.rn`` / ``div.rn`` are exact everywhere and the fast path equals them where |x| <= 41 (2)."""
    one = "0f3F800000"
    b = ""
    for i in range(n):
        x, y, c = f"${4 * n + i}", f"${5 * n + i}", f"${7 * n + n // 2 + i}"
        if clamp:
            b += f"min.NaN.f32 x{i}, {x}, {c}; "
            if xorsign:
                b += f"min.NaN.xorsign.abs.f32 y{i}, {y}, {c}; "
            else:
                b += f"neg.f32 a, {c}; max.NaN.f32 y{i}, {y}, a; min.NaN.f32 y{i}, y{i}, {c}; "
        else:
            b += f"mov.b32 x{i}, {x}; mov.b32 y{i}, {y}; "
        b += ptx_one_plus_exp_neg(f"x{i}", f"t{i}")
    if n == 4:
        guard = ptx_abs_max([f"x{i}" for i in range(n)])
    else:  # a tree: abs into m<i>, then pairwise max
        guard = "".join(f"abs.f32 m{i}, x{i}; " for i in range(n))
        k = n
        while k > 1:
            k //= 2
            guard += "".join(f"max.f32 m{i}, m{i}, m{i + k}; " for i in range(k))
        guard += "mov.b32 m, m0; "
    fast = "".join(ptx_div_fast(f"x{i}", f"t{i}", f"q{i}", "r", f"s{i}", "r") for i in range(n))
    slow = "".join(f"rcp.rn.f32 s{i}, t{i}; div.rn.f32 q{i}, x{i}, t{i}; " for i in range(n))
    tail = ""
    for i in range(n):
        c = f"${7 * n + n // 2 + i}"
        gw = f"${6 * n + i // 2}"
        w = f"${6 * n + n // 2 + i}"
        tail += (f"shl.b32 g, {gw}, 16; " if i % 2 == 0 else f"and.b32 g, {gw}, 0xFFFF0000; ")
        tail += (f"mul.rn.f32 h, g, {w}; mul.rn.f32 h, h, s{i}; "             # gws = (g * w) * s
                 f"mul.rn.f32 a, q{i}, y{i}; mul.rn.f32 ${i}, a, {w}; mul.rn.f32 ${3 * n + i}, g, a; "
                 f"sub.rn.f32 d, {one}, s{i}; fma.rn.f32 d, x{i}, d, {one}; "
                 f"mul.rn.f32 u, h, y{i}; mul.rn.f32 u, u, d; mul.rn.f32 v, h, x{i}; ")
        if clamp:
            # the flags from the unclamped inputs (still live: no mask registers across the branch)
            tail += (f"setp.gt.f32 p, ${4 * n + i}, {c}; selp.b32 ${n + i}, 0, u, p; "
                     f"abs.f32 a, ${5 * n + i}; setp.gt.f32 p, a, {c}; selp.b32 ${2 * n + i}, 0, v, p; ")
        else:
            tail += f"mov.b32 ${n + i}, u; mov.b32 ${2 * n + i}, v; "
    regs = (f".reg .pred p; .reg .b32 x<{n}>, y<{n}>, t<{n}>, s<{n}>, q<{n}>, "
            + ("" if n == 4 else f"m<{n}>, ") + "a, s, j, k, f, e, m, r, z, g, h, d, u, v; ")
    return ("{ " + regs + b + guard + "setp.le.f32 p, m, 0f42240000; @!p bra SLOW; " + fast + "bra.uni DONE; SLOW: "
            + slow + "DONE: " + tail + "}")


def _bwd_constraints(n: int) -> str:
    """The inline-asm constraints of ``_bwd_fused_ptx(..., n)``: 4n float outputs, then x, y, n/2 grad_out words, w, c."""
    return ",".join(["=f"] * (4 * n) + ["f"] * (2 * n) + ["r"] * (n // 2) + ["f"] * (2 * n))


# the fused blocks at 3 * (N // 8) + clamp mode: N = 4, 8, 16; no clamp, clamp, clamp with XORSIGN (_bwd_fused picks
# one at compile time)
_BWD_ASM = tl.constexpr(tuple(_bwd_fused_ptx(c, x, n) for n in (4, 8, 16)
                              for c, x in ((False, False), (True, False), (True, True))))
_BWD_CONSTRAINTS = tl.constexpr(tuple(_bwd_constraints(n) for n in (4, 8, 16)))


@triton.jit
def _bwd_fused(xf, yf, gbits, w, c, HAS_CLAMP: tl.constexpr, XORSIGN: tl.constexpr, N: tl.constexpr = 4):
    """``(act * w, dx_x, dx_y, g * act)`` of the unclamped xf / yf, grad_out bits ``gbits`` (int16) and the routing
    weight ``w`` (all the same shape): one ``_bwd_fused_ptx`` block per N (4, 8 or 16) elements on GPUs; under
    EMULATE the element-wise FAST_DIV path (MASK_FLAGS masks, comparison clamp, ``_rcp_div_fast``'s stand-in), whose
    values the block reproduces bit for bit."""
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
        # the PTX block for N elements (4, 8 or 16) and the clamp mode
        MODE: tl.constexpr = (2 if XORSIGN else 1) if HAS_CLAMP else 0
        asm: tl.constexpr = _BWD_ASM[3 * (N // 8) + MODE]
        cons: tl.constexpr = _BWD_CONSTRAINTS[N // 8]
        return tl.inline_asm_elementwise(asm, cons, [xf, yf, gbits, w, cc],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                         pack=N)


@triton.jit
def _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c0, row_ok, stride_qm, stride_sfm, stride_sfk, stride_gm,
                     H: tl.constexpr, NPC: tl.constexpr, SF_PACKED: tl.constexpr, CH: tl.constexpr,
                     EVICT: tl.constexpr = ""):
    """One chunk's inputs of the rows (masked: 0): the codes of both halves ``[R, CH]``, their scales
    ``[R, CH/NPC]`` and the grad_out bf16 bits ``[R, CH]``; ``EVICT`` the codes' and grad_out's eviction policy
    (read once)."""
    G: tl.constexpr = CH // NPC
    cols = c0 + tl.arange(0, CH)
    gx = c0 // NPC + tl.arange(0, G)
    m = row_ok[:, None] & (cols < H)[None, :]
    gm = row_ok[:, None] & (gx < H // NPC)[None, :]
    qx = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=m, other=0, eviction_policy=EVICT)
    qy = tl.load(q_ptr + rows[:, None] * stride_qm + (cols[None, :] + H), mask=m, other=0, eviction_policy=EVICT)
    sfx = _load_sf(sfx_ptr, rows, gx, stride_sfm, stride_sfk, gm, SF_PACKED)
    sfy = _load_sf(sfx_ptr, rows, gx + H // NPC, stride_sfm, stride_sfk, gm, SF_PACKED)
    gbits = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :], mask=m, other=0, eviction_policy=EVICT)
    return qx, qy, sfx, sfy, gbits


@triton.jit
def _bwd_chunk(qx, qy, sfx, sfy, gbits, c0, rows, row_ok, w3, rowsum, pend, rs, clamp_value,
               out_ptr, dq_ptr, dsf_ptr, xg_ptr, stride_om, stride_dqm, stride_dsm, stride_xgm,
               H: tl.constexpr, NPC: tl.constexpr, HAS_CLAMP: tl.constexpr, ROUND_SF: tl.constexpr,
               BLOCK_R: tl.constexpr, CH: tl.constexpr, FAST_MAX: tl.constexpr, FAST_ENC: tl.constexpr,
               MINMAX_CLAMP: tl.constexpr, MASK_FLAGS: tl.constexpr, RCP: tl.constexpr, TILE_ROWSUM: tl.constexpr,
               FAST_DIV: tl.constexpr, ROWSUM_PAIRS: tl.constexpr, FUSED_BWD: tl.constexpr,
               XORSIGN_CLAMP: tl.constexpr, INT_SCALE: tl.constexpr, SPLIT_STORE: tl.constexpr,
               ST_CACHE: tl.constexpr = ""):
    """One chunk (columns ``[c0, c0 + CH)`` of the row block) from its loaded codes, scales and grad_out bits: the
    element-wise backward, the stores of out, x_grad, dx's codes and scales, and the row sum's update.  Returns the
    loop-carried ``(rowsum, pend, rs)`` (``pend``: ROWSUM_PAIRS' last even chunk sum; ``rs``: TILE_ROWSUM's tile;
    each passed through unchanged where its mode is off).  ``ST_CACHE``: the cache modifier of the plain stores
    (written once)."""
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
                                      XORSIGN_CLAMP, FUSED_BWD)
    else:
        aw, dxx, dxy, ga = _bwd_elements(xf, yf, gbits, w3, clamp_value, HAS_CLAMP, MASK_FLAGS,
                                         MINMAX_CLAMP, FAST_DIV, FAST_ENC, RCP, BLOCK_R, G, NPC)
    if TILE_ROWSUM:
        rs += ga
    elif ROWSUM_PAIRS:
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
    if SPLIT_STORE:
        _store_bf16_split(out_ptr, rows, stride_om, c0, out, row_ok, H, BLOCK_R, CH)
        _store_bf16_split(xg_ptr, rows, stride_xgm, c0, tl.reshape(f32_to_bf16_bits(dxx), (BLOCK_R, CH)),
                          row_ok, H, BLOCK_R, CH)
        _store_bf16_split(xg_ptr + H, rows, stride_xgm, c0,
                          tl.reshape(f32_to_bf16_bits(dxy), (BLOCK_R, CH)), row_ok, H, BLOCK_R, CH)
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=m, cache_modifier=ST_CACHE)
        tl.store(xg_ptr + rows[:, None] * stride_xgm + cols[None, :],
                 tl.reshape(f32_to_bf16_bits(dxx), (BLOCK_R, CH)), mask=m, cache_modifier=ST_CACHE)
        tl.store(xg_ptr + rows[:, None] * stride_xgm + (cols[None, :] + H),
                 tl.reshape(f32_to_bf16_bits(dxy), (BLOCK_R, CH)), mask=m, cache_modifier=ST_CACHE)
    _quant_store(dxx, rows, cols, m, gx, gm, dq_ptr, stride_dqm, dsf_ptr, stride_dsm, ROUND_SF, BLOCK_R, CH,
                 FAST_MAX, FAST_ENC, INT_SCALE, ST_CACHE)
    _quant_store(dxy, rows, cols + H, m, gy, gm, dq_ptr, stride_dqm, dsf_ptr, stride_dsm, ROUND_SF,
                 BLOCK_R, CH, FAST_MAX, FAST_ENC, INT_SCALE, ST_CACHE)
    return rowsum, pend, rs


@triton.jit
def _swiglu_backward_and_per_token_cast_kernel(
        q_ptr, sfx_ptr, g_ptr, ptt_ptr, w_ptr,
        out_ptr, dq_ptr, dsf_ptr, xg_ptr, rowsum_ptr,
        num_rows, num_weights,
        stride_qm, stride_sfm, stride_sfk, stride_gm, stride_om, stride_dqm, stride_dsm, stride_xgm,
        clamp_value,
        H: tl.constexpr, NPC: tl.constexpr, SF_PACKED: tl.constexpr, HAS_CLAMP: tl.constexpr,
        ROUND_SF: tl.constexpr, BLOCK_R: tl.constexpr, CH: tl.constexpr,
        FAST_MAX: tl.constexpr, FAST_ENC: tl.constexpr, MINMAX_CLAMP: tl.constexpr, MASK_FLAGS: tl.constexpr,
        RCP: tl.constexpr, TILE_ROWSUM: tl.constexpr, FAST_DIV: tl.constexpr, PREFETCH: tl.constexpr,
        ROWSUM_PAIRS: tl.constexpr, FUSED_BWD: tl.constexpr = 0, XORSIGN_CLAMP: tl.constexpr = False,
        INT_SCALE: tl.constexpr = False, SPLIT_STORE: tl.constexpr = False, UNROLL: tl.constexpr = 1,
        PERSIST: tl.constexpr = False, PEEL: tl.constexpr = False, LD_EVICT: tl.constexpr = "",
        ST_CACHE: tl.constexpr = "", SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False):
    """MINMAX_CLAMP: the clamp by NaN-propagating min/max (GPU).  MASK_FLAGS: the clamp flags kept as
    int32 masks (``|yf| > c`` in one compare) that clear dx by a bitwise and, instead of predicates
    held across the chunk.  RCP: ``s`` by ``rcp.rn``.  TILE_ROWSUM: ``g * act`` summed per element
    slot over the chunks and reduced once per row block (another float32 summation order).  FAST_DIV
    (with FAST_ENC): ``s`` and ``xf / t`` by ``_rcp_div_fast`` (one shared reciprocal, one range check per
    4 elements).  PREFETCH: a persistent grid whose programs walk row blocks; each chunk's loads (codes,
    scales, grad_out) are issued one chunk ahead, across row blocks (the last chunk of a row block loads
    the first chunk of the program's next one), and the routing weight is gathered a row block ahead
    (its index two ahead), so neither the chunk loads nor the index -> weight round trips are exposed.
    ROWSUM_PAIRS (without TILE_ROWSUM): the row sum adds the sums of chunk pairs (2k, 2k + 1), so CH=512 with
    1 warp gives the default's (CH=1024, 2 warps) weight_grad bits: both reduce each 128-group in the
    layout [1, 1, 16] per thread x [1, 4, 8] lanes, and the 2-warp kernel's two warp partials meet in one
    (commutative) add.

    Same-bits instruction cuts (config keys, off by default; sm_90a counts in _bench_swiglu.py's _BWD_TUNE):
    FUSED_BWD=4 (with FAST_DIV, FAST_ENC, MASK_FLAGS and, with a clamp, MINMAX_CLAMP) the per-element backward in
    one PTX block per four elements (``_bwd_fused_ptx``: expf / division rewrites of the forward's FUSED_SILU,
    flags as ``set`` masks, grad_out widened in the block); XORSIGN_CLAMP (with FUSED_BWD) yf clamped by one
    ``min.NaN.xorsign.abs.f32``; INT_SCALE (ROUND_SF) dx's power-of-two scales from amax's bits.  Under the
    interpreter FUSED_BWD runs its element-wise stand-in.  SPLIT_STORE: the bf16 stores (out, both x_grad halves) as
    ``_store_bf16_split`` (each thread's two 16-byte halves from its own registers; no lane exchange; H200,
    2026-11-30, commit bc6f44a: 899.9 us CUPTI against 884.4 for the default).  Bulk L2 prefetches of the chunks
    ahead (cp.async.bulk.prefetch.L2) were tried at commit bc6f44a and removed: 939-1063 us.

    Loop candidates (config keys, off by default; same bits: every value, weight_grad's summation order included, is
    unchanged; H200, 2026-11-30, commit d53c6fa; sm_90a figures in _bench_swiglu.py's _BWD_TUNE):
    FUSED_BWD=8 / 16: the fused block over 8 / 16 elements of a thread (one guard and one branch per block, so the
    compiler can interleave more expf / reciprocal chains; ``_bwd_fused_ptx``).
    UNROLL=2 (non-PREFETCH, an even chunk count): two chunks a loop step, both chunks' loads issued before the first
    one's arithmetic (one exposed load round trip per two chunks; ~18 more registers, no loop-carried loads).
    PEEL (non-PREFETCH): the first loop step peeled off: its chunk loads go out first, then the index load and the
    weight gather in a run-time branch (which the compiler cannot hoist above the loads).  Without it both dependent
    round trips (index, then weight: the weight sits in a uniform register, which the compiler fills before the
    loop) are waited for before any chunk load of the row block is issued.
    PERSIST (non-PREFETCH): PREFETCH's persistent grid and weight pipeline (index two row blocks ahead, weight one
    ahead) without its chunk prefetch; with PEEL the next weight's gather goes out after the first step's loads.
    LD_EVICT / ST_CACHE: the eviction policy of the code and grad_out loads / the cache modifier of the code and
    bf16 stores (the launcher's STREAM key).

    SPLIT (> 1; one row block a program, no UNROLL; with PEEL the part's first chunk is peeled): each row block's
    chunks over SPLIT programs (program ``pid`` takes part ``pid % SPLIT`` of row block ``pid // SPLIT``,
    ceil(chunks / SPLIT) chunks a part but the last; ROWSUM_PAIRS' pairs are the row's chunk pairs, cut at the parts'
    ends), so the programs are SPLIT times shorter and the launch's tail, which runs at low occupancy, too.  Each part
    writes its own row sums (``rowsum_ptr + part * num_rows``); ``_swiglu_weight_grad_kernel`` adds them in part
    order.  Every output but weight_grad keeps its bits; weight_grad is the same float32 sum in another order."""
    pdl_enter(PDL)
    G: tl.constexpr = CH // NPC
    num_rb = (num_rows + BLOCK_R - 1) // BLOCK_R
    WPIPE: tl.constexpr = PREFETCH or PERSIST  # a persistent grid, the weights gathered a row block ahead
    START: tl.constexpr = CH * UNROLL if PEEL else 0  # the chunk loop's first column
    NCH: tl.constexpr = (H + CH - 1) // CH
    PART: tl.constexpr = ((NCH + SPLIT - 1) // SPLIT) * CH  # SPLIT's columns a part
    part = tl.program_id(0) % SPLIT  # (0 without SPLIT)
    rb = tl.program_id(0) // SPLIT
    p_lo = part * PART  # SPLIT: this part's columns [p_lo, p_hi)
    p_hi = tl.minimum(p_lo + PART, H)
    if WPIPE:
        nprog = tl.num_programs(0)
        step = nprog * BLOCK_R  # rows from one row block of a program to its next
        rows0 = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok0 = rows0 < num_rows
        idx0 = tl.load(ptt_ptr + rows0, mask=ok0, other=-1).to(tl.int64)
        w_ok0 = ok0 & (idx0 >= 0) & (idx0 < num_weights)
        w_c = tl.where(w_ok0, tl.load(w_ptr + idx0, mask=w_ok0, other=0.0), 0.0)
        idx_c1 = tl.load(ptt_ptr + rows0 + step, mask=rows0 + step < num_rows, other=-1)
        if PREFETCH:
            qx_n, qy_n, sfx_n, sfy_n, g_n = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows0, 0, ok0, stride_qm,
                                                             stride_sfm, stride_sfk, stride_gm, H, NPC, SF_PACKED, CH,
                                                             LD_EVICT)
    else:
        nprog = num_rb  # one row block per program
    while rb < num_rb:  # a while loop: range() over program ids breaks the interpreter (numpy 2.4)
        rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        if WPIPE:
            idx = idx_c1.to(tl.int64)  # the next row block's index (loaded a row block ago)
            w = w_c
            # the weight of the next row block (its index arrived a row block ago), the index of the one after
            ok1 = row_ok & (rows + step < num_rows)
            w_ok1 = ok1 & (idx >= 0) & (idx < num_weights)
            if not PEEL:
                w_nx = tl.where(w_ok1, tl.load(w_ptr + idx, mask=w_ok1, other=0.0), 0.0)
            idx_nx2 = tl.load(ptt_ptr + rows + 2 * step, mask=rows + 2 * step < num_rows, other=-1)
        elif not PEEL:
            idx = tl.load(ptt_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
            w_ok = row_ok & (idx >= 0) & (idx < num_weights)
            w = tl.where(w_ok, tl.load(w_ptr + idx, mask=w_ok, other=0.0), 0.0)
        rowsum = tl.zeros([BLOCK_R], tl.float32)
        pend = tl.zeros([BLOCK_R], tl.float32)  # ROWSUM_PAIRS: the last even chunk's sum
        if TILE_ROWSUM:
            rs = tl.zeros([BLOCK_R, G, NPC], tl.float32)
        else:
            rs = rowsum  # unused
        if PEEL:
            # the first loop step before the loop: its chunk loads go out before the weight's index is loaded and
            # the weight gathered (w is kept in a uniform register, waited for before the loop that uses it: here
            # the two dependent round trips overlap the first step's loads); with SPLIT the first chunk of the part
            c_first = p_lo if SPLIT > 1 else 0
            qx, qy, sfx, sfy, gbits = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c_first, row_ok, stride_qm,
                                                       stride_sfm, stride_sfk, stride_gm, H, NPC, SF_PACKED, CH,
                                                       LD_EVICT)
            if UNROLL == 2:
                qx2, qy2, sfx2, sfy2, gbits2 = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, CH, row_ok, stride_qm,
                                                                stride_sfm, stride_sfk, stride_gm, H, NPC, SF_PACKED,
                                                                CH, LD_EVICT)
            if WPIPE:
                w_nx = tl.where(w_ok1, tl.load(w_ptr + idx, mask=w_ok1, other=0.0), 0.0)
            else:
                # a run-time branch (w = 0 without weights, as the gather gives): the compiler cannot hoist the
                # index load above the chunk loads out of it
                w = tl.zeros([BLOCK_R], tl.float32)
                if num_weights > 0:
                    idx = tl.load(ptt_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
                    w_ok = row_ok & (idx >= 0) & (idx < num_weights)
                    w = tl.where(w_ok, tl.load(w_ptr + idx, mask=w_ok, other=0.0), 0.0)
            w3 = w[:, None, None]
            rowsum, pend, rs = _bwd_chunk(
                qx, qy, sfx, sfy, gbits, c_first, rows, row_ok, w3, rowsum, pend, rs, clamp_value, out_ptr, dq_ptr,
                dsf_ptr, xg_ptr, stride_om, stride_dqm, stride_dsm, stride_xgm, H, NPC, HAS_CLAMP, ROUND_SF, BLOCK_R,
                CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP, MASK_FLAGS, RCP, TILE_ROWSUM, FAST_DIV, ROWSUM_PAIRS,
                FUSED_BWD, XORSIGN_CLAMP, INT_SCALE, SPLIT_STORE, ST_CACHE)
            if UNROLL == 2:
                rowsum, pend, rs = _bwd_chunk(
                    qx2, qy2, sfx2, sfy2, gbits2, CH, rows, row_ok, w3, rowsum, pend, rs, clamp_value, out_ptr,
                    dq_ptr, dsf_ptr, xg_ptr, stride_om, stride_dqm, stride_dsm, stride_xgm, H, NPC, HAS_CLAMP,
                    ROUND_SF, BLOCK_R, CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP, MASK_FLAGS, RCP, TILE_ROWSUM, FAST_DIV,
                    ROWSUM_PAIRS, FUSED_BWD, XORSIGN_CLAMP, INT_SCALE, SPLIT_STORE, ST_CACHE)
        w3 = w[:, None, None]
        if SPLIT > 1:  # this part's chunks (a while loop: range() over program ids breaks the interpreter)
            c0 = p_lo + (CH if PEEL else 0)
            while c0 < p_hi:
                qx, qy, sfx, sfy, gbits = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c0, row_ok, stride_qm,
                                                           stride_sfm, stride_sfk, stride_gm, H, NPC, SF_PACKED, CH,
                                                           LD_EVICT)
                rowsum, pend, rs = _bwd_chunk(
                    qx, qy, sfx, sfy, gbits, c0, rows, row_ok, w3, rowsum, pend, rs, clamp_value, out_ptr, dq_ptr,
                    dsf_ptr, xg_ptr, stride_om, stride_dqm, stride_dsm, stride_xgm, H, NPC, HAS_CLAMP, ROUND_SF,
                    BLOCK_R, CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP, MASK_FLAGS, RCP, TILE_ROWSUM, FAST_DIV,
                    ROWSUM_PAIRS, FUSED_BWD, XORSIGN_CLAMP, INT_SCALE, SPLIT_STORE, ST_CACHE)
                c0 += CH
        else:
            for c0 in range(START, H, CH * UNROLL):
                if PREFETCH:
                    qx, qy, sfx, sfy, gbits = qx_n, qy_n, sfx_n, sfy_n, g_n
                    # the next chunk of this row block, or after the last one the next row block's first
                    last = c0 + CH >= H
                    n_rows = rows + tl.where(last, step, 0)
                    qx_n, qy_n, sfx_n, sfy_n, g_n = _bwd_chunk_loads(
                        q_ptr, sfx_ptr, g_ptr, n_rows, tl.where(last, 0, c0 + CH), n_rows < num_rows, stride_qm,
                        stride_sfm, stride_sfk, stride_gm, H, NPC, SF_PACKED, CH, LD_EVICT)
                else:
                    qx, qy, sfx, sfy, gbits = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c0, row_ok, stride_qm,
                                                               stride_sfm, stride_sfk, stride_gm, H, NPC, SF_PACKED, CH,
                                                               LD_EVICT)
                    if UNROLL == 2:  # the second chunk's loads issued before the first chunk's arithmetic
                        qx2, qy2, sfx2, sfy2, gbits2 = _bwd_chunk_loads(q_ptr, sfx_ptr, g_ptr, rows, c0 + CH, row_ok,
                                                                        stride_qm, stride_sfm, stride_sfk, stride_gm, H,
                                                                        NPC, SF_PACKED, CH, LD_EVICT)
                rowsum, pend, rs = _bwd_chunk(
                    qx, qy, sfx, sfy, gbits, c0, rows, row_ok, w3, rowsum, pend, rs, clamp_value, out_ptr, dq_ptr,
                    dsf_ptr, xg_ptr, stride_om, stride_dqm, stride_dsm, stride_xgm, H, NPC, HAS_CLAMP, ROUND_SF,
                    BLOCK_R, CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP, MASK_FLAGS, RCP, TILE_ROWSUM, FAST_DIV,
                    ROWSUM_PAIRS, FUSED_BWD, XORSIGN_CLAMP, INT_SCALE, SPLIT_STORE, ST_CACHE)
                if UNROLL == 2:
                    rowsum, pend, rs = _bwd_chunk(
                        qx2, qy2, sfx2, sfy2, gbits2, c0 + CH, rows, row_ok, w3, rowsum, pend, rs, clamp_value, out_ptr,
                        dq_ptr, dsf_ptr, xg_ptr, stride_om, stride_dqm, stride_dsm, stride_xgm, H, NPC, HAS_CLAMP,
                        ROUND_SF, BLOCK_R, CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP, MASK_FLAGS, RCP, TILE_ROWSUM, FAST_DIV,
                        ROWSUM_PAIRS, FUSED_BWD, XORSIGN_CLAMP, INT_SCALE, SPLIT_STORE, ST_CACHE)
        if TILE_ROWSUM:
            rowsum = tl.sum(tl.sum(rs, axis=2), axis=1)
        elif ROWSUM_PAIRS:
            if SPLIT > 1:  # the part's last chunk has an even index: no partner (a part may start at an odd one)
                rowsum = tl.where(((p_hi - 1) // CH) % 2 == 0, rowsum + pend, rowsum)
            elif ((H + CH - 1) // CH) % 2 == 1:
                rowsum += pend  # an odd chunk count: the last chunk has no partner
        tl.store(rowsum_ptr + part * num_rows + rows, rowsum, mask=row_ok)
        if WPIPE:
            w_c = w_nx
            idx_c1 = idx_nx2
        rb += nprog


@triton.jit
def _swiglu_weight_grad_kernel(ttp_ptr, rowsum_ptr, wg_ptr, n, num_rows, BLOCK: tl.constexpr,
                               SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False):
    """weight_grad[i] = the row sum of row ttp[i] (0 where ttp[i] is -1): the SPLIT parts' sums added in order."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = tl.load(ttp_ptr + offs, mask=ok, other=-1).to(tl.int64)
    hit = ok & (p >= 0) & (p < num_rows)
    v = tl.load(rowsum_ptr + p, mask=hit, other=0.0)
    for part in tl.static_range(1, SPLIT):
        v += tl.load(rowsum_ptr + part * num_rows + p, mask=hit, other=0.0)
    tl.store(wg_ptr + offs, tl.where(hit, v, 0.0), mask=ok)


def _chunk(H: int, npc: int) -> int:
    """Chunk width: on GPUs the largest of 1024..32 dividing H (no masked lanes); under the
    interpreter one masked chunk as wide as the row (up to 1024), so a row block runs few steps."""
    if interpreter_configs():
        return max(npc, min(1024, next_power_of_two(H)))
    for ch in (1024, 512, 256, 128, 64, 32):
        if ch >= npc and H % ch == 0:
            return ch
    return npc


def _config(H: int, npc: int) -> dict:
    """Default launch config (passed through ``tuned("swiglu_backward_and_per_token_cast")``).

    16 columns per thread.  sm_90a SASS at the anchor (H = 7168, npc = 128, clamp, round_sf):
    109.2 executed instructions per column (x and y element) with every flag off, 75.2 with FAST_MAX,
    FAST_ENC, MINMAX_CLAMP, MASK_FLAGS (164 registers), 61.2 adding FAST_DIV (the default since
    2026-11-30; 168 registers, no spills).  CH = 1024 with 4 warps: 68.5 per column, but 96 registers
    and no shared-memory round trips for the bf16 stores (the 2-warp layout holds 16 columns per
    thread, the stores 8).  H200 sweep (2026-11-30, commit 694bd6c, the anchor, CUDA graph): registers capped at
    128 (8 blocks of 2 warps per SM instead of 6) 958.3 us, against 1049.6 us uncapped; the persistent PREFETCH variants
    1047-1548 us."""
    ch = _chunk(H, npc)
    gpu = not interpreter_configs()
    # Sweep of 2026-11-30 (H200, commit 694bd6c; CUPTI, L2 flushed): a 1024-wide chunk as two 512-wide chunks of 1 warp
    # with ROWSUM_PAIRS (the 2-warp layout's weight_grad summation order: same bits; no shared-memory relayout, no
    # barrier) 906.5 us against 950.0 us for [1, 1024] x 2 warps
    pairs = gpu and ch == 1024 and npc <= 512
    # Sweep of 2026-11-30 (H200, commit 65d4724; CUPTI, L2 flushed, the anchor): the same-bits instruction cuts
    # FUSED_BWD=4, XORSIGN_CLAMP and INT_SCALE (64.0 -> 56.1 sm_90a instructions per column, 114 registers, no stack)
    # capped at 112 registers 884.2 us against 907.2 us for the default of commit 694bd6c (FUSED_BWD alone 889.3,
    # uncapped 885.0, cap 104 889.1).  H200, 2026-11-30, commit fd8764c (CUPTI, L2 flushed): SPLIT=2 (a row's 14 chunks
    # over two programs: the launch's tail at half the length) 878.5-878.8 us against 890.9-891.2 in three sweeps (8 + 6
    # chunks); weight_grad sums in another order
    return dict(BLOCK_R=1 if gpu else 64, CH=512 if pairs else ch, num_warps=1 if pairs else max(1, ch // 512),
                FAST_MAX=True, FAST_ENC=True, MINMAX_CLAMP=True, MASK_FLAGS=True, RCP=False, TILE_ROWSUM=False,
                FAST_DIV=True, PREFETCH=False, ROWSUM_PAIRS=pairs, programs_per_sm=4,
                maxnreg=112 if gpu else None, FUSED_BWD=4 if gpu else 0, XORSIGN_CLAMP=gpu, INT_SCALE=gpu,
                SPLIT=2 if gpu else 1)


def _split_parts(num_chunks: int, split: int) -> int:
    """The part count the kernel's SPLIT gets: at most ``split``, ceil(num_chunks / SPLIT) chunks a part (the kernel's
    PART) but the last, no empty part."""
    split = max(1, min(split, num_chunks))
    while split > 1 and (split - 1) * ceil_div(num_chunks, split) >= num_chunks:
        split -= 1
    return split


def _check_config(cfg: dict, npc: int) -> None:
    """Reject a (tuning) config the kernel cannot run, with a ValueError."""
    pow2 = lambda v: isinstance(v, int) and v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg["CH"]) and pow2(cfg["BLOCK_R"]) and pow2(cfg["num_warps"])) or cfg["CH"] < npc:
        raise ValueError(f"CH (>= npc = {npc}), BLOCK_R and num_warps must be powers of two, got {cfg}")
    if cfg["programs_per_sm"] < 1:
        raise ValueError(f"programs_per_sm must be >= 1, got {cfg['programs_per_sm']}")


def _launch(q, sfi, grad_out, weight, ptt, ttp, npc, round_sf, clamp):
    num_rows, two_h = q.shape
    H = two_h // 2
    dev = q.device
    out = empty((num_rows, H), torch.bfloat16, dev)
    dq = empty((num_rows, two_h), torch.float8_e4m3fn, dev)
    dsf = alloc_sf(num_rows, two_h, (1, npc), False, False, dev)
    xg = empty((num_rows, two_h), torch.bfloat16, dev)
    wg = empty(tuple(weight.shape), torch.float32, dev)
    split = 1
    rowsum = empty((1,), torch.float32, dev)  # E = 0: weight_grad reads no row sum
    if num_rows > 0:
        cfg = tuned("swiglu_backward_and_per_token_cast", _config(H, npc))
        _check_config(cfg, npc)
        block_r = cfg["BLOCK_R"]
        extra = {} if cfg.get("maxnreg") is None else dict(maxnreg=cfg["maxnreg"])
        fused = int(cfg.get("FUSED_BWD", 0) or 0)
        num_rb = ceil_div(num_rows, block_r)
        prefetch = bool(cfg["PREFETCH"])
        # PREFETCH / PERSIST: a persistent grid (programs_per_sm per SM), its programs walking row blocks
        persist = prefetch or bool(cfg.get("PERSIST", False))
        grid = (min(num_rb, config.get_num_sms() * cfg["programs_per_sm"]),) if persist else (num_rb,)
        # UNROLL=2 (two chunks a loop step) needs an even chunk count and no PREFETCH
        unroll = 2 if (int(cfg.get("UNROLL", 1) or 1) == 2 and not prefetch and ceil_div(H, cfg["CH"]) % 2 == 0) \
            else 1
        stream = int(cfg.get("STREAM", 0) or 0)
        peel = bool(cfg.get("PEEL", False)) and not prefetch
        if not persist and unroll == 1:
            split = _split_parts(ceil_div(H, cfg["CH"]), int(cfg.get("SPLIT", 1) or 1))
            grid = (num_rb * split,)
        rowsum = empty((max(num_rows, 1) * split,), torch.float32, dev)
        _swiglu_backward_and_per_token_cast_kernel[grid](
            q.view(torch.uint8), sfi.tensor, grad_out.view(torch.int16), ptt, weight,
            out.view(torch.int16), dq.view(torch.uint8), dsf, xg.view(torch.int16), rowsum,
            num_rows, weight.numel(),
            q.stride(0), sfi.stride_m, sfi.stride_k, grad_out.stride(0), out.stride(0), dq.stride(0),
            dsf.stride(0), xg.stride(0),
            clamp if clamp is not None else 0.0,
            H=H, NPC=npc, SF_PACKED=sfi.packed, HAS_CLAMP=clamp is not None, ROUND_SF=round_sf,
            BLOCK_R=block_r, CH=cfg["CH"], FAST_MAX=bool(cfg["FAST_MAX"]), FAST_ENC=bool(cfg["FAST_ENC"]),
            MINMAX_CLAMP=bool(cfg["MINMAX_CLAMP"]) and _minmax_clamp_ok(clamp), MASK_FLAGS=bool(cfg["MASK_FLAGS"]),
            RCP=bool(cfg["RCP"]),
            TILE_ROWSUM=bool(cfg["TILE_ROWSUM"]), FAST_DIV=bool(cfg["FAST_DIV"]), PREFETCH=bool(cfg["PREFETCH"]),
            ROWSUM_PAIRS=bool(cfg["ROWSUM_PAIRS"]),
            # same-bits instruction cuts (config keys, off by default): the fused PTX backward over FUSED_BWD = 4, 8 or
            # 16 elements needs that many per thread in a row (CH / (32 * num_warps) >= FUSED_BWD) and, with a clamp,
            # the min/max clamp (not c = -0.0)
            FUSED_BWD=fused if fused in (4, 8, 16) and cfg["CH"] >= 32 * fused * cfg["num_warps"] else 0,
            XORSIGN_CLAMP=bool(cfg.get("XORSIGN_CLAMP", False)),
            INT_SCALE=bool(cfg.get("INT_SCALE", False)) and round_sf,
            SPLIT_STORE=bool(cfg.get("SPLIT_STORE", False)) and cfg["CH"] >= 16,
            # memory-side candidates (config keys, off by default; same bits): UNROLL, PERSIST, PEEL (see the
            # kernel); STREAM bit 1: evict-first loads of the codes and grad_out, bit 2: streaming (.cs) stores
            UNROLL=unroll, PERSIST=persist and not prefetch, PEEL=peel, SPLIT=split,
            LD_EVICT="evict_first" if stream & 1 else "",
            ST_CACHE=".cs" if stream & 2 else "",
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,  # no FMA contraction of 1 + exp(-x); tl.fma stays fused
            **extra, **pdl_args(out.device))
    n = ttp.numel()
    if n > 0:
        block = 16384 if interpreter_configs() else 1024
        _swiglu_weight_grad_kernel[(ceil_div(n, block),)](ttp, rowsum, wg, n, num_rows, BLOCK=block, SPLIT=split,
                                                          num_warps=4, **pdl_args(wg.device, launch=False))
    return out, (dq, dsf), xg, wg


def _launch_fake(q, sf, grad_out, weight, ptt, ttp, npc, round_sf, clamp):
    num_rows, two_h = q.shape
    return (q.new_empty((num_rows, two_h // 2), dtype=torch.bfloat16),
            q.new_empty((num_rows, two_h), dtype=torch.float8_e4m3fn),
            alloc_sf(num_rows, two_h, (1, npc), False, False, q.device),
            q.new_empty((num_rows, two_h), dtype=torch.bfloat16),
            weight.new_empty(tuple(weight.shape), dtype=torch.float32))


@custom_op("swiglu_backward_and_per_token_cast", fake=_launch_fake)
def _launch_op(q: torch.Tensor, sf: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor, ptt: torch.Tensor,
               ttp: torch.Tensor, npc: int, round_sf: bool, clamp: Optional[float]
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::swiglu_backward_and_per_token_cast`` (validated arguments; flat outputs)."""
    sfi = SFInfo(sf, sf.stride(0), sf.stride(1), sf.dtype == torch.int32)
    out, (dq, dsf), xg, wg = _launch(q, sfi, grad_out, weight, ptt, ttp, npc, round_sf, clamp)
    return out, dq, dsf, xg, wg


def swiglu_backward_and_per_token_cast(
        x: QuantTensor, grad_out: torch.Tensor, weight: torch.Tensor, pos_to_token_topk: torch.Tensor,
        token_topk_to_pos: torch.Tensor, num_per_channels: int, round_sf: bool = False,
        swiglu_clamp_value: Optional[float] = None
) -> Tuple[torch.Tensor, QuantTensor, torch.Tensor, torch.Tensor]:
    """Backward of the routing-weighted SwiGLU over fused MoE rows, with a per-token FP8 cast of dx.

    Per row e: ``w = weight.flat[pos_to_token_topk[e]]``, 0 where the index is negative (or past
    ``weight``).  Per column j < H: ``xf = f32(q[e, j] * sf[e, j/npc])``, ``yf`` likewise at ``j + H``;
    with a clamp c the flags ``cx = xf > c`` and ``cy = |yf| > c`` are taken, then ``xf = min(xf, c)``
    and ``yf`` is clamped to ``[-c, c]``::

        t = 1 + exp(-xf);  s = 1 / t;  g = f32(grad_out)
        act = (xf / t) * yf;            gws = (g * w) * s
        out[e, j]     = bf16(act * w)
        dx[e, j]      = cx ? +0 : (gws * yf) * fma(xf, 1 - s, 1)     (one rounding on GPUs)
        dx[e, j + H]  = cy ? +0 : gws * xf
        weight_grad[t, k] = sum_j g * act of row token_topk_to_pos[t, k]  (0 where that is -1; a float32 sum whose
                            order is the kernel's: compare it with a tolerance, as TileKernels' test does)

    ``dx`` (float32) is quantized per (row, npc columns) as ``spec/quant.md`` §2.2 says (clamp 1e-4).

    Args:
        x: QuantTensor ``(data, sf)``: data float8_e4m3fn ``(E, 2H)`` (leading dims of a 3D tensor are
            flattened), unit column stride; sf ``(E, 2H/npc)`` float32 (any strides) or packed UE8M0 int32
            ``(E, ceil(2H/npc/4))``.
        grad_out: bf16 ``(E, H)`` (leading dims flattened), unit column stride.
        weight: float32 ``(T, K)`` contiguous.
        pos_to_token_topk: int32 ``(E,)`` contiguous, flat index ``t*K + k`` or -1.
        token_topk_to_pos: int32 ``(T, K)`` contiguous, row of slot ``(t, k)`` or -1.
        num_per_channels: npc of both x's sf and dx's sf, 32 or 128; H % npc == 0.
        round_sf: round dx's scales up to powers of two.
        swiglu_clamp_value: optional clamp c >= 0.

    Returns:
        ``(out, (dx_fp8, dx_sf), x_grad, weight_grad)``: out bf16 ``(E, H)``; dx_fp8 float8_e4m3fn
        ``(E, 2H)``; dx_sf float32 ``(E, 2H/npc)`` row-major; x_grad bf16 ``(E, 2H)``; weight_grad float32
        ``(T, K)`` (zeros when E = 0).

    Non-finite dx: a group holding inf or NaN gets sf = +inf and codes ``e4m3(dx * 0)`` (NaN for the
    non-finite elements), so it dequantizes to NaN.
    """
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"x must be a QuantTensor (data, sf), got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0]", data, dtypes=(torch.float8_e4m3fn,), ndim=(2, 3))
    if data.dim() == 3:
        data = data.flatten(0, 1)
    check_inner_contiguous("x[0]", data)
    npc = _check_int("num_per_channels", num_per_channels)
    if npc not in (32, 128):
        raise ValueError(f"num_per_channels must be 32 or 128, got {npc}")
    num_rows, two_h = data.shape
    if two_h % (2 * npc) != 0 or two_h == 0:
        raise ValueError(f"x[0] must have 2*H columns with H a multiple of num_per_channels={npc}, "
                         f"got shape {tuple(data.shape)}")
    H = two_h // 2
    if isinstance(sf, torch.Tensor) and sf.dim() == 3:
        sf = sf.flatten(0, 1)
    sfi = sf_info("x[1]", sf, num_rows, two_h // npc)
    check_tensor("grad_out", grad_out, dtypes=(torch.bfloat16,), ndim=(2, 3))
    if grad_out.dim() == 3:
        grad_out = grad_out.flatten(0, 1)
    check_shape("grad_out", grad_out, (num_rows, H))
    check_inner_contiguous("grad_out", grad_out)
    check_tensor("weight", weight, dtypes=(torch.float32,), ndim=2)
    check_contiguous("weight", weight)
    check_tensor("pos_to_token_topk", pos_to_token_topk, dtypes=(torch.int32,), ndim=1)
    check_shape("pos_to_token_topk", pos_to_token_topk, (num_rows,))
    check_contiguous("pos_to_token_topk", pos_to_token_topk)
    check_tensor("token_topk_to_pos", token_topk_to_pos, dtypes=(torch.int32,), ndim=2)
    check_shape("token_topk_to_pos", token_topk_to_pos, tuple(weight.shape))
    check_contiguous("token_topk_to_pos", token_topk_to_pos)
    if not isinstance(round_sf, bool):
        raise TypeError(f"round_sf must be a bool, got {type(round_sf).__name__}")
    clamp = _check_clamp_value("swiglu_clamp_value", swiglu_clamp_value)
    check_same_device(x=data, x_sf=sfi.tensor, grad_out=grad_out, weight=weight, pos_to_token_topk=pos_to_token_topk,
                      token_topk_to_pos=token_topk_to_pos)
    out, dq, dsf, xg, wg = _launch_op(data, sfi.tensor, grad_out, weight, pos_to_token_topk, token_topk_to_pos, npc,
                                      round_sf, clamp)
    return out, (dq, dsf), xg, wg

