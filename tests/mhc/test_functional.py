"""The mHC layer API (``expand_from_embedding``, ``mhc_pre``, ``mhc_head``) and a whole chained layer.

- ``mhc_pre``'s training path against its no-grad path (``mhc_pre_big_fuse``), with and without ``norm_weight``
  (TileKernels' upstream test, ``atol = rtol = 1e-4``; here the two are in fact bitwise equal, and checked so).
- One model: ``expand_from_embedding`` -> 2 x (``mhc_pre`` -> bf16 linear -> ``mhc_post``) -> ``mhc_head``, forward
  and backward, against the same model built from ``tritile.torch``'s references with plain autograd (the fused
  residual-gradient buffer of ``mhc_post`` / ``mhc_pre_apply_mix`` / ``mhc_pre_norm_fn`` against autograd's sums).
"""

import pytest
import torch
import torch.nn.functional as F

from tritile.modeling.mhc import expand_from_embedding, mhc_head, mhc_pre
from tritile.mhc import round_to_tf32
from tritile.modeling.mhc.ops import mhc_post
from tritile.testing import calc_diff, pick
from tritile.torch.mhc import (expand_to_mhc_ref, mhc_head_compute_mix_ref, mhc_post_ref, mhc_pre_apply_mix_ref,
                               mhc_pre_norm_fn_ref, mhc_pre_split_mixes_ref, sinkhorn_normalize_ref)

N = 4
N3 = N * (N + 2)
EPS = 1e-6


def _params(H, device, normw, rows=N3):
    stream = 1 + torch.arange(N, device=device).mul(0.01)
    fn = (torch.randn(rows, N, H, device=device) * 1e-4 * stream.view(1, -1, 1)).flatten(1, 2)
    scale = torch.randn(3 if rows == N3 else 1, device=device) * 0.1
    base = torch.randn(rows, device=device) * 0.1
    w = torch.randn(N * H, device=device) * 0.1 + 1.0 if normw else None
    return fn, scale, base, w


def _residual(n0, n1, H, device):
    stream = 1 + torch.arange(N, device=device).mul(0.01)
    return (torch.randn(n0, n1, N, H, device=device) * stream.view(-1, 1)).bfloat16()


@pytest.mark.parametrize("normw", [False, True])
@pytest.mark.parametrize("n1,H", pick(cpu=[(13, 64), (33, 80)],
                                      gpu=[(n1, H) for n1 in (4096, 8192) for H in (1280, 2560, 7168)]))
def test_mhc_pre_train_vs_no_grad(device, n1, H, normw):
    residual = _residual(1, n1, H, device)
    fn, scale, base, w = _params(H, device, normw)
    r = residual.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (fn, scale, base)]
    nw = None if w is None else w.clone().requires_grad_()
    li, (post, comb) = mhc_pre(r, *leaves, norm_weight=nw)
    assert li.requires_grad and post.requires_grad and comb.requires_grad
    with torch.no_grad():
        li0, (post0, comb0) = mhc_pre(residual, fn, scale, base, norm_weight=w)
    with torch.inference_mode():
        li1, (post1, comb1) = mhc_pre(residual, fn, scale, base, norm_weight=w)
    for a, b, c in ((li, li0, li1), (post, post0, post1), (comb, comb0, comb1)):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.detach(), b, atol=1e-4, rtol=1e-4)
        # the no-grad path is the fused kernel of the same ops: bitwise the same
        assert torch.equal(a.detach(), b) and torch.equal(b, c)
    if normw:  # the norm weight is honoured without grad (TileKernels drops it there)
        with torch.no_grad():
            _, (post2, _) = mhc_pre(residual, fn, scale, base)
        assert not torch.equal(post2, post0)


def _tf32(v: torch.Tensor) -> torch.Tensor:
    """float32 -> TF32 as the kernels round it (``round_to_tf32``, then the low 13 bits cleared)."""
    return (round_to_tf32(v).view(torch.int32) & -8192).view(torch.float32)


class _TF32Projection(torch.autograd.Function):
    """``p = x . tf32(fn)^T`` with the backward of TileKernels' TF32 GEMMs made explicit: ``g_p`` rounded to TF32 where
    the kernels round it (CUDA), straight through to ``fn``.  cuBLAS picks TF32 or float32 kernels by shape (at a
    few tokens, float32), so ``allow_tf32`` alone does not fix what the reference computes."""

    @staticmethod
    def forward(ctx, x, fn, round_grad):
        f = _tf32(fn)
        ctx.save_for_backward(x, f)
        ctx.round_grad = round_grad
        return torch.einsum("abd,jd->abj", x, f)

    @staticmethod
    def backward(ctx, g):
        x, f = ctx.saved_tensors
        if ctx.round_grad:
            g = _tf32(g.contiguous())
        return torch.einsum("abj,jd->abd", g, f), torch.einsum("abj,abd->jd", g, x), None


