"""tritile's mHC side by side with TileKernels itself: every op of both libraries on the same inputs, at TileKernels'
test shapes (tokens 4096 and 8192; hidden 1280, 2560, 4096, 7168; mhc_mult 4), forward and forward + backward.

Runs where the real TileKernels (its TileLang kernels) is importable on a CUDA GPU, e.g. with
``../shared/tools/tk_native`` (see the README there); skipped elsewhere, also where ``tile_kernels`` resolves to
tritile through that folder's import shim.  ``TRITILE_TK_QUICK=1`` keeps 4096 tokens and hidden 1280 and 7168.

What is compared, and how:

- bitwise (``torch.equal``): every op whose result is fixed by its inputs and TileKernels' order of operations:
  ``expand_to_mhc``, ``mhc_post`` (+ ``mhc_post_fwd`` / ``mhc_post_bwd``), ``mhc_pre_apply_mix``,
  ``sinkhorn_normalize``, ``mhc_pre_split_mixes``, ``mhc_head_compute_mix``, ``mhc_multilayer_recompute``, forward
  and backward (the parameter gradients from TileKernels' one row of partial sums per SM); ``norm_fn``'s
  normalisation steps and ``pre_big_fuse``'s kernel on the same GEMM outputs (TileKernels' own kernels called on
  them).
- bounded: what goes through the projection GEMM (``mhc_pre_norm_fn``, ``mhc_pre_big_fuse``, ``mhc_pre``,
  ``mhc_head``).  TileKernels accumulates it on tensor cores (TF32 ``mma.sync``, in its order); tritile's Triton
  GEMM (``wgmma`` on Hopper, its own tiling and split over ``D``) sums the same exact products in another order,
  which cannot be reproduced.  Bounds, each with its cause:

  * a float32 sum of products (the mixes before normalisation, ``fn``'s gradient): ``2^-14`` of the sum of the
    products' magnitudes (two float32 sums of up to 28672 (forward) or 8192 (backward) terms in different orders;
    measured up to ``2^-18.5`` on an H200);
  * the residual gradient of ``norm_fn`` (``g_p . tf32(fn) + 2 x g_s``, rounded to bf16): one bf16 ulp, plus
    ``2^-10`` of ``|g_p| . |fn|`` (the TF32 rounding of ``g_p`` may land one TF32 ulp apart: ``r`` differs in its
    last bits) and ``2^-14`` of the ``g_s`` term; the two terms can cancel, so one ulp of the result is no bound;
  * the layer input ``sum_s pre_s x_s`` (``mhc_pre``, ``pre_big_fuse``, ``mhc_head``'s output): one bf16 ulp plus
    ``2^-20 sum_s |x_s|``.  The pre mixes come out of the GEMM a few float32 ulps apart (the post mixes: up to
    ``1.8e-7`` measured, ``2^-22.4``), and four terms of magnitude ~1 can cancel to a result thousands of bf16 ulps
    smaller than they are: there, a float64 reference of the layer input is up to ~1000 ulps of the result from
    *both* libraries (H200, hidden 7168), so one ulp of the result bounds nothing there;
  * the post and comb mixes (in [0, 1]): ``1e-5`` (the mixes' difference through the sigmoid and Sinkhorn; measured
    up to ``2.4e-7``);
  * whole chains (``mhc_pre`` with ``mhc_post``, ``mhc_head``, forward + backward): ``calc_diff < 1e-6`` on the
    chain's output and every gradient (the above, through a nonlinear sublayer and the residual-gradient buffer's
    bf16 roundings).
"""

import math
import os

import pytest
import torch

from tritile.testing import calc_diff

N = 4
N3 = N * (N + 2)
EPS = 1e-6


def _load_tilekernels():
    if not torch.cuda.is_available():
        return None, "TileKernels runs TileLang kernels: needs a CUDA GPU"
    try:
        import tile_kernels.mhc
        import tile_kernels.modeling.mhc.functional as tk_functional
        import tile_kernels.modeling.mhc.ops as tk_ops
    except Exception as e:  # not installed, or TileLang missing
        return None, f"TileKernels is not importable ({type(e).__name__}: {e})"
    if tile_kernels.mhc.__name__.startswith("tritile"):
        return None, "tile_kernels resolves to tritile (the import shim): there is no TileKernels to compare with"
    return (tk_ops, tk_functional), None


_TK, _REASON = _load_tilekernels()
pytestmark = pytest.mark.skipif(_TK is None, reason=str(_REASON))

