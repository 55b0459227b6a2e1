"""``per_channel_cast_fused``: e4m3 cast with per-channel scales (128 rows x 1 column), optionally
fused with a row gather (``pos_to_token``) and the dequantization of an FP8 input
(``tile_kernels.quant.per_channel_cast_fused``)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, e4m3_bits_to_f32, ue8m0_to_f32
from ..language.cast import EMULATE, e4m3_bits_to_f32_fast
from ..language.grid import tile_grid
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_choice, check_inner_contiguous, check_same_device, check_tensor, checks_enabled,
                       custom_op, empty, interpreter_configs, tuned)
from ..utils import ceil_div
from ..runtime.plan import planned
from ._per_channel_common import (all_finite, column_amax, column_amax_bf16, per_channel_encode,
                                  per_channel_encode_signed, per_channel_launch_config, per_channel_quant_tile, per_channel_quant_tile_bf16,
                                  per_channel_scale)
from .common import sf_info
from .swiglu_forward_and_per_channel_cast_and_transpose_kernel import (_column_max_words, _column_scale, _encode_words,
                                                                       _word_tile_index)
from .types import QuantTensor

__all__ = ["per_channel_cast_fused"]

# x element kinds
_IN_F32, _IN_BF16, _IN_E4M3 = 0, 1, 2
_IN_KIND = {torch.float32: _IN_F32, torch.bfloat16: _IN_BF16, torch.float8_e4m3fn: _IN_E4M3}


@triton.jit
def _load_rows(x_ptr, x_sf_ptr, pos_ptr, rows, cols, pid_k, num_rows_in, num_rows_out, hidden, num_groups,
               stride_xm, stride_xsm, stride_xsk, stride_pos,
               IN_KIND: tl.constexpr, HAS_SF: tl.constexpr, SF_PACKED: tl.constexpr, NPC: tl.constexpr,
               HAS_MAP: tl.constexpr, BK: tl.constexpr, RAW: tl.constexpr = False, HW_DECODE: tl.constexpr = False):
    """float32 logical rows ``rows`` x columns ``cols`` (gathered, dequantized; 0 outside / on padding).
    ``RAW`` (bf16 input without sf only): the int16 bf16 patterns instead (0 outside / on padding).
    ``HW_DECODE`` (e4m3 input): the hardware conversion (``e4m3_bits_to_f32_fast``), the same value for every
    non-NaN code; a NaN code's sign may differ, but the input-scale multiply that always follows returns the GPU's
    canonical NaN for either decode (as in ``cast_back``, whose default it is)."""
    BM: tl.constexpr = rows.shape[0]
    out_row_ok = rows < num_rows_out
    col_ok = cols < hidden
    if HAS_MAP:
        src = tl.load(pos_ptr + rows * stride_pos, mask=out_row_ok, other=-1).to(tl.int64)
        # -1 = padding row; out-of-range entries (rejected under TRITILE_CHECKS=1) never read memory
        row_ok = (src >= 0) & (src < num_rows_in)
    else:
        src = rows
        row_ok = out_row_ok
    mask = row_ok[:, None] & col_ok[None, :]
    ptrs = x_ptr + src[:, None] * stride_xm + cols[None, :]
    if RAW:
        tl.static_assert(IN_KIND == 1 and not HAS_SF)
        x = tl.load(ptrs, mask=mask, other=0)
    elif IN_KIND == 0:
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif IN_KIND == 1:
        x = bf16_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    elif HW_DECODE:
        x = e4m3_bits_to_f32_fast(tl.load(ptrs, mask=mask, other=0))
    else:
        x = e4m3_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    if HAS_SF:
        # dequantize first: f32(q * sf_in); padding rows read q = 0 and sf_in = 0, giving +0
        G: tl.constexpr = BK // NPC
        if G == 1:  # one input-scale group per tile (the GPU's shape): one scale per row
            if SF_PACKED:
                w = tl.load(x_sf_ptr + src * stride_xsm + (pid_k // 4) * stride_xsk, mask=row_ok, other=0)
                s = tl.where(row_ok, ue8m0_to_f32(w >> ((pid_k % 4) * 8).to(tl.int32)), 0.0)
            else:
                s = tl.load(x_sf_ptr + src * stride_xsm + pid_k * stride_xsk, mask=row_ok, other=0.0)
            x = x * s[:, None]
        else:
            grp = pid_k * G + tl.arange(0, G)
            smask = row_ok[:, None] & (grp < num_groups)[None, :]
            if SF_PACKED:
                w = tl.load(x_sf_ptr + src[:, None] * stride_xsm + (grp // 4)[None, :] * stride_xsk, mask=smask,
                            other=0)
                s = tl.where(smask, ue8m0_to_f32(w >> ((grp % 4) * 8)[None, :].to(tl.int32)), 0.0)
            else:
                s = tl.load(x_sf_ptr + src[:, None] * stride_xsm + grp[None, :] * stride_xsk, mask=smask, other=0.0)
            x = tl.reshape(tl.reshape(x, (BM, G, NPC)) * tl.reshape(s, (BM, G, 1)), (BM, BK))
    return x


@triton.jit
def _encode_pass(x_ptr, x_sf_ptr, pos_ptr, out_ptr, sf_inv, cols, pid_m, pid_k, num_rows_in, num_rows_out, hidden,
                 num_groups, stride_xm, stride_xsm, stride_xsk, stride_pos, stride_om,
                 IN_KIND: tl.constexpr, HAS_SF: tl.constexpr, SF_PACKED: tl.constexpr, NPC: tl.constexpr,
                 HAS_MAP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr,
                 ALL_FINITE: tl.constexpr, SIGNED_ENC: tl.constexpr = False, HW_DECODE: tl.constexpr = False):
    """Second pass of a streamed block: re-read each ``RB``-row chunk, encode it with ``sf_inv``, store."""
    col_ok = cols < hidden
    for r in tl.range(0, BM, RB):
        rows = pid_m * BM + r + tl.arange(0, RB)
        x = _load_rows(x_ptr, x_sf_ptr, pos_ptr, rows, cols, pid_k, num_rows_in, num_rows_out, hidden,
                       num_groups, stride_xm, stride_xsm, stride_xsk, stride_pos, IN_KIND, HAS_SF, SF_PACKED, NPC,
                       HAS_MAP, BK, False, HW_DECODE)
        if SIGNED_ENC:
            codes = per_channel_encode_signed(x, sf_inv, RB, x)
        else:
            codes = per_channel_encode(x, sf_inv, RB, ALL_FINITE)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], codes,
                 mask=(rows < num_rows_out)[:, None] & col_ok[None, :])


@triton.jit
def _per_channel_cast_fused_kernel(
        x_ptr, x_sf_ptr, pos_ptr, out_ptr, sf_ptr,
        num_rows_in, num_rows_out, hidden, num_groups,
        stride_xm, stride_xsm, stride_xsk, stride_pos, stride_om, stride_sm,
        IN_KIND: tl.constexpr, HAS_SF: tl.constexpr, SF_PACKED: tl.constexpr, NPC: tl.constexpr,
        HAS_MAP: tl.constexpr, ROUND_SF: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr,
        FINITE_BRANCH: tl.constexpr, VEC: tl.constexpr = 0, SIGNED_ENC: tl.constexpr = 0,
        INT_POW2: tl.constexpr = False, HW_DECODE: tl.constexpr = False, PDL: tl.constexpr = False):
    """One 128-row block x ``BK`` columns per program.  ``RB == BM``: the block is held in registers
    (one read).  ``RB < BM``: it is streamed in ``RB``-row chunks twice (amax, then encode; the second
    read mostly hits L2), which needs far fewer registers per thread.  ``FINITE_BRANCH`` (GPU): a
    uniform branch leaves the NaN patch out of the encode when the tile's scales are all finite.
    ``VEC`` (> 0): the column offsets are declared contiguous in runs of ``VEC`` only, so Triton's
    coalescing gives each thread ``VEC`` columns (8: one 16-byte bf16 load, one 8-byte code store) and
    spreads the threads over more rows (more rows per thread: fewer shuffles in the column max).
    ``SIGNED_ENC`` (1 or 2): the encode takes the NaN codes' sign from x through a byte merge instead of
    a compare-and-select per element (``_per_channel_common.per_channel_encode_signed``: same bits, ~1/3
    of the encode's instructions; FINITE_BRANCH then has nothing to drop and is ignored); 2, for bf16 input
    without sf in the one-pass tile: unpack and multiply inside the same per-four assembly
    (``per_channel_encode_bf16``), which keeps ptxas from holding a float32 copy of the tile.
    ``INT_POW2`` (round_sf): the power-of-two scales from amax's bits, no division (same bits;
    ``_per_channel_common.per_channel_scale``).
    bf16 input without an input sf: the column max is taken on the bf16 patterns (``BITS_AMAX``)."""
    pdl_enter(PDL)
    BITS_AMAX: tl.constexpr = IN_KIND == 1 and not HAS_SF
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    cols = pid_k * BK + tl.arange(0, BK)
    if VEC > 0:
        cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
    col_ok = cols < hidden
    if RB >= BM:
        rows = pid_m * BM + tl.arange(0, BM)
        if BITS_AMAX:  # bf16 without sf: the column max on the bf16 patterns
            bits = _load_rows(x_ptr, x_sf_ptr, pos_ptr, rows, cols, pid_k, num_rows_in, num_rows_out, hidden,
                              num_groups, stride_xm, stride_xsm, stride_xsk, stride_pos, IN_KIND, HAS_SF, SF_PACKED,
                              NPC, HAS_MAP, BK, True)
            codes, sf = per_channel_quant_tile_bf16(bits, BM, ROUND_SF, FINITE_BRANCH, SIGNED_ENC, INT_POW2)
        else:
            x = _load_rows(x_ptr, x_sf_ptr, pos_ptr, rows, cols, pid_k, num_rows_in, num_rows_out, hidden, num_groups,
                           stride_xm, stride_xsm, stride_xsk, stride_pos, IN_KIND, HAS_SF, SF_PACKED, NPC, HAS_MAP, BK,
                           False, HW_DECODE)
            codes, sf = per_channel_quant_tile(x, BM, ROUND_SF, FINITE_BRANCH, SIGNED_ENC, INT_POW2)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], codes,
                 mask=(rows < num_rows_out)[:, None] & col_ok[None, :])
    else:
        # running element-wise max |x| (NaN as +inf) of the chunks, reduced over the rows once at the end
        if BITS_AMAX:  # bf16 without sf: on the bf16 patterns (two per LOP3 / VIMNMX.U16x2 on the GPU)
            acc16 = tl.zeros((RB, BK), tl.int16)
            for r in tl.range(0, BM, RB):
                rows = pid_m * BM + r + tl.arange(0, RB)
                bits = _load_rows(x_ptr, x_sf_ptr, pos_ptr, rows, cols, pid_k, num_rows_in, num_rows_out, hidden,
                                  num_groups, stride_xm, stride_xsm, stride_xsk, stride_pos, IN_KIND, HAS_SF,
                                  SF_PACKED, NPC, HAS_MAP, BK, True)
                acc16 = tl.maximum(acc16, bits & 0x7FFF)
            sf, sf_inv = per_channel_scale(column_amax_bf16(acc16, RB), ROUND_SF, INT_POW2)
        else:
            acc = tl.zeros((RB, BK), tl.float32)
            for r in tl.range(0, BM, RB):
                rows = pid_m * BM + r + tl.arange(0, RB)
                x = _load_rows(x_ptr, x_sf_ptr, pos_ptr, rows, cols, pid_k, num_rows_in, num_rows_out, hidden,
                               num_groups, stride_xm, stride_xsm, stride_xsk, stride_pos, IN_KIND, HAS_SF, SF_PACKED,
                               NPC, HAS_MAP, BK, False, HW_DECODE)
                # NaN-propagating max (one FMNMX.NAN per element on the GPU; numpy's maximum propagates NaN
                # too); column_amax maps a NaN maximum to +inf
                acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            sf, sf_inv = per_channel_scale(column_amax(acc, RB), ROUND_SF, INT_POW2)
        args = (x_ptr, x_sf_ptr, pos_ptr, out_ptr, sf_inv, cols, pid_m, pid_k, num_rows_in, num_rows_out, hidden,
                num_groups, stride_xm, stride_xsm, stride_xsk, stride_pos, stride_om)
        if SIGNED_ENC:  # no NaN patch to drop
            _encode_pass(*args, IN_KIND, HAS_SF, SF_PACKED, NPC, HAS_MAP, BM, BK, RB, False, True, HW_DECODE)
        elif FINITE_BRANCH:
            if all_finite(sf_inv):  # uniform: no group of the tile holds inf/NaN
                _encode_pass(*args, IN_KIND, HAS_SF, SF_PACKED, NPC, HAS_MAP, BM, BK, RB, True, False, HW_DECODE)
            else:
                _encode_pass(*args, IN_KIND, HAS_SF, SF_PACKED, NPC, HAS_MAP, BM, BK, RB, False, False, HW_DECODE)
        else:
            _encode_pass(*args, IN_KIND, HAS_SF, SF_PACKED, NPC, HAS_MAP, BM, BK, RB, False, False, HW_DECODE)
    tl.store(sf_ptr + pid_m * stride_sm + cols[None, :], sf, mask=col_ok[None, :])


@triton.jit
def _per_channel_cast_words_kernel(
        x_ptr, pos_ptr, out_ptr, sf_ptr, num_rows_in, num_rows_out, num_words,
        stride_xm, stride_pos, stride_om, stride_sm,
        HAS_MAP: tl.constexpr, ROUND_SF: tl.constexpr, BM: tl.constexpr, BKW: tl.constexpr, VECW: tl.constexpr,
        EVEN: tl.constexpr, INT_POW2: tl.constexpr, HMUL_ENC: tl.constexpr, PDL: tl.constexpr = False,
        SXM: tl.constexpr = 0, SOM: tl.constexpr = 0, FAST_DIV: tl.constexpr = False, KFAST: tl.constexpr = False):
    """WORDS path (bf16 x without an input sf): the ``[BM, 2 * BKW]`` block held as int32 words of two bf16
    (adjacent columns, the low column in the low half), half the registers of the int16 tile.  ``x_ptr``
    int32 words (``stride_xm`` in words), ``out_ptr`` int16 words of two codes (``stride_om`` in words),
    ``num_words = K / 2``.  Same bits as the element kernel, from the SwiGLU WORDS kernel's helpers:
    the column max on the words' two 16-bit halves (``max.u16x2`` on the GPU; ``|bf16|`` orders like its
    bits, NaN patterns above inf map to inf), the scales of the two columns of each word as today
    (``INT_POW2``: the round_sf scales in integer ops), then per two words one PTX block that unpacks,
    multiplies by the column's ``sf_inv`` (float32; ``HMUL_ENC`` with round_sf: the exact power-of-two
    product on the bf16 pairs), converts and merges x's signs (SIGNED_ENC=2's NaN handling), stored as
    16-bit words (coalesced).  ``HAS_MAP``: rows gathered through ``pos_ptr`` (-1 or out of range: a zero
    row).  ``EVEN``: no masks (no map, M % BM == 0, num_words % BKW == 0).  ``VECW``: words per thread run.
    Offsets inside the block are int32 (the launcher checks ``BM * stride < 2^31``).

    Speed-only candidates (same bits, off by default): ``SXM`` / ``SOM`` (> 0) are the row strides of x and out
    (in words) as compile-time constants (STATIC_STRIDES), so each thread's row addresses are one base register plus
    immediate offsets (no 64-bit address arithmetic per load / store, fewer live registers; one compile per row
    stride); ``FAST_DIV`` (round_sf
    off) computes the two IEEE divisions of the scales on the mantissa of ``a`` only (``_column_scale_fast_div``: no
    range check, no slow-path call)."""
    pdl_enter(PDL)
    pid_m, pid_k, r, c, rows, cw = _word_tile_index(BM, BKW, VECW, KFAST)
    col_ok = cw < num_words
    out_row_ok = rows < num_rows_out
    if HAS_MAP:
        src = tl.load(pos_ptr + rows.to(tl.int64) * stride_pos, mask=out_row_ok, other=-1).to(tl.int64)
        row_ok = (src >= 0) & (src < num_rows_in)  # -1 = padding row; out-of-range entries read nothing
        if SXM > 0:
            x_tile = x_ptr + pid_k * BKW + src[:, None] * SXM + c[None, :]
        else:
            x_tile = x_ptr + pid_k * BKW + src[:, None] * stride_xm + c[None, :]
    else:
        row_ok = out_row_ok
        if SXM > 0:  # one 64-bit base, the in-block offsets as int32 (immediates per row on the GPU)
            x_tile = (x_ptr + pid_m.to(tl.int64) * (BM * SXM) + pid_k * BKW) + (r[:, None] * SXM + c[None, :])
        else:
            x_tile = x_ptr + pid_m.to(tl.int64) * BM * stride_xm + pid_k * BKW + r[:, None] * stride_xm + c[None, :]
    if EVEN:
        w = tl.load(x_tile)
    else:
        w = tl.load(x_tile, mask=row_ok[:, None] & col_ok[None, :], other=0)
    mw = _column_max_words(w & 0x7FFF7FFF, True)  # [1, BKW]: the two columns' max |bf16| patterns per word
    if FAST_DIV and not ROUND_SF:
        sf_lo, si_lo = _column_scale_fast_div(mw & 0xFFFF)
        sf_hi, si_hi = _column_scale_fast_div(mw >> 16)
    else:
        sf_lo, si_lo = _column_scale(mw & 0xFFFF, ROUND_SF, INT_POW2)
        sf_hi, si_hi = _column_scale(mw >> 16, ROUND_SF, INT_POW2)
    codes = _encode_words(w, si_lo, si_hi, HMUL_ENC and ROUND_SF)
    if SOM > 0:
        dst = (out_ptr + pid_m.to(tl.int64) * (BM * SOM) + pid_k * BKW) + (r[:, None] * SOM + c[None, :])
    else:
        dst = out_ptr + pid_m.to(tl.int64) * BM * stride_om + pid_k * BKW + r[:, None] * stride_om + c[None, :]
    sf_row = sf_ptr + pid_m.to(tl.int64) * stride_sm + 2 * cw[None, :]
    if EVEN:
        tl.store(dst, codes)
        tl.store(sf_row, sf_lo)
        tl.store(sf_row + 1, sf_hi)
    else:
        tl.store(dst, codes, mask=out_row_ok[:, None] & col_ok[None, :])
        tl.store(sf_row, sf_lo, mask=col_ok[None, :])
        tl.store(sf_row + 1, sf_hi, mask=col_ok[None, :])


# q = RN(n / d) by the fast path of the compiler's own div.rn.f32 sequence (the SASS it emits: MUFU.RCP, then FFMAs
# refining the reciprocal and correcting the quotient), without the FCHK range check and its slow-path call: exact
# (the same bits as div.rn) whenever that check passes, as it does for the operands of _column_scale_fast_div
# (normal, d and n in [1, 448], quotient in [2^-9, 448]).
_DIV_FAST = tl.constexpr(
    "{ .reg .f32 r, e, q, t, nd; rcp.approx.ftz.f32 r, $2; neg.f32 nd, $2; fma.rn.f32 e, nd, r, 0f3F800000; "
    "fma.rn.f32 r, r, e, r; mul.rn.f32 q, $1, r; fma.rn.f32 t, nd, q, $1; fma.rn.f32 $0, r, t, q; }")


@triton.jit
def _div_rn_in_range(n, d):
    """``div_rn(n, d)`` for operands where div.rn.f32 takes its fast path (see ``_DIV_FAST``); ``div_rn`` under
    EMULATE."""
    if EMULATE:
        return tl.math.div_rn(n, d)
    else:
        return tl.inline_asm_elementwise(_DIV_FAST, "=f,f,f", [n, d], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _column_scale_fast_div(m):
    """``_column_scale(m, ROUND_SF=False)``: ``(div_rn(a, 448), div_rn(448, a))`` for ``a = max(amax, 1e-4)`` with
    ``amax`` the column's max ``|bf16|`` pattern ``m`` (int32 0..0x7FFF; patterns above 0x7F80 are NaN and count as
    inf), by dividing the mantissa ``d = a / 2^k`` in [1, 2) instead of ``a``: ``a / 448 = (d / 448) 2^k`` and
    ``448 / a = (448 / d) 2^-k`` exactly, and rounding commutes with the power of two as long as the results are normal
    (``1e-4 <= a < 2^128`` keeps them in [2^-23, 2^121]), so the scaled rounded quotients are the rounded quotients.
    The quotient's exponent is then adjusted in its bits.  ``inf`` gives ``(inf, 0)`` as before."""
    ab = tl.maximum(tl.minimum(m, 0x7F80) << 16, 0x38D1B717)  # bits of max(amax, 1e-4f) (both >= 0: int order)
    k = (ab >> 23) - 127
    d = ((ab & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    c448 = tl.full(d.shape, 448.0, tl.float32)
    sf = (_div_rn_in_range(d, c448).to(tl.int32, bitcast=True) + (k << 23)).to(tl.float32, bitcast=True)
    sf_inv = (_div_rn_in_range(c448, d).to(tl.int32, bitcast=True) - (k << 23)).to(tl.float32, bitcast=True)
    inf = m >= 0x7F80
    return tl.where(inf, float("inf"), sf), tl.where(inf, 0.0, sf_inv)


def _launch_words(x: torch.Tensor, pos_to_token: Optional[torch.Tensor], out: torch.Tensor, sf: torch.Tensor,
                  num_rows_out: int, round_sf: bool, c: dict, block_m: int) -> bool:
    """The WORDS kernel where it applies (bf16 x, even K, even row stride, 4-byte aligned base, int32 offsets
    inside a block); False (nothing launched) otherwise, and the element kernel runs."""
    num_rows_in, hidden = x.shape
    if (hidden % 2 or x.stride(0) % 2 or x.data_ptr() % 4
            or block_m * max(x.stride(0), out.stride(0)) >= 2 ** 31):
        return False
    bkw, vecw = c["BLOCK_K"] // 2, int(c["VEC"]) // 2
    if vecw > 1 and bkw % vecw:
        raise ValueError(f"bad per-channel WORDS config {c}: VEC must divide BLOCK_K")
    num_words = hidden // 2
    has_map = pos_to_token is not None
    even = not has_map and num_rows_out % block_m == 0 and num_words % bkw == 0
    grid, kfast = tile_grid(ceil_div(num_rows_out, block_m), ceil_div(num_words, bkw), c.get("KFAST", False))
    x_words = x.view(torch.int32)
    _per_channel_cast_words_kernel[grid](
        x_words, pos_to_token if has_map else x_words, out.view(torch.int16), sf,
        num_rows_in, num_rows_out, num_words, x.stride(0) // 2, pos_to_token.stride(0) if has_map else 0,
        out.stride(0) // 2, sf.stride(0),
        HAS_MAP=has_map, ROUND_SF=round_sf, BM=block_m, BKW=bkw, VECW=vecw, EVEN=even,
        INT_POW2=bool(c["INT_POW2"]), HMUL_ENC=bool(c["HMUL_ENC"]), KFAST=kfast, num_warps=c["num_warps"],
        **_words_candidates(c, x, out),
        **({} if c.get("maxnreg") is None else dict(maxnreg=c["maxnreg"])), **pdl_args(out.device))
    return True


def _words_candidates(c: dict, x: torch.Tensor, out: torch.Tensor) -> dict:
    """The WORDS kernel's speed-only constexprs from the config (same bits; absent keys: off): ``STATIC_STRIDES``
    (x's and out's row strides as constexprs: one compile per stride pair) and ``FAST_DIV`` (see
    ``_per_channel_cast_words_kernel``); both on by default since commit bc6f44a."""
    extra = {}
    if c.get("STATIC_STRIDES", False):
        extra.update(SXM=x.stride(0) // 2, SOM=out.stride(0) // 2)
    if c.get("FAST_DIV", False):
        extra["FAST_DIV"] = True
    return extra


def _launch(x: torch.Tensor, x_sf: Optional[torch.Tensor], sf_packed: bool, pos_to_token: Optional[torch.Tensor],
            num_rows_out: int, round_sf: bool, config: Optional[dict] = None, name: str = "per_channel_cast_fused"):
    """``config`` (tests) and ``tritile.runtime.tuned(name, ...)`` (sweeps): ``BLOCK_K`` (a power of two; a
    multiple of 128 with an input sf), ``ROWS_PER_STEP`` (128: one pass over registers; 16/32/64: two
    streamed passes), ``num_warps``, ``num_stages``, ``FINITE_BRANCH``, ``VEC``, ``SIGNED_ENC`` and ``INT_POW2`` (see the kernel);
    missing keys come from the default rule.  Rows per block are always 128.

    ``WORDS`` (off by default; bf16 x without an input sf, gathered or not): ``_per_channel_cast_words_kernel``,
    the one-pass block held as int32 words of two bf16 (``BLOCK_K`` and ``VEC`` still count columns;
    ``ROWS_PER_STEP``, ``FINITE_BRANCH``, ``SIGNED_ENC``, ``num_stages`` do not apply; ``INT_POW2`` does).
    ``HW_DECODE`` (e4m3 input; the GPU default there): the hardware e4m3 decode (see ``_load_rows``).  Same
    bits.  It needs an even K, an even row stride and a 4-byte aligned x (else the element kernel runs).
    ``HMUL_ENC`` (WORDS with round_sf): the power-of-two multiply on the bf16 pairs (exact: see the SwiGLU WORDS
    kernel).  ``maxnreg`` (WORDS only; None: no cap): ptxas' register cap.  ``STATIC_STRIDES`` / ``FAST_DIV`` (WORDS
    only, on with it by default since commit bc6f44a, same bits): see ``_words_candidates``.  ``KFAST`` (WORDS only,
    on with it since commit 4d49e57): the grid's first dimension over the column blocks (``tritile.language.grid``).
    sm_90a figures at 4096 x 7168 (offline SASS; registers, SASS instructions per element, round_sf off / on),
    [128, 128] x 4 warps, VEC 8: default 127 / 128 registers, 9.82 / 8.48; WORDS 94 / 106, 8.24 / 6.41; WORDS + HMUL_ENC
    94 / 96, 8.24 / 5.97 (5 blocks per SM instead of 4: 1.25x the bytes in flight); with maxnreg=80: 80
    registers, 6 blocks per SM, 48 / 16 bytes of stack, 8.70 / 6.09.  [128, 64] x 4 warps: default 72, WORDS
    64 registers (8 blocks per SM), 13.5 / 11.5 instructions per element.  First H200 look (CUDA-graph medians):
    24.0 / 23.4 us default, 22.7 / 22.3 us WORDS + HMUL_ENC (same bits)."""
    num_rows_in, hidden = x.shape
    dev = x.device
    num_per_tokens = 128
    out = empty((num_rows_out, hidden), torch.float8_e4m3fn, dev)
    sf = empty((ceil_div(num_rows_out, num_per_tokens), hidden), torch.float32, dev)
    if out.numel() == 0:
        return out, sf
    has_sf = x_sf is not None
    cfg = per_channel_launch_config(num_rows_out, hidden, num_per_tokens, k_multiple=128 if has_sf else 1)
    # GPU default, from the H200 sweep of 2026-11-30 (4096 x 7168 bf16, CUDA-graph us): without an input sf, one pass
    # over a [128, 64] tile held in registers by 4 warps, VEC=8 (8 columns per thread), no FINITE_BRANCH: 30.5 us,
    # against 49.2 us for [128, 128] streamed in 16-row steps with FINITE_BRANCH (the SASS-count favourite: ~11.4
    # instructions per element, but two dependent passes), 36.2 us for 32-row steps, 35.9 us for the one-pass tile with
    # FINITE_BRANCH, and 41.8 us for the first version.  With an input sf (BLOCK_K a multiple of 128): 32-row steps of
    # [128, 128].  Candidates: bench/cases/quant.py's _TUNE_CHANNEL. Sweep of 2026-11-30 (H200, commit 694bd6c; same shape):
    # SIGNED_ENC=2 (the NaN patch as a sign-byte merge) 24.9 us, with INT_POW2 (round_sf) 24.8 us, against 30.1-30.8 us
    # without (TileKernels 25.1 / 25.0). H200, 2026-11-30, commit 694bd6c (CUPTI, L2 flushed): [128, 128] x 4 warps
    # 26.3-26.5 us against 27.0-27.1 us for [128, 64].
    gpu = not interpreter_configs()
    if gpu:
        one_pass = not has_sf
        cfg = cfg._replace(block_k=128, rows_per_step=128 if one_pass else 32)
    # WORDS + HMUL_ENC (bf16 x without an input sf; the GPU default since commit 65d4724): CUPTI at 4096 x 7168,
    # round_sf off / on, 25.22 / 25.06 us against 26.52 / 26.39 (per_channel_cast_fused: 25.17 against 26.66).  H200,
    # 2026-11-30, commit bc6f44a: + STATIC_STRIDES + FAST_DIV, 24.99 / 24.96 us (per_channel_cast / _fused, round_sf
    # off) against 25.28 / 25.28 for WORDS + HMUL_ENC in the same sweep (TileKernels 25.1 / 25.0); same bits (the
    # division's exhaustive GPU test).  H200, 2026-12-01, commit 4d49e57: + KFAST (the grid's first dimension over the
    # column blocks, tritile.language.grid), two sweeps (CUPTI, round_sf off): per_channel_cast 23.89 / 24.03 us against
    # 25.03 / 24.91, round_sf on 23.74 against 24.60, per_channel_cast_fused 24.13 / 24.04 against 24.93 / 24.78
    words = gpu and not has_sf
    # An e4m3 input with its sf (is_fused_cast_back): the hardware decode (HW_DECODE) in 64-row steps.  H200,
    # 2026-12-02, commit be9d783 (plain 4096 rows, CUPTI with L2 flushed, round_sf off / on, same bits): hidden 2048
    # 26.16 / 26.00 -> 10.07 / 9.66 us, 4096 48.91 / 48.23 -> 18.42 / 17.84, 7168 81.52 / 80.96 -> 32.44 / 31.29
    # (15.6-17 % of copy -> 40-44 %); at 2560 the 32-row steps were faster (12.85 / 12.56 against 14.56 / 13.95)
    hw = gpu and has_sf and x.dtype == torch.float8_e4m3fn
    if hw:
        cfg = cfg._replace(rows_per_step=64)
    c = tuned(name, {"BLOCK_K": cfg.block_k, "ROWS_PER_STEP": cfg.rows_per_step,
                     "num_warps": cfg.num_warps, "num_stages": 3, "FINITE_BRANCH": gpu and has_sf,
                     "VEC": 8 if gpu else 0, "SIGNED_ENC": 2, "INT_POW2": True, "WORDS": words,
                     "HMUL_ENC": words, "STATIC_STRIDES": words, "FAST_DIV": words, "KFAST": words,
                     "HW_DECODE": hw, **(config or {})})
    bk, warps, rb, stages = c["BLOCK_K"], c["num_warps"], c["ROWS_PER_STEP"], c["num_stages"]
    if bk < 16 or bk & (bk - 1) or (has_sf and bk % 128) or rb not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"bad per-channel launch config {c}: BLOCK_K a power of two >= 16 (a multiple of 128 "
                         "with an input sf), ROWS_PER_STEP a power of two <= 128")
    if (c["WORDS"] and x.dtype == torch.bfloat16 and not has_sf
            and _launch_words(x, pos_to_token, out, sf, num_rows_out, round_sf, c, cfg.block_m)):
        return out, sf
    x_arg = x.view(torch.int16) if x.dtype == torch.bfloat16 else (x.view(torch.uint8) if x.element_size() == 1
                                                                    else x)
    grid = (ceil_div(num_rows_out, cfg.block_m), ceil_div(hidden, bk))
    _per_channel_cast_fused_kernel[grid](
        x_arg, x_sf if has_sf else x_arg, pos_to_token if pos_to_token is not None else x_arg,
        out.view(torch.uint8), sf,
        num_rows_in, num_rows_out, hidden, ceil_div(hidden, 128),
        x.stride(0), x_sf.stride(0) if has_sf else 0, x_sf.stride(1) if has_sf else 0,
        pos_to_token.stride(0) if pos_to_token is not None else 0, out.stride(0), sf.stride(0),
        IN_KIND=_IN_KIND[x.dtype], HAS_SF=has_sf, SF_PACKED=sf_packed, NPC=128,
        HAS_MAP=pos_to_token is not None, ROUND_SF=round_sf, BM=cfg.block_m, BK=bk, RB=rb,
        FINITE_BRANCH=bool(c["FINITE_BRANCH"]), VEC=int(c["VEC"]), SIGNED_ENC=int(c["SIGNED_ENC"]),
        INT_POW2=bool(c["INT_POW2"]), HW_DECODE=bool(c["HW_DECODE"]) and x.dtype == torch.float8_e4m3fn,
        num_warps=warps,
        num_stages=stages, **pdl_args(out.device))
    return out, sf


def _fake(x, x_sf, pos_to_token, round_sf):
    rows = x.shape[0] if pos_to_token is None else pos_to_token.shape[0]
    return (x.new_empty((rows, x.shape[1]), dtype=torch.float8_e4m3fn),
            x.new_empty((ceil_div(rows, 128), x.shape[1]), dtype=torch.float32))


@custom_op("per_channel_cast_fused", fake=_fake)
def _per_channel_cast_fused_op(x: torch.Tensor, x_sf: Optional[torch.Tensor], pos_to_token: Optional[torch.Tensor],
                               round_sf: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0] if pos_to_token is None else pos_to_token.shape[0]
    packed = x_sf is not None and x_sf.dtype == torch.int32
    return _launch(x, x_sf, packed, pos_to_token, rows, round_sf)


def _check_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")


@planned("per_channel_cast_fused")
def per_channel_cast_fused(x: Union[torch.Tensor, QuantTensor], fmt: str, num_per_tokens: int,
                           round_sf: bool = False, num_per_channels: Optional[int] = None,
                           pos_to_token: Optional[torch.Tensor] = None) -> QuantTensor:
    """Cast to FP8 e4m3 with one scale per (128 rows x 1 column) block, fusing an optional row gather
    and an optional FP8 re-quantization.

    Row ``i`` of the logical input is ``x[pos_to_token[i]]`` (or ``x[i]`` without a map; ``-1`` is a
    padding row of zeros).  For a QuantTensor the logical value is ``f32(f32(q * sf_in) * sf_inv)``, in
    that order.  Then, per column ``k`` of each 128-row block (a partial last block takes only the
    existing rows): ``amax = max |x|``, ``sf = max(amax, 1e-4) / 448`` (IEEE), ``sf_inv = 448 / max(amax,
    1e-4)``, or with ``round_sf`` ``sf = 2^ceil(log2 sf)``, ``sf_inv = 1 / sf``; ``out = e4m3(x * sf_inv)``
    (RNE, saturating).  A block holding +-inf or NaN gets ``sf = +inf``, its finite elements ``+-0`` and
    its non-finite ones NaN (``0x7F | sign``), so it dequantizes to NaN.  For a QuantTensor the rule
    applies to the dequantized values (an e4m3 NaN code or a non-finite ``sf_in`` makes them
    non-finite; the sign of such a NaN follows the backend's NaN propagation, as in the reference).

    Args:
        x: bfloat16 or float32 ``(N, K)`` with a unit column stride (rows may be strided), or a
            QuantTensor ``(data, sf_in)``: data float8_e4m3fn ``(N, K)`` with a unit column stride and
            ``K % 128 == 0``; sf_in float32 ``(N, K/128)`` of any strides (or packed UE8M0 int32
            ``(N, ceil(K/512))``, a tritile extension).
        fmt: must be ``'e4m3'``.
        num_per_tokens: rows per scale block; must be 128.
        round_sf: round the scales up to powers of two.
        num_per_channels: columns per input-scale block: must be 128 for a QuantTensor, None otherwise.
        pos_to_token: optional int32 ``(Mo,)`` gather map into x's rows, ``Mo % 16 == 0``; ``-1`` marks a
            padding row.  Without it ``Mo = N`` and ``N % 128 == 0``.  Entries must lie in
            ``[-1, N)`` (checked when ``TRITILE_CHECKS=1``; otherwise an out-of-range entry reads as a
            padding row).

    Returns:
        ``(out, sf)``: float8_e4m3fn ``(Mo, K)`` contiguous and float32 ``(ceil(Mo/128), K)`` contiguous.
        ``Mo = 0`` gives empty ``(0, K)`` tensors and launches nothing.
    """
    check_choice("fmt", fmt, ["e4m3"])
    _check_int("num_per_tokens", num_per_tokens)
    check_choice("num_per_tokens", num_per_tokens, [128])
    if not isinstance(round_sf, bool):
        raise TypeError(f"round_sf must be a bool, got {type(round_sf).__name__}")
    x_sf, sf_packed = None, False
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x as a QuantTensor must be a (data, sf) pair, got {len(x)} items")
        data, x_sf = x
        check_tensor("x[0] (data)", data, dtypes=(torch.float8_e4m3fn,), ndim=2)
        check_inner_contiguous("x[0] (data)", data)
        if num_per_channels is None:
            raise ValueError("num_per_channels is required (128) when x is a QuantTensor")
        _check_int("num_per_channels", num_per_channels)
        check_choice("num_per_channels", num_per_channels, [128])
        if data.shape[1] % 128 != 0:
            raise ValueError(f"x[0] (data) must have a multiple of 128 columns, got {data.shape[1]}")
        info = sf_info("x[1] (sf)", x_sf, data.shape[0], data.shape[1] // 128)
        x_sf, sf_packed = info.tensor, info.packed
        x = data
    else:
        check_tensor("x", x, dtypes=(torch.bfloat16, torch.float32), ndim=2)
        check_inner_contiguous("x", x)
        if num_per_channels is not None:
            raise ValueError(f"num_per_channels must be None for a plain tensor x, got {num_per_channels!r}")
    if pos_to_token is not None:
        check_tensor("pos_to_token", pos_to_token, dtypes=(torch.int32,), ndim=1)
    check_same_device(x=x, x_sf=x_sf, pos_to_token=pos_to_token)
    num_rows_in = x.shape[0]
    if pos_to_token is not None:
        num_rows_out = pos_to_token.shape[0]
        if num_rows_out % 16 != 0:
            raise ValueError(f"pos_to_token must have a multiple of 16 entries, got {num_rows_out}")
        if checks_enabled() and num_rows_out > 0:
            lo, hi = int(pos_to_token.min()), int(pos_to_token.max())
            if lo < -1 or hi >= num_rows_in:
                raise ValueError(f"pos_to_token entries must lie in [-1, {num_rows_in}), got [{lo}, {hi}]")
    else:
        num_rows_out = num_rows_in
        if num_rows_out % 128 != 0:
            raise ValueError(f"x must have a multiple of 128 rows without pos_to_token, got {num_rows_out}")
    if torch.compiler.is_compiling():  # traced as the opaque custom op ``torch.ops.tritile.per_channel_cast_fused``
        return _per_channel_cast_fused_op(x, x_sf, pos_to_token, round_sf)
    return _launch(x, x_sf, sf_packed, pos_to_token, num_rows_out, round_sf)
