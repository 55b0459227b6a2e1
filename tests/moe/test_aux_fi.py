import pytest
import torch

import tritile.moe as moe
from tritile.config import set_num_sms
from tritile.testing import assert_equal, calc_diff
from tritile.torch import aux_fi as ref

from _gating_utils import generate_moe_params, generate_topk_idx, param_id, sweep_num_sms


@pytest.mark.parametrize("params", generate_moe_params(), ids=param_id)
def test_aux_fi(device, params):
    topk_idx = generate_topk_idx(params, device)
    e, k = params["num_experts"], params["num_topk"]
    with sweep_num_sms() as sms_values:
        for num_aux_topk in sorted({1, k}):
            fi_ref = ref(topk_idx, e, num_aux_topk)
            for sms in sms_values:
                set_num_sms(sms)
                fi = moe.aux_fi(topk_idx, e, num_aux_topk)
                assert calc_diff(fi, fi_ref) < 2e-7   # TileKernels' check
                assert_equal(fi, fi_ref)              # and bitwise: int counts, one IEEE division


def test_aux_fi_edges(device):
    e = 7
    # 0 tokens: zeros; rows of -1 still count in T; K = 0
    assert_equal(moe.aux_fi(torch.empty(0, 4, dtype=torch.int64, device=device), e, 2),
                 torch.zeros(e, device=device))
    idx = torch.full((5, 3), -1, dtype=torch.int64, device=device)
    idx[0] = torch.tensor([0, 6, 6])
    assert_equal(moe.aux_fi(idx, e, 3), ref(idx, e, 3))
    assert_equal(moe.aux_fi(torch.empty(4, 0, dtype=torch.int64, device=device), e, 1), torch.zeros(e, device=device))
    big = torch.randint(-1, e, (2049, 9), device=device)  # several programs on the CPU too
    with sweep_num_sms() as sms_values:
        for sms in sms_values:
            set_num_sms(sms)
            assert_equal(moe.aux_fi(big, e, 9), ref(big, e, 9))


def test_aux_fi_bad_input(device, monkeypatch):
    idx = torch.randint(-1, 8, (4, 2), device=device)
    with pytest.raises(TypeError, match="topk_idx"):
        moe.aux_fi(idx.int(), 8, 1)
    with pytest.raises(ValueError, match="topk_idx"):
        moe.aux_fi(idx.view(-1), 8, 1)
    with pytest.raises(ValueError, match="topk_idx"):
        moe.aux_fi(torch.randint(-1, 8, (2, 4), device=device).t(), 8, 1)
    with pytest.raises(ValueError, match="num_experts"):
        moe.aux_fi(idx, 0, 1)
    with pytest.raises(ValueError, match="num_aux_topk"):
        moe.aux_fi(idx, 8, 0)
    with pytest.raises(TypeError, match="num_aux_topk"):
        moe.aux_fi(idx, 8, 1.0)
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="topk_idx"):
        moe.aux_fi(idx, 4, 1)
