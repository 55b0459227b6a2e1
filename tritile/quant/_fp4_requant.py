"""FP4 -> FP4 per-token requantization by byte permutes (``per_token_cast`` of an e2m1 QuantTensor with UE8M0 block
scales to e2m1 with power-of-two scales).

With power-of-two scales on both sides every value is exact: an input nibble of magnitude code ``m`` in a block of
scale ``2^(e-127)`` dequantizes to ``val(m) * 2^(e-127)`` and requantizes, under the output scale ``2^eo``, to
``RNE_e2m1(val(m) * 2^k)`` with ``k = e - 127 - eo``: a function of ``m`` and the integer ``k`` only.  For each input
block the kernel picks that 8-entry map (one byte per ``m``, for ``k`` in -4..3; all zeros below, where every value
rounds to 0) and applies it to eight nibbles a 32-bit word by two ``prmt`` (one per four nibbles, the magnitudes as
the byte selectors), then repacks the bytes into nibbles (one more ``prmt``) and puts the input's sign bits back:
~2 integer operations an element instead of a float decode, scale, multiply and encode.  The scales (amax per
group, ``quant_scale`` with round_sf) are the general path's, from each block's (or word's) largest magnitude.

Bytes above 252 (scales from ``2^126``, where a block's values can overflow to inf, and 255) take the general path
for their tile (a per-program branch), so the codes and scales are the general kernel's bits for every input
(tests/quant/test_fp4_requant.py compares the two over every code, every scale byte and random tensors).

Where an input block lies in one output group (BLOCKS: x_block_size 32 x 32 -> npc 128) the words are handled as
[blocks, groups, rows, words]: the exponent of a block's largest value from one-hot bytes (``_block_max_exp``), one
scale byte and one map (an 8-byte load from a table) a block, the group max by shuffles within a warp, and the
output scale's exponent in integers.  H200 (2026-11-30, 8001 x 7168, x_block_size (32, 32) -> npc 128, packed
UE8M0, CUPTI): 18.6 us at [16, 512] tiles, 2 warps, 80 registers, the grid's first dimension over the chunks
(session 11; 19.2 us at [8, 512] x 1 warp in row-block order, 37.4 in session 9 with [rows, groups, blocks, words]
words and a SWAR max, 52.3 once a word; the general kernel 123.7, TileKernels 287.8): 74 % of the copy bandwidth for
its 58 MB.  The register cap matters: the general branch in the same kernel would take 255 registers and set the
occupancy.
"""

from __future__ import annotations

from fractions import Fraction

import triton
import triton.language as tl

from ._lossless_ptx import prmt

_E2M1 = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3), Fraction(4), Fraction(6)]


def _rne_e2m1(v: Fraction) -> int:
    """Magnitude code of the e2m1 value nearest to v >= 0 (ties to the even code), saturating at 6."""
    if v >= 6:
        return 7
    return min(range(8), key=lambda c: (abs(_E2M1[c] - v), c & 1))


def _lut_words(k: int):
    """The 8-byte map m -> RNE_e2m1(val(m) * 2^k) as (bytes 0..3, bytes 4..7) int32 words."""
    b = [_rne_e2m1(_E2M1[m] * Fraction(2) ** k) for m in range(8)]
    return (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24), (b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)


K_MIN, K_MAX = -4, 3  # below K_MIN every magnitude rounds to 0; above K_MAX only m = 0 can occur
_LUTS = [_lut_words(k) for k in range(K_MIN, K_MAX + 1)]
_KS = tl.constexpr(tuple(range(K_MIN, K_MAX + 1)))
_LUT_LO = tl.constexpr(tuple(lo for lo, _ in _LUTS))
_LUT_HI = tl.constexpr(tuple(hi for _, hi in _LUTS))
_NLUT = tl.constexpr(len(_LUTS))


@triton.jit
def _lut_select(k):
    """The map's two words for an int32 tensor of k (k < K_MIN: zeros; k > K_MAX: K_MAX's), from the ``_lut_words``
    table (a chain of selects, unrolled at compile time)."""
    lo = tl.zeros_like(k)
    hi = tl.zeros_like(k)
    for i in tl.static_range(_NLUT):
        lo = tl.where(_lut_hit(k, i, _NLUT, _KS[i]), _LUT_LO[i], lo)
    for i in tl.static_range(_NLUT):
        hi = tl.where(_lut_hit(k, i, _NLUT, _KS[i]), _LUT_HI[i], hi)
    return lo, hi


