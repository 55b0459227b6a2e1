"""The autograd layer ``tritile.modeling.engram.engram_gate`` against autograd through ``engram_gate_ref``."""

import pytest
import torch

from tritile.engram import engram_gate_bwd, engram_gate_fwd, fused_weight
from tritile.modeling.engram import EngramGateFn, engram_gate
from tritile.testing import assert_equal, calc_diff, pick
from tritile.torch.engram import engram_gate_ref

from engram_testlib import CLAMP, EPS


def _leaves(shape, hc, H, device):
    x = torch.randn(*shape, hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    k = torch.randn(*shape, hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    v = torch.randn(*shape, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    return x, k, v, wh, we


def _ref_grads(x, k, v, wh, we, grad_out):
    xr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (x, k, v))
    whr, wer = (t.detach().float().requires_grad_(True) for t in (wh, we))
    out = engram_gate_ref(xr, kr, vr, whr, wer, CLAMP, EPS)
    out.backward(grad_out)
    return out, (xr.grad, kr.grad, vr.grad, whr.grad, wer.grad)


@pytest.mark.parametrize("shape,hc,H", pick(cpu=[((2, 5), 4, 256), ((7,), 3, 33), ((0,), 4, 64)],
                                             gpu=[((2, 2000), 4, 7168), ((4001,), 4, 2560), ((7,), 3, 33)]))
def test_engram_gate_autograd(device, shape, hc, H):
    x, k, v, wh, we = _leaves(shape, hc, H, device)
    grad_out = torch.randn(*shape, hc, H, dtype=torch.bfloat16, device=device)
    out = engram_gate(x, k, v, wh, we, CLAMP, EPS)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    out.backward(grad_out)
    out_ref, grads = _ref_grads(x, k, v, wh, we, grad_out)
    assert calc_diff(out.detach(), out_ref.detach()) < 2e-10
    for leaf in (x, k, v, wh, we):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
    # The layer's plumbing, exactly: its gradients are the kernels' on the kernel forward's saved tensors.
    xs, ks = (t.detach().reshape(-1, hc, H) for t in (x, k))
    vs = v.detach().reshape(-1, H)
    wf = fused_weight(wh.detach(), we.detach())
    _, dot, gate, rx, rk = engram_gate_fwd(xs, ks, vs, wf, EPS, CLAMP)
    gx, gk, gv, _ = engram_gate_bwd(grad_out.reshape(-1, hc, H), xs, ks, vs, wf, dot, gate, rx, rk,
                                    CLAMP)
    assert_equal(x.grad.reshape(-1, hc, H), gx)
    assert_equal(k.grad.reshape(-1, hc, H), gk)
    assert_equal(v.grad.reshape(-1, H), gv)
    # Against autograd through the reference.  The gate's derivative 0.5/sqrt(|s|) is ill-conditioned where
    # |s| is small: there a last-bit difference in s (the forward's sums, reduced in another order) moves the
    # gradient of that whole row.  At GPU sizes (16k-32k rows of H >= 2560) a few such rows appeared and gave
    # calc_diff ~5e-6 on grad_x (H200 run, 2026-11-29), while the kernel backward fed the *reference's*
    # saved tensors matched to 8e-11 and on its own saved tensors to 5e-9 at T=4000, H=7168: so the
    # 1e-8 check is applied where the row count keeps such rows out (the CPU grid and the small GPU case),
    # and test_engram_gate_bwd checks the kernel with TileKernels' 1e-8 on every GPU shape.
    if x.numel() <= 64 * 1024:
        for name, leaf, want in zip(("x", "k", "v", "wh", "we"), (x, k, v, wh, we), grads):
            # the weight grads come back in float32 and autograd casts them to bf16: compare bf16 to bf16
            diff = calc_diff(leaf.grad, want.to(leaf.dtype))
            assert diff < 1e-8, f"grad of {name}: {diff:.3e}"


def test_engram_gate_main_grad(device):
    shape, hc, H = (3, 4), 4, 96
    x, k, v, wh, we = _leaves(shape, hc, H, device)
    grad_out = torch.randn(*shape, hc, H, dtype=torch.bfloat16, device=device)
    start_h = torch.randn(hc, H, device=device)
    start_e = torch.randn(hc, H, device=device)
    wh.main_grad, we.main_grad = start_h.clone(), start_e.clone()
    engram_gate(x, k, v, wh, we, CLAMP, EPS).backward(grad_out)
    # main_grad accumulates in float32, in place; the weights get no .grad
    assert wh.grad is None and we.grad is None
    _, grads = _ref_grads(x, k, v, wh, we, grad_out)
    assert calc_diff(wh.main_grad - start_h, grads[3]) < 1e-8
    assert calc_diff(we.main_grad - start_e, grads[4]) < 1e-8
    assert calc_diff(x.grad, grads[0]) < 1e-8
    # a second backward accumulates again
    before = wh.main_grad.clone()
    engram_gate(x, k, v, wh, we, CLAMP, EPS).backward(grad_out)
    assert calc_diff(wh.main_grad - before, grads[3]) < 1e-8


def test_engram_gate_sum_loss_and_strided_k(device):
    # .sum() gives a stride-0 grad_output; k and v as slices of a fused projection
    T, hc, H = 6, 4, 128
    proj = torch.randn(T, hc + 1, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    k, v = proj[:, :hc], proj[:, hc]
    x = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device).requires_grad_(True)
    EngramGateFn.apply(x, k, v, wh, we, CLAMP, EPS).float().sum().backward()
    pr = proj.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    whr, wer = wh.detach().float().requires_grad_(True), we.detach().float().requires_grad_(True)
    engram_gate_ref(xr, pr[:, :hc], pr[:, hc], whr, wer, CLAMP, EPS).float().sum().backward()
    assert calc_diff(proj.grad, pr.grad) < 1e-8
    assert calc_diff(x.grad, xr.grad) < 1e-8
    assert calc_diff(wh.grad, whr.grad.bfloat16()) < 1e-8


def test_engram_gate_bad_inputs(device):
    x, k, v, wh, we = (t.detach() for t in _leaves((3,), 4, 64, device))
    with pytest.raises(ValueError, match="k must have the shape"):
        engram_gate(x, k[:, :3], v, wh, we, CLAMP, EPS)
    with pytest.raises(ValueError, match="v must have shape"):
        engram_gate(x, k, v[:, :32], wh, we, CLAMP, EPS)
    with pytest.raises(TypeError, match="hidden_states"):
        engram_gate(x.float(), k, v, wh, we, CLAMP, EPS)
    with pytest.raises(ValueError, match="weight_embed"):
        engram_gate(x, k, v, wh, we[:, :32], CLAMP, EPS)
    x4 = torch.randn(2, 3, 4, 64, dtype=torch.bfloat16, device=device).transpose(0, 1)  # not viewable as (-1, 4, 64)
    k4 = torch.randn(3, 2, 4, 64, dtype=torch.bfloat16, device=device)
    v4 = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="hidden_states .* cannot be viewed"):
        engram_gate(x4, k4, v4, wh, we, CLAMP, EPS)
    wh.main_grad = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    xg = x.clone().requires_grad_(True)
    out = engram_gate(xg, k, v, wh, we, CLAMP, EPS)
    with pytest.raises(TypeError, match="weight_hidden.main_grad"):
        out.sum().backward()


def test_engram_gate_torch_compile(device):
    # the ops are torch.library custom ops under torch.compile: the compiled layer (forward and backward)
    # gives the eager results bit for bit
    shape, hc, H = (2, 3), 4, 64
    leaves = _leaves(shape, hc, H, device)
    twins = [t.detach().clone().requires_grad_(True) for t in leaves]
    grad_out = torch.randn(*shape, hc, H, dtype=torch.bfloat16, device=device)

    def layer(x, k, v, wh, we):
        return engram_gate(x, k, v, wh, we, CLAMP, EPS)

    out = torch.compile(layer, backend="eager", fullgraph=True)(*leaves)
    out.backward(grad_out)
    want = layer(*twins)
    want.backward(grad_out)
    assert torch.equal(out, want)
    for a, b in zip(leaves, twins):
        assert torch.equal(a.grad, b.grad)
