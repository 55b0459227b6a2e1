"""``mhc_pre_big_fuse``: bitwise equal to the unfused chain of tritile's own ops (as TileKernels tests it), and close
to the chain of ``tritile.torch`` references (which alone settles orientation and order questions)."""

import pytest
import torch

from tritile.modeling.mhc.ops import (mhc_pre_apply_mix, mhc_pre_big_fuse, mhc_pre_norm_fn, mhc_pre_split_mixes,
                                      sinkhorn_normalize)
from tritile.runtime import override_config
from tritile.testing import pick
from tritile.torch.mhc import (mhc_pre_apply_mix_ref, mhc_pre_norm_fn_ref, mhc_pre_split_mixes_ref,
                               sinkhorn_normalize_ref)

N = 4
N3 = N * (N + 2)


def _data(shape, H, device):
    stream = 1 + torch.arange(N, device=device).mul(0.01)
    residual = (torch.randn(*shape, N, H, device=device) * stream.view(-1, 1)).bfloat16()
    fn = (torch.randn(N3, N, H, device=device) * 1e-4 * stream.view(1, -1, 1)).flatten(1, 2)
    scale = torch.randn(3, device=device) * 0.1
    base = torch.randn(N3, device=device) * 0.1
    return residual, fn, scale, base


def _unfused(residual, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat):
    mixes = mhc_pre_norm_fn(residual, fn, None, rms_eps, fuse_grad_acc=False, n_splits=16)
    if mixes.dim() != 3:  # pre_split_mixes takes (B, S, n3)
        mixes = mixes.reshape(1, -1, N3)
    pre, post, comb = mhc_pre_split_mixes(mixes, scale, base, N, post_mult, pre_eps)
    comb = sinkhorn_normalize(comb, repeat=repeat, eps=sk_eps)
    outer = residual.shape[:-2]
    layer_input = mhc_pre_apply_mix(residual, pre.view(*outer, N, 1))
    return post.view(*outer, N, 1), comb.view(*outer, N, N), layer_input


def _check(residual, fn, scale, base, rms_eps=1e-6, pre_eps=1e-6, sk_eps=1e-6, post_mult=1.0, repeat=10):
    args = (residual, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat)
    post, comb, layer_input = mhc_pre_big_fuse(*args, n_splits=16)
    outer = tuple(residual.shape[:-2])
    assert post.shape == (*outer, N, 1) and post.dtype == torch.float32
    assert comb.shape == (*outer, N, N) and comb.dtype == torch.float32
    assert layer_input.shape == (*outer, residual.shape[-1]) and layer_input.dtype == torch.bfloat16
    post_u, comb_u, li_u = _unfused(*args)
    assert torch.equal(post, post_u)
    assert torch.equal(comb, comb_u)
    assert torch.equal(layer_input, li_u)
    return post, comb, layer_input


@pytest.mark.parametrize("n1,H", pick(cpu=[(1, 64), (13, 80), (40, 96)],
                                      gpu=[(n1, H) for n1 in (512, 1024, 2048, 8192) for H in (1280, 2560, 4096)]))
