"""``sinkhorn_normalize`` (forward + unrolled backward) against the reference and its autograd."""

import pytest
import torch

from tritile.modeling.mhc.ops.sinkhorn import sinkhorn_normalize
from tritile.testing import pick
from tritile.torch.mhc import _sinkhorn_bwd_tk, _sinkhorn_fwd_tk, sinkhorn_normalize_ref


def _tester(impl, x, grad, repeat, eps):
    x_ = x.clone().requires_grad_()
    out = impl(x_, repeat, eps)
    out.backward(grad)
    return out, x_.grad


@pytest.mark.parametrize("n0,n1", pick(cpu=[(1, 1), (2, 37)],
                                       gpu=[(n0, n1) for n0 in (1, 2) for n1 in (1, 1024, 4096)]))
def test_sinkhorn_comprehensive(device, n0, n1):
    x = torch.randn(n0, n1, 4, 4, device=device)
    grad = torch.randn(n0, n1, 4, 4, device=device)
    out, g = _tester(sinkhorn_normalize, x, grad, 10, 1e-6)
    out_ref, g_ref = _tester(sinkhorn_normalize_ref, x, grad, 10, 1e-6)
    torch.testing.assert_close(out, out_ref)  # default fp32 tolerance, as TileKernels
    torch.testing.assert_close(g, g_ref)
    # TileKernels' order, bit for bit on every backend (same exp: libdevice's on the GPU, numpy's on the CPU)
    assert torch.equal(out, _sinkhorn_fwd_tk(x, 10, 1e-6))
    assert torch.equal(g, _sinkhorn_bwd_tk(x, grad, 10, 1e-6))
    cols = out.sum(-2)
    assert torch.all((cols - 1).abs() < 1e-4)


@pytest.mark.parametrize("repeat,n,eps", [(1, 4, 1e-6), (3, 4, 1e-3), (2, 3, 1e-6), (2, 8, 1e-6), (1, 1, 1e-6),
                                          (10, 3, 1e-6), (10, 6, 1e-6), (20, 5, 1e-6)])
def test_sinkhorn_repeat_and_size(device, repeat, n, eps):
    x = torch.randn(5, 3, n, n, device=device) * 2
    grad = torch.randn(5, 3, n, n, device=device)
    out, g = _tester(sinkhorn_normalize, x, grad, repeat, eps)
    out_ref, g_ref = _tester(sinkhorn_normalize_ref, x, grad, repeat, eps)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(g, g_ref)
    assert torch.equal(out, _sinkhorn_fwd_tk(x, repeat, eps))  # n not a power of two: butterflies over zero padding
    assert torch.equal(g, _sinkhorn_bwd_tk(x, grad, repeat, eps))


def test_sinkhorn_zero_tokens_and_strides(device):
    x = torch.randn(0, 4, 4, device=device, requires_grad=True)
    out = sinkhorn_normalize(x)
    assert out.shape == (0, 4, 4)
    out.sum().backward()
    assert x.grad.shape == (0, 4, 4)
    # a non-contiguous input (transposed matrices) and an expanded gradient
    base = torch.randn(6, 4, 4, device=device)
    xt = base.transpose(-1, -2).requires_grad_()
    out = sinkhorn_normalize(xt, 2)
    out.backward(torch.ones(1, 4, 1, device=device).expand(6, 4, 4))
    xr = base.transpose(-1, -2).contiguous().requires_grad_()
    out_ref = sinkhorn_normalize_ref(xr, 2)
    out_ref.backward(torch.ones(6, 4, 4, device=device))
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(xt.grad, xr.grad)


def test_sinkhorn_bad_input(device):
    with pytest.raises(TypeError, match="x"):
        sinkhorn_normalize(torch.randn(2, 4, 4, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        sinkhorn_normalize(torch.randn(2, 4, 3, device=device))
    with pytest.raises(ValueError, match="x"):
        sinkhorn_normalize(torch.randn(4, device=device))
    with pytest.raises(ValueError, match="repeat"):
        sinkhorn_normalize(torch.randn(2, 4, 4, device=device), repeat=0)
    with pytest.raises(TypeError, match="repeat"):
        sinkhorn_normalize(torch.randn(2, 4, 4, device=device), repeat=2.0)
    with pytest.raises(ValueError, match="eps must be positive"):
        sinkhorn_normalize(torch.randn(2, 4, 4, device=device), eps=-1e-6)


def test_sinkhorn_compile(device):
    x = torch.randn(3, 4, 4, device=device)
    grad = torch.randn(3, 4, 4, device=device)
    fn = torch.compile(lambda t: sinkhorn_normalize(t, 3, 1e-6), fullgraph=True,
                       backend=pick(cpu="eager", gpu="inductor"))
    out, g = _tester(lambda t, r, e: fn(t), x, grad, 3, 1e-6)
    out_e, g_e = _tester(sinkhorn_normalize, x, grad, 3, 1e-6)
    assert torch.equal(out, out_e)
    assert torch.equal(g, g_e)


def test_sinkhorn_without_a_graph(device):
    """With nothing to differentiate the op launches its kernel without an autograd node: the same bits as the
    recorded forward (strided input included) and no ``grad_fn``."""
    x = torch.randn(3, 5, 4, 8, device=device)[..., ::2]
    with_graph = sinkhorn_normalize(x.clone().requires_grad_(), 10, 1e-6)
    with torch.no_grad():
        off = sinkhorn_normalize(x.clone().requires_grad_(), 10, 1e-6)
    for out in (sinkhorn_normalize(x, 10, 1e-6), off):
        assert out.grad_fn is None and out.shape == x.shape
        assert torch.equal(out, with_graph.detach())
