"""``mhc_pre_norm_fn``: RMS-normalised projection of the mHC residual onto the mix logits, with autograd
(``tile_kernels.modeling.mhc.ops.norm_fn``)."""

from __future__ import annotations

from typing import Optional

import torch

from tritile.mhc.norm_fn_kernel import (check_norm_fn_inputs, empty_grad_like, flatten_residual, norm_fn_bwd,
                                        norm_fn_fwd)
from tritile.mhc._common import check_positive, get_post_grad_buffer
from tritile.runtime import check_same_device, check_shape, check_tensor, records_graph

__all__ = ["mhc_pre_norm_fn", "merge_norm_weight", "MHCPreNormFn"]


def _tf32_policy(device: torch.device) -> bool:
    """Whether the backward rounds ``g_p`` to TF32: where TileKernels' (and the reference's) GEMMs run on TF32
    tensor cores, i.e. NVIDIA GPUs.  The CPU reference computes in float32."""
    return device.type == "cuda" and torch.version.hip is None


def _main_grad(name: str, t: torch.Tensor) -> Optional[torch.Tensor]:
    mg = getattr(t, "main_grad", None)
    if mg is None:
        return None
    check_tensor(f"{name}.main_grad", mg, dtypes=(torch.float32,))
    if mg.shape != t.shape:
        raise ValueError(f"{name}.main_grad must have shape {tuple(t.shape)}, got {tuple(mg.shape)}")
    return mg


class _MHCFnNormwMerge(torch.autograd.Function):
    """``fn' = fn * norm_weight`` (the RMSNorm weight folded into the projection's columns).

    Backward (``G`` = grad of ``fn'``): ``g_fn = G * norm_weight``, ``g_norm_weight = sum_rows(G * fn)`` (float32,
    deterministic).  When ``fn.main_grad`` / ``norm_weight.main_grad`` exists (Megatron style), the gradient is
    accumulated into it in place and ``None`` is returned for that input."""

    @staticmethod
    def forward(ctx, fn: torch.Tensor, normw: torch.Tensor) -> torch.Tensor:
        ctx.fn_main_grad = _main_grad("mhc_fn", fn)
        ctx.normw_main_grad = _main_grad("mhc_norm_weight", normw)
        ctx.save_for_backward(fn, normw)
        return fn * normw

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        fn, normw = ctx.saved_tensors
        g_fn = g * normw
        g_w = (g * fn).sum(0)
        if ctx.fn_main_grad is not None:
            ctx.fn_main_grad.add_(g_fn)
            g_fn = None
        if ctx.normw_main_grad is not None:
            ctx.normw_main_grad.add_(g_w)
            g_w = None
        return g_fn, g_w


