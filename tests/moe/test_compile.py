"""Every public moe op under ``torch.compile(fullgraph=True)``: the compiled call runs the registered custom op
(``torch.ops.tritile.moe_*``, traced through its fake kernel) and gives the eager call's bits.  CPU: the "eager"
backend; GPU: inductor.  ``get_fused_mapping``'s synchronising mode has an unbacked output length (its fake kernel's
``new_dynamic_size``) and reads its counts back as a list (``capture_scalar_outputs``)."""

from __future__ import annotations

import pytest
import torch

import tritile.moe as moe
from tritile.testing import assert_equal, is_gpu_run
from tritile.testing.generator import generate_topk_idx_rows

_BACKEND = "inductor" if is_gpu_run() else "eager"
T, K, E, EP = 13, 6, 9, 8


def _idx(d):
    return generate_topk_idx_rows(T, K, E, EP, d)


def _mapping(d, n):
    idx = _idx(d)
    return lambda: moe.get_fused_mapping(idx, E, n, 16)


def _expand(d):
    idx = _idx(d)
    p2e, _, _, t2p, *_ = moe.get_fused_mapping(idx, E, 0, 16)
    x = torch.randn(T, 64, device=d).to(torch.bfloat16)
    return lambda: moe.expand_to_fused(x, t2p, p2e)


def _expand_sf(d, col_major):
    idx = _idx(d)
    p2e, _, _, t2p, *_ = moe.get_fused_mapping(idx, E, 0, 16)
    x = torch.randint(0, 256, (T, 256), dtype=torch.uint8, device=d).view(torch.float8_e4m3fn)
    x_sf = torch.randint(120, 135, (T, 4), dtype=torch.uint8, device=d).view(torch.int32) if col_major else \
        torch.rand(T, 2, device=d)
    return lambda: moe.expand_to_fused_with_sf((x, x_sf), 128, t2p, p2e, col_major)


def _reduce(d, with_out):
    idx = _idx(d)
    _, _, _, t2p, *_ = moe.get_fused_mapping(idx, E, 0, 1)
    x = torch.randn(T * K, 256, device=d).to(torch.bfloat16)
    w, x_sf, sf = torch.rand(T, K, device=d), torch.randn(T * K, device=d), torch.randn(1, device=d)

    def call():
        out = torch.empty(T, 256, dtype=torch.float8_e4m3fn, device=d) if with_out else None
        return moe.reduce_fused((x, x_sf), w, t2p, "e4m3", sf, out)
    return call


def _unique(d):
    g0 = _idx(d) // 3

    def call():
        g = g0.clone()
        moe.inplace_unique_group_indices(g, 24)
        return g
    return call


def _top2(d):
    logits, bias = torch.randn(T, 96, device=d), torch.randn(96, device=d)  # 96 % (6 // 2) == 0
    pmap = torch.arange(98, dtype=torch.int32, device=d).view(-1, 1).expand(-1, 3).contiguous()
    count = torch.ones(98, dtype=torch.int32, device=d)
    fix = torch.zeros(T, dtype=torch.bool, device=d)
    fix[1] = True
    unm0 = torch.randint(0, 96, (T, 6), device=d)

    def call():
        unm = unm0.clone()
        idx, w = moe.top2_sum_gate(logits, bias, 6, 2, 8, True, 2, 2.5, 0, 4, 1, 2, moe.scoring.ScoringFunc.SIGMOID,
                                   fix_routing_mask=fix, to_physical_map=pmap, logical_count=count,
                                   unmapped_topk_idx=unm)
        return idx, w, unm
    return call


_CASES = {
    "topk_gate": lambda d: (lambda s=torch.randn(T, 64, device=d): moe.topk_gate(s, 6)),
    "top2_sum_gate": _top2,
    "topk_sum_and_topk_group_idx": lambda d: (
        lambda s=torch.randn(T, 8, 9, device=d): moe.topk_sum_and_topk_group_idx(s, 2, 4)),
    "normalize_weight": lambda d: (lambda w=torch.rand(T, K, device=d): moe.normalize_weight(w)),
    "aux_fi": lambda d: (lambda i=_idx(d): moe.aux_fi(i, E, 2)),
    "group_count": lambda d: (lambda i=_idx(d): moe.group_count(i, E)),
    "mask_indices_by_tp": lambda d: (lambda i=_idx(d): moe.mask_indices_by_tp(i, E * EP, EP, 1, 2)),
    "inplace_unique_group_indices": _unique,
    "get_fused_mapping": lambda d: _mapping(d, 0),
    "get_fused_mapping[no-sync]": lambda d: _mapping(d, 300),
    "expand_to_fused": _expand,
    "expand_to_fused_with_sf[row]": lambda d: _expand_sf(d, False),
    "expand_to_fused_with_sf[col]": lambda d: _expand_sf(d, True),
    "reduce_fused": lambda d: _reduce(d, False),
    "reduce_fused[out]": lambda d: _reduce(d, True),
}


def _tree_equal(got, want):
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want)
        for g, w in zip(got, want):
            _tree_equal(g, w)
    elif isinstance(want, torch.Tensor):
        assert_equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("name", list(_CASES))
def test_compile_fullgraph(device, name):
    torch._dynamo.reset()
    call = _CASES[name](device)
    want = call()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(call, backend=_BACKEND, fullgraph=True)()
    _tree_equal(got, want)
