"""The ``@triton.jit`` tile helpers of the generic block cast (``per_token_cast_kernel._block_cast_kernel``),
shared with ``per_block_cast_kernel``, ``cast_back_kernel`` and the FP4 requantization (``_fp4_requant``): loads of
bf16 / fp32 / e4m3 / FP4 tiles with their input scales, block amax, scale stores in the three sf layouts, and the
encodes and stores of e4m3 / e2m1 codes (plain, pairs, words, finite-only)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..language import (
    bf16_bits_to_f32,
    e4m3_bits_to_f32,
    f32_to_e2m1_code,
    f32_to_e4m3_bits,
    pack_e2m1,
    quant_scale,
    sf_to_ue8m0,
    ue8m0_to_f32,
    unpack_e2m1,
)
from ..language.cast import (
    EMULATE,
    e4m3_bits_to_f32_fast,
    f32_to_e2m1_code_fast,
    f32_to_e2m1_code_finite,
    f32_to_e4m3_bits_satfinite,
    round_scale_bits as _round_scale_bits,
)
from ._per_channel_common import _ENC4_BF16
from .common import pack_ue8m0_words


# ------------------------------------------------------------------------------------------------
# Shared @triton.jit building blocks
# ------------------------------------------------------------------------------------------------
@triton.jit
def _load_block_sf(sf_ptr, r, kb, mask, stride_m, stride_k, PACKED: tl.constexpr):
    """float32 scales of blocks ``(r, kb)`` (broadcastable int64 index tensors); masked -> 0."""
    if PACKED:
        w = tl.load(sf_ptr + r * stride_m + (kb // 4) * stride_k, mask=mask, other=0)
        return ue8m0_to_f32(w >> ((kb % 4) * 8).to(tl.int32))
    else:
        return tl.load(sf_ptr + r * stride_m + kb * stride_k, mask=mask, other=0.0)


@triton.jit
def _load_tile(x_ptr, xsf_ptr, rows, row_ok, col0, K, stride_xm, stride_xsf_m, stride_xsf_k, num_xsf_k,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IN_KIND: tl.constexpr, XBM: tl.constexpr,
               XBK: tl.constexpr, XSF_PACKED: tl.constexpr, HW_DECODE: tl.constexpr = False):
    """float32 tile ``[BLOCK_M, BLOCK_K]`` of logical columns ``col0 ..``; 0 outside the tensor.

    IN_KIND 0/1: bf16/fp32 x.  IN_KIND 2/3: e4m3 / packed FP4 data dequantized as ``f32(q * sf)``
    with sf blocks ``(XBM, XBK)`` (float32 or packed UE8M0).  HW_DECODE (speed only): e4m3 through the hardware
    conversion (``e4m3_bits_to_f32_fast``): the same value for every non-NaN code; a NaN code gives a NaN of
    unspecified sign, and the scale multiply that follows returns NVIDIA's canonical NaN for either decode (a tune
    candidate, its bits on the GPU checked by ``test_per_token_cast_fp8_input_tune_candidates``)."""
    if IN_KIND == 3:
        pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
        m = row_ok[:, None] & (pc < K // 2)[None, :]
        b = tl.load(x_ptr + rows[:, None] * stride_xm + pc[None, :], mask=m, other=0)
        q = unpack_e2m1(b)
    else:
        cols = col0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m = row_ok[:, None] & (cols < K)[None, :]
        ptr = x_ptr + rows[:, None] * stride_xm + cols[None, :]
        if IN_KIND == 0:
            q = bf16_bits_to_f32(tl.load(ptr, mask=m, other=0))
        elif IN_KIND == 1:
            q = tl.load(ptr, mask=m, other=0.0)
        elif HW_DECODE:
            q = e4m3_bits_to_f32_fast(tl.load(ptr, mask=m, other=0))
        else:
            q = e4m3_bits_to_f32(tl.load(ptr, mask=m, other=0))
    if IN_KIND >= 2:
        q = _apply_block_sf(q, xsf_ptr, rows, row_ok, col0, col0 + tl.arange(0, BLOCK_K).to(tl.int64), K, num_xsf_k,
                            stride_xsf_m, stride_xsf_k, BLOCK_M, BLOCK_K, XBM, XBK, XSF_PACKED)
    return q


@triton.jit
def _apply_block_sf(q, xsf_ptr, rows, row_ok, col0, cols, K, num_xsf_k, stride_xsf_m, stride_xsf_k,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, XBM: tl.constexpr, XBK: tl.constexpr,
                    XSF_PACKED: tl.constexpr):
    """``f32(q * sf)`` of a decoded ``[BLOCK_M, BLOCK_K]`` tile (columns ``cols``, starting at ``col0``) with sf
    blocks ``(XBM, XBK)`` (float32 or packed UE8M0)."""
    sr = rows // XBM
    if BLOCK_K % XBK == 0:
        # one scale per XBK columns: load [BLOCK_M, BLOCK_K // XBK] and broadcast
        NB: tl.constexpr = BLOCK_K // XBK
        kb = col0 // XBK + tl.arange(0, NB).to(tl.int64)
        sm = row_ok[:, None] & (kb < num_xsf_k)[None, :]
        s = _load_block_sf(xsf_ptr, sr[:, None], kb[None, :], sm, stride_xsf_m, stride_xsf_k, XSF_PACKED)
        return tl.reshape(tl.reshape(q, (BLOCK_M, NB, XBK)) * s[:, :, None], (BLOCK_M, BLOCK_K))
    else:
        sm = row_ok[:, None] & (cols < K)[None, :]
        s = _load_block_sf(xsf_ptr, sr[:, None], (cols // XBK)[None, :], sm, stride_xsf_m, stride_xsf_k, XSF_PACKED)
        return q * s


@triton.jit
def _block_amax(x, MB: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """max |x| per ``(BM, BK)`` block of an ``[MB*BM, G*BK]`` tile -> ``[MB, G]``; NaN counts as +inf.

    Only shapes the GPU compiler handles well: per-token rows (BM == 1) reshaped to ``[MB, G, BK]``, a
    whole-row group (G == 1), or a tile that is exactly one 2D block (MB == G == 1)."""
    return _block_max(tl.where(x == x, tl.abs(x), float("inf")), MB, BM, G, BK)


@triton.jit
def _scale_tile(x, sf_inv, MB: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """``f32(x * sf_inv[block])`` for an ``[MB*BM, G*BK]`` tile and ``[MB, G]`` multipliers."""
    if BM == 1 and G > 1:
        return tl.reshape(tl.reshape(x, (MB, G, BK)) * sf_inv[:, :, None], (MB, G * BK))
    else:
        return x * sf_inv  # [MB, 1] per row, or [1, 1] for the whole tile


@triton.jit
def _store_codes(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 OUT_E2M1: tl.constexpr):
    """Encode ``v = x * sf_inv`` and store: e4m3 bytes, or packed FP4 (even element in the low nibble).

    Where ``v`` is NaN (non-finite x in a block with sf_inv = 0) the code is NaN (e4m3) or 0 (e2m1)
    with x's sign, the same on every backend."""
    xs = x.to(tl.int32, bitcast=True)
    nan = v != v
    if OUT_E2M1:
        code = f32_to_e2m1_code(v)
        code = tl.where(nan, (xs >> 28) & 8, code)
        pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
        m = row_ok[:, None] & (pc < K // 2)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + pc[None, :], pack_e2m1(code), mask=m)
    else:
        byte = f32_to_e4m3_bits(v)
        byte = tl.where(nan, (((xs >> 24) & 0x80) | 0x7F).to(tl.uint8), byte)
        cols = col0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m = row_ok[:, None] & (cols < K)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], byte, mask=m)


