"""``mhc_pre_apply_mix`` (forward + backward, the in-place ``grad_from_mhc_post`` accumulation, ``out=``)."""

import pytest
import torch

from tritile.modeling.mhc.ops.pre_apply_mix import mhc_pre_apply_mix
from tritile.testing import pick
from tritile.torch.mhc import _apply_mix_bwd_tk, _fma_chain, mhc_pre_apply_mix_ref

TOL = dict(atol=1e-2, rtol=1e-3)


def _data(n0, n1, h, device, n=4):
    x = torch.randn(n0, n1, n, h, device=device).sigmoid().bfloat16()
    mix = torch.randn(n0, n1, n, 1, device=device).softmax(-2)
    g = torch.randn(n0, n1, h, device=device).bfloat16()
    return x, mix, g


def _tester(impl, x, mix, g, with_buffer=True):
    x_, m_ = x.clone().requires_grad_(), mix.clone().requires_grad_()
    out = impl(x_, m_)
    if with_buffer:
        x_.untyped_storage().grad_from_mhc_post = torch.zeros_like(x_)
    out.backward(g)
    xg = x_.grad if x_.grad is not None else x_.untyped_storage().grad_from_mhc_post
    return out, xg, m_.grad


@pytest.mark.parametrize("n0,n1,h", pick(
    cpu=[(1, 1, 64), (2, 13, 80), (1, 3, 7680)],
    gpu=[(n0, n1, h) for n0 in (1, 2) for n1 in (1024, 4096) for h in (1280, 2560, 7680)]))
def test_pre_apply_mix_comprehensive(device, n0, n1, h):
    x, mix, g = _data(n0, n1, h, device)
    out, xg, mg = _tester(mhc_pre_apply_mix, x, mix, g)
    out_r, xg_r, mg_r = _tester(mhc_pre_apply_mix_ref, x, mix, g)
    assert out.dtype == torch.bfloat16 and out.shape == (n0, n1, h) and mg.shape == mix.shape
    torch.testing.assert_close(out, out_r, **TOL)
    torch.testing.assert_close(xg, xg_r, **TOL)
    torch.testing.assert_close(mg, mg_r, **TOL)
    # TileKernels' order, bit for bit: the forward a chain of fused multiply-adds over the streams from 0; the
    # backward's mix gradient per-lane chains over gcd(1024, H) / 128 contiguous columns a lane, then a butterfly
    assert torch.equal(out, _fma_chain(mix, x.float(), -2).squeeze(-2).bfloat16())
    xg_e, mg_e = _apply_mix_bwd_tk(x, mix, g)
    assert torch.equal(xg, xg_e) and torch.equal(mg, mg_e)


@pytest.mark.parametrize("h", [1024, 1280, 384])
def test_pre_apply_mix_lane_layouts(device, h):
    """The backward's lanes hold 8, 2 and 1 contiguous columns a chunk (gcd(1024, H) / 128), as TileKernels'."""
    x, mix, g = _data(1, 3, h, device)
    _, xg, mg = _tester(mhc_pre_apply_mix, x, mix, g)
    xg_e, mg_e = _apply_mix_bwd_tk(x, mix, g)
    assert torch.equal(xg, xg_e) and torch.equal(mg, mg_e)


def test_pre_apply_mix_protocol(device):
    """With the buffer: accumulated in place (one rounding of buf + mix * g), None for x, attribute kept."""
    x, mix, g = _data(1, 9, 96, device)
    x_, m_ = x.clone().requires_grad_(), mix.clone().requires_grad_()
    out = mhc_pre_apply_mix(x_, m_)
    buf = torch.randn(1, 9, 4, 96, device=device).bfloat16()
    before = buf.clone()
    x_.untyped_storage().grad_from_mhc_post = buf
    out.backward(g)
    assert x_.grad is None
    assert x_.untyped_storage().grad_from_mhc_post is buf
    assert torch.equal(buf, _apply_mix_bwd_tk(x, mix, g, before)[0])  # bf16(fma(mix, g, buf)), one rounding
    # without the buffer: a fresh gradient
    x2 = x.clone().requires_grad_()
    mhc_pre_apply_mix(x2, mix).backward(g)
    torch.testing.assert_close(x2.grad, (mix * g.float().unsqueeze(-2)).bfloat16(), atol=0, rtol=0)


