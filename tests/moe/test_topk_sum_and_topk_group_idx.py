import pytest
import torch

import tritile.moe as moe
from tritile.testing import assert_equal, generate_num_tokens
from tritile.torch import topk_sum_and_topk_group_idx as ref

_PARAMS = [(e, g, n, gk) for e in (72, 256) for g in (4, 8, 12, 16) if e % g == 0 for n in (1, 2) for gk in (2, 4)]


@pytest.mark.parametrize("num_experts,num_groups,num_topk_sum,num_topk_groups", _PARAMS)
def test_topk_sum_and_topk_group_idx(device, num_experts, num_groups, num_topk_sum, num_topk_groups):
    for num_tokens in generate_num_tokens(cpu=(0, 33, 130)):
        scores = torch.randn(num_tokens, num_groups, num_experts // num_groups, device=device)
        out = moe.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups)
        assert_equal(out, ref(scores, num_topk_sum, num_topk_groups))


@pytest.mark.parametrize("num_topk_sum", [1, 2])
def test_topk_sum_ties(device, num_topk_sum):
    g, per = 7, 5  # odd sizes: partial blocks in both directions
    scores = torch.randint(-2, 3, (65, g, per), device=device).float()
    scores[0] = 0.0
    scores[1, :, 0] = 1.0
    scores[1, 3, 1] = 1.0     # group 3: duplicate maxima -> 2 * max wins with top-2 sum
    scores[2, :, :] = -0.0
    for gk in (1, 3, g):
        out = moe.topk_sum_and_topk_group_idx(scores, num_topk_sum, gk)
        assert_equal(out, ref(scores, num_topk_sum, gk))
    assert_equal(moe.topk_sum_and_topk_group_idx(scores, num_topk_sum, g)[0], torch.arange(g, device=device))


def test_topk_sum_bad_input(device):
    x = torch.randn(4, 8, 4, device=device)
    f = moe.topk_sum_and_topk_group_idx
    with pytest.raises(ValueError, match="scores"):
        f(x.view(4, 32), 2, 2)
    with pytest.raises(TypeError, match="scores"):
        f(x.half(), 2, 2)
    with pytest.raises(ValueError, match="scores"):
        f(x.transpose(1, 2), 2, 2)
    with pytest.raises(ValueError, match="num_topk_sum"):
        f(x, 3, 2)
    with pytest.raises(ValueError, match="num_topk_sum"):
        f(torch.randn(4, 8, 1, device=device), 2, 2)
    with pytest.raises(ValueError, match="num_topk_groups"):
        f(x, 2, 9)
    with pytest.raises(ValueError, match="num_topk_groups"):
        f(x, 2, 0)
    with pytest.raises(ValueError, match="groups"):
        f(torch.randn(2, 33, 2, device=device), 1, 2)
