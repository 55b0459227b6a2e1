"""Benchmark cases of the mHC ops (``python -m tritile bench --module mhc``).

GPU shapes: n = 4 streams, T = 8192 tokens as ``(n0, n1) = (2, 4096)``, H in {2560, 7168}.  TileKernels ships no mHC
benchmark; its H200 figures (``tritile/data/tilekernels-h200.json``, kernels ``mhc_post``,
``mhc_pre_apply_mix``, ``sinkhorn``) were timed around its tests' helpers, so the ``fwd+bwd`` cases here time the
same thing: clone the inputs, ``requires_grad_``, forward, ``torch.autograd.backward`` (and, for the apply-mix, the
zero ``grad_from_mhc_post`` buffer its test attaches before the backward).  Bytes (each tensor read or written once)
follow the mHC spec §4: expand ``T H 2 + T n H 2`` (each way); split ``T n3 4 + 2 T n 4 + T n^2 4``; Sinkhorn fwd
``2 T n^2 4``, fwd+bwd ``5 T n^2 4``; apply-mix fwd ``T n H 2 + T n 4 + T H 2``; post fwd
``T (n^2 4 + n H 2 + n 4 + H 2 + n H 2)``, post bwd ``T (3 n H 2 + 2 H 2 + 2 n^2 4 + 2 n 4)``; head mix ``2 T n 4``;
the multilayer recompute: TileKernels' ``io_fused``.

Liger-Kernel (``liger_kernel.ops.mhc``, where installed) has the same two stream ops; its cases (label ``liger``)
time ``LigerMHCPreFunction`` / ``LigerMHCPostResFunction`` on the same data.  Where they differ from tritile's:

- ``h_res`` (Liger's comb) is indexed ``[out, in]``; tritile's ``comb_res_mix`` ``[in, out]`` (the cases pass the
  transpose).  Liger's ``h_pre`` / ``h_post`` are ``(..., n)``, tritile's ``(..., n, 1)``.
- Liger's kernels write fp32 outputs that ``.to(bf16)`` rounds afterwards (an extra fp32 round trip through memory),
  sum the streams with ``acc += w * x`` (contracted by the compiler) and round gradients the same way; tritile
  rounds once in the kernel.  Values agree to bf16 rounding; bits may differ.
- Liger has no residual-gradient protocol (``grad_from_mhc_post``): each op returns its own residual gradient and
  autograd adds them.
- Liger's Sinkhorn is fused with the split into ``LigerMHCCoeffsFunction`` (after its own RMS-norm GEMM), uses
  ``tl.sum`` and approximate division, ``tmax = 20`` by default and a saved history for the backward; there is no
  standalone Sinkhorn op to time against ``sinkhorn_normalize``.

``mhc_pre_norm_fn`` (forward; forward + backward), ``mhc_pre_big_fuse`` and the functional ``mhc_pre`` (training
forward + backward; no grad) run at n = 4, T = 8192 tokens (2 x 4096), H in {2560, 7168} on the GPU.

TileKernels has no benchmark for these ops either; the byte counts follow spec/mhc.md (each tensor read or
written once):

- norm_fn forward: ``T D 2 + n3 D 4 + T n3 4``;
- norm_fn backward: ``T D 2`` (x) ``+ 2 T D 2`` (the residual-gradient buffer, read and written) ``+ 2 n3 D 4``
  ``+ 2 T n3 4`` (the mixes' gradient in, ``fn``'s gradient out);
- big_fuse: ``2 T D 2 + n3 D 4 + 2 T (n3 + 1) 4 + T (n + n^2) 4 + T H 2`` (the residual read twice, the GEMM's
  partials written and read back, post/comb/layer input written);
- mhc_pre training: the forward reads the residual twice and writes the layer input; the backward reads the layer
  input's gradient and the residual twice and writes the residual gradient twice (apply-mix, then norm_fn adds in
  place): ``T (2 D 2 + H 2) + T (H 2 + 2 D 2 + 3 D 2)`` plus the parameters;
- mhc_pre without grad: big_fuse's count.

Where Liger-Kernel is installed, its fused GEMM + RMS (``liger_kernel.ops.mhc.mhc_mm_norm_fwd`` / ``_bwd``) is timed
on the same data (label ``liger``).
"""

