import random

import pytest
import torch

import tritile.moe as moe
from tritile.testing import assert_equal
from tritile.torch import mask_indices_by_tp as ref

from _gating_utils import generate_moe_params, generate_topk_idx, param_id


@pytest.mark.parametrize("params", generate_moe_params(), ids=param_id)
@pytest.mark.parametrize("num_tp_ranks", [2, 4, 8])
def test_mask_indices_by_tp(device, params, num_tp_ranks):
    idx = generate_topk_idx(params, device)
    tp_rank = random.randrange(num_tp_ranks)
    n = params["num_experts"] * params["num_ep_ranks"]
    out = moe.mask_indices_by_tp(idx, n, params["num_ep_ranks"], tp_rank, num_tp_ranks)
    assert_equal(out, ref(idx, n, params["num_ep_ranks"], tp_rank, num_tp_ranks))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n,num_ep_ranks,num_tp_ranks", [(256, 8, 2), (72, 8, 4), (288, 72, 8), (7, 7, 1), (65, 4, 3)])
def test_mask_indices_by_tp_spread(device, dtype, n, num_ep_ranks, num_tp_ranks):
    """Ids over all of [-1, n) (TileKernels' generator only yields GPU 0's experts)."""
    idx = torch.randint(-1, n, (131, 9), device=device, dtype=dtype)
    per_rank = n // num_ep_ranks
    for tp_rank in range(num_tp_ranks):
        out = moe.mask_indices_by_tp(idx, n, num_ep_ranks, tp_rank, num_tp_ranks)
        expected = ref(idx, n, num_ep_ranks, tp_rank, num_tp_ranks)
        assert_equal(out, expected)
        # explicit formula for a few entries
        for g, o in zip(idx.flatten()[:50].tolist(), out.flatten()[:50].tolist()):
            r = g // per_rank if g >= 0 else -1
            want = (r // num_tp_ranks) * per_rank + g % per_rank if g >= 0 and r % num_tp_ranks == tp_rank else -1
            assert o == want
    assert_equal(moe.mask_indices_by_tp(idx[:0], n, num_ep_ranks, 0, num_tp_ranks), idx[:0])


def test_mask_indices_by_tp_bad_input(device, monkeypatch):
    idx = torch.randint(-1, 16, (4, 2), device=device)
    f = moe.mask_indices_by_tp
    with pytest.raises(TypeError, match="indices"):
        f(idx.float(), 16, 4, 0, 2)
    with pytest.raises(ValueError, match="indices"):
        f(idx.view(-1), 16, 4, 0, 2)
    with pytest.raises(ValueError, match="indices"):
        f(torch.randint(-1, 16, (2, 4), device=device).t(), 16, 4, 0, 2)
    with pytest.raises(ValueError, match="num_ep_ranks"):
        f(idx, 16, 0, 0, 2)
    with pytest.raises(ValueError, match="num_ep_ranks"):
        f(idx, 16, 32, 0, 2)
    with pytest.raises(ValueError, match="num_tp_ranks"):
        f(idx, 16, 4, 0, 0)
    with pytest.raises(ValueError, match="tp_rank"):
        f(idx, 16, 4, 2, 2)
    with pytest.raises(TypeError, match="tp_rank"):
        f(idx, 16, 4, 0.0, 2)
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="indices"):
        f(idx, 8, 4, 0, 2)
