"""``expand_to_mhc`` (forward + backward), its launcher factories, ``out=``, zero tokens, bad input, torch.compile."""

import pytest
import torch

from tritile.mhc.expand_kernel import expand_to_mhc_bwd_tl, expand_to_mhc_fwd_tl
from tritile.modeling.mhc.ops.expand import expand_to_mhc
from tritile.testing import pick
from tritile.torch.mhc import expand_to_mhc_ref


def _tester(impl, hidden, grad, mhc):
    x = hidden.clone().requires_grad_()
    out = impl(x, mhc)
    out.backward(grad)
    return out, x.grad


@pytest.mark.parametrize("n0,n1,mhc,H", pick(
    cpu=[(1, 1, 4, 64), (2, 13, 2, 80), (1, 7, 8, 48), (2, 3, 4, 1280)],
    gpu=[(n0, n1, m, h) for n0 in (1, 2) for n1 in (1024, 4096) for m in (2, 4, 8) for h in (1280, 2560, 7168)]))
def test_expand_comprehensive(device, n0, n1, mhc, H):
    hidden = torch.randn(n0, n1, H, dtype=torch.bfloat16, device=device)
    grad = torch.randn(n0, n1, mhc, H, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        out = expand_to_mhc(hidden, mhc)
    assert torch.equal(out, expand_to_mhc_ref(hidden, mhc))
    out, g = _tester(expand_to_mhc, hidden, grad, mhc)
    out_ref, g_ref = _tester(expand_to_mhc_ref, hidden, grad, mhc)
    assert torch.equal(out, out_ref)
    torch.testing.assert_close(g, g_ref)
    # the kernel's stream sum: fp32 in order m = 0..n-1, one rounding
    acc = grad[..., 0, :].float()
    for m in range(1, mhc):
        acc = acc + grad[..., m, :].float()
    assert torch.equal(g, acc.bfloat16())


def test_expand_leading_dims_and_zero_tokens(device):
    for shape in [(0, 64), (2, 0, 64), (3, 2, 5, 64), (64,)]:
        hidden = torch.randn(*shape, dtype=torch.bfloat16, device=device, requires_grad=True)
        out = expand_to_mhc(hidden, 4)
        assert out.shape == tuple(shape[:-1]) + (4, shape[-1])
        assert torch.equal(out, expand_to_mhc_ref(hidden.detach(), 4))
        g = torch.randn_like(out)
        out.backward(g)
        assert hidden.grad.shape == hidden.shape
        torch.testing.assert_close(hidden.grad, g.float().sum(-2).bfloat16())


def test_expand_out(device):
    hidden = torch.randn(2, 5, 96, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = torch.empty(2, 5, 4, 96, dtype=torch.bfloat16, device=device)
    res = expand_to_mhc(hidden, 4, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out, expand_to_mhc_ref(hidden.detach(), 4))
    res.sum().backward()
    assert torch.equal(hidden.grad, torch.full_like(hidden, 4.0))


def test_expand_factories(device):
    x = torch.randn(9, 80, dtype=torch.bfloat16, device=device)
    out = torch.empty(9, 2, 80, dtype=torch.bfloat16, device=device)
    expand_to_mhc_fwd_tl(80, 2)(x, out)
    assert torch.equal(out, expand_to_mhc_ref(x, 2))
    g = torch.randn(9, 2, 80, dtype=torch.bfloat16, device=device)
    gx = torch.empty(9, 80, dtype=torch.bfloat16, device=device)
    expand_to_mhc_bwd_tl(80, 2)(g, gx)
    assert torch.equal(gx, (g[:, 0].float() + g[:, 1].float()).bfloat16())
    with pytest.raises(ValueError, match="out"):
        expand_to_mhc_fwd_tl(80, 4)(x, out)


def test_expand_bad_input(device):
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="hidden"):
        expand_to_mhc(x.float(), 4)
    with pytest.raises(ValueError, match="hidden"):
        expand_to_mhc(torch.randn(64, 4, dtype=torch.bfloat16, device=device).t(), 4)
    with pytest.raises(ValueError, match="mhc_mult"):
        expand_to_mhc(x, 0)
    with pytest.raises(TypeError, match="mhc_mult"):
        expand_to_mhc(x, 4.0)
    with pytest.raises(ValueError, match="out"):
        expand_to_mhc(x, 4, out=torch.empty(4, 2, 64, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="out"):
        expand_to_mhc(x, 4, out=torch.empty(4, 4, 64, device=device))
    with pytest.raises(ValueError, match="out"):
        expand_to_mhc(x, 4, out=torch.empty(4, 64, 4, dtype=torch.bfloat16, device=device).transpose(1, 2))
    with pytest.raises(TypeError, match="hidden"):
        expand_to_mhc([1.0], 4)


def test_expand_compile(device):
    hidden = torch.randn(2, 3, 64, dtype=torch.bfloat16, device=device)
    grad = torch.randn(2, 3, 4, 64, dtype=torch.bfloat16, device=device)
    fn = torch.compile(lambda x: expand_to_mhc(x, 4), fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    out, g = _tester(lambda x, m: fn(x), hidden, grad, 4)
    out_ref, g_ref = _tester(expand_to_mhc, hidden, grad, 4)
    assert torch.equal(out, out_ref)
    assert torch.equal(g, g_ref)


def test_expand_without_a_graph(device):
    """With nothing to differentiate the op launches its copy without an autograd node: the same bits as the
    recorded forward, into a new tensor or into ``out`` (returned), and no ``grad_fn``."""
    hidden = torch.randn(3, 5, 64, device=device).bfloat16()
    with_graph = expand_to_mhc(hidden.clone().requires_grad_(), 4)
    out = torch.empty(3, 5, 4, 64, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        off = expand_to_mhc(hidden.clone().requires_grad_(), 4)
    got_out = expand_to_mhc(hidden, 4, out=out)
    for got in (expand_to_mhc(hidden, 4), off, got_out):
        assert got.grad_fn is None and torch.equal(got, with_graph.detach())
    assert got_out.data_ptr() == out.data_ptr()
