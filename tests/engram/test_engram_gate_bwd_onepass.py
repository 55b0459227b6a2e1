"""The one-pass engram backward (Gluon, Hopper GPUs): its shape / alignment rules everywhere, its results on the GPU.

On the GPU, ``engram_gate_bwd`` takes the one-pass kernel by default wherever it covers the shape, so the main test
file exercises it at TileKernels' shapes; this file adds the edges (H tails, hc = 1 / 2, strided k / v, empty and
long token chunks, the fallback for unaligned strides) and checks it against the two-pass kernels."""

import pytest
import torch

import tritile.engram._engram_bwd_gluon as onepass
import tritile.engram.engram_gate_kernel as gk
from tritile.config import get_num_sms, set_num_sms
from tritile.engram import engram_gate_bwd
from tritile.runtime import override_config
from tritile.testing import assert_equal, calc_diff, is_gpu_run

from engram_testlib import make_gate_data, strided_gate_data
from test_engram_gate_bwd import _reference, _run_and_check


def test_onepass_config_rules():
    # tiles of [hc, 1024]: H a multiple of 256 up to 8192, hc in {1, 2, 4}
    cfg = onepass.config(7168, 4)
    assert cfg["NT"] == 7 and cfg["NSLOT"] == 3 and cfg["NR"] == 4  # 3 accumulator tiles in shared memory
    assert onepass.config(7168, 4, 2)["NR"] == 2
    assert onepass.config(8192, 4)["NSLOT"] == 2  # a shallower ring leaves room for the accumulator
    # the shared memory the rule plans stays within the block's limit
    for H in range(256, 8193, 256):
        c = onepass.config(H, 4)
        tile = 4 * 1024
        used = c["NT"] * (tile + 1024) * 2 + c["NSLOT"] * tile * 8 + (c["NT"] - c["NR"]) * tile * 4
        assert c["NR"] <= 4 and used + onepass.SMEM_SCRATCH <= onepass.SMEM_LIMIT
    assert cfg["A1"] * cfg["A2"] == onepass.NUM_WARPS and 4 * cfg["B1"] * cfg["B2"] == onepass.NUM_WARPS
    assert 32 * cfg["B2"] * cfg["VB"] == onepass.CHUNK
    assert onepass.config(2560, 4)["NT"] == 3 and onepass.config(8192, 4)["NT"] == 8
    for hc in (1, 2):
        c = onepass.config(4096, hc)
        assert hc * c["B1"] * c["B2"] == onepass.NUM_WARPS and c["B1"] <= onepass.NCH
    for H, hc in ((7000, 4), (8448, 4), (7168, 3), (7168, 8), (0, 4)):
        assert onepass.config(H, hc) is None


def test_onepass_supports_alignment():
    # TMA needs 16-byte aligned bases and strides: a k slice starting 4 elements in is not
    T, hc, H = 3, 4, 512
    x, k, v, _, _ = make_gate_data(T, hc, H, "cpu")
    wf = torch.randn(hc, H)
    assert onepass.supports(x, x, k, v, wf)
    proj = torch.randn(T, hc + 1, H + 8, dtype=torch.bfloat16)
    assert onepass.supports(x, x, proj[:, :hc, 8:], proj[:, hc, :H], wf)
    assert not onepass.supports(x, x, proj[:, :hc, 4:H + 4], v, wf)
    assert not onepass.supports(x, x[:, :, :H - 8], k[:, :, :H - 8], v[:, :H - 8], wf[:, :H - 8])  # H % 256
    assert not onepass.available(torch.device("cpu"))


gpu_only = pytest.mark.skipif(not is_gpu_run() or not onepass.available(torch.device("cuda")),
                              reason="the one-pass kernel needs a Hopper-class GPU and Triton's Gluon")


def _both(x, k, v, wh, we, grad_out, calls):
    """(one-pass results, checked against autograd; two-pass results); ``calls`` counts one-pass launches."""
    n = calls[0]
    one = _run_and_check(x, k, v, wh, we, grad_out)
    assert calls[0] == n + 1, "the one-pass kernel did not run"
    with override_config("engram_gate_bwd", ONEPASS=False):
        two = _run_and_check(x, k, v, wh, we, grad_out)
    assert calls[0] == n + 1
    return one, two


