"""Lossless FP4 (e2m1) -> FP8 (e4m3) re-quantization (``tile_kernels.quant.per_block_cast_lossless_kernel``).

Exponent arithmetic only; no value is rounded when the input satisfies the precondition below.

* ``e_in(b)``: the biased exponent of input block ``b``'s scale (``bits(sf) >> 23`` for float32 scales, whose
  sign and mantissa are ignored, or the UE8M0 byte of a packed sf).
* Per output block ``B``: ``E = max e_in(b)`` over the input blocks of ``B`` inside the tensor, then
  ``E = E - 6`` saturating at 0 (out sf = max in sf / 64).
* Each FP4 value becomes ``e4m3(q * 2**(e_in(b) - E))``: at most ``6 * 2**6 = 384``, at least
  ``0.5 * 2**-5 = 2**-6`` (the smallest e4m3 normal) when ``e_in(b) >= E - 5``.
* Out sf: ``2**(E - 127)`` as float32 (E = 0 gives 0.0, as UE8M0 decodes), or byte E of packed UE8M0.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..language import f32_to_e4m3_bits, unpack_e2m1
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_choice, check_device, check_inner_contiguous, check_same_device, check_tensor,
                       checks_enabled, custom_op, empty, interpreter_configs, tuned)
from ..utils import align, ceil_div, is_power_of_two, next_power_of_two
from ..runtime.plan import planned
from ._lossless_jit import (_block_multiplier_exponents, _store_out_scales, _tile_sf_exponents, _tile_sf_raw,
                            _tile_store, _tile_words, _words_e4m3_lanes, _words_e4m3_prmt, _words_e4m3_slow)
from .common import SFInfo, alloc_sf, check_sf_flags, sf_info
from .types import QuantTensor

__all__ = ["per_block_cast_lossless"]


@triton.jit
def _per_block_cast_lossless_kernel(
    x_ptr, sf_in_ptr, out_ptr, sf_out_ptr,
    M, K, MS_IN, KS_IN, MS_OUT, KS_OUT_PAD,
    stride_xm, stride_sim, stride_sik, stride_om, stride_som, stride_sok,
    IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr,
    BMI: tl.constexpr, BKI: tl.constexpr, BMO: tl.constexpr, BKO: tl.constexpr,
    TM: tl.constexpr, TK: tl.constexpr, PDL: tl.constexpr = False
):
    """One program: a ``TM x TK`` tile of whole output blocks (TM % BMO == 0, TK % BKO == 0)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    NIM: tl.constexpr = TM // BMI  # input blocks per tile, rows
    NIK: tl.constexpr = TK // BKI  # input blocks per tile, cols
    NOM: tl.constexpr = TM // BMO
    NOK: tl.constexpr = TK // BKO
    RM: tl.constexpr = BMO // BMI  # input blocks per output block, rows
    RK: tl.constexpr = BKO // BKI

    # ---- per-input-block multiplier 2^(e_in - E) (0 for non-finite output blocks) and output exponents E
    d, e_out = _block_multiplier_exponents(sf_in_ptr, pid_m, pid_k, MS_IN, KS_IN, stride_sim, stride_sik,
                                           IN_PACKED, NIM, NIK, RM, RK)
    mult = (d << 23).to(tl.float32, bitcast=True)

    # ---- data: FP4 bytes [TM, TK/2] -> values [TM, TK] -> scaled -> e4m3 bytes
    rows = pid_m * TM + tl.arange(0, TM).to(tl.int64)
    bcols = pid_k * (TK // 2) + tl.arange(0, TK // 2).to(tl.int64)
    row_ok = rows < M
    bmask = row_ok[:, None] & (bcols[None, :] < K // 2)
    q = tl.load(x_ptr + rows[:, None] * stride_xm + bcols[None, :], mask=bmask, other=0)
    v = unpack_e2m1(q)
    v = tl.reshape(tl.reshape(v, (NIM, BMI, NIK, BKI)) * tl.reshape(mult, (NIM, 1, NIK, 1)), (TM, TK))
    cols = pid_k * TK + tl.arange(0, TK).to(tl.int64)
    mask = row_ok[:, None] & (cols[None, :] < K)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], f32_to_e4m3_bits(v), mask=mask)

    _store_out_scales(sf_out_ptr, e_out, pid_m, pid_k, MS_OUT, KS_OUT_PAD, stride_som, stride_sok, NOM, NOK,
                      OUT_PACKED)