from __future__ import annotations

import functools

import torch

from tritile.bench import Case, op, register
from tritile.mhc.post_kernel import mhc_post_fwd
from tritile.modeling.mhc.ops.post import mhc_post
from tritile.modeling.mhc.ops.pre_apply_mix import mhc_pre_apply_mix
from tritile.torch.mhc import (expand_to_mhc_ref, mhc_head_compute_mix_ref, mhc_post_ref, mhc_pre_apply_mix_ref,
                               mhc_pre_norm_fn_ref, mhc_pre_split_mixes_ref, sinkhorn_normalize_ref)

_M = "mhc"
N = 4

# Launch-config candidates (``python -m tritile tune --module mhc``).  Forward kernels: every candidate gives the same
# bits (per-element math).  Backward kernels: the hidden chunk (BH) and warps change the fp32 summation order of the
# per-token reductions over H (d_post, d_comb, d_mix: "output differs" within the tests' tolerances).
_TILE_TUNE = [dict(BT=bt, BH=bh, num_warps=w) for bt, bh, w in
              ((1, 1024, 4), (1, 1024, 8), (2, 1024, 8), (1, 512, 2), (2, 512, 4), (4, 512, 8), (1, 2048, 8),
               (2, 256, 2), (4, 256, 4))]
_BWD_TUNE = [dict(BT=1, BH=bh, num_warps=w) for bh in (512, 1024, 2048) for w in (2, 4, 8)] + [
    dict(BT=2, BH=512, num_warps=4), dict(BT=2, BH=1024, num_warps=8)]
_SK_TUNE = [dict(BT=bt, num_warps=w) for bt in (8, 16, 32, 64, 128) for w in (1, 2, 4)]
_EXPAND_TUNE = [dict(BT=bt, BH=bh, num_warps=w) for bt, bh, w in
                ((1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 512, 4), (2, 2048, 8), (4, 1024, 8), (1, 2048, 4),
                 (2, 512, 2), (16, 256, 4))]


def _gpu(device) -> bool:
    return torch.device(device).type == "cuda"


def _shapes(device, quick):
    """``(n0, n1, h)`` cases."""
    if not _gpu(device):
        return [(1, 7, 256)]
    return [(2, 4096, 7168)] if quick else [(2, 4096, 2560), (2, 4096, 7168)]


def _close(tol=None):
    def check(out, ref):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        for a, b in zip(outs, refs):
            if a is None and b is None:
                continue
            torch.testing.assert_close(a, b, **(tol or {}))
    return check


def _fwd_bwd_impl(path, inputs, grads, *extra, attach_zero_buffer=None):
    """The ``impl`` of a forward + backward case: :func:`_fwd_bwd` of the op at ``path`` called as
    ``op(*leaves, *extra)``."""
    def impl(get):
        f = get(path)
        fwd = (lambda *leaves: f(*leaves, *extra)) if extra else f
        return functools.partial(_fwd_bwd, fwd, inputs, grads, attach_zero_buffer)
    return impl


