"""Benchmark registrations of the MoE gating ops (TileKernels' anchor shapes on the GPU, small on the CPU; with
``grid=True`` TileKernels' whole benchmark grid, ``_grid``).

Every case is latency-bound (a few µs): the harness also times CUDA-graph replay and host overhead."""

from __future__ import annotations

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal, count_bytes

from tritile.moe import (aux_fi, group_count, inplace_unique_group_indices, mask_indices_by_tp, normalize_weight,
               top2_sum_gate, topk_gate, topk_sum_and_topk_group_idx)
from . import _grid
from tritile.moe.scoring import ScoringFunc

_M = "moe"


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
                   fn=lambda scores=scores, k=k: topk_gate(scores, k),
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
                       fn=lambda args=args, kw=kw, unm=unm: top2_sum_gate(*args, **kw, unmapped_topk_idx=unm),
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
        yield Case(params=params, fn=lambda s_=scores, n=n, gk=gk: topk_sum_and_topk_group_idx(s_, n, gk),
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
        yield Case(params=params, fn=lambda w=w: normalize_weight(w), ref=lambda w=w: ref(w), check=check,
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
            yield Case(params=params, fn=lambda idx=idx, e=e, aux=aux: aux_fi(idx, e, aux),
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
        yield Case(params=params, fn=lambda idx=idx, e=e: group_count(idx, e), ref=lambda idx=idx, e=e: ref(idx, e),
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
            yield Case(params=params, fn=lambda args=args: mask_indices_by_tp(*args), ref=lambda args=args: ref(*args),
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

            def fn(work=work, ng=ng):
                inplace_unique_group_indices(work, ng)
                return work

            yield Case(params=params, fn=fn, ref=lambda expected=expected: expected, check=assert_equal,
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