def _norm_fn_ref(residual, fn, w, eps):
    """``mhc_pre_norm_fn_ref`` with the kernels' TF32 operands explicit (``_TF32Projection``)."""
    a, b, n, h = residual.shape
    x = residual.float().reshape(a, b, n * h)
    p = _TF32Projection.apply(x, fn if w is None else fn * w, residual.device.type == "cuda")
    return p * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class _Model:
    """The chained model: ``expand -> 2 x (pre -> linear -> post) -> head``; ``ops`` picks tritile or references."""

    def __init__(self, H, device, normw):
        self.subs = []
        for _ in range(2):
            fn, scale, base, w = _params(H, device, normw)
            lin = torch.randn(H, H, device=device).mul(H ** -0.5).bfloat16()
            self.subs.append([fn, scale, base, w, lin])
        fn_h, scale_h, base_h, w_h = _params(H, device, normw, rows=N)
        self.head = [fn_h, scale_h, base_h, w_h]

    def leaves(self):
        out = {}
        for i, (fn, scale, base, w, lin) in enumerate(self.subs):
            out.update({f"fn{i}": fn, f"scale{i}": scale, f"base{i}": base, f"lin{i}": lin})
            if w is not None:
                out[f"normw{i}"] = w
        out.update(fn_h=self.head[0], scale_h=self.head[1], base_h=self.head[2])
        if self.head[3] is not None:
            out["normw_h"] = self.head[3]
        return out

    def run(self, emb, tensors, mode):
        """``mode``: 'ours' (tritile), 'ref' (the bf16 references) or 'f32' (the same math in float32 throughout, no
        bf16 rounding: the yardstick of both)."""
        subs = [[tensors.get(f"{k}{i}") for k in ("fn", "scale", "base", "normw", "lin")] for i in range(2)]
        fn_h, scale_h, base_h, w_h = (tensors.get(k) for k in ("fn_h", "scale_h", "base_h", "normw_h"))
        if mode == "ours":
            R = expand_from_embedding(emb, N)
            for fn, scale, base, w, lin in subs:
                u, (post, comb) = mhc_pre(R, fn, scale, base, norm_weight=w)
                R = mhc_post(F.linear(u, lin), R, post, comb)
            return mhc_head(R, fn_h, scale_h, base_h, norm_weight=w_h)
        f32 = mode == "f32"
        R = emb.float().unsqueeze(-2).expand(*emb.shape[:-1], N, emb.shape[-1]) if f32 else expand_to_mhc_ref(emb, N)
        for fn, scale, base, w, lin in subs:
            mixes = mhc_pre_norm_fn_ref(R, fn, w, EPS) if f32 else _norm_fn_ref(R, fn, w, EPS)
            pre, post, comb = mhc_pre_split_mixes_ref(mixes, scale, base, N, 1.0, EPS)
            comb = sinkhorn_normalize_ref(comb, 10, EPS)
            if f32:
                y = F.linear((R * pre).sum(-2), lin.float())
                R = post * y.unsqueeze(-2) + torch.einsum("bsio,bsih->bsoh", comb, R)
            else:
                R = mhc_post_ref(F.linear(mhc_pre_apply_mix_ref(R, pre), lin), R, post, comb)
        fn_h = F.pad(fn_h, (0, 0, 0, N3 - N))
        mixes = (mhc_pre_norm_fn_ref(R, fn_h, w_h, EPS) if f32 else _norm_fn_ref(R, fn_h, w_h, EPS))[..., :N]
        mix = mhc_head_compute_mix_ref(mixes, scale_h, base_h, EPS).unsqueeze(-1)
        return (R * mix).sum(-2) if f32 else mhc_pre_apply_mix_ref(R, mix)


