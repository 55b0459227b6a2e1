"""Benchmarks of ``mhc_pre_norm_fn`` (forward; forward + backward), ``mhc_pre_big_fuse`` and the functional ``mhc_pre``
(training forward + backward; no grad) at n = 4, T = 8192 tokens (2 x 4096), H in {2560, 7168} on the GPU.

TileKernels has no benchmark for these ops; the byte counts follow spec/mhc.md (each tensor read or written once):

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

import torch

from tritile.bench import Case, register
from tritile.torch.mhc import (mhc_pre_apply_mix_ref, mhc_pre_norm_fn_ref, mhc_pre_split_mixes_ref,
                         sinkhorn_normalize_ref)

_M = "mhc"
N = 4
N3 = N * (N + 2)
EPS = 1e-6

# Launch-config candidates (python -m tritile tune --module mhc).  The GEMM's split count and tile change the
# float32 summation order of p and s ("output differs" is expected; the tests' tolerances hold for each).
_GEMM_TUNE = [dict(BLOCK_T=bt, BLOCK_D=bd, num_warps=w, num_stages=st, PROGRAMS=p)
              for bt, bd, w, st, p in ((64, 128, 4, 4, 512), (64, 128, 4, 3, 512), (64, 128, 4, 5, 512),
                                       (64, 128, 4, 4, 1024), (64, 256, 8, 3, 512), (128, 64, 4, 3, 512),
                                       (128, 128, 8, 3, 512), (256, 64, 8, 3, 512), (32, 128, 4, 4, 512),
                                       (64, 64, 4, 4, 512))]
_BWD_TUNE = [dict(BLOCK_T=bt, BLOCK_D=bd, num_warps=w, num_stages=st, PROGRAMS=p)
             for bt, bd, w, st, p in ((64, 128, 4, 3, 512), (64, 128, 4, 4, 512), (64, 128, 4, 2, 512),
                                      (64, 128, 4, 3, 1024), (64, 128, 4, 3, 264), (32, 128, 4, 3, 512),
                                      (64, 64, 4, 3, 512), (128, 128, 8, 3, 512))]
_FUSE_TUNE = [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=w)
              for bt, bh, w in ((1, 1024, 4), (4, 512, 4), (8, 256, 4), (8, 512, 8), (16, 256, 4), (16, 256, 8),
                                (16, 512, 8), (32, 128, 4), (32, 256, 8), (64, 128, 8))]


def _shapes(device, quick):
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


def _close(atol, rtol):
    def check(out, ref):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        for a, b in zip(outs, refs):
            torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
    return check


def _liger():
    """Liger-Kernel's mHC ops with its fused GEMM + RMS (``mhc_mm_norm_fwd``), else None."""
    from .mhc import _liger as liger_ops

    liger_mhc = liger_ops()
    return liger_mhc if hasattr(liger_mhc, "mhc_mm_norm_fwd") else None


@register(_M, "mhc_pre_norm_fn")
def _norm_fn_cases(device, quick):
    from tritile.modeling.mhc.ops import mhc_pre_norm_fn

    for n0, n1, H in _shapes(device, quick):
        T, D = n0 * n1, N * H
        residual, fn, *_ = _inputs(n0, n1, H, device)
        fwd_bytes = T * D * 2 + N3 * D * 4 + T * N3 * 4
        yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="fwd",
                   fn=lambda r=residual, f=fn: mhc_pre_norm_fn(r, f, None, EPS),
                   ref=lambda r=residual, f=fn: mhc_pre_norm_fn_ref(r, f, None, EPS),
                   check=_close(1e-3, 1e-3), nbytes=fwd_bytes,
                   tune=("mhc_norm_fn_gemm", _GEMM_TUNE) if device.type == "cuda" else None)

        r = residual.clone().requires_grad_()
        f = fn.clone().requires_grad_()
        g = torch.randn(n0, n1, N3, device=device)
        buf = torch.zeros_like(residual)

        def fwd_bwd(r=r, f=f, g=g, buf=buf):
            out = mhc_pre_norm_fn(r, f, None, EPS)
            r.untyped_storage().grad_from_mhc_post = buf
            f.grad = None
            out.backward(g)
            return out, f.grad

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
        yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="fwd+bwd", fn=fwd_bwd, ref=ref_fwd_bwd,
                   check=_close(3e-2, 1e-3), nbytes=fwd_bytes + bwd_bytes,
                   tune=("mhc_norm_fn_bwd", _BWD_TUNE) if device.type == "cuda" else None)

        liger = _liger()
        if liger is not None:
            # Liger-Kernel's fused GEMM + RMS (phi as (D, n3), float32 operands on TF32 tensor cores, grad_phi by
            # float32 atomics); its backward writes a fresh residual gradient (no accumulation buffer).
            x2, phi = residual.view(T, D), fn.t().contiguous()
            yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="liger fwd",
                       fn=lambda x2=x2, phi=phi: liger.mhc_mm_norm_fwd(x2, phi, EPS)[0],
                       ref=lambda r=residual, f=fn: mhc_pre_norm_fn_ref(r, f, None, EPS).view(T, N3),
                       check=_close(1e-3, 1e-3), nbytes=fwd_bytes)

            def liger_fwd_bwd(x2=x2, phi=phi, g=g.view(T, N3)):
                mix, invr = liger.mhc_mm_norm_fwd(x2, phi, EPS)
                return liger.mhc_mm_norm_bwd(x2, phi, mix, invr, g)

            yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H), label="liger fwd+bwd", fn=liger_fwd_bwd,
                       nbytes=fwd_bytes + bwd_bytes - T * D * 2)  # no accumulation buffer to read


