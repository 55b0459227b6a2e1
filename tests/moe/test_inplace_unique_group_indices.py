import pytest
import torch

import tritile.moe as moe
from tritile.config import set_num_sms
from tritile.testing import assert_equal
from tritile.torch import inplace_unique_group_indices as ref

from _gating_utils import generate_moe_params, generate_topk_idx, param_id, sweep_num_sms


# num_groups in {8, 16, 72} where the total expert count splits into that many groups (as TileKernels)
_CASES = [(p, ng) for p in generate_moe_params() for ng in (8, 16, 72)
          if (p["num_experts"] * p["num_ep_ranks"]) % ng == 0]


@pytest.mark.parametrize("params,num_groups", _CASES, ids=lambda v: param_id(v) if isinstance(v, dict) else str(v))
def test_inplace_unique_group_indices(device, params, num_groups):
    e_total = params["num_experts"] * params["num_ep_ranks"]
    group = generate_topk_idx(params, device) // (e_total // num_groups)  # -1 stays -1
    expected = group.clone()
    ref(expected, num_groups)
    with sweep_num_sms() as sms_values:
        for sms in sms_values:
            set_num_sms(sms)
            g = group.clone()
            assert moe.inplace_unique_group_indices(g, num_groups) is None
            assert_equal(g, expected)


@pytest.mark.parametrize("num_tokens,num_topk", [(0, 4), (1, 1), (7, 9), (130, 8), (33, 32)])
def test_inplace_unique_edges(device, num_tokens, num_topk):
    g = torch.randint(-3, 6, (num_tokens, num_topk), device=device)  # many repeats; -2/-3 never change
    expected = g.clone()
    ref(expected, 6)
    ptr = g.data_ptr()
    moe.inplace_unique_group_indices(g, 6)
    assert g.data_ptr() == ptr
    assert_equal(g, expected)
    if num_tokens and num_topk > 1:
        assert bool((g[g < -1] < -1).all())


def test_inplace_unique_bad_input(device):
    g = torch.randint(-1, 8, (4, 3), device=device)
    f = moe.inplace_unique_group_indices
    with pytest.raises(TypeError, match="group_indices"):
        f(g.int(), 8)
    with pytest.raises(ValueError, match="group_indices"):
        f(g.view(-1), 8)
    with pytest.raises(ValueError, match="group_indices"):
        f(torch.randint(-1, 8, (3, 4), device=device).t(), 8)
    with pytest.raises(ValueError, match="num_groups"):
        f(g, 129)
    with pytest.raises(ValueError, match="num_groups"):
        f(g, 0)