def test_pre_apply_mix_out_and_zero_tokens(device):
    x, mix, g = _data(2, 5, 64, device)
    out = torch.empty(2, 5, 64, dtype=torch.bfloat16, device=device)
    res = mhc_pre_apply_mix(x, mix, out=out)
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, mhc_pre_apply_mix_ref(x, mix), **TOL)
    x0, m0, g0 = _data(1, 0, 64, device)
    x0.requires_grad_()
    m0.requires_grad_()
    out0 = mhc_pre_apply_mix(x0, m0)
    assert out0.shape == (1, 0, 64)
    out0.backward(g0)
    assert x0.grad.shape == x0.shape and m0.grad.shape == m0.shape
    # any leading dims, other stream counts
    x3 = torch.randn(3, 2, 2, 8, 48, device=device).bfloat16()
    m3 = torch.rand(3, 2, 2, 8, 1, device=device)
    torch.testing.assert_close(mhc_pre_apply_mix(x3, m3), mhc_pre_apply_mix_ref(x3, m3), **TOL)


def test_pre_apply_mix_bad_input(device):
    x, mix, _ = _data(1, 3, 64, device)
    with pytest.raises(TypeError, match="x"):
        mhc_pre_apply_mix(x.float(), mix)
    with pytest.raises(TypeError, match="mix"):
        mhc_pre_apply_mix(x, mix.double())
    with pytest.raises(ValueError, match="mix"):
        mhc_pre_apply_mix(x, mix.view(1, 3, 4))
    with pytest.raises(ValueError, match="mix"):
        mhc_pre_apply_mix(x, torch.rand(1, 3, 2, 1, device=device))
    with pytest.raises(ValueError, match="x"):
        mhc_pre_apply_mix(torch.randn(1, 3, 64, 4, device=device).bfloat16().transpose(-1, -2), mix)
    with pytest.raises(ValueError, match="out"):
        mhc_pre_apply_mix(x, mix, out=torch.empty(1, 3, 32, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="out"):
        mhc_pre_apply_mix(x, mix, out=torch.empty(1, 3, 64, device=device))
    with pytest.raises(ValueError, match="x"):
        mhc_pre_apply_mix(x[0, 0, 0], mix)


def test_pre_apply_mix_compile(device):
    x, mix, g = _data(1, 4, 64, device)
    fn = torch.compile(mhc_pre_apply_mix, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    got = _tester(fn, x, mix, g, with_buffer=False)
    for a, b in zip(got, _tester(mhc_pre_apply_mix, x, mix, g, with_buffer=False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [dict(BT=1, BH=32, num_warps=1), dict(BT=4, BH=64, num_warps=2),
                                 dict(BT=8, BH=128, num_warps=4)], ids=str)
def test_pre_apply_mix_configs(device, cfg):
    """Bits independent of the launch config (the forward and the x gradient are per element)."""
    from tritile.runtime import override_config

    x, mix, g = _data(1, 5, 96, device)
    ref = _tester(mhc_pre_apply_mix, x, mix, g)
    with override_config("mhc_pre_apply_mix_fwd", **cfg), override_config("mhc_pre_apply_mix_bwd", **cfg):
        got = _tester(mhc_pre_apply_mix, x, mix, g)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2], atol=1e-5, rtol=1e-5)


def test_pre_apply_mix_without_a_graph(device):
    """With nothing to differentiate the op launches its kernel without an autograd node: the same bits as the
    recorded forward, into a new tensor or into ``out`` (returned), and no ``grad_fn``."""
    x = torch.randn(2, 5, 4, 64, device=device).bfloat16()
    mix = torch.randn(2, 5, 4, 1, device=device).softmax(-2)
    with_graph = mhc_pre_apply_mix(x, mix.clone().requires_grad_())
    out = torch.empty(2, 5, 64, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        off = mhc_pre_apply_mix(x.clone().requires_grad_(), mix)
    got_out = mhc_pre_apply_mix(x, mix, out=out)
    for got in (mhc_pre_apply_mix(x, mix), off, got_out):
        assert got.grad_fn is None and torch.equal(got, with_graph.detach())
    assert got_out.data_ptr() == out.data_ptr()