def _fwd_bwd(impl, inputs, grads, attach_zero_buffer=None):
    """TileKernels' test helper: clone, requires_grad_, forward, backward; returns the outputs and the grads."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    outs = impl(*leaves)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    if attach_zero_buffer is not None:
        leaf = leaves[attach_zero_buffer]
        leaf.untyped_storage().grad_from_mhc_post = torch.zeros_like(leaf)
    torch.autograd.backward(list(outs), list(grads))
    gs = []
    for k, t in enumerate(leaves):
        g = t.grad
        if g is None and attach_zero_buffer == k:
            g = t.untyped_storage().grad_from_mhc_post
        gs.append(g)
    return (*outs, *gs)


# ----------------------------------------------------------------------------------- pre-norm, big fuse, mhc_pre

N3 = N * (N + 2)
EPS = 1e-6

# Launch-config candidates (python -m tritile tune --module mhc).  The GEMM's split count and tile change the
# float32 summation order of p and s ("output differs" is expected; the tests' tolerances hold for each).
_GEMM_TUNE = [dict(BLOCK_T=bt, BLOCK_D=bd, num_warps=w, num_stages=st, PROGRAMS=p)
              for bt, bd, w, st, p in ((128, 64, 4, 3, 512), (128, 128, 4, 3, 512), (128, 128, 8, 3, 512),
                                       (64, 128, 4, 3, 512), (64, 256, 4, 3, 512), (128, 256, 8, 3, 512),
                                       (256, 64, 8, 3, 512), (256, 128, 8, 3, 512), (128, 128, 4, 4, 512),
                                       (128, 64, 4, 4, 1024), (128, 128, 4, 4, 264), (128, 128, 4, 2, 512),
                                       (256, 128, 8, 4, 264), (64, 128, 4, 4, 1024))]
_GEMM_TUNE.append(dict(_GEMM_TUNE[0], SPLIT_BF16=False))  # x widened to float32 on TF32 MMAs
_POST_BWD_TUNE = [dict(U=u, num_warps=w) for u in (1, 2, 4, 8) for w in (4, 8)]
_NORM_BWD_TUNE = [dict(BLOCK_T=bt, BLOCK_D=bd, num_warps=w, num_stages=st, PROGRAMS=p)
             for bt, bd, w, st, p in ((64, 128, 4, 3, 512), (64, 128, 4, 4, 512), (64, 128, 4, 2, 512),
                                      (64, 128, 4, 3, 1024), (64, 128, 4, 3, 264), (32, 128, 4, 3, 512),
                                      (64, 64, 4, 3, 512), (128, 128, 8, 3, 512))]
_FUSE_TUNE = [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=w)
              for bt, bh, w in ((1, 1024, 4), (4, 512, 4), (8, 256, 4), (8, 512, 8), (16, 256, 4), (16, 256, 8),
                                (16, 512, 8), (32, 128, 4), (32, 256, 8), (64, 128, 8))]


def _norm_shapes(device, quick):
    if device.type != "cuda":
        return [(1, 19, 64)]
    hs = (7168,) if quick else (2560, 7168)
    return [(2, 4096, h) for h in hs]


def _inputs(n0, n1, H, device, normw=False):
    stream = 1 + torch.arange(N, device=device).mul(0.01)
    residual = (torch.randn(n0, n1, N, H, device=device) * stream.view(1, 1, -1, 1)).bfloat16()
    fn = (torch.randn(N3, N, H, device=device) * 1e-4 * stream.view(1, -1, 1)).flatten(1, 2)
    scale = torch.randn(3, device=device) * 0.1
    base = torch.randn(N3, device=device) * 0.1
    w = torch.randn(N * H, device=device) * 0.1 + 1.0 if normw else None
    return residual, fn, scale, base, w


def _close_f32(atol, rtol):
    def check(out, ref):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        for a, b in zip(outs, refs):
            torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
    return check


def _liger_mm_norm():
    """Liger-Kernel's mHC ops with its fused GEMM + RMS (``mhc_mm_norm_fwd``), else None."""
    liger_mhc = _liger()
    return liger_mhc if hasattr(liger_mhc, "mhc_mm_norm_fwd") else None