@triton.jit
def _lut_hit(k, i: tl.constexpr, n: tl.constexpr, ki: tl.constexpr):
    """Where the i-th map applies: k == ki, and k >= ki for the last (the K_MAX map)."""
    if i + 1 == n:
        hit = k >= ki
    else:
        hit = k == ki
    return hit


@triton.jit
def _requant_words(w, lo, hi):
    """Eight packed e2m1 nibbles of each word mapped through the magnitude map (lo, hi); signs kept.  The mapped
    bytes (< 8) of nibbles 0..3 and 4..7 are folded pairwise into bytes (``b | b >> 4``: byte 0 = b0 | b1 << 4,
    byte 2 = b2 | b3 << 4) and one ``prmt`` gathers bytes 0 and 2 of both halves."""
    m = w & 0x77777777
    b_lo = prmt(lo, hi, m)
    b_hi = prmt(lo, hi, m >> 16)
    return prmt(b_lo | (b_lo >> 4), b_hi | (b_hi >> 4), 0x6420) | (w & -2004318072)  # 0x88888888


def _map_table_values():
    """The maps as int64 words ``lo | hi << 32`` indexed by ``t = clamp(k - K_MIN + 1, 0, NLUT)``: entry 0 the zero
    map (k < K_MIN), entries 1..NLUT the maps of k = K_MIN..K_MAX (the last also for k > K_MAX); then the one-hot
    bytes ``1 << c`` of :func:`_block_max_exp` (entry NLUT + 1, as a signed int64)."""
    return [0] + [lo | hi << 32 for lo, hi in _LUTS] + [(0x08040201 | 0x80402010 << 32) - 2**64]


@triton.jit
def _map_words(k, lut_ptr, TABLE: tl.constexpr):
    """The map's two words for an int32 tensor of k: one 8-byte load from the table of :func:`_map_table_values`
    at ``lut_ptr`` (TABLE), else :func:`_lut_select`'s chain of selects."""
    if TABLE:
        v = tl.load(lut_ptr + tl.minimum(tl.maximum(k + (1 - _KS[0]), 0), _NLUT))
        return v.to(tl.int32), (v >> 32).to(tl.int32)
    else:
        return _lut_select(k)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _block_max_exp(m, e, axis: tl.constexpr, lut_ptr, TABLE: tl.constexpr):
    """The biased float32 exponent of ``val(c) * 2^(e - 127)`` for the largest e2m1 magnitude code c among all
    nibbles of the magnitude words ``m`` (``w & 0x77777777``) along ``axis``, e the block's UE8M0 scale byte; 0 where
    c = 0.  Each nibble's code as the one-hot byte ``1 << c`` (two ``prmt`` a word), the OR over the words and their
    four bytes, the top bit c through an int -> float32 conversion (biased exponent 127 + c); val(c) = 1.0 or 1.5 x
    2^E with E = (c >> 1) - 1 for c >= 1, so the product's biased exponent is E + e where it is normal (where it is
    not, E + e <= 0: below any clamp).  TABLE: the one-hot bytes loaded from the table at ``lut_ptr`` (values ptxas
    keeps in registers; as constants it re-materialises them before every ``prmt``)."""
    if TABLE:
        v = tl.load(lut_ptr + _NLUT + 1)
        t_lo = v.to(tl.int32)
        t_hi = (v >> 32).to(tl.int32)
    else:
        t_lo = 0x08040201
        t_hi = -2143281136  # 0x80402010
    oh = prmt(t_lo, t_hi, m) | prmt(t_lo, t_hi, m >> 16)  # bytes 1 << c
    x = tl.reduce(oh, axis, _or)
    x = x | (x >> 16)
    x = (x | (x >> 8)) & 0xFF  # 1 <= x < 256: code 0 sets bit 0
    fb = x.to(tl.float32).to(tl.int32, bitcast=True)  # (127 + c) << 23: (fb + 2^23) >> 24 = 64 + (c >> 1)
    return tl.where(x > 1, ((fb + 0x800000) >> 24) - 65 + e, 0)


@triton.jit
def _word_max_code(w):
    """The largest magnitude code (0..7) among a word's eight nibbles."""
    m = w & 0x77777777
    mx = m & 7
    for i in tl.static_range(1, 8):
        mx = tl.maximum(mx, (m >> (4 * i)) & 7)
    return mx
