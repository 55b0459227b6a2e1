import pytest
import torch

import tritile.moe as moe
from tritile.testing import assert_equal, generate_num_tokens
from tritile.torch import stable_topk

_EK = [(72, 6), (32, 6), (64, 6), (96, 6), (16, 6), (36, 6), (108, 6), (128, 6), (144, 6), (256, 8)]


@pytest.mark.parametrize("num_experts,num_topk", _EK)
def test_topk_gate(device, num_experts, num_topk):
    for num_tokens in generate_num_tokens(cpu=(0, 3, 130)):
        scores = torch.randn(num_tokens, num_experts, device=device)
        out = moe.topk_gate(scores, num_topk)
        assert_equal(out, stable_topk(scores, num_topk))  # column order matters


def test_topk_gate_ties_and_specials(device):
    e, k = 33, 33  # odd width, a partial block, every expert taken
    scores = torch.randn(9, e, device=device)
    scores[0] = 0.0                                    # all tied: index order
    scores[1, ::3] = -0.0                              # -0.0 ties with +0.0
    scores[1, 1::3] = 0.0
    scores[2, ::2] = float("-inf")                     # -inf taken in index order, never twice
    scores[3] = float("-inf")
    scores[4, 5] = float("nan")                        # NaN first, as torch.sort
    scores[5, :] = scores[5, 0]
    scores[6] = torch.randint(-2, 3, (e,), device=device).float()  # many ties
    out = moe.topk_gate(scores, k)
    assert_equal(out, stable_topk(scores, k))
    assert_equal(out[0], torch.arange(e, device=device))
    assert_equal(moe.topk_gate(scores, 1), stable_topk(scores, 1))


def test_topk_gate_bad_input(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(TypeError, match="scores"):
        moe.topk_gate(x.double(), 2)
    with pytest.raises(ValueError, match="scores"):
        moe.topk_gate(x.view(4, 4, 4), 2)
    with pytest.raises(ValueError, match="scores"):
        moe.topk_gate(x.t(), 2)
    with pytest.raises(ValueError, match="num_topk"):
        moe.topk_gate(x, 17)
    with pytest.raises(ValueError, match="num_topk"):
        moe.topk_gate(x, 0)
    with pytest.raises(TypeError, match="num_topk"):
        moe.topk_gate(x, 2.0)
    with pytest.raises(TypeError, match="scores"):
        moe.topk_gate(x.tolist(), 2)


@pytest.mark.parametrize("cfg", [dict(KEY32=False), dict(KEY32=False, SPLIT=True, BLOCK_T=1, num_warps=1),
                                 dict(KEY32=False, SPLIT=True, BLOCK_T=2, num_warps=2),
                                 dict(KEY32=True, SPLIT=True, BLOCK_T=2, num_warps=1),
                                 dict(KEY32=True, SPLIT=True, BLOCK_T=4, num_warps=4),
                                 dict(KEY32=True, SPLIT=False, BLOCK_T=1, num_warps=2)])
@pytest.mark.parametrize("num_experts,num_topk", [(256, 8), (72, 6), (33, 33)])
def test_topk_gate_configs(device, cfg, num_experts, num_topk):
    """Both arg-max forms (64-bit packed keys, two 32-bit passes), split and plain rows: the same bits, ties included."""
    from tritile.runtime import override_config
    scores = torch.randn(37, num_experts, device=device)
    scores[0] = 0.0
    scores[1, ::3] = -0.0
    scores[2, ::2] = float("-inf")
    scores[3, 5] = float("nan")
    scores[4] = torch.randint(-2, 3, (num_experts,), device=device).float()
    with override_config("topk_gate", **cfg):
        assert_equal(moe.topk_gate(scores, num_topk), stable_topk(scores, num_topk))