@triton.jit
def _per_block_cast_lossless_words_kernel(
    x_ptr, sf_in_ptr, out_ptr, sf_out_ptr,
    M, K, MS_IN, KS_IN, MS_OUT, KS_OUT_PAD,
    stride_xm, stride_sim, stride_sik, stride_om, stride_som, stride_sok,
    IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr,
    BMI: tl.constexpr, BKI: tl.constexpr, BMO: tl.constexpr, BKO: tl.constexpr,
    TM: tl.constexpr, TW: tl.constexpr, PDL: tl.constexpr = False
):
    """One program: ``TM`` rows x ``TW`` 32-bit words of FP4 data (``TK = 8 * TW`` values), whole output
    blocks.  ``x_ptr`` is the int8 data (read as int32 words: 4-byte aligned rows), ``out_ptr`` an int32 view
    of the output; strides in words.  ``BKI >= 8``, so a word lies in one input block.  Each input word
    gives two output words (the 8 values of one word are the 8 nibbles, value 2j in the low nibble of
    byte j, and become bytes 0..3 of the first and second output word).

    Fast path (every input block of the tile has a multiplier ``2**dd`` with -5 <= dd <= 6, or 0, which
    always holds when the lossless precondition does): byte-lane exponent arithmetic (``_lanes_e4m3``),
    ~4 integer ops per value.  Otherwise (a tile that breaks the precondition, whose values round; a
    uniform branch) the float computation of ``_per_block_cast_lossless_kernel``, value by value, in a
    rolled loop (so it does not raise the register count): the same results either way.  GPU (ptxas
    sm_90, 16 words per thread): 58-97 registers, no spills, 16-byte loads and stores, ~7.5 SASS
    instructions per value on the fast path (the value-by-value kernel: 30-64 and byte accesses).
    Bounds are written ``(K // 32) * 4`` / ``(K // 32) * 8`` (K % 32 == 0) so that the compiler sees
    masks uniform over 4/8 words and vectorizes."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    TK: tl.constexpr = TW * 8
    NIM: tl.constexpr = TM // BMI
    NIK: tl.constexpr = TK // BKI
    NOM: tl.constexpr = TM // BMO
    NOK: tl.constexpr = TK // BKO
    WPB: tl.constexpr = BKI // 8  # words per input block row
    d, e_out = _block_multiplier_exponents(sf_in_ptr, pid_m, pid_k, MS_IN, KS_IN, stride_sim, stride_sik,
                                           IN_PACKED, NIM, NIK, BMO // BMI, BKO // BKI)

    row0 = pid_m * TM + (tl.arange(0, NIM) * BMI).to(tl.int64)
    # the tile as [NIM, BMI, NIK, WPB] words, so per-block values broadcast along dims 1 and 3
    rows = row0[:, None, None, None] + tl.arange(0, BMI)[None, :, None, None]
    wc = (tl.arange(0, NIK) * WPB)[None, None, :, None] + tl.arange(0, WPB)[None, None, None, :]
    row_ok = rows < M
    wmask = row_ok & (pid_k * TW + wc < (K // 32) * 4)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(xw_ptr + rows * stride_xm + (pid_k * TW + wc), mask=wmask, other=0)
    # two output words per input word: [NIM, BMI, NIK, 2 * WPB]
    oc = (tl.arange(0, NIK) * (2 * WPB))[None, None, :, None] + tl.arange(0, 2 * WPB)[None, None, None, :]
    omask = row_ok & (pid_k * (2 * TW) + oc < (K // 32) * 8)
    optrs = out_ptr + rows * stride_om + (pid_k * (2 * TW) + oc)
    d4 = tl.reshape(d, (NIM, 1, NIK, 1))
    bad = tl.max(tl.max(tl.where((d != 0) & ((d < 122) | (d > 133)), 1, 0), axis=1), axis=0)
    if bad == 0:
        lo, hi = _words_e4m3_lanes(w, d4)  # values 0..3 / 4..7 of the word
    else:
        lo, hi = _words_e4m3_slow(w, d4)
    tl.store(optrs, tl.reshape(tl.join(lo, hi), (NIM, BMI, NIK, 2 * WPB)), mask=omask)

    _store_out_scales(sf_out_ptr, e_out, pid_m, pid_k, MS_OUT, KS_OUT_PAD, stride_som, stride_sok, NOM, NOK,
                      OUT_PACKED)


@triton.jit
def _per_block_cast_lossless_1d_kernel(
    x_ptr, sf_in_ptr, out_ptr, sf_out_ptr,
    M, K, MS_IN, KS_IN, MS_OUT, KS_OUT_PAD,
    stride_xm, stride_sim, stride_sik, stride_om, stride_som, stride_sok,
    NUM_TILES, NKT, NMT,
    IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr,
    BMI: tl.constexpr, BKI: tl.constexpr, BMO: tl.constexpr, BKO: tl.constexpr,
    TM: tl.constexpr, TW: tl.constexpr, PDL: tl.constexpr = False
):
    """The word kernel (``_per_block_cast_lossless_words_kernel``, ``[TM, TW]``-word tiles, the same bits) on a 1-D
    grid: program ``t`` takes tile ``t = pid_m * NKT + pid_k`` (K fastest: consecutive programs cover a row block left
    to right), its fast path by byte permutes (``_words_e4m3_prmt``, ~9 instructions per input word instead of the
    2-D kernel's ~30 of byte-lane arithmetic; offline sm_90a SASS at 8001 x 7168, (1, 128), [4, 128] x 1 warp: 4.49
    instructions per value against 7.60).  The GPU's default at (1, 128) out blocks (H200: 26.88 us, against 27.20
    for the permutes on the 2-D grid and 28.53 for the 2-D word kernel, 8001 x 7168).

    The tile goes through a tile loop that runs once and loads the "next" tile ahead of the conversion, with every
    load of it masked (its row block is moved to ``NMT``, past the tensor): the form of the measured code, kept
    as it compiles."""
    pdl_enter(PDL)
    TK: tl.constexpr = TW * 8
    NIM: tl.constexpr = TM // BMI
    NIK: tl.constexpr = TK // BKI
    NOM: tl.constexpr = TM // BMO
    NOK: tl.constexpr = TK // BKO
    WPB: tl.constexpr = BKI // 8  # words per input block row
    RM: tl.constexpr = BMO // BMI
    RK: tl.constexpr = BKO // BKI
    first = tl.program_id(0)
    end = tl.minimum(first + 1, NUM_TILES)
    t = first
    pid_m = (t // NKT).to(tl.int64)
    pid_k = (t % NKT).to(tl.int64)
    w = _tile_words(x_ptr, pid_m, pid_k, M, K, stride_xm, TM, TW, BMI, NIM, NIK, WPB)
    raw = _tile_sf_raw(sf_in_ptr, pid_m, pid_k, MS_IN, KS_IN, stride_sim, stride_sik, IN_PACKED, NIM, NIK)
    while t < end:
        # the next tile (none past the program's last: row block NMT lies past the tensor, all its loads masked)
        tn = t + 1
        pid_mn = tl.where(tn < end, tn // NKT, NMT).to(tl.int64)
        pid_kn = (tn % NKT).to(tl.int64)
        d, e_out = _tile_sf_exponents(raw, pid_k, IN_PACKED, NIM, NIK, RM, RK)
        d4 = tl.reshape(d, (NIM, 1, NIK, 1))
        bad = tl.max(tl.max(tl.where((d != 0) & ((d < 122) | (d > 133)), 1, 0), axis=1), axis=0)
        if bad == 0:
            # prefetch: the next tile's loads fly while this one is converted (the rare slow path loads after its
            # conversion, so that the prefetched words do not add to its registers)
            w_next = _tile_words(x_ptr, pid_mn, pid_kn, M, K, stride_xm, TM, TW, BMI, NIM, NIK, WPB)
            raw_next = _tile_sf_raw(sf_in_ptr, pid_mn, pid_kn, MS_IN, KS_IN, stride_sim, stride_sik, IN_PACKED, NIM,
                                    NIK)
            lo, hi = _words_e4m3_prmt(w, d4)
        else:
            lo, hi = _words_e4m3_slow(w, d4)
            w_next = _tile_words(x_ptr, pid_mn, pid_kn, M, K, stride_xm, TM, TW, BMI, NIM, NIK, WPB)
            raw_next = _tile_sf_raw(sf_in_ptr, pid_mn, pid_kn, MS_IN, KS_IN, stride_sim, stride_sik, IN_PACKED, NIM,
                                    NIK)
        _tile_store(out_ptr, lo, hi, pid_m, pid_k, M, K, stride_om, TM, TW, BMI, NIM, NIK, WPB)
        _store_out_scales(sf_out_ptr, e_out, pid_m, pid_k, MS_OUT, KS_OUT_PAD, stride_som, stride_sok, NOM, NOK,
                          OUT_PACKED)
        w = w_next
        raw = raw_next
        t = tn
        pid_m = pid_mn
        pid_k = pid_kn


def _tile(bmo: int, bko: int):
    """(TM, TK, num_warps) of the value-by-value kernel: whole output blocks, ~8K elements per program on
    GPU, bigger in the interpreter."""
    if interpreter_configs():
        tm = max(bmo, 64)
        tk = max(bko, 65536 // tm)
        return tm, tk, 4
    tm = max(bmo, 32)
    tk = max(bko, 8192 // tm)
    return tm, tk, 8 if tm * tk >= 16384 else 4


def _word_tile(bmo: int, bko: int, hidden: int):
    """(TM, TW, num_warps) of the word kernel: whole output blocks; GPU ~2-4K input words (16-32K values)
    per program, up to 128 words (1024 values) of a row, 16 words per thread (H200 sweep)."""
    wrow = max(next_power_of_two(hidden // 8), 1)
    if interpreter_configs():
        tm = max(bmo, 64)
        tw = max(bko // 8, min(wrow, 8192 // tm))
        return tm, tw, 4
    # H200 sweep (8001 x 7168): ~1K input words per program at 16 words per thread won: out block 1x128
    # [4, 128] words, 1 warp: 28.9 us (the first guess [16, 128], 4 warps: 36.6); 32x32 [32, 32], 2 warps:
    # 36.2 us (first guess [32, 128], 8 warps: 48.3)
    tm = max(bmo, 4)
    tw = max(bko // 8, min(wrow, 128, 1024 // tm))
    return tm, tw, max(1, min(8, tm * tw // 512))


def _gpu_defaults(bmo: int, words_ok: bool) -> dict:
    """The GPU's speed-only defaults (same bits).  H200, 2026-11-30, commit bc6f44a (CUPTI, 8001 x 7168, (1, 128)
    out blocks): PRMT on the 1-D grid with K fastest (GRID_1D) 26.88 / 26.87 us in two sweeps, against 28.53 / 28.57
    for the word kernel without PRMT and 27.20 / 27.38 with PRMT on the 2-D grid.  Other out blocks: not measured."""
    if interpreter_configs() or not words_ok or bmo != 1:
        return {}
    return {"GRID_1D": True}


def _lossless_exponents(sfi, ms_in: int, ks_in: int) -> torch.Tensor:
    """Input scale exponents ``(Ms_in, Ks_in)`` int64 (host side, for the TRITILE_CHECKS precondition)."""
    sf = sfi.tensor
    if sfi.packed:
        w = sf.to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(0, 32, 8, device=sf.device, dtype=torch.int64)
        return ((w.unsqueeze(-1) >> shifts) & 0xFF).reshape(ms_in, -1)[:, :ks_in]
    bits = sf.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if bool(((bits & 0x807FFFFF) != 0).any()):
        raise ValueError("x[1] (sf) must hold non-negative powers of two (or +inf) for a lossless cast; "
                         "found scales with a mantissa, a sign or NaN")
    return (bits >> 23) & 0xFF


def _check_lossless(sfi, ms_in, ks_in, bmi, bki, bmo, bko):
    """TRITILE_CHECKS=1: every input block's scale is >= (max in its output block) / 2**11."""
    e_in = _lossless_exponents(sfi, ms_in, ks_in)
    rm, rk = bmo // bmi, bko // bki
    ms_o, ks_o = ceil_div(ms_in, rm), ceil_div(ks_in, rk)
    pad = torch.zeros((ms_o * rm, ks_o * rk), dtype=torch.int64, device=e_in.device)
    pad[:ms_in, :ks_in] = e_in
    emax = pad.reshape(ms_o, rm, ks_o, rk).amax(dim=(1, 3))
    e_out = torch.where(emax >= 6, emax - 6, torch.zeros_like(emax))
    eb = e_out.repeat_interleave(rm, 0).repeat_interleave(rk, 1)[:ms_in, :ks_in]
    nonfinite = (emax == 255).repeat_interleave(rm, 0).repeat_interleave(rk, 1)[:ms_in, :ks_in]
    bad = (e_in != 0) & ~nonfinite & (e_in + 5 < eb)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"x is not losslessly representable in e4m3 with out_block_size {(bmo, bko)}: input scale block "
            f"({i}, {j}) has exponent {int(e_in[i, j]) - 127}, more than 11 below the largest scale of its output "
            f"block (2^{int(eb[i, j]) + 6 - 127}); every input scale must be >= max / 2^11")