@pytest.fixture
def calls(monkeypatch):
    n = [0]
    launch = onepass.launch

    def counted(*a, **kw):
        n[0] += 1
        return launch(*a, **kw)

    monkeypatch.setattr(onepass, "launch", counted)
    return n


@gpu_only
@pytest.mark.parametrize("T,hc,H", [(257, 4, 7168), (50, 4, 2560), (33, 2, 4096), (9, 1, 1024), (20, 4, 8192),
                                    (7, 4, 256), (1, 4, 1024)])
@pytest.mark.parametrize("num_sms", [None, 3])
def test_onepass_against_two_passes(device, calls, T, hc, H, num_sms):
    # num_sms None: the GPU's 132 programs (most chunks of 1-2 tokens, rows without tokens); 3: long chunks whose
    # token loop wraps the ring and the G / v buffers many times
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    old = get_num_sms()
    if num_sms:
        set_num_sms(num_sms)
    try:
        one, two = _both(x, k, v, wh, we, grad_out, calls)
        # deterministic: a second run is bitwise the same
        again = _run_and_check(x, k, v, wh, we, grad_out)
    finally:
        set_num_sms(old)
    for a, b in zip(one, again):
        assert_equal(a, b)
    _close(one, two)


def _close(one, two):
    """The one-pass and two-pass results agree as well as each agrees with autograd (checked at 1e-8 above).

    grad_v (sum_h g_h G_h in head order in both) is bitwise the same.  grad_x and grad_k are not: gamma = G . v is
    summed over H in another order, and gamma cancels (random signs over 7168 terms), so delta's relative
    difference reaches ~1e-4 on a few tokens (measured on the H200: calc_diff up to 6e-9 for grad_k)."""
    assert_equal(one[2], two[2])
    for name, a, b in zip(("grad_x", "grad_k"), one[:2], two[:2]):
        assert calc_diff(a, b) < 1e-7, name
    torch.testing.assert_close(one[3].sum(0), two[3].sum(0), rtol=1e-4, atol=1e-3)


@gpu_only
def test_onepass_strided(device, calls):
    # k and v as 16-byte aligned slices of one projection (TMA descriptors with their strides), grad_out padded
    x, k, v, wh, we, grad_out = strided_gate_data(37, 4, 3072, 64, 256, device)
    one, two = _both(x, k, v, wh, we, grad_out, calls)
    _close(one, two)


@gpu_only
def test_onepass_unaligned_falls_back(device, calls):
    # a k slice 4 elements in: TMA cannot describe it, the two passes run (and are right)
    T, hc, H = 5, 4, 1024
    proj = torch.randn(T, hc, H + 4, dtype=torch.bfloat16, device=device)
    k = proj[:, :, 4:]
    x, _, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    _run_and_check(x, k, v, wh, we, grad_out)
    assert calls[0] == 0


@gpu_only
def test_onepass_clamped(device, calls):
    # |s| < clamp_value everywhere: delta = 0, so grad_x == grad_out exactly and grad_k, grad_w are zero
    T, hc, H = 6, 4, 2048
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    saved, _ = _reference(x, k, v, wh, we, grad_out, clamp_value=1e3)
    gx, gk_, gv, gwp = engram_gate_bwd(grad_out, x, k, v, wh.float() * we.float(), *saved, 1e3)
    assert calls[0] == 1
    assert_equal(gx, grad_out)
    assert (gk_ == 0).all() and (gwp == 0).all()


def test_onepass_not_under_interpreter(device, calls):
    # on the CPU (the interpreter) the two passes always run
    if torch.device(device).type != "cpu":
        pytest.skip("CPU only")
    T, hc, H = 3, 4, 1024
    x, k, v, wh, we = make_gate_data(T, hc, H, device)
    _run_and_check(x, k, v, wh, we, torch.randn_like(x))
    assert calls[0] == 0
    assert gk._bwd_launch_config(H, hc)["ONEPASS"]
