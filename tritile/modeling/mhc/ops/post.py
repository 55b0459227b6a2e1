"""``mhc_post``: ``R'_o = post_o y + sum_i comb[i][o] R_i`` with autograd, and the residual-gradient protocol's
first step (``tile_kernels.modeling.mhc.ops.post``).  Also re-exports the plain ``mhc_post_fwd`` / ``mhc_post_bwd``."""

from __future__ import annotations

from typing import Optional

import torch

from tritile.mhc.post_kernel import _check_post_args, mhc_post_bwd, mhc_post_fwd
from tritile.runtime import check_contiguous, check_same_device, check_shape, check_tensor

__all__ = ["mhc_post", "mhc_post_fwd", "mhc_post_bwd", "MHCPost"]


class MHCPost(torch.autograd.Function):
    """Backward (``n = 4``): one kernel gives ``d_x``, ``d_residual``, ``d_post``, ``d_comb``.  ``d_residual`` is
    attached to ``residual.untyped_storage().grad_from_mhc_post`` (the buffer the residual's other consumers,
    ``mhc_pre_apply_mix`` and ``mhc_pre_norm_fn``, accumulate into in place) **and** returned as its gradient."""

    @staticmethod
    def forward(ctx, x, residual, post_layer_mix, comb_res_mix, out):
        out = mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, out)
        ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, residual, post_layer_mix, comb_res_mix = ctx.saved_tensors
        d_x, d_res, d_post, d_comb = mhc_post_bwd(x, residual, post_layer_mix, comb_res_mix, grad,
                                                  fuse_grad_acc=True)
        return d_x, d_res, d_post, d_comb, None


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """mHC post combination with autograd.

    Args:
        x: bf16 ``(B, S, H)``, contiguous: the sublayer output.
        residual: bf16 ``(B, S, n, H)``, contiguous (it must own its storage: the backward attaches the residual
            gradient buffer to it).
        post_layer_mix: fp32 ``(B, S, n, 1)``, contiguous.
        comb_res_mix: fp32 ``(B, S, n, n)``, contiguous, ``[input stream i, output stream o]``.
        out: optional bf16 ``(B, S, n, H)``, contiguous, written in place (the result aliases it).

    Returns:
        bf16 ``(B, S, n, H)``: ``post_o x + sum_i comb[i, o] residual_i`` in fp32, rounded once.  The backward
        supports ``n = 4`` only (as TileKernels).
    """
    _check_post_args(x, residual, post_layer_mix, comb_res_mix)
    check_contiguous("residual", residual)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,))
        check_shape("out", out, residual.shape)
        check_contiguous("out", out)
        check_same_device(out=out, residual=residual)
    return MHCPost.apply(x, residual, post_layer_mix, comb_res_mix, out)