@register(_M, "mhc_pre_norm_fn")
def _norm_fn_cases(device, quick):
    for n0, n1, H in _norm_shapes(device, quick):
        T, D = n0 * n1, N * H
        residual, fn, *_ = _inputs(n0, n1, H, device)
        fwd_bytes = T * D * 2 + N3 * D * 4 + T * N3 * 4
        yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="fwd",
                   impl=op("modeling.mhc.ops.mhc_pre_norm_fn", residual, fn, None, EPS),
                   ref=lambda r=residual, f=fn: mhc_pre_norm_fn_ref(r, f, None, EPS),
                   check=_close_f32(1e-3, 1e-3), nbytes=fwd_bytes,
                   tune=("mhc_norm_fn_gemm", _GEMM_TUNE) if device.type == "cuda" else None)

        r = residual.clone().requires_grad_()
        f = fn.clone().requires_grad_()
        g = torch.randn(n0, n1, N3, device=device)
        buf = torch.zeros_like(residual)

        def fwd_bwd(get, r=r, f=f, g=g, buf=buf):
            norm_fn = get("modeling.mhc.ops.mhc_pre_norm_fn")

            def call():
                out = norm_fn(r, f, None, EPS)
                r.untyped_storage().grad_from_mhc_post = buf
                f.grad = None
                out.backward(g)
                return out, f.grad
            return call

        def ref_fwd_bwd(r=r, f=f, g=g):
            rr, ff = r.detach().clone().requires_grad_(), f.detach().clone().requires_grad_()
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True  # as TileKernels' reference: the kernels round g_p too
            try:
                out = mhc_pre_norm_fn_ref(rr, ff, None, EPS)
                out.backward(g)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
            return out, ff.grad

        bwd_bytes = T * D * 2 + 2 * T * D * 2 + 2 * N3 * D * 4 + 2 * T * N3 * 4
        yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="fwd+bwd", impl=fwd_bwd, ref=ref_fwd_bwd,
                   check=_close_f32(3e-2, 1e-3), nbytes=fwd_bytes + bwd_bytes,
                   tune=("mhc_norm_fn_bwd", _NORM_BWD_TUNE) if device.type == "cuda" else None)

        liger = _liger_mm_norm()
        if liger is not None:
            # Liger-Kernel's fused GEMM + RMS (phi as (D, n3), float32 operands on TF32 tensor cores, grad_phi by
            # float32 atomics); its backward writes a fresh residual gradient (no accumulation buffer).
            x2, phi = residual.view(T, D), fn.t().contiguous()
            yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="liger fwd",
                       fn=lambda x2=x2, phi=phi: liger.mhc_mm_norm_fwd(x2, phi, EPS)[0],
                       no_tk="Liger-Kernel's op",
                       ref=lambda r=residual, f=fn: mhc_pre_norm_fn_ref(r, f, None, EPS).view(T, N3),
                       check=_close_f32(1e-3, 1e-3), nbytes=fwd_bytes)

            def liger_fwd_bwd(x2=x2, phi=phi, g=g.view(T, N3)):
                mix, invr = liger.mhc_mm_norm_fwd(x2, phi, EPS)
                return liger.mhc_mm_norm_bwd(x2, phi, mix, invr, g)

            yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="liger fwd+bwd", fn=liger_fwd_bwd,
                       no_tk="Liger-Kernel's op",
                       nbytes=fwd_bytes + bwd_bytes - T * D * 2)  # no accumulation buffer to read


def _chain_ref(residual, fn, scale, base, w=None):
    mixes = mhc_pre_norm_fn_ref(residual, fn, w, EPS)
    pre, post, comb = mhc_pre_split_mixes_ref(mixes, scale, base, N, 1.0, EPS)
    comb = sinkhorn_normalize_ref(comb, 10, EPS)
    return post, comb, mhc_pre_apply_mix_ref(residual, pre)


@register(_M, "mhc_pre_big_fuse")
def _big_fuse_cases(device, quick):
    for n0, n1, H in _norm_shapes(device, quick):
        T, D = n0 * n1, N * H
        residual, fn, scale, base, _ = _inputs(n0, n1, H, device)
        nbytes = 2 * T * D * 2 + N3 * D * 4 + 2 * T * (N3 + 1) * 4 + T * (N + N * N) * 4 + T * H * 2
        yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H),
                   impl=op("modeling.mhc.ops.mhc_pre_big_fuse", residual, fn, scale, base, EPS, EPS, EPS, 1.0, 10),
                   ref=lambda r=residual, f=fn, s=scale, b=base: _chain_ref(r, f, s, b),
                   check=_close_f32(2e-2, 1e-2), nbytes=nbytes,
                   tune=("mhc_pre_big_fuse", _FUSE_TUNE) if device.type == "cuda" else None)


