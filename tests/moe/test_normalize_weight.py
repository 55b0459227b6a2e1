import pytest
import torch

import tritile.moe as moe
from tritile.testing import assert_equal
from tritile.torch import normalize_weight as ref

from _gating_utils import generate_moe_params, generate_topk_idx, param_id


@pytest.mark.parametrize("params", generate_moe_params(), ids=param_id)
def test_normalize_weight(device, params):
    num_tokens = generate_topk_idx(params, device).size(0)
    w = torch.rand(num_tokens, params["num_topk"], device=device)
    denom, norm = moe.normalize_weight(w)
    denom_ref, norm_ref = ref(w)
    assert_equal(denom, denom_ref)  # bitwise: sequential sum, IEEE division
    assert_equal(norm, norm_ref)


@pytest.mark.parametrize("num_tokens,num_topk", [(0, 8), (1, 1), (7, 3), (33, 32), (130, 9)])
def test_normalize_weight_edges(device, num_tokens, num_topk):
    w = torch.randn(num_tokens, num_topk, device=device) * torch.exp2(torch.randint(-30, 30, (num_tokens, num_topk),
                                                                                     device=device).float())
    if num_tokens > 3:
        w[0] = 0.0          # denominator 1e-20 exactly
        w[1, 0] = -0.0
        w[2, :] = 1e-30     # subnormal-free tiny values: the 1e-20 seed matters
    denom, norm = moe.normalize_weight(w)
    denom_ref, norm_ref = ref(w)
    assert denom.shape == (num_tokens,) and norm.shape == (num_tokens, num_topk)
    assert_equal(denom, denom_ref)
    assert_equal(norm, norm_ref)


def test_normalize_weight_bad_input(device):
    with pytest.raises(TypeError, match="topk_weights"):
        moe.normalize_weight(torch.rand(4, 8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="topk_weights"):
        moe.normalize_weight(torch.rand(32, device=device))
    with pytest.raises(ValueError, match="topk_weights"):
        moe.normalize_weight(torch.rand(8, 4, device=device).t())
    with pytest.raises(TypeError, match="topk_weights"):
        moe.normalize_weight([[1.0, 2.0]])


@pytest.mark.parametrize("cfg", [dict(BLOCK_T=32, num_warps=1, RCP=False), dict(BLOCK_T=128, num_warps=4, RCP=False),
                                 dict(PER_COL=True, BLOCK_T=64, num_warps=2),
                                 dict(SPLIT=True, BLOCK_T=16, num_warps=1, RCP=False),
                                 dict(SPLIT=True, BLOCK_T=32, num_warps=1, RCP=True),
                                 dict(SPLIT=False, BLOCK_T=32, num_warps=1, RCP=True)], ids=str)
@pytest.mark.parametrize("num_tokens,num_topk", [(1, 1), (7, 3), (33, 4), (45, 5), (20, 6), (70, 8), (9, 9),
                                                 (17, 16)])
def test_normalize_weight_configs(device, cfg, num_tokens, num_topk):
    """Every launch-config path (tune candidates) gives the reference's bits."""
    from tritile.runtime import override_config
    w = torch.randn(num_tokens, num_topk, device=device) * torch.exp2(torch.randint(-30, 30, (num_tokens, num_topk),
                                                                                     device=device).float())
    if num_tokens > 3:
        w[1, 0] = -0.0
        w[2, :] = 0.0
    with override_config("normalize_weight", **cfg):
        denom, norm = moe.normalize_weight(w)
    denom_ref, norm_ref = ref(w)
    assert_equal(denom, denom_ref)
    assert_equal(norm, norm_ref)


@pytest.mark.parametrize("cfg", [dict(RCP=True, BLOCK_T=32, num_warps=1), dict(RCP=True, BLOCK_T=128, num_warps=4)],
                         ids=str)
@pytest.mark.parametrize("num_tokens,num_topk,wild", [(70, 8, False), (45, 5, False), (33, 3, False), (40, 8, True),
                                                      (9, 9, True)])
def test_normalize_weight_rcp(device, cfg, num_tokens, num_topk, wild):
    """``RCP`` (a reciprocal per row and multiply-add corrections) gives the reference's bits: on routing-like
    weights (the fast branch) and on wild ones (signed zeros, huge / tiny values: the ``div_rn`` fallback)."""
    from tritile.runtime import override_config
    if wild:
        w = torch.randn(num_tokens, num_topk, device=device) * torch.exp2(
            torch.randint(-60, 60, (num_tokens, num_topk), device=device).float())
        w[1, 0] = -0.0
        w[2, :] = 0.0
    else:
        w = torch.rand(num_tokens, num_topk, device=device) ** 4
        w[1, 0] = -0.0
        w[3, 1] = 0.0
    with override_config("normalize_weight", **cfg):
        denom, norm = moe.normalize_weight(w)
    denom_ref, norm_ref = ref(w)
    assert_equal(denom, denom_ref)
    assert_equal(norm, norm_ref)
