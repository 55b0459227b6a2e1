import pytest
import torch

import tritile.moe as moe
from tritile.config import set_num_sms
from tritile.testing import assert_equal
from tritile.torch import group_count as ref

from _gating_utils import generate_moe_params, generate_topk_idx, param_id, sweep_num_sms


@pytest.mark.parametrize("params", generate_moe_params(), ids=param_id)
def test_group_count(device, params):
    group_idx = generate_topk_idx(params, device)
    num_groups = params["num_experts"]
    expected = ref(group_idx, num_groups)
    with sweep_num_sms() as sms_values:
        for sms in sms_values:
            set_num_sms(sms)
            assert_equal(moe.group_count(group_idx, num_groups), expected)


@pytest.mark.parametrize("num_groups", [1, 7, 256, 300])
def test_group_count_edges(device, num_groups):
    assert_equal(moe.group_count(torch.empty(0, 3, dtype=torch.int64, device=device), num_groups),
                 torch.zeros(num_groups, dtype=torch.int32, device=device))
    idx = torch.randint(-1, num_groups, (2049, 9), device=device)  # several programs on the CPU too
    with sweep_num_sms() as sms_values:
        for sms in sms_values:
            set_num_sms(sms)
            assert_equal(moe.group_count(idx, num_groups), ref(idx, num_groups))


def test_group_count_bad_input(device, monkeypatch):
    monkeypatch.delenv("TRITILE_CHECKS", raising=False)
    idx = torch.randint(-1, 8, (4, 2), device=device)
    with pytest.raises(TypeError, match="group_idx"):
        moe.group_count(idx.float(), 8)
    with pytest.raises(ValueError, match="group_idx"):
        moe.group_count(idx.view(-1), 8)
    with pytest.raises(ValueError, match="group_idx"):
        moe.group_count(torch.randint(-1, 8, (2, 4), device=device).t(), 8)
    with pytest.raises(ValueError, match="num_groups"):
        moe.group_count(idx, 0)
    with pytest.raises(TypeError, match="num_groups"):
        moe.group_count(idx, "8")
    # out-of-range ids are ignored by default (never written out of bounds) ...
    bad = idx.clone()
    bad[0, 0] = 100
    bad[1, 0] = -5
    assert_equal(moe.group_count(bad, 8), ref(bad.clamp(max=-1).where(bad >= 8, bad), 8))
    # ... and rejected under TRITILE_CHECKS=1
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="group_idx"):
        moe.group_count(bad, 8)
