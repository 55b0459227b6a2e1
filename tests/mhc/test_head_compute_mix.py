"""``mhc_head_compute_mix`` (forward + backward) against the reference and its autograd."""

import pytest
import torch

from tritile.config import set_num_sms, get_num_sms
from tritile.modeling.mhc.ops.head_compute_mix import mhc_head_compute_mix
from tritile.testing import pick
from tritile.torch.mhc import _head_compute_mix_bwd_tk, mhc_head_compute_mix_ref

EPS = 1e-2


def _tester(impl, x, scale, base, grad):
    x_, s_, b_ = (t.clone().requires_grad_() for t in (x, scale, base))
    out = impl(x_, s_, b_, EPS)
    out.backward(grad)
    return out, x_.grad, s_.grad, b_.grad


@pytest.mark.parametrize("n0,n1", pick(cpu=[(1, 1), (2, 37), (1, 1100)],
                                       gpu=[(n0, n1) for n0 in (1, 2) for n1 in (1024, 4096)]))
def test_head_compute_mix_comprehensive(device, n0, n1):
    x = torch.randn(n0, n1, 4, device=device)
    scale = torch.randn(1, device=device)
    base = torch.randn(4, device=device)
    grad = torch.randn(n0, n1, 4, device=device)
    res = _tester(mhc_head_compute_mix, x, scale, base, grad)
    ref = _tester(mhc_head_compute_mix_ref, x, scale, base, grad)
    for a, b in zip(res, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # TileKernels' order, bit for bit: q = (s (1 - s)) g; one row of partial sums per SM (32-token blocks, lanes
    # (token, j), chains and butterflies) added by torch.sum
    t = n0 * n1
    want = _head_compute_mix_bwd_tk(x.view(t, 4), scale, base, grad.view(t, 4), get_num_sms())
    assert torch.equal(res[1].view(t, 4), want[0])
    assert torch.equal(res[2], want[1]) and torch.equal(res[3], want[2])


def test_head_compute_mix_deterministic_and_strided(device):
    mixes = torch.randn(2, 9, 24, device=device)
    x = mixes[..., :4]  # the strided view mhc_head passes
    scale, base = torch.randn(1, device=device), torch.randn(4, device=device)
    grad = torch.randn(2, 9, 4, device=device)
    a = _tester(mhc_head_compute_mix, x, scale, base, grad)
    old = get_num_sms()
    set_num_sms(1)
    try:
        b = _tester(mhc_head_compute_mix, x.contiguous(), scale, base, grad)
    finally:
        set_num_sms(old)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    want = _head_compute_mix_bwd_tk(x.reshape(18, 4), scale, base, grad.view(18, 4), 1)
    assert torch.equal(b[2], want[1]) and torch.equal(b[3], want[2])  # the partial rows follow the SM count
    ref = _tester(mhc_head_compute_mix_ref, x, scale, base, grad)
    for u, v in zip(a, ref):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)
    c = _tester(mhc_head_compute_mix, x, scale, base, grad)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_head_compute_mix_zero_tokens(device):
    x = torch.randn(1, 0, 4, device=device, requires_grad=True)
    s = torch.randn(1, device=device, requires_grad=True)
    b = torch.randn(4, device=device, requires_grad=True)
    out = mhc_head_compute_mix(x, s, b, EPS)
    assert out.shape == (1, 0, 4)
    out.sum().backward()
    assert torch.equal(s.grad, torch.zeros(1, device=device)) and torch.equal(b.grad, torch.zeros(4, device=device))


def test_head_compute_mix_bad_input(device):
    x = torch.randn(1, 3, 4, device=device)
    s, b = torch.randn(1, device=device), torch.randn(4, device=device)
    with pytest.raises(ValueError, match="input_mix"):
        mhc_head_compute_mix(x.view(3, 4), s, b, EPS)
    with pytest.raises(ValueError, match="mhc_pre_eps must be positive"):
        mhc_head_compute_mix(x, s, b, 0.0)
    with pytest.raises(TypeError, match="input_mix"):
        mhc_head_compute_mix(x.double(), s, b, EPS)
    with pytest.raises(ValueError, match="mhc_scale"):
        mhc_head_compute_mix(x, torch.randn(2, device=device), b, EPS)
    with pytest.raises(ValueError, match="mhc_base"):
        mhc_head_compute_mix(x, s, torch.randn(3, device=device), EPS)
    with pytest.raises(TypeError, match="mhc_base"):
        mhc_head_compute_mix(x, s, b.bfloat16(), EPS)


def test_head_compute_mix_compile(device):
    x = torch.randn(1, 5, 4, device=device)
    s, b = torch.randn(1, device=device), torch.randn(4, device=device)
    grad = torch.randn(1, 5, 4, device=device)
    fn = torch.compile(mhc_head_compute_mix, fullgraph=True, backend=pick(cpu="eager", gpu="inductor"))
    for u, v in zip(_tester(fn, x, s, b, grad), _tester(mhc_head_compute_mix, x, s, b, grad)):
        assert torch.equal(u, v)


def test_head_compute_mix_without_a_graph(device):
    """With nothing to differentiate (no input requiring grad, or grad mode off) the op launches its kernel without
    an autograd node: the same bits as the recorded forward, strided input included, and no ``grad_fn``."""
    x = torch.randn(2, 9, 8, device=device)[..., ::2]
    scale, base = torch.randn(1, device=device), torch.randn(4, device=device)
    with_graph = mhc_head_compute_mix(x, scale.clone().requires_grad_(), base, EPS)
    for out in (mhc_head_compute_mix(x, scale, base, EPS),
                _no_grad(mhc_head_compute_mix, x, scale.clone().requires_grad_(), base, EPS)):
        assert out.grad_fn is None and out.shape == (2, 9, 4)
        assert torch.equal(out, with_graph.detach())


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)
