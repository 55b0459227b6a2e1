"""tritile.ep.reduce.combine_reduce against tritile.ep.ref.combine_reduce_ref, bit for bit."""

import pytest
import torch

from tritile.ep.layout import dispatch_layout
from tritile.ep.reduce import combine_reduce
from tritile.ep.ref import combine_reduce_ref
from tritile.testing import assert_equal, pick

CASES = pick(
    cpu=[(0, 2, 8, 2, 64), (1, 1, 4, 4, 33), (29, 4, 16, 4, 72), (40, 3, 6, 3, 128), (17, 2, 8, 2, 1)],
    gpu=[(0, 8, 256, 2, 7168), (4096, 8, 256, 2, 7168), (8192, 8, 256, 2, 7168), (4001, 6, 64, 8, 2048)])


@pytest.mark.parametrize("t,k,num_experts,num_ranks,hidden", CASES)
@pytest.mark.parametrize("num_bias", [0, 1, 2])
@pytest.mark.parametrize("fixed", [False, True])
def test_combine_reduce(device, t, k, num_experts, num_ranks, hidden, num_bias, fixed):
    idx = torch.rand((t, num_experts)).topk(k, dim=1).indices if t else torch.zeros((0, k), dtype=torch.int64)
    if t:
        idx[torch.rand((t, k)) < 0.3] = -1
    per_rank, _, _, slot, _ = dispatch_layout(idx.to(device), num_experts, num_ranks)
    if fixed:
        cap = t + 1
        base = torch.arange(num_ranks, dtype=torch.int32, device=device) * cap
        rows = num_ranks * cap
    else:
        base = (per_rank.cumsum(0) - per_rank).to(torch.int32)
        rows = int(per_rank.sum())
    buf = (torch.randn((rows, hidden + 2), device=device) * 4).to(torch.bfloat16)[:, :hidden]  # strided rows
    wbuf = torch.rand((rows, k), device=device)
    biases = [torch.randn((t, hidden), device=device).to(torch.bfloat16) for _ in range(num_bias)]
    b0 = biases[0] if num_bias > 0 else None
    b1 = biases[1] if num_bias > 1 else None
    out, wout = combine_reduce(buf, slot, base, b0, b1, wbuf)
    ref, wref = combine_reduce_ref(buf, slot, base, b0, b1, wbuf)
    assert_equal(out, ref, "combined_x")
    assert_equal(wout, wref, "combined_topk_weights")
    out2, w2 = combine_reduce(buf, slot, base)
    assert w2 is None
    assert_equal(out2, combine_reduce_ref(buf, slot, base)[0], "combined_x (no bias, no weights)")


def test_combine_reduce_bf16_edges(device):
    """Rounding ties, subnormals, signed zeros and infinities go through the same float32 adds."""
    slot = torch.tensor([[0, 0], [1, -1], [-1, 1], [2, 2]], dtype=torch.int32, device=device)
    base = torch.tensor([0, 3], dtype=torch.int32, device=device)
    vals = torch.tensor([[1.0, 1e-40, -0.0], [2.0 ** -8, -1e-39, float("inf")], [3.0, 0.0, 1.0],
                         [1.0, 1e-40, -0.0], [2.0 ** -9, 1e-39, -0.0], [-3.0, 5.0, 2.0]], device=device)
    buf = vals.to(torch.bfloat16)
    out, _ = combine_reduce(buf, slot, base)
    ref, _ = combine_reduce_ref(buf, slot, base)
    assert_equal(out, ref, "combined_x")


def test_combine_reduce_bad_args(device):
    slot = torch.zeros((3, 2), dtype=torch.int32, device=device)
    base = torch.zeros((2,), dtype=torch.int32, device=device)
    buf = torch.zeros((4, 8), dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="buf"):
        combine_reduce(buf.float(), slot, base)
    with pytest.raises(ValueError, match="bias0"):
        combine_reduce(buf, slot, base, torch.zeros((2, 8), dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="wbuf"):
        combine_reduce(buf, slot, base, wbuf=torch.zeros((3, 2), device=device))
    with pytest.raises(ValueError, match="buf"):
        combine_reduce(torch.zeros((8, 4), dtype=torch.bfloat16, device=device).t(), slot, base)


def test_combine_reduce_compile(device):
    slot = torch.tensor([[0, -1], [1, 0], [-1, 1]], dtype=torch.int32, device=device)
    base = torch.tensor([0, 2], dtype=torch.int32, device=device)
    buf = torch.randn((4, 16), device=device).to(torch.bfloat16)
    wbuf = torch.rand((4, 2), device=device)
    fn = torch.compile(lambda b, w: combine_reduce(b, slot, base, None, None, w), fullgraph=True,
                       backend="eager" if device.type == "cpu" else "inductor")
    out, wout = fn(buf, wbuf)
    ref, wref = combine_reduce_ref(buf, slot, base, None, None, wbuf)
    assert_equal(out, ref, "combined_x")
    assert_equal(wout, wref, "combined weights")
