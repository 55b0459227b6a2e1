"""Per-token (1 x npc) casts to FP8 e4m3 / FP4 e2m1 (``tile_kernels.quant.per_token_cast_kernel``).

This file also holds the generic block cast that ``per_block_cast_kernel`` reuses: one ``@triton.jit`` body
(``_block_cast_kernel``) that loads an ``[BLOCK_M, BLOCK_K]`` tile (bf16, fp32, or a dequantized e4m3 / FP4
QuantTensor with scales in any layout), reduces amax per ``(BM, BK)`` scale block, computes the scales
(``tritile.language.quant_scale``), stores them in one of the three sf layouts, and encodes the tile.  Its tile
helpers are in ``_block_cast_tiles``, its argument parsing and launch rule in ``_block_cast_host``; an FP4
QuantTensor cast to FP4 with power-of-two scales takes the byte-permute kernel of ``_fp4_requant``.

Scale math (``spec/quant.md`` §2.2): per block ``a = max(amax, CLAMP)``, ``sf = a / MAX``,
``sf_inv = MAX / a`` (two IEEE divisions), or with ``round_sf`` ``sf = 2^ceil(log2(a / MAX))`` and
``sf_inv = 1 / sf``; ``q = encode(f32(x * sf_inv))`` with RNE and saturation.  QuantTensor input is
dequantized first, ``f32(q_in * sf_in)``.

Non-finite input: NaN counts as +inf in amax; a block holding +-inf/NaN gets ``sf = +inf`` (UE8M0
byte 0xFF) and ``sf_inv = 0``; its finite elements encode as +-0 and its non-finite ones as NaN
(e4m3 ``0x7F | sign``; e2m1: +-0), so it dequantizes to NaN.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..language import quant_scale, sf_to_ue8m0
from ..language.cast import round_scale_bits as _round_scale_bits
from ..language.grid import tile_grid, tile_ids
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_inner_contiguous, check_shape, check_tensor, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div, next_power_of_two
from ..runtime.plan import planned
from ._block_cast_host import (
    _IN_KIND,
    IN_BF16,
    IN_E2M1,
    IN_E4M3,
    IN_FP32,
    SF_ONLY,
    SF_PRECOMPUTED,
    SF_QUANT,
    _check_cast_config,
    _check_fmt,
    _config,
    _data_view,
    _parse_input,
    _sf_layout,
)
from ._block_cast_tiles import (
    _amax_of,
    _block_max,
    _encode_store,
    _load_pairs,
    _load_raw,
    _load_tile,
    _raw_amax,
    _raw_to_f32,
    _scale_tile,
    _split_pairs,
    _store_codes_finite,
    _store_codes_words,
    _store_pairs_e2m1,
    _store_pairs_e2m1_finite,
    _store_sf,
    _wide_pairs_cast,
)
from ._fp4_requant import _fp4_requant_launch
from .common import FMT_CLAMP, FMT_MAX, alloc_sf, check_sf_flags
from .per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
from .types import QuantTensor

__all__ = ["per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf"]


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
    WORDS: tl.constexpr = False, KFAST: tl.constexpr = False, HW_DECODE: tl.constexpr = False, PDL: tl.constexpr = False
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
                       num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED, HW_DECODE)
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
                               num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED, HW_DECODE)
                amax = tl.maximum(amax, _amax_of(x, MB, BM, 1, BLOCK_K, False))
            sf, sf_inv = quant_scale(amax, CLAMP, MAX, ROUND_SF)
            _store_sf(sf_ptr, sf, mblk, 0, num_ms, num_ks, stride_sm, stride_sk, MB, 1, PACKED)
        if SF_MODE != 1:
            for c in range(0, NUM_CHUNKS):
                x = _load_tile(x_ptr, xsf_ptr, rows, row_ok, c * BLOCK_K, K, stride_xm, stride_xsf_m, stride_xsf_k,
                               num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED, HW_DECODE)
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
        # bitwise test on the H200 (2026-11-30, commit 65d4724; the report was lost to the run's time limit), for a 0.6
        # % gain at best
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
                                   num_xsf_k, BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED, HW_DECODE)
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
        # H200 (8001 x 7168, CUPTI; TileKernels 287.8 us, the general kernel 116-124): 2026-11-30, commit 31c87fe, once
        # a block ([rows, groups, blocks, words] words, SWAR block maxima, [4, 512] x 2 warps) 37.42 us; H200,
        # 2026-11-30, commit 424cc12, the words as [blocks, groups, rows, words] with one-hot maxima, integer scale
        # exponents and the maps from a table, [8, 512] tiles, 1 warp, 80 registers (the general branch in the same
        # kernel would take 255): 19.21 us (19.28-19.37 for [8, 512] x 2 warps at 48, [4, 1024] x 1 at 80, [8, 1024] x 2
        # at 80, 72 registers); H200, 2026-11-30, commit fd8764c: KFAST (the grid's first dimension over a row block's
        # chunks) with [16, 512] x 2 warps 18.33 us against 19.40 (18.58 against 19.34 at commit 424cc12)
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
        # launch config through tritile.runtime.tuned ("per_token_cast" / "per_block_cast"): a sweep may override
        # BLOCK_M, BLOCK_K, CHUNKS_PER_PROG, num_warps and the speed-only flags FAST / PREFETCH.  2D blocks: PAIRS (FP4
        # from plain x) loads pair tiles in the packed bytes' layout (no shared-memory relayout for the packing), FINITE
        # encodes finite chunks without the NaN/sign patches, and a 32x32 FP4 tile takes 4 warps: sm_90 SASS of the
        # 32x32 fp32 -> e2m1 loop 29.3 -> 16.5 instructions per element with PAIRS/FINITE (128x128 bf16 -> e4m3: 10.2 ->
        # 8.0).  H200 sweep (2026-11-30, commit 694bd6c, 8001 x 7168 fp32 -> e2m1 32x32, CUDA graph): 4 warps 87.8 us, 2
        # warps 88.0, PAIRS/FINITE off at 2 warps 93.6, 1 warp 139.5 (one-warp blocks cap at 32 warps per SM: half
        # occupancy).  H200, 2026-11-30, commit 2615106 (same shape, CUPTI with L2 flushed): WIDE (a program's 4
        # chunks as one [32, 64]-pair tile: 2 barriers instead of 12, 16 KB of loads in flight) with WIDE_VEC=4 took
        # 93.65 us to 68.68 (TileKernels 160.6)
        wide_default = False
        if (bm > 1 and out_e2m1 and sf_mode == SF_QUANT and in_kind in (IN_BF16, IN_FP32) and not row_group
                and bm * bk <= 1024):
            warps = 4
            if not interpreter_configs():
                wide_default, cpp = True, 4
        # H200, 2026-11-30, commit 65d4724 (8001 x 7168 bf16 -> e4m3, 128 x 128 blocks, CUPTI with L2 flushed): WORDS
        # (the raw bf16 words packed until a PTX encode per four elements) with INT_SF, PREFETCH and 80 registers (3
        # blocks of 8 warps per SM, each with the next chunk's load in flight) took 48.16 us to 46.59 (TileKernels
        # 47.7); the GPU default for 2D bf16 -> e4m3 blocks with computed scales
        words_default = (bm > 1 and not out_e2m1 and sf_mode == SF_QUANT and in_kind == IN_BF16 and not row_group
                         and not interpreter_configs())
        cfg = dict(BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, CHUNKS_PER_PROG=cpp, num_warps=warps, FAST=True,
                   PREFETCH=(bm > 1 and bm * bk <= 1024 and in_kind in (IN_BF16, IN_FP32)
                             and not interpreter_configs()) or words_default, PAIRS=bm > 1, FINITE=bm > 1,
                   WIDE=wide_default, WIDE_VEC=4 if wide_default else 16, WORDS=words_default,
                   INT_SF=words_default, maxnreg=80 if words_default else None,
                   # H200, 2026-11-30, commit fd8764c (8001 x 7168, CUPTI): the grid's first dimension over the chunks
                   # (consecutive programs on the same rows): per-token bf16 -> e4m3 43.67 us against 44.67, FP4 32 x 32
                   # blocks 66.75 against 68.66, 128 x 128 blocks (below) 44.77-44.90 against 46.73-46.75
                   KFAST=not interpreter_configs() and ((bm == 1 and in_kind in (IN_BF16, IN_FP32)) or wide_default))
        if words_default and (bm, bk) == (128, 128) and not packed:
            # H200, 2026-11-30, commit fd8764c (same shape, CUPTI): the grid's first dimension over the chunks (KFAST:
            # consecutive programs on the same rows) with one 128 x 128 block a program at 16 warps, no prefetch:
            # 44.42-44.44 us against 46.73-46.75 in two sweeps (91.6 % of copy; KFAST on the old default 44.77-44.90)
            cfg.update(KFAST=True, CHUNKS_PER_PROG=1, PREFETCH=False, maxnreg=None, num_warps=16)
        if bm == 1 and in_kind == IN_E4M3 and not row_group and not interpreter_configs():
            # H200, 2026-12-02, commit be9d783 (8001 x 7168 e4m3 QuantTensor in 128 x 128 or 32 x 32 blocks, packed
            # sf, CUPTI with L2 flushed; same bits): HW_DECODE (the hardware e4m3 conversion: sm_90 SASS 40.8 -> 22.9
            # instructions an element to e4m3, 51.8 -> 36.8 to e2m1) on [2, 1024] tiles at 2 warps, KFAST: e4m3 out
            # 87.47 -> 39.55 us (31 -> 69 % of copy), e2m1 out 125.70 -> 78.26; [4, 1024] x 4 warps 40.84 / 79.51,
            # HW_DECODE on the old [1, 1024] tiles 68.32 / 81.43
            cfg.update(HW_DECODE=True, BLOCK_M=2, num_warps=2, KFAST=True)
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
        hw_decode = bool(cfg.get("HW_DECODE", False))  # e4m3 input through the hardware conversion (same bits)
    else:
        fast, prefetch, pairs, finite, wide, int_sf, wide_vec = True, False, False, False, False, False, 16
        words, maxnreg, kfast, hw_decode = False, None, False, False
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
        INT_SF=int_sf, WORDS=words, KFAST=kfast, HW_DECODE=hw_decode and in_kind == IN_E4M3, num_warps=warps, **extra,
        **pdl_args(xv.device),
    )
    return out, sf


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
    if sf_mode == SF_PRECOMPUTED:
        dev = x[0].device if isinstance(x, (tuple, list)) else x.device
        _check_precomputed_sf(psf, m, k, 1, num_per_channels, dev)
    return _launch_cast(x, x_block_size, fmt, 1, num_per_channels, row_group, sf_mode, psf, round_sf, col_major,
                        packed)


@planned("per_token_cast")
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
        return per_token_cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    _check_fmt(fmt, ("e4m3", "e2m1", "e5m6"))
    return _per_token(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                      use_packed_ue8m0, SF_QUANT)


@planned("per_token_cast_with_sf_only")
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


@planned("per_token_cast_with_precomputed_sf")
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
