import math

import pytest
import torch

from tritile.config import get_device_num_sms, get_num_sms, set_num_sms
from tritile.engram import engram_gate_fwd, fused_weight
from tritile.runtime import override_config
from tritile.testing import assert_equal, calc_diff, is_gpu_run
from tritile.torch.engram import engram_gate_ref

from engram_testlib import CLAMP, EPS, gate_oracle, gate_shapes, make_gate_data


def _check_fwd(x, k, v, wh, we, eps=EPS, clamp_value=CLAMP):
    wf = wh.float() * we.float()
    out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wf, eps, clamp_value, save_for_backward=True)
    T, hc, H = x.shape
    for t in (dot, gate, rx, rk):
        assert t.dtype == torch.float32 and t.shape == (T, hc) and t.is_contiguous()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    # against float64 sums (the CPU reference's fp32 einsum is itself noisy at large H: spec/engram.md)
    oracle = gate_oracle(x, k, v, wf, eps, clamp_value)
    for name, got, want in zip(("out", "dot", "gate", "rstd_x", "rstd_k"), (out, dot, gate, rx, rk), oracle):
        diff = calc_diff(got, want)
        assert diff < 2e-10, f"{name} mismatch against the float64 oracle: {diff:.3e}"
    # TileKernels' own check: against the PyTorch reference, calc_diff < 2e-10.  The CPU reference's fp32
    # sums are too noisy for it at H >= 4096 (spec/engram.md: 2.3-3.9e-10 at H=7168 even for exact sums);
    # below that it holds on the CPU at these small T (measured <= 4.6e-12 at T=33, H=2560).
    if is_gpu_run() or x.shape[-1] < 4096:
        ref = engram_gate_ref(x, k, v, wh, we, clamp_value, eps, save_for_backward=True)
        for name, got, want in zip(("out", "dot", "gate", "rstd_x", "rstd_k"), (out, dot, gate, rx, rk), ref):
            diff = calc_diff(got, want)
            assert diff < 2e-10, f"{name} mismatch against engram_gate_ref: {diff:.3e}"
    # save_for_backward=False: None for the saved tensors, the output bit for bit the same
    res = engram_gate_fwd(x, k, v, wf, eps, clamp_value, save_for_backward=False)
    assert len(res) == 5 and all(r is None for r in res[1:])
    assert_equal(res[0], out)
    return out, dot, gate, rx, rk


@pytest.mark.parametrize("T,hc,H", gate_shapes())
def test_engram_gate_fwd(device, T, hc, H):
    _check_fwd(*make_gate_data(T, hc, H, device))


@pytest.mark.parametrize("H", [256, 520])
def test_engram_gate_fwd_strided(device, H):
    # k and v as slices of one fused projection; x with a padded head stride
    T, hc = 9, 4
    proj = torch.randn(T, hc + 1, H + 16, dtype=torch.bfloat16, device=device)
    k = proj[:, :hc, 16:]
    v = proj[:, hc, :H]
    xbig = torch.randn(T, hc, H + 64, dtype=torch.bfloat16, device=device)
    x = xbig[:, :, :H]
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    assert not k.is_contiguous() and not v.is_contiguous() and not x.is_contiguous()
    out = _check_fwd(x, k, v, wh, we)[0]
    assert_equal(out, engram_gate_fwd(x.contiguous(), k.contiguous(), v.contiguous(), wh.float() * we.float(),
                                      EPS, CLAMP)[0], check_stride=False)


def test_engram_gate_fwd_zero_rows(device):
    # s == 0: the gate is sigmoid(+-sqrt(clamp_value)) by the sign bit of s (TileKernels' kernel), and the
    # clamp floors tiny |s|.  Row 0: x == 0; row 1: k == 0 with negative weights: every product is -0.0, and
    # their sum is +0.0 on every backend (as torch's sum gives), so the gate is sigmoid(+sqrt(clamp_value)).
    T, hc, H = 3, 2, 64
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    x[0, 0] = 0
    k[1, 1] = 0
    wh[1] = -wh[1].abs()
    we[1] = we[1].abs()
    x[1, 1] = x[1, 1].abs()
    clamp_value = 1e-2
    wf = fused_weight(wh, we)
    out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wf, EPS, clamp_value)
    assert float(dot[0, 0]) == 0.0 and float(dot[1, 1]) == 0.0
    assert math.copysign(1.0, float(dot[1, 1])) == 1.0
    pos = torch.sigmoid(torch.tensor(math.sqrt(clamp_value))).item()
    assert gate[0, 0].item() == pytest.approx(pos, rel=1e-6)
    sign = math.copysign(1.0, float(dot[1, 1]))
    assert gate[1, 1].item() == pytest.approx(torch.sigmoid(torch.tensor(sign * math.sqrt(clamp_value))).item(),
                                              rel=1e-6)
    assert rx[0, 0].item() == pytest.approx(1e10, rel=1e-6)  # rsqrt(0 + 1e-20)
    oracle = gate_oracle(x, k, v, wf, EPS, clamp_value)
    assert calc_diff(out, oracle[0]) < 2e-10
    assert calc_diff(gate, oracle[2]) < 1e-12