if os.environ.get("TRITILE_TK_QUICK") == "1":
    TOKENS, HIDDEN = (4096,), (1280, 7168)
else:
    TOKENS, HIDDEN = (4096, 8192), (1280, 2560, 4096, 7168)
SHAPES = [(t, h) for t in TOKENS for h in HIDDEN]
DEV = "cuda"


def _tk():
    return _TK[0]


def _tt():
    import tritile.modeling.mhc.ops as ops

    return ops


# ------------------------------------------------------------------------------------------------
# Comparisons
# ------------------------------------------------------------------------------------------------
def _equal(name, tk, tt):
    assert tk.shape == tt.shape and tk.dtype == tt.dtype, (name, tk.shape, tt.shape, tk.dtype, tt.dtype)
    if torch.equal(tk, tt):
        return
    ne = tk != tt
    d = (tk.float() - tt.float()).abs()
    i = int(d.flatten().argmax())
    raise AssertionError(f"{name}: {int(ne.sum())} of {tk.numel()} differ, max |d| = {d.max().item():.3g} "
                         f"(TileKernels {tk.flatten()[i].item()!r}, tritile {tt.flatten()[i].item()!r})")


def _within(name, tk, tt, bound):
    d = (tk.double() - tt.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64, device=d.device).expand_as(d)
    bad = d > bound
    ratio = (d / bound.clamp_min(1e-300)).max().item()
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} of {d.numel()} beyond the bound, max |d| = "
                                 f"{d.max().item():.3g}, max |d| / bound = {ratio:.3g}")


def _bf16_ulp(a, b):
    """One bf16 ulp of the larger magnitude of ``a`` and ``b`` (the smallest normal's ulp near zero)."""
    m = torch.maximum(a.double().abs(), b.double().abs()).clamp_min(2.0 ** -126)
    _, e = torch.frexp(m)  # m = f 2^e with f in [0.5, 1): a bf16 ulp there is 2^(e - 8)
    return torch.ldexp(torch.ones_like(m), e - 8)


def _mix_apply_bound(a, b, residual):
    """The layer input's bound: one bf16 ulp of the larger of ``a`` and ``b`` plus ``2^-20 sum_s |x_s|`` over the
    residual's streams (``residual (..., N, H)``)."""
    terms = residual.double().abs().sum(-2).reshape(a.shape)
    return _bf16_ulp(a, b) + 2.0 ** -20 * terms


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


# ------------------------------------------------------------------------------------------------
# Bitwise ops
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,H", SHAPES)
def test_expand(T, H):
    x = torch.randn(1, T, H, device=DEV).bfloat16()
    g = torch.randn(1, T, N, H, device=DEV).bfloat16()
    res = []
    for ops in (_tk(), _tt()):
        (xl,) = _leaves(x)
        out = ops.expand_to_mhc(xl, N)
        out.backward(g)
        res.append((out, xl.grad))
    for name, a, b in zip(("out", "grad"), *res):
        _equal(name, a, b)


@pytest.mark.parametrize("T,H", SHAPES)
def test_post(T, H):
    x = torch.randn(1, T, H, device=DEV).bfloat16()
    r = torch.randn(1, T, N, H, device=DEV).bfloat16()
    post = torch.randn(1, T, N, 1, device=DEV)
    comb = torch.randn(1, T, N, N, device=DEV)
    g = torch.randn(1, T, N, H, device=DEV).bfloat16()
    res = []
    for ops in (_tk(), _tt()):
        ls = _leaves(x, r, post, comb)
        out = ops.mhc_post(*ls)
        out.backward(g)
        res.append([out] + [t.grad for t in ls])
    for name, a, b in zip(("out", "d_x", "d_residual", "d_post", "d_comb"), *res):
        _equal(name, a, b)
    _equal("mhc_post_fwd", _tk().mhc_post_fwd(x, r, post, comb), _tt().mhc_post_fwd(x, r, post, comb))


@pytest.mark.parametrize("T,H", SHAPES)
@pytest.mark.parametrize("buffer", [True, False])
def test_pre_apply_mix(T, H, buffer):
    x = torch.randn(1, T, N, H, device=DEV).sigmoid().bfloat16()
    mix = torch.randn(1, T, N, 1, device=DEV).softmax(-2)
    g = torch.randn(1, T, H, device=DEV).bfloat16()
    acc = torch.randn(1, T, N, H, device=DEV).bfloat16()
    res = []
    for ops in (_tk(), _tt()):
        xl, ml = _leaves(x, mix)
        out = ops.mhc_pre_apply_mix(xl, ml)
        buf = acc.clone()
        if buffer:
            xl.untyped_storage().grad_from_mhc_post = buf
        out.backward(g)
        res.append((out, buf if buffer else xl.grad, ml.grad))
    for name, a, b in zip(("out", "d_x", "d_mix"), *res):
        _equal(name, a, b)


