"""Exact float32 -> {bf16, e4m3, e2m1, e5m6, UE8M0} conversions for Triton kernels.

All conversions round to nearest, ties to even (RNE) and match torch bit for bit, on GPUs and
under the CPU interpreter.  Conventions:

* ``f32_to_bf16_bits(x)``  -> int16 bf16 bit patterns (NaN -> 0x7FC0, as torch's CPU cast).
* ``f32_to_bf16(x)``       -> a ``tl.bfloat16`` tensor (hardware cast on GPU).
* ``f32_to_e4m3_bits(x)``  -> uint8 e4m3fn codes, saturating at +-448 (inf -> +-448, NaN -> 0x7F|sign),
  the same as ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``.  Kernels store these bytes
  through a ``uint8`` view of the output.
* ``f32_to_e2m1_code(x)``  -> int32 4-bit FP4 codes (bit 3 = sign), RNE, saturating at +-6;
  ``pack_e2m1`` packs pairs along the last axis (even element in the low nibble).
* ``f32_to_e5m6_code(x)``  -> int32 12-bit E5M6 codes (TileKernels' recipe: fp16 round-toward-zero
  bits, then RNE on the float32 mantissa).
* ``quant_scale(amax, CLAMP, MAX, ROUND_SF)`` -> ``(sf, sf_inv)`` exactly as TileKernels computes them.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["INTERPRET", "EMULATE", "f32_to_bf16_bits_sw", "f32_to_bf16", "f32_to_bf16_bits", "bf16_bits_to_f32",
           "f32_to_e4m3_bits_sw", "f32_to_e4m3_bits_hw", "f32_to_e4m3_bits", "e4m3_bits_to_f32", "f32_to_e2m1_code",
           "pack_e2m1", "e2m1_code_to_f32", "unpack_e2m1", "f32_to_fp16_rtz_bits", "f32_to_e5m6_code",
           "ceil_pow2_exponent", "exp2_int", "sf_to_ue8m0", "ue8m0_to_f32", "quant_scale", "round_scale_bits",
           "exp_f32", "f32_to_e4m3_bits_satfinite", "e4m3_bits_to_f32_hw", "e4m3_bits_to_f32_fast", "abs_max_bits",
           "f32_to_e2m1_code_fast", "f32_to_e2m1_code_finite"]

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"))
# Software (integer) conversions everywhere when asked, e.g. on targets without native OCP fp8
# conversions; always under the interpreter.
EMULATE = tl.constexpr(bool(INTERPRET) or os.environ.get("TRITILE_EMULATE_CASTS", "0") == "1")

if not bool(INTERPRET):
    from triton.language.extra import libdevice as _libdevice
else:  # the interpreter has no libdevice
    _libdevice = None


# ------------------------------------------------------------------------------------------------
# bf16
# ------------------------------------------------------------------------------------------------
@triton.jit
def f32_to_bf16_bits_sw(x):
    """float32 -> bf16 bits (int16), RNE, by integer arithmetic.  NaN -> 0x7FC0."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def f32_to_bf16(x):
    """float32 -> ``tl.bfloat16`` with RNE (hardware cast on GPU, integer RNE in the interpreter)."""
    if EMULATE:
        return f32_to_bf16_bits_sw(x).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> bf16 bit patterns (int16), RNE."""
    if EMULATE:
        return f32_to_bf16_bits_sw(x)
    else:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)


@triton.jit
def bf16_bits_to_f32(bits):
    """bf16 bit patterns (int16/uint16) -> float32, exact for every code (subnormals included)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------------
# FP8 e4m3fn
# ------------------------------------------------------------------------------------------------
@triton.jit
def f32_to_e4m3_bits_sw(x):
    """float32 -> e4m3fn byte (uint8), RNE, saturating at +-448, by integer arithmetic."""
    b = x.to(tl.int32, bitcast=True)
    s = (b >> 24) & 0x80
    ab = b & 0x7FFFFFFF
    # saturate first (448 = 0x43E00000); NaN (> 0x7F800000) is patched below
    abc = tl.minimum(ab, 0x43E00000)
    # normal e4m3 range, |x| >= 2^-6: RNE to 3 mantissa bits on the float32 pattern
    rb = (abc + 0x7FFFF + ((abc >> 20) & 1)) & 0x7FF00000
    normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
    # subnormal range: RNE to a multiple of 2^-9 (code 8 == 2^-6 is also the right encoding)
    a = abc.to(tl.float32, bitcast=True)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(abc >= 0x3C800000, normal, sub)
    code = tl.where(ab > 0x7F800000, 0x7F, code)
    return (s | code).to(tl.uint8)


