"""Benchmark registrations: E5M6 cast / cast back and the lossless FP4 -> FP8 re-quantization.

GPU: TileKernels' anchor shapes (8001 x 7168), or with ``grid=True`` its whole benchmark grid (``_quant_grid``); CPU:
small shapes (a correctness pass only)."""

from __future__ import annotations

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal, count_bytes, generate_rand_float

from . import _quant_grid as _grid
from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
from tritile.quant.per_block_cast_lossless_kernel import per_block_cast_lossless
from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6

_M = "quant"
_CONFIGS = [(False, True, False), (True, True, True)]  # (col_major, round_sf, packed)


# Tuning sweeps (``python -m tritile tune --op OP``), GPU anchor cases (8001 x 7168) only.
# per_token_cast_to_e5m6: default the quad kernel (bf16 read as int32 words; a thread owns 32 columns: 4 x 16-byte
# loads, 3 x 16-byte stores), one pass over a whole row in registers (256 quads, 224 used), 8 warps, hardware fp16
# RTZ; sm_90: ~16 SASS per element, 32 registers (the previous default, first candidate: two passes of
# 2048-column chunks, 4-byte stores at a 12-byte stride, ~22 SASS per element, 120 registers).  BLOCK_Q=32
# candidates: two passes of 7 exact 1024-column chunks, a warp per row (x re-read from L2).
# Default (H200 @ 65d4724): the quad kernel (lane-contiguous stores) and the three instruction cuts INT_SF (round_sf: power-of-two scales
# from the amax bits, no division), AMAX16 (amax by max.u16x2 on the bf16 pair words) and PAIR_ENC (round_sf: the E5M6
# codes of a bf16 pair per cvt.rz.f16x2, rounded on both halves at once; tiles with a row of amax > 65024 keep the
# general encoder).  sm_90a, finite-row path of the 256 quads x 4 warps tile (an sm_90a SASS count): 64 registers and
# 16.44 SASS instructions per element without the cuts, 66 and 10.53 with them (-36 %); Nsight Compute (base clocks)
# 67.3 -> 48.8 us, SM 80 -> 58 %, DRAM 56 -> 76 %.  H200 @ 65d4724 sweep (CUPTI, L2 flushed, us; row-major / TMA-aligned
# packed sf): without the cuts 55.87 / 55.87, all three 49.93 / 49.90, PAIR_ENC alone 50.03 / 49.79, AMAX16 alone
# 53.63 / 53.80, INT_SF alone 55.35 / 55.53, all three at 8 warps 50.24 / 50.07, 2 x 256 quads x 8 warps 52.19 / 52.20.
# Lane-contiguous 16-byte stores (through a shared-memory layout conversion) 55.6-56.0 against 58.4-58.5 us for
# quad-per-lane stores, since removed (H200 @ 694bd6c).  The first candidate is the H200 @ 694bd6c/2615106 default.
_NO_CUTS = dict(INT_SF=False, PAIR_ENC=False, AMAX16=False)
_TUNE_E5M6 = [
    dict(_NO_CUTS),
    dict(_NO_CUTS, QUAD=False, BLOCK_M=1, BLOCK_K=2048, num_warps=2),
    dict(INT_SF=False), dict(AMAX16=False), dict(PAIR_ENC=False), dict(num_warps=8),
    dict(BLOCK_Q=128, num_warps=4), dict(BLOCK_M=2, BLOCK_Q=256, num_warps=8), dict(BLOCK_M=2, BLOCK_Q=128, num_warps=8),
]
# cast_back_e5m6: default [2 rows, 512 groups of 8] (8192 values), 8 warps
_TUNE_CAST_BACK = [
    dict(BLOCK_M=1, BLOCK_G=512, num_warps=4), dict(BLOCK_M=1, BLOCK_G=512, num_warps=8),
    dict(BLOCK_M=1, BLOCK_G=1024, num_warps=8), dict(BLOCK_M=1, BLOCK_G=1024, num_warps=16),
    dict(BLOCK_M=2, BLOCK_G=512, num_warps=16), dict(BLOCK_M=2, BLOCK_G=512, num_warps=4),
    dict(BLOCK_M=4, BLOCK_G=256, num_warps=8), dict(BLOCK_M=4, BLOCK_G=256, num_warps=4),
    dict(BLOCK_M=2, BLOCK_G=256, num_warps=4), dict(BLOCK_M=1, BLOCK_G=256, num_warps=2),
    dict(BLOCK_M=4, BLOCK_G=512, num_warps=8), dict(BLOCK_M=8, BLOCK_G=128, num_warps=4),
    dict(BLOCK_M=1, BLOCK_G=128, num_warps=1), dict(BLOCK_M=4, BLOCK_G=128, num_warps=4),
]
# per_block_cast_lossless: default word kernel, TM rows x TW words (8 values each), 16 words per thread
# PRMT / PAIR64 candidates (offline: sm_90a ptxas, an sm_90a ptxas / SASS count; float32 sf in and out; the
# fast path per output value of one thread): PRMT builds the fast path's e4m3 bytes by byte permutes (~9
# instructions per input word instead of ~30); PAIR64 lays the tile out as the store wants it and stores int64
# pairs of output words from each branch (no join/reshape shuffles: -32 SHFL, -64 SEL per thread), maxnreg caps
# ptxas (the spills land in the rolled slow path).  Default [4, 128] x 1 warp: 94 regs, 7.60 instr/value;
# PRMT 96 / 4.49 (maxnreg=80: 80 / 4.59, 5 STL + 5 LDL on the fast path); PRMT+PAIR64 132 / 3.45; PRMT+PAIR64
# maxnreg=80: 80 / 3.63 (3 STL + 1 LDL on the fast path), maxnreg=72: 72 / 3.63 (7 warps per scheduler instead
# of 5); PRMT+PAIR64 TW=64: 63 / 5.03; [8, 128] x 2 warps: 128 / 3.66, maxnreg=80: 80 / 3.81 (packed UE8M0 sf in
# and out: default 95 / 7.87, PRMT 94 / 4.77, PRMT+PAIR64 128 / 4.22, maxnreg=80 80 / 4.30).
# (32, 32) [32, 32] x 2 warps: default 95 / 7.25; PRMT 95 / 4.41; PRMT+PAIR64 115 / 4.16, maxnreg=80 or 72: 4.26.
# (128, 128) [128, 16] x 4 warps: default 96 / 6.66; PRMT 95 / 3.58, maxnreg=80: 80 / 3.62; PRMT+PAIR64 128 /
# 3.59, maxnreg=80: 80 / 3.72 (no gain there).  Expected (issue-bound: SM 74 %, DRAM 46 %): ~2x fewer instructions
# per value and more warps per scheduler, toward the ~25 us target at 1x128 (28.6 us now); the H200 sweep decides.
# Looping word kernel (TILES: chunks of consecutive tiles per program, K fastest; PERSIST: get_num_sms() * PERSIST
# programs, grid-stride; both prefetch the next tile's words and sf before converting the current one: the PRMT
# [4, 128] x 1 warp program is latency-bound, 41 % fewer instructions gave 4 %).  sm_90a at (1, 128), float32 sf
# (an sm_90a ptxas / SASS count; instructions per value of the tile loop's fast path): PRMT TILES=1 (only the K-fastest
# 1-D grid) 96 regs / 4.58; TILES=4 135 / 4.26 (maxnreg=128: 127 / 4.62, no spills: 4 warps per scheduler; 96: 40 B
# stack, 10 LDL per tile); TILES=4 x 2 warps 95 / 5.39 (8 words per thread); TW=64 x 1 warp 115 / 6.08 (maxnreg=96:
# 95 / 6.70; maxnreg=80: 80 / 6.80, no spills: 6 warps per scheduler).  PERSIST must not exceed the blocks per SM
# that fit (1 warp at 128 regs: 16; 2 warps at 96: 10; 1 warp at 80: 24), or the extra programs run after the rest.
# (1, 128): the GPU default is PRMT + GRID_1D since H200 @ bc6f44a (``_gpu_defaults``).  H200 @ bc6f44a sweeps (CUPTI, us):
# PRMT TILES=1 26.88 / 26.87; PRMT PERSIST=16 maxnreg=128 26.93 (prefetch by hand); PRMT on the 2-D grid 27.20 /
# 27.38; PRMT PERSIST=16 PIPE=3 27.90 (compiler pipelining through shared memory); PRMT PERSIST=24 TW=64 maxnreg=80
# 28.15; PRMT maxnreg=80 28.23; PRMT PERSIST=32 PIPE=3 28.36; the word kernel without PRMT (the default before)
# 28.53 / 28.57; PRMT+PAIR64 maxnreg=80 28.74; TILES=8 maxnreg=128 28.88.  Dropped after losing by 4-1000 % in both
# sweeps: every [8 | 16 | 32 | 64]-row tile, TW=64 and TW=256 tiles, 2-warp loops, TILES 2 / 4, PIPE 4, PIPE at 2
# warps, PIPE with TILES, PAIR64 without a cap; then PIPE itself (the walk as a Triton-pipelined tl.range loop,
# cp.async into shared memory) was removed.  More bytes in flight (prefetch by hand or by cp.async) bought nothing:
# the 1-warp [4, 128] program is not latency-bound; Nsight puts it on MIO (the relayouts through shared memory).
# SFW (H200 @ d53c6fa; built in three layouts, swept on the H200, removed; docs/PERFORMANCE.md has the outcome): the tile in one
# register layout for the loads, the per-word input scales and the stores, with no relayout through shared memory.
# (1) the words' layout with a split-view store: 33.47 us against 26.83 (every 32-byte output sector written in two
# 16-byte halves by two store instructions); (2) a block's words in two neighbouring lanes (whole-sector stores):
# 26.76-28.32 against 26.98-27.00 (126 registers; faster than the default at base clocks, slower at boost);
# (3) an output block's input blocks in one thread (SHFL 29 -> 9): 29.24-30.00 against 26.91 (8-byte loads at a
# 16-byte stride: half sectors per load instruction).
# PAIR64 (int64 pair stores in the load's layout), the looping kernel (TILES > 1, PERSIST) and PIPE lost and were
# removed (docs/PERFORMANCE.md).
_OLD_1x128 = dict(GRID_1D=False)
_TUNE_LOSSLESS = {
    (1, 128): [_OLD_1x128, dict(_OLD_1x128, WORDS=False)],
    (32, 32): [dict(num_warps=4), dict(num_warps=16), dict(TW=64, num_warps=4), dict(TW=64, num_warps=8),
               dict(TW=32, num_warps=2), dict(TW=32, num_warps=4), dict(TM=64, TW=64, num_warps=8),
               dict(TM=64, TW=32, num_warps=4), dict(TW=256, num_warps=16), dict(WORDS=False),
               dict(GRID_1D=True)],
    (128, 128): [dict(num_warps=4), dict(num_warps=16), dict(TW=16, num_warps=4), dict(TW=16, num_warps=2),
                 dict(TW=16, num_warps=8), dict(TW=64, num_warps=8), dict(TW=64, num_warps=16), dict(WORDS=False),
                 dict(GRID_1D=True)],
}


