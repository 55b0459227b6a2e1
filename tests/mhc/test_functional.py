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

    def run(self, emb, tensors, ref):
        subs = [[tensors.get(f"{k}{i}") for k in ("fn", "scale", "base", "normw", "lin")] for i in range(2)]
        fn_h, scale_h, base_h, w_h = (tensors.get(k) for k in ("fn_h", "scale_h", "base_h", "normw_h"))
        R = expand_to_mhc_ref(emb, N) if ref else expand_from_embedding(emb, N)
        for fn, scale, base, w, lin in subs:
            if ref:
                mixes = mhc_pre_norm_fn_ref(R, fn, w, EPS)
                pre, post, comb = mhc_pre_split_mixes_ref(mixes, scale, base, N, 1.0, EPS)
                comb = sinkhorn_normalize_ref(comb, 10, EPS)
                u = mhc_pre_apply_mix_ref(R, pre)
            else:
                u, (post, comb) = mhc_pre(R, fn, scale, base, norm_weight=w)
            y = F.linear(u, lin)
            R = mhc_post_ref(y, R, post, comb) if ref else mhc_post(y, R, post, comb)
        if ref:
            mixes = mhc_pre_norm_fn_ref(R, F.pad(fn_h, (0, 0, 0, N3 - N)), w_h, EPS)[..., :N]
            mix = mhc_head_compute_mix_ref(mixes, scale_h, base_h, EPS)
            return mhc_pre_apply_mix_ref(R, mix.unsqueeze(-1))
        return mhc_head(R, fn_h, scale_h, base_h, norm_weight=w_h)


# Tolerances, as calc_diff (a normalised squared error, float64).  The two models round to bf16 at the same points
# (layer inputs, linear outputs, residuals), but the kernels' projections use TF32 operands for fn and sum in
# another order, and the fused residual-gradient buffer rounds its three contributions in another order than
# autograd's sums: a bf16 value now and then lands one ulp away and the difference propagates to earlier layers.
# Measured on the CPU grid (3 seeds x both shapes x normw on/off): head output <= 2.5e-7; gradients of the
# embedding, fn, norm_weight and linear weights <= 9e-6; of scale and base <= 1.1e-4 (sums over a few tokens of
# products of rounded gradients, with cancellation).
FWD_TOL = 1e-5
GRAD_TOL = 1e-4
MIX_GRAD_TOL = 1e-3  # scale*, base*


@pytest.mark.parametrize("normw", [False, True])
@pytest.mark.parametrize("n0,n1,H", pick(cpu=[(1, 13, 64), (2, 5, 48)], gpu=[(1, 4096, 2560), (2, 2048, 7168)]))
def test_chained_layer(device, n0, n1, H, normw):
    model = _Model(H, device, normw)
    emb = torch.randn(n0, n1, H, device=device).bfloat16()
    g = torch.randn(n0, n1, H, device=device).bfloat16()
    results = []
    for ref in (False, True):
        tensors = {k: v.clone().requires_grad_() for k, v in model.leaves().items()}
        e = emb.clone().requires_grad_()
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = ref and device.type == "cuda"  # TileKernels' references on TF32
        try:
            out = model.run(e, tensors, ref)
            out.backward(g)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        assert out.shape == (n0, n1, H) and out.dtype == torch.bfloat16
        results.append((out.detach(), e.grad, {k: t.grad for k, t in tensors.items()}))
    (out, e_grad, grads), (out_r, e_grad_r, grads_r) = results
    assert calc_diff(out, out_r) < FWD_TOL
    assert e_grad is not None and e_grad.dtype == torch.bfloat16
    assert calc_diff(e_grad, e_grad_r) < GRAD_TOL, calc_diff(e_grad, e_grad_r)
    for k in grads_r:
        assert grads[k] is not None, k
        assert grads[k].shape == grads_r[k].shape, k
        tol = MIX_GRAD_TOL if k.startswith(("scale", "base")) else GRAD_TOL
        assert calc_diff(grads[k], grads_r[k]) < tol, (k, calc_diff(grads[k], grads_r[k]))


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
            mixes = mhc_pre_norm_fn_ref(R, F.pad(ts[0], (0, 0, 0, N3 - N)), ts[3], EPS)[..., :N]
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
