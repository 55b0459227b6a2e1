"""The Gluon engram forward (Hopper): its rules everywhere, its results on the GPU against the oracle, the reference
and the Triton kernels.  On the GPU engram_gate_fwd takes it by default, so test_engram_gate_fwd.py covers
TileKernels' shapes with it; this file adds the edges and checks that it ran."""

import pytest
import torch

import tritile.engram._engram_fwd_gluon as fwd
from tritile.config import get_num_sms, set_num_sms
from tritile.engram import engram_gate_fwd
from tritile.runtime import override_config
from tritile.testing import assert_equal, calc_diff, is_gpu_run

from engram_testlib import CLAMP, EPS, make_gate_data
from test_engram_gate_fwd import _check_fwd


def test_fwd_onepass_config_rules():
    cfg = fwd.config(7168, 4)
    assert cfg["NT"] == 7 and cfg["NSLOT"] == 3
    assert fwd.config(8192, 4)["NSLOT"] == 2  # the two row buffers leave room for two slots
    for H in range(256, 8193, 256):
        c = fwd.config(H, 4)
        tile = 4 * 1024
        used = 2 * c["NT"] * (tile + 1024) * 2 + c["NSLOT"] * tile * 6
        assert used + fwd.SMEM_SCRATCH <= fwd.SMEM_LIMIT
    for H, hc in ((7000, 4), (8448, 4), (7168, 3)):
        assert fwd.config(H, hc) is None
    x, k, v, _, _ = make_gate_data(3, 4, 512, "cpu")
    assert fwd.supports(x, k, v, torch.randn(4, 512))
    assert not fwd.supports(x, torch.randn(3, 4, 516).bfloat16()[:, :, 4:], v, torch.randn(4, 512))


gpu_only = pytest.mark.skipif(not is_gpu_run() or not fwd.available(torch.device("cuda")),
                              reason="the Gluon forward needs a Hopper-class GPU and Triton's Gluon")


@pytest.fixture
def calls(monkeypatch):
    n = [0]
    launch = fwd.launch

    def counted(*a, **kw):
        n[0] += 1
        return launch(*a, **kw)

    monkeypatch.setattr(fwd, "launch", counted)
    return n


@gpu_only
@pytest.mark.parametrize("T,hc,H", [(257, 4, 7168), (50, 4, 2560), (33, 2, 4096), (9, 1, 1024), (20, 4, 8192),
                                    (7, 4, 256), (1, 4, 1024)])
@pytest.mark.parametrize("num_sms", [None, 3])
def test_fwd_onepass(device, calls, T, hc, H, num_sms):
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    old = get_num_sms()
    if num_sms:
        set_num_sms(num_sms)
    try:
        one = _check_fwd(x, k, v, wh, we)  # oracle, reference, save on / off bitwise (two launches)
        assert calls[0] == 2
        again = engram_gate_fwd(x, k, v, wh.float() * we.float(), EPS, CLAMP, True)
    finally:
        set_num_sms(old)
    for a, b in zip(one, again):  # deterministic
        assert_equal(a, b)
    with override_config("engram_gate_fwd", ONEPASS=False):
        two = engram_gate_fwd(x, k, v, wh.float() * we.float(), EPS, CLAMP, True)
    assert calls[0] == 3
    # the reductions sum in another order than the Triton kernels; each is within 2e-10 of the float64 oracle
    # (checked above), and the gate's sqrt amplifies dot's relative differences where |s| is small, so the two agree
    # to the spec's bound, not to the last bit
    for name, a, b in zip(("out", "dot", "gate", "rstd_x", "rstd_k"), one, two):
        assert calc_diff(a, b) < 2e-10, name


@gpu_only
def test_fwd_onepass_strided(device, calls):
    # k / v as 16-byte aligned slices of one projection, x with a padded head stride
    T, hc, H = 37, 4, 3072
    proj = torch.randn(T, hc + 1, H + 64, dtype=torch.bfloat16, device=device)
    k, v = proj[:, :hc, 64:], proj[:, hc, :H]
    x = torch.randn(T, hc, H + 256, dtype=torch.bfloat16, device=device)[:, :, 256:]
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    out = _check_fwd(x, k, v, wh, we)[0]
    assert calls[0] == 2
    assert out.is_contiguous()


@gpu_only
def test_fwd_onepass_unaligned_falls_back(device, calls):
    T, hc, H = 5, 4, 1024
    proj = torch.randn(T, hc, H + 4, dtype=torch.bfloat16, device=device)
    x, _, v, wh, we = make_gate_data(T, hc, H, device)
    _check_fwd(x, proj[:, :, 4:], v, wh, we)
    assert calls[0] == 0


@gpu_only
def test_fwd_onepass_zero_rows(device, calls):
    # all-zero rows: dot == 0, the gate from the sign bit of s (+0 here: dot is normalised to +0)
    T, hc, H = 4, 4, 1024
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    x[1].zero_()
    k[2, 1].zero_()
    out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wh.float() * we.float(), EPS, CLAMP, True)
    assert calls[0] == 1
    with override_config("engram_gate_fwd", ONEPASS=False):
        ref = engram_gate_fwd(x, k, v, wh.float() * we.float(), EPS, CLAMP, True)
    assert_equal(dot[1], ref[1][1])
    assert_equal(gate[1], ref[2][1])
    assert (dot[1] == 0).all() and not torch.signbit(dot[1]).any()
    assert_equal(gate[2, 1], ref[2][2, 1])
