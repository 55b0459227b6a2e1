import pytest
import torch

from tritile.config import get_num_sms, set_num_sms
from tritile.engram import engram_gate_bwd
from tritile.runtime import override_config
from tritile.testing import assert_equal, calc_diff, is_gpu_run
from tritile.torch.engram import engram_gate_ref

from engram_testlib import CLAMP, EPS, gate_shapes, make_gate_data, strided_gate_data


def _reference(x, k, v, wh, we, grad_out, clamp_value=CLAMP):
    """TileKernels' check: autograd through engram_gate_ref, bf16 leaves for x/k/v, fp32 leaves for the weights."""
    xr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (x, k, v))
    whr, wer = (t.detach().float().requires_grad_(True) for t in (wh, we))
    out, dot, gate, rx, rk = engram_gate_ref(xr, kr, vr, whr, wer, clamp_value, EPS, save_for_backward=True)
    out.backward(grad_out)
    saved = tuple(t.detach() for t in (dot, gate, rx, rk))
    return saved, (xr.grad, kr.grad, vr.grad, whr.grad, wer.grad)


def _run_and_check(x, k, v, wh, we, grad_out, clamp_value=CLAMP, tol=1e-8):
    saved, grads = _reference(x, k, v, wh, we, grad_out, clamp_value)
    wf = wh.float() * we.float()
    gx, gk, gv, gwp = engram_gate_bwd(grad_out, x, k, v, wf, *saved, clamp_value)
    T, hc, H = x.shape
    assert gwp.dtype == torch.float32 and gwp.shape == (get_num_sms(), hc, H)
    for got, like in ((gx, x), (gk, k), (gv, v)):
        assert got.dtype == torch.bfloat16 and got.shape == like.shape
        assert got.stride() == torch.empty_like(like).stride()
    gw = gwp.sum(0)
    got = (gx, gk, gv, gw * we.float(), gw * wh.float())
    for name, a, b in zip(("grad_x", "grad_k", "grad_v", "grad_wh", "grad_we"), got, grads):
        diff = calc_diff(a, b)
        assert diff < tol, f"{name} mismatch: {diff:.3e}"
    # rows of grad_w_partial past the last token chunk are exactly zero
    chunk = -(-T // gwp.shape[0]) if T else 1
    used = -(-T // chunk) if T else 0
    assert (gwp[used:] == 0).all()
    return gx, gk, gv, gwp


@pytest.mark.parametrize("T,hc,H", gate_shapes(min_hidden=2))
def test_engram_gate_bwd(device, T, hc, H):
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    _run_and_check(x, k, v, wh, we, grad_out)


def test_engram_gate_bwd_strided(device):
    # k / v slices of one projection (grad_k keeps k's layout rule: contiguous for a non-dense slice),
    # grad_out with a padded row stride
    x, k, v, wh, we, grad_out = strided_gate_data(11, 4, 264, 8, 32, device)
    gx, gk, gv, _ = _run_and_check(x, k, v, wh, we, grad_out)
    assert gk.is_contiguous() and gv.is_contiguous()
    # a dense but permuted k keeps its strides in grad_k
    kp = k.contiguous().transpose(0, 1).contiguous().transpose(0, 1)
    gx2, gk2, gv2, _ = _run_and_check(x, kp, v, wh, we, grad_out)
    assert gk2.stride() == kp.stride()
    assert_equal(gk2.contiguous(), gk)
    assert_equal(gx2, gx)


@pytest.mark.parametrize("num_sms", [1, 3])
def test_engram_gate_bwd_num_sms(device, num_sms):
    # the token split only changes grad_w_partial's rows; every other output is bitwise the same
    T, hc, H = 10, 4, 256
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    base = _run_and_check(x, k, v, wh, we, grad_out)
    old = get_num_sms()
    set_num_sms(num_sms)
    try:
        other = _run_and_check(x, k, v, wh, we, grad_out)
    finally:
        set_num_sms(old)
    assert other[3].shape[0] == num_sms
    for a, b in zip(base[:3], other[:3]):
        assert_equal(a, b)
    torch.testing.assert_close(other[3].sum(0), base[3].sum(0), rtol=1e-5, atol=1e-3)


def test_engram_gate_bwd_clamped(device):
    # |s| < clamp_value everywhere: the gate has no gradient, so grad_x == grad_out, grad_k == 0, grad_w == 0
    T, hc, H = 6, 4, 96
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    saved, _ = _reference(x, k, v, wh, we, grad_out, clamp_value=1e3)
    gx, gk, gv, gwp = engram_gate_bwd(grad_out, x, k, v, wh.float() * we.float(), *saved, 1e3)
    assert_equal(gx, grad_out)
    assert (gk == 0).all() and (gwp == 0).all()
    want = (saved[1][:, :, None] * grad_out.float()).sum(1).bfloat16()
    assert calc_diff(gv, want) < 1e-8


def test_engram_gate_bwd_zero_tokens(device):
    x, k, v, wh, we = make_gate_data(0, 4, 256, device)
    z = torch.empty(0, 4, dtype=torch.float32, device=device)
    gx, gk, gv, gwp = engram_gate_bwd(x, x, k, v, wh.float() * we.float(), z, z, z, z, CLAMP)
    assert gx.shape == (0, 4, 256) and gk.shape == (0, 4, 256) and gv.shape == (0, 256)
    assert gwp.shape == (get_num_sms(), 4, 256) and (gwp == 0).all()


def test_engram_gate_bwd_bad_inputs(device):
    T, hc, H = 3, 4, 256
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    wf = wh.float() * we.float()
    g = torch.randn_like(x)
    s = torch.rand(T, hc, device=device)
    f = engram_gate_bwd
    with pytest.raises(ValueError, match="grad_out"):
        f(g[:, :3], x, k, v, wf, s, s, s, s, CLAMP)
    with pytest.raises(TypeError, match="grad_out"):
        f(g.float(), x, k, v, wf, s, s, s, s, CLAMP)
    with pytest.raises(ValueError, match="k must have shape"):
        f(g, x, k[:, :, :128], v, wf, s, s, s, s, CLAMP)
    with pytest.raises(ValueError, match="weight_fused"):
        f(g, x, k, v, wf[:2], s, s, s, s, CLAMP)
    with pytest.raises(ValueError, match="dot"):
        f(g, x, k, v, wf, s[:, :3], s, s, s, CLAMP)
    with pytest.raises(TypeError, match="gate_score"):
        f(g, x, k, v, wf, s, s.double(), s, s, CLAMP)
    with pytest.raises(ValueError, match="rstd_x must be contiguous"):
        f(g, x, k, v, wf, s, s, torch.randn(T, 2 * hc, device=device)[:, :hc], s, CLAMP)
    with pytest.raises(ValueError, match="rstd_k"):
        f(g, x, k, v, wf, s, s, s, s[:2], CLAMP)
    with pytest.raises(ValueError, match="grad_out must have a unit stride"):
        f(g.transpose(1, 2).contiguous().transpose(1, 2), x, k, v, wf, s, s, s, s, CLAMP)
    with pytest.raises(TypeError, match="clamp_value"):
        f(g, x, k, v, wf, s, s, s, s, None)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="same device"):
            f(g, x, k, v, wf, s.cpu(), s, s, s, CLAMP)


@pytest.mark.parametrize("tok,bd1,bd2", [(1, 64, 64), (2, 128, 32)])
def test_engram_gate_bwd_gpu_like_blocks(device, monkeypatch, tok, bd1, bd2):
    # several H steps in pass 1 and several H tiles in pass 2, each with a partial tail (H = 200)
    import tritile.engram.engram_gate_kernel as gk

    monkeypatch.setattr(gk, "_bwd_config", lambda H, hc: (4, tok, bd1, bd2, 4))
    T, hc, H = 7, 3, 200
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    _run_and_check(x, k, v, wh, we, grad_out)


@pytest.mark.parametrize("cfg", [dict(COEF=True, PREFETCH=True, SPLIT=2), dict(COEF=True, PREFETCH=False, SPLIT=1, PIPE=0),
                                 dict(COEF=False), dict(PREFETCH=False, SPLIT=1, PIPE=3, MAXNREG2=128)])
@pytest.mark.parametrize("num_sms", [2, 5])
def test_engram_gate_bwd_variants(device, cfg, num_sms):
    # every bwd code path of the two passes; token chunks of 4 with a partial last one (num_sms=2) and of 2 with
    # an unused last row (5); hc = 3 (a padded head)
    T, hc, H = 7, 3, 232
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    old = get_num_sms()
    set_num_sms(num_sms)
    try:
        with override_config("engram_gate_bwd", **cfg):
            _run_and_check(x, k, v, wh, we, grad_out)
    finally:
        set_num_sms(old)


def test_engram_gate_bwd_opcheck(device):
    import tritile.engram.engram_gate_kernel as gk

    x, k, v, wh, we = make_gate_data(5, 4, 64, device)
    grad_out = torch.randn_like(x)
    saved, _ = _reference(x, k, v, wh, we, grad_out)
    torch.library.opcheck(gk._engram_gate_bwd_op.op, (grad_out, x, k, v, wh.float() * we.float(), *saved, CLAMP))
