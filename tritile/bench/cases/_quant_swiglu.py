"""Benchmark registrations of the fused SwiGLU casts: swiglu_forward_and_per_token_cast,
swiglu_backward_and_per_token_cast, swiglu_forward_and_per_channel_cast_and_transpose.

GPU: TileKernels' anchor shapes, or with ``grid=True`` its whole benchmark grid (``_quant_grid``); CPU: small
shapes (a correctness pass only).  Bytes as TileKernels counts them: every input read once (a QuantTensor
counts data + sf), every output written once.

The MoE data is built as TileKernels' test generator does (bf16 ``rand`` scores of
``num_send_tokens * ep`` rows, top-k, non-local experts -> -1, rows with no local expert dropped),
then cut to the anchor's token count exactly, and mapped with a plain-torch fused mapping in the
canonical order (stable by ``t*K + k`` inside each expert, segments aligned, padding rows -1/zero).
"""

from __future__ import annotations

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal, count_bytes

from . import _quant_grid as _grid
from tritile.quant.swiglu_backward_and_per_token_cast_kernel import swiglu_backward_and_per_token_cast
from tritile.quant.swiglu_forward_and_per_channel_cast_and_transpose_kernel import \
    swiglu_forward_and_per_channel_cast_and_transpose
from tritile.quant.swiglu_forward_and_per_token_cast_kernel import swiglu_forward_and_per_token_cast

_M = "quant"


def _moe(device, num_tokens, num_topk, num_experts, num_ep_ranks, hidden, alignment):
    """``(x (rows, 2 * hidden) bf16, pos_to_expert, pos_to_token_topk, token_topk_to_pos)`` of a routing point, the
    map aligned to ``alignment`` (:func:`tritile.bench.cases._quant_grid.moe_inputs`)."""
    x, p2e, _, p2tk, tk2p = _grid.moe_inputs(device, num_tokens, num_topk, num_experts, num_ep_ranks, 2 * hidden,
                                             alignment)
    return x, p2e, p2tk, tk2p


def _check_pair(out, ref):
    assert_equal(out[0], ref[0])
    assert_equal(out[1], ref[1])


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

            def fn(x=x, p2e=p2e if enable_p2e else None, clamp=clamp, counts=counts):
                return swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_expert=p2e, clamped_count=counts,
                                                         swiglu_clamp_value=clamp, **kw)

            def ref(x=x, clamp=clamp):  # padding rows are zero: the reference's rows there are the kernel's
                return cast(swiglu_forward(x, swiglu_clamp_value=clamp), "e4m3", (1, 128), **kw)

            out = fn()
            params = dict(enable_pos_to_expert=enable_p2e, hidden=H, num_ep_ranks=ep, num_experts=E,
                          num_per_channels=128, num_tokens=T, num_topk=K, round_sf=True, swiglu_clamp_value=clamp,
                          use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True, with_weights=False)
            yield Case(params=dict(params, num_rows=x.shape[0]), fn=fn, ref=ref, check=_check_pair,
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
                def fn(args=args, clamp=clamp):
                    return swiglu_backward_and_per_token_cast(*args, round_sf=True, swiglu_clamp_value=clamp)

                def ref(args=args, clamp=clamp):
                    out, xg, wg = swiglu_backward(*args, swiglu_clamp_value=clamp)
                    return out.bfloat16(), cast(xg, "e4m3", (1, args[-1]), round_sf=True), xg.bfloat16(), wg

                res = fn()
                params = dict(hidden=H, num_ep_ranks=ep, num_experts=E, num_per_channels=npc, num_tokens=T,
                              num_topk=K, round_sf=True, swiglu_clamp_value=clamp)
                yield Case(params=dict(params, num_rows=xq[0].shape[0]), fn=fn, ref=ref, check=_check_bwd,
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
        def fn(a=(npt, rnd, wt, clamp)):
            return swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", a[0], round_sf=a[1],
                                                                     without_transpose=a[2], swiglu_clamp_value=a[3])

        def ref(a=(npt, rnd, wt, clamp)):
            out, sf = cast(swiglu_forward(x, swiglu_clamp_value=a[3]).bfloat16(), "e4m3", (a[0], 1), round_sf=a[1])
            return (out if a[2] else out.T.contiguous()), sf

        out = fn()
        params = dict(hidden=H, num_per_tokens=npt, num_tokens=M, round_sf=rnd, swiglu_clamp_value=clamp,
                      without_transpose=wt)
        at_anchor = dict(params, without_transpose=True) == _CHANNEL_ANCHOR
        yield Case(params=params, fn=fn, ref=ref, check=_check_pair, nbytes=count_bytes(x, out),
                   label=f"without_transpose={wt}",
                   anchor=("swiglu_forward_and_per_channel_cast_and_transpose", params)
                   if gpu and (wt or anchor_transposed) else None,
                   tune=("swiglu_forward_and_per_channel_cast_and_transpose", _CHANNEL_TUNE)
                   if gpu and at_anchor else None)
        del out


#: The anchor's parameters (TileKernels' record); the tuning sweep runs there, transposed or not.
_CHANNEL_ANCHOR = dict(hidden=7168, num_per_tokens=32, num_tokens=4096, round_sf=True, swiglu_clamp_value=None,
                       without_transpose=True)