def _block(name, block):
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise ValueError(f"{name} must be a (rows, cols) pair, got {block!r}")
    for v in block:
        if isinstance(v, bool) or not isinstance(v, int) or not is_power_of_two(v):
            raise ValueError(f"{name} must hold two positive powers of two, got {tuple(block)!r}")
    return int(block[0]), int(block[1])


@planned("per_block_cast_lossless")
def per_block_cast_lossless(x: QuantTensor, fmt: str, x_block_size: Tuple[int, int], out_block_size: Tuple[int, int],
                            use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                            use_packed_ue8m0: bool = False) -> QuantTensor:
    """Losslessly re-quantize FP4 (e2m1) data with power-of-two scales to FP8 (e4m3) with larger blocks.

    Exponent arithmetic only.  Per output block ``B`` (``out_block_size``): ``E = max e_in(b) - 6`` over the
    input blocks ``b`` of ``B`` inside the tensor (saturating at 0), where ``e_in`` is the biased exponent
    of the input scale; out sf = ``2**(E-127)``; each value becomes ``e4m3(q * 2**(e_in(b) - E))``.

    Precondition (exactness): every input scale within an output block is at least ``max / 2**11`` (input
    blocks whose scale is 0 are exempt).  Otherwise the small values are rounded (RNE) or flushed to zero;
    TileKernels checks this with a device assert.  tritile checks it on the host when ``TRITILE_CHECKS=1``
    (raising ``ValueError``; this syncs) and also rejects float32 scales that are not powers of two there.

    Non-finite input: an input block whose scale is +inf/NaN (UE8M0 byte 0xFF), as tritile's casts write for
    blocks holding inf/NaN, makes its whole output block's sf +inf (byte 0xFF) with +-0 codes, so that block
    dequantizes to NaN instead of silently to finite values.

    Args:
        x: ``(data, sf)``.  ``data`` int8 ``(M, K/2)``: packed FP4 (element ``2j`` in the low nibble of byte
            ``j``), logical ``K % 32 == 0``, unit column stride.  ``sf``: float32 ``(ceil(M/bm), ceil(K/bk))``
            powers of two (sign and mantissa ignored), or packed UE8M0 int32 ``(ceil(M/bm), ceil(ceil(K/bk)/4))``;
            any strides.
        fmt: must be ``'e4m3'``.
        x_block_size: ``(bm, bk)`` of the input scales, powers of two.
        out_block_size: ``(bm_out, bk_out)`` powers of two, multiples of ``x_block_size``.
        use_tma_aligned_col_major_sf / use_packed_ue8m0: layout of the output sf (§2.3); packed requires
            column-major.
        round_sf: ignored (the output scales are always powers of two); kept for API compatibility.

    Returns:
        ``(out, sf)``: ``out`` float8_e4m3fn ``(M, K)``; ``sf`` float32 ``(ceil(M/bm_out), ceil(K/bk_out))``
        (row-major or strides ``(1, A4(Ms))``), or int32 packed UE8M0 ``(Ms, ceil(Ks/4))`` with strides
        ``(1, A4(Ms))`` and zero unused bytes.
    """
    check_choice("fmt", fmt, ("e4m3",))
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"x must be a (data, sf) QuantTensor pair, got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0] (data)", data, dtypes=(torch.int8,), ndim=2)
    check_tensor("x[1] (sf)", sf, dtypes=(torch.float32, torch.int32), ndim=2)
    check_device("x[0] (data)", data)
    check_same_device(data=data, sf=sf)
    # round_sf is ignored: the output is a power of two anyway; packed only needs column-major here
    check_sf_flags(use_tma_aligned_col_major_sf, True if use_packed_ue8m0 else bool(round_sf), use_packed_ue8m0)
    bmi, bki = _block("x_block_size", x_block_size)
    bmo, bko = _block("out_block_size", out_block_size)
    if bmo % bmi != 0 or bko % bki != 0:
        raise ValueError(f"out_block_size {(bmo, bko)} must be a multiple of x_block_size {(bmi, bki)} in each dim")
    check_inner_contiguous("x[0] (data)", data)
    num_tokens = data.shape[0]
    hidden = data.shape[1] * 2
    if hidden % 32 != 0:
        raise ValueError(f"x[0] (data) must have a logical hidden size (2 * columns) divisible by 32, got {hidden}")
    ms_in, ks_in = ceil_div(num_tokens, bmi), ceil_div(hidden, bki)
    sf_info("x[1] (sf)", sf, ms_in, ks_in)
    return _lossless_op(data, sf, bmi, bki, bmo, bko, bool(use_tma_aligned_col_major_sf), bool(use_packed_ue8m0))


