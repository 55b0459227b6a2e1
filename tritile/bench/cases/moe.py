"""Benchmark cases of ``tritile.moe``: the gating ops (topk_gate, top2_sum_gate, topk_sum_and_topk_group_idx,
normalize_weight, aux_fi, group_count, mask_indices_by_tp, inplace_unique_group_indices) and the fused-layout ops
(get_fused_mapping, expand_to_fused(_with_sf), reduce_fused).

GPU: TileKernels' anchor shapes (tritile/data/tilekernels-h200.json), or with ``grid=True`` its whole benchmark grid
(``_grid``); CPU: small shapes, checked once.  Bytes are counted as TileKernels' benchmarks count them (spec/moe.md).
The gating cases are latency-bound (a few µs): the harness also times CUDA-graph replay and host overhead.
"""

from __future__ import annotations

import torch

from tritile.bench import Case, op, register
from tritile.moe import mask_indices_by_tp, normalize_weight, topk_gate, topk_sum_and_topk_group_idx
from tritile.moe.expand_to_fused_kernel import expand_to_fused, expand_to_fused_with_sf
from tritile.moe.get_fused_mapping_kernel import get_fused_mapping
from tritile.moe.reduce_fused_kernel import reduce_fused
from tritile.moe.scoring import ScoringFunc
from tritile.testing import assert_equal, count_bytes
from tritile.utils import ceil_div

from . import _grid

_M = "moe"


