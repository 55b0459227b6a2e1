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
(commit fd8764c; 19.2 us at [8, 512] x 1 warp in row-block order, 37.4 at commit 31c87fe with [rows, groups, blocks,
words] words and a SWAR max, 52.3 once a word; the general kernel 123.7, TileKernels 287.8): 74 % of the copy
bandwidth for its 58 MB.  The register cap matters: the general branch in the same kernel would take 255 registers and set the
occupancy.
"""

from __future__ import annotations

import struct
from fractions import Fraction
from typing import Optional

import torch
import triton
import triton.language as tl

from ..language import e2m1_code_to_f32, quant_scale, sf_to_ue8m0, ue8m0_to_f32
from ..language.grid import tile_grid, tile_ids
from ..language.pdl import pdl_args, pdl_enter
from ..utils import ceil_div
from ..runtime import constant
from ._block_cast_tiles import _amax_of, _encode_store, _load_tile, _scale_tile, _store_sf
from ._lossless_ptx import prmt
from .common import FMT_CLAMP, FMT_MAX

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


@triton.jit
def _fp4_words_and_scales(xw_ptr, xsf_ptr, rows, col0, M, KW, num_xsf_k, stride_xw, stride_xsf_m, stride_xsf_k,
                          XBM: tl.constexpr, XBK: tl.constexpr, G: tl.constexpr, WPG: tl.constexpr):
    """A chunk's words ``[BLOCK_M, G, WPG]`` (groups of WPG words: the group max and its broadcast back stay in the
    layout), their offsets and mask, and each word's input scale byte (a word lies in one input block)."""
    wj = (col0 // 8 + tl.arange(0, G).to(tl.int64)[:, None] * WPG + tl.arange(0, WPG).to(tl.int64)[None, :])[None, :, :]
    r3 = rows[:, None, None]
    wmask = (r3 < M) & (wj < KW)
    w = tl.load(xw_ptr + r3 * stride_xw + wj, mask=wmask, other=0)
    kb = (wj * 8) // XBK
    sw = tl.load(xsf_ptr + (r3 // XBM) * stride_xsf_m + (kb // 4) * stride_xsf_k, mask=wmask & (kb < num_xsf_k),
                 other=0)
    return w, wj, wmask, (sw >> ((kb % 4) * 8).to(tl.int32)) & 0xFF


@triton.jit
def _fp4_chunk_fast(w, wj, wmask, e_in, rows, kb0, outw_ptr, sf_ptr, M, num_ks, stride_ow, stride_sm, stride_sk,
                    BLOCK_M: tl.constexpr, G: tl.constexpr, PACKED: tl.constexpr, CLAMP: tl.constexpr,
                    MAX: tl.constexpr):
    """The byte-permute requantization of one chunk (every scale byte <= 252): amax per group from each word's largest
    magnitude, the scales as the general path computes them, the codes through the map of k = e_in - e_out."""
    amax = tl.max(e2m1_code_to_f32(_word_max_code(w)) * ue8m0_to_f32(e_in), axis=2)
    sf, sf_inv = quant_scale(amax, CLAMP, MAX, True)
    _store_sf(sf_ptr, sf, rows, kb0, M, num_ks, stride_sm, stride_sk, BLOCK_M, G, PACKED)
    k = tl.where(e_in == 0, -128, e_in - sf_to_ue8m0(sf)[:, :, None])  # a zero byte (scale 0.0) zeroes the block
    lo, hi = _lut_select(k)
    tl.store(outw_ptr + rows[:, None, None] * stride_ow + wj, _requant_words(w, lo, hi), mask=wmask)


@triton.jit
def _fp4_blocks_and_scales(xw_ptr, xsf_ptr, rows, pk, M, KW, num_xsf_k, stride_xw, stride_xsf_m, stride_xsf_k,
                           XBM: tl.constexpr, XBK: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
                           BPG: tl.constexpr, WPB: tl.constexpr):
    """The words of chunk ``pk`` as ``[BPG, G, BLOCK_M, WPB]`` (input block b of group g of a row: the blocks of a
    group in neighbouring lanes, then the groups, then the rows, so a warp's load covers whole rows' runs and the group
    max is a shuffle within the warp), their offsets and mask, and each block's input scale byte ``[BPG, G,
    BLOCK_M]``."""
    blk = tl.arange(0, G)[None, :, None] * BPG + tl.arange(0, BPG)[:, None, None]  # [BPG, G, 1]: block in the chunk
    wj = (pk * (BLOCK_K // 8) + blk * WPB)[:, :, :, None] + tl.arange(0, WPB)[None, None, None, :]
    r4 = rows[None, None, :, None]
    wmask = (r4 < M) & (wj < KW)
    w = tl.load(xw_ptr + r4 * stride_xw + wj, mask=wmask, other=0)
    r3 = rows[None, None, :]
    kb = pk * (BLOCK_K // XBK) + blk
    sw = tl.load(xsf_ptr + (r3 // XBM) * stride_xsf_m + (kb // 4) * stride_xsf_k, mask=(r3 < M) & (kb < num_xsf_k),
                 other=0)
    return w, wj, wmask, (sw >> ((kb % 4) * 8).to(tl.int32)) & 0xFF


@triton.jit
def _fp4_chunk_fast_blocks(w, wj, wmask, e_in, rows, pk, lut_ptr, outw_ptr, sf_ptr, M, num_ks, stride_ow, stride_sm,
                           stride_sk, BLOCK_M: tl.constexpr, G: tl.constexpr, PACKED: tl.constexpr,
                           CLAMP_BITS: tl.constexpr, TABLE: tl.constexpr):
    """:func:`_fp4_chunk_fast` once a block on the ``[BPG, G, BLOCK_M, WPB]`` words of
    :func:`_fp4_blocks_and_scales`, the output scale from amax's exponent alone: ``a = max(amax, CLAMP)`` is 1.0 or
    1.5 x 2^E and normal (e2m1 values times powers of two, CLAMP = 1.5 x 2^-124), so ``2^ceil(log2(a / 6))``, the
    general path's ``quant_scale`` with round_sf, is 2^(E - 2), and E is the largest of the blocks' product exponents
    (:func:`_block_max_exp`) and CLAMP's; the maps from the table at ``lut_ptr`` (TABLE) or by selects."""
    amax_exp = tl.max(_block_max_exp(w & 0x77777777, e_in, 3, lut_ptr, TABLE), axis=0)  # [G, BLOCK_M]: its exponent
    e_out = tl.maximum(amax_exp, CLAMP_BITS >> 23) - 2  # the biased exponent of sf
    kb0 = pk * G
    kg = kb0 + tl.arange(0, G)[:, None].to(tl.int64)
    row_ok = (rows < M)[None, :]
    if PACKED:
        sh = 8 * (tl.arange(0, G)[:, None] % 4)
        word = tl.sum(tl.reshape(tl.where(kg < num_ks, e_out, 0) << sh, (G // 4, 4, BLOCK_M)), axis=1)
        wi = kb0 // 4 + tl.arange(0, G // 4)[:, None].to(tl.int64)
        tl.store(sf_ptr + rows[None, :] * stride_sm + wi * stride_sk, word, mask=row_ok & (wi < (num_ks + 3) // 4))
    else:
        tl.store(sf_ptr + rows[None, :] * stride_sm + kg * stride_sk, (e_out << 23).to(tl.float32, bitcast=True),
                 mask=row_ok & (kg < num_ks))
    k = tl.where(e_in == 0, -128, e_in - e_out[None, :, :])  # a zero byte (scale 0.0) zeroes the block
    lo, hi = _map_words(k, lut_ptr, TABLE)
    tl.store(outw_ptr + rows[None, None, :, None] * stride_ow + wj,
             _requant_words(w, lo[:, :, :, None], hi[:, :, :, None]), mask=wmask)


@triton.jit
def _fp4_chunk_general(xb_ptr, xsf_ptr, outb_ptr, sf_ptr, rows, col0, kb0, M, K, num_xsf_k, num_ks, stride_xb,
                       stride_xsf_m, stride_xsf_k, stride_ob, stride_sm, stride_sk, XBM: tl.constexpr,
                       XBK: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       G: tl.constexpr, PACKED: tl.constexpr, CLAMP: tl.constexpr, MAX: tl.constexpr):
    """One chunk by the general kernel's code (float decode, scale, amax, encode): the same bits for any scale byte."""
    row_ok = rows < M
    x = _load_tile(xb_ptr, xsf_ptr, rows, row_ok, col0, K, stride_xb, stride_xsf_m, stride_xsf_k, num_xsf_k,
                   BLOCK_M, BLOCK_K, 3, XBM, XBK, True)
    amax = _amax_of(x, BLOCK_M, 1, G, BK, True)
    sf, sf_inv = quant_scale(amax, CLAMP, MAX, True)
    _store_sf(sf_ptr, sf, rows, kb0, M, num_ks, stride_sm, stride_sk, BLOCK_M, G, PACKED)
    _encode_store(outb_ptr, x, _scale_tile(x, sf_inv, BLOCK_M, 1, G, BK), rows, row_ok, col0, K, stride_ob,
                  BLOCK_M, BLOCK_K, True, True)


@triton.jit
def _fp4_requant_kernel(
    xw_ptr, xb_ptr, xsf_ptr, outw_ptr, outb_ptr, sf_ptr, lut_ptr,
    M, K, KW, num_xsf_k, num_ks,
    stride_xw, stride_xb, stride_xsf_m, stride_xsf_k, stride_ow, stride_ob, stride_sm, stride_sk,
    XBM: tl.constexpr, XBK: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr, CLAMP: tl.constexpr, MAX: tl.constexpr, FAST_LIMIT: tl.constexpr = 252,
    BLOCKS: tl.constexpr = False, TABLE: tl.constexpr = False, CLAMP_BITS: tl.constexpr = 0,
    KFAST: tl.constexpr = False, PDL: tl.constexpr = False
):
    """Per-token FP4 -> FP4 requantization of a [BLOCK_M, BLOCK_K] tile (``tritile/quant/_fp4_requant.py``): x as
    int32 words of eight nibbles (``xw_ptr``, ``stride_xw`` in words) and as bytes (``xb_ptr``) for the general code,
    which a tile holding an input scale byte above FAST_LIMIT = 252 takes (FAST_LIMIT = -1: always, for the tests);
    the same for the output.  Power-of-two output scales (round_sf), UE8M0 input scales (packed), groups of BK
    columns, XBK and BK multiples of 8.  BLOCKS (an input block lies in one group): the words as ``[BPG, G, BLOCK_M,
    WPB]``, one scale byte, one max and one map a block instead of a word (``_fp4_chunk_fast_blocks``: one-hot block
    maxima, the scale exponent in integers, the maps from the table at ``lut_ptr`` with TABLE).  KFAST: the grid's
    first dimension runs over the chunks (consecutive programs read consecutive chunks of the same rows)."""
    pdl_enter(PDL)
    G: tl.constexpr = BLOCK_K // BK
    pm, pk = tile_ids(KFAST)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    col0 = pk * BLOCK_K
    if BLOCKS:
        w, wj, wmask, e_in = _fp4_blocks_and_scales(xw_ptr, xsf_ptr, rows, pk, M, KW, num_xsf_k, stride_xw,
                                                    stride_xsf_m, stride_xsf_k, XBM, XBK, BLOCK_K, G, BK // XBK,
                                                    XBK // 8)
    else:
        w, wj, wmask, e_in = _fp4_words_and_scales(xw_ptr, xsf_ptr, rows, col0, M, KW, num_xsf_k, stride_xw,
                                                   stride_xsf_m, stride_xsf_k, XBM, XBK, G, BK // 8)
    if tl.max(tl.max(tl.max(e_in, 2), 1), 0) <= FAST_LIMIT:
        if BLOCKS:
            _fp4_chunk_fast_blocks(w, wj, wmask, e_in, rows, pk, lut_ptr, outw_ptr, sf_ptr, M, num_ks, stride_ow,
                                   stride_sm, stride_sk, BLOCK_M, G, PACKED, CLAMP_BITS, TABLE)
        else:
            _fp4_chunk_fast(w, wj, wmask, e_in, rows, pk * G, outw_ptr, sf_ptr, M, num_ks, stride_ow, stride_sm,
                            stride_sk, BLOCK_M, G, PACKED, CLAMP, MAX)
    else:
        _fp4_chunk_general(xb_ptr, xsf_ptr, outb_ptr, sf_ptr, rows, col0, pk * G, M, K, num_xsf_k, num_ks, stride_xb,
                           stride_xsf_m, stride_xsf_k, stride_ob, stride_sm, stride_sk, XBM, XBK, BK, BLOCK_M, BLOCK_K,
                           G, PACKED, CLAMP, MAX)


def _fp4_requant_launch(data, x_sf, out, sf, m: int, k: int, xbm: int, xbk: int, bk: int, packed: bool,
                        cfg: dict) -> bool:
    """Launch ``_fp4_requant_kernel`` (x and the output as words of eight nibbles); False when x's rows cannot be
    viewed as int32 words (an odd start or row stride), for the general kernel to take over."""
    try:
        xw, ow = data.view(torch.int32), out.view(torch.int32)
    except RuntimeError:
        return False
    block_k, block_m = int(cfg.get("BLOCK_K", 512)), int(cfg["BLOCK_M"])
    if block_k < 4 * bk or block_k % bk or block_k & (block_k - 1):
        raise ValueError(f"BLOCK_K={block_k} must be a power of two holding at least 4 groups of {bk}")
    grid, kfast = tile_grid(ceil_div(m, block_m), ceil_div(k, block_k), cfg.get("KFAST", False))
    extra = {} if cfg.get("maxnreg") is None else dict(maxnreg=int(cfg["maxnreg"]))
    blocks = bool(cfg.get("BLOCKS", True)) and bk % xbk == 0 and (xbk // 8) & (xbk // 8 - 1) == 0
    lut = _map_table(data.device) if blocks and cfg.get("TABLE", True) else None
    _fp4_requant_kernel[grid](
        xw, data, x_sf, ow, out, sf, lut if lut is not None else xw, m, k, k // 8, ceil_div(k, xbk), ceil_div(k, bk),
        xw.stride(0), data.stride(0), x_sf.stride(0), x_sf.stride(1), ow.stride(0), out.stride(0), sf.stride(0),
        sf.stride(1), XBM=xbm, XBK=xbk, BK=bk, BLOCK_M=block_m, BLOCK_K=block_k, PACKED=bool(packed),
        CLAMP=FMT_CLAMP["e2m1"], MAX=FMT_MAX["e2m1"], FAST_LIMIT=int(cfg["FAST_LIMIT"]),
        BLOCKS=blocks, TABLE=lut is not None, CLAMP_BITS=_E2M1_CLAMP_BITS, KFAST=kfast,
        num_warps=int(cfg["num_warps"]), **extra, **pdl_args(data.device))
    return True


_MAP_TABLES: dict = {}
_E2M1_CLAMP_BITS = struct.unpack("<I", struct.pack("<f", FMT_CLAMP["e2m1"]))[0]  # float32 bits of the e2m1 clamp


def _map_table(device: torch.device) -> Optional[torch.Tensor]:
    """The FP4 requantization maps as an int64 tensor on ``device`` (``_fp4_requant._map_table_values``), made once
    per device; None while a CUDA graph is being captured and it is not made yet (the kernel then selects the maps
    by compares, same bits), since a tensor allocated during a capture belongs to the graph's memory pool."""
    key = str(device)
    t = _MAP_TABLES.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _MAP_TABLES[key] = constant(torch.tensor(_map_table_values(), dtype=torch.int64, device=device))
    return t
