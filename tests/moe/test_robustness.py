"""Edge inputs of the moe ops: empty tensors with zero strides, the ``num_topk`` limit of
``inplace_unique_group_indices``, ``top2_sum_gate``'s data checks (``TRITILE_CHECKS=1``) and output buffers that
share memory with an input."""

from __future__ import annotations

import pytest
import torch

import tritile.moe as moe
from tritile.testing import assert_equal


def _zero_stride(shape, dtype, device):
    """An empty tensor whose strides are all 0 (``torch.zeros(()).expand(...)``)."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def test_empty_zero_stride_inputs(device):
    k, e = 3, 8
    idx = _zero_stride((0, k), torch.int64, device)
    assert idx.stride() == (0, 0)
    assert_equal(moe.group_count(idx, e), torch.zeros(e, dtype=torch.int32, device=device))
    assert_equal(moe.aux_fi(idx, e, 1), torch.zeros(e, device=device))
    assert moe.mask_indices_by_tp(idx, e, 2, 0, 2).shape == (0, k)
    moe.inplace_unique_group_indices(idx, 8)
    d, w = moe.normalize_weight(_zero_stride((0, k), torch.float32, device))
    assert d.shape == (0,) and w.shape == (0, k)
    assert moe.topk_gate(_zero_stride((0, e), torch.float32, device), k).shape == (0, k)
    assert moe.topk_sum_and_topk_group_idx(_zero_stride((0, 4, 2), torch.float32, device), 1, 2).shape == (0, 2)
    res = moe.get_fused_mapping(idx, e, 0, 16)
    assert res[0].shape == (0,) and res[3].shape == (0, k) and res[7] == [0] * e
    t2p = _zero_stride((0, k), torch.int32, device)
    p2e = _zero_stride((0,), torch.int32, device)
    assert moe.expand_to_fused(_zero_stride((0, 64), torch.bfloat16, device), t2p, p2e).shape == (0, 64)
    out = moe.reduce_fused(_zero_stride((0, 256), torch.float32, device), None, t2p)
    assert out.shape == (0, 256)
    idx2, w2 = moe.top2_sum_gate(_zero_stride((0, 16), torch.float32, device), torch.zeros(16, device=device),
                                 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")
    assert idx2.shape == (0, 2) and w2.shape == (0, 2)


def test_inplace_unique_topk_limit(device):
    """Up to 256 columns work (the pairwise design); more are rejected before any launch."""
    g = torch.randint(-1, 4, (2, 256), device=device)
    want = g.clone()
    from tritile.torch import inplace_unique_group_indices as ref
    ref(want, 8)
    moe.inplace_unique_group_indices(g, 8)
    assert_equal(g, want)
    with pytest.raises(ValueError, match="at most 256 columns"):
        moe.inplace_unique_group_indices(torch.zeros(2, 257, dtype=torch.int64, device=device), 8)


@pytest.mark.parametrize("rows,design", [(37, "rows"), (37, "tile"), (5, "rows"), (37, "loop")])
@pytest.mark.parametrize("num_topk", [2, 3, 9, 16])
def test_inplace_unique_designs(device, rows, design, num_topk):
    """Every design (a row per thread; the pairwise tile; the loops of wide rows) gives the reference's bits."""
    from tritile.runtime import override_config
    from tritile.torch import inplace_unique_group_indices as ref
    g = torch.randint(-3, 5, (rows, num_topk), device=device)
    want = g.clone()
    ref(want, 8)
    with override_config("inplace_unique_group_indices", ROWS=design == "rows", LOOP=design == "loop", BLOCK_T=32):
        moe.inplace_unique_group_indices(g, 8)
    assert_equal(g, want)


def _gate_args(device, e=32, x=2):
    logits, bias = torch.randn(5, e, device=device), torch.randn(e, device=device)
    pmap = torch.arange(e, dtype=torch.int32, device=device).view(-1, 1).repeat(1, x + 1)
    count = torch.ones(e, dtype=torch.int32, device=device)
    return logits, bias, pmap, count


def _gate(logits, bias, pmap, count, **kw):
    return moe.top2_sum_gate(logits, bias, 4, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "softmax", to_physical_map=pmap,
                             logical_count=count, **kw)


def test_top2_sum_gate_data_checks(device, monkeypatch):
    logits, bias, pmap, count = _gate_args(device)
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    _gate(logits, bias, pmap, count)  # valid
    bad = pmap.clone()
    bad[3, 0] = 34  # E + X = 34 physical experts
    with pytest.raises(ValueError, match="to_physical_map"):
        _gate(logits, bias, bad, count)
    bad = pmap.clone()
    bad[3, 1] = -5  # column 1 is past logical_count[3] = 1: never read, so accepted
    _gate(logits, bias, bad, count)
    zero = count.clone()
    zero[7] = 0
    with pytest.raises(ValueError, match="logical_count"):
        _gate(logits, bias, pmap, zero)
    unm = torch.zeros(5, 4, dtype=torch.int64, device=device)
    unm[2, 1] = 32
    fix = torch.zeros(5, dtype=torch.bool, device=device)
    fix[2] = True
    with pytest.raises(ValueError, match="unmapped_topk_idx"):
        _gate(logits, bias, pmap, count, fix_routing_mask=fix, unmapped_topk_idx=unm)


def test_output_buffers_must_not_overlap_inputs(device):
    logits, bias, pmap, count = _gate_args(device, e=16)
    with pytest.raises(ValueError, match="unmapped_topk_idx must not overlap"):
        _gate(logits, bias, pmap, count, unmapped_topk_idx=logits.view(torch.int64)[:, :4])
    t2p = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32, device=device)
    x = torch.randn(3, 256, device=device)
    w = torch.rand(2, 2, device=device)
    with pytest.raises(ValueError, match="out must not overlap the input x"):
        moe.reduce_fused(x, w, t2p, "", None, x[1:])
    out = torch.empty(2, 256, device=device)
    assert moe.reduce_fused(x, w, t2p, "", None, out) is out
