"""``mhc_post``: ``R'_o = post_o y + sum_i comb[i][o] R_i`` with autograd, and the residual-gradient protocol's
first step (``tile_kernels.modeling.mhc.ops.post``).  Also re-exports the plain ``mhc_post_fwd`` / ``mhc_post_bwd``."""

from __future__ import annotations

from typing import Optional

import torch

from tritile.mhc.post_kernel import _check_post_args, check_four_streams, mhc_post_bwd, mhc_post_fwd, post_bwd
from tritile.runtime import check_contiguous, check_same_device, check_shape, check_tensor, custom_op, records_graph

__all__ = ["mhc_post", "mhc_post_fwd", "mhc_post_bwd", "MHCPost"]


def _post_alloc_fake(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                     comb_res_mix: torch.Tensor) -> torch.Tensor:
    return residual.new_empty(residual.shape)


@custom_op("mhc_post_alloc", fake=_post_alloc_fake)
def _post_alloc(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                comb_res_mix: torch.Tensor) -> torch.Tensor:
    """:func:`mhc_post_fwd` into a new bf16 ``(B, S, n, H)`` tensor (arguments as there, checked by the caller).

    The output is allocated (and, in tests, poisoned) inside the op, so the traced ``MHCPost.forward`` holds no
    in-place tensor op: with one there, torch 2.11's ``torch.compile`` routes the output's gradient to the wrong
    slot of the traced forward, and the backward receives zeros."""
    return mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix)


def _post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
          out: Optional[torch.Tensor]) -> torch.Tensor:
    """The forward kernel into ``out``, or into a new tensor allocated inside the op (see :func:`_post_alloc`)."""
    if out is None:
        return _post_alloc(x, residual, post_layer_mix, comb_res_mix)
    return mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, out)


class MHCPost(torch.autograd.Function):
    """Backward (``n = 4``): one kernel gives ``d_x``, ``d_residual``, ``d_post``, ``d_comb``.  ``d_residual`` is
    attached to ``residual.untyped_storage().grad_from_mhc_post`` (the buffer the residual's other consumers,
    ``mhc_pre_apply_mix`` and ``mhc_pre_norm_fn``, accumulate into in place) **and** returned as its gradient."""

    @staticmethod
    def forward(ctx, x, residual, post_layer_mix, comb_res_mix, out):
        out = _post(x, residual, post_layer_mix, comb_res_mix, out)
        ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
        return out

    @staticmethod
    def backward(ctx, grad):
        # the forward checked every input (mhc_post): only the stream count the backward supports is left
        x, residual, post_layer_mix, comb_res_mix = ctx.saved_tensors
        check_four_streams(residual)
        return (*post_bwd(x, residual, post_layer_mix, comb_res_mix, grad), None)


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """mHC post combination with autograd.

    Args:
        x: bf16 ``(B, S, H)``, contiguous: the sublayer output.
        residual: bf16 ``(B, S, n, H)``, contiguous (the backward attaches the residual gradient buffer to its
            storage, per view: residuals that are views of one tensor, e.g. ``R[0:1]`` and ``R[1:2]``, keep separate
            buffers).
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
    if not records_graph(x, residual, post_layer_mix, comb_res_mix):
        return _post(x, residual, post_layer_mix, comb_res_mix, out)  # no graph to record: the launch alone
    return MHCPost.apply(x, residual, post_layer_mix, comb_res_mix, out)