def test_correctness(device, n1, H):
    residual, fn, scale, base = _data((1, n1), H, device)
    post, comb, layer_input = _check(residual, fn, scale, base)
    # against the references (fp32 GEMM without TF32 on the CPU; sigmoid / exp / rsqrt differ in the last bits)
    mixes = mhc_pre_norm_fn_ref(residual, fn, None, 1e-6)
    pre_r, post_r, comb_r = mhc_pre_split_mixes_ref(mixes, scale, base, N, 1.0, 1e-6)
    comb_r = sinkhorn_normalize_ref(comb_r, 10, 1e-6)
    torch.testing.assert_close(post, post_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(comb, comb_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer_input, mhc_pre_apply_mix_ref(residual, pre_r))


@pytest.mark.parametrize("case", ["splits", "params", "3d", "n0=2"])
def test_variants(device, case):
    """A forced split over D (the fused and unfused paths share it), other eps / post_mult / repeat values, and
    other leading dimensions."""
    H = 48
    if case == "splits":
        residual, fn, scale, base = _data((1, 21), H, device)
        with override_config("mhc_norm_fn_gemm", SPLITS=3, BLOCK_D=32):
            _check(residual, fn, scale, base)
    elif case == "params":
        residual, fn, scale, base = _data((1, 9), H, device)
        _check(residual, fn, scale, base, rms_eps=1e-3, pre_eps=1e-2, sk_eps=1e-4, post_mult=2.0, repeat=3)
        _check(residual, fn, scale, base, repeat=1)
    elif case == "3d":
        residual, fn, scale, base = _data((11,), H, device)
        _check(residual, fn, scale, base)
    else:
        residual, fn, scale, base = _data((2, 5), H, device)
        _check(residual, fn, scale, base)


def test_zero_tokens(device):
    residual, fn, scale, base = _data((1, 0), 64, device)
    post, comb, layer_input = mhc_pre_big_fuse(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 1.0, 10)
    assert post.shape == (1, 0, N, 1) and comb.shape == (1, 0, N, N) and layer_input.shape == (1, 0, 64)


def test_bad_inputs(device):
    residual, fn, scale, base = _data((1, 3), 32, device)
    eps = (1e-6, 1e-6, 1e-6, 1.0, 10)
    with pytest.raises(TypeError, match="residual"):
        mhc_pre_big_fuse(residual.float(), fn, scale, base, *eps)
    for k, name in enumerate(("rms_eps", "mhc_pre_eps", "mhc_sinkhorn_eps")):
        bad = list(eps)
        bad[k] = -1e-6
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            mhc_pre_big_fuse(residual, fn, scale, base, *bad)
    with pytest.raises(TypeError, match="sinkhorn_repeat must be an int"):
        mhc_pre_big_fuse(residual, fn, scale, base, *eps[:4], 2.5)
    with pytest.raises(TypeError, match="fn"):
        mhc_pre_big_fuse(residual, fn.double(), scale, base, *eps)
    with pytest.raises(ValueError, match="fn"):
        mhc_pre_big_fuse(residual, fn[:, :64].contiguous(), scale, base, *eps)
    with pytest.raises(ValueError, match="24 rows"):
        mhc_pre_big_fuse(residual, fn[:20].contiguous(), scale, base, *eps)
    with pytest.raises(ValueError, match="mhc_scale"):
        mhc_pre_big_fuse(residual, fn, scale[:2], base, *eps)
    with pytest.raises(TypeError, match="mhc_base"):
        mhc_pre_big_fuse(residual, fn, scale, base.double(), *eps)
    with pytest.raises(ValueError, match="mhc_base"):
        mhc_pre_big_fuse(residual, fn, scale, base[:-1], *eps)
    with pytest.raises(ValueError, match="sinkhorn_repeat"):
        mhc_pre_big_fuse(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 1.0, 0)
    with pytest.raises(ValueError, match="mhc_post_mult_value"):
        mhc_pre_big_fuse(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 0.0, 10)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        mhc_pre_big_fuse(residual.transpose(-1, -2).contiguous().transpose(-1, -2), fn, scale, base, *eps)


def test_torch_compile(device):
    residual, fn, scale, base = _data((1, 7), 32, device)
    eager = mhc_pre_big_fuse(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 1.0, 10)
    compiled = torch.compile(lambda *a: mhc_pre_big_fuse(*a, 1e-6, 1e-6, 1e-6, 1.0, 10), fullgraph=True,
                             backend="eager" if device.type == "cpu" else "inductor")
    for a, b in zip(compiled(residual, fn, scale, base), eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T,H,post_mult", [(7, 64, 1.0), (3, 1280, 2.0)])
def test_tail_exact(device, T, H, post_mult):
    """The fused kernel from the GEMM's outputs on, in TileKernels' order, bit for bit: ``mixes = p r`` (the plain
    product), ``fma(mixes, scale, base)``, the sigmoids, the forward Sinkhorn's butterflies and the apply-mix chain."""
    from tritile.mhc.pre_big_fuse_kernel import big_fuse_tail
    from tritile.torch._numerics import fma_f32
    from tritile.torch.mhc import _fma_chain, _norm_fn_norm_tk, _sigmoid_tk, _sinkhorn_fwd_tk

    residual, _, scale, base = _data((T,), H, device)
    D = N * H
    p = torch.randn(1, T, N3, device=device) * 30
    s = torch.rand(1, T, device=device) * D * 2
    post, comb, li = big_fuse_tail(p, s, residual.view(T, D), scale, base, 1e-6, 1e-2, 1e-6, post_mult, 10, N)
    mixes = _norm_fn_norm_tk(p[0], s[0], D, 1e-6, fused_tail=True)
    sc = torch.cat([scale[0].expand(N), scale[1].expand(N), scale[2].expand(N * N)])
    z = fma_f32(mixes, sc.expand(T, N3), base.expand(T, N3))
    pre = _sigmoid_tk(z[:, :N]) + 1e-2
    assert torch.equal(post, _sigmoid_tk(z[:, N:2 * N]) * post_mult)
    assert torch.equal(comb, _sinkhorn_fwd_tk(z[:, 2 * N:].reshape(T, N, N), 10, 1e-6))
    assert torch.equal(li, _fma_chain(pre[:, :, None], residual.float(), 1).squeeze(1).bfloat16())