def _shape(device):
    return (8001, 7168) if device.type == "cuda" else (33, 576)


def _check_pair(out, ref):
    assert_equal(out[0], ref[0])
    assert_equal(out[1].clone(memory_format=torch.contiguous_format),
                 ref[1].clone(memory_format=torch.contiguous_format))


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _e5m6_case(device, kernel, m, k, config, dtype, fn, ref, check, nbytes, tune):
    """A case of an E5M6 op (one group per row) in sf ``config``; ``dtype``: ``{"in_dtype" | "out_dtype": name}``."""
    col, rnd, packed = config
    return Case(params=dict(num_tokens=m, hidden=k, **dtype, col=col, round_sf=rnd, packed=packed),
                fn=fn, ref=ref, check=check, nbytes=nbytes,
                anchor=(kernel, dict(hidden=k, num_per_channels=k, num_tokens=m, **dtype, **_grid.sf_flags(config))),
                tune=(kernel, tune) if tune is not None and device.type == "cuda" and (m, k) == _shape(device)
                else None)


@register(_M, "per_token_cast_to_e5m6")
def _e5m6_cases(device, quick, grid=False):
    """bf16 at the anchor shape in both sf configs, or TileKernels' grid: tokens x hidden x both configs x in_dtype
    bf16 / fp32 (its randn input; the special-value inputs are not benchmarked)."""
    from tritile.torch.cast_e5m6 import cast_to_e5m6

    if _grid.on(quick, grid):
        todo = [(m, k, d, _CONFIGS) for m, k in _grid.shapes(device) for d in _DTYPES]
    else:
        todo = [(*_shape(device), "bf16", _CONFIGS[:1] if quick else _CONFIGS)]
    for m, k, dname, configs in todo:
        x = torch.randn(m, k, device=device, dtype=_DTYPES[dname])
        for config in configs:
            out = per_token_cast_to_e5m6(x, k, *config)
            yield _e5m6_case(device, "per_token_cast_to_e5m6", m, k, config, {"in_dtype": dname},
                             fn=lambda c=config, x=x, k=k: per_token_cast_to_e5m6(x, k, *c),
                             ref=lambda c=config, x=x, k=k: cast_to_e5m6(x, k, *c), check=_check_pair,
                             nbytes=count_bytes(x, out), tune=_TUNE_E5M6 if dname == "bf16" else None)


