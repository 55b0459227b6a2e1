"""Benchmark registrations of the MoE gating ops (TileKernels' anchor shapes on the GPU, small on the CPU).

Every case is latency-bound (a few µs): the harness also times CUDA-graph replay and host overhead."""

from __future__ import annotations

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal, count_bytes
from tritile.testing.generator import generate_topk_idx_rows

from . import (aux_fi, group_count, inplace_unique_group_indices, mask_indices_by_tp, normalize_weight,
               top2_sum_gate, topk_gate, topk_sum_and_topk_group_idx)
from .scoring import ScoringFunc

_M = "moe"


def _topk_idx(device, num_experts, num_ep_ranks, num_topk, num_tokens):
    return generate_topk_idx_rows(num_tokens, num_topk, num_experts, num_ep_ranks, device)


@register(_M, "topk_gate")
def _topk_gate_cases(device, quick):
    gpu = device.type == "cuda"
    t, e, k = (8001, 256, 8) if gpu else (67, 256, 8)
    scores = torch.randn(t, e, device=device)
    out = topk_gate(scores, k)
    from tritile.torch import stable_topk
    yield Case(params=dict(num_tokens=t, num_experts=e, num_topk=k), fn=lambda: topk_gate(scores, k),
               ref=lambda: stable_topk(scores, k), check=assert_equal, nbytes=count_bytes(scores, out),
               anchor=("topk_gate", dict(num_experts=e, num_tokens=t, num_topk=k)), latency_bound=True,
               tune=("topk_gate", _TOPK_GATE_TUNE) if gpu else None)


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
def _topk_sum_cases(device, quick):
    from tritile.torch import topk_sum_and_topk_group_idx as ref
    gpu = device.type == "cuda"
    t = 8001 if gpu else 67
    combos = [(72, 4, 1, 2)] if quick else [(e, g, n, gk) for e in (72, 256) for g in (4, 8, 12, 16) if e % g == 0
                                            for n in (1, 2) for gk in (2, 4)]
    for e, g, n, gk in combos:
        scores = torch.randn(t, g, e // g, device=device)
        out = topk_sum_and_topk_group_idx(scores, n, gk)
        params = dict(num_experts=e, num_group_sum_topk=n, num_groups=g, num_tokens=t, num_topk_groups=gk)
        yield Case(params=params, fn=lambda s_=scores, n=n, gk=gk: topk_sum_and_topk_group_idx(s_, n, gk),
                   ref=lambda s_=scores, n=n, gk=gk: ref(s_, n, gk), check=assert_equal,
                   nbytes=count_bytes(scores, out), anchor=("topk_sum_and_topk_group_idx", params), latency_bound=True)


def _anchor_tokens(device, gpu_tokens):
    return gpu_tokens if device.type == "cuda" else 301


@register(_M, "normalize_weight")
def _normalize_cases(device, quick):
    from tritile.torch import normalize_weight as ref
    ep, e, k = 8, 9, 8
    t = _anchor_tokens(device, 21876)
    w = torch.rand(t, k, device=device)
    d, nw = normalize_weight(w)
    params = dict(num_tokens=t, num_experts=e, num_ep_ranks=ep, num_topk=k)

    def check(out, expected):
        assert_equal(out[0], expected[0])
        assert_equal(out[1], expected[1])

    yield Case(params=params, fn=lambda: normalize_weight(w), ref=lambda: ref(w), check=check,
               nbytes=count_bytes(w, d, nw), anchor=("normalize_weight", params), latency_bound=True,
               tune=("normalize_weight", _NORMALIZE_TUNE) if device.type == "cuda" else None)


# Default (session 5): RCP on [32, 8] tiles x 1 warp (2.02 us CUPTI against 2.32 for the session-4 default, [128, 8]
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
    dict(RCP=True, BLOCK_T=8, num_warps=1), dict(RCP=True, BLOCK_T=128, num_warps=1),
]


