"""Benchmark registrations: per_token_cast, per_block_cast, cast_back (per-token and block).

GPU: TileKernels' anchor shapes (8001 x 7168), or with ``grid=True`` its whole benchmark grid (``_quant_grid``); CPU:
small shapes (a correctness pass only).
Bytes as TileKernels counts them: every input read once (a QuantTensor counts data + sf), every output
written once, sf by its logical elements.
"""

from __future__ import annotations

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal, count_bytes

from . import _quant_grid as _grid
from tritile.quant.cast_back_kernel import cast_back, per_token_cast_back
from tritile.quant.per_block_cast_kernel import per_block_cast
from tritile.quant.per_token_cast_kernel import per_token_cast

_M = "quant"
_PACKED = (True, True, True)  # (col_major, round_sf, packed)
_ROUND = (False, True, False)


def _shape(device):
    return (8001, 7168) if device.type == "cuda" else (33, 576)


def _dense(t):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _check_pair(out, ref):
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
                fn=lambda a=(x, fmt, npc, xbs): per_token_cast(*a, col, rnd, packed),
                ref=lambda a=(x, fmt, npc, xbs): cast(a[0], a[1], (1, a[2]), x_block_size=a[3], round_sf=rnd,
                                                      use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed),
                check=_check_pair, nbytes=count_bytes(x, out),
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
                fn=lambda a=(x, fmt, block, col, rnd, packed): per_block_cast(*a),
                ref=lambda a=(x, fmt, block): cast(*a, round_sf=rnd, use_tma_aligned_col_major_sf=col,
                                                   use_packed_ue8m0=packed),
                check=_check_pair, nbytes=count_bytes(x, out),
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
                fn=lambda a=(q, out_dtype, npc): per_token_cast_back(*a),
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
                fn=lambda a=(q, out_dtype, block): cast_back(*a), ref=lambda a=(q, out_dtype, block): cast_back_ref(*a),
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


from . import _quant_channel, _quant_e5m6, _quant_swiglu  # noqa: E402,F401  (register their cases)
