"""``mhc_post`` (forward + one-kernel backward), ``mhc_post_fwd`` / ``mhc_post_bwd``, the residual-gradient
protocol's first step, ``out=``, bad input, torch.compile."""

import pytest
import torch

from tritile.mhc import mhc_post_bwd, mhc_post_fwd
from tritile.bench.cases.mhc import post_data as _data
from tritile.modeling.mhc.ops.post import mhc_post
from tritile.testing import pick
from tritile.torch.mhc import _post_bwd_tk, _post_fwd_tk, mhc_post_ref


def _tester(impl, x, residual, post, comb, g):
    leaves = [t.clone().requires_grad_() for t in (x, residual, post, comb)]
    out = impl(*leaves)
    torch.autograd.backward([out], [g])
    return (out, *(t.grad for t in leaves))


def _check(res, ref):
    out, gx, gr, gp, gc = res
    out_r, gx_r, gr_r, gp_r, gc_r = ref
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(gx, gx_r)
    torch.testing.assert_close(gr, gr_r)
    torch.testing.assert_close(gp, gp_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gc, gc_r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n0,n1,h", pick(
    cpu=[(1, 1, 64), (2, 13, 80), (1, 2, 1280)],
    gpu=[(n0, 4096, h) for n0 in (1, 2) for h in (1280, 2560, 7168)]))
def test_mhc_post_comprehensive(device, n0, n1, h):
    data = _data(n0, n1, h, device)
    _check(_tester(mhc_post, *data), _tester(mhc_post_ref, *data))


@pytest.mark.parametrize("n1,h", [(7, 96), (3, 1280), (2, 200)])
def test_mhc_post_order_is_exact(device, n1, h):
    """TileKernels' order, bit for bit on every backend: forward ``fma(post_o, y, comb[0, o] R_0)`` then
    ``fma(comb[i, o], R_i, acc)``; backward stream sums as fma chains, the sums over ``h`` as per-lane chains
    (lane ``l``: ``h = j 128 + l``) and a 128-lane butterfly (``tritile.torch.mhc._post_*_tk``)."""
    x, residual, post, comb, g = _data(1, n1, h, device)
    assert torch.equal(mhc_post_fwd(x, residual, post, comb), _post_fwd_tk(x, residual, post, comb))
    got = mhc_post_bwd(x, residual, post, comb, g, fuse_grad_acc=False)
    for a, b in zip(got, _post_bwd_tk(x, residual, post, comb, g)):
        assert torch.equal(a, b)


def test_mhc_post_protocol(device):
    """The backward attaches d_residual to the residual's storage and also returns it as the residual's grad."""
    x, residual, post, comb, g = _data(1, 5, 64, device)
    r = residual.clone().requires_grad_()
    out = mhc_post(x, r, post, comb)
    out.backward(g)
    buf = r.untyped_storage().grad_from_mhc_post
    assert torch.equal(buf, r.grad)  # (a leaf's AccumulateGrad may copy it; a non-leaf receives the buffer)
    assert buf.shape == r.shape and buf.dtype == torch.bfloat16
    # plain mhc_post_bwd: fuse on/off
    r2 = residual.clone()
    d = mhc_post_bwd(x, r2, post, comb, g, fuse_grad_acc=False)
    assert not hasattr(r2.untyped_storage(), "grad_from_mhc_post")
    assert torch.equal(d[1], r.grad)
    d = mhc_post_bwd(x, r2, post, comb, g)
    assert r2.untyped_storage().grad_from_mhc_post is d[1]


def test_mhc_post_chain_protocol(device):
    """post -> (pre_apply_mix on the same residual): the apply-mix backward adds into post's buffer; the total
    residual gradient matches the unfused autograd graph of the references."""
    from tritile.modeling.mhc.ops.pre_apply_mix import mhc_pre_apply_mix
    from tritile.torch.mhc import _apply_mix_bwd_tk, mhc_pre_apply_mix_ref

    x, residual, post, comb, g = _data(1, 6, 64, device)
    mix = torch.rand(1, 6, 4, 1, device=device)
    gu = torch.randn(1, 6, 64, device=device).bfloat16()

    def run(post_fn, apply_fn):
        r = residual.clone().requires_grad_()
        u = apply_fn(r, mix)
        out = post_fn(x, r, post, comb)
        torch.autograd.backward([out, u], [g, gu])
        return r.grad

    got = run(mhc_post, mhc_pre_apply_mix)
    want = run(mhc_post_ref, mhc_pre_apply_mix_ref)
    # the fused buffer rounds the post part to bf16 before the apply part is added (spec §5), the unfused graph
    # rounds both parts and their sum: they differ by up to an ulp of the partial sums (|d_R| < 8 here: 2^-5;
    # measured 0.006)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=1.6e-2)
    d_post = mhc_post_bwd(x, residual, post, comb, g, fuse_grad_acc=False)[1]
    assert torch.equal(got, _apply_mix_bwd_tk(residual, mix, gu, d_post)[0])  # buf = bf16(fma(mix, g, buf))


