"""Benchmark cases of ``tritile.quant``: per_token_cast, per_block_cast and the cast-backs; the E5M6 cast and cast
back and the lossless FP4 -> FP8 re-quantization; the per-channel casts (per_channel_cast, per_channel_cast_fused,
per_channel_cast_and_transpose); the fused SwiGLU casts (swiglu_forward_and_per_token_cast,
swiglu_backward_and_per_token_cast, swiglu_forward_and_per_channel_cast_and_transpose).

GPU: TileKernels' anchor shapes (8001 x 7168 for the casts), or with ``grid=True`` its whole benchmark grid
(``_grid``); CPU: small shapes (a correctness pass only).  Bytes as TileKernels counts them: every input read once
(a QuantTensor counts data + sf), every output written once, sf by its logical elements.

The MoE data of the fused casts is built as TileKernels' test generator does (bf16 ``rand`` scores of
``num_send_tokens * ep`` rows, top-k, non-local experts -> -1, rows with no local expert dropped), then cut to the
anchor's token count exactly, and mapped with a plain-torch fused mapping in the canonical order (stable by ``t*K + k``
inside each expert, segments aligned, padding rows -1/zero).
"""

from __future__ import annotations

import torch

from tritile.bench import TRITILE, Case, op, register
from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
from tritile.quant.cast_back_kernel import cast_back, per_token_cast_back
from tritile.quant.per_block_cast_kernel import per_block_cast
from tritile.quant.per_block_cast_lossless_kernel import per_block_cast_lossless
from tritile.quant.per_channel_cast_fused_kernel import per_channel_cast_fused
from tritile.quant.per_token_cast_kernel import per_token_cast
from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
from tritile.testing import assert_equal, count_bytes, generate_rand_float

from . import _grid

_M = "quant"


_PACKED = (True, True, True)  # (col_major, round_sf, packed)
_ROUND = (False, True, False)


def _shape(device):
    return (8001, 7168) if device.type == "cuda" else (33, 576)


def _dense(t):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _check_cast(out, ref):
    assert_equal(out[0], ref[0])
    assert out[1].shape == ref[1].shape and out[1].stride() == ref[1].stride()
    assert_equal(_dense(out[1]), _dense(ref[1]))  # tritile and the reference both zero unused UE8M0 bytes


def _anchor(device, kernel, **params):
    return (kernel, params) if device.type == "cuda" else None


def _tune(device, name, candidates):
    """``Case.tune`` for GPU cases only (``python -m tritile tune``); None on the CPU."""
    return (name, candidates) if device.type == "cuda" else None


# Launch-config candidates at the anchor shape (8001 x 7168), overriding the defaults that the wrappers pass
# to tritile.runtime.tuned.  FAST=False / HW_DECODE=False select the previous code paths (same bits).
# per-token, npc 128, packed UE8M0; default (the shape rule): [4, 1024] tiles, one a program, 4 warps, FAST, no
# prefetch, KFAST (H200 @ fd8764c: 43.67 us CUPTI against 44.67 without; the last candidates below)
_PER_TOKEN_TUNE = [
    dict(FAST=False),
    dict(PREFETCH=True),
    dict(BLOCK_M=1, num_warps=1),
    dict(BLOCK_M=1, num_warps=1, PREFETCH=True),
    dict(BLOCK_M=1, num_warps=2),
    dict(BLOCK_M=1, num_warps=2, PREFETCH=True),
    dict(BLOCK_M=2, num_warps=4),
    dict(BLOCK_M=2, num_warps=4, PREFETCH=True),
    dict(BLOCK_M=4, num_warps=4),
    dict(BLOCK_M=4, num_warps=4, PREFETCH=True),
    dict(BLOCK_M=4, num_warps=8),
    dict(BLOCK_M=8, num_warps=8),
    dict(BLOCK_M=1, BLOCK_K=2048, num_warps=2),
    dict(BLOCK_M=1, BLOCK_K=2048, num_warps=4),
    dict(BLOCK_M=1, BLOCK_K=2048, num_warps=4, PREFETCH=True),
    dict(BLOCK_M=2, BLOCK_K=2048, num_warps=4),
    dict(BLOCK_M=1, BLOCK_K=512, num_warps=1),
    dict(BLOCK_M=1, BLOCK_K=512, num_warps=1, PREFETCH=True),
    dict(BLOCK_M=2, BLOCK_K=512, num_warps=2, PREFETCH=True),
    dict(BLOCK_M=4, BLOCK_K=512, num_warps=4, PREFETCH=True),
    dict(CHUNKS_PER_PROG=1),
    dict(CHUNKS_PER_PROG=1, BLOCK_M=4, num_warps=4),
    dict(CHUNKS_PER_PROG=4, BLOCK_M=1, BLOCK_K=512, num_warps=1, PREFETCH=True),
    # H200 @ fd8764c: KFAST (the grid's first dimension over the chunk groups) is the default: 43.67 us against 44.67
    # for the row-block order (KFAST=False); one-row programs of 1 warp 68.28
    dict(KFAST=False), dict(KFAST=True, CHUNKS_PER_PROG=1, BLOCK_M=1, num_warps=1),
]
# per-token with an FP4 QuantTensor input (32x32 scales) -> FP4
# H200 @ 31c87fe: the byte-permute requantization kernel (FP4_REQUANT, ``_fp4_requant.py``) is the default ([4, 512] tiles
# at 2 warps); the general kernel's candidates run with FP4_REQUANT=False.  Swept (CUPTI, us): the default 52.26-52.49,
# ROWLOOP (a program walking its rows' chunks, the next chunk's loads in flight; removed) [4] x 2 warps 53.03,
# [2] x 1 53.32, [8] x 4 54.00, [4] x 4 58.14; tiles [4, 1024] x 2 53.23, [8, 512] x 4 56.6-57.1, [16, 512] x 4
# 57.66, [4, 2048] x 2 72.48, [8, 2048] x 4 76.72; the general kernel 116.2-142.7.  Relative to the default:
_PER_TOKEN_E2M1_TUNE = [dict(FP4_REQUANT=False, **c) for c in [
    dict(FAST=False), dict(BLOCK_M=1), dict(BLOCK_M=1, num_warps=1), dict(BLOCK_M=4, num_warps=4),
]] + [dict(FP4_REQUANT=False)] + [
    # BLOCKS (the default where an input block lies in one group): the words as [rows, groups, blocks, words], the
    # block maxima and the maps once a block; False: once a word (the 52.3 us figures above).  Swept (CUPTI, us):
    # BLOCKS 40.04, [8, 512] x 2 40.32, [4, 1024] 40.44, [8, 512] x 4 43.25, [4, 512] x 4 56.06, [16, 512] x 4
    # 63.35, [2, 512] x 1 68.22, BLOCKS=False 52.26
    dict(BLOCKS=False)] + [
    # register caps (H200 @ 424cc12): the fast path alone needs 26-44 registers (sm_90a), the general path in the same
    # kernel 85 (255 at 16 words a thread), which sets the occupancy; under a cap the general path spills (rare tiles
    # only) and the fast path stays spill-free.  First sweep (CUPTI, us; the default 36.06): [8, 512] x 1 warp cap 64
    # 22.14, [4, 1024] x 2 cap 48 23.70, [8, 512] x 2 cap 40 24.17, cap 48 24.59, [16, 512] x 4 cap 48 28.96, [8,
    # 512] x 4 cap 32 29.04, [4, 512] x 2 cap 32 / 40 34.6, [2, 512] x 1 68.3
    # Second sweep (CUPTI, us; the then-default [4, 512] x 2 35.78): the words as [blocks, groups, rows, words]
    # (whole-row runs a warp, the group max in the warp), one-hot block maxima, the scale exponent in integers, the
    # maps from a table in memory: [8, 512] x 1 warp cap 80 19.21 (the new default), cap 72 19.28, [8, 512] x 2 cap
    # 48 19.33, [4, 1024] x 1 cap 80 19.35, [8, 1024] x 2 cap 80 19.37, cap 96 19.49, the maps by selects (TABLE=False)
    # 19.76, [16, 512] x 2 cap 80 20.25, [2, 2048] x 1 cap 80 21.18, [4, 512] x 1 cap 48 34.59; the first build's
    # [rows, groups, blocks, words] at [8, 512] x 1 cap 64 21.00 (22.14 before the repacking by one prmt)
    # Third sweep (the new default 19.28): [16, 512] x 2 warps 18.76, [8, 1024] x 2 19.08, [4, 1024] x 1 19.33,
    # x 2 cap 48 19.39, cap 72 19.42, TABLE=False 19.99; a persistent grid (the next tile's loads before the current
    # tile's arithmetic, the general branch not inlined; removed) 25.1-28.8 at 8-24 programs per SM.  Fourth / fifth
    # sweeps: 19.22 / 19.26 (the fifth after a 9 % instruction cut), [8, 1024] x 2 19.22 / 19.37, cap 72 19.30 / 19.33,
    # [16, 512] x 2 20.45 (18.76 in the third)
    dict(TABLE=False), dict(maxnreg=72), dict(num_warps=2, maxnreg=48), dict(BLOCK_M=4, BLOCK_K=1024),
    dict(BLOCK_M=8, BLOCK_K=1024, num_warps=2),
    # KFAST: consecutive programs on consecutive chunks of the same rows (DRAM locality).  Sixth sweep (the default
    # 19.34): KFAST 19.34, KFAST [16, 512] x 2 18.58 (without KFAST 19.99 here; 18.76 / 20.45 before: noisy, not
    # switched on one sweep), KFAST [4, 1024] x 1 19.08
    # H200 @ fd8764c: a persistent grid whose tile loop the compiler software-pipelines (cp.async into shared memory, the
    # general tiles after the loop; sm_90a: spill-free at 128 registers) lost and was removed: 27.98 us at PIPE=2, 16
    # programs an SM, 29.97-31.62 at PIPE=3 and 8-16 programs, 32.69 at [16, 512] x 2 warps (the default 19.43)
    # H200 @ fd8764c sweep (the then-default 19.40): KFAST [16, 512] x 2 18.33 (the new default), KFAST [4, 1024] x 1
    # 19.05, KFAST alone 19.33
    dict(KFAST=False, BLOCK_M=8, num_warps=1), dict(KFAST=True, BLOCK_M=8, num_warps=1),
    dict(KFAST=True, BLOCK_M=4, BLOCK_K=1024, num_warps=1), dict(KFAST=False)]