def merge_norm_weight(fn: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``fn * norm_weight`` (float32 ``(n3, D)`` times float32 ``(D,)``), through the merge node when autograd records.

    Without grad the plain product is returned: the same float32 multiplication, so a no-grad pipeline sees the
    very bits the training pipeline does."""
    if records_graph(fn, norm_weight):
        return _MHCFnNormwMerge.apply(fn, norm_weight)
    return fn * norm_weight


class MHCPreNormFn(torch.autograd.Function):
    """Autograd node of the projection ``mixes = (x . round_to_tf32(fn)^T) * rsqrt(mean(x^2) + eps)``.

    ``forward(ctx, x, fn, norm_eps, fuse_grad_acc, n_splits)``: x bfloat16 ``(..., n, H)`` contiguous, fn float32
    ``(n3, n H)`` (already merged with the norm weight); returns float32 ``(..., n3)``.

    Backward: gradients of ``x`` and ``fn``.  With ``fuse_grad_acc`` and a ``grad_from_mhc_post`` buffer on
    ``x.untyped_storage()`` (set by ``mhc_post``'s backward), the residual gradient is added into that buffer in
    place (one bf16 rounding), the attribute is deleted and ``None`` is returned for ``x``.  Without the attribute
    (e.g. ``mhc_head``'s residual, which no ``mhc_post`` consumes) a fresh gradient is returned instead:
    TileKernels raises ``AttributeError`` there.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: torch.Tensor, norm_eps: float, fuse_grad_acc: bool, n_splits: int):
        n3 = fn.shape[0]
        x2 = flatten_residual(x)
        fn = fn.contiguous()
        mixes, p, s = norm_fn_fwd(x2, fn, float(norm_eps))
        ctx.save_for_backward(x, fn, p, s)
        ctx.norm_eps = float(norm_eps)
        ctx.fuse_grad_acc = bool(fuse_grad_acc)
        return mixes.view(*x.shape[:-2], n3)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, fn, p, s = ctx.saved_tensors
        n3, D = fn.shape
        x2 = x.view(-1, D)
        g2 = g.reshape(-1, n3).contiguous().float()
        buf = get_post_grad_buffer(x, take=True) if ctx.fuse_grad_acc else None
        if buf is not None:
            if buf.dtype != torch.bfloat16 or buf.numel() != x.numel() or not buf.is_contiguous():
                raise ValueError(f"grad_from_mhc_post must be a contiguous bfloat16 tensor of {x.numel()} elements, "
                                 f"got {buf.dtype} of shape {tuple(buf.shape)}")
            x_grad = buf.view(-1, D)
        else:
            x_grad = empty_grad_like(x2)
        g_fn = norm_fn_bwd(g2, x2, fn, p, s, ctx.norm_eps, x_grad, buf is not None, _tf32_policy(x.device))
        if buf is not None:
            return None, g_fn, None, None, None
        return x_grad.view_as(x), g_fn, None, None, None


def mhc_pre_norm_fn(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: Optional[torch.Tensor],
                    mhc_norm_eps: float, fuse_grad_acc: bool = True, n_splits: int = 16) -> torch.Tensor:
    """The mix logits of every token: ``(fn * norm_weight) . vec(R_t) * rsqrt(mean(R_t^2) + eps)``.

    Args:
        residual: bfloat16 ``(..., n, H)``, contiguous (it is the key of the fused residual-gradient buffer, so it
            is never copied).
        mhc_fn: float32 ``(n3, n H)`` with ``n3 = n (n + 2) = 24`` (``n = 4``, the only supported value); used
            with TF32 operands (``round_to_tf32``), as TileKernels' tensor-core GEMM.
        mhc_norm_weight: ``None`` or float32 ``(n H,)``: the RMSNorm weight, folded into ``mhc_fn``'s columns.
        mhc_norm_eps: the RMS epsilon (inside the square root), positive.
        fuse_grad_acc: accumulate the residual gradient into ``residual.untyped_storage().grad_from_mhc_post``
            when ``mhc_post``'s backward has set it (see :class:`MHCPreNormFn`).
        n_splits: accepted for compatibility and ignored (the split over ``D`` is chosen by shape).

    Returns:
        float32 ``(..., n3)``.

    Bits against TileKernels: the normalisation around the GEMM is TileKernels' order, but the GEMM is not:
    TileKernels accumulates ``x . fn''`` on TF32 tensor cores (``mma.sync``, its tiling), tritile's Triton GEMM
    (``wgmma`` on Hopper, its tiling and split over ``D``) sums the same exact products in another order.  Each
    float32 sum (the projection, the sum of squares, and in the backward ``fn``'s gradient over the tokens) then
    differs within ``2^-14`` of the sum of its products' magnitudes (measured on an H200 up to ``2^-18.5``: mixes
    within 5e-6, ``fn``'s gradient within 0.02 at 8192 tokens); the bf16 residual gradient by one ulp where a value
    sits next to a rounding boundary.  ``tests/mhc/test_mhc_vs_tilekernels.py`` checks these bounds on the GPU.
    """
    n, H, n3 = check_norm_fn_inputs(residual, mhc_fn)
    mhc_norm_eps = check_positive("mhc_norm_eps", mhc_norm_eps)
    if mhc_norm_weight is not None:
        check_tensor("mhc_norm_weight", mhc_norm_weight, dtypes=(torch.float32,), ndim=1)
        check_shape("mhc_norm_weight", mhc_norm_weight, (n * H,))
        check_same_device(residual=residual, mhc_norm_weight=mhc_norm_weight)
        mhc_fn = merge_norm_weight(mhc_fn, mhc_norm_weight)
    flatten_residual(residual)  # contiguity check before any autograd node
    return MHCPreNormFn.apply(residual, mhc_fn, mhc_norm_eps, fuse_grad_acc, n_splits)