def _lossless_fake(data, sf, bmi, bki, bmo, bko, col_major, packed):
    num_tokens, hidden = data.shape[0], data.shape[1] * 2
    return (data.new_empty((num_tokens, hidden), dtype=torch.float8_e4m3fn),
            alloc_sf(num_tokens, hidden, (bmo, bko), col_major, packed, data.device))


@custom_op("per_block_cast_lossless", fake=_lossless_fake)
def _lossless_op(data: torch.Tensor, sf: torch.Tensor, bmi: int, bki: int, bmo: int, bko: int, col_major: bool,
                 packed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::per_block_cast_lossless`` (validated arguments)."""
    use_tma_aligned_col_major_sf, use_packed_ue8m0 = col_major, packed
    num_tokens, hidden = data.shape[0], data.shape[1] * 2
    ms_in, ks_in = ceil_div(num_tokens, bmi), ceil_div(hidden, bki)
    sfi = SFInfo(sf, sf.stride(0), sf.stride(1), sf.dtype == torch.int32)
    out = empty((num_tokens, hidden), torch.float8_e4m3fn, data.device)
    out_sf = alloc_sf(num_tokens, hidden, (bmo, bko), use_tma_aligned_col_major_sf, use_packed_ue8m0, data.device)
    if num_tokens == 0 or hidden == 0:
        return out, out_sf
    if checks_enabled():
        _check_lossless(sfi, ms_in, ks_in, bmi, bki, bmo, bko)

    ms_out, ks_out = ceil_div(num_tokens, bmo), ceil_div(hidden, bko)
    ks_out_pad = align(ks_out, 4) if use_packed_ue8m0 else ks_out
    _launch(data, sfi, out, out_sf, bmi, bki, bmo, bko, ms_in, ks_in, ms_out, ks_out_pad, use_packed_ue8m0)
    return out, out_sf


def _launch(data, sfi, out, out_sf, bmi, bki, bmo, bko, ms_in, ks_in, ms_out, ks_out_pad, out_packed):
    """Launch config through ``tritile.runtime.tuned("per_block_cast_lossless", ...)``: ``WORDS`` (the word
    kernel; needs ``bki >= 8`` and 4-byte aligned data rows, else the value-by-value kernel runs), ``TM``
    (rows, a multiple of bmo), ``TW`` (words of 8 values per row, ``8 * TW`` a multiple of bko; word
    kernel) or ``TK`` (values per row, a multiple of bko; value kernel), ``num_warps``; word kernel speed-only
    flags (same bits; ``_gpu_defaults`` says where they are on): ``GRID_1D`` (``_per_block_cast_lossless_1d_kernel``:
    the tiles on a 1-D grid, K fastest, with the fast path by byte permutes ``_words_e4m3_prmt``; the 2-D word
    kernel's fast path is the byte-lane one); ``maxnreg`` (None: no cap): ptxas' register cap.  Other keys are a
    ValueError."""
    num_tokens, hidden = out.shape
    words_ok = (bki >= 8 and data.stride(0) % 4 == 0 and data.storage_offset() % 4 == 0
                and data.data_ptr() % 4 == 0)
    tm, tw, w_warps = _word_tile(bmo, bko, hidden)
    tm_b, tk, b_warps = _tile(bmo, bko)
    base = {"WORDS": words_ok, "TM": tm if words_ok else tm_b, "TW": tw, "TK": tk,
            "num_warps": w_warps if words_ok else b_warps, "GRID_1D": False, "maxnreg": None}
    c = tuned("per_block_cast_lossless", dict(base, **_gpu_defaults(bmo, words_ok)))
    unknown = sorted(set(c) - set(base))
    if unknown:
        raise ValueError(f"per_block_cast_lossless launch config: unknown keys {unknown}, expected some of "
                         f"{sorted(base)} (the byte-permute fast path goes with GRID_1D)")
    words = bool(c["WORDS"]) and words_ok
    tm = c["TM"]
    if tm % bmo or tm & (tm - 1) or (words and ((8 * c["TW"]) % bko or c["TW"] & (c["TW"] - 1))) or \
            (not words and (c["TK"] % bko or c["TK"] & (c["TK"] - 1))):
        raise ValueError(f"bad per_block_cast_lossless launch config {c} for out_block_size {(bmo, bko)}: TM, TW, "
                         "TK powers of two, TM a multiple of bmo, 8*TW (TK) a multiple of bko")
    common = (num_tokens, hidden, ms_in, ks_in, ms_out, ks_out_pad)
    extra = {} if c["maxnreg"] is None else dict(maxnreg=int(c["maxnreg"]))
    if words and c["GRID_1D"]:
        out_w = out.view(torch.uint8).view(torch.int32)
        nmt, nkt = ceil_div(num_tokens, tm), ceil_div(ks_out_pad * bko, 8 * c["TW"])
        num_tiles = nmt * nkt
        _per_block_cast_lossless_1d_kernel[(num_tiles,)](
            data, sfi.tensor, out_w, out_sf, *common,
            data.stride(0) // 4, sfi.stride_m, sfi.stride_k, out_w.stride(0), out_sf.stride(0), out_sf.stride(1),
            num_tiles, nkt, nmt,
            IN_PACKED=sfi.packed, OUT_PACKED=out_packed,
            BMI=bmi, BKI=bki, BMO=bmo, BKO=bko, TM=tm, TW=c["TW"],
            num_warps=c["num_warps"], **extra, **pdl_args(data.device))
    elif words:
        out_w = out.view(torch.uint8).view(torch.int32)
        grid = (ceil_div(num_tokens, tm), ceil_div(ks_out_pad * bko, 8 * c["TW"]))
        _per_block_cast_lossless_words_kernel[grid](
            data, sfi.tensor, out_w, out_sf, *common,
            data.stride(0) // 4, sfi.stride_m, sfi.stride_k, out_w.stride(0), out_sf.stride(0), out_sf.stride(1),
            IN_PACKED=sfi.packed, OUT_PACKED=out_packed,
            BMI=bmi, BKI=bki, BMO=bmo, BKO=bko, TM=tm, TW=c["TW"],
            num_warps=c["num_warps"], **extra, **pdl_args(data.device))
    else:
        grid = (ceil_div(num_tokens, tm), ceil_div(ks_out_pad * bko, c["TK"]))
        _per_block_cast_lossless_kernel[grid](
            data, sfi.tensor, out.view(torch.uint8), out_sf, *common,
            data.stride(0), sfi.stride_m, sfi.stride_k, out.stride(0), out_sf.stride(0), out_sf.stride(1),
            IN_PACKED=sfi.packed, OUT_PACKED=out_packed,
            BMI=bmi, BKI=bki, BMO=bmo, BKO=bko, TM=tm, TK=c["TK"], num_warps=c["num_warps"], **extra,
            **pdl_args(data.device))