def test_mhc_post_out_and_zero_tokens(device):
    x, residual, post, comb, g = _data(2, 3, 64, device)
    out = torch.empty_like(residual)
    res = mhc_post_fwd(x, residual, post, comb, out=out)
    assert res is out
    res2 = mhc_post(x, residual, post, comb, out=torch.empty_like(residual))
    assert torch.equal(res2, out)
    o = torch.empty_like(residual)
    res3 = mhc_post(x, residual, post, comb, out=o)
    assert res3.data_ptr() == o.data_ptr()
    # a non-contiguous residual is copied by the plain forward
    rt = residual.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(mhc_post_fwd(x, rt, post, comb), out)
    data0 = _data(1, 0, 64, device)
    res0 = _tester(mhc_post, *data0)
    assert res0[0].shape == (1, 0, 4, 64)
    assert all(t.shape == d.shape for t, d in zip(res0[1:], data0[:4]))
    # forward works for any n; n = 2
    d2 = _data(1, 3, 64, device, n=2)
    torch.testing.assert_close(mhc_post_fwd(*d2[:4]), mhc_post_ref(*d2[:4]))


def test_mhc_post_bad_input(device):
    x, residual, post, comb, g = _data(1, 3, 64, device)
    with pytest.raises(TypeError, match="x"):
        mhc_post(x.float(), residual, post, comb)
    with pytest.raises(ValueError, match="residual"):
        mhc_post(x, residual[0], post, comb)
    with pytest.raises(ValueError, match="x"):
        mhc_post(x[..., :32], residual, post, comb)
    with pytest.raises(ValueError, match="post_layer_mix"):
        mhc_post(x, residual, post[..., :2, :], comb)
    with pytest.raises(ValueError, match="comb_res_mix"):
        mhc_post(x, residual, post, comb.transpose(-1, -2))
    with pytest.raises(TypeError, match="comb_res_mix"):
        mhc_post(x, residual, post, comb.bfloat16())
    with pytest.raises(ValueError, match="residual"):
        mhc_post(x, residual.transpose(-1, -2).contiguous().transpose(-1, -2), post, comb)
    with pytest.raises(ValueError, match="out"):
        mhc_post(x, residual, post, comb, out=torch.empty(1, 3, 4, 32, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="out"):
        mhc_post_fwd(x, residual, post, comb, out=torch.empty(1, 3, 4, 64, device=device))
    with pytest.raises(ValueError, match="residual"):
        mhc_post_bwd(*_data(1, 3, 64, device, n=2))
    with pytest.raises(ValueError, match="d_o"):
        mhc_post_bwd(x, residual, post, comb, g[..., :32])
    # two streams: the forward runs, the autograd backward names the residual's stream count
    x2, r2, p2, c2, g2 = _data(1, 3, 64, device, n=2)
    r2.requires_grad_()
    out = mhc_post(x2, r2, p2, c2)
    with pytest.raises(ValueError, match="4 streams"):
        out.backward(g2)


def test_mhc_post_compile(device):
    data = _data(1, 3, 64, device)
    fn = torch.compile(mhc_post, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    for a, b in zip(_tester(fn, *data), _tester(mhc_post, *data)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [dict(BT=1, BH=32, num_warps=1), dict(BT=4, BH=64, num_warps=2),
                                 dict(BT=8, BH=128, num_warps=4)], ids=str)
def test_mhc_post_configs(device, cfg):
    """The forward's bits do not depend on the launch config (per-element math); the backward's per-token sums
    over H change order only."""
    from tritile.runtime import override_config

    x, residual, post, comb, g = _data(1, 5, 96, device)
    out = mhc_post_fwd(x, residual, post, comb)
    d = mhc_post_bwd(x, residual, post, comb, g, fuse_grad_acc=False)
    with override_config("mhc_post_fwd", **cfg), override_config("mhc_post_bwd", **cfg):
        assert torch.equal(mhc_post_fwd(x, residual, post, comb), out)
        d2 = mhc_post_bwd(x, residual, post, comb, g, fuse_grad_acc=False)
    assert torch.equal(d2[0], d[0]) and torch.equal(d2[1], d[1])
    torch.testing.assert_close(d2[2], d[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(d2[3], d[3], atol=1e-4, rtol=1e-4)


def test_mhc_post_without_a_graph(device):
    """With nothing to differentiate the op launches its kernel without an autograd node: the same bits as the
    recorded forward, into a new tensor or into ``out`` (returned), and no ``grad_fn``."""
    x, residual, post, comb, _ = _data(2, 5, 64, device)
    with_graph = mhc_post(x, residual, post, comb.clone().requires_grad_())
    out = torch.empty_like(residual)
    with torch.no_grad():
        off = mhc_post(x.clone().requires_grad_(), residual, post, comb)
    for got in (mhc_post(x, residual, post, comb), off, mhc_post(x, residual, post, comb, out=out)):
        assert got.grad_fn is None and torch.equal(got, with_graph.detach())
    assert out.data_ptr() == mhc_post(x, residual, post, comb, out=out).data_ptr()
