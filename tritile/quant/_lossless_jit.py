"""``@triton.jit`` helpers of the lossless FP4 -> FP8 re-quantization (``per_block_cast_lossless_kernel``).

Scales: a tile's raw input scales (``_tile_sf_raw``), each input block's multiplier exponent and each output block's
exponent (``_tile_sf_exponents``), the output scales' store (``_store_out_scales``).  Values: the e4m3 output words of
FP4 input words by byte-lane exponent arithmetic (``_words_e4m3_lanes``), by byte permutes (``_words_e4m3_prmt``) or,
for tiles that break the lossless precondition, in float32 (``_words_e4m3_slow``).  Word tiles: their load and store
(``_tile_words``, ``_tile_store``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language import e2m1_code_to_f32, f32_to_e4m3_bits
from ._lossless_ptx import prmt

_SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: bit 7 of each byte


@triton.jit
def _store_out_scales(sf_out_ptr, e_out, pid_m, pid_k, MS_OUT, KS_OUT_PAD, stride_som, stride_sok,
                      NOM: tl.constexpr, NOK: tl.constexpr, OUT_PACKED: tl.constexpr):
    """The ``[NOM, NOK]`` output scale exponents ``e_out`` of a tile: packed UE8M0 bytes (one per block,
    written through a byte view of the int32 words; blocks past Ks up to the word boundary lie outside the
    tensor, so their E is 0: unused bytes are written as zeros) or float32 ``2^(e - 127)``."""
    ob_m = pid_m * NOM + tl.arange(0, NOM).to(tl.int64)
    ob_k = pid_k * NOK + tl.arange(0, NOK).to(tl.int64)
    ob_ok = (ob_m < MS_OUT)[:, None] & (ob_k < KS_OUT_PAD)[None, :]
    if OUT_PACKED:
        bp = sf_out_ptr.to(tl.pointer_type(tl.uint8))
        off = 4 * (ob_m[:, None] * stride_som + (ob_k // 4)[None, :] * stride_sok) + (ob_k % 4)[None, :]
        tl.store(bp + off, e_out.to(tl.uint8), mask=ob_ok)
    else:
        sf = (e_out << 23).to(tl.float32, bitcast=True)
        tl.store(sf_out_ptr + ob_m[:, None] * stride_som + ob_k[None, :] * stride_sok, sf, mask=ob_ok)


@triton.jit
def _block_multiplier_exponents(sf_in_ptr, pid_m, pid_k, MS_IN, KS_IN, stride_sim, stride_sik,
                                IN_PACKED: tl.constexpr, NIM: tl.constexpr, NIK: tl.constexpr,
                                RM: tl.constexpr, RK: tl.constexpr):
    """``(d, e_out)``: biased exponent ``d`` of each input block's multiplier ``2**(e_in - E)`` ([NIM, NIK];
    0 = multiplier 0.0) and the output exponent ``E`` of each output block ([NIM // RM, NIK // RK])."""
    raw = _tile_sf_raw(sf_in_ptr, pid_m, pid_k, MS_IN, KS_IN, stride_sim, stride_sik, IN_PACKED, NIM, NIK)
    return _tile_sf_exponents(raw, pid_k, IN_PACKED, NIM, NIK, RM, RK)


@triton.jit
def _spread_nibbles(v):
    """16-bit value (int32, 4 nibbles) -> nibble j in the low half of byte j."""
    a = (v | (v << 8)) & 0x00FF00FF
    return (a | (a << 4)) & 0x0F0F0F0F


@triton.jit
def _lanes_e4m3(n, m7, b):
    """e4m3 codes of four FP4 codes (one per byte lane of ``n``) scaled by ``2**dd`` with -5 <= dd <= 6:
    exponent arithmetic on the byte lanes (every result is an e4m3 normal or zero, so nothing rounds).

    Per lane, magnitude ``m = n & 7`` (``m7 = 0`` gives a zero multiplier): 0 -> 0; 1 (0.5) -> ``b``; m >= 2
    (value ``2**(e-1) * (1 + f/2)``, ``e = m >> 1``, ``f = m & 1``) -> ``4m + b`` with ``b = 8 * (dd + 6)``;
    the sign (bit 3) moves to bit 7.  No lane carries into the next (4m + b <= 124)."""
    m = n & m7
    h = ((m >> 1) | (m >> 2)) & 0x01010101  # m >= 2
    nz = h | (m & 0x01010101)  # m != 0
    t = m & (h | 0x06060606)  # m, or 0 where m == 1
    return ((t << 2) + nz * b) | ((n << 4) & _SIGN_BITS)


@triton.jit
def _words_e4m3_prmt(w, d):
    """PRMT fast path: the two e4m3 output words (values 0..3, 4..7) of FP4 words ``w`` whose input block has the
    multiplier exponent ``d`` (broadcast; 122 <= d <= 133, or 0 for a zero multiplier), by byte permutes.

    Magnitudes: one table lookup per output word; the 3-bit magnitude ``m`` of each nibble selects byte ``m`` of an
    8-byte table (``_lanes_e4m3``'s map: 0, b, 4m + b for m >= 2, ``b = 8 * (d - 121)``; all zero for d = 0) held
    in two words built per input block, ``lo = 0x0C080000 + b * 0x01010100``, ``hi = 0x1C181410 + b * 0x01010101``
    (no byte carries: at most 28 + 96).  The selector is the word with its sign bits cleared (prmt reads the low 16
    bits: 4 nibbles of 3 bits; bit 3 of a nibble would replicate a sign).  Signs: one sign-replicating permute per
    output word brings the sign bit of each nibble to the top of its byte, from ``w`` (odd values: bit 7 of input
    byte k) and ``w << 4`` (even values: bit 3 of byte k), then ``mag | (s & 0x80808080)``.  Per input word:
    and, shift, 2 prmt (magnitudes), shift, 2 prmt (signs), 2 lop3: ~9 instructions for 8 values."""
    b = (d - 121) * 8
    t_lo = tl.where(d == 0, 0, b * 0x01010100 + 0x0C080000)
    t_hi = tl.where(d == 0, 0, b * 0x01010101 + 0x1C181410)
    s = w & 0x77777777
    w4 = w << 4
    # sign selectors (bit 3 set: replicate): value j from byte j // 2 of w4 (j even, index j // 2) or of w (j odd,
    # index 4 + j // 2): 0xD9C8 for values 0..3 (bytes 0, 1), 0xFBEA for values 4..7 (bytes 2, 3)
    lo = prmt(t_lo, t_hi, s) | (prmt(w4, w, 0xD9C8) & _SIGN_BITS)
    hi = prmt(t_lo, t_hi, s >> 16) | (prmt(w4, w, 0xFBEA) & _SIGN_BITS)
    return lo, hi


@triton.jit
def _words_e4m3_lanes(w, d4):
    """The fast path without PRMT: the two e4m3 output words (values 0..3, 4..7) of FP4 words ``w`` by exponent
    arithmetic on the byte lanes (``_lanes_e4m3``), ``d4`` as in ``_words_e4m3_prmt``."""
    m7 = tl.where(d4 == 0, 0, 0x07070707)
    b = tl.where(d4 == 0, 0, (d4 - 121) * 8)
    return _lanes_e4m3(_spread_nibbles(w & 0xFFFF), m7, b), _lanes_e4m3(_spread_nibbles((w >> 16) & 0xFFFF), m7, b)


@triton.jit
def _words_e4m3_slow(w, d4):
    """The slow path (any multiplier exponent ``d4``): each value scaled in float32 and rounded to e4m3; a rolled loop,
    as the path is rare and must not raise the fast path's register count."""
    mult = (d4 << 23).to(tl.float32, bitcast=True)
    lo = tl.zeros_like(w)
    hi = tl.zeros_like(w)
    for j in tl.range(0, 4, loop_unroll_factor=1):
        lo |= f32_to_e4m3_bits(e2m1_code_to_f32((w >> (4 * j)) & 0xF) * mult).to(tl.int32) << (8 * j)
        hi |= f32_to_e4m3_bits(e2m1_code_to_f32((w >> (4 * j + 16)) & 0xF) * mult).to(tl.int32) << (8 * j)
    return lo, hi


@triton.jit
def _tile_sf_raw(sf_in_ptr, pid_m, pid_k, MS_IN, KS_IN, stride_sim, stride_sik,
                 IN_PACKED: tl.constexpr, NIM: tl.constexpr, NIK: tl.constexpr):
    """The raw input scales of a tile as int32 bits ([NIM, NIK]: float32 bits, or the packed UE8M0 word holding each
    block's byte; 0 outside the tensor): loaded ahead of their use, decoded by ``_tile_sf_exponents``."""
    ib_m = pid_m * NIM + tl.arange(0, NIM).to(tl.int64)
    ib_k = pid_k * NIK + tl.arange(0, NIK).to(tl.int64)
    ib_ok = (ib_m < MS_IN)[:, None] & (ib_k < KS_IN)[None, :]
    if IN_PACKED:
        raw = tl.load(sf_in_ptr + ib_m[:, None] * stride_sim + (ib_k // 4)[None, :] * stride_sik, mask=ib_ok, other=0)
    else:
        raw = tl.load(sf_in_ptr.to(tl.pointer_type(tl.int32)) + ib_m[:, None] * stride_sim + ib_k[None, :] * stride_sik,
                      mask=ib_ok, other=0)
    return raw


@triton.jit
def _tile_sf_exponents(raw, pid_k, IN_PACKED: tl.constexpr, NIM: tl.constexpr, NIK: tl.constexpr,
                       RM: tl.constexpr, RK: tl.constexpr):
    """``(d, e_out)`` (see ``_block_multiplier_exponents``) from the raw scales of ``_tile_sf_raw``."""
    NOM: tl.constexpr = NIM // RM
    NOK: tl.constexpr = NIK // RK
    if IN_PACKED:
        ib_k = pid_k * NIK + tl.arange(0, NIK).to(tl.int64)
        e_in = (raw >> (8 * (ib_k % 4)).to(tl.int32)[None, :]) & 0xFF
    else:
        e_in = (raw >> 23) & 0xFF
    # max over each output block's input blocks, broadcast back without reshaping a broadcast (that gives
    # a layout in which every thread holds the whole tensor)
    e4 = tl.reshape(e_in, (NOM, RM, NOK, RK))
    emax = tl.max(tl.max(e4, axis=3, keep_dims=True), axis=1, keep_dims=True)
    e_out4 = tl.where(emax >= 255, 255, tl.where(emax >= 6, emax - 6, 0))  # [NOM, 1, NOK, 1]
    d4 = tl.where(e_out4 >= 255, 0, tl.minimum(tl.maximum(e4 - e_out4 + 127, 0), 254))
    d = tl.reshape(d4, (NIM, NIK))
    e_out = tl.reshape(e_out4, (NOM, NOK))
    return d, e_out


@triton.jit
def _tile_rows_words(pid_m, pid_k, M, K, TM: tl.constexpr, TW: tl.constexpr, BMI: tl.constexpr,
                     NIM: tl.constexpr, NIK: tl.constexpr, WPB: tl.constexpr):
    """``(rows, wc, wmask)`` of a tile's ``[NIM, BMI, NIK, WPB]`` words: the row (int64), the word column within the
    tile, the bounds mask (``(K // 32) * 4``: uniform over 4 words, so the loads vectorize)."""
    rows = (pid_m * TM + (tl.arange(0, NIM) * BMI).to(tl.int64))[:, None, None, None] + \
        tl.arange(0, BMI)[None, :, None, None]
    wc = (tl.arange(0, NIK) * WPB)[None, None, :, None] + tl.arange(0, WPB)[None, None, None, :]
    wmask = (rows < M) & (pid_k * TW + wc < (K // 32) * 4)
    return rows, wc, wmask


@triton.jit
def _tile_words(x_ptr, pid_m, pid_k, M, K, stride_xm, TM: tl.constexpr, TW: tl.constexpr, BMI: tl.constexpr,
                NIM: tl.constexpr, NIK: tl.constexpr, WPB: tl.constexpr):
    """A tile's FP4 words ``[NIM, BMI, NIK, WPB]`` (0 outside the tensor)."""
    rows, wc, wmask = _tile_rows_words(pid_m, pid_k, M, K, TM, TW, BMI, NIM, NIK, WPB)
    return tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + rows * stride_xm + (pid_k * TW + wc), mask=wmask, other=0)


@triton.jit
def _tile_store(out_ptr, lo, hi, pid_m, pid_k, M, K, stride_om, TM: tl.constexpr, TW: tl.constexpr,
                BMI: tl.constexpr, NIM: tl.constexpr, NIK: tl.constexpr, WPB: tl.constexpr):
    """Store a tile's output words (``lo``: values 0..3, ``hi``: 4..7 of each input word; int32 ``[NIM, BMI, NIK,
    WPB]``), joined and reshaped to ``[NIM, BMI, NIK, 2 * WPB]`` int32 words (as the word kernel does)."""
    rows, wc, wmask = _tile_rows_words(pid_m, pid_k, M, K, TM, TW, BMI, NIM, NIK, WPB)
    oc = (tl.arange(0, NIK) * (2 * WPB))[None, None, :, None] + tl.arange(0, 2 * WPB)[None, None, None, :]
    omask = (rows < M) & (pid_k * (2 * TW) + oc < (K // 32) * 8)
    tl.store(out_ptr + rows * stride_om + (pid_k * (2 * TW) + oc),
             tl.reshape(tl.join(lo, hi), (NIM, BMI, NIK, 2 * WPB)), mask=omask)