@register(_M, "mhc_pre")
def _mhc_pre_cases(device, quick):
    for n0, n1, H in _norm_shapes(device, quick):
        T, D = n0 * n1, N * H
        residual, fn, scale, base, w = _inputs(n0, n1, H, device, normw=True)
        params = dict(n0=n0, n1=n1, mhc_mult=N, hidden=H, norm_weight=True)

        def no_grad(get, residual=residual, fn=fn, scale=scale, base=base, w=w):
            pre = get("modeling.mhc.mhc_pre")

            def call():
                with torch.no_grad():
                    li, (post, comb) = pre(residual, fn, scale, base, norm_weight=w)
                return post, comb, li
            return call

        nbytes = 2 * T * D * 2 + N3 * D * 4 + 2 * T * (N3 + 1) * 4 + T * (N + N * N) * 4 + T * H * 2
        yield Case(params=params, label="no_grad", impl=no_grad,
                   ref=lambda r=residual, f=fn, s=scale, b=base, w=w: _chain_ref(r, f, s, b, w),
                   check=_close_f32(2e-2, 1e-2), nbytes=nbytes)

        leaves = [t.clone().requires_grad_() for t in (fn, scale, base, w)]
        r = residual.clone().requires_grad_()
        g = torch.randn(n0, n1, H, device=device).bfloat16()
        buf = torch.zeros_like(residual)

        def train(get, r=r, leaves=leaves, g=g, buf=buf):
            pre = get("modeling.mhc.mhc_pre")

            def call():
                f, s, b, nw = leaves
                for t in (r, *leaves):
                    t.grad = None
                li, _ = pre(r, f, s, b, norm_weight=nw)
                # the residual-gradient buffer mhc_post's backward would attach (TileKernels' backward requires it)
                r.untyped_storage().grad_from_mhc_post = buf
                li.backward(g)
                return li
            return call

        train_bytes = T * (2 * D * 2 + H * 2) + T * (H * 2 + 2 * D * 2 + 3 * D * 2) + 3 * N3 * D * 4 + 3 * D * 4
        yield Case(params=params, label="train fwd+bwd", impl=train, nbytes=train_bytes)


# ---------------------------------------------------------------------------------------------------- stream ops
@register(_M, "expand_to_mhc")
def _expand_cases(device, quick):
    for n0, n1, h in _shapes(device, quick):
        t = n0 * n1
        x = torch.randn(n0, n1, h, dtype=torch.bfloat16, device=device)
        g = torch.randn(n0, n1, N, h, dtype=torch.bfloat16, device=device)
        nb = t * h * 2 + t * N * h * 2
        yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd"), impl=op("modeling.mhc.ops.expand_to_mhc", x, N),
                   ref=lambda x=x: expand_to_mhc_ref(x, N), check=_close(dict(atol=0, rtol=0)), nbytes=nb,
                   tune=("mhc_expand", _EXPAND_TUNE))
        yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd+bwd"),
                   impl=_fwd_bwd_impl("modeling.mhc.ops.expand_to_mhc", [x], [g], N),
                   ref=lambda x=x, g=g: _fwd_bwd(lambda a: expand_to_mhc_ref(a, N), [x], [g]),
                   check=_close(), nbytes=2 * nb, tune=("mhc_expand_bwd", _EXPAND_TUNE))