def test_engram_gate_fwd_nan_propagates(device):
    x, k, v, wh, we = make_gate_data(2, 2, 32, device)
    x[0, 1, 3] = float("nan")
    out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, fused_weight(wh, we), EPS, CLAMP)
    assert out[0, 1].isnan().all() and gate[0, 1].isnan() and dot[0, 1].isnan()
    assert not out[1].isnan().any() and not out[0, 0].isnan().any()


def test_engram_gate_fwd_bad_inputs(device):
    T, hc, H = 3, 4, 256
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    wf = wh.float() * we.float()
    f = engram_gate_fwd
    with pytest.raises(ValueError, match="k must have shape"):
        f(x, k[:, :3], v, wf, EPS, CLAMP)  # mismatched hc
    with pytest.raises(ValueError, match="weight_fused"):
        f(x, k, v, wf[:3], EPS, CLAMP)
    with pytest.raises(ValueError, match="v must have shape"):
        f(x, k, v[:, :128], wf, EPS, CLAMP)  # mismatched H
    with pytest.raises(ValueError, match="k must have shape"):
        f(x, k[:, :, :128], v, wf, EPS, CLAMP)
    with pytest.raises(ValueError, match="v must have shape"):
        f(x, k, v[:2], wf, EPS, CLAMP)  # mismatched T
    with pytest.raises(TypeError, match="hidden_states"):
        f(x.float(), k, v, wf, EPS, CLAMP)
    with pytest.raises(TypeError, match="k must be bfloat16"):
        f(x, k.half(), v, wf, EPS, CLAMP)
    with pytest.raises(TypeError, match="v must be bfloat16"):
        f(x, k, v.float(), wf, EPS, CLAMP)
    with pytest.raises(TypeError, match="weight_fused"):
        f(x, k, v, wf.bfloat16(), EPS, CLAMP)
    with pytest.raises(ValueError, match="hidden_states must be 3D"):
        f(x[0], k, v, wf, EPS, CLAMP)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)  # hidden stride 4, not 1
    with pytest.raises(ValueError, match="k must have a unit stride"):
        f(x, kt, v, wf, EPS, CLAMP)
    with pytest.raises(ValueError, match="v must have a unit stride"):
        f(x, k, v.t().contiguous().t(), wf, EPS, CLAMP)
    with pytest.raises(TypeError, match="eps"):
        f(x, k, v, wf, None, CLAMP)
    with pytest.raises(TypeError, match="clamp_value"):
        f(x, k, v, wf, EPS, "1e-6")
    with pytest.raises(ValueError, match="hidden size"):
        z = torch.empty(T, hc, 0, dtype=torch.bfloat16, device=device)
        f(z, z, v[:, :0], wf[:, :0], EPS, CLAMP)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="k must be on the same device"):
            f(x, k.cpu(), v, wf, EPS, CLAMP)


@pytest.mark.parametrize("rows", [1, 4])
def test_engram_gate_fwd_gpu_like_blocks(device, monkeypatch, rows):
    # the row kernel with the GPU's launch rule (few rows per program): row masks with a partial last program
    import tritile.engram.engram_gate_kernel as gk
    import triton

    monkeypatch.setattr(gk, "_fwd_config", lambda H: (triton.next_power_of_2(H), rows, 4))
    with override_config("engram_gate_fwd", PERSIST=False):
        _check_fwd(*make_gate_data(7, 3, 200, device))


@pytest.mark.parametrize("num_sms,waves,prefetch", [(1, 1, True), (6, 1, True), (6, 2, False), (64, 1, True)])
def test_engram_gate_fwd_persistent(device, num_sms, waves, prefetch):
    # the persistent kernel (program = one head of a token chunk): one chunk, chunks of 4 tokens with a partial
    # last one (7 = 4 + 3), with and without the prefetch, one token per chunk; every grid gives the same bits
    x, k, v, wh, we = make_gate_data(7, 3, 200, device)
    old = get_num_sms()
    set_num_sms(min(num_sms, get_device_num_sms()) if is_gpu_run() else num_sms)
    try:
        with override_config("engram_gate_fwd", PERSIST=True, WARPS=4, WAVES=waves, PREFETCH=prefetch):
            got = _check_fwd(x, k, v, wh, we)
    finally:
        set_num_sms(old)
    with override_config("engram_gate_fwd", PERSIST=True, WARPS=4, WAVES=1, PREFETCH=True):
        want = engram_gate_fwd(x, k, v, wh.float() * we.float(), EPS, CLAMP)
    for a, b in zip(got, want):
        assert_equal(a, b)


def test_engram_gate_fwd_opcheck(device):
    import tritile.engram.engram_gate_kernel as gk

    x, k, v, wh, we = make_gate_data(5, 4, 64, device)
    wf = fused_weight(wh, we)
    for save in (True, False):
        torch.library.opcheck(gk._engram_gate_fwd_op.op, (x, k, v, wf, EPS, CLAMP, save))
    f = torch.compile(engram_gate_fwd, backend="eager", fullgraph=True)
    res = f(x, k, v, wf, EPS, CLAMP, False)
    assert all(r is None for r in res[1:])
    assert_equal(res[0], engram_gate_fwd(x, k, v, wf, EPS, CLAMP)[0])