def _chain_ref(residual, fn, scale, base, w=None):
    mixes = mhc_pre_norm_fn_ref(residual, fn, w, EPS)
    pre, post, comb = mhc_pre_split_mixes_ref(mixes, scale, base, N, 1.0, EPS)
    comb = sinkhorn_normalize_ref(comb, 10, EPS)
    return post, comb, mhc_pre_apply_mix_ref(residual, pre)


@register(_M, "mhc_pre_big_fuse")
def _big_fuse_cases(device, quick):
    from tritile.modeling.mhc.ops import mhc_pre_big_fuse

    for n0, n1, H in _shapes(device, quick):
        T, D = n0 * n1, N * H
        residual, fn, scale, base, _ = _inputs(n0, n1, H, device)
        nbytes = 2 * T * D * 2 + N3 * D * 4 + 2 * T * (N3 + 1) * 4 + T * (N + N * N) * 4 + T * H * 2
        yield Case(params=dict(n0=n0, n1=n1, mhc_mult=N, hidden=H),
                   fn=lambda r=residual, f=fn, s=scale, b=base: mhc_pre_big_fuse(r, f, s, b, EPS, EPS, EPS, 1.0, 10),
                   ref=lambda r=residual, f=fn, s=scale, b=base: _chain_ref(r, f, s, b),
                   check=_close(2e-2, 1e-2), nbytes=nbytes,
                   tune=("mhc_pre_big_fuse", _FUSE_TUNE) if device.type == "cuda" else None)


@register(_M, "mhc_pre")
def _mhc_pre_cases(device, quick):
    from tritile.modeling.mhc import mhc_pre

    for n0, n1, H in _shapes(device, quick):
        T, D = n0 * n1, N * H
        residual, fn, scale, base, w = _inputs(n0, n1, H, device, normw=True)
        params = dict(n0=n0, n1=n1, mhc_mult=N, hidden=H, norm_weight=True)

        def no_grad(residual=residual, fn=fn, scale=scale, base=base, w=w):
            with torch.no_grad():
                li, (post, comb) = mhc_pre(residual, fn, scale, base, norm_weight=w)
            return post, comb, li

        nbytes = 2 * T * D * 2 + N3 * D * 4 + 2 * T * (N3 + 1) * 4 + T * (N + N * N) * 4 + T * H * 2
        yield Case(params=params, label="no_grad", fn=no_grad,
                   ref=lambda r=residual, f=fn, s=scale, b=base, w=w: _chain_ref(r, f, s, b, w),
                   check=_close(2e-2, 1e-2), nbytes=nbytes)

        leaves = [t.clone().requires_grad_() for t in (fn, scale, base, w)]
        r = residual.clone().requires_grad_()
        g = torch.randn(n0, n1, H, device=device).bfloat16()

        def train(r=r, leaves=leaves, g=g):
            f, s, b, nw = leaves
            for t in (r, *leaves):
                t.grad = None
            li, _ = mhc_pre(r, f, s, b, norm_weight=nw)
            li.backward(g)
            return li

        train_bytes = T * (2 * D * 2 + H * 2) + T * (H * 2 + 2 * D * 2 + 3 * D * 2) + 3 * N3 * D * 4 + 3 * D * 4
        yield Case(params=params, label="train fwd+bwd", fn=train, nbytes=train_bytes)