@register(_M, "mhc_pre_split_mixes")
def _split_cases(device, quick):
    n3 = N * (N + 2)
    for n0, n1 in ([(1, 7)] if not _gpu(device) else [(2, 4096)]):
        t = n0 * n1
        args = [torch.randn(n0, n1, n3, device=device), torch.randn(3, device=device),
                torch.randn(n3, device=device)]
        grads = [torch.randn(n0, n1, N, 1, device=device), torch.randn(n0, n1, N, 1, device=device),
                 torch.randn(n0, n1, N, N, device=device)]
        nb = t * n3 * 4 + 2 * t * N * 4 + t * N * N * 4
        yield Case(params=dict(n0=n0, n1=n1, op="fwd+bwd"),
                   impl=_fwd_bwd_impl("modeling.mhc.ops.mhc_pre_split_mixes", args, grads, N, 2.0, 1e-2),
                   ref=lambda: _fwd_bwd(lambda m, s, b: mhc_pre_split_mixes_ref(m, s, b, N, 2.0, 1e-2), args, grads),
                   check=_close(dict(rtol=1e-5, atol=2e-5)), nbytes=2 * nb, latency_bound=True,
                   tune=("mhc_pre_split_mixes_fwd", _SK_TUNE))


@register(_M, "sinkhorn_normalize")
def _sinkhorn_cases(device, quick):
    for n0, n1 in ([(1, 7)] if not _gpu(device) else [(2, 4096)]):
        t = n0 * n1
        x = torch.randn(n0, n1, N, N, device=device)
        g = torch.randn(n0, n1, N, N, device=device)
        yield Case(params=dict(n0=n0, n1=n1, mhc=N, op="fwd"),
                   impl=op("modeling.mhc.ops.sinkhorn_normalize", x, 10, 1e-6),
                   ref=lambda: sinkhorn_normalize_ref(x, 10, 1e-6), check=_close(), nbytes=2 * t * N * N * 4,
                   latency_bound=True, tune=("mhc_sinkhorn_fwd", _SK_TUNE))
        yield Case(params=dict(n0=n0, n1=n1, mhc=N, op="fwd+bwd"),
                   impl=_fwd_bwd_impl("modeling.mhc.ops.sinkhorn_normalize", [x], [g], 10, 1e-6),
                   ref=lambda: _fwd_bwd(lambda a: sinkhorn_normalize_ref(a, 10, 1e-6), [x], [g]),
                   check=_close(), nbytes=5 * t * N * N * 4, latency_bound=True,
                   anchor=("sinkhorn/fwd+bwd", dict(n0=n0, n1=n1, mhc=N)), tune=("mhc_sinkhorn_bwd", _SK_TUNE))


def _apply_data(n0, n1, h, device):
    x = torch.randn(n0, n1, N, h, device=device).sigmoid().bfloat16()
    mix = torch.randn(n0, n1, N, 1, device=device).softmax(-2)
    g = torch.randn(n0, n1, h, device=device).bfloat16()
    return x, mix, g


@register(_M, "mhc_pre_apply_mix")
def _apply_cases(device, quick):
    tol = dict(atol=1e-2, rtol=1e-3)
    for n0, n1, h in _shapes(device, quick):
        t = n0 * n1
        x, mix, g = _apply_data(n0, n1, h, device)
        fwd_b = t * N * h * 2 + t * N * 4 + t * h * 2
        bwd_b = t * h * 2 + t * N * h * 2 + 2 * t * N * h * 2 + 2 * t * N * 4
        yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd"), impl=op("modeling.mhc.ops.mhc_pre_apply_mix", x, mix),
                   ref=lambda x=x, m=mix: mhc_pre_apply_mix_ref(x, m), check=_close(tol), nbytes=fwd_b,
                   tune=("mhc_pre_apply_mix_fwd", _TILE_TUNE))
        yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd+bwd"),
                   impl=_fwd_bwd_impl("modeling.mhc.ops.mhc_pre_apply_mix", [x, mix], [g], attach_zero_buffer=0),
                   ref=lambda x=x, m=mix, g=g: _fwd_bwd(mhc_pre_apply_mix_ref, [x, m], [g], attach_zero_buffer=0),
                   check=_close(tol), nbytes=fwd_b + bwd_b,
                   anchor=("mhc_pre_apply_mix/fwd+bwd", dict(n0=n0, n1=n1, h=h)),
                   tune=("mhc_pre_apply_mix_bwd", _BWD_TUNE))
        liger = _liger()
        if liger is not None:
            pre_fn = liger.LigerMHCPreFunction.apply
            yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd+bwd"), label="liger",
                       fn=lambda x=x, m=mix, g=g: _fwd_bwd(lambda a, b: pre_fn(a, b.squeeze(-1)), [x, m], [g]),
                       no_tk="Liger-Kernel's op",
                       ref=lambda x=x, m=mix, g=g: _fwd_bwd(mhc_pre_apply_mix, [x, m], [g]),
                       check=_close(tol), nbytes=fwd_b + bwd_b)