@triton.jit
def _load_raw(x_ptr, rows, row_ok, col0, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Raw ``[BLOCK_M, BLOCK_K]`` tile of a plain bf16 (int16 view) / fp32 x; 0 outside the tensor.
    Split from the conversion so a prefetch issues only the load."""
    cols = col0 + tl.arange(0, BLOCK_K).to(tl.int64)
    m = row_ok[:, None] & (cols < K)[None, :]
    return tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0)


@triton.jit
def _raw_to_f32(raw, IN_KIND: tl.constexpr):
    if IN_KIND == 0:
        return bf16_bits_to_f32(raw)
    else:
        return raw


@triton.jit
def _block_max(a, MB: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """max of ``a`` per ``(BM, BK)`` block of an ``[MB*BM, G*BK]`` tile -> ``[MB, G]`` (the shapes of
    :func:`_block_amax`)."""
    if BM == 1:
        if G == 1:
            return tl.max(a, axis=1, keep_dims=True)
        else:
            return tl.max(tl.reshape(a, (MB, G, BK)), axis=2)
    else:
        tl.static_assert(MB == 1 and G == 1, "a 2D-block tile holds exactly one scale block")
        return tl.max(tl.max(a, axis=1, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _block_amax_fast(x, MB: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """Same value as :func:`_block_amax` (NaN counts as +inf), by an integer max over the float32 bit
    patterns ``bits & 0x7FFFFFFF`` (non-negative floats order like their patterns; NaN patterns sort
    above inf and are clamped to it): two integer ops per element instead of compare/select/max."""
    m = _block_max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, MB, BM, G, BK)
    return tl.minimum(m, 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _raw_amax(raw, MB: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, IN_KIND: tl.constexpr):
    """:func:`_block_amax_fast` of ``_raw_to_f32(raw)``, taken on the raw tile: for bf16 an int16 max over
    ``bits & 0x7FFF`` (NaN patterns sort above inf 0x7F80), so the float32 tile need not stay live
    across the reduction."""
    if IN_KIND == 0:
        m = _block_max(raw & 0x7FFF, MB, BM, G, BK)
        return (tl.minimum(m, 0x7F80).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return _block_amax_fast(raw, MB, BM, G, BK)


@triton.jit
def _store_codes_fast(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr, OUT_E2M1: tl.constexpr):
    """:func:`_store_codes` for computed scales (``sf_inv >= 0``; 0 only in non-finite blocks).

    There every non-NaN ``v = x * sf_inv`` has x's sign (a zero factor keeps it too), and ``v`` is NaN
    exactly where x is non-finite in a block with ``sf_inv = 0`` or x is NaN.  So the code is the
    magnitude code with x's sign bit: NaN magnitude 0x7F (e4m3) / 0 (e2m1), the same bits as
    :func:`_store_codes`, without a NaN test per element; e4m3 uses the satfinite conversion (no clamp),
    e2m1 the integer encoder ``f32_to_e2m1_code_fast`` (same codes as ``f32_to_e2m1_code``)."""
    xs = x.to(tl.int32, bitcast=True)
    if OUT_E2M1:
        code = (f32_to_e2m1_code_fast(v) & 7) | ((xs >> 28) & 8)
        pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
        m = row_ok[:, None] & (pc < K // 2)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + pc[None, :], pack_e2m1(code), mask=m)
    else:
        byte = (f32_to_e4m3_bits_satfinite(v) & 0x7F) | ((xs >> 24) & 0x80).to(tl.uint8)
        cols = col0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m = row_ok[:, None] & (cols < K)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], byte, mask=m)


@triton.jit
def _store_sf(sf_ptr, sf, mblk, kb0, num_ms, num_ks, stride_sm, stride_sk, MB: tl.constexpr, G: tl.constexpr,
              PACKED: tl.constexpr):
    """Store ``[MB, G]`` scales of row blocks ``mblk`` and k-blocks ``kb0 ..``: float32, or UE8M0 bytes
    packed four per int32 word (bytes of k-blocks past ``num_ks`` are 0; ``kb0 % 4 == 0``)."""
    kb = kb0 + tl.arange(0, G).to(tl.int64)
    if PACKED:
        e = tl.where((kb < num_ks)[None, :], sf_to_ue8m0(sf), 0)
        if G >= 4:
            words = pack_ue8m0_words(e)
            wi = kb0 // 4 + tl.arange(0, G // 4).to(tl.int64)
        else:  # one group per row (num_ks == 1): the word is the byte
            words = e
            wi = kb0 // 4 + tl.arange(0, G).to(tl.int64)
        m = (mblk < num_ms)[:, None] & (wi < (num_ks + 3) // 4)[None, :]
        tl.store(sf_ptr + mblk[:, None] * stride_sm + wi[None, :] * stride_sk, words, mask=m)
    else:
        m = (mblk < num_ms)[:, None] & (kb < num_ks)[None, :]
        tl.store(sf_ptr + mblk[:, None] * stride_sm + kb[None, :] * stride_sk, sf, mask=m)


@triton.jit
def _amax_of(x, MB: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr):
    if FAST:
        return _block_amax_fast(x, MB, BM, G, BK)
    else:
        return _block_amax(x, MB, BM, G, BK)


@triton.jit
def _encode_store(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  OUT_E2M1: tl.constexpr, FAST: tl.constexpr):
    if FAST:
        _store_codes_fast(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M, BLOCK_K, OUT_E2M1)
    else:
        _store_codes(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M, BLOCK_K, OUT_E2M1)


@triton.jit
def _load_pairs(x_ptr, rows, row_ok, col0, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Raw ``[BLOCK_M, BLOCK_K // 2]`` tile of element pairs (columns ``2j, 2j + 1``) of a plain x viewed as
    words of two elements (fp32 -> int64, bf16 -> int32; ``stride_xm`` in words); 0 outside the tensor."""
    pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
    m = row_ok[:, None] & (pc < K // 2)[None, :]
    return tl.load(x_ptr + rows[:, None] * stride_xm + pc[None, :], mask=m, other=0)


@triton.jit
def _split_pairs(w, IN_KIND: tl.constexpr):
    """float32 bit patterns (int32) of the even and the odd element of each word of :func:`_load_pairs`."""
    if IN_KIND == 1:  # int64 word = two float32, the even element in the low half
        return w.to(tl.int32), (w >> 32).to(tl.int32)
    else:  # int32 word = two bf16, the even element in the low half
        return w << 16, w & -65536


@triton.jit
def _store_pairs_e2m1(out_ptr, lo, hi, vlo, vhi, rows, row_ok, col0, K, stride_om, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """:func:`_store_codes_fast` (e2m1) for pair tiles: ``lo`` / ``hi`` the x bit patterns, ``vlo`` / ``vhi``
    the scaled values; byte ``j`` = code(2j) | code(2j + 1) << 4, in the load's layout (no relayout)."""
    clo = (f32_to_e2m1_code_fast(vlo) & 7) | ((lo >> 28) & 8)
    chi = (f32_to_e2m1_code_fast(vhi) & 7) | ((hi >> 28) & 8)
    pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
    m = row_ok[:, None] & (pc < K // 2)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + pc[None, :], (clo | (chi << 4)).to(tl.int8), mask=m)


@triton.jit
def _store_codes_finite(out_ptr, v, rows, row_ok, col0, K, stride_om, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        OUT_E2M1: tl.constexpr):
    """:func:`_store_codes_fast` for a tile whose blocks all have a finite amax: no x is NaN or inf and every
    ``sf_inv`` is finite and >= 0, so ``v = x * sf_inv`` is never NaN and has x's sign (a zero keeps it); the
    codes come straight from v (satfinite e4m3 / e2m1 with v's sign), without the sign patch."""
    if OUT_E2M1:
        code = f32_to_e2m1_code_finite(v)
        pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
        m = row_ok[:, None] & (pc < K // 2)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + pc[None, :], pack_e2m1(code), mask=m)
    else:
        cols = col0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m = row_ok[:, None] & (cols < K)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], f32_to_e4m3_bits_satfinite(v), mask=m)


@triton.jit
def _store_pairs_e2m1_finite(out_ptr, vlo, vhi, rows, row_ok, col0, K, stride_om, BLOCK_M: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """:func:`_store_pairs_e2m1` where no block of the tile is non-finite (see :func:`_store_codes_finite`)."""
    clo = f32_to_e2m1_code_finite(vlo)
    chi = f32_to_e2m1_code_finite(vhi)
    pc = col0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
    m = row_ok[:, None] & (pc < K // 2)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + pc[None, :], (clo | (chi << 4)).to(tl.int8), mask=m)


@triton.jit
def _store_codes_words(out_ptr, raw, sf_inv, rows, row_ok, col0, K, stride_om, MB: tl.constexpr, BM: tl.constexpr,
                       G: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_store_codes_fast` (e4m3) of a raw bf16 tile (int16 patterns, as loaded: two per 32-bit register) with
    multipliers ``sf_inv`` ``[MB, G]`` (>= 0): the same bits, ``code = (e4m3_satfinite(f32(x * sf_inv)) & 0x7F) |
    sign(x)`` for every x (NaN products included, see ``per_channel_encode_signed``).

    GPU: ``per_channel_encode_bf16``'s assembly per four elements (two loaded words): unpack by shift / mask, two
    IEEE multiplies, two paired ``cvt.rn.satfinite.e4m3x2.f32``, the signs by one ``prmt`` and merged by one
    ``lop3``, so no float32 copy of the tile exists outside it (a plain float32 tile gets hoisted by ptxas above
    the scale computation and held whole).  Software encode under EMULATE (the interpreter)."""
    if EMULATE:
        x = bf16_bits_to_f32(raw)
        _store_codes_fast(out_ptr, x, _scale_tile(x, sf_inv, MB, BM, G, BK), rows, row_ok, col0, K, stride_om,
                          BLOCK_M, BLOCK_K, False)
    else:
        tl.static_assert(MB == 1 and G == 1, "WORDS: one 2D scale block per tile")
        s = tl.broadcast_to(sf_inv, (BLOCK_M, BLOCK_K))
        code = tl.inline_asm_elementwise(_ENC4_BF16, "=r,f,f,f,f,r,r", [s, raw], dtype=tl.uint8, is_pure=True,
                                         pack=4)
        cols = col0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m = row_ok[:, None] & (cols < K)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], code, mask=m)


@triton.jit
def _wide_pairs_cast(x_ptr, out_ptr, sf_ptr, rows, row_ok, mblk, c0, K, num_ms, num_ks, stride_xm, stride_om,
                     stride_sm, stride_sk, IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr,
                     NCH: tl.constexpr, ROUND_SF: tl.constexpr, PACKED: tl.constexpr, CLAMP: tl.constexpr,
                     MAX: tl.constexpr, FIN: tl.constexpr, INT_SF: tl.constexpr, SVEC: tl.constexpr):
    """The PAIRS path (plain x -> FP4, computed sf, one ``(BLOCK_M, BK)`` block per chunk) for ``NCH`` chunks at
    once: one ``[BLOCK_M, NCH * BK // 2]`` pair-tile load (all of the program's bytes in flight together), the
    ``NCH`` block maxima by one reduction (one cross-warp exchange instead of one per chunk), their scales and
    (packed) sf words in one go, then one encode and store; the per-element math is the per-chunk path's."""
    WK: tl.constexpr = NCH * BK
    col0 = c0 * BK
    raw = _load_pairs(x_ptr, rows, row_ok, col0, K, stride_xm, BLOCK_M, WK)
    lo, hi = _split_pairs(raw, IN_KIND)
    m2 = tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF)
    if NCH == 1:
        am = tl.max(tl.max(m2, axis=1, keep_dims=True), axis=0, keep_dims=True)
    else:
        am = tl.max(tl.max(tl.reshape(m2, (BLOCK_M, NCH, BK // 2)), axis=2), axis=0, keep_dims=True)  # [1, NCH]
    am = tl.minimum(am, 0x7F800000)  # NaN patterns count as +inf
    amax = am.to(tl.float32, bitcast=True)
    if INT_SF and ROUND_SF:
        sf, sf_inv = _round_scale_bits(am, CLAMP, MAX)
    else:
        sf, sf_inv = quant_scale(amax, CLAMP, MAX, ROUND_SF)
    _store_sf(sf_ptr, sf, mblk, c0, num_ms, num_ks, stride_sm, stride_sk, 1, NCH, PACKED)
    vlo = _scale_tile(lo.to(tl.float32, bitcast=True), sf_inv, BLOCK_M, 1, NCH, BK // 2)
    vhi = _scale_tile(hi.to(tl.float32, bitcast=True), sf_inv, BLOCK_M, 1, NCH, BK // 2)
    # the byte store's address runs are capped at SVEC bytes: the compiler sizes the per-thread vector of the whole
    # load -> store chain by its widest access, so this keeps each thread's pair loads at SVEC words (lanes of a
    # warp on consecutive 32-byte pieces of a row) rather than 16 words (eight 16-byte loads per thread, each warp
    # load instruction touching 32 different 128-byte lines)
    pc = tl.max_contiguous(col0 // 2 + tl.arange(0, WK // 2).to(tl.int64), SVEC)
    optr = out_ptr + rows[:, None] * stride_om + pc[None, :]
    om = row_ok[:, None] & (pc < K // 2)[None, :]
    if FIN:
        if tl.max(tl.max(amax, 1), 0) < float("inf"):
            clo = f32_to_e2m1_code_finite(vlo)
            chi = f32_to_e2m1_code_finite(vhi)
            tl.store(optr, (clo | (chi << 4)).to(tl.int8), mask=om)
        else:
            _store_pair_codes(optr, om, lo, hi, vlo, vhi)
    else:
        _store_pair_codes(optr, om, lo, hi, vlo, vhi)


@triton.jit
def _store_pair_codes(optr, om, lo, hi, vlo, vhi):
    """The store of :func:`_store_pairs_e2m1` at given byte pointers and mask."""
    clo = (f32_to_e2m1_code_fast(vlo) & 7) | ((lo >> 28) & 8)
    chi = (f32_to_e2m1_code_fast(vhi) & 7) | ((hi >> 28) & 8)
    tl.store(optr, (clo | (chi << 4)).to(tl.int8), mask=om)
