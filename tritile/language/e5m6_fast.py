"""Fast E5M6 pieces for power-of-two scales (``round_sf``) on bf16 input, two values per 32-bit word.

With ``sf_inv = 2^k``, ``k >= 0``, and ``|x * sf_inv| <= 65024`` (a finite row), ``v = x * sf_inv`` is exact and
its float32 pattern has its low 16 bits zero (a bf16 value scaled by a power of two; a bf16 subnormal stays
within its 7 significant bits), so TileKernels' rounding step ``t += (t & 1) + (bits(v) & 0x1FFFF) > 0x10000``
reduces to ``t += t & m0``, ``m0`` the last bf16 mantissa bit of ``x`` (bit 16 of ``bits(v)``; for a bf16
subnormal x, ``|v| < 2^-96`` so ``t`` is the bare sign and ``t & 1 = 0``).  That works on both halves of a word
of bf16 pairs at once, on the pair's two fp16 round-toward-zero patterns.

The GPU paths use inline PTX (``cvt.rz.f16x2.f32``, ``max.u16x2``; plain Triton gives two ``F2F`` and a ``PRMT``
per pair, +1 SASS per two values); the interpreter runs the integer stand-ins.  The PTX was checked on the H200
(tests/quant/test_per_token_cast_to_e5m6.py on the GPU, 2026-11-30).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cast import EMULATE, f32_to_fp16_rtz_bits

__all__ = ["fp16x2_rtz_bits", "max_u16x2", "e5m6_pair_codes", "pack3_pairs"]


@triton.jit
def fp16x2_rtz_bits(hi, lo):
    """Two float32 tensors (``|v| < 65536``) -> uint32 words holding their fp16 round-toward-zero patterns,
    ``hi`` in the upper half (one ``F2FP.F16.F32.PACK_AB.RZ`` per word on the GPU)."""
    if EMULATE:
        h = f32_to_fp16_rtz_bits(hi).to(tl.uint32, bitcast=True)
        lw = f32_to_fp16_rtz_bits(lo).to(tl.uint32, bitcast=True)
        return (h << 16) | (lw & 0xFFFF)
    else:
        return tl.inline_asm_elementwise("cvt.rz.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.uint32,
                                         is_pure=True, pack=1)


@triton.jit
def max_u16x2(a, b):
    """Per 16-bit half of int32 words: the unsigned max (one ``VIMNMX.U16x2`` on the GPU)."""
    if EMULATE:
        lo = tl.maximum(a & 0xFFFF, b & 0xFFFF)
        hi = tl.maximum((a >> 16) & 0xFFFF, (b >> 16) & 0xFFFF)
        return (hi << 16) | lo
    else:
        return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def e5m6_pair_codes(a, sf_inv):
    """The two E5M6 codes of ``x * sf_inv`` for the bf16 pair of int32 words ``a`` (low half = even column):
    uint32 words with the even column's code in bits 0..11, the odd one's in bits 16..27, bits 28..31 zero and
    bits 12..15 garbage (the odd value's low fp16 nibble).  Needs ``sf_inv = 2^k``, ``k >= 0``, and a finite row
    (``|x * sf_inv| <= 65024``): see the module docstring.  The odd value is multiplied with the even one's bits
    still below it: they only reach float32 mantissa bits 0..15, which round toward zero to fp16 drops (and a
    +-0 with them stays a +-0 after the exact scaling)."""
    v_lo = (a << 16).to(tl.float32, bitcast=True) * sf_inv
    v_hi = a.to(tl.float32, bitcast=True) * sf_inv
    t = fp16x2_rtz_bits(v_hi, v_lo) >> 4
    return t + (t & a.to(tl.uint32, bitcast=True) & 0x00010001)


@triton.jit
def pack3_pairs(q0, q1, q2, q3):
    """Four :func:`e5m6_pair_codes` words (codes c0..c7, even columns in the low halves) -> the group's three
    words (int32) ``w0 = c0<<20 | c1<<8 | c2>>4``, ``w1 = (c2&0xF)<<28 | c3<<16 | c4<<4 | c5>>8``,
    ``w2 = (c5&0xFF)<<24 | c6<<12 | c7``; the garbage nibbles (bits 12..15) are masked off."""
    w0 = (q0 << 20) | ((q0 >> 8) & 0xFFF00) | ((q1 >> 4) & 0xFF)
    w1 = (q1 << 28) | (q1 & 0x0FFF0000) | ((q2 << 4) & 0xFFF0) | (q2 >> 24)
    w2 = ((q2 << 8) & 0xFF000000) | ((q3 << 12) & 0x00FFF000) | (q3 >> 16)
    return w0.to(tl.int32, bitcast=True), w1.to(tl.int32, bitcast=True), w2.to(tl.int32, bitcast=True)