@pytest.mark.parametrize("T", TOKENS + (33,))
@pytest.mark.parametrize("repeat,eps", [(10, 1e-6), (3, 1e-3)])
def test_sinkhorn(T, repeat, eps):
    x = torch.randn(1, T, N, N, device=DEV)
    g = torch.randn(1, T, N, N, device=DEV)
    res = []
    for ops in (_tk(), _tt()):
        (xl,) = _leaves(x)
        out = ops.sinkhorn_normalize(xl, repeat, eps)
        out.backward(g)
        res.append((out, xl.grad))
    for name, a, b in zip(("out", "grad"), *res):
        _equal(name, a, b)


@pytest.mark.parametrize("T", TOKENS + (1000,))
def test_pre_split_mixes(T):
    m = torch.randn(1, T, N3, device=DEV)
    s = torch.randn(3, device=DEV)
    b = torch.randn(N3, device=DEV)
    gs = [torch.randn(1, T, N, 1, device=DEV), torch.randn(1, T, N, 1, device=DEV), torch.randn(1, T, N, N, device=DEV)]
    res = []
    for ops in (_tk(), _tt()):
        ls = _leaves(m, s, b)
        outs = ops.mhc_pre_split_mixes(*ls, N, 2.0, 1e-2)
        torch.autograd.backward(list(outs), gs)
        res.append(list(outs) + [t.grad for t in ls])
    for name, a, b_ in zip(("pre", "post", "comb", "d_mixes", "d_scale", "d_base"), *res):
        _equal(name, a, b_)


@pytest.mark.parametrize("T", TOKENS + (1000,))
def test_head_compute_mix(T):
    m = torch.randn(1, T, N, device=DEV)
    s = torch.randn(1, device=DEV)
    b = torch.randn(N, device=DEV)
    g = torch.randn(1, T, N, device=DEV)
    res = []
    for ops in (_tk(), _tt()):
        ls = _leaves(m, s, b)
        out = ops.mhc_head_compute_mix(*ls, 1e-2)
        out.backward(g)
        res.append([out] + [t.grad for t in ls])
    for name, a, b_ in zip(("out", "d_input", "d_scale", "d_base"), *res):
        _equal(name, a, b_)


@pytest.mark.parametrize("T,H", SHAPES)
@pytest.mark.parametrize("L,LP", [(10, 9), (10, 10)])
def test_multilayer_recompute(T, H, L, LP):
    r0 = torch.randn(1, T, N, H, device=DEV).bfloat16()
    pre = [torch.randn(1, T, N, 1, device=DEV) for _ in range(L)]
    y = [torch.randn(1, T, H, device=DEV).bfloat16() for _ in range(LP)]
    post = [torch.randn(1, T, N, 1, device=DEV) for _ in range(LP)]
    comb = [torch.randn(1, T, N, N, device=DEV) for _ in range(LP)]
    res = []
    for ops in (_tk(), _tt()):
        li = [torch.empty(1, T, H, device=DEV, dtype=torch.bfloat16) for _ in range(L)]
        rs = [torch.empty(1, T, N, H, device=DEV, dtype=torch.bfloat16) for _ in range(LP)]
        ops.mhc_multilayer_recompute(r0, pre, y, post, comb, li, rs)
        res.append(li + rs)
    for k, (a, b) in enumerate(zip(*res)):
        _equal(f"layer_input[{k}]" if k < L else f"residual[{k - L}]", a, b)


# ------------------------------------------------------------------------------------------------
# The GEMM's neighbours, bitwise on the same GEMM outputs
# ------------------------------------------------------------------------------------------------
def _gemm_outputs(T, H):
    D = N * H
    return torch.randn(1, T, N3, device=DEV) * 30, torch.rand(1, T, device=DEV) * D * 2