@register(_M, "aux_fi")
def _aux_fi_cases(device, quick):
    from tritile.torch import aux_fi as ref
    ep, e, k, aux = 8, 9, 8, 1
    t = _anchor_tokens(device, 21788)
    idx = _topk_idx(device, e, ep, k, t)
    params = dict(num_tokens=t, num_experts=e, num_ep_ranks=ep, num_topk=k, num_aux_topk=aux)

    def check(out, expected):  # bitwise on the CPU; the CUDA reference may differ by an ulp (spec §3.6)
        from tritile.testing import calc_diff
        assert calc_diff(out, expected) < 2e-7

    yield Case(params=params, fn=lambda: aux_fi(idx, e, aux), ref=lambda: ref(idx, e, aux), check=check,
               nbytes=count_bytes(idx), anchor=("aux_fi", params), latency_bound=True,
               tune=("aux_fi", _AUX_FI_TUNE) if device.type == "cuda" else None)


# Default: group_count's grid (1024 entries per chunk at the anchor: 171 programs of 4 warps).
_AUX_FI_TUNE = [
    dict(BLOCK=512), dict(BLOCK=2048), dict(BLOCK=4096), dict(BLOCK=512, num_warps=2), dict(BLOCK=1024, num_warps=2),
    dict(BLOCK=1024, num_warps=8), dict(BLOCK=2048, num_warps=8), dict(BLOCK=4096, num_warps=8),
    dict(BLOCK=8192, num_warps=8), dict(BLOCK=1024, PROGRAMS_PER_SM=1), dict(BLOCK=512, PROGRAMS_PER_SM=1),
    dict(BLOCK=2048, num_warps=2),
]


@register(_M, "group_count")
def _group_count_cases(device, quick):
    from tritile.torch import group_count as ref
    ep, e, k = 8, 9, 8
    t = _anchor_tokens(device, 21862)
    idx = _topk_idx(device, e, ep, k, t)
    params = dict(num_tokens=t, num_experts=e, num_ep_ranks=ep, num_topk=k)
    yield Case(params=params, fn=lambda: group_count(idx, e), ref=lambda: ref(idx, e), check=assert_equal,
               nbytes=count_bytes(idx), anchor=("group_count", params), latency_bound=True)


@register(_M, "mask_indices_by_tp")
def _mask_cases(device, quick):
    from tritile.torch import mask_indices_by_tp as ref
    ep, e, k, tp_rank, num_tp = 8, 9, 8, 0, 2
    t = _anchor_tokens(device, 21785)
    idx = _topk_idx(device, e, ep, k, t)
    out = mask_indices_by_tp(idx, e * ep, ep, tp_rank, num_tp)
    params = dict(num_tokens=t, num_experts=e, num_ep_ranks=ep, num_topk=k, num_tp_ranks=num_tp, tp_rank=tp_rank)
    yield Case(params=params, fn=lambda: mask_indices_by_tp(idx, e * ep, ep, tp_rank, num_tp),
               ref=lambda: ref(idx, e * ep, ep, tp_rank, num_tp), check=assert_equal,
               nbytes=count_bytes(idx, out), anchor=("mask_indices_by_tp", params), latency_bound=True)


@register(_M, "inplace_unique_group_indices")
def _unique_cases(device, quick):
    from tritile.torch import inplace_unique_group_indices as ref
    ep, e, k, ng = 8, 9, 8, 8
    t = _anchor_tokens(device, 21783)
    group = _topk_idx(device, e, ep, k, t) // (e * ep // ng)
    expected = group.clone()
    ref(expected, ng)
    changed = int((expected != group).sum())
    work = group.clone()  # deduplicated by the first call; later calls find nothing to change (as TileKernels)
    params = dict(num_tokens=t, num_experts=e, num_ep_ranks=ep, num_topk=k, num_groups=ng)

    def fn():
        inplace_unique_group_indices(work, ng)
        return work

    yield Case(params=params, fn=fn, ref=lambda: expected, check=assert_equal,
               nbytes=group.numel() * 8 + changed * 4, anchor=("inplace_unique_group_indices", params),
               latency_bound=True)
