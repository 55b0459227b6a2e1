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


def _count_workspaces(device):
    from tritile import runtime

    return [ws for key, ws in runtime._ZEROED.items() if key[0] == "moe_count" and ws.device == device]


def test_count_workspace_left_zeroed(device):
    """group_count and aux_fi past the one-program path accumulate in a cached workspace with no fill launch: each
    launch must leave it zeroed, so calls in a row (different sizes, bins and both ops interleaved) stay exact."""
    device = torch.device(device)
    for num_groups, rows in ((9, 2049), (300, 1500), (4, 3000), (9, 2049)):
        idx = torch.randint(-1, num_groups, (rows, 6), device=device)
        assert_equal(moe.group_count(idx, num_groups), ref(idx, num_groups))
        from tritile.torch import aux_fi as aux_ref

        assert_equal(moe.aux_fi(idx, num_groups, 6), aux_ref(idx, num_groups, 6))
        workspaces = _count_workspaces(device)
        assert workspaces, "the multi-program path did not run"
        for ws in workspaces:
            assert int(ws.count_nonzero()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and CUDA graphs")
def test_count_workspace_streams_and_graphs(device):
    """Another stream gets a buffer of its own; a captured graph gets a fresh zeroed one (its fill a graph node),
    and replays interleaved with eager calls stay exact."""
    from tritile.torch import aux_fi as aux_ref

    idx = torch.randint(-1, 72, (8001, 8), device=device)
    expected, f_ref = ref(idx, 72), aux_ref(idx, 72, 8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            got_side = moe.group_count(idx, 72)
    assert_equal(moe.group_count(idx, 72), expected)
    torch.cuda.current_stream().wait_stream(side)
    assert_equal(got_side, expected)
    assert len(_count_workspaces(torch.device(device))) >= 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_counts = moe.group_count(idx, 72)
        g_f = moe.aux_fi(idx, 72, 8)
    for _ in range(3):
        graph.replay()
        assert_equal(moe.group_count(idx, 72), expected)
        assert_equal(g_counts, expected)
        assert_equal(g_f, f_ref)
    for ws in _count_workspaces(torch.device(device)):
        assert int(ws.count_nonzero()) == 0