@register(_M, "cast_back_e5m6")
def _cast_back_e5m6_cases(device, quick, grid=False):
    """bf16 input data at the anchor shape (both configs, out bf16 / fp32), or TileKernels' grid: tokens x hidden x
    both configs x out bf16 / fp32, the input drawn in the output's dtype."""
    from tritile.torch.cast_e5m6 import cast_back_from_e5m6, cast_to_e5m6

    if _grid.on(quick, grid):
        todo = [(m, k, _CONFIGS, ("bf16", "fp32"), True) for m, k in _grid.shapes(device)]
    else:
        todo = [(*_shape(device), _CONFIGS[:1] if quick else _CONFIGS, ("bf16",) if quick else ("bf16", "fp32"),
                 False)]
    for m, k, configs, fmts, own_dtype in todo:
        x = None if own_dtype else torch.randn(m, k, device=device, dtype=torch.bfloat16)
        xs = {f: torch.randn(m, k, device=device, dtype=_DTYPES[f]) if own_dtype else x for f in fmts}
        for config in configs:
            for fmt in fmts:
                q = cast_to_e5m6(xs[fmt], k, *config)
                back = cast_back_e5m6(q, fmt, (1, k))
                yield _e5m6_case(device, "cast_back_e5m6", m, k, config, {"out_dtype": fmt},
                                 fn=lambda q=q, fmt=fmt, k=k: cast_back_e5m6(q, fmt, (1, k)),
                                 ref=lambda q=q, fmt=fmt, k=k: cast_back_from_e5m6(q, fmt, (1, k)),
                                 check=assert_equal,
                                 nbytes=count_bytes(q, back), tune=_TUNE_CAST_BACK)


