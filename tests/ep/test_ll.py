"""tritile.ep.ll.ll_positions against tritile.ep.ref.ll_positions_ref, bit for bit."""

import pytest
import torch

from tritile.ep.ll import ll_positions
from tritile.ep.ref import ll_positions_ref
from tritile.testing import assert_equal, pick

CASES = pick(cpu=[(4, 2, 5, 3), (3, 3, 7, 2), (1, 2, 1, 1), (2, 4, 3, 4), (5, 2, 33, 2)],
             gpu=[(128, 2, 128, 8), (36, 8, 128, 8), (32, 8, 256, 8), (128, 2, 1, 8)])


def _recv(num_local, num_ranks, cap, k, device, dtype):
    idx = torch.full((num_ranks * cap, k), -1, dtype=torch.int64)
    for s in range(num_ranks):
        c = int(torch.randint(0, cap + 1, ()))
        for i in range(c):  # distinct local ids (or -1) per row, valid rows first in each block
            row = torch.randperm(num_local + k)[:k]
            idx[s * cap + i] = torch.where(row < num_local, row, -1)
    src = torch.randint(0, 1000, (num_ranks * cap,), dtype=torch.int32)
    return idx.to(dtype).to(device), src.to(device)


@pytest.mark.parametrize("num_local,num_ranks,cap,k", CASES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_ll_positions(device, num_local, num_ranks, cap, k, dtype):
    idx, src = _recv(num_local, num_ranks, cap, k, device, dtype)
    got = ll_positions(idx, src, num_local, num_ranks, cap)
    ref = ll_positions_ref(idx, src, num_local, num_ranks, cap)
    for name, a, b in zip(("pos", "recv_count", "src_info", "layout_range"), got, ref):
        assert_equal(a, b, name)


def test_ll_positions_all_one_expert(device):
    idx = torch.zeros((2 * 4, 1), dtype=torch.int32, device=device)  # every row selects local expert 0
    src = torch.arange(8, dtype=torch.int32, device=device)
    pos, count, info, rng = ll_positions(idx, src, 2, 2, 4)
    assert count.tolist() == [8, 0]
    assert pos.flatten().tolist() == list(range(8))
    assert info[0].tolist() == list(range(8)) and info[1].tolist() == [-1] * 8
    assert rng[0].tolist() == [4, (4 << 32) | 4] and rng[1].tolist() == [0, 0]


def test_ll_positions_bad_args(device):
    idx = torch.zeros((6, 2), dtype=torch.int32, device=device)
    src = torch.zeros((6,), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="R\\*M"):
        ll_positions(idx, src, 2, 2, 4)
    with pytest.raises(TypeError, match="recv_idx"):
        ll_positions(idx.float(), src, 2, 2, 3)


def test_ll_positions_compile(device):
    idx, src = _recv(3, 2, 4, 2, device, torch.int32)
    fn = torch.compile(lambda i, s: ll_positions(i, s, 3, 2, 4), fullgraph=True,
                       backend="eager" if device.type == "cpu" else "inductor")
    for a, b in zip(fn(idx, src), ll_positions_ref(idx, src, 3, 2, 4)):
        assert torch.equal(a, b)