# per-token with an FP8 QuantTensor input -> FP8 / FP4.  The default (H200, CUPTI, 2026-12-02, commit be9d783, 8001 x
# 7168, 128 x 128 input blocks, packed sf): the hardware e4m3 decode (HW_DECODE) on [2, 1024] tiles at 2 warps, KFAST:
# 39.55 us (e4m3 out, 69 % of copy) and 78.26 (e2m1 out); the software decode on [1, 1024] tiles took 87.47 and 125.70
_PER_TOKEN_FP8_IN_TUNE = [
    dict(HW_DECODE=True, BLOCK_M=4, num_warps=4), dict(HW_DECODE=True, BLOCK_M=1, KFAST=False),
    dict(HW_DECODE=False), dict(BLOCK_M=2, num_warps=4),
]
# per-token bf16 / fp32 -> FP4: the default [4, 1024] x 4 warps, KFAST: 42.92 us (bf16, 39 % of copy) at 4001 x 7168
# (H200, CUPTI, 2026-12-02, commit cb0e634), issue-bound.  sm_90 SASS, instructions an element: 33.6 (bf16) and 36.1
# (fp32); PAIRS (the words loaded as the packed bytes' pairs, no relayout for the packing) 27.7 and 26.7; PAIRS with
# FINITE 38.1 and 37.4.  Not yet timed:
_PER_TOKEN_E2M1_PLAIN_TUNE = [dict(PAIRS=True), dict(PAIRS=True, PREFETCH=True),
                              dict(PAIRS=True, BLOCK_M=2, num_warps=2), dict(PAIRS=True, BLOCK_M=8, num_warps=8)]
# 128x128 bf16 -> e4m3: one block per chunk.  Default (H200 @ 65d4724): CHUNKS_PER_PROG=2, 8 warps, FAST, FINITE, WORDS (the
# raw bf16 words stay packed until a per-four-element PTX encode: unpack, multiply, two paired cvt, sign merge; no
# float32 copy of the tile), INT_SF, PREFETCH, maxnreg=80: 46.59 us CUPTI (TileKernels 47.7).  sm_90a
# (an sm_90a ptxas / SASS count; registers, instructions per element on a finite program's path, blocks of 256 threads per
# SM): the H200 @ 2615106 default 128 regs, 7.00/elem, 2 blocks (Nsight Compute: 25 % occupancy, 67.8 % of peak DRAM,
# 10 cycles per issued instruction: latency-bound); WORDS 80, 6.80, 3; WORDS + INT_SF 69, 6.86, 3; + maxnreg=64 64,
# 6.88, 4.  H200 @ 65d4724 sweep (us): H200 @ 2615106 default 48.16, WORDS 46.95, WORDS + INT_SF 50.38 (!), + maxnreg=64
# 48.21, CHUNKS_PER_PROG=1 47.28, 16 warps with one chunk 46.80, CHUNKS_PER_PROG=4 53.81 (48.55 at 64 registers),
# 16 warps with 4 chunks at 40 registers 50.18; the older candidates (FAST off, 16 warps, 1/4/7 chunks, PREFETCH at
# 16 warps, 4 warps) were all within 2 % of the H200 @ 2615106 default before
_PER_BLOCK_128_TUNE = [
    dict(WORDS=False, INT_SF=False, PREFETCH=False, maxnreg=None),  # the H200 @ 2615106 default (48.16 us)
    dict(WORDS=False, INT_SF=False, PREFETCH=False, maxnreg=None, FINITE=False),  # the 2026-11-30 default (50.1)
    dict(INT_SF=False, PREFETCH=False, maxnreg=None),  # WORDS alone (46.95)
    dict(PREFETCH=False, maxnreg=None, num_warps=16, CHUNKS_PER_PROG=1),  # 32 regs, 4 x 16 warps (46.80)
    dict(PREFETCH=False, maxnreg=None, CHUNKS_PER_PROG=1),  # 58 regs, 4 blocks (47.28)
    dict(maxnreg=None), dict(maxnreg=72), dict(maxnreg=96),
    dict(INT_SF=False), dict(CHUNKS_PER_PROG=1), dict(num_warps=16, maxnreg=None),
    # KFAST (H200 @ fd8764c): the grid's first dimension over the chunk groups (consecutive programs read whole rows'
    # runs).  scripts/steady_probe.py: 93.7 % of copy in steady state, 3.75 us fixed cost against a copy's 2.29.
    # Two sweeps (CUPTI, the then-default 46.73-46.75 us): KFAST + one block a program at 16 warps, no prefetch
    # 44.42-44.44 (the new default), KFAST alone 44.77-44.90, maxnreg=96 46.32-46.52
    dict(KFAST=False, CHUNKS_PER_PROG=2, PREFETCH=True, maxnreg=80, num_warps=8),  # the H200 @ 65d4724 default (46.7)
    dict(KFAST=True, CHUNKS_PER_PROG=2, PREFETCH=True, maxnreg=80, num_warps=8),
    dict(num_warps=8), dict(maxnreg=64),
]
# 32x32 fp32 -> e2m1 packed: default CHUNKS_PER_PROG=4 (a multiple of 4: whole UE8M0 words), 4 warps, FAST,
# PREFETCH, PAIRS (pair tiles in the packed bytes' layout), FINITE (finite chunks skip the NaN/sign patches)
_PER_BLOCK_32_TUNE = [  # default (H200 @ 2615106): WIDE, WIDE_VEC=4, 4 chunks per program, 4 warps (68.68 us CUPTI)
    dict(WIDE=False, WIDE_VEC=16),  # the H200 @ 694bd6c default (93.65 us CUPTI)
    dict(PAIRS=False, FINITE=False, num_warps=2),  # the 2026-11-30 default (93.9 us)
    dict(FAST=False, PAIRS=False, FINITE=False, num_warps=2),
    dict(FINITE=False),
    dict(num_warps=2),
    dict(PREFETCH=False),
    dict(num_warps=2, PREFETCH=False),
    dict(num_warps=1),  # the H200 @ 8b7524c default (139.5 us: half occupancy)
    dict(num_warps=8),
    dict(num_warps=4, PREFETCH=False),
    dict(CHUNKS_PER_PROG=8),
    dict(CHUNKS_PER_PROG=8, PREFETCH=False),
    dict(CHUNKS_PER_PROG=16, PREFETCH=False),
    # H200 @ 2615106 (2026-11-30) candidates (same bits; sm_90a SASS of the anchor's variant, straight-line path of a finite program,
    # instructions per element per thread / registers; the default: 25.2 / 50 regs = 9 blocks of 4 warps per SM,
    # at most 4-8 KB of loads in flight per block and three block barriers per 32x32 block).
    # INT_SF: round_sf scales from the amax bits (no div_rn, no slow-path call): 23.4 / 48
    dict(INT_SF=True),
    # WIDE: the program's 4 blocks as one [32, 64]-pair tile: one 16 KB load, one amax exchange (2 barriers per
    # program), one encode/store; WIDE_VEC 4 keeps lanes on consecutive 32-byte pieces (loads as coalesced as the
    # default's): 20.2 / 80 regs = 6 blocks x 16 KB in flight per SM
    dict(WIDE=True, WIDE_VEC=4, INT_SF=True, CHUNKS_PER_PROG=4),
    dict(WIDE=True, WIDE_VEC=4, CHUNKS_PER_PROG=4),  # 20.6 / 80
    # the compiler's own vector (16 pairs = 128 B per thread; each warp load instruction touches 32 lines): 18.1 / 77
    dict(WIDE=True, INT_SF=True, CHUNKS_PER_PROG=4),
    dict(WIDE=True, WIDE_VEC=8, INT_SF=True, CHUNKS_PER_PROG=4),  # 18.5 / 78
    dict(WIDE=True, WIDE_VEC=4, INT_SF=True, CHUNKS_PER_PROG=4, num_warps=8),  # 23.6 / 48: 5 blocks x 16 KB
    dict(WIDE=True, WIDE_VEC=4, INT_SF=True, CHUNKS_PER_PROG=8, num_warps=8),  # 20.1 / 80: 3 blocks x 32 KB
    dict(WIDE=True, WIDE_VEC=4, INT_SF=True, CHUNKS_PER_PROG=8),  # 18.3 / 206: 2 blocks x 32 KB (a bound)
    # H200 @ 65d4724: register caps on the default (80 registers: 6 warps per scheduler, 37.5 % occupancy; Nsight Compute
    # 73 % of peak DRAM, SM 75 %): 72 gives 7 warps per scheduler, 64 gives 8
    dict(maxnreg=72), dict(maxnreg=64), dict(INT_SF=True, maxnreg=64),
    # H200 @ fd8764c: KFAST (the grid's first dimension over the chunk groups) is the default: 66.75 us against 68.66
    dict(KFAST=False), dict(KFAST=True, CHUNKS_PER_PROG=8, num_warps=8),  # 68.66 / 68.17
    # H200 @ d53c6fa: WARP_BLOCKS (the wide tile held so that each warp owns whole 32x32 blocks: amax by 5 SHFL, no shared
    # memory, no barrier, 55 registers, 19.09 instructions per element against 20.56 / 80; an sm_90a SASS count
    # prints these figures) lost on the H200: 74.68 us against 68.15 (8 chunks at 8 warps 70.53, 2 warps 75.38,
    # WIDE_VEC 16 116.53, STREAM 83.37); a 32x32 block's FP4 row is 16 bytes, half a 32-byte sector, and with the
    # warps on the blocks every store instruction writes half sectors (the lossless SFW lesson).  Removed.
]
# per-token e4m3 -> bf16: default (H200 @ bc6f44a) BLOCK_M=1, BLOCK_K=8192, CHUNKS_PER_PROG=1 (the whole row), 16 warps,
# hardware e4m3 decode, VEC=8 (loads in the stores' layout).  H200 @ bc6f44a sweep (CUPTI, L2 flushed, us; TileKernels
# 44.07): this default 43.19; the old default (BLOCK_K=2048 x 4 chunks at 8 warps, PREFETCH: the next chunk's loads
# first) 44.07, with VEC=0 43.98, 8192 x 1 at 8 warps 44.38, 4096 x 2 at 8 warps 44.10, 4 warps 44.90, 2 warps 44.99,
# PREFETCH=False 45.00, STREAM (evict-first loads, .cs stores) 45.28, CHUNKS_PER_PROG=2 45.21, 1024 x 7 at 4 warps
# 45.16; lost by 4 % or more and dropped: 1024 x 7 at 2 warps, [2, 1024] x 7, [4, 1024] x 7, STREAM at 4 warps,
# 1024 x 8 STREAM (the STREAM switch has since left the kernel).  HW_DECODE=False (69.8) stays as the software
# decode's bit check.
_CB_OLD = dict(BLOCK_K=2048, CHUNKS_PER_PROG=4, num_warps=8)
_CAST_BACK_TUNE = [
    dict(num_warps=32), dict(VEC=0), dict(num_warps=8), dict(BLOCK_M=2, num_warps=32),
    dict(BLOCK_K=4096, CHUNKS_PER_PROG=2, num_warps=16), dict(HW_DECODE=False),
    _CB_OLD, dict(_CB_OLD, VEC=0), dict(_CB_OLD, PREFETCH=False),
]

