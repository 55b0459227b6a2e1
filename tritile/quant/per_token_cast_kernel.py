"""Per-token (1 x npc) casts to FP8 e4m3 / FP4 e2m1 (``tile_kernels.quant.per_token_cast_kernel``).

This file also holds the generic block-cast machinery that ``per_block_cast_kernel`` and
``cast_back_kernel`` reuse: one ``@triton.jit`` body that loads an ``[BLOCK_M, BLOCK_K]`` tile (bf16,
fp32, or a dequantized e4m3 / FP4 QuantTensor with scales in any layout), reduces amax per
``(BM, BK)`` scale block, computes the scales (``tritile.language.quant_scale``), stores them in one of
the three sf layouts, and encodes the tile.

Scale math (``spec/quant.md`` §2.2): per block ``a = max(amax, CLAMP)``, ``sf = a / MAX``,
``sf_inv = MAX / a`` (two IEEE divisions), or with ``round_sf`` ``sf = 2^ceil(log2(a / MAX))`` and
``sf_inv = 1 / sf``; ``q = encode(f32(x * sf_inv))`` with RNE and saturation.  QuantTensor input is
dequantized first, ``f32(q_in * sf_in)``.

Non-finite input: NaN counts as +inf in amax; a block holding +-inf/NaN gets ``sf = +inf`` (UE8M0
byte 0xFF) and ``sf_inv = 0``; its finite elements encode as +-0 and its non-finite ones as NaN
(e4m3 ``0x7F | sign``; e2m1: +-0), so it dequantizes to NaN.
"""

from __future__ import annotations

import struct
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..language import (
    bf16_bits_to_f32,
    e2m1_code_to_f32,
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
    f32_to_e2m1_code_fast,
    f32_to_e2m1_code_finite,
    f32_to_e4m3_bits_satfinite,
)
from ..language.grid import tile_grid, tile_ids
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (
    check_choice,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    check_tensor,
    custom_op,
    empty,
    interpreter_configs,
    tuned,
)
from ..utils import ceil_div, next_power_of_two
from ._fp4_requant import _block_max_exp, _lut_select, _map_table_values, _map_words, _requant_words, _word_max_code
from ._per_channel_common import _ENC4_BF16
from .common import FMT_CLAMP, FMT_MAX, alloc_sf, check_sf_flags, pack_ue8m0_words, sf_info
from .types import QuantTensor

__all__ = ["per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf"]

# input kinds (constexpr IN_KIND)
IN_BF16, IN_FP32, IN_E4M3, IN_E2M1 = 0, 1, 2, 3
# sf modes (constexpr SF_MODE)
SF_QUANT, SF_ONLY, SF_PRECOMPUTED = 0, 1, 2

_IN_KIND = {torch.bfloat16: IN_BF16, torch.float32: IN_FP32, torch.float8_e4m3fn: IN_E4M3, torch.int8: IN_E2M1}


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
               XBK: tl.constexpr, XSF_PACKED: tl.constexpr):
    """float32 tile ``[BLOCK_M, BLOCK_K]`` of logical columns ``col0 ..``; 0 outside the tensor.

    IN_KIND 0/1: bf16/fp32 x.  IN_KIND 2/3: e4m3 / packed FP4 data dequantized as ``f32(q * sf)``
    with sf blocks ``(XBM, XBK)`` (float32 or packed UE8M0)."""
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
def _round_scale_bits(am, CLAMP: tl.constexpr, MAX: tl.constexpr):
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