@pytest.mark.parametrize("T,H", SHAPES)
def test_norm_fn_normalisation_steps(T, H):
    from tile_kernels.mhc import norm_fn_kernel as tk_nf

    from tritile.mhc.norm_fn_kernel import bwd_normalise, normalise

    D = N * H
    p, s = _gemm_outputs(T, H)
    out_mul = torch.empty(T, 1, N3, device=DEV)
    sqrsum = torch.empty(T, 1, device=DEV)
    out = torch.empty(T, N3, device=DEV)
    tk_nf._mhc_pre_norm_fn_fwd_norm(N3, 1, D, EPS, 1)(p.view(1, T, 1, N3), s.view(1, T, 1), out_mul, sqrsum, out)
    _equal("mixes", out, normalise(p, s, D, EPS)[0])
    g = torch.randn(T, N3, device=DEV)
    gp = torch.empty(T, 1, N3, device=DEV)
    gs = torch.empty(T, 1, device=DEV)
    tk_nf._mhc_pre_norm_fn_bwd_norm(N3, 1, D, EPS)(g, p.view(T, 1, N3), s.view(T, 1), gp, gs)
    gp_t, gs_t = bwd_normalise(g, p[0].contiguous(), s[0].contiguous(), D, EPS, False)
    _equal("g_p", gp.view(T, N3), gp_t[:, :N3].contiguous())
    _equal("g_s", gs.view(T), gs_t)


@pytest.mark.parametrize("T,H", SHAPES)
def test_pre_big_fuse_kernel(T, H):
    """TileKernels' fused kernel and tritile's on the same GEMM outputs: the normalisation, the split, the Sinkhorn
    and the apply-mix."""
    from tile_kernels.mhc import pre_big_fuse_kernel as tk_bf

    from tritile.mhc.pre_big_fuse_kernel import big_fuse_tail

    p, s = _gemm_outputs(T, H)
    r = torch.randn(T, N, H, device=DEV).bfloat16()
    scale = torch.randn(3, device=DEV) * 0.1
    base = torch.randn(N3, device=DEV) * 0.1
    post = torch.empty(T, N, device=DEV)
    comb = torch.empty(T, N * N, device=DEV)
    li = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
    tk_bf._mhc_pre_big_fuse(H, EPS, 1e-2, EPS, 2.0, 10, n_splits=1, mhc_mult=N)(p, s, scale, base, r, post, comb, li)
    got = big_fuse_tail(p, s, r.view(T, N * H), scale, base, EPS, 1e-2, EPS, 2.0, 10, N)
    _equal("post", post, got[0])
    _equal("comb", comb, got[1].view(T, N * N))
    _equal("layer_input", li, got[2])


# ------------------------------------------------------------------------------------------------
# Through the GEMM: bounded
# ------------------------------------------------------------------------------------------------
def _norm_data(T, H):
    stream = 1 + torch.arange(N, device=DEV).mul(0.01)
    residual = (torch.randn(1, T, N, H, device=DEV) * stream.view(-1, 1)).bfloat16()
    fn = (torch.randn(N3, N, H, device=DEV) * 1e-4 * stream.view(1, -1, 1)).flatten(1, 2)
    return residual, fn


def _tf32(t):
    return ((t.view(torch.int32) + 0x1000) & -8192).view(torch.float32)


def _sum_bound(a_abs, b_abs):
    """``2^-14`` of the sum of the products' magnitudes, ``a_abs @ b_abs`` (float64)."""
    return 2.0 ** -14 * (a_abs.double() @ b_abs.double())