# Tolerances, as calc_diff (a normalised squared error, float64).  The two models round to bf16 at the same points
# (layer inputs, linear outputs, residuals), but the kernels sum in another order, and the fused residual-gradient
# buffer rounds its three contributions in another order than autograd's sums: a bf16 value now and then lands one
# ulp away and the difference propagates to earlier layers.  Measured on the CPU grid (8 seeds x both shapes x normw
# on/off): head output <= 2.5e-7; gradients of the embedding, fn, norm_weight and linear weights <= 1.3e-5.
FWD_TOL = 1e-5
GRAD_TOL = 1e-4
# The gradients of scale and base sum a few tokens' products of rounded gradients, with cancellation: there the
# bf16 reference is itself far from the same model in float32 (calc_diff up to 2.4e-2 on the CPU grid, 3.5e-2 on the
# GPU, where the TF32 rounding of the norm_fn backward adds to it), and at one seed the tritile model can land as far
# on the other side (6e-3 from the reference on the GPU at 10 tokens; at most 9.8e-4 on the CPU grid).  So they must
# agree with the reference to MIX_GRAD_TOL or, failing that, be as close to the float32 model as the reference is
# over MIX_SEEDS seeds: mean calc_diff at most 4x the reference's (2x its RMS distance).
MIX_GRAD_TOL = 1e-3  # scale*, base*
MIX_SEEDS = 6


def _chain_grads(model, emb, g, mode):
    f32 = mode == "f32"
    tensors = {k: (v.float() if f32 else v).clone().requires_grad_() for k, v in model.leaves().items()}
    e = (emb.float() if f32 else emb).clone().requires_grad_()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = model.run(e, tensors, mode)
        out.backward(g.float() if f32 else g)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out.detach(), e.grad, {k: t.grad for k, t in tensors.items()}


@pytest.mark.parametrize("normw", [False, True])
@pytest.mark.parametrize("n0,n1,H", pick(cpu=[(1, 13, 64), (2, 5, 48)], gpu=[(1, 4096, 2560), (2, 2048, 7168)]))
def test_chained_layer(device, n0, n1, H, normw):
    model = _Model(H, device, normw)
    emb = torch.randn(n0, n1, H, device=device).bfloat16()
    g = torch.randn(n0, n1, H, device=device).bfloat16()
    out, e_grad, grads = _chain_grads(model, emb, g, "ours")
    out_r, e_grad_r, grads_r = _chain_grads(model, emb, g, "ref")
    assert out.shape == (n0, n1, H) and out.dtype == torch.bfloat16
    assert calc_diff(out, out_r) < FWD_TOL
    assert e_grad is not None and e_grad.dtype == torch.bfloat16
    assert calc_diff(e_grad, e_grad_r) < GRAD_TOL, calc_diff(e_grad, e_grad_r)
    noisy = []
    for k in grads_r:
        assert grads[k] is not None, k
        assert grads[k].shape == grads_r[k].shape, k
        d = calc_diff(grads[k], grads_r[k])
        if not k.startswith(("scale", "base")):
            assert d < GRAD_TOL, (k, d)
        elif d >= MIX_GRAD_TOL:
            noisy.append(k)
    if noisy:  # both models against the float32 one, over more seeds
        err = {k: [0.0, 0.0] for k in noisy}
        for i in range(MIX_SEEDS):
            if i:
                model = _Model(H, device, normw)
                emb = torch.randn(n0, n1, H, device=device).bfloat16()
                g = torch.randn(n0, n1, H, device=device).bfloat16()
                grads, grads_r = (_chain_grads(model, emb, g, m)[2] for m in ("ours", "ref"))
            grads_f = _chain_grads(model, emb, g, "f32")[2]
            for k in noisy:
                err[k][0] += calc_diff(grads[k], grads_f[k]) / MIX_SEEDS
                err[k][1] += calc_diff(grads_r[k], grads_f[k]) / MIX_SEEDS
        for k, (ours, ref) in err.items():
            assert ours < 4 * ref, (k, "mean calc_diff from float32: tritile", ours, "reference", ref)


def test_head_without_post(device):
    """``mhc_head`` straight on an expanded embedding: no ``mhc_post`` provides the residual-gradient buffer, and the
    backward still works (TileKernels raises AttributeError) and matches the references."""
    H = 64
    emb = torch.randn(1, 9, H, device=device).bfloat16()
    fn, scale, base, w = _params(H, device, True, rows=N)
    g = torch.randn(1, 9, H, device=device).bfloat16()
    grads = []
    for ref in (False, True):
        e = emb.clone().requires_grad_()
        ts = [t.clone().requires_grad_() for t in (fn, scale, base, w)]
        if ref:
            R = expand_to_mhc_ref(e, N)
            mixes = _norm_fn_ref(R, F.pad(ts[0], (0, 0, 0, N3 - N)), ts[3], EPS)[..., :N]
            out = mhc_pre_apply_mix_ref(R, mhc_head_compute_mix_ref(mixes, ts[1], ts[2], EPS).unsqueeze(-1))
        else:
            out = mhc_head(expand_from_embedding(e, N), ts[0], ts[1], ts[2], norm_weight=ts[3])
        out.backward(g)
        grads.append([out.detach(), e.grad] + [t.grad for t in ts])
    # output, embedding, fn, scale, base, norm_weight
    for a, b, tol in zip(*grads, (FWD_TOL, GRAD_TOL, GRAD_TOL, MIX_GRAD_TOL, MIX_GRAD_TOL, GRAD_TOL)):
        assert calc_diff(a, b) < tol, (calc_diff(a, b), tol)