@triton.jit
def _block_cast_kernel(
    x_ptr, xsf_ptr, out_ptr, sf_ptr, psf_ptr,
    M, K, num_xsf_k, num_ms, num_ks,
    stride_xm, stride_xsf_m, stride_xsf_k, stride_om, stride_sm, stride_sk, stride_pm,
    IN_KIND: tl.constexpr, XBM: tl.constexpr, XBK: tl.constexpr, XSF_PACKED: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, ROW_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    OUT_E2M1: tl.constexpr, SF_MODE: tl.constexpr, ROUND_SF: tl.constexpr, PACKED: tl.constexpr,
    CLAMP: tl.constexpr, MAX: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_PER_PROG: tl.constexpr,
    FAST: tl.constexpr = False, PREFETCH: tl.constexpr = False, PAIRS: tl.constexpr = False,
    FINITE: tl.constexpr = False, WIDE: tl.constexpr = False, WIDE_VEC: tl.constexpr = 16, INT_SF: tl.constexpr = False,
    WORDS: tl.constexpr = False, KFAST: tl.constexpr = False, PDL: tl.constexpr = False
):
    """Cast ``[BLOCK_M, BLOCK_K]`` tiles with ``(BM, BK)`` scale blocks.

    Program ``(pm, pk)`` owns rows ``pm*BLOCK_M ..`` and chunks ``pk*CHUNKS_PER_PROG ..`` of BLOCK_K
    logical columns.  ROW_GROUP: one scale group spans the whole row (npc == K); the program owns every
    chunk, reduces amax across them, then quantizes (one pass when a single chunk covers K).

    Speed-only flags (same bits either way): FAST (SF_MODE 0 only) takes amax by an integer max over
    the float32 patterns and encodes e4m3 with the satfinite conversion plus x's sign bit
    (``_block_amax_fast`` / ``_store_codes_fast``); PREFETCH (plain bf16/fp32 x, 2D/per-token groups)
    issues the load of chunk ``i + 1`` before chunk ``i`` is reduced and stored; PAIRS (e2m1 output from plain
    x, computed sf, not ROW_GROUP; x passed as words of two elements, fp32 -> int64 / bf16 -> int32, with
    ``stride_xm`` in words) loads ``[BLOCK_M, BLOCK_K // 2]`` pair tiles in the packed bytes' layout, so the
    FP4 packing needs no reshape/split and no shared-memory relayout; FINITE (with FAST, computed sf, not
    ROW_GROUP) branches once per chunk on "every block amax is finite" and then encodes without the NaN/sign
    patches (``_store_codes_finite``), the general encode otherwise; WIDE (with PAIRS) casts the program's
    CHUNKS_PER_PROG blocks as one tile (``_wide_pairs_cast``: one load of all of them, one amax reduction, one
    encode and store); INT_SF (with ROUND_SF, computed sf) takes the scales from the amax bits without a division
    (``_round_scale_bits``); WORDS (with FAST: plain bf16 x -> e4m3, computed sf, 2D blocks) keeps the raw tile
    as the loaded words of two bf16 until the encode and encodes four elements per assembly block
    (``_store_codes_words``: no float32 copy of the tile, no FINITE branch: the sign merge is one ``lop3``)."""
    pdl_enter(PDL)
    MB: tl.constexpr = BLOCK_M // BM
    G: tl.constexpr = BLOCK_K // BK
    FASTQ: tl.constexpr = FAST and SF_MODE == 0
    pm, pk = tile_ids(KFAST)  # KFAST: the grid's first dimension over the chunk groups
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < M
    mblk = pm * MB + tl.arange(0, MB).to(tl.int64)
    if ROW_GROUP and NUM_CHUNKS == 1 and SF_MODE == 0:
        # the whole row fits one tile: load once, reduce, quantize
        x = _load_tile(x_ptr, xsf_ptr, rows, row_ok, 0, K, stride_xm, stride_xsf_m, stride_xsf_k,
                       num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED)
        sf, sf_inv = quant_scale(_amax_of(x, MB, BM, 1, BLOCK_K, FASTQ), CLAMP, MAX, ROUND_SF)
        _store_sf(sf_ptr, sf, mblk, 0, num_ms, num_ks, stride_sm, stride_sk, MB, 1, PACKED)
        _encode_store(out_ptr, x, _scale_tile(x, sf_inv, MB, BM, 1, BLOCK_K), rows, row_ok, 0, K, stride_om,
                      BLOCK_M, BLOCK_K, OUT_E2M1, FASTQ)
    elif ROW_GROUP:
        if SF_MODE == 2:
            p = tl.load(psf_ptr + mblk[:, None] * stride_pm + tl.zeros((MB, 1), tl.int64),
                        mask=(mblk < num_ms)[:, None], other=1.0)
            sf_inv = tl.math.div_rn(tl.full((MB, 1), 1.0, tl.float32), p)
        else:
            amax = tl.zeros((MB, 1), tl.float32)
            for c in range(0, NUM_CHUNKS):
                x = _load_tile(x_ptr, xsf_ptr, rows, row_ok, c * BLOCK_K, K, stride_xm, stride_xsf_m, stride_xsf_k,
                               num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED)
                amax = tl.maximum(amax, _amax_of(x, MB, BM, 1, BLOCK_K, False))
            sf, sf_inv = quant_scale(amax, CLAMP, MAX, ROUND_SF)
            _store_sf(sf_ptr, sf, mblk, 0, num_ms, num_ks, stride_sm, stride_sk, MB, 1, PACKED)
        if SF_MODE != 1:
            for c in range(0, NUM_CHUNKS):
                x = _load_tile(x_ptr, xsf_ptr, rows, row_ok, c * BLOCK_K, K, stride_xm, stride_xsf_m, stride_xsf_k,
                               num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED)
                v = _scale_tile(x, sf_inv, MB, BM, 1, BLOCK_K)
                # FAST is not used on this two-pass path: on the H200 its codes came out wrong in every other
                # column (test_per_token_cast_row_group_multi_chunk, 2026-11-30); the plain path is verified
                _encode_store(out_ptr, x, v, rows, row_ok, c * BLOCK_K, K, stride_om, BLOCK_M, BLOCK_K, OUT_E2M1,
                              False)
    else:
        # CHUNKS_PER_PROG is a multiple of 4 when 2D blocks pack UE8M0 (one chunk = one k-block, four
        # chunks = one int32 word); chunks past NUM_CHUNKS are fully masked.
        PF: tl.constexpr = PREFETCH and IN_KIND < 2
        PAIRED: tl.constexpr = PAIRS and OUT_E2M1 and SF_MODE == 0 and IN_KIND < 2
        FIN: tl.constexpr = FINITE and FASTQ
        WIDE_P: tl.constexpr = WIDE and PAIRED
        # WORDS on 2D blocks only: the per-token tiles' variant (a [MB, G, BK] reshape into the PTX encode) failed its
        # bitwise test on the H200 (session 6; the report was lost to the run's time limit), for a 0.6 % gain at best
        WORDS_P: tl.constexpr = WORDS and FASTQ and not OUT_E2M1 and IN_KIND == 0 and BM > 1
        # plain x: keep the raw tile, reduce amax on it, convert after the reduction (FAST, computed sf)
        RAW: tl.constexpr = PF or (FAST and IN_KIND < 2)
        c0 = pk * CHUNKS_PER_PROG
        if WIDE_P:
            _wide_pairs_cast(x_ptr, out_ptr, sf_ptr, rows, row_ok, mblk, c0, K, num_ms, num_ks, stride_xm, stride_om,
                             stride_sm, stride_sk, IN_KIND, BLOCK_M, BK, CHUNKS_PER_PROG, ROUND_SF, PACKED, CLAMP, MAX,
                             FIN, INT_SF, WIDE_VEC)
        else:
            if PF:
                if PAIRED:
                    nxt = _load_pairs(x_ptr, rows, row_ok, c0 * BLOCK_K, K, stride_xm, BLOCK_M, BLOCK_K)
                else:
                    nxt = _load_raw(x_ptr, rows, row_ok, c0 * BLOCK_K, K, stride_xm, BLOCK_M, BLOCK_K)
            for i in tl.static_range(CHUNKS_PER_PROG):
                c = c0 + i
                col0 = c * BLOCK_K
                if PF:
                    raw = nxt
                    if i + 1 < CHUNKS_PER_PROG:
                        if PAIRED:
                            nxt = _load_pairs(x_ptr, rows, row_ok, col0 + BLOCK_K, K, stride_xm, BLOCK_M, BLOCK_K)
                        else:
                            nxt = _load_raw(x_ptr, rows, row_ok, col0 + BLOCK_K, K, stride_xm, BLOCK_M, BLOCK_K)
                elif PAIRED:
                    raw = _load_pairs(x_ptr, rows, row_ok, col0, K, stride_xm, BLOCK_M, BLOCK_K)
                elif RAW:
                    raw = _load_raw(x_ptr, rows, row_ok, col0, K, stride_xm, BLOCK_M, BLOCK_K)
                else:
                    x = _load_tile(x_ptr, xsf_ptr, rows, row_ok, col0, K, stride_xm, stride_xsf_m, stride_xsf_k,
                                   num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED)
                kb0 = c * G
                if SF_MODE == 2:
                    kb = kb0 + tl.arange(0, G).to(tl.int64)
                    pmask = (mblk < num_ms)[:, None] & (kb < num_ks)[None, :]
                    p = tl.load(psf_ptr + mblk[:, None] * stride_pm + kb[None, :], mask=pmask, other=1.0)
                    sf_inv = tl.math.div_rn(tl.full((MB, G), 1.0, tl.float32), p)
                else:
                    if PAIRED:
                        lo, hi = _split_pairs(raw, IN_KIND)
                        am = _block_max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), MB, BM, G, BK // 2)
                        amax = tl.minimum(am, 0x7F800000).to(tl.float32, bitcast=True)
                    elif RAW:
                        amax = _raw_amax(raw, MB, BM, G, BK, IN_KIND)
                    else:
                        amax = _amax_of(x, MB, BM, G, BK, FAST)
                    if INT_SF and ROUND_SF:
                        sf, sf_inv = _round_scale_bits(amax.to(tl.int32, bitcast=True), CLAMP, MAX)
                    else:
                        sf, sf_inv = quant_scale(amax, CLAMP, MAX, ROUND_SF)
                    if PACKED and G == 1:
                        # one k-block per chunk: assemble the word from four consecutive chunks
                        e = tl.where(c < num_ks, sf_to_ue8m0(sf), 0)
                        if i % 4 == 0:
                            word = e
                        else:
                            word = word | (e << (8 * (i % 4)))
                        if i % 4 == 3:
                            wi = c // 4 + tl.zeros((MB, 1), tl.int64)
                            wm = (mblk < num_ms)[:, None] & (wi < (num_ks + 3) // 4)
                            tl.store(sf_ptr + mblk[:, None] * stride_sm + wi * stride_sk, word, mask=wm)
                    else:
                        _store_sf(sf_ptr, sf, mblk, kb0, num_ms, num_ks, stride_sm, stride_sk, MB, G, PACKED)
                if PAIRED:
                    vlo = _scale_tile(lo.to(tl.float32, bitcast=True), sf_inv, MB, BM, G, BK // 2)
                    vhi = _scale_tile(hi.to(tl.float32, bitcast=True), sf_inv, MB, BM, G, BK // 2)
                    if FIN:
                        if tl.max(tl.max(amax, 1), 0) < float("inf"):
                            _store_pairs_e2m1_finite(out_ptr, vlo, vhi, rows, row_ok, col0, K, stride_om, BLOCK_M,
                                                     BLOCK_K)
                        else:
                            _store_pairs_e2m1(out_ptr, lo, hi, vlo, vhi, rows, row_ok, col0, K, stride_om, BLOCK_M,
                                              BLOCK_K)
                    else:
                        _store_pairs_e2m1(out_ptr, lo, hi, vlo, vhi, rows, row_ok, col0, K, stride_om, BLOCK_M, BLOCK_K)
                elif WORDS_P:
                    _store_codes_words(out_ptr, raw, sf_inv, rows, row_ok, col0, K, stride_om, MB, BM, G, BK, BLOCK_M,
                                       BLOCK_K)
                elif SF_MODE != 1:
                    if RAW:
                        x = _raw_to_f32(raw, IN_KIND)
                    v = _scale_tile(x, sf_inv, MB, BM, G, BK)
                    if FIN:
                        if tl.max(tl.max(amax, 1), 0) < float("inf"):
                            _store_codes_finite(out_ptr, v, rows, row_ok, col0, K, stride_om, BLOCK_M, BLOCK_K,
                                                OUT_E2M1)
                        else:
                            _encode_store(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M, BLOCK_K, OUT_E2M1,
                                          FASTQ)
                    else:
                        _encode_store(out_ptr, x, v, rows, row_ok, col0, K, stride_om, BLOCK_M, BLOCK_K, OUT_E2M1,
                                      FASTQ)


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


# ------------------------------------------------------------------------------------------------
# Host side (shared with per_block_cast_kernel / cast_back_kernel)
# ------------------------------------------------------------------------------------------------
def _parse_input(name: str, x, x_block_size, allow_quant: bool = True):
    """-> (data, xsf_info or None, in_kind, M, K logical, (xbm, xbk))."""
    if isinstance(x, (tuple, list)):
        if not allow_quant:
            raise TypeError(f"{name} must be a bfloat16/float32 tensor here, got a QuantTensor")
        if len(x) != 2:
            raise ValueError(f"{name} as a QuantTensor must be (data, sf), got a sequence of length {len(x)}")
        data, xsf = x
        check_tensor(f"{name}[0] (data)", data, dtypes=(torch.float8_e4m3fn, torch.int8), ndim=2)
        check_inner_contiguous(f"{name}[0] (data)", data)
        if x_block_size is None:
            raise ValueError(f"x_block_size is required when {name} is a QuantTensor, got None")
        xbs = _check_block("x_block_size", x_block_size)
        m = data.shape[0]
        k = data.shape[1] * 2 if data.dtype == torch.int8 else data.shape[1]
        info = sf_info(f"{name}[1] (sf)", xsf, ceil_div(m, xbs[0]), ceil_div(k, xbs[1]))
        check_same_device(**{f"{name}[0]": data, f"{name}[1]": xsf})
        return data, info, _IN_KIND[data.dtype], m, k, xbs
    check_tensor(name, x, dtypes=(torch.bfloat16, torch.float32), ndim=2)
    check_inner_contiguous(name, x)
    check_same_device(**{name: x})
    if x_block_size is not None:
        raise ValueError(f"x_block_size must be None when {name} is a plain tensor, got {x_block_size!r}")
    return x, None, _IN_KIND[x.dtype], x.shape[0], x.shape[1], (1, 1)


def _check_block(name: str, bs) -> Tuple[int, int]:
    if not isinstance(bs, (tuple, list)) or len(bs) != 2 or not all(isinstance(b, int) and not isinstance(b, bool)
                                                                    for b in bs):
        raise TypeError(f"{name} must be a pair of ints (rows, cols), got {bs!r}")
    if bs[0] < 1 or bs[1] < 1:
        raise ValueError(f"{name} must be positive, got {tuple(bs)}")
    return int(bs[0]), int(bs[1])


def _check_fmt(fmt, allowed=("e4m3", "e2m1")) -> str:
    check_choice("fmt", fmt, allowed)
    return fmt


def _data_view(t: torch.Tensor) -> torch.Tensor:
    """Integer view a kernel loads raw bits through (bf16 -> int16, fp8 -> uint8)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def _config(m: int, k: int, bm: int, bk: int, row_group: bool, packed: bool, block_m: Optional[int],
            block_k: Optional[int], quant_input: bool = False):
    """(BLOCK_M, BLOCK_K, BK for the reshape, num_chunks, chunks_per_prog, num_warps): deterministic by shape.

    * per-token (bm == 1): ``[BLOCK_M, BLOCK_K]`` tiles (GPU: 2 rows x 1024 columns, 2 warps), up to 8
      chunks of a row pair per program (a static loop);
    * one group per row (npc == K): a whole row per tile when it fits (GPU: up to 8192 columns), else a
      two-pass loop over chunks;
    * 2D blocks: one ``(bm, bk)`` block per tile, ``chunks_per_prog`` blocks along K per program (a multiple
      of 4 when packed, so a program writes whole UE8M0 words).
    Under the interpreter: bigger tiles and fewer programs."""
    interp = interpreter_configs()
    if row_group:
        BLOCK_K = block_k or min(next_power_of_two(k), 2048 if interp else 8192)
        BK = BLOCK_K
        BLOCK_M = block_m or (min(next_power_of_two(m), 32) if interp else 1)
        warps = 4 if BLOCK_K * BLOCK_M <= 4096 else 8
        num_chunks = ceil_div(k, BLOCK_K)
        return BLOCK_M, BLOCK_K, BK, num_chunks, num_chunks, warps
    if bm == 1:
        # H200 sweep (8001 x 7168, npc 128): one [4, 1024] chunk per program, 4 warps: 43.4 us against 46.3 us
        # for [2, 1024] x 7 chunks, 2 warps; QuantTensor (FP4) input: one row per program, 134.7 against 241 us
        BLOCK_M = block_m or (min(next_power_of_two(m), 64) if interp else (1 if quant_input else 4))
        BLOCK_K = block_k or max(min(next_power_of_two(k), 2048 if interp else 1024), bk)
        if packed:
            BLOCK_K = max(BLOCK_K, 4 * bk)
        warps = 2 if BLOCK_M * BLOCK_K <= 2048 else 4
        num_chunks = ceil_div(k, BLOCK_K)
        cpp = num_chunks if interp else 1
        return BLOCK_M, BLOCK_K, bk, num_chunks, cpp, warps
    num_chunks = ceil_div(k, bk)
    if interp:
        cpp = num_chunks
    elif bm * bk >= 16384:
        cpp = min(num_chunks, 2)  # H200 sweep, 128x128 bf16: 2 blocks per program 49.2 us, 1: 52.6 us
    else:
        # H200 sweep, 32x32 fp32 -> e2m1 packed: 4 blocks per program (with prefetch, see _launch_cast) 93.9 us,
        # 16 blocks: 158.7 us
        cpp = max(1, min(num_chunks, 4))
    if packed:
        cpp = ceil_div(cpp, 4) * 4
    warps = 8 if bm * bk >= 16384 else (4 if bm * bk >= 4096 else 2)
    return bm, bk, bk, num_chunks, cpp, warps


def _check_cast_config(cfg, m, k, bm, bk, row_group, packed, BLOCK_M, BLOCK_K, BK, num_chunks, cpp):
    """Apply a (possibly overridden) launch config; ValueError for one the kernel cannot run.

    -> (BLOCK_M, BLOCK_K, BK, num_chunks, chunks_per_prog)."""
    bmx, bkx, cppx = int(cfg["BLOCK_M"]), int(cfg["BLOCK_K"]), int(cfg["CHUNKS_PER_PROG"])
    if (bmx, bkx, cppx) == (BLOCK_M, BLOCK_K, cpp):
        return BLOCK_M, BLOCK_K, BK, num_chunks, cpp
    for name, v in (("BLOCK_M", bmx), ("BLOCK_K", bkx)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if cppx < 1:
        raise ValueError(f"CHUNKS_PER_PROG must be positive, got {cppx}")
    if row_group:  # one group per row: BLOCK_K-wide chunks, every chunk in one program
        nc = ceil_div(k, bkx)
        return bmx, bkx, bkx, nc, nc
    if bm == 1:
        if bkx % bk:
            raise ValueError(f"BLOCK_K={bkx} must be a multiple of num_per_channels={bk}")
        if packed and (bkx // bk) % 4:
            raise ValueError(f"packed UE8M0 needs BLOCK_K={bkx} to hold a multiple of 4 groups of {bk}")
        nc = ceil_div(k, bkx)
        return bmx, bkx, bk, nc, min(cppx, nc)
    if (bmx, bkx) != (bm, bk):
        raise ValueError(f"2D blocks take one ({bm}, {bk}) block per tile, got BLOCK_M={bmx}, BLOCK_K={bkx}")
    if packed and cppx % 4:
        raise ValueError(f"packed UE8M0 with 2D blocks needs CHUNKS_PER_PROG % 4 == 0, got {cppx}")
    return bm, bk, bk, num_chunks, cppx


def _sf_layout(m: int, k: int, bm: int, bk: int, col_major: bool, packed: bool):
    """(shape, strides, dtype) of the §2.3 sf that ``alloc_sf`` returns (for the fake kernel)."""
    ms, ks = ceil_div(m, bm), ceil_div(k, bk)
    if packed:
        kc = ceil_div(ks, 4)
        return (ms, kc), ((kc, 1) if ms == 0 else (1, ceil_div(ms, 4) * 4)), torch.int32
    if col_major and ms > 0:
        return (ms, ks), (1, ceil_div(ms, 4) * 4), torch.float32
    return (ms, ks), (ks, 1), torch.float32


def _block_cast_impl(data: torch.Tensor, x_sf: Optional[torch.Tensor], psf: Optional[torch.Tensor], fmt: str,
                     xbm: int, xbk: int, bm: int, bk: int, row_group: bool, sf_mode: int, round_sf: bool,
                     col_major: bool, packed: bool, block_m: Optional[int] = None, block_k: Optional[int] = None,
                     chunks_per_prog: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocate and launch; inputs already validated.  Returns ``(out, sf)``; an output the mode does not
    produce is an empty ``(0,)`` placeholder (custom ops cannot return None)."""
    device = data.device
    in_kind = _IN_KIND[data.dtype]
    m = data.shape[0]
    k = data.shape[1] * 2 if in_kind == IN_E2M1 else data.shape[1]
    out_e2m1 = fmt == "e2m1"
    bk_eff = max(k, 1) if row_group else bk
    ms, ks = ceil_div(m, bm), ceil_div(k, bk_eff)
    if sf_mode != SF_ONLY:
        out = empty((m, k // 2) if out_e2m1 else (m, k), torch.int8 if out_e2m1 else torch.float8_e4m3fn, device)
    else:
        out = torch.empty((0,), dtype=torch.float8_e4m3fn, device=device)
    if sf_mode != SF_PRECOMPUTED:
        sf = alloc_sf(m, k, (bm, bk_eff), col_major, packed, device)
    else:
        sf = torch.empty((0,), dtype=torch.float32, device=device)
    if m == 0 or k == 0:
        return out, sf
    if (in_kind == IN_E2M1 and out_e2m1 and sf_mode == SF_QUANT and round_sf and not row_group and bm == 1
            and x_sf is not None and x_sf.dtype == torch.int32 and xbk % 8 == 0 and bk % 8 == 0 and k % 8 == 0
            and bk & (bk - 1) == 0 and bk <= 128 and block_m is None and block_k is None and chunks_per_prog is None):
        # H200 (8001 x 7168, CUPTI; TileKernels 287.8 us, the general kernel 116-124): session 9, once a block
        # ([rows, groups, blocks, words] words, SWAR block maxima, [4, 512] x 2 warps) 37.42 us; session 10, the words
        # as [blocks, groups, rows, words] with one-hot maxima, integer scale exponents and the maps from a table,
        # [8, 512] tiles, 1 warp, 80 registers (the general branch in the same kernel would take 255): 19.21 us
        # (19.28-19.37 for [8, 512] x 2 warps at 48, [4, 1024] x 1 at 80, [8, 1024] x 2 at 80, 72 registers);
        # session 11: KFAST (the grid's first dimension over a row block's chunks) with [16, 512] x 2 warps 18.33 us
        # against 19.40 (18.58 against 19.34 in session 10)
        gpu = not interpreter_configs()
        fcfg = tuned("per_token_cast", dict(FP4_REQUANT=True, FAST_LIMIT=252,
                                            BLOCK_M=16 if gpu else min(next_power_of_two(m), 16),
                                            num_warps=2, maxnreg=80 if gpu else None, KFAST=gpu))
        if fcfg["FP4_REQUANT"] and _fp4_requant_launch(data, x_sf, out, sf, m, k, xbm, xbk, bk, packed, fcfg):
            return out, sf
    BLOCK_M, BLOCK_K, BK, num_chunks, cpp, warps = _config(m, k, bm, bk, row_group, packed, block_m, block_k,
                                                           quant_input=in_kind in (IN_E4M3, IN_E2M1))
    if chunks_per_prog is not None and not row_group:
        cpp = chunks_per_prog
    if block_m is None and block_k is None and chunks_per_prog is None:
        # launch config through tritile.runtime.tuned ("per_token_cast" / "per_block_cast"): a sweep may
        # override BLOCK_M, BLOCK_K, CHUNKS_PER_PROG, num_warps and the speed-only flags FAST / PREFETCH
        # 2D blocks: PAIRS (FP4 from plain x) loads pair tiles in the packed bytes' layout (no shared-memory
        # relayout for the packing), FINITE encodes finite chunks without the NaN/sign patches, and a 32x32
        # FP4 tile takes 4 warps: sm_90 SASS of the 32x32 fp32 -> e2m1 loop 29.3 -> 16.5 instructions per
        # element with PAIRS/FINITE (128x128 bf16 -> e4m3: 10.2 -> 8.0).  H200 sweep (2026-11-30 session 4,
        # 8001 x 7168 fp32 -> e2m1 32x32, CUDA graph): 4 warps 87.8 us, 2 warps 88.0, PAIRS/FINITE off at 2 warps
        # 93.6, 1 warp 139.5 (one-warp blocks cap at 32 warps per SM: half occupancy)
        # Session 5 (same shape, CUPTI with L2 flushed): WIDE (a program's 4 chunks as one [32, 64]-pair tile: 2
        # barriers instead of 12, 16 KB of loads in flight) with WIDE_VEC=4 took 93.65 us to 68.68 (TileKernels 160.6)
        wide_default = False
        if (bm > 1 and out_e2m1 and sf_mode == SF_QUANT and in_kind in (IN_BF16, IN_FP32) and not row_group
                and bm * bk <= 1024):
            warps = 4
            if not interpreter_configs():
                wide_default, cpp = True, 4
        # Session 6 (8001 x 7168 bf16 -> e4m3, 128 x 128 blocks, CUPTI with L2 flushed): WORDS (the raw bf16 words
        # packed until a PTX encode per four elements) with INT_SF, PREFETCH and 80 registers (3 blocks of 8 warps per
        # SM, each with the next chunk's load in flight) took 48.16 us to 46.59 (TileKernels 47.7); the GPU default
        # for 2D bf16 -> e4m3 blocks with computed scales
        words_default = (bm > 1 and not out_e2m1 and sf_mode == SF_QUANT and in_kind == IN_BF16 and not row_group
                         and not interpreter_configs())
        cfg = dict(BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, CHUNKS_PER_PROG=cpp, num_warps=warps, FAST=True,
                   PREFETCH=(bm > 1 and bm * bk <= 1024 and in_kind in (IN_BF16, IN_FP32)
                             and not interpreter_configs()) or words_default, PAIRS=bm > 1, FINITE=bm > 1,
                   WIDE=wide_default, WIDE_VEC=4 if wide_default else 16, WORDS=words_default,
                   INT_SF=words_default, maxnreg=80 if words_default else None,
                   # Session 11 (8001 x 7168, CUPTI): the grid's first dimension over the chunks (consecutive programs
                   # on the same rows): per-token bf16 -> e4m3 43.67 us against 44.67, FP4 32 x 32 blocks 66.75 against
                   # 68.66, 128 x 128 blocks (below) 44.77-44.90 against 46.73-46.75
                   KFAST=not interpreter_configs() and ((bm == 1 and in_kind in (IN_BF16, IN_FP32)) or wide_default))
        if words_default and (bm, bk) == (128, 128) and not packed:
            # Session 11 (same shape, CUPTI): the grid's first dimension over the chunks (KFAST: consecutive programs
            # on the same rows) with one 128 x 128 block a program at 16 warps, no prefetch: 44.42-44.44 us against
            # 46.73-46.75 in two sweeps (91.6 % of copy; KFAST on the old default 44.77-44.90)
            cfg.update(KFAST=True, CHUNKS_PER_PROG=1, PREFETCH=False, maxnreg=None, num_warps=16)
        cfg = tuned("per_token_cast" if bm == 1 else "per_block_cast", cfg)
        BLOCK_M, BLOCK_K, BK, num_chunks, cpp = _check_cast_config(cfg, m, k, bm, bk, row_group, packed, BLOCK_M,
                                                                   BLOCK_K, BK, num_chunks, cpp)
        warps, fast, prefetch = int(cfg["num_warps"]), bool(cfg["FAST"]), bool(cfg["PREFETCH"])
        pairs, finite = bool(cfg.get("PAIRS", False)), bool(cfg.get("FINITE", False))
        # speed-only flags (same bits; WIDE on in the GPU default of FP4 32x32 blocks): WIDE (with PAIRS, a
        # power-of-two CHUNKS_PER_PROG) casts a program's chunks as one tile, INT_SF (round_sf) computes the scales
        # from the amax bits (WIDE_VEC: the widest per-thread run of the FP4 byte store, which sizes the pair loads'
        # vectors too)
        wide, int_sf = bool(cfg.get("WIDE", False)), bool(cfg.get("INT_SF", False))
        wide_vec = int(cfg.get("WIDE_VEC", 16))
        # WORDS (plain bf16 -> e4m3, computed sf, not npc == K): the raw words stay packed until a per-four-element
        # assembly encode (see _block_cast_kernel); maxnreg (None: no cap): ptxas' register cap
        words, maxnreg = bool(cfg.get("WORDS", False)), cfg.get("maxnreg")
        kfast = bool(cfg.get("KFAST", False))  # the grid's first dimension over the chunk groups
    else:
        fast, prefetch, pairs, finite, wide, int_sf, wide_vec = True, False, False, False, False, False, 16
        words, maxnreg, kfast = False, None, False
    grid, kfast = tile_grid(ceil_div(m, BLOCK_M), ceil_div(num_chunks, cpp), kfast)
    xv = _data_view(data)
    pairs = pairs and out_e2m1 and sf_mode == SF_QUANT and in_kind in (IN_BF16, IN_FP32) and not row_group
    if pairs:  # words of two elements (needs an even row stride and an aligned start; else the plain path)
        try:
            xv = data.view(torch.int64 if in_kind == IN_FP32 else torch.int32)
        except RuntimeError:
            pairs = False
    wide = wide and pairs and bm > 1 and cpp & (cpp - 1) == 0
    if wide and (wide_vec < 1 or wide_vec & (wide_vec - 1)):
        raise ValueError(f"WIDE_VEC must be a power of two, got {wide_vec}")
    int_sf = int_sf and bool(round_sf) and sf_mode != SF_PRECOMPUTED and not row_group
    outv = out.view(torch.uint8) if out.dtype == torch.float8_e4m3fn else out
    words = words and fast and in_kind == IN_BF16 and not out_e2m1 and sf_mode == SF_QUANT and not row_group
    extra = {} if maxnreg is None else dict(maxnreg=int(maxnreg))
    has_out, has_sf = sf_mode != SF_ONLY, sf_mode != SF_PRECOMPUTED
    _block_cast_kernel[grid](
        xv, x_sf if x_sf is not None else xv, outv if has_out else xv, sf if has_sf else xv,
        psf if psf is not None else xv,
        m, k, ceil_div(k, xbk), ms, ks,
        xv.stride(0), x_sf.stride(0) if x_sf is not None else 0, x_sf.stride(1) if x_sf is not None else 0,
        outv.stride(0) if has_out else 0, sf.stride(0) if has_sf else 0, sf.stride(1) if has_sf else 0,
        psf.stride(0) if psf is not None else 0,
        IN_KIND=in_kind, XBM=xbm, XBK=xbk, XSF_PACKED=x_sf is not None and x_sf.dtype == torch.int32,
        BM=bm, BK=BK, ROW_GROUP=row_group, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
        OUT_E2M1=out_e2m1, SF_MODE=sf_mode, ROUND_SF=bool(round_sf), PACKED=bool(packed),
        CLAMP=FMT_CLAMP[fmt], MAX=FMT_MAX[fmt], NUM_CHUNKS=num_chunks, CHUNKS_PER_PROG=cpp, FAST=fast,
        PREFETCH=prefetch, PAIRS=pairs, FINITE=finite, WIDE=wide, WIDE_VEC=wide_vec if wide else 16,
        INT_SF=int_sf, WORDS=words, KFAST=kfast, num_warps=warps, **extra, **pdl_args(xv.device),
    )
    return out, sf


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
        t = _MAP_TABLES[key] = torch.tensor(_map_table_values(), dtype=torch.int64, device=device)
    return t


def _block_cast_fake(data, x_sf, psf, fmt, xbm, xbk, bm, bk, row_group, sf_mode, round_sf, col_major, packed):
    m = data.shape[0]
    k = data.shape[1] * 2 if data.dtype == torch.int8 else data.shape[1]
    dev = data.device
    if sf_mode != SF_ONLY:
        out = torch.empty((m, k // 2) if fmt == "e2m1" else (m, k),
                          dtype=torch.int8 if fmt == "e2m1" else torch.float8_e4m3fn, device=dev)
    else:
        out = torch.empty((0,), dtype=torch.float8_e4m3fn, device=dev)
    if sf_mode != SF_PRECOMPUTED:
        shape, stride, dtype = _sf_layout(m, k, bm, max(k, 1) if row_group else bk, col_major, packed)
        sf = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
    else:
        sf = torch.empty((0,), dtype=torch.float32, device=dev)
    return out, sf


@custom_op("block_cast", fake=_block_cast_fake)
def _block_cast_op(data: torch.Tensor, x_sf: Optional[torch.Tensor], psf: Optional[torch.Tensor], fmt: str,
                   xbm: int, xbk: int, bm: int, bk: int, row_group: bool, sf_mode: int, round_sf: bool,
                   col_major: bool, packed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::block_cast`` behind every block cast (works under torch.compile)."""
    return _block_cast_impl(data, x_sf, psf, fmt, xbm, xbk, bm, bk, row_group, sf_mode, round_sf, col_major, packed)


def _launch_cast(x, x_block_size, fmt: str, bm: int, bk: int, row_group: bool, sf_mode: int,
                 psf: Optional[torch.Tensor], round_sf: bool, col_major: bool, packed: bool,
                 block_m: Optional[int] = None, block_k: Optional[int] = None, chunks_per_prog: Optional[int] = None):
    """Validate ``x`` (plain tensor or QuantTensor) -> (out or None, sf or None).

    ``block_m`` / ``block_k`` / ``chunks_per_prog`` override the launch rule (tests use them to run the
    GPU tilings, e.g. several K-programs with masked tail chunks, under the interpreter)."""
    data, xinfo, in_kind, m, k, xbs = _parse_input("x", x, x_block_size)
    if fmt == "e2m1" and k % 2:
        raise ValueError(f"fmt='e2m1' packs two values per byte, so K must be even, got K={k}")
    x_sf = xinfo.tensor if xinfo is not None else None
    args = (data, x_sf, psf, fmt, xbs[0], xbs[1], bm, bk, bool(row_group), int(sf_mode), bool(round_sf),
            bool(col_major), bool(packed))
    if block_m is None and block_k is None and chunks_per_prog is None:
        out, sf = _block_cast_op(*args)
    else:
        out, sf = _block_cast_impl(*args, block_m=block_m, block_k=block_k, chunks_per_prog=chunks_per_prog)
    return (None if sf_mode == SF_ONLY else out), (None if sf_mode == SF_PRECOMPUTED else sf)


def _check_precomputed_sf(sf, m: int, k: int, bm: int, bk: int, device) -> torch.Tensor:
    check_tensor("sf", sf, dtypes=(torch.float32,), ndim=2)
    check_shape("sf", sf, (ceil_div(m, bm), ceil_div(k, bk)))
    check_inner_contiguous("sf", sf)
    if sf.device != device:
        raise ValueError(f"sf must be on the same device as x ({device}), got {sf.device}")
    return sf


def _logical_shape(x):
    if isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], torch.Tensor):
        d = x[0]
        if d.dim() == 2:
            return d.shape[0], (d.shape[1] * 2 if d.dtype == torch.int8 else d.shape[1])
        return None
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        return x.shape[0], x.shape[1]
    return None


def _check_npc(num_per_channels, k: int) -> bool:
    """Validate npc; returns True when one group spans the whole row (npc == K, not a listed width)."""
    if not isinstance(num_per_channels, int) or isinstance(num_per_channels, bool):
        raise TypeError(f"num_per_channels must be an int, got {type(num_per_channels).__name__}")
    if num_per_channels in (16, 32, 64, 128):
        return False
    if num_per_channels == k:
        if k % 64 != 0:
            raise ValueError(f"num_per_channels == K (one group per row) requires K % 64 == 0, got K={k}")
        return True
    raise ValueError(f"num_per_channels must be 16, 32, 64, 128 or K={k}, got {num_per_channels}")


def _per_token(x, fmt, num_per_channels, x_block_size, col_major, round_sf, packed, sf_mode, psf=None):
    check_sf_flags(col_major, round_sf, packed)
    shape = _logical_shape(x)
    # full validation of x happens in _launch_cast; npc needs K first
    if shape is None:
        _parse_input("x", x, x_block_size)  # raises the right TypeError/ValueError
    m, k = shape
    row_group = _check_npc(num_per_channels, k)
    if psf is not None:
        dev = x[0].device if isinstance(x, (tuple, list)) else x.device
        _check_precomputed_sf(psf, m, k, 1, num_per_channels, dev)
    return _launch_cast(x, x_block_size, fmt, 1, num_per_channels, row_group, sf_mode, psf, round_sf, col_major,
                        packed)


def per_token_cast(x: Union[torch.Tensor, QuantTensor], fmt: str, num_per_channels: int,
                   x_block_size: Optional[Tuple[int, int]] = None, use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False) -> QuantTensor:
    """Quantize each row in groups of ``num_per_channels`` columns (scale block ``(1, npc)``).

    Args:
        x: ``(M, K)`` bfloat16/float32 (rows may be strided, ``stride(1) == 1``), or a QuantTensor
            ``(data, sf_in)``: data float8_e4m3fn ``(M, K)`` or int8 FP4 ``(M, K/2)``, sf_in float32
            ``(ceil(M/bm), ceil(K/bk))`` (any strides) or packed UE8M0 int32 ``(ceil(M/bm), ceil(Ks/4))``
            for ``x_block_size = (bm, bk)``; it is dequantized first, ``f32(q * sf_in)``.
        fmt: ``'e4m3'``, ``'e2m1'`` or ``'e5m6'`` (dispatches to ``per_token_cast_to_e5m6``; npc == K).
        num_per_channels: group width npc: 16, 32, 64, 128, or K (K % 64 == 0). The last group may be partial.
        x_block_size: ``(bm, bk)`` of a QuantTensor input's scales; None for a plain tensor.
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: sf layout and rounding (packed UE8M0
            requires column-major and round_sf).

    Returns:
        ``(out, sf)``: out float8_e4m3fn ``(M, K)`` or int8 ``(M, K/2)`` (two FP4 codes per byte, even
        element in the low nibble); sf float32 ``(M, ceil(K/npc))`` row-major or column-major with
        strides ``(1, A4(M))``, or packed UE8M0 int32 ``(M, ceil(Ks/4))`` with strides ``(1, A4(M))``.

    Scales per group: ``sf = max(amax, clamp) / MAX`` (rounded up to a power of two with round_sf),
    codes ``encode(x * sf_inv)`` with RNE and saturation.  A group holding inf/NaN gets sf = +inf and
    dequantizes to NaN (codes: NaN/0 for the non-finite elements, +-0 for the others).
    """
    if fmt == "e5m6":
        if x_block_size is not None:
            raise ValueError(f"x_block_size must be None for fmt='e5m6', got {x_block_size!r}")
        from .per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6

        return per_token_cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    _check_fmt(fmt, ("e4m3", "e2m1", "e5m6"))
    return _per_token(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                      use_packed_ue8m0, SF_QUANT)


def per_token_cast_with_sf_only(x: Union[torch.Tensor, QuantTensor], fmt: str, num_per_channels: int,
                                x_block_size: Optional[Tuple[int, int]] = None,
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Only the scale factors of :func:`per_token_cast` (identical bits and layout); no codes are written.

    Arguments as :func:`per_token_cast` (fmt ``'e4m3'`` or ``'e2m1'``).  Returns sf: float32
    ``(M, ceil(K/npc))`` (row- or column-major) or packed UE8M0 int32 ``(M, ceil(Ks/4))``.
    """
    _check_fmt(fmt)
    return _per_token(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                      use_packed_ue8m0, SF_ONLY)[1]


def per_token_cast_with_precomputed_sf(x: torch.Tensor, fmt: str, num_per_channels: int, sf: torch.Tensor,
                                       x_block_size: Optional[Tuple[int, int]] = None,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Quantize with given scales: ``out = encode(f32(x * (1 / sf[row, group])))``.

    Args:
        x: ``(M, K)`` bfloat16/float32, ``stride(1) == 1``.
        fmt: ``'e4m3'`` or ``'e2m1'``.
        num_per_channels: group width (16, 32, 64, 128 or K).
        sf: float32 ``(M, ceil(K/npc))`` dequant scales, ``stride(1) == 1``; read only.
        x_block_size: must be None.  use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False;
            round_sf is ignored.

    Returns:
        out float8_e4m3fn ``(M, K)`` or int8 ``(M, K/2)``.
    """
    _check_fmt(fmt)
    if use_tma_aligned_col_major_sf or use_packed_ue8m0:
        raise ValueError("per_token_cast_with_precomputed_sf takes a row-major float32 sf: "
                         "use_tma_aligned_col_major_sf and use_packed_ue8m0 must be False, got "
                         f"{use_tma_aligned_col_major_sf} and {use_packed_ue8m0}")
    if isinstance(x, (tuple, list)):
        raise TypeError("x must be a bfloat16/float32 tensor for per_token_cast_with_precomputed_sf, got a QuantTensor")
    return _per_token(x, fmt, num_per_channels, x_block_size, False, False, False, SF_PRECOMPUTED, psf=sf)[0]