def post_data(n0, n1, h, device, n=N):
    """Random ``mhc_post`` inputs (shared with its tests): bf16 ``x (n0, n1, h)``, bf16 ``residual (n0, n1, n, h)``,
    fp32 ``post (n0, n1, n, 1)``, fp32 ``comb (n0, n1, n, n)`` and a bf16 output gradient ``(n0, n1, n, h)``."""
    x = torch.randn(n0, n1, h, dtype=torch.bfloat16, device=device)
    r = torch.randn(n0, n1, n, h, dtype=torch.bfloat16, device=device)
    p = torch.randn(n0, n1, n, 1, device=device)
    c = torch.randn(n0, n1, n, n, device=device)
    g = torch.randn(n0, n1, n, h, dtype=torch.bfloat16, device=device)
    return x, r, p, c, g


def _post_tol(out, ref):
    o, gx, gr, gp, gc = out
    ro, rgx, rgr, rgp, rgc = ref
    for a, b in ((o, ro), (gx, rgx), (gr, rgr)):
        torch.testing.assert_close(a, b)
    for a, b in ((gp, rgp), (gc, rgc)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@register(_M, "mhc_post")
def _post_cases(device, quick):
    for n0, n1, h in _shapes(device, quick):
        t = n0 * n1
        x, r, p, c, g = post_data(n0, n1, h, device)
        fwd_b = t * (N * N * 4 + N * h * 2 + N * 4 + h * 2 + N * h * 2)
        bwd_b = t * (3 * N * h * 2 + 2 * h * 2 + 2 * N * N * 4 + 2 * N * 4)
        out = torch.empty_like(r)
        yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd"),
                   impl=op("mhc.post_kernel.mhc_post_fwd", x, r, p, c, out=out),
                   ref=lambda x=x, r=r, p=p, c=c: mhc_post_ref(x, r, p, c), check=_close(), nbytes=fwd_b,
                   anchor=("mhc_post/fwd", dict(n0=n0, n1=n1, h=h)), tune=("mhc_post_fwd", _TILE_TUNE))
        yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd+bwd"),
                   impl=_fwd_bwd_impl("modeling.mhc.ops.mhc_post", [x, r, p, c], [g]),
                   ref=lambda x=x, r=r, p=p, c=c, g=g: _fwd_bwd(mhc_post_ref, [x, r, p, c], [g]),
                   check=_post_tol, nbytes=fwd_b + bwd_b,
                   anchor=("mhc_post/fwd+bwd", dict(n0=n0, n1=n1, h=h)), tune=("mhc_post_bwd", _POST_BWD_TUNE))
        liger = _liger()
        if liger is not None:
            post_fn = liger.LigerMHCPostResFunction.apply

            def lig(xx, rr, pp, cc):
                return post_fn(rr, xx, pp.squeeze(-1), cc.transpose(-1, -2))

            yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd"), label="liger",
                       fn=lambda x=x, r=r, p=p, c=c: lig(x, r, p, c), no_tk="Liger-Kernel's op",
                       ref=lambda x=x, r=r, p=p, c=c: mhc_post_fwd(x, r, p, c), check=_close(), nbytes=fwd_b)
            yield Case(params=dict(n0=n0, n1=n1, h=h, op="fwd+bwd"), label="liger",
                       fn=lambda x=x, r=r, p=p, c=c, g=g: _fwd_bwd(lig, [x, r, p, c], [g]),
                       no_tk="Liger-Kernel's op",
                       ref=lambda x=x, r=r, p=p, c=c, g=g: _fwd_bwd(mhc_post, [x, r, p, c], [g]),
                       check=_post_tol, nbytes=fwd_b + bwd_b)