def test_expand_from_embedding(device):
    x = torch.randn(2, 3, 40, device=device).bfloat16()
    R = expand_from_embedding(x)
    assert R.shape == (2, 3, N, 40)
    assert torch.equal(R, x.unsqueeze(-2).expand(2, 3, N, 40))


def test_zero_tokens(device):
    H = 32
    fn, scale, base, w = _params(H, device, True)
    residual = torch.empty(1, 0, N, H, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        li, (post, comb) = mhc_pre(residual, fn, scale, base, norm_weight=w)
    assert li.shape == (1, 0, H) and post.shape == (1, 0, N, 1) and comb.shape == (1, 0, N, N)
    r = residual.clone().requires_grad_()
    li, (post, comb) = mhc_pre(r, fn.requires_grad_(), scale, base, norm_weight=w)
    assert li.shape == (1, 0, H)


def test_bad_inputs(device):
    H = 32
    residual = _residual(1, 3, H, device)
    fn, scale, base, w = _params(H, device, True)
    with pytest.raises(ValueError, match="mhc_mult"):
        mhc_pre(residual, fn, scale, base, mhc_mult=2)
    with pytest.raises(TypeError, match="residual"):
        mhc_pre(residual.float(), fn, scale, base)
    with pytest.raises(ValueError, match="4D"):
        mhc_pre(residual[0], fn, scale, base)
    with torch.no_grad():
        with pytest.raises(ValueError, match="norm_weight"):
            mhc_pre(residual, fn, scale, base, norm_weight=w[:-1])
        with pytest.raises(ValueError, match="fn"):
            mhc_pre(residual, fn[:, :-1].contiguous(), scale, base)
    fn_h, scale_h, base_h, _ = _params(H, device, False, rows=N)
    with pytest.raises(ValueError, match="scale"):
        mhc_head(residual, fn_h, torch.ones(2, device=device), base_h)
    with pytest.raises(ValueError, match="fn"):
        mhc_head(residual, fn_h[:3], scale_h, base_h)
    with pytest.raises(ValueError, match="mhc_mult"):
        mhc_head(residual, fn_h, scale_h, base_h, mhc_mult=2)


def test_torch_compile_no_grad(device):
    H = 32
    residual = _residual(1, 7, H, device)
    fn, scale, base, w = _params(H, device, True)
    compiled = torch.compile(lambda *a: mhc_pre(*a, norm_weight=w), fullgraph=True,
                             backend="eager" if device.type == "cpu" else "inductor")
    with torch.no_grad():
        eager = mhc_pre(residual, fn, scale, base, norm_weight=w)
        out = compiled(residual, fn, scale, base)
    assert torch.equal(out[0], eager[0])
    assert torch.equal(out[1][0], eager[1][0]) and torch.equal(out[1][1], eager[1][1])


def _layers(parts, fn, scale, base, w):
    """One sublayer on each residual of ``parts``, step by step across them (as a batched model interleaves them):
    ``mhc_pre`` on each, a bf16 nonlinearity on each, ``mhc_post`` on each."""
    pres = [mhc_pre(R, fn, scale, base, norm_weight=w) for R in parts]
    ys = [(u.float().tanh() * 2).bfloat16() for u, _ in pres]
    return [mhc_post(y, R, post, comb) for y, R, (_, (post, comb)) in zip(ys, parts, pres)]


@pytest.mark.parametrize("split", ["batch", "seq"])
def test_residual_views_share_storage(device, split):
    """Residuals that are views of one tensor (``R[0:1]``, ``R[1:2]``: slices of a batch) share a storage, the key
    of the residual-gradient buffer: each keeps its own buffer, and the gradients are those of separate storages
    (bit for bit)."""
    H = 64
    fn, scale, base, w = _params(H, device, True)
    R0 = _residual(2, 6, H, device) if split == "batch" else _residual(1, 12, H, device)
    gs = [torch.randn(1, 6, N, H, device=device).bfloat16() for _ in range(2)]
    results = []
    for shared in (True, False):
        R = R0.clone().requires_grad_()
        ts = [t.clone().requires_grad_() for t in (fn, scale, base, w)]
        parts = (R[0:1], R[1:2]) if split == "batch" else (R[:, 0:6], R[:, 6:12])
        if not shared:
            parts = tuple(p.clone() for p in parts)  # own storages; the gradient still reaches R
        outs = _layers(parts, *ts)
        torch.autograd.backward(outs, gs)
        results.append([R.grad] + [t.grad for t in ts])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad", [True, False])
def test_same_checks_with_and_without_grad(device, grad):
    """Every argument is checked by its public name, with and without grad alike (TileKernels' no-grad path accepts
    ``mhc_mult=4.0``, ``sinkhorn_repeat=2.5`` and negative epsilons)."""
    H = 32
    residual = _residual(1, 3, H, device)
    fn, scale, base, w = _params(H, device, True)
    cases = [
        (dict(mhc_mult=4.0), TypeError, "mhc_mult must be an int"),
        (dict(sinkhorn_repeat=2.5), TypeError, "sinkhorn_repeat must be an int"),
        (dict(sinkhorn_repeat=0), ValueError, "sinkhorn_repeat"),
        (dict(norm_eps=-1e-6), ValueError, "norm_eps must be positive"),
        (dict(pre_eps=0.0), ValueError, "pre_eps must be positive"),
        (dict(sinkhorn_eps=-1e-6), ValueError, "sinkhorn_eps must be positive"),
        (dict(sinkhorn_eps=float("nan")), ValueError, "sinkhorn_eps must be positive"),
        (dict(post_mult_value=0.0), ValueError, "post_mult_value must be non-zero"),
        (dict(norm_weight=w[:-1]), ValueError, "norm_weight"),
        (dict(n_splits=1.5), TypeError, "n_splits"),
    ]
    with torch.set_grad_enabled(grad):
        for kwargs, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                mhc_pre(residual, fn, scale, base, **kwargs)
        with pytest.raises(ValueError, match=r"fn must have shape \(24, mhc_mult \* hidden_size = 128\), got \(24, 127\)"):
            mhc_pre(residual, fn[:, :-1].contiguous(), scale, base)
        with pytest.raises(ValueError, match="fn must be contiguous"):
            mhc_pre(residual, fn.t().contiguous().t(), scale, base)
        with pytest.raises(ValueError, match=r"scale must have shape \(3,\)"):
            mhc_pre(residual, fn, scale[:2], base)
        with pytest.raises(ValueError, match=r"base must have shape \(24,\)"):
            mhc_pre(residual, fn, scale, base[:-1])
        with pytest.raises(TypeError, match="fn must be"):
            mhc_pre(residual, fn.double(), scale, base)
        # mhc_head: fn's shape is reported as passed, not padded to 24 rows
        fn_h, scale_h, base_h, _ = _params(H, device, False, rows=N)
        with pytest.raises(ValueError, match=r"fn must have shape \(4 or 24, .*\), got \(4, 127\)"):
            mhc_head(residual, fn_h[:, :-1].contiguous(), scale_h, base_h)
        with pytest.raises(ValueError, match="pre_eps must be positive"):
            mhc_head(residual, fn_h, scale_h, base_h, pre_eps=-1.0)
        with pytest.raises(ValueError, match="norm_eps must be positive"):
            mhc_head(residual, fn_h, scale_h, base_h, norm_eps=0.0)
        with pytest.raises(TypeError, match="mhc_mult must be an int"):
            mhc_head(residual, fn_h, scale_h, base_h, mhc_mult=4.0)
        with pytest.raises(ValueError, match=r"base must have shape \(4,\)"):
            mhc_head(residual, fn_h, scale_h, base_h[:3])
    # expand_from_embedding names its own argument
    with pytest.raises(TypeError, match="x must be"):
        expand_from_embedding(torch.randn(2, 8, device=device))
    with pytest.raises(ValueError, match="x must be contiguous"):
        expand_from_embedding(torch.randn(8, 2, device=device).bfloat16().t())
    with pytest.raises(TypeError, match="mhc_mult"):
        expand_from_embedding(torch.randn(2, 8, device=device).bfloat16(), 4.0)