@pytest.mark.parametrize("T,H", SHAPES)
@pytest.mark.parametrize("normw", [False, True])
def test_norm_fn(T, H, normw):
    residual, fn = _norm_data(T, H)
    w = torch.randn(N * H, device=DEV) * 0.1 + 1.0 if normw else None
    g = torch.randn(1, T, N3, device=DEV)
    res = []
    for ops in (_tk(), _tt()):
        rl, fl = _leaves(residual, fn)
        wl = w.clone().requires_grad_() if normw else None
        out = ops.mhc_pre_norm_fn(rl, fl, wl, EPS)
        buf = torch.zeros_like(rl)
        rl.untyped_storage().grad_from_mhc_post = buf
        out.backward(g)
        res.append((out, buf, fl.grad, wl.grad if normw else None))
    (out_k, rg_k, fg_k, wg_k), (out_t, rg_t, fg_t, wg_t) = res
    x = residual.view(T, N * H).float()
    fn2 = fn * w if normw else fn
    fnt = _tf32(fn2)
    xs = x.double().square().sum(1)
    r = torch.rsqrt(xs / (N * H) + EPS)
    # mixes = p r: p's float32 sum in another order, and r's through the sum of squares
    bound = _sum_bound(x.abs(), fnt.abs().t()) * r[:, None] + 2.0 ** -14 * out_k.view(T, N3).double().abs()
    _within("mixes", out_k.view(T, N3), out_t.view(T, N3), bound)
    gp = _tf32((g.view(T, N3) * r.float()[:, None]))
    # d_residual = bf16(g_p . tf32(fn) + 2 x g_s): each g_p is rounded to TF32 after a product with r, whose float32
    # value differs in its last bits (the sums of squares in other orders), so the two roundings may land one TF32
    # ulp (2^-10 relative) apart; g_s = -(sum g p) r / (2 (s + eps D)) carries p's 2^-14 bound.  Both libraries are
    # ~1e6 bf16 ulps from a float64 reference where the two terms cancel (H100, hidden 1280), so one ulp of the
    # result alone bounds nothing there.
    p64 = x.double() @ fnt.double().t()
    p_mag = p64.abs() + x.double().abs() @ fnt.double().abs().t()  # |p| and the magnitudes its sum adds
    gs_mag = (g.view(T, N3).double().abs() * p_mag).sum(1) * r / (2 * (xs + EPS * N * H))
    rbound = (_bf16_ulp(rg_k, rg_t).view(T, N * H) + 2.0 ** -10 * (gp.double().abs() @ fnt.double().abs())
              + 2.0 ** -14 * 2 * x.double().abs() * gs_mag[:, None])
    _within("d_residual", rg_k, rg_t, rbound.view(rg_k.shape))
    fbound = _sum_bound(gp.abs().t(), x.abs())
    _within("d_fn", fg_k, fg_t, fbound * (w.abs()[None, :] if normw else 1.0))
    if normw:
        _within("d_norm_weight", wg_k, wg_t, (fbound * fn.abs().double()).sum(0) + 2.0 ** -14 * (
            (fg_k.double() / w.double()).abs() * fn.abs().double()).sum(0))


@pytest.mark.parametrize("T,H", SHAPES)
def test_pre_big_fuse(T, H):
    residual, fn = _norm_data(T, H)
    scale = torch.randn(3, device=DEV) * 0.1
    base = torch.randn(N3, device=DEV) * 0.1
    res = [ops.mhc_pre_big_fuse(residual, fn, scale, base, EPS, EPS, EPS, 1.0, 10, 16) for ops in (_tk(), _tt())]
    (post_k, comb_k, li_k), (post_t, comb_t, li_t) = res
    _within("post_mix", post_k, post_t, 1e-5)
    _within("comb_mix", comb_k, comb_t, 1e-5)
    _within("layer_input", li_k, li_t, _mix_apply_bound(li_k, li_t, residual))


def _functional():
    import tritile.modeling.mhc.functional as tt_functional

    return _TK[1], tt_functional


@pytest.mark.parametrize("T,H", SHAPES)
def test_mhc_pre_no_grad(T, H):
    residual, fn = _norm_data(T, H)
    scale = torch.randn(3, device=DEV) * 0.1
    base = torch.randn(N3, device=DEV) * 0.1
    with torch.no_grad():
        res = [F.mhc_pre(residual, fn, scale, base) for F in _functional()]
    (li_k, (post_k, comb_k)), (li_t, (post_t, comb_t)) = res
    _within("post_mix", post_k, post_t, 1e-5)
    _within("comb_mix", comb_k, comb_t, 1e-5)
    _within("layer_input", li_k, li_t, _mix_apply_bound(li_k, li_t, residual))


@pytest.mark.parametrize("T,H", SHAPES)
@pytest.mark.parametrize("normw", [False, True])
def test_mhc_pre_with_post(T, H, normw):
    """``mhc_pre`` -> a bf16 sublayer -> ``mhc_post``, forward and backward (TileKernels' ``mhc_pre`` needs the
    ``mhc_post`` for its backward)."""
    residual, fn = _norm_data(T, H)
    scale = torch.randn(3, device=DEV) * 0.1
    base = torch.randn(N3, device=DEV) * 0.1
    w = torch.randn(N * H, device=DEV) * 0.1 + 1.0 if normw else None
    g = torch.randn(1, T, N, H, device=DEV).bfloat16()
    res = []
    for F, ops in zip(_functional(), (_tk(), _tt())):
        ls = _leaves(residual, fn, scale, base) + ([w.clone().requires_grad_()] if normw else [])
        R = ls[0] * 1  # a non-leaf residual, as inside a model
        u, (post, comb) = F.mhc_pre(R, *ls[1:4], norm_weight=ls[4] if normw else None)
        out = ops.mhc_post((u.float().tanh() * 2).bfloat16(), R, post, comb)
        out.backward(g)
        res.append([u, post, comb, out] + [t.grad for t in ls])
    names = ("layer_input", "post_mix", "comb_mix", "out", "d_residual", "d_fn", "d_scale", "d_base", "d_norm_weight")
    for name, a, b in zip(names, *res):
        if name in ("post_mix", "comb_mix"):
            _within(name, a, b, 1e-5)
        elif name == "layer_input":
            _within(name, a, b, _mix_apply_bound(a, b, residual))
        else:
            d = calc_diff(a, b)
            assert d < 1e-6, (name, d)