def _ref_mapping(topk_idx, num_experts, alignment):
    """Stable-sort reference (tritile's canonical order) of the synchronising mode."""
    num_tokens, num_topk = topk_idx.shape
    dev = topk_idx.device
    flat = topk_idx.flatten()
    valid = flat >= 0
    aligned = (torch.bincount(flat[valid], minlength=num_experts) + alignment - 1) // alignment * alignment
    end = torch.cumsum(aligned, 0)
    start = end - aligned
    n = int(aligned.sum())
    pos_to = [torch.full((n,), -1, dtype=torch.int32, device=dev) for _ in range(3)]
    t2p = torch.full((flat.numel(),), -1, dtype=torch.int32, device=dev)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices[: int(valid.sum())]
    experts = key[order]
    pos = start[experts] + torch.arange(order.numel(), device=dev) - torch.searchsorted(experts, experts)
    pos_to[0][pos], pos_to[1][pos], pos_to[2][pos] = experts.int(), (order // num_topk).int(), order.int()
    t2p[order] = pos.int()
    return (*pos_to, t2p.view(num_tokens, num_topk), start.int(), end.int(), aligned.int(), aligned.tolist())


def _check_mapping(out, ref):
    for a, b in zip(out[:7], ref[:7]):
        assert_equal(a, b)
    assert out[7] == ref[7]


# Default at E = 4: packed ranks, two launches, 1024-slot chunks, 4 warps.  The first is the previous default
# (3 launches, [64, 64] rank comparisons: 30.4 us CUPTI on 2026-11-30).  E in 5..32: packed ranks in E / 4 lanes,
# 512-slot chunks on 4 warps; lanes_max=0 gives the [64, 64] rank steps of before.  single_max: the largest T*K placed
# by one program (one launch: count, scan and scatter), with single_warps warps.
_MAPPING_TUNE = [
    dict(chunk=512, num_warps=2, packed=False, fuse_scan=0), dict(chunk=512, num_warps=2, packed=False),
    dict(fuse_scan=0), dict(chunk=256, num_warps=2), dict(chunk=512, num_warps=2),
    dict(chunk=512, num_warps=4), dict(chunk=1024, num_warps=2), dict(chunk=1024, num_warps=8),
    dict(chunk=2048, num_warps=4), dict(chunk=2048, num_warps=8), dict(chunk=4096, num_warps=8),
    dict(lanes_max=0), dict(lanes_max=0, num_warps=2), dict(num_warps=8), dict(chunk=256), dict(chunk=1024),
    dict(chunk=1024, num_warps=8), dict(chunk=256, num_warps=2),
    dict(single_max=2048, single_warps=8), dict(single_max=4096, single_warps=8),
    dict(single_max=4096, single_warps=16), dict(single_max=8192, single_warps=16),
    dict(single_max=16384, single_warps=32),
    # 9-32 experts past the 8-bit rule's table bound: large chunks ranked in 128- / 256-slot sub-blocks of 8-bit
    # counters (sm_90 one-hot cumsums of [256, 4] int64 at E = 32 instead of [512, 8])
    dict(field_bits=8, sub=256, chunk=512), dict(field_bits=8, sub=256, chunk=1024),
    dict(field_bits=8, sub=128, chunk=512), dict(field_bits=8, sub=128, chunk=1024),
    dict(field_bits=8, sub=256, chunk=2048), dict(field_bits=8, sub=256, chunk=1024, num_warps=8),
    dict(field_bits=8, sub=256, chunk=512, num_warps=2),
]


@register(_M, "get_fused_mapping")
def _mapping_cases(device, quick, grid=False):
    gpu = device.type == "cuda"
    a = 128
    for k, e, ep in _grid.points(quick, grid, (9, 4, 64)):
        t, _ = _grid.num_tokens(device, "get_fused_mapping", k, e, ep, alignment=a)
        topk_idx = _grid.topk_idx(device, t, k, e, ep)
        res = get_fused_mapping(topk_idx, e, 0, a)
        anchor = ("get_fused_mapping", dict(alignment=a, num_ep_ranks=ep, num_experts=e, num_tokens=t, num_topk=k))
        params = dict(num_tokens=t, num_topk=k, num_experts=e, num_ep_ranks=ep, alignment=a)
        # The synchronising call (as TileKernels times it: kernels plus the host sync of the counts); its host µs
        # and event µs against the no-sync case's give the sync's cost.
        yield Case(params=params, impl=op("moe.get_fused_mapping", topk_idx, e, 0, a),
                   ref=lambda x=topk_idx, e=e: _ref_mapping(x, e, a), check=_check_mapping,
                   nbytes=count_bytes(topk_idx, *res[:7]), anchor=anchor, latency_bound=True)
        # The capturable mode (a caller-sized buffer, no host sync): the kernels' own latency, which is what
        # TileKernels' CUPTI timer reports for the synchronising call.  Kept in --quick runs for that reason.
        n = sum(res[7])
        res_fixed = get_fused_mapping(topk_idx, e, n, a)
        yield Case(params=dict(params, num_expanded_tokens=n),
                   impl=op("moe.get_fused_mapping", topk_idx, e, n, a),
                   ref=lambda x=topk_idx, e=e: _ref_mapping(x, e, a)[:7] + ([],), check=_check_mapping,
                   nbytes=count_bytes(topk_idx, *res_fixed[:7]), anchor=anchor, latency_bound=True, label="no-sync",
                   tune=("get_fused_mapping", _MAPPING_TUNE) if gpu else None)


def _hidden_sizes(device, grid, default_gpu, default_cpu, align_to=64):
    """TileKernels' ``generate_hidden_sizes(align_to)`` in grid runs (CPU: the two smallest), else the default."""
    gpu = device.type == "cuda"
    if not grid:
        return [default_gpu if gpu else default_cpu]
    sizes = (576, 2048, 2560, 3072, 4096, 6144, 7168) if gpu else (256, 512, 576)
    return [h for h in sizes if h % align_to == 0][:None if gpu else 2]


@register(_M, "expand_to_fused")
def _expand_cases(device, quick, grid=False):
    from tritile.torch import expand_to_fused as ref_expand
    gpu = device.type == "cuda"
    for k, e, ep in _grid.points(quick, grid, (8, 9, 8)):
        for h in _hidden_sizes(device, grid and not quick, 7168, 576):
            if grid:
                t, _ = _grid.num_tokens(device, "expand_to_fused", k, e, ep, hidden=h)
            else:
                t = 21913 if gpu else 129
            topk_idx = _grid.topk_idx(device, t, k, e, ep)
            pos_to_expert, _, _, t2p, *_ = get_fused_mapping(topk_idx, e, 0, 16)
            x = torch.randn((t, h), dtype=torch.bfloat16, device=device)
            out = expand_to_fused(x, t2p, pos_to_expert)
            params = dict(num_tokens=t, num_topk=k, num_experts=e, num_ep_ranks=ep, hidden=h)
            yield Case(params=params, impl=op("moe.expand_to_fused", x, t2p, pos_to_expert),
                       ref=lambda a=(x, t2p, pos_to_expert): ref_expand(*a),
                       check=assert_equal, nbytes=count_bytes(x, t2p, pos_to_expert, out),
                       anchor=("expand_to_fused", dict(hidden=h, num_ep_ranks=ep, num_experts=e, num_tokens=t,
                                                       num_topk=k)),
                       tune=("expand_to_fused", _EXPAND_BF16_TUNE) if gpu else None)


# Launch-config candidates (python -m tritile tune) at H = 7168: BT x BH int32 words per token tile, padding
# programs PSUB x [PBT, BH].  bf16 rows are 3584 words (default [8, 512]), fp8 rows 1792 (default [16, 256]).
_EXPAND_BF16_TUNE = [
    dict(BT=4, BH=512), dict(BT=16, BH=512, num_warps=8), dict(BT=8, BH=512, num_warps=8), dict(BT=16, BH=256),
    dict(BT=8, BH=256, num_warps=2), dict(BT=4, BH=1024), dict(BT=2, BH=1024, num_warps=2), dict(BT=32, BH=128),
    dict(BT=2, BH=2048), dict(BT=4, BH=512, num_warps=2), dict(BT=8, BH=512, PBT=4, PSUB=16),
    dict(BT=8, BH=512, PBT=16, PSUB=4),
    # COMPACT: one [BT, KP] index load, a store per valid-slot rank; PAD_FIRST: padding programs first
    dict(COMPACT=True), dict(COMPACT=True, PAD_FIRST=True),
    # narrow rows (H = 576: 288 words, one 512-wide block wastes 44 % of the lanes): narrower blocks
    dict(BT=32, BH=128), dict(BT=64, BH=64), dict(BT=128, BH=32), dict(BT=16, BH=128, num_warps=2),
    dict(BT=32, BH=64, num_warps=2), dict(BT=16, BH=512, num_warps=8), dict(BT=4, BH=512, num_warps=2),
]
_EXPAND_FP8_TUNE = [  # default: COMPACT + PAD_FIRST (H200 @ 694bd6c)
    dict(COMPACT=False, PAD_FIRST=False),  # the H200 @ 8b7524c default (141.5 us CUPTI at ep 64)
    dict(BT=8, BH=256), dict(BT=32, BH=256, num_warps=8), dict(BT=16, BH=256, num_warps=8),
    dict(BT=8, BH=256, num_warps=2), dict(BT=4, BH=256, num_warps=1), dict(BT=16, BH=128),
    dict(BT=32, BH=128, num_warps=8), dict(BT=8, BH=128, num_warps=2),
    dict(BT=2, BH=2048), dict(BT=4, BH=1024), dict(BT=1, BH=2048, num_warps=8), dict(BT=8, BH=512),
    dict(BT=16, BH=256, PBT=8, PSUB=8), dict(BT=16, BH=256, PBT=32, PSUB=2), dict(BT=16, BH=256, PBT=16, PSUB=1),
    # COMPACT: one [BT, KP] index load, a store per valid-slot rank (1-2 at ep 64 against K = 9 predicated
    # stores); PAD_FIRST: padding programs on the low ids (no tail of short programs)
    dict(COMPACT=False), dict(PAD_FIRST=False), dict(BT=4, BH=256, num_warps=1),
]


def _check_pair(out, ref):
    assert_equal(out[0], ref[0])
    assert_equal(out[1], ref[1])


@register(_M, "expand_to_fused_with_sf")
def _expand_sf_cases(device, quick, grid=False):
    from tritile.torch import expand_to_fused_with_sf as ref_expand_sf
    gpu = device.type == "cuda"
    if grid and not quick:
        # (T, K, E, ep, H, npc, col_major, packed); T from TileKernels' record where there is one
        configs = []
        for k, e, ep in _grid.points(quick, grid, (9, 4, 64)):
            for h in _hidden_sizes(device, True, 7168, 576)[:None if gpu else 1]:  # CPU: 576 (an npc-128 tail)
                for npc in (32, 128):
                    for col_major, packed in ((False, False), (True, True)):
                        t, _ = _grid.num_tokens(device, "expand_to_fused_with_sf", k, e, ep, hidden=h,
                                                num_per_channels=npc, use_packed_ue8m0=packed)
                        configs.append((t, k, e, ep, h, npc, col_major, packed))
    else:
        # the two anchor records
        h = 7168 if gpu else 576
        configs = [(35761, 9, 4, 64, h, 128, True, True), (21913, 8, 9, 8, h, 128, False, False)] if gpu else \
            [(133, 9, 4, 64, h, 128, True, True), (71, 8, 9, 8, h, 128, False, False)]
        if quick:
            configs = configs[:1]
    for t, k, e, ep, h, npc, col_major, packed in configs:
        topk_idx = _grid.topk_idx(device, t, k, e, ep)
        pos_to_expert, _, _, t2p, *_ = get_fused_mapping(topk_idx, e, 0, 16)
        x = torch.randint(0, 256, (t, h), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        groups = ceil_div(h, npc)
        if packed:  # UE8M0 exponents around 127 (scales near 1), four per int32 word
            x_sf = torch.randint(120, 135, (t, ceil_div(groups, 4) * 4), dtype=torch.uint8, device=device)
            x_sf = x_sf.view(torch.int32)
        else:
            x_sf = torch.rand((t, groups), device=device) + 0.5
        args = ((x, x_sf), npc, t2p, pos_to_expert, col_major)
        out = expand_to_fused_with_sf(*args)
        params = dict(hidden=h, num_ep_ranks=ep, num_experts=e, num_per_channels=npc, num_tokens=t, num_topk=k,
                      round_sf=True, use_packed_ue8m0=packed, use_tma_aligned_col_major_sf=col_major)
        yield Case(params=params, impl=op("moe.expand_to_fused_with_sf", *args),
                   ref=lambda args=args: ref_expand_sf(*args), check=_check_pair,
                   nbytes=count_bytes(x, x_sf, t2p, pos_to_expert, *out),
                   anchor=("expand_to_fused_with_sf", params),
                   tune=("expand_to_fused_with_sf", _EXPAND_FP8_TUNE) if gpu else None)


@register(_M, "reduce_fused")
def _reduce_cases(device, quick, grid=False):
    from tritile.torch import reduce_fused as ref_reduce
    gpu = device.type == "cuda"
    if grid and not quick:
        # TileKernels' benchmark filter: num_topk == 6 and with_weights
        configs = [(k, e, ep, h, i, o, xs) for k, e, ep in _grid.points(quick, grid, (6, 4, 64)) if k == 6
                   for h in _hidden_sizes(device, True, 7168, 256, align_to=256)
                   for i in ("fp32", "bf16") for o in (i, "e4m3") for xs in (True, False)]
    else:
        configs = [(6, 4, 64, 7168 if gpu else 512, "bf16", "e4m3", False)]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for k, e, ep, h, in_dtype, out_dtype, with_sf in configs:
        if grid:
            t, _ = _grid.num_tokens(device, "reduce_fused", k, e, ep, hidden=h, in_dtype=in_dtype,
                                    out_dtype=out_dtype, with_sf=with_sf, with_weights=True)
        else:
            t = 25023 if gpu else 97
        topk_idx = _grid.topk_idx(device, t, k, e, ep)
        _, _, _, t2p, *_ = get_fused_mapping(topk_idx, e, 0, 1)
        x = torch.randn((t * k, h), device=device).to(dtypes[in_dtype])
        w = torch.rand((t, k), device=device)
        fmt = "e4m3" if out_dtype == "e4m3" else ""
        sf = torch.randn((1,), device=device) if fmt else None
        x_sf = torch.randn((t * k,), device=device) if with_sf else None
        x_in = (x, x_sf) if with_sf else x
        out = reduce_fused(x_in, w, t2p, fmt, sf)
        nbytes = count_bytes(t2p, x_sf, out, w) + int((t2p != -1).sum()) * h * x.element_size()
        params = dict(hidden=h, in_dtype=in_dtype, num_ep_ranks=ep, num_experts=e, num_tokens=t, num_topk=k,
                      out_dtype=out_dtype, with_sf=with_sf, with_weights=True)
        args = (x_in, w, t2p, fmt, sf)
        yield Case(params=params, impl=op("moe.reduce_fused", *args), ref=lambda args=args: ref_reduce(*args),
                   check=assert_equal, nbytes=nbytes, anchor=("reduce_fused", params),
                   tune=("reduce_fused", _REDUCE_TUNE) if gpu else None)


# Launch-config candidates at the anchor (K = 6, H = 7168, bf16 -> e4m3; 97 % of tokens hold 1 valid slot).
# Default: one token per program, 7 chunks of 1024 columns (4 warps), bf16 read as int32 pairs, the valid
# slots compacted (NG=1: a one-slot token gathers only its row, 3 chunks ahead; others gather all 6 slots),
# e4m3 through the satfinite conversion.  The first candidate is the previous default (all 6 slots gathered
# and summed, 1 chunk ahead); GATHER=False is the first version (slot by slot).
_REDUCE_TUNE = [
    dict(NG=0, SKIP=False, PREFETCH=1, SATFINITE=False), dict(NG=0, PREFETCH=1), dict(PREFETCH=2),
    dict(PREFETCH=1), dict(PREFETCH_DENSE=1), dict(NG=2, PREFETCH=2), dict(num_warps=2, PREFETCH=2),
    dict(num_warps=8), dict(BH=512, COL_ITERS=14, num_warps=2), dict(BH=512, COL_ITERS=7, num_warps=1),
    dict(SATFINITE=False), dict(GATHER=False, COL_ITERS=7, SKIP=True),
    # the grid's fp32 rows and ep 8 (1.4 valid slots a token): compact up to 2 slots, narrower chunks, prefetch
    dict(NG=2), dict(NG=2, PREFETCH=2), dict(PREFETCH_DENSE=1), dict(NG=2, PREFETCH_DENSE=1),
    dict(BH=512, COL_ITERS=4, num_warps=2), dict(BH=512, COL_ITERS=4, num_warps=2, NG=2), dict(NG=4),
    # short rows (2048, 2560): several tokens a program (fewer position-then-gather latency chains per byte), and
    # 512-column chunks (2560 = 5 x 512: no half-masked third chunk of 1024)
    dict(BT=2), dict(BT=4), dict(BT=2, num_warps=8), dict(BT=4, num_warps=8), dict(BH=512, COL_ITERS=5, num_warps=2),
    dict(BT=2, BH=512, COL_ITERS=5, num_warps=4), dict(BT=2, BH=512, COL_ITERS=4, num_warps=4),
]


# ---------------------------------------------------------------------------------------------------- gating ops

#: TileKernels' topk_gate benchmark configs (num_experts, num_topk).
_TOPK_GATE_CONFIGS = [(72, 6), (32, 6), (64, 6), (96, 6), (16, 6), (36, 6), (108, 6), (128, 6), (144, 6), (256, 8)]


@register(_M, "topk_gate")
def _topk_gate_cases(device, quick, grid=False):
    from tritile.torch import stable_topk
    gpu = device.type == "cuda"
    tokens = (4001, 8001) if gpu else (67,)
    shapes = [(t, e, k) for t in tokens for e, k in _TOPK_GATE_CONFIGS] if grid and not quick else \
        [(8001 if gpu else 67, 256, 8)]
    for t, e, k in shapes:
        scores = torch.randn(t, e, device=device)
        out = topk_gate(scores, k)
        yield Case(params=dict(num_tokens=t, num_experts=e, num_topk=k),
                   impl=op("moe.topk_gate", scores, k),
                   ref=lambda scores=scores, k=k: stable_topk(scores, k), check=assert_equal,
                   nbytes=count_bytes(scores, out), anchor=("topk_gate", dict(num_experts=e, num_tokens=t, num_topk=k)),
                   latency_bound=True, tune=("topk_gate", _TOPK_GATE_TUNE) if gpu and e == 256 else None)


# Launch-config candidates (python -m tritile tune) at E = 256.  Default: two rows per 1-warp program, each row
# as two joined halves of 128 (all in one warp, no shared memory), arg-max in two 32-bit passes (KEY32: one
# REDUX.MAX + one REDUX.MIN per row and round, no shuffles; 440-464 SASS instructions per row against 800 with
# 80 SHFL for the 64-bit packed keys).  dict(KEY32=False, BLOCK_T=1) is the previous default (13.65 us CUPTI
# on 2026-11-30).
_TOPK_GATE_TUNE = [
    dict(KEY32=False, BLOCK_T=1), dict(BLOCK_T=1), dict(BLOCK_T=4), dict(BLOCK_T=2, num_warps=2),
    dict(BLOCK_T=4, num_warps=4), dict(BLOCK_T=8, num_warps=8), dict(SPLIT=False, BLOCK_T=1, num_warps=2),
    dict(SPLIT=False, BLOCK_T=1), dict(KEY32=False, BLOCK_T=2, num_warps=2), dict(KEY32=False, BLOCK_T=4, num_warps=4),
    dict(KEY32=False, SPLIT=False, BLOCK_T=4, num_warps=4),
]


_TOP2_CONFIGS = [(0, 0, 72, 1, 6), (0, 0, 32, 2, 6), (0, 0, 64, 2, 6), (0, 0, 96, 2, 6), (0, 0, 16, 2, 6),
                 (0, 0, 36, 2, 6), (0, 0, 108, 2, 6), (0, 0, 128, 2, 6), (0, 0, 144, 2, 6), (8, 8, 256, 2, 8),
                 (8, 4, 256, 2, 8)]


def _check_gate(out, ref):
    assert_equal(out[0], ref[0])
    assert torch.allclose(out[1], ref[1], rtol=1e-5, atol=1e-8)


@register(_M, "top2_sum_gate")
def _top2_cases(device, quick):
    from tritile.torch import top2_sum_gate as ref_gate
    configs = [(8, 4, 256, 2, 8)] if quick else _TOP2_CONFIGS
    funcs = [ScoringFunc.SOFTMAX] if quick else [f for f in ScoringFunc if f != ScoringFunc.IDENTITY]
    num_tokens, num_padded, num_extra, tp_rank = 32, 4, 32, 1  # TileKernels' benchmark setting
    n = num_tokens + num_padded
    for g, gk, e, s, k in configs:
        shared = k % s == 0 and e % (k // s) == 0
        for func in funcs:
            logits = torch.randn(n, e, device=device)
            bias = torch.randn(e, device=device)
            mask = torch.ones(n, dtype=torch.bool, device=device)
            mask[-num_padded:] = False
            pmap = count = None
            if shared:
                pmap = torch.arange(e + s, dtype=torch.int32, device=device).view(-1, 1).expand(
                    -1, num_extra + 1).contiguous()
                count = torch.ones(e + s, dtype=torch.int32, device=device)
            unm = torch.zeros(n, k, dtype=torch.int64, device=device)
            unm_ref = unm.clone()
            args = (logits, bias, k, gk, g, shared, s, 1.5, 0, 4, tp_rank, 2, str(func))
            kw = dict(mask=mask, to_physical_map=pmap, logical_count=count)
            params = dict(num_groups=g, num_routed_experts=e, num_shared_experts=s, num_topk=k, num_topk_groups=gk,
                          scoring_func=str(func))
            yield Case(params=params,
                       impl=op("moe.top2_sum_gate", *args, **kw, unmapped_topk_idx=unm),
                       ref=lambda args=args, kw=kw, u=unm_ref: ref_gate(*args, **kw, unmapped_topk_idx=u),
                       check=_check_gate, nbytes=count_bytes(logits, bias), anchor=("top2_sum_gate", params),
                       latency_bound=True)


@register(_M, "topk_sum_and_topk_group_idx")
def _topk_sum_cases(device, quick, grid=False):
    from tritile.torch import topk_sum_and_topk_group_idx as ref
    gpu = device.type == "cuda"
    tokens = ((4001, 8001) if gpu else (31, 67)) if grid else ((8001,) if gpu else (67,))
    combos = [(72, 4, 1, 2)] if quick else [(e, g, n, gk) for e in (72, 256) for g in (4, 8, 12, 16) if e % g == 0
                                            for n in (1, 2) for gk in (2, 4)]
    for t, (e, g, n, gk) in [(t, c) for t in tokens for c in combos]:
        scores = torch.randn(t, g, e // g, device=device)
        out = topk_sum_and_topk_group_idx(scores, n, gk)
        params = dict(num_experts=e, num_group_sum_topk=n, num_groups=g, num_tokens=t, num_topk_groups=gk)
        yield Case(params=params, impl=op("moe.topk_sum_and_topk_group_idx", scores, n, gk),
                   ref=lambda s_=scores, n=n, gk=gk: ref(s_, n, gk), check=assert_equal,
                   nbytes=count_bytes(scores, out), anchor=("topk_sum_and_topk_group_idx", params), latency_bound=True)


def _params(t, k, e, ep, **extra):
    return dict(num_tokens=t, num_experts=e, num_ep_ranks=ep, num_topk=k, **extra)


@register(_M, "normalize_weight")
def _normalize_cases(device, quick, grid=False):
    from tritile.torch import normalize_weight as ref
    gpu = device.type == "cuda"

    def check(out, expected):
        assert_equal(out[0], expected[0])
        assert_equal(out[1], expected[1])

    for k, e, ep in _grid.points(quick, grid, (8, 9, 8)):
        t, _ = _grid.num_tokens(device, "normalize_weight", k, e, ep)
        w = torch.rand(t, k, device=device)
        d, nw = normalize_weight(w)
        params = _params(t, k, e, ep)
        yield Case(params=params, impl=op("moe.normalize_weight", w), ref=lambda w=w: ref(w), check=check,
                   nbytes=count_bytes(w, d, nw), anchor=("normalize_weight", params), latency_bound=True,
                   tune=("normalize_weight", _NORMALIZE_TUNE) if gpu else None)


# Default (H200 @ 2615106): RCP on [32, 8] tiles x 1 warp (2.02 us CUPTI against 2.32 for the H200 @ 694bd6c default, [128, 8]
# x 4 warps with div_rn, the first candidate).  RCP: one div_rn(1, d) per row, three multiply-adds per element
# (block-uniform div_rn fallback outside the range).
_NORMALIZE_TUNE = [
    dict(RCP=False, BLOCK_T=128, num_warps=4), dict(PDL=False),
    dict(PER_COL=True, BLOCK_T=64, num_warps=2),
    dict(BLOCK_T=32, num_warps=1), dict(BLOCK_T=64, num_warps=1), dict(BLOCK_T=128, num_warps=4),
    dict(BLOCK_T=128, num_warps=2), dict(BLOCK_T=256, num_warps=8), dict(BLOCK_T=256, num_warps=4),
    dict(RCP=True), dict(RCP=True, BLOCK_T=128, num_warps=2), dict(RCP=True, BLOCK_T=32, num_warps=1),
    dict(RCP=True, BLOCK_T=256, num_warps=8), dict(RCP=True, BLOCK_T=64, num_warps=2), dict(BLOCK_T=64, num_warps=2),
    dict(RCP=True, BLOCK_T=512, num_warps=8), dict(BLOCK_T=512, num_warps=8),
    dict(RCP=True, BLOCK_T=16, num_warps=1), dict(RCP=True, BLOCK_T=64, num_warps=1),
    # K = 6 and 9 (rows spanning 4 and 16 lanes): SPLIT (the columns by reshapes and splits, the default there)
    # against the lane reductions
    dict(SPLIT=False), dict(SPLIT=True, BLOCK_T=32), dict(SPLIT=True, BLOCK_T=64, num_warps=2),
    dict(RCP=True, BLOCK_T=8, num_warps=1), dict(RCP=True, BLOCK_T=128, num_warps=1),
    # the grid's K = 2 and 9: smaller tiles, and a row per thread
    dict(BLOCK_T=16), dict(BLOCK_T=64), dict(BLOCK_T=4), dict(PER_COL=True, BLOCK_T=32, num_warps=1),
    dict(PER_COL=True, BLOCK_T=128, num_warps=4), dict(PER_COL=True, BLOCK_T=64, num_warps=1),
]


@register(_M, "aux_fi")
def _aux_fi_cases(device, quick, grid=False):
    from tritile.torch import aux_fi as ref
    gpu = device.type == "cuda"

    def check(out, expected):  # bitwise on the CPU; the CUDA reference may differ by an ulp (spec §3.6)
        from tritile.testing import calc_diff
        assert calc_diff(out, expected) < 2e-7

    for k, e, ep in _grid.points(quick, grid, (8, 9, 8)):
        for aux in ((1, k) if grid else (1,)):
            t, _ = _grid.num_tokens(device, "aux_fi", k, e, ep, num_aux_topk=aux)
            idx = _grid.topk_idx(device, t, k, e, ep)
            params = _params(t, k, e, ep, num_aux_topk=aux)
            yield Case(params=params, impl=op("moe.aux_fi", idx, e, aux),
                       ref=lambda idx=idx, e=e, aux=aux: ref(idx, e, aux), check=check, nbytes=count_bytes(idx),
                       anchor=("aux_fi", params), latency_bound=True,
                       tune=("aux_fi", _AUX_FI_TUNE) if gpu else None)


# Default: group_count's grid (1024 entries per chunk at the anchor: 171 programs of 4 warps).
_AUX_FI_TUNE = [
    dict(BLOCK=512), dict(BLOCK=2048), dict(BLOCK=4096), dict(BLOCK=512, num_warps=2), dict(BLOCK=1024, num_warps=2),
    dict(BLOCK=1024, num_warps=8), dict(BLOCK=2048, num_warps=8), dict(BLOCK=4096, num_warps=8),
    dict(BLOCK=8192, num_warps=8), dict(BLOCK=1024, PROGRAMS_PER_SM=1), dict(BLOCK=512, PROGRAMS_PER_SM=1),
    dict(BLOCK=2048, num_warps=2),
    dict(SINGLE_MAX=0), dict(SINGLE_MAX=8192), dict(SINGLE_MAX=32768, SINGLE_WARPS=16),
    dict(SINGLE_MAX=32768, SINGLE_WARPS=32), dict(SINGLE_WARPS=8), dict(SINGLE_WARPS=32),
]


@register(_M, "group_count")
def _group_count_cases(device, quick, grid=False):
    from tritile.torch import group_count as ref
    gpu = device.type == "cuda"
    for k, e, ep in _grid.points(quick, grid, (8, 9, 8)):
        t, _ = _grid.num_tokens(device, "group_count", k, e, ep)
        idx = _grid.topk_idx(device, t, k, e, ep)
        params = _params(t, k, e, ep)
        yield Case(params=params, impl=op("moe.group_count", idx, e),
                   ref=lambda idx=idx, e=e: ref(idx, e),
                   check=assert_equal, nbytes=count_bytes(idx), anchor=("group_count", params), latency_bound=True,
                   tune=("group_count", _GROUP_COUNT_TUNE) if gpu else None)


# Candidates shared by group_count and aux_fi (both count with ``count_chunks``).  SINGLE_MAX: the largest T*K
# counted by one program that writes the result itself (no atomics, no workspace); 0 turns that path off.
_GROUP_COUNT_TUNE = [
    dict(SINGLE_MAX=0), dict(SINGLE_MAX=8192), dict(SINGLE_MAX=32768), dict(SINGLE_MAX=65536),
    dict(SINGLE_WARPS=8), dict(SINGLE_WARPS=32), dict(SINGLE_MAX=32768, SINGLE_WARPS=32),
    dict(BLOCK=512), dict(BLOCK=2048), dict(BLOCK=1024, num_warps=8), dict(BLOCK=4096, num_warps=8),
]


@register(_M, "mask_indices_by_tp")
def _mask_cases(device, quick, grid=False):
    from tritile.torch import mask_indices_by_tp as ref
    gpu = device.type == "cuda"
    for k, e, ep in _grid.points(quick, grid, (8, 9, 8)):
        for num_tp in ((2, 4, 8) if grid else (2,)):
            t, rec = _grid.num_tokens(device, "mask_indices_by_tp", k, e, ep, num_tp_ranks=num_tp)
            # TileKernels draws tp_rank at random: its record's where there is one (the cost does not depend on it)
            tp_rank = rec["params"]["tp_rank"] if rec is not None else (0 if not grid else 1)
            idx = _grid.topk_idx(device, t, k, e, ep)
            out = mask_indices_by_tp(idx, e * ep, ep, tp_rank, num_tp)
            params = _params(t, k, e, ep, num_tp_ranks=num_tp, tp_rank=tp_rank)
            args = (idx, e * ep, ep, tp_rank, num_tp)
            yield Case(params=params, impl=op("moe.mask_indices_by_tp", *args),
                       ref=lambda args=args: ref(*args),
                       check=assert_equal, nbytes=count_bytes(idx, out), anchor=("mask_indices_by_tp", params),
                       latency_bound=True, tune=("mask_indices_by_tp", _MASK_TUNE) if gpu else None)


_MASK_TUNE = [
    dict(BLOCK=1024), dict(BLOCK=512), dict(BLOCK=256), dict(BLOCK=256, num_warps=2), dict(BLOCK=512, num_warps=2),
    dict(BLOCK=128, num_warps=1), dict(BLOCK=2048, num_warps=8), dict(BLOCK=1024, num_warps=8),
]


@register(_M, "inplace_unique_group_indices")
def _unique_cases(device, quick, grid=False):
    from tritile.torch import inplace_unique_group_indices as ref
    gpu = device.type == "cuda"
    for k, e, ep in _grid.points(quick, grid, (8, 9, 8)):
        for ng in ((8, 16, 72) if grid else (8,)):
            if (e * ep) % ng:
                continue
            t, _ = _grid.num_tokens(device, "inplace_unique_group_indices", k, e, ep, num_groups=ng)
            group = _grid.topk_idx(device, t, k, e, ep) // (e * ep // ng)
            expected = group.clone()
            ref(expected, ng)
            changed = int((expected != group).sum())
            work = group.clone()  # deduplicated by the first call; later calls find nothing to change (as TileKernels)
            params = _params(t, k, e, ep, num_groups=ng)

            def impl(get, work=work, ng=ng):
                unique = get("moe.inplace_unique_group_indices")

                def call():
                    unique(work, ng)
                    return work
                return call

            yield Case(params=params, impl=impl, ref=lambda expected=expected: expected, check=assert_equal,
                       nbytes=group.numel() * 8 + changed * 4, anchor=("inplace_unique_group_indices", params),
                       latency_bound=True, tune=("inplace_unique_group_indices", _UNIQUE_TUNE) if gpu else None)


# Designs (``ROWS``): 0 = [BLOCK_T, BLOCK_K] tile with a pairwise [BLOCK_T, BLOCK_K, BLOCK_K] comparison; 1 = one row
# per thread, the K columns as K vectors compared pairwise in registers (no cross-lane traffic).
_UNIQUE_TUNE = [
    dict(ROWS=0), dict(ROWS=1, BLOCK_T=128, num_warps=4), dict(ROWS=1, BLOCK_T=64, num_warps=2),
    dict(ROWS=1, BLOCK_T=32, num_warps=1), dict(ROWS=1, BLOCK_T=256, num_warps=8),
    dict(ROWS=1, BLOCK_T=256, num_warps=4), dict(ROWS=0, LOOP=True, BLOCK_T=64, num_warps=2),
    dict(ROWS=0, BLOCK_T=16), dict(ROWS=0, BLOCK_T=64), dict(ROWS=0, num_warps=2), dict(ROWS=0, num_warps=8),
]