# One scale a row (npc = hidden): the default whole-block path with a chunk-wide scale block (cast_back_kernel's
# ROW_BLOCK), against a scale load per element
_CAST_BACK_ROW_TUNE = [dict(ROW_BLOCK=False)]


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (in_dtype, fmt, npc, x_block_size) -> the tuning candidates of that anchor case (at the anchor shape)
_PER_TOKEN_TUNES = {("bf16", "e4m3", 128, None): _PER_TOKEN_TUNE,
                    ("e2m1", "e2m1", 128, (32, 32)): _PER_TOKEN_E2M1_TUNE,
                    **{("e4m3", fmt, 128, xbs): _PER_TOKEN_FP8_IN_TUNE for fmt in ("e4m3", "e2m1")
                       for xbs in ((128, 128), (32, 32))},
                    **{(d, "e2m1", 128, None): _PER_TOKEN_E2M1_PLAIN_TUNE for d in ("bf16", "fp32")}}


def _per_token_case(device, x, in_dtype, fmt, npc, xbs, m, k, anchored=True):
    """A packed-sf ``per_token_cast`` case: ``x`` plain (``in_dtype`` fp32 / bf16) or a QuantTensor of ``in_dtype``
    e4m3 / e2m1 in ``xbs`` blocks."""
    from tritile.torch.cast import cast

    col, rnd, packed = _PACKED
    out = per_token_cast(x, fmt, npc, xbs, col, rnd, packed)
    tk = dict(fmt=fmt, hidden=k, in_dtype=in_dtype, num_per_channels=npc, num_tokens=m,
              x_block_size=list(xbs) if xbs else None,
              **_grid.sf_flags(_PACKED))
    key = (in_dtype, fmt, npc, xbs)
    return Case(params=dict(num_tokens=m, hidden=k, in_dtype=in_dtype, fmt=fmt, npc=npc,
                            **({"x_block_size": xbs} if xbs else {}), packed=True),
                impl=op("quant.per_token_cast", x, fmt, npc, xbs, col, rnd, packed),
                ref=lambda a=(x, fmt, npc, xbs): cast(a[0], a[1], (1, a[2]), x_block_size=a[3], round_sf=rnd,
                                                      use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed),
                check=_check_cast, nbytes=count_bytes(x, out),
                anchor=_anchor(device, "per_token_cast", **tk) if anchored else None,
                tune=_tune(device, "per_token_cast", _PER_TOKEN_TUNES[key])
                if (m, k) == _shape(device) and key in _PER_TOKEN_TUNES else None)