@pytest.mark.parametrize("T,H", SHAPES)
def test_mhc_head(T, H):
    """TileKernels' ``mhc_head`` fails on its own sliced mixes (its head kernel's compact-stride argument check);
    tritile's matches TileKernels' pieces composed with contiguous mixes."""
    tk_F, tt_F = _functional()
    residual, fn4 = _norm_data(T, H)
    fn4 = fn4[:N].contiguous()
    scale = torch.randn(1, device=DEV) * 0.1
    base = torch.randn(N, device=DEV) * 0.1
    with pytest.raises(Exception, match="ABI"):
        tk_F.mhc_head(residual, fn4, scale, base)
    g = torch.randn(1, T, H, device=DEV).bfloat16()
    res = []
    for impl in ("tk", "tt"):
        rl, fl, sl, bl = _leaves(residual, fn4, scale, base)
        if impl == "tk":
            ops = _tk()
            mixes = ops.mhc_pre_norm_fn(rl, torch.nn.functional.pad(fl, (0, 0, 0, N3 - N)), None, EPS)
            mix = ops.mhc_head_compute_mix(mixes[..., :N].contiguous(), sl, bl, EPS)
            out = ops.mhc_pre_apply_mix(rl, mix.unsqueeze(-1))
            buf = torch.zeros_like(rl)
            rl.untyped_storage().grad_from_mhc_post = buf  # no mhc_post: the buffer by hand
            out.backward(g)
            rgrad = buf if rl.grad is None else rl.grad + buf
        else:
            out = tt_F.mhc_head(rl, fl, sl, bl)
            out.backward(g)
            rgrad = rl.grad
        res.append((out, rgrad, fl.grad, sl.grad, bl.grad))
    (out_k, *gk), (out_t, *gt) = res
    _within("out", out_k, out_t, _mix_apply_bound(out_k, out_t, residual))
    for name, a, b in zip(("d_residual", "d_fn", "d_scale", "d_base"), gk, gt):
        d = calc_diff(a, b)
        assert d < 1e-6, (name, d)


def test_bounds_are_not_vacuous():
    """The bounds above reject a one-bf16-ulp change of a single bf16 value only where stated (two ulps fail the
    one-ulp bound), a relative change of 2^-10 of a float32 sum, and a layer input from a pre mix off by 2^-12."""
    a = torch.tensor([1.0, 3.0], device=DEV).bfloat16()
    b = a.clone()
    b[1] = 3.03125  # two bf16 ulps of 3
    with pytest.raises(AssertionError):
        _within("x", a, b, _bf16_ulp(a, b))
    x = torch.randn(64, 512, device=DEV).abs()
    y = torch.randn(512, 8, device=DEV).abs()
    p = x @ y
    with pytest.raises(AssertionError):
        _within("p", p, p * (1 + 2.0 ** -10), _sum_bound(x, y))
    assert math.isfinite(float(_sum_bound(x, y).max()))
    # the layer input's bound rejects a pre mix off by 2^-12 (a stream's weight, not a rounding)
    gen = torch.Generator(device=DEV).manual_seed(0)
    r = torch.randn(64, N, 512, device=DEV, generator=gen).bfloat16()
    pre = torch.rand(64, N, 1, device=DEV, generator=gen)
    li = (pre * r.float()).sum(1).bfloat16()
    li_off = ((pre + torch.tensor([2.0 ** -12, 0, 0, 0], device=DEV)[:, None]) * r.float()).sum(1).bfloat16()
    _within("li", li, (pre * r.float()).sum(1).bfloat16(), _mix_apply_bound(li, li, r))
    with pytest.raises(AssertionError):
        _within("li", li, li_off, _mix_apply_bound(li, li_off, r))