@triton.jit
def f32_to_e4m3_bits_hw(x):
    """float32 -> e4m3fn byte via the hardware conversion (RNE, satfinite) after a NaN-preserving clamp."""
    xc = tl.where(x > 448.0, 448.0, tl.where(x < -448.0, -448.0, x))
    return xc.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 -> e4m3fn byte (uint8): RNE, saturating at +-448; NaN -> 0x7F | sign."""
    if EMULATE:
        return f32_to_e4m3_bits_sw(x)
    else:
        return f32_to_e4m3_bits_hw(x)


@triton.jit
def e4m3_bits_to_f32(bits):
    """e4m3fn byte (uint8/int8) -> float32, exact (NaN codes 0x7F/0xFF -> NaN)."""
    v = bits.to(tl.int32) & 0xFF
    s = (v & 0x80) << 24
    e = (v >> 3) & 0xF
    m = v & 7
    normal = ((e + 120) << 23) | (m << 20)
    mag = tl.where(e == 0, (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True), normal)
    mag = tl.where((v & 0x7F) == 0x7F, 0x7FC00000, mag)
    return (s | mag).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------------
# FP4 e2m1
# ------------------------------------------------------------------------------------------------
@triton.jit
def f32_to_e2m1_code(x):
    """float32 -> FP4 e2m1 code in the low 4 bits of an int32 (bit 3 = sign); RNE, saturating at 6.

    The sign comes from the float32 sign bit, so -0.0 and small negatives give 0x8.  NaN gives +-0.
    """
    a = tl.abs(x)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    s = (x.to(tl.int32, bitcast=True) >> 28) & 0x8
    return s | code


@triton.jit
def pack_e2m1(codes):
    """Pack FP4 codes ``[R, 2N]`` (int32) into bytes ``[R, N]`` (int8): element 2j -> low nibble."""
    R: tl.constexpr = codes.shape[0]
    N2: tl.constexpr = codes.shape[1]
    lo, hi = tl.split(tl.reshape(codes, (R, N2 // 2, 2)))
    return (lo | (hi << 4)).to(tl.int8)


@triton.jit
def e2m1_code_to_f32(code):
    """4-bit e2m1 code (int32, low nibble) -> float32 (code 8 -> -0.0)."""
    c = code & 0xF
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)))
    sbit = (c & 8) << 28
    return (mag.to(tl.int32, bitcast=True) | sbit).to(tl.float32, bitcast=True)


@triton.jit
def unpack_e2m1(packed):
    """Packed FP4 bytes ``[R, N]`` -> float32 ``[R, 2N]`` (low nibble first)."""
    R: tl.constexpr = packed.shape[0]
    N: tl.constexpr = packed.shape[1]
    p = packed.to(tl.int32)
    lo = e2m1_code_to_f32(p & 0xF)
    hi = e2m1_code_to_f32((p >> 4) & 0xF)
    return tl.reshape(tl.join(lo, hi), (R, 2 * N))


# ------------------------------------------------------------------------------------------------
# E5M6 (top 12 bits of an fp16 pattern)
# ------------------------------------------------------------------------------------------------
@triton.jit
def f32_to_fp16_rtz_bits(x):
    """float32 -> fp16 bit pattern (int32, low 16 bits), rounding toward zero.

    |x| < 2^-24 gives +-0; fp16 subnormals are truncated; |x| >= 65536 gives +-inf; NaN -> 0x7E00.
    """
    b = x.to(tl.int32, bitcast=True)
    s = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    normal = ((e - 112) << 10) | (m >> 13)
    shift = tl.minimum(tl.maximum(126 - e, 0), 31)
    sub = tl.where(e >= 103, (m | 0x800000) >> shift, 0)
    h = tl.where(e >= 113, normal, sub)
    h = tl.where(e >= 143, 0x7C00, h)
    h = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7E00, h)
    return s | h


@triton.jit
def f32_to_e5m6_code(x):
    """float32 -> 12-bit E5M6 code (int32): fp16 RTZ bits >> 4, then RNE on the float32 mantissa."""
    t = f32_to_fp16_rtz_bits(x) >> 4
    r = x.to(tl.int32, bitcast=True) & 0x1FFFF
    t = tl.where((t & 1) + r > 0x10000, t + 1, t)
    return t & 0xFFF


# ------------------------------------------------------------------------------------------------
# Scales: power-of-two rounding and UE8M0
# ------------------------------------------------------------------------------------------------
@triton.jit
def ceil_pow2_exponent(sf):
    """``ceil(log2(sf))`` for a positive normal float32 (an exact power of two keeps its exponent)."""
    return ((sf.to(tl.int32, bitcast=True) - 1) >> 23) + 1 - 127


@triton.jit
def exp2_int(e):
    """``2.0 ** e`` as float32 for an int32 exponent in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def sf_to_ue8m0(sf):
    """Biased exponent byte (int32 0..255) of a float32 scale (its mantissa is dropped)."""
    return (sf.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def ue8m0_to_f32(e):
    """UE8M0 byte (int32 0..255) -> float32 ``2^(e-127)``; e = 0 decodes to 0.0, as TileKernels does."""
    return ((e & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quant_scale(amax, CLAMP: tl.constexpr, MAX: tl.constexpr, ROUND_SF: tl.constexpr):
    """Dequant scale ``sf`` and quant multiplier ``sf_inv`` for a block whose max |x| is ``amax``.

    ``a = max(amax, CLAMP)``; ``sf = div_rn(a, MAX)``; without ROUND_SF ``sf_inv = div_rn(MAX, a)``
    (a second division, not ``1/sf``); with ROUND_SF ``sf = 2^ceil(log2 sf)`` and ``sf_inv = 1/sf``
    (exact).  CLAMP may also be a tensor (a run-time clamp).

    Non-finite amax (a block holding +-inf; map NaN to +inf before the max so both backends agree)
    gives ``sf = +inf`` and ``sf_inv = 0``: the block's codes become encode(x*0) and it dequantizes
    to NaN, loudly.
    """
    a = tl.maximum(amax, CLAMP)
    sf = tl.math.div_rn(a, tl.full(a.shape, MAX, tl.float32))
    if ROUND_SF:
        e = ceil_pow2_exponent(sf)
        sf = exp2_int(e)  # amax = inf gives e = 128 and sf = +inf
        sf_inv = tl.where(e >= 128, 0.0, exp2_int(-e))
    else:
        sf_inv = tl.math.div_rn(tl.full(a.shape, MAX, tl.float32), a)
    return sf, sf_inv


# ------------------------------------------------------------------------------------------------
# Transcendentals matching torch on each backend
# ------------------------------------------------------------------------------------------------
@triton.jit
def round_scale_bits(am, CLAMP: tl.constexpr, MAX: tl.constexpr):
    """:func:`quant_scale` with ROUND_SF from the amax bit pattern ``am`` (int32 of a float >= 0 or +inf; no NaN),
    without the division: ``(sf, sf_inv)`` with the same bits.

    With ``a = max(amax, CLAMP)`` normal and ``sf = 2^k``: ``RN(a / MAX) <= 2^k`` iff ``a <= MAX * 2^k`` (no float
    lies in ``(MAX * 2^k, MAX * 2^k * (1 + 2^-24)]`` as MAX has at most 24 significant bits, and the tie
    ``2^k * (1 + 2^-24)`` rounds to the even ``2^k``), so
    ``k + 127 = (bits(a) - bits(MAX) + 0x7FFFFF + (127 << 23)) >> 23`` (the exponent difference, plus one when a's
    mantissa field exceeds MAX's) and ``sf_inv = 2^-k`` has the bits
    ``(254 - (k + 127)) << 23``.  Needs ``CLAMP / MAX >= 2^-126`` (sf normal) and ``MAX >= 2`` (``k <= 126``, so
    sf_inv is normal); ``amax = +inf`` gives ``sf = +inf``, ``sf_inv = 0``.  Exhaustive check over every amax
    pattern: ``tests/quant/test_per_block_cast.py::test_round_scale_bits`` (sampled) and the script in its docstring."""
    tl.static_assert(MAX >= 2.0)
    tl.static_assert(CLAMP / MAX >= 1.1754943508222875e-38)
    cb = tl.full([], CLAMP, tl.float32).to(tl.int32, bitcast=True)
    mb = tl.full([], MAX, tl.float32).to(tl.int32, bitcast=True)
    a = tl.maximum(am, cb)
    e = ((a + (0x3F800000 + 0x7FFFFF - mb)) >> 23) & 0xFF
    inf = am >= 0x7F800000
    sf = tl.where(inf, 0x7F800000, e << 23).to(tl.float32, bitcast=True)
    sf_inv = tl.where(inf, 0, (254 - e) << 23).to(tl.float32, bitcast=True)
    return sf, sf_inv


@triton.jit
def exp_f32(x):
    """``exp`` that matches torch: libdevice ``expf`` on GPU (torch CUDA's ``exp``), numpy float32
    ``exp`` under the interpreter (``tritile.torch``'s CPU references compute it the same way)."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return _libdevice.exp(x)


# ------------------------------------------------------------------------------------------------
# Fast variants for hot loops (added for the block casts; the helpers above are unchanged)
# ------------------------------------------------------------------------------------------------
@triton.jit
def f32_to_e4m3_bits_satfinite(x):
    """float32 -> e4m3fn byte (uint8) with the same bits as :func:`f32_to_e4m3_bits` for every
    non-NaN ``x`` (RNE, +-inf and |x| > 448 saturate to +-448); a NaN gives a NaN code (0x7F or 0xFF,
    sign unspecified).

    GPU: one ``cvt.rn.satfinite.e4m3x2.f32`` per pair and no clamp (``.satfinite`` already maps
    overflow and infinities to +-MAX_NORM); software path under EMULATE.  Callers that must give NaN
    a definite sign patch it themselves, e.g. ``(byte & 0x7F) | sign``."""
    if EMULATE:
        return f32_to_e4m3_bits_sw(x)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_bits_to_f32_hw(bits):
    """e4m3fn byte (uint8/int8) -> float32 through the hardware conversion (exact: every e4m3 value,
    subnormals included, is a float16 and a float32).  NaN codes give a NaN (payload unspecified)."""
    if bits.dtype.primitive_bitwidth == 8:
        b8 = bits.to(tl.uint8, bitcast=True)
    else:  # wider integer codes (0..255): truncate to the byte (a bitcast needs equal widths)
        b8 = bits.to(tl.uint8)
    return b8.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_bits_to_f32_fast(bits):
    """e4m3fn byte -> float32: the same value as :func:`e4m3_bits_to_f32` for every non-NaN code
    (NaN codes: a NaN of unspecified payload/sign).  Hardware conversion on the GPU, the software
    decode under EMULATE (the interpreter)."""
    if EMULATE:
        return e4m3_bits_to_f32(bits)
    else:
        return e4m3_bits_to_f32_hw(bits)


@triton.jit
def abs_max_bits(x, axis: tl.constexpr, keep_dims: tl.constexpr = False):
    """``max |x|`` of a float32 tensor along ``axis`` as an int32 float32 bit pattern in which NaN
    counts as +inf (result ``<= 0x7F800000``): an integer max over ``bits & 0x7FFFFFFF`` (for
    non-negative floats the bit patterns order like the values; NaN patterns sort above inf).
    ``.to(tl.float32, bitcast=True)`` of the result equals ``max(where(x == x, |x|, inf))``."""
    ab = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    m = tl.max(ab, axis=axis, keep_dims=keep_dims)
    return tl.minimum(m, 0x7F800000)


@triton.jit
def f32_to_e2m1_code_fast(x):
    """Same codes as :func:`f32_to_e2m1_code` for every float32 (NaN -> +-0, +-inf -> +-6), in integer and
    one-FMA arithmetic instead of seven compares.

    ``|x| < 2``: the FP4 grid step is 0.5 (codes 0..4 = 2|x| rounded half to even), so
    ``code = rint(2a)``, exact through ``2a + 1.5*2^23`` (``2a`` is exact, the add rounds once).
    ``2 <= |x| <= 6``: RNE of the float32 pattern to one mantissa bit, ``code = (rounded >> 22) - 0xFC``.
    """
    b = x.to(tl.int32, bitcast=True)
    ab = b & 0x7FFFFFFF
    abc = tl.minimum(ab, 0x40C00000)  # saturate at 6.0 (inf and NaN patterns too; NaN is patched below)
    a = abc.to(tl.float32, bitcast=True)
    sub = (a * 2.0 + 12582912.0).to(tl.int32, bitcast=True) & 7
    nrm = ((abc + 0x1FFFFF + ((abc >> 22) & 1)) >> 22) - 0xFC
    code = tl.where(abc < 0x40000000, sub, nrm)
    code = tl.where(ab > 0x7F800000, 0, code)
    return ((b >> 28) & 0x8) | code


@triton.jit
def f32_to_e2m1_code_finite(x):
    """Same codes as :func:`f32_to_e2m1_code` for every non-NaN float32 (+-inf -> +-6), for callers that know
    x is not NaN: one float clamp, then one magic-number add whose ulp is the FP4 step at ``a = min(|x|, 6)``.

    With ``E = max(exponent(a), 127)`` (127 for a < 2, 128 for [2, 4), 129 for [4, 6]) and ``M = 2^(E - 105)``
    (``2^22``, ``2^23``, ``2^24``: ulp 0.5, 1, 2, the FP4 grid steps there), ``a + M`` rounds a to the grid
    once (RNE; a < 8 << M, so no binade change) and ``bits(a + M) - bits(M)`` counts grid steps:
    ``rint(2a)`` = codes 0..4 below 2, ``rint(a)`` in {2, 3, 4} and ``rint(a / 2)`` in {2, 3} above, which the
    offset ``2 * (E - 127)`` turns into codes 4..7.  Sign: x's sign bit."""
    a = tl.minimum(tl.abs(x), 6.0)  # exact clamp (x is not NaN)
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127)
    mb = (e + 22) << 23
    y = (a + mb.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return ((x.to(tl.int32, bitcast=True) >> 28) & 0x8) | (y - mb + 2 * (e - 127))