def _clamp_abs_ratio(t, max_ratio=2.0**9):
    floor = t.abs().max() / max_ratio
    return torch.sign(t) * torch.maximum(t.abs(), floor)


@register(_M, "per_block_cast_lossless")
def _lossless_cases(device, quick, grid=False):
    """FP4 (1x32 blocks) -> e4m3 at the anchor shape, or TileKernels' whole grid: tokens x hidden x both input
    configs x both output configs x output blocks 1x128 / 32x32 / 128x128."""
    combos = [(_CONFIGS[0], _CONFIGS[0], (1, 128))] if quick else [
        (i, o, ob) for i in _CONFIGS for o in _CONFIGS for ob in ((1, 128), (32, 32), (128, 128))]
    for m, k in _grid.shapes(device) if _grid.on(quick, grid) else [_shape(device)]:
        yield from _lossless_shape(device, m, k, combos)


def _lossless_shape(device, m, k, combos):
    from tritile.torch.cast import cast, cast_back

    x = _clamp_abs_ratio(generate_rand_float((m, k), device=device))
    in_block = (1, 32)
    cache = {}
    for in_flags, out_flags, ob in combos:
        if in_flags not in cache:
            cache[in_flags] = cast(x, "e2m1", in_block, round_sf=in_flags[1],
                                   use_tma_aligned_col_major_sf=in_flags[0], use_packed_ue8m0=in_flags[2])
        x_fp4 = cache[in_flags]
        out = per_block_cast_lossless(x_fp4, "e4m3", in_block, ob, *out_flags)

        def check(got, ref, ob=ob):  # the round trip is exact (TileKernels' test)
            assert_equal(cast_back(got, "fp32", ob), ref)

        yield Case(
            params=dict(num_tokens=m, hidden=k, in_flags=in_flags, out_flags=out_flags, out_block=ob),
            fn=lambda x_fp4=x_fp4, ob=ob, f=out_flags: per_block_cast_lossless(x_fp4, "e4m3", in_block, ob, *f),
            # the reference is the dequantized input (its time is a dequant, not a re-quantization)
            ref=lambda x_fp4=x_fp4: cast_back(x_fp4, "fp32", in_block),
            check=check, nbytes=count_bytes(x_fp4, out),
            anchor=("per_block_cast_lossless", dict(
                hidden=k, in_sf_block=list(in_block), num_tokens=m, out_sf_block=list(ob),
                **_grid.sf_flags(in_flags, "in_"), **_grid.sf_flags(out_flags, "out_"))),
            tune=("per_block_cast_lossless", _TUNE_LOSSLESS[ob])
            if device.type == "cuda" and (m, k) == _shape(device) else None)