@register(_M, "mhc_head_compute_mix")
def _head_cases(device, quick):
    for n0, n1 in ([(1, 7)] if not _gpu(device) else [(2, 4096)]):
        t = n0 * n1
        args = [torch.randn(n0, n1, N, device=device), torch.randn(1, device=device), torch.randn(N, device=device)]
        g = [torch.randn(n0, n1, N, device=device)]
        yield Case(params=dict(n0=n0, n1=n1, op="fwd+bwd"),
                   impl=_fwd_bwd_impl("modeling.mhc.ops.mhc_head_compute_mix", args, g, 1e-2),
                   ref=lambda: _fwd_bwd(lambda a, s, b: mhc_head_compute_mix_ref(a, s, b, 1e-2), args, g),
                   check=_close(dict(rtol=1e-4, atol=1e-5)), nbytes=4 * t * N * 4, latency_bound=True)


@register(_M, "mhc_multilayer_recompute")
def _multilayer_cases(device, quick, grid: bool = False):
    if not _gpu(device):
        shapes = [(3, 2, 5, 256)]
    elif quick:
        shapes = [(10, 10, 8192, 7168)]
    else:
        hs = (2560, 4096, 7168, 8192) if grid else (2560, 7168)
        shapes = [(10, lp, 8192, h) for h in hs for lp in (9, 10)]
    for num_layers, num_post, seq, h in shapes:
        t = seq
        r0 = torch.randn(1, seq, N, h, device=device).bfloat16()
        pre = [torch.randn(1, seq, N, 1, device=device) for _ in range(num_layers)]
        y = [torch.randn(1, seq, h, device=device).bfloat16() for _ in range(num_post)]
        post = [torch.randn(1, seq, N, 1, device=device) for _ in range(num_post)]
        comb = [torch.randn(1, seq, N, N, device=device) for _ in range(num_post)]
        li = [torch.empty(1, seq, h, dtype=torch.bfloat16, device=device) for _ in range(num_layers)]
        res = [torch.empty(1, seq, N, h, dtype=torch.bfloat16, device=device) for _ in range(num_post)]
        io = t * N * h * 2 + num_layers * (t * N * 4 + t * h * 2) + num_post * (
            t * h * 2 + t * N * 4 + t * N * N * 4 + t * N * h * 2)

        def fused(get, r0=r0, pre=pre, y=y, post=post, comb=comb, li=li, res=res):
            recompute = get("mhc.multilayer_recompute_kernel.mhc_multilayer_recompute")

            def call():
                recompute(r0, pre, y, post, comb, li, res)
                return li + res
            return call

        def chain(r0=r0, pre=pre, y=y, post=post, comb=comb):
            r, outs_li, outs_res = r0, [], []
            for i in range(len(pre)):
                outs_li.append(mhc_pre_apply_mix(r, pre[i]))
                if i < len(y):
                    r = mhc_post_fwd(y[i], r, post[i], comb[i])
                    outs_res.append(r)
            return outs_li + outs_res

        yield Case(params=dict(num_layers=num_layers, num_post=num_post, bs=1, seq=seq, mhc_mult=N, hidden=h),
                   impl=fused, ref=chain, check=_close(dict(atol=0, rtol=0)), nbytes=io,
                   anchor=("mhc_multilayer_recompute", dict(num_layers=num_layers, num_post=num_post, bs=1,
                                                            seq=seq, mhc_mult=N, hidden=h)),
                   tune=("mhc_multilayer_recompute", _TILE_TUNE))


def _liger():
    """``liger_kernel.ops.mhc`` where Liger-Kernel is installed and can run here (CUDA), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from liger_kernel.ops import mhc as liger_mhc
    except ImportError:
        return None
    return liger_mhc