@register(_M, "per_token_cast")
def _per_token_cases(device, quick, grid=False):
    """The two anchors (bf16 -> e4m3 and FP4 32x32 -> FP4, npc 128), or TileKernels' grid: tokens x hidden x in_dtype
    (fp32 / bf16 at npc 32 / 64 / 128 / K; e4m3 / FP4 QuantTensors in 128x128 / 32x32 blocks at npc 32 / 128) x fmt
    e4m3 / e2m1, packed col-major sf only (the benchmark's filter)."""
    from tritile.torch.cast import cast

    if _grid.on(quick, grid):
        yield from _per_token_grid(device)
        return
    m, k = _shape(device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    col, rnd, packed = _PACKED
    yield _per_token_case(device, x, "bf16", "e4m3", 128, None, m, k)
    # FP4 QuantTensor input (32x32 packed UE8M0 scales) -> FP4 per-token packed
    qx = cast(x, "e2m1", (32, 32), round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    yield _per_token_case(device, qx, "e2m1", "e2m1", 128, (32, 32), m, k)
    if quick:
        return
    # not anchored: bf16 -> FP4 packed, and one group per row (npc == K)
    for fmt, npc in (("e2m1", 128), ("e4m3", k)):
        yield _per_token_case(device, x, "bf16", fmt, npc, None, m, k, anchored=False)


def _per_token_grid(device):
    from tritile.torch.cast import cast

    col, rnd, packed = _PACKED
    for m, k in _grid.shapes(device):
        for in_dtype in ("fp32", "bf16", "e4m3", "e2m1"):
            if in_dtype in _DTYPES:
                inputs = [(torch.randn(m, k, device=device, dtype=_DTYPES[in_dtype]), None)]
                npcs = (32, 64, 128, k)
            else:  # TileKernels' FP8 / FP4 inputs: its reference cast of a bf16 randn, in the same sf config
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                inputs = [(cast(x, in_dtype, xbs, round_sf=rnd, use_tma_aligned_col_major_sf=col,
                                use_packed_ue8m0=packed), xbs) for xbs in ((128, 128), (32, 32))]
                npcs = (32, 128)
            for npc in npcs:
                for xin, xbs in inputs:
                    for fmt in ("e4m3", "e2m1"):
                        yield _per_token_case(device, xin, in_dtype, fmt, npc, xbs, m, k)


# (block, fmt, in_dtype, config) -> the tuning candidates of that anchor case (at the anchor shape)
_PER_BLOCK_TUNES = {((128, 128), "e4m3", "bf16", _ROUND): _PER_BLOCK_128_TUNE,
                    ((32, 32), "e2m1", "fp32", _PACKED): _PER_BLOCK_32_TUNE}


def _per_block_case(device, x, dname, fmt, block, config, m, k):
    from tritile.torch.cast import cast

    col, rnd, packed = config
    out = per_block_cast(x, fmt, block, col, rnd, packed)
    key = (block, fmt, dname, config)
    return Case(params=dict(num_tokens=m, hidden=k, in_dtype=dname, fmt=fmt, block=block, packed=packed),
                impl=op("quant.per_block_cast", x, fmt, block, col, rnd, packed),
                ref=lambda a=(x, fmt, block): cast(*a, round_sf=rnd, use_tma_aligned_col_major_sf=col,
                                                   use_packed_ue8m0=packed),
                check=_check_cast, nbytes=count_bytes(x, out),
                anchor=_anchor(device, "per_block_cast", block_size=list(block), fmt=fmt, hidden=k, in_dtype=dname,
                               num_tokens=m, **_grid.sf_flags(config)),
                tune=_tune(device, "per_block_cast", _PER_BLOCK_TUNES[key])
                if (m, k) == _shape(device) and key in _PER_BLOCK_TUNES else None)


@register(_M, "per_block_cast")
def _per_block_cases(device, quick, grid=False):
    """The two anchors (bf16 128x128 e4m3, fp32 32x32 packed FP4), or TileKernels' whole grid: tokens x hidden x
    in_dtype bf16 / fp32 x fmt e4m3 / e2m1 x both sf configs x blocks 128x128 / 32x32."""
    if _grid.on(quick, grid):
        for m, k in _grid.shapes(device):
            for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                x = torch.randn(m, k, device=device, dtype=dtype)
                for fmt in ("e4m3", "e2m1"):
                    for config in _grid.CONFIGS:
                        for block in ((128, 128), (32, 32)):
                            yield _per_block_case(device, x, dname, fmt, block, config, m, k)
        return
    m, k = _shape(device)
    cases = [((128, 128), "e4m3", "bf16", _ROUND), ((32, 32), "e2m1", "fp32", _PACKED)]
    for block, fmt, dname, config in cases[:1] if quick else cases:
        x = torch.randn(m, k, device=device, dtype=_DTYPES[dname])
        yield _per_block_case(device, x, dname, fmt, block, config, m, k)


def _cast_back_token_case(device, q, fmt, npc, out_dtype, config, m, k, anchored=True):
    """``per_token_cast_back(q, out_dtype, npc)`` of a QuantTensor ``q`` (``fmt``, sf in ``config``)."""
    from tritile.torch.cast import cast_back as cast_back_ref

    back = per_token_cast_back(q, out_dtype, npc)
    return Case(params=dict(num_tokens=m, hidden=k, fmt=fmt, npc=npc, out=out_dtype,
                            **({"packed": True} if config[2] else {})),
                impl=op("quant.per_token_cast_back", q, out_dtype, npc),
                ref=lambda a=(q, out_dtype, (1, npc)): cast_back_ref(*a),
                check=assert_equal, nbytes=count_bytes(back, q),
                anchor=_anchor(device, "cast_back_per_token", fmt=fmt, hidden=k, num_per_channels=npc, num_tokens=m,
                               out_dtype=out_dtype, **_grid.sf_flags(config)) if anchored else None,
                tune=_tune(device, "cast_back", _CAST_BACK_TUNE)
                if anchored and (m, k, fmt, npc, out_dtype, config) == (*_shape(device), "e4m3", 128, "bf16", _ROUND)
                else _tune(device, "cast_back", _CAST_BACK_ROW_TUNE) if npc == k else None)


def _cast_back_block_case(device, q, block, out_dtype, rnd, m, k, anchored=True):
    """``cast_back(q, out_dtype, block)`` of an e4m3 QuantTensor ``q`` in row-major float32 ``block`` scales."""
    from tritile.torch.cast import cast_back as cast_back_ref

    back = cast_back(q, out_dtype, block)
    return Case(params=dict(num_tokens=m, hidden=k, fmt="e4m3", block=block, out=out_dtype,
                            **({"round_sf": True} if rnd else {})),
                impl=op("quant.cast_back", q, out_dtype, block), ref=lambda a=(q, out_dtype, block): cast_back_ref(*a),
                check=assert_equal, nbytes=count_bytes(back, q),
                anchor=_anchor(device, "cast_back", fmt="e4m3", hidden=k, num_per_channels=block[1],
                               num_per_tokens=block[0], num_tokens=m, out_dtype=out_dtype, round_sf=rnd)
                if anchored else None)


@register(_M, "per_token_cast_back")
def _cast_back_per_token_cases(device, quick, grid=False):
    """The anchor (e4m3 per-token -> bf16; plus FP4 packed -> bf16 and 128x128 blocks -> fp32), or TileKernels' grid
    of its two cast-back benchmarks: per-token (fmt e2m1 / e4m3 x both sf configs x npc 128 / K x out fp32 / bf16)
    and blocks (round_sf x out bf16 / fp32 x 128x1 / 128x128 e4m3 blocks), each over tokens x hidden."""
    from tritile.torch.cast import cast

    if _grid.on(quick, grid):
        yield from _cast_back_grid(device)
        return
    m, k = _shape(device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    q = cast(x, "e4m3", (1, 128), round_sf=True)
    yield _cast_back_token_case(device, q, "e4m3", 128, "bf16", _ROUND, m, k)
    if quick:
        return
    # not anchored: FP4 packed per-token -> bf16, and 128x128 e4m3 blocks -> fp32
    q4 = cast(x, "e2m1", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    yield _cast_back_token_case(device, q4, "e2m1", 32, "bf16", _PACKED, m, k, anchored=False)
    qb = cast(x, "e4m3", (128, 128))
    yield _cast_back_block_case(device, qb, (128, 128), "fp32", False, m, k, anchored=False)


def _cast_back_grid(device):
    from tritile.torch.cast import cast

    for m, k in _grid.shapes(device):
        xs = {name: torch.randn(m, k, device=device, dtype=dtype) for name, dtype in _DTYPES.items()}
        for fmt in ("e2m1", "e4m3"):
            for config in _grid.CONFIGS:
                col, rnd, packed = config
                for npc in (128, k):
                    for out_dtype in ("fp32", "bf16"):  # the input in the output's dtype, as TileKernels draws it
                        q = cast(xs[out_dtype], fmt, (1, npc), round_sf=rnd, use_tma_aligned_col_major_sf=col,
                                 use_packed_ue8m0=packed)
                        yield _cast_back_token_case(device, q, fmt, npc, out_dtype, config, m, k)
    for m, k in _grid.shapes(device):
        xs = {name: torch.randn(m, k, device=device, dtype=dtype) for name, dtype in _DTYPES.items()}
        for rnd in (False, True):
            for out_dtype in ("bf16", "fp32"):
                for block in ((128, 1), (128, 128)):
                    q = cast(xs[out_dtype], "e4m3", block, round_sf=rnd)
                    yield _cast_back_block_case(device, q, block, out_dtype, rnd, m, k)


# ------------------------------------------------------------------------------- E5M6 casts, lossless FP4 -> FP8

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
_TUNE_CAST_BACK_E5M6 = [
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


def _check_dense_pair(out, ref):
    assert_equal(out[0], ref[0])
    assert_equal(out[1].clone(memory_format=torch.contiguous_format),
                 ref[1].clone(memory_format=torch.contiguous_format))


_E5M6_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _e5m6_case(device, kernel, m, k, config, dtype, impl, ref, check, nbytes, tune):
    """A case of an E5M6 op (one group per row) in sf ``config``; ``dtype``: ``{"in_dtype" | "out_dtype": name}``."""
    col, rnd, packed = config
    return Case(params=dict(num_tokens=m, hidden=k, **dtype, col=col, round_sf=rnd, packed=packed),
                impl=impl, ref=ref, check=check, nbytes=nbytes,
                anchor=(kernel, dict(hidden=k, num_per_channels=k, num_tokens=m, **dtype, **_grid.sf_flags(config))),
                tune=(kernel, tune) if tune is not None and device.type == "cuda" and (m, k) == _shape(device)
                else None)


@register(_M, "per_token_cast_to_e5m6")
def _e5m6_cases(device, quick, grid=False):
    """bf16 at the anchor shape in both sf configs, or TileKernels' grid: tokens x hidden x both configs x in_dtype
    bf16 / fp32 (its randn input; the special-value inputs are not benchmarked)."""
    from tritile.torch.cast_e5m6 import cast_to_e5m6

    if _grid.on(quick, grid):
        todo = [(m, k, d, _CONFIGS) for m, k in _grid.shapes(device) for d in _E5M6_DTYPES]
    else:
        todo = [(*_shape(device), "bf16", _CONFIGS[:1] if quick else _CONFIGS)]
    for m, k, dname, configs in todo:
        x = torch.randn(m, k, device=device, dtype=_E5M6_DTYPES[dname])
        for config in configs:
            out = per_token_cast_to_e5m6(x, k, *config)
            yield _e5m6_case(device, "per_token_cast_to_e5m6", m, k, config, {"in_dtype": dname},
                             impl=op("quant.per_token_cast", x, "e5m6", k, None, *config),
                             ref=lambda c=config, x=x, k=k: cast_to_e5m6(x, k, *c), check=_check_dense_pair,
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
        xs = {f: torch.randn(m, k, device=device, dtype=_E5M6_DTYPES[f]) if own_dtype else x for f in fmts}
        for config in configs:
            for fmt in fmts:
                q = cast_to_e5m6(xs[fmt], k, *config)
                back = cast_back_e5m6(q, fmt, (1, k))
                yield _e5m6_case(device, "cast_back_e5m6", m, k, config, {"out_dtype": fmt},
                                 impl=op("quant.cast_back", q, fmt, (1, k), x_special_fmt="e5m6"),
                                 ref=lambda q=q, fmt=fmt, k=k: cast_back_from_e5m6(q, fmt, (1, k)),
                                 check=assert_equal,
                                 nbytes=count_bytes(q, back), tune=_TUNE_CAST_BACK_E5M6)


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
            impl=op("quant.per_block_cast_lossless", x_fp4, "e4m3", in_block, ob, *out_flags),
            # the reference is the dequantized input (its time is a dequant, not a re-quantization)
            ref=lambda x_fp4=x_fp4: cast_back(x_fp4, "fp32", in_block),
            check=check, nbytes=count_bytes(x_fp4, out),
            anchor=("per_block_cast_lossless", dict(
                hidden=k, in_sf_block=list(in_block), num_tokens=m, out_sf_block=list(ob),
                **_grid.sf_flags(in_flags, "in_"), **_grid.sf_flags(out_flags, "out_"))),
            tune=("per_block_cast_lossless", _TUNE_LOSSLESS[ob])
            if device.type == "cuda" and (m, k) == _shape(device) else None)


# --------------------------------------------------------------------------------------------- per-channel casts

# Tuning sweeps (``python -m tritile tune --op OP``), GPU anchor cases only.  Plain per-channel cast, 128-row
# blocks: BLOCK_K columns per program, ROWS_PER_STEP (128: the block in registers, one read; else two
# streamed passes), warps, FINITE_BRANCH (skip the NaN patch of finite tiles), VEC (columns per thread; 0 =
# Triton's choice).
# Default (no input sf, H200 @ 65d4724): WORDS + HMUL_ENC on the one-pass [128, 128] x 4 warps tile (INT_POW2): 25.22 /
# 25.06 us CUPTI (round_sf off / on; per_channel_cast_fused 25.17) against 26.52 / 26.39 for the H200 @ 2615106 default
# (the element kernel, the first candidate).  WORDS (``_per_channel_cast_words_kernel``, same bits): the block as int32
# words of two bf16; sm_90a at [128, 128] x 4 warps (registers, SASS instructions per element, round_sf off / on;
# an sm_90a ptxas / SASS count): element kernel 127 / 128, 9.82 / 8.48 (4 blocks per SM); WORDS 94 / 106, 8.24 /
# 6.41; WORDS + HMUL_ENC 94 / 96, 8.24 / 5.97 (5 blocks per SM).  H200 @ 65d4724 sweep (us, round_sf off / on): WORDS
# alone 25.22 / 25.46, + maxnreg=88 25.67 / 25.93, BLOCK_K=64 26.21 / 25.98, 8 warps 25.98 / 26.00; maxnreg=80
# spilled (25.1 / 23.7 us graph against 22.7 / 22.3).  The element kernel's knobs: BLOCK_K (columns), ROWS_PER_STEP
# (128 one pass; 16-64 two streamed passes), warps, FINITE_BRANCH, VEC, SIGNED_ENC (the NaN patch as a byte merge
# per four codes; sm_90 [128, 64] x 4 warps: 18.0 -> 11.2 instructions per element), INT_POW2 (round_sf scales
# from amax's bits).
_EL = dict(WORDS=False, HMUL_ENC=False)
_TUNE_CHANNEL = [
    dict(_EL),  # the H200 @ 2615106 default (26.52 / 26.39 us)
    dict(_EL, SIGNED_ENC=0, INT_POW2=False, BLOCK_K=64),  # the H200 @ 8b7524c default (30.1-30.8 us graph)
    dict(_EL, BLOCK_K=64),  # the first H200 @ 694bd6c default (27.0-27.1 us CUPTI)
    dict(_EL, BLOCK_K=128, ROWS_PER_STEP=32), dict(_EL, BLOCK_K=64, num_warps=8),
    dict(HMUL_ENC=False), dict(maxnreg=88), dict(BLOCK_K=64), dict(num_warps=8), dict(BLOCK_K=256, num_warps=8),
    # H200 @ bc6f44a candidates on the WORDS kernel (same bits; sm_90a at the anchor, an sm_90a ptxas / SASS count: registers,
    # SASS instructions per element, round_sf off / on; the default 94 / 96, 8.24 / 5.97, 5 blocks per SM):
    # STATIC_STRIDES (the row strides as constexprs: one base register plus immediate offsets per row, no 64-bit
    # address arithmetic per load / store; one compile per stride) 95 / 94, 7.22 / 4.96; FAST_DIV (round_sf off: the
    # two IEEE divisions of each column's scales on a's mantissa, the fast path of div.rn without its range check and
    # slow-path call) 96, 7.05; both 96 / 94, 6.05 / 4.96; with maxnreg=80 (6 blocks per SM) 80 / 80, 6.24 / 5.01, a
    # 32-byte / no spill; BLOCK_K=64 56 / 48 registers (9 / 10 blocks of 4 warps per SM), 8.03 / 6.36; 8 warps
    # 57 / 57, 8.16 / 6.48.  H200 @ bc6f44a sweep (CUPTI, round_sf off, per_channel_cast / _fused): both 24.99 / 24.96 us
    # (the new default), STATIC_STRIDES 25.03 / 25.12, FAST_DIV 25.12 / 25.10, neither (the H200 @ 65d4724 default) 25.28 /
    # 25.28, HMUL_ENC=False 25.09 / 25.22, maxnreg=88 25.61 / 25.80
    dict(STATIC_STRIDES=False, FAST_DIV=False), dict(STATIC_STRIDES=False), dict(FAST_DIV=False),
    dict(maxnreg=80),
    # H200 @ 4d49e57: KFAST on the WORDS kernel (the grid's first dimension over the column blocks; it took four casts -2
    # to -5 % in H200 @ fd8764c).  First sweep (CUPTI, per_channel_cast / _fused, the default 25.03 / 24.93 us): KFAST
    # 23.89 / 24.13, with BLOCK_K=64 24.63 / 24.69
    dict(KFAST=True), dict(KFAST=True, BLOCK_K=64), dict(KFAST=True, BLOCK_K=256, num_warps=8),
    dict(KFAST=True, num_warps=8), dict(KFAST=True, maxnreg=80), dict(KFAST=False),
]
# per_channel_cast_and_transpose.  Defaults (H200 sweeps, 2026-11-30 and H200 @ 694bd6c): npt 128: [128, 64] x 4 warps
# (KFAST since H200 @ 4d49e57), npt 32: [32, 128] x 2 warps; SIGNED_ENC=2; VEC=8, PERM (each thread's rows are consecutive
# tokens: words packed in registers), FINITE_BRANCH off, words.  The first candidate of each list is the first version
# (npt 128: 121.2 us).
_TUNE_TRANSPOSE = {
    128: [dict(BLOCK_K=32, num_warps=2, SIGNED_ENC=0),  # the H200 @ 8b7524c default (57.9-58.6 us)
          dict(BLOCK_K=64, num_warps=8, VEC=0, PERM=False, SIGNED_ENC=0), dict(BLOCK_K=32, num_warps=2),
          dict(FINITE_BRANCH=True), dict(maxnreg=96, FINITE_BRANCH=True), dict(BLOCK_K=16, num_warps=1),
          dict(BLOCK_K=64, num_warps=2), dict(num_warps=4), dict(num_stages=1), dict(PERM=False),
          # SIGNED_ENC (same bits; sm90 hot path per element: default 19.8 instructions / 96 registers,
          # SIGNED_ENC=2 14.0 / 66)
          dict(SIGNED_ENC=2), dict(SIGNED_ENC=1), dict(SIGNED_ENC=2, BLOCK_K=64, num_warps=4),
          dict(SIGNED_ENC=2, BLOCK_K=16, num_warps=1), dict(SIGNED_ENC=2, BLOCK_K=64, num_warps=2),
          dict(SIGNED_ENC=2, INT_POW2=True),
         # H200 @ fd8764c: KFAST (the grid's first dimension over the column blocks; the default since H200 @ 4d49e57) and a
         # register cap (95 -> 80: 6 blocks an SM instead of 5).  scripts/steady_probe.py: 95.2 % of copy in steady
         # state, 4.22 us fixed cost against a copy's 2.50.  Two sweeps (CUPTI, the default 47.05 / 47.07 us): KFAST
         # 46.94 / 46.87 (within the spread: not switched then), maxnreg=80 47.06 / 47.11, both 47.89 / 47.92
         dict(KFAST=False), dict(maxnreg=80), dict(KFAST=True, maxnreg=80),
         # H200 @ 4d49e57: a third sweep, KFAST 46.87 against 47.75, made it the default at npt 128 (KFAST=False above
         # is the old order).  Its fixed cost (4.46 us against a copy's 2.86, steady_probe) is the tail of ~4 us
         # programs; shorter programs and fewer elements a thread lost (KFAST, us): [128, 32] x 2 warps 51.59, x 1
         # warp 51.21 (64-byte row reads), [128, 64] x 8 warps 63.42 (59.79 without KFAST), [128, 128] x 8 warps
         # 56.22 (56.98); removed
         ],
    32: [dict(SIGNED_ENC=0),  # the H200 @ 8b7524c default (57.5-59.1 us)
         dict(BLOCK_K=128, num_warps=4, VEC=0, PERM=False), dict(BLOCK_K=256, num_warps=4),
         dict(BLOCK_K=64, num_warps=1), dict(BLOCK_K=256, num_warps=2), dict(FINITE_BRANCH=True),
         dict(BLOCK_K=64, num_warps=2), dict(num_stages=1), dict(PERM=False),
         dict(SIGNED_ENC=2), dict(SIGNED_ENC=2, BLOCK_K=64, num_warps=1), dict(SIGNED_ENC=2, BLOCK_K=256, num_warps=4),
         dict(SIGNED_ENC=2, INT_POW2=True),
         # H200 @ 4d49e57: KFAST (the npt-128 default since then) lost here (CUPTI, round_sf off / on): 49.36 / 49.37 us
         # against 48.53-48.71 / 48.72-48.79; at npt 128 in the same sweep 46.99 / 47.07 against 47.56 / 47.52
         dict(KFAST=True)],
}


def _check_pair(out, ref):
    assert_equal(out[0], ref[0])
    assert_equal(out[1], ref[1])


def _ref_fused(x, round_sf, npc=None, pos=None):
    from tritile.torch.per_channel_cast_fused import per_channel_cast_fused as ref

    return ref(x, 128, npc, round_sf, pos)


def _plain_shape(device, m, k, kernel, npts, rnds, ref, npt_key, show_npt, tunes):
    """One bf16 ``(m, k)`` input's cases of a plain per-channel cast, one per ``(npt, round_sf)``: the public op
    ``kernel(x, 'e4m3', npt, rnd)`` and ``ref(x, npt, rnd)``; TileKernels names npt ``npt_key`` in the kernel's
    record; ``tunes`` maps ``(m, k, npt)`` to the tuning candidates there."""
    gpu = device.type == "cuda"
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    for npt in npts:
        for rnd in rnds:
            impl = op(f"quant.{kernel}", x, "e4m3", npt, rnd)
            fn = impl(TRITILE)
            out = fn()
            params = dict(num_tokens=m, hidden=k, dtype="bf16", **({"num_per_tokens": npt} if show_npt else {}),
                          round_sf=rnd)
            yield Case(params=params, fn=fn, impl=impl, ref=lambda a=(x, npt, rnd): ref(*a),
                       check=_check_pair, nbytes=count_bytes(x, out),
                       anchor=(kernel, {"dtype": "bf16", "hidden": k, npt_key: npt, "num_tokens": m, "round_sf": rnd})
                       if gpu else None,
                       tune=(kernel, tunes[m, k, npt]) if gpu and (m, k, npt) in tunes else None)
            del out


def _plain_shapes(device, quick, grid, default):
    """TileKernels' benchmark grid of the plain per-channel casts (``generate_num_tokens(128)`` x
    ``generate_hidden_sizes()``), else the anchor shape ``default`` (GPU, CPU)."""
    return _grid.shapes(device, 128) if _grid.on(quick, grid) else [default[device.type != "cuda"]]


@register(_M, "per_channel_cast")
def _per_channel_cast_cases(device, quick, grid=False):
    """The anchor shape (round_sf off / on), or TileKernels' grid: M 4096 / 8064 x its 7 hidden sizes x round_sf."""
    for m, k in _plain_shapes(device, quick, grid, ((4096, 7168), (256, 576))):
        yield from _plain_shape(device, m, k, "per_channel_cast", npts=(128,),
                                rnds=(False,) if quick else (False, True),
                                ref=lambda x, npt, rnd: _ref_fused(x, rnd), npt_key="num_per_tokens", show_npt=False,
                                tunes={(4096, 7168, 128): _TUNE_CHANNEL})


#: The fused cast's anchor (TileKernels' record): a plain 4096 x 7168 input, no map.
_FUSED_ANCHOR = dict(hidden=7168, is_fused_cast_back=False, num_ep_ranks=0, num_experts=0, num_per_channels=128,
                     num_per_tokens=128, num_tokens=4096, num_topk=0, round_sf=False)


# A QuantTensor input (is_fused_cast_back): the default is the hardware e4m3 decode (HW_DECODE, same bits) in 64-row
# steps of [128, 128] blocks: 32.44 us at 4096 x 7168 on the H200 (CUPTI, 2026-12-02, commit be9d783), against 81.52
# for the software decode in 32-row steps.  sm_90 SASS of the [128, 128] x 4 warps program, 32-row steps: 2296 ->
# 1120 static instructions with HW_DECODE.
_TUNE_CAST_BACK = [
    dict(ROWS_PER_STEP=32), dict(ROWS_PER_STEP=16), dict(HW_DECODE=False, ROWS_PER_STEP=32),
    dict(ROWS_PER_STEP=128, num_warps=8), dict(FINITE_BRANCH=False), dict(BLOCK_K=256, num_warps=8),
]


def _fused_case(inp, rnd, npc, pos, params, anchor=None, tune=None):
    """A case of ``per_channel_cast_fused(inp, 'e4m3', 128, rnd, npc, pos)`` against the reference."""
    out = per_channel_cast_fused(inp, "e4m3", 128, rnd, npc, pos)
    case = Case(params=params, impl=op("quant.per_channel_cast_fused", inp, "e4m3", 128, rnd, npc, pos),
                ref=lambda a=(inp, rnd, npc, pos): _ref_fused(*a), check=_check_pair, nbytes=count_bytes(inp, pos, out),
                anchor=anchor, tune=tune)
    del out
    return case


@register(_M, "per_channel_cast_fused")
def _per_channel_cast_fused_cases(device, quick, grid=False):
    """The anchor (plain 4096 x 7168) plus a gathered bf16 and a gathered FP8 input, or TileKernels' grid."""
    if _grid.on(quick, grid):
        yield from _fused_grid(device)
        return
    gpu = device.type == "cuda"
    n, k = (4096, 7168) if gpu else (256, 512)
    g = torch.Generator(device=device)
    g.manual_seed(0)
    x = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    # anchor: plain input, no map
    yield _fused_case(x, False, None, None,
                      dict(num_tokens=n, hidden=k, fused_cast_back=False, gather=False, round_sf=False),
                      anchor=("per_channel_cast_fused", _FUSED_ANCHOR) if gpu else None,
                      tune=("per_channel_cast_fused", _TUNE_CHANNEL) if gpu else None)
    if quick:
        return
    # FP8 input with per-token (1 x 128) scales, gathered through a map with ~10% padding rows
    amax = x.float().reshape(n, k // 128, 128).abs().amax(dim=2).clamp_min(1e-4)
    sf_in = amax / torch.full_like(amax, 448.0)
    q = (x.float() / sf_in.repeat_interleave(128, dim=1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    xq = (q, sf_in)
    mo = 2 * n
    pos = torch.randint(0, n, (mo,), device=device, generator=g, dtype=torch.int32)
    pos[torch.rand(mo, device=device, generator=g) < 0.1] = -1
    for inp, npc, name in ((x, None, False), (xq, 128, True)):
        yield _fused_case(inp, False, npc, pos,
                          dict(num_tokens=mo, hidden=k, fused_cast_back=name, gather=True, round_sf=False),
                          tune=("per_channel_cast_fused", _TUNE_CAST_BACK) if gpu and name else None)


def _fused_grid(device):
    """TileKernels' benchmark grid of the fused cast: a plain 4096-row input (no map) and the routing points of
    ``num_topk`` 6 (x ``expand_to_fused`` of ``randn``, the map ``get_fused_mapping(topk_idx, E, 0, 128)``'s
    ``pos_to_token``), x ``generate_hidden_sizes(128)`` x fused cast-back (x replaced by TileKernels'
    ``per_token_cast(x, 'e4m3', 128)``) x round_sf."""
    from tritile.torch.cast import cast

    gpu = device.type == "cuda"
    points = [(4096 if gpu else 128, 0, 0, 0)] + list(_grid.moe_points(device, "per_channel_cast_fused", topk=(6,)))
    for T, K, E, ep in points:
        for k in _grid.hidden_sizes(device, 128):
            if K:
                x, _, pos, _, _ = _grid.moe_inputs(device, T, K, E, ep, k, 128)
            else:
                x, pos = torch.randn(T, k, device=device, dtype=torch.bfloat16), None
            xq = cast(x, "e4m3", (1, 128))  # row-major float32 scales, not powers of two
            for fused, inp in ((False, x), (True, xq)):
                for rnd in (False, True):
                    tk = dict(num_tokens=T, num_topk=K, num_experts=E, num_ep_ranks=ep, hidden=k, num_per_tokens=128,
                              num_per_channels=128, is_fused_cast_back=fused, round_sf=rnd)
                    tune = None
                    if gpu and tk == _FUSED_ANCHOR:
                        tune = ("per_channel_cast_fused", _TUNE_CHANNEL)
                    elif gpu and fused and not K:
                        tune = ("per_channel_cast_fused", _TUNE_CAST_BACK)
                    yield _fused_case(inp, rnd, 128 if fused else None, pos, dict(tk, num_rows=x.shape[0]),
                                      anchor=("per_channel_cast_fused", tk) if gpu else None, tune=tune)


@register(_M, "per_channel_cast_and_transpose")
def _per_channel_cast_and_transpose_cases(device, quick, grid=False):
    """The anchor shape (npt 128 / 32 x round_sf), or TileKernels' grid: M 4096 / 8064 x its 7 hidden sizes x npt
    128 / 32 x round_sf."""
    from tritile.torch.per_channel_cast_fused import per_channel_cast_values

    def ref(x, npt, rnd):
        o, s = per_channel_cast_values(x.float(), npt, rnd)
        return o.T.contiguous(), s

    for m, k in _plain_shapes(device, quick, grid, ((8064, 7168), (256, 576))):
        yield from _plain_shape(device, m, k, "per_channel_cast_and_transpose", npts=(128,) if quick else (128, 32),
                                rnds=(False,) if quick else (False, True),
                                ref=ref,
                                npt_key="num_per_channels", show_npt=True,
                                tunes={(8064, 7168, npt): _TUNE_TRANSPOSE[npt] for npt in (128, 32)})


# -------------------------------------------------------------------------------------------- fused SwiGLU casts

def _moe(device, num_tokens, num_topk, num_experts, num_ep_ranks, hidden, alignment):
    """``(x (rows, 2 * hidden) bf16, pos_to_expert, pos_to_token_topk, token_topk_to_pos)`` of a routing point, the
    map aligned to ``alignment`` (:func:`tritile.bench.cases._quant_grid.moe_inputs`)."""
    x, p2e, _, p2tk, tk2p = _grid.moe_inputs(device, num_tokens, num_topk, num_experts, num_ep_ranks, 2 * hidden,
                                             alignment)
    return x, p2e, p2tk, tk2p


@register(_M, "swiglu_forward_and_per_token_cast")
def _fwd_cases(device, quick, grid=False):
    """The anchor (K = 9, E = 4, ep = 64, H = 3584, clamp 0.5), or TileKernels' grid: its 12 routing points x
    H in {1024, ..., 3584} x pos_to_expert on / off x clamp None / 0.5, npc 128, packed col-major sf, no weights
    (the benchmark keeps the column-major round_sf configs, and packed sf excludes weights)."""
    if not _grid.on(quick, grid):
        T, K, E, ep, H = (36077, 9, 4, 64, 3584) if device.type == "cuda" else (37, 9, 4, 64, 256)
        yield from _fwd_point(device, T, K, E, ep, [H], [(False, 0.5)])
        return
    for T, K, E, ep in _grid.moe_points(device, "swiglu_forward_and_per_token_cast"):
        # CPU: H = 256, two 128-groups (H = 128, one group, stops the packed-sf kernel's pack_ue8m0_words reshape
        # under the interpreter)
        yield from _fwd_point(device, T, K, E, ep, [h // 2 for h in _grid.hidden_sizes(device, 256, cpu=(512,))],
                              [(p2e, clamp) for p2e in (True, False) for clamp in (None, 0.5)])


def _fwd_point(device, T, K, E, ep, hiddens, variants):
    """One routing point's cases: per hidden size in ``hiddens``, one per ``(enable_pos_to_expert, clamp)`` of
    ``variants`` (the tuning sweep at the anchor's parameters)."""
    from tritile.torch import cast, swiglu_forward

    gpu = device.type == "cuda"
    kw = dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    for H in hiddens:
        x, p2e, _, _ = _moe(device, T, K, E, ep, H, 16)
        for enable_p2e, clamp in variants:
            counts = None if clamp is None else torch.zeros(3, dtype=torch.int64, device=device)

            impl = op("quant.swiglu_forward_and_per_token_cast", x, "e4m3", 128,
                      pos_to_expert=p2e if enable_p2e else None, clamped_count=counts, swiglu_clamp_value=clamp, **kw)
            fn = impl(TRITILE)

            def ref(x=x, clamp=clamp):  # padding rows are zero: the reference's rows there are the kernel's
                return cast(swiglu_forward(x, swiglu_clamp_value=clamp), "e4m3", (1, 128), **kw)

            out = fn()
            params = dict(enable_pos_to_expert=enable_p2e, hidden=H, num_ep_ranks=ep, num_experts=E,
                          num_per_channels=128, num_tokens=T, num_topk=K, round_sf=True, swiglu_clamp_value=clamp,
                          use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True, with_weights=False)
            yield Case(params=dict(params, num_rows=x.shape[0]), fn=fn, impl=impl, ref=ref, check=_check_pair,
                       nbytes=count_bytes(x, out),
                       anchor=("swiglu_forward_and_per_token_cast", params) if gpu else None,
                       tune=("swiglu_forward_and_per_token_cast", _FWD_TUNE)
                       if gpu and params == _FWD_ANCHOR else None)
            del out


#: The forward anchor's parameters (TileKernels' record), where the tuning sweep runs.
_FWD_ANCHOR = dict(enable_pos_to_expert=False, hidden=3584, num_ep_ranks=64, num_experts=4, num_per_channels=128,
                   num_tokens=36077, num_topk=9, round_sf=True, swiglu_clamp_value=0.5, use_packed_ue8m0=True,
                   use_tma_aligned_col_major_sf=True, with_weights=False)


# Tuning candidates at the forward anchor (H = 3584, packed sf: CH in {512, 1024}; the default is
# BLOCK_R=2, CH=512, 2 warps, 8 persistent programs per SM, every fast flag on but PREFETCH).  sm_90a SASS,
# executed per element on the fast path: 42.8 with the first candidate (the default before 2026-11-30),
# 37.1 with FAST_DIV and BF16X2_CLAMP off, 33.6 with the defaults (92 registers: 10 programs of 2 warps fit).
_FWD_TUNE = (  # default (H200 @ 2615106): [1, CH] x 1 warp, 20 programs per SM, PREFETCH + PREFETCH_RB, and the four
    # instruction cuts below (CUPTI 171.91 us against 203.99 for the H200 @ 694bd6c default, the first candidate)
    [dict(FUSED_SILU=0, INT_COUNT=False, XORSIGN_CLAMP=False, INT_SCALE=False),
     dict(BLOCK_R=2, num_warps=2, programs_per_sm=8, PREFETCH=False, PREFETCH_RB=False),  # H200 @ 8b7524c (242.9 us)
     dict(WORDS=False, BF16X2_COUNT=False, BF16X2_CLAMP=False, FAST_DIV=False), dict(FAST_DIV=False),
     dict(PREFETCH_RB=False), dict(PREFETCH=False, PREFETCH_RB=False)]
    # more programs per SM: 1 warp at ~96 registers fits ~21, so more need a register cap
    + [dict(programs_per_sm=p) for p in (16, 24)]
    + [dict(programs_per_sm=24, maxnreg=80), dict(programs_per_sm=28, maxnreg=72), dict(programs_per_sm=32, maxnreg=64)]
    + [dict(CH=1024, num_warps=2, programs_per_sm=10), dict(CH=1024, num_warps=2, programs_per_sm=8),
       dict(BLOCK_R=2, num_warps=2, programs_per_sm=10)]
    # PREFETCH2: loads two chunks ahead (two 2 KB chunks in flight per program).  sm_90a: 119 registers, no
    # spills (17 one-warp programs fit); maxnreg=104: 8 bytes of stack, 19 fit
    + [dict(PREFETCH2=True, programs_per_sm=p) for p in (12, 16, 17)]
    + [dict(PREFETCH2=True, programs_per_sm=19, maxnreg=104)]
    # Same-bits instruction cuts (H200 @ 2615106; see _swiglu_forward_and_per_token_cast_kernel).  sm_90a hot path at the
    # anchor, executed instructions per element (inner chunk loop + row-block overhead / 7 chunks; the default:
    # 37.5 = 35.75 + 1.8, 96 registers): FUSED_SILU=4 one PTX block per four words from the bf16 words to float32
    # act (expf/division rewrites of the per-channel op, bf16 guard); INT_COUNT the clamp counts as 16-bit mask sums
    # (HSET2 + IADD3 per two words, flushed every 2340 row blocks, not every row); XORSIGN_CLAMP r clamped by one
    # min.NaN.xorsign.abs.bf16x2; INT_SCALE the round_sf pow2 scale from amax's bits (no FCHK division)
    + [dict(FUSED_SILU=4, INT_COUNT=True, XORSIGN_CLAMP=True, INT_SCALE=True),  # 30.9 (30.4 + 0.5), 90 registers
       dict(FUSED_SILU=4, INT_COUNT=True, XORSIGN_CLAMP=True, INT_SCALE=True, programs_per_sm=21),  # 21 fit (<= 96)
       dict(FUSED_SILU=4),      # 34.5 (32.75 + 1.8), 94 registers
       dict(INT_COUNT=True),    # ~35.5 (35.0 + 0.5), 89 registers
       dict(XORSIGN_CLAMP=True),  # 37.0 (35.25 + 1.8), 96 registers
       dict(INT_SCALE=True)]    # 36.6 (34.8 + 1.8), 96 registers
)


@register(_M, "swiglu_backward_and_per_token_cast")
def _bwd_cases(device, quick, grid=False):
    """The anchor (K = 9, E = 4, ep = 64, H = 7168, npc 128, clamp 0.5), or TileKernels' grid: its 12 routing
    points x H in {2048, ..., 7168} x npc 32 / 128 x clamp None / 0.5, round_sf (the benchmark's filter)."""
    if not _grid.on(quick, grid):
        T, K, E, ep, H, npc = (36207, 9, 4, 64, 7168, 128) if device.type == "cuda" else (37, 9, 4, 64, 256, 128)
        yield from _bwd_point(device, T, K, E, ep, [H], [npc], [0.5])
        return
    for T, K, E, ep in _grid.moe_points(device, "swiglu_backward_and_per_token_cast"):
        yield from _bwd_point(device, T, K, E, ep, _grid.hidden_sizes(device, 256), (32, 128), (None, 0.5))


def _bwd_point(device, T, K, E, ep, hiddens, npcs, clamps):
    """One routing point's cases: per hidden size and npc (the map's alignment), one per clamp value."""
    from tritile.torch import cast, swiglu_backward

    gpu = device.type == "cuda"
    for H in hiddens:
        for npc in npcs:
            x, _, p2tk, tk2p = _moe(device, T, K, E, ep, H, npc)
            xq = cast(x, "e4m3", (1, npc))
            del x
            w = torch.rand((T, K), device=device)
            g = torch.randn((xq[0].shape[0], H), dtype=torch.bfloat16, device=device)
            args = (xq, g, w, p2tk, tk2p, npc)
            for clamp in clamps:
                impl = op("quant.swiglu_backward_and_per_token_cast", *args, round_sf=True, swiglu_clamp_value=clamp)
                fn = impl(TRITILE)

                def ref(args=args, clamp=clamp):
                    out, xg, wg = swiglu_backward(*args, swiglu_clamp_value=clamp)
                    return out.bfloat16(), cast(xg, "e4m3", (1, args[-1]), round_sf=True), xg.bfloat16(), wg

                res = fn()
                params = dict(hidden=H, num_ep_ranks=ep, num_experts=E, num_per_channels=npc, num_tokens=T,
                              num_topk=K, round_sf=True, swiglu_clamp_value=clamp)
                yield Case(params=dict(params, num_rows=xq[0].shape[0]), fn=fn, impl=impl, ref=ref, check=_check_bwd,
                           nbytes=count_bytes(xq, g, w, p2tk, tk2p, res),
                           anchor=("swiglu_backward_and_per_token_cast", params) if gpu else None,
                           tune=("swiglu_backward_and_per_token_cast", _BWD_TUNE)
                           if gpu and params == _BWD_ANCHOR else None)
                del res


#: The backward anchor's parameters (TileKernels' record), where the tuning sweep runs.
_BWD_ANCHOR = dict(hidden=7168, num_ep_ranks=64, num_experts=4, num_per_channels=128, num_tokens=36207, num_topk=9,
                   round_sf=True, swiglu_clamp_value=0.5)


def _check_bwd(o, r):
    assert_equal(o[0], r[0])
    _check_pair(o[1], r[1])
    assert_equal(o[2], r[2])
    torch.testing.assert_close(o[3], r[3], atol=1e-4, rtol=1e-4)  # weight_grad: a float32 sum in another order


# Tuning candidates at the backward anchor (H = 7168, npc = 128).  weight_grad is a float32 row sum whose order
# follows CH and the warp layout: candidates that change CH, BLOCK_R or num_warps can differ from the
# default in weight_grad's last bits (allowed: the op's check is atol/rtol 1e-4) and then show as "output differs"
# in the bitwise sweep; compare their other outputs by hand.  The default (H200 @ 65d4724): CH=512 x 1 warp with
# ROWSUM_PAIRS (the 2-warp layout's row-sum order, no barrier or smem in the loop), the same-bits instruction cuts
# FUSED_BWD=4 / XORSIGN_CLAMP / INT_SCALE, registers capped at 112.  sm_90a hot path at the anchor (clamp 0.5,
# round_sf), executed instructions per column (x and y element) of the chunk loop: 56.3 (110 registers, 18 warps
# per SM), against 64.0 without the cuts (128 registers, 24 bytes of stack), 75.2 without FAST_DIV as well.
# H200 @ 8b7524c..65d4724 (CUPTI, L2 flushed): the H200 @ 65d4724 default 884.2 us, the H200 @ 2615106 default (first candidate) 907.2,
# the H200 @ 694bd6c default (second) 948.0; CH 1024-2048 with 4-8 warps, BLOCK_R=2 and the persistent PREFETCH variants
# (1043-2246 us) were removed after losing by 15 % or more in two sweeps.
_BWD_TUNE = (
    [dict(FUSED_BWD=0, XORSIGN_CLAMP=False, INT_SCALE=False, maxnreg=128),                 # H200 @ 2615106 (907.2 us)
     dict(FUSED_BWD=0, XORSIGN_CLAMP=False, INT_SCALE=False, maxnreg=128, CH=1024, num_warps=2,
          ROWSUM_PAIRS=False)]                                                               # H200 @ 694bd6c (948.0 us)
    # FUSED_BWD alone / with XORSIGN_CLAMP (58.9 / 57.9 per column, 114 registers): 889.3 / 889.5 us
    + [dict(XORSIGN_CLAMP=False, INT_SCALE=False), dict(INT_SCALE=False)]
    # register caps: a warp's registers come from one of the SM's four 16 K partitions, so 112 and 104 registers both
    # give 4 warps per scheduler (16 per SM; Nsight Compute: 16 active warps), 96 gives 5 (16 bytes of stack, +0.6 %
    # static instructions), 80 gives 6 (72 bytes of stack, +4 %); uncapped 885.0 us, 104 889.1 us
    + [dict(maxnreg=None), dict(maxnreg=96), dict(maxnreg=80)]
    # the 2-warp layout with the cuts (weight_grad order unchanged: same bits)
    + [dict(CH=1024, num_warps=2, ROWSUM_PAIRS=False)]
    # H200 @ bc6f44a (same bits): SPLIT_STORE (the three bf16 tiles stored as each thread's two 16-byte halves, without
    # the plain store's lane exchange: 56.6 -> 52.1 sm_90a instructions per column) lost: CUPTI 899.9 us against 884.4
    # for the default; removed.  Bulk L2 prefetches of chunk c + D (cp.async.bulk.prefetch.L2) lost: 939-1063 us; removed.
    # H200 @ d53c6fa (same bits).  sm_90a, executed instructions per column on the chunk loop's fast path
    # (an sm_90a ptxas / SASS count "fast"; the default 56.6 at 108 registers, 37 SHFL per 16 columns).  MUFU: 2 per column
    # executed (ex2.approx.ftz in expf; one rcp.approx.ftz shared by s = 1/t and xf/t); the 4 per column of the static
    # count include the guarded rcp.rn / div.rn slow path, never taken at the anchor.  No same-bits MUFU cut is left.
    # Memory side (the SASS): each program waits for its row's index, then its weight (kept in a uniform register that
    # the compiler fills before the chunk loop), before issuing any chunk load (two dependent round trips per row), and
    # each chunk's loads wait for the previous chunk's arithmetic.  Expected: a few tenths of a % to ~2 % each.
    # PEEL (the first chunk's loads before the index / weight gathers), UNROLL=2 (two chunks' loads a step), PERSIST (a
    # persistent grid, weights gathered a row block ahead) and STREAM (.cs stores, evict-first loads) lost (880-953 us)
    # and were removed.  FUSED_BWD=8 / 16 (one |x| guard and branch per 8 / 16 elements: 55.9 / 55.5 per column, 112 /
    # 128 registers) lost (FUSED_BWD=8 in the fourth sweep below: 882.69 us against 878.00) and were removed.
    # H200 @ fd8764c: the chunk loop software-pipelined by the compiler (tl.range num_stages, cp.async into shared memory;
    # the loop's static instructions 1.8x, shared-memory reads and barriers) lost and was removed: CUPTI 1038.0 us at
    # num_stages=3 and 128 registers, 1209.4 at 2, 1311.7 at 2 and 112 registers (spills), the default 890.3
    # SPLIT (H200 @ fd8764c; every output's bits but weight_grad's, a float32 sum in another order): a row's chunks over
    # SPLIT programs.  scripts/steady_probe.py (CUPTI): the default at N and 2N rows runs at 90.1 % of copy in steady
    # state with an 18.6 us fixed cost (a same-size copy: ~2.5): the tail of 38272 one-warp programs of ~49 us, ~18
    # waves.  sm_90a: the loop unchanged (1384 instructions, 108 / 106 registers).  Expected: the tail's cost / SPLIT
    # First sweep (CUPTI, us): SPLIT=2 878.05 against 891.20 (-1.5 %), SPLIT=4 897.39, SPLIT=7 909.67 (more programs,
    # each waiting for its index and weight before its first loads).  With PEEL (the part's first chunk loads before
    # the index / weight gathers; sm_90a 112 registers, 16 B of stack outside the loop):
    # Second and third sweeps (the default 890.92 / 890.90): SPLIT=2 878.54 / 878.79, + PEEL + maxnreg=128 878.70 /
    # 879.12, + PEEL 889.30 / 889.33, SPLIT=4 897.66 / 897.46, SPLIT=3 905.10, SPLIT=3 / 4 + PEEL + maxnreg=128 905.2
    # / 905.1, SPLIT=7 + PEEL + maxnreg=128 915.73.  SPLIT=2 is the default since; its parts were then made even (7 +
    # 7 chunks instead of 8 + 6)
    # Fourth sweep (7 + 7, the default: 878.00): SPLIT=2 + PEEL + maxnreg=128 881.88, + FUSED_BWD=8 882.69, SPLIT=3
    # 883.08, SPLIT=1 890.89.  Fifth / sixth (copy 4248 GB/s; the default 870.10 / 870.12, 90.0-90.1 % of copy):
    # TAIL_SPLIT (the last TAIL_ROWS rows split finer: short programs for the tail only; removed) 7 ways over 1056
    # rows 870.91 / 870.87, over 2112 871.74 / 871.88, over 4224 873.60; 4 ways 871.84-873.66; with PEEL 884.38.
    # SPLIT 3 / 4 / 7 and PEEL were removed.
    + [dict(SPLIT=1)]
)


_CHANNEL_TUNE = [  # default (npt 32) [32, 64] x 2 warps, VEC=8, SIGNED_ENC=2, FAST_DIV, INT_POW2, FINITE_BRANCH off
    dict(BLOCK_K=32, num_warps=1, SIGNED_ENC=0, FAST_DIV=False, INT_POW2=False),  # H200 @ 8b7524c default (66.7 us)
    dict(BLOCK_K=128, num_warps=4, VEC=0), dict(BLOCK_K=128, num_warps=4), dict(BLOCK_K=64, num_warps=2),
    dict(FINITE_BRANCH=True), dict(VEC=0), dict(BLOCK_K=16, num_warps=1), dict(BLOCK_K=64, num_warps=1),
    dict(BLOCK_K=32, num_warps=2), dict(BLOCK_M=64, BLOCK_K=32, num_warps=2),
    # same bits, fewer instructions (sm90 hot path per element, [32, 32] x 1 warp, round_sf: default 50.0,
    # SIGNED_ENC=2 42.2, + FAST_DIV 41.7, + INT_POW2 40.5; 106-111 registers): SIGNED_ENC folds the encode's NaN
    # patch into a byte merge, FAST_DIV is the per-token kernel's division without FCHK, INT_POW2 the pow2 scale
    # from amax's bits
    dict(SIGNED_ENC=2, FAST_DIV=True, INT_POW2=True), dict(SIGNED_ENC=2, INT_POW2=True), dict(SIGNED_ENC=2),
    dict(SIGNED_ENC=2, FAST_DIV=True), dict(FAST_DIV=True), dict(INT_POW2=True),
    dict(SIGNED_ENC=2, FAST_DIV=True, INT_POW2=True, BLOCK_K=64, num_warps=2)]
# WORDS (same bits): _swiglu_channel_words_kernel, the tile as int32 words of two bf16, one row group per program;
# FUSED_SILU = one PTX block per 2 / 4 words from the loaded words to packed bf16 act (expf with the sign flip folded
# into its constants, its cvt.sat into the fma and its last mul into 1 + e as one fma; the fast division's guard on
# max |l|), PACKED_MAX = the column max with max.u16x2 on the words, SCALE_BITS = round_sf scales from the max bf16
# pattern in ~8 integer ops, HMUL_ENC = the power-of-two multiply of the encode on bf16 pairs, NO_MASK = no masks on
# even tiles.  The default since H200 @ 2615106 at npt 32 without a clamp: [32, 128] x 2 warps, FUSED_SILU=4, HMUL_ENC
# (H200 CUPTI 41.98 us against 56.53 for the element kernel, the first candidate below).  sm_90a static hot-path
# instructions per element in the comments (the element kernel: 41.0).
# The element kernel's candidates above run with WORDS=False (its default launch: the first below).
_CHANNEL_TUNE = [dict(c, WORDS=False) for c in _CHANNEL_TUNE]
_ELEMENT_DEFAULT = dict(WORDS=False, BLOCK_M=32, BLOCK_K=64, num_warps=2, FUSED_SILU=2, HMUL_ENC=False)
_CHANNEL_TUNE = [_ELEMENT_DEFAULT] + _CHANNEL_TUNE + [
    dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=2, FUSED_SILU=4, HMUL_ENC=True),  # 29.8, 64 registers
    dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=1, FUSED_SILU=4, HMUL_ENC=True),  # 26.3, 96 registers
    dict(WORDS=True, BLOCK_K=256, VEC=8, num_warps=4, FUSED_SILU=4, HMUL_ENC=True),
    dict(WORDS=True, BLOCK_K=128, VEC=8, num_warps=4, FUSED_SILU=4, HMUL_ENC=True),
    dict(WORDS=True, BLOCK_K=128, VEC=8, num_warps=2, FUSED_SILU=2, HMUL_ENC=True),
    dict(WORDS=True, BLOCK_K=128, VEC=8, num_warps=2, FUSED_SILU=4, HMUL_ENC=False),
    dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=1, FUSED_SILU=0),                 # 32.0 (no PTX silu)
    # H200 @ 4d49e57: KFAST (the grid's first dimension over the column blocks; it took four casts -2 to -5 % at
    # fd8764c), now the default (the candidates above run with it), with 4 warps without transpose (2 with it).  This op
    # ran at 86 % of a copy of its own size (scripts/copy_ceiling.py).  Three sweeps (CUPTI, us; without / with
    # transpose): the old default 41.96 / 42.55 / - and 43.25 / -, KFAST 41.07 / 40.76 / 41.25 and 42.64 / 42.60,
    # KFAST with 4 warps 39.74 / 39.67 and 43.45 / 43.51, KFAST with [32, 256] x 4 warps 40.38 / 41.33 / 41.43 and
    # 43.51 / 43.51
    dict(KFAST=False, num_warps=2), dict(KFAST=True, num_warps=2), dict(KFAST=True, num_warps=4),
    dict(KFAST=True, BLOCK_K=256, VEC=8, num_warps=4), dict(KFAST=False, BLOCK_K=256, VEC=8, num_warps=4),
    dict(KFAST=True, BLOCK_K=512, VEC=8, num_warps=8), dict(KFAST=True, BLOCK_K=256, VEC=8, num_warps=8),
    dict(KFAST=True, BLOCK_K=256, VEC=8, num_warps=4, FUSED_SILU=2), dict(KFAST=True, BLOCK_K=64, VEC=8, num_warps=2),
]


@register(_M, "swiglu_forward_and_per_channel_cast_and_transpose")
def _channel_cases(device, quick, grid=False):
    """The anchor shape (npt 32, round_sf, no clamp; the transposed case without a TileKernels figure), or
    TileKernels' grid: M in {4096, 8064} x its 7 hidden sizes x npt 32 / 128 x without_transpose x round_sf x
    clamp None / 0.5 (the benchmark's filter)."""
    if not _grid.on(quick, grid):
        M, H = (4096, 7168) if device.type == "cuda" else (256, 192)
        variants = [(32, wt, True, None) for wt in ((True,) if quick else (True, False))]
        yield from _channel_shape(device, M, H, variants, anchor_transposed=False)
        return
    variants = [(npt, wt, rnd, clamp) for npt in (32, 128) for wt in (True, False) for rnd in (True, False)
                for clamp in (None, 0.5)]
    for M, H in _grid.shapes(device, 128):
        yield from _channel_shape(device, M, H, variants, anchor_transposed=True)


def _channel_shape(device, M, H, variants, anchor_transposed):
    """One shape's cases, one per ``(npt, without_transpose, round_sf, clamp)`` of ``variants``."""
    from tritile.torch import cast, swiglu_forward

    gpu = device.type == "cuda"
    x = torch.randn((M, 2 * H), dtype=torch.bfloat16, device=device)
    for npt, wt, rnd, clamp in variants:
        impl = op("quant.swiglu_forward_and_per_channel_cast_and_transpose", x, "e4m3", npt, round_sf=rnd,
                  without_transpose=wt, swiglu_clamp_value=clamp)
        fn = impl(TRITILE)

        def ref(a=(npt, rnd, wt, clamp)):
            out, sf = cast(swiglu_forward(x, swiglu_clamp_value=a[3]).bfloat16(), "e4m3", (a[0], 1), round_sf=a[1])
            return (out if a[2] else out.T.contiguous()), sf

        out = fn()
        params = dict(hidden=H, num_per_tokens=npt, num_tokens=M, round_sf=rnd, swiglu_clamp_value=clamp,
                      without_transpose=wt)
        at_anchor = dict(params, without_transpose=True) == _CHANNEL_ANCHOR
        yield Case(params=params, fn=fn, impl=impl, ref=ref, check=_check_pair, nbytes=count_bytes(x, out),
                   label=f"without_transpose={wt}",
                   anchor=("swiglu_forward_and_per_channel_cast_and_transpose", params)
                   if gpu and (wt or anchor_transposed) else None,
                   tune=("swiglu_forward_and_per_channel_cast_and_transpose", _CHANNEL_TUNE)
                   if gpu and at_anchor else None)
        del out


#: The anchor's parameters (TileKernels' record); the tuning sweep runs there, transposed or not.
_CHANNEL_ANCHOR = dict(hidden=7168, num_per_tokens=32, num_tokens=4096, round_sf=True, swiglu_clamp_value=None,
                       without_transpose=True)
