"""tritile.ep.layout.dispatch_layout: the Triton kernels against tritile.ep.ref.dispatch_layout_ref, bit for bit."""

import pytest
import torch

from tritile.ep.layout import dispatch_layout
from tritile.ep.ref import dispatch_layout_ref
from tritile.testing import assert_equal, pick


def _topk(t, k, num_experts, num_ranks, device, masked=0.0, one_rank=False):
    idx = torch.rand((t, num_experts)).topk(k, dim=1).indices if t else torch.zeros((0, k), dtype=torch.int64)
    if masked and t:
        idx[torch.rand((t, k)) < masked] = -1
        idx[::4] = -1
    if one_rank and t:
        per = num_experts // num_ranks
        for i in range(t):
            r = i % num_ranks
            idx[i] = torch.randperm(per)[:k] + r * per
    return idx.to(device)


CASES = pick(
    cpu=[(0, 2, 8, 2), (1, 1, 4, 4), (37, 4, 16, 4), (70, 3, 6, 3), (33, 8, 16, 2), (5, 2, 16, 8)],
    gpu=[(0, 8, 256, 2), (4096, 8, 256, 2), (8192, 8, 256, 2), (4001, 6, 256, 8), (128, 8, 288, 8),
         (8192, 8, 256, 64)])


@pytest.mark.parametrize("t,k,num_experts,num_ranks", CASES)
@pytest.mark.parametrize("mode", ["random", "masked", "one_rank"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_dispatch_layout(device, t, k, num_experts, num_ranks, mode, dtype):
    if mode == "one_rank":
        k = min(k, num_experts // num_ranks)  # every expert of a token on one rank
    idx = _topk(t, k, num_experts, num_ranks, device, masked=0.3 if mode == "masked" else 0.0,
                one_rank=mode == "one_rank").to(dtype)
    out = dispatch_layout(idx, num_experts, num_ranks)
    ref = dispatch_layout_ref(idx, num_experts, num_ranks)
    for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "send_slot", "bad"),
                          out, ref):
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            assert_equal(a, b, name)
    if mode == "one_rank" and t:
        assert bool((out[2].sum(1) == 1).all())


def test_dispatch_layout_strided_and_bad_ids(device):
    idx = _topk(20, 3, 12, 3, device)
    wide = torch.full((20, 6), 5, dtype=torch.int64, device=device)
    wide[:, ::2] = idx
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    for a, b in zip(dispatch_layout(strided, 12, 3), dispatch_layout_ref(idx, 12, 3)):
        assert torch.equal(a, b)
    bad = idx.clone()
    bad[3, 1] = 12
    bad[5, 0] = -7
    bad[7, 2] = (1 << 32) + 1  # an int32 cast would wrap these two into [0, 12)
    bad[9, 0] = -(1 << 32)
    out = dispatch_layout(bad, 12, 3)
    ref = dispatch_layout_ref(bad, 12, 3)
    assert int(out[4]) == 4 == int(ref[4])
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_dispatch_layout_checks_env(device, monkeypatch):
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    bad = _topk(6, 2, 8, 2, device)
    bad[0, 0] = 9
    with pytest.raises(ValueError, match="topk_idx"):
        dispatch_layout(bad, 8, 2)


def test_dispatch_layout_bad_args(device):
    idx = _topk(4, 2, 8, 2, device)
    with pytest.raises(TypeError, match="topk_idx"):
        dispatch_layout(idx.float(), 8, 2)
    with pytest.raises(ValueError, match="topk_idx"):
        dispatch_layout(idx[0], 8, 2)
    with pytest.raises(ValueError, match="divisible"):
        dispatch_layout(idx, 9, 2)
    with pytest.raises(ValueError, match="num_experts"):
        dispatch_layout(idx, 0, 2)


def test_dispatch_layout_compile(device):
    idx = _topk(9, 2, 8, 2, device)
    fn = torch.compile(lambda i: dispatch_layout(i, 8, 2), fullgraph=True, backend="eager" if device.type == "cpu"
                       else "inductor")
    for a, b in zip(fn(idx), dispatch_layout_ref(idx, 8, 2)):
        assert torch.equal(a, b)
