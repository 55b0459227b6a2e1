"""The mHC layer API: embedding expansion, the per-sublayer pre step and the LM-head step
(``tile_kernels.modeling.mhc.functional``).

A model built from them (per sublayer ``mhc_pre`` -> sublayer -> ``mhc_post``)::

    R = expand_from_embedding(emb)                       # (B, S, n, H)
    for each sublayer:
        u, (post, comb) = mhc_pre(R, fn, scale, base, norm_weight=normw)
        R = mhc_post(sublayer(u), R, post, comb)
    h = mhc_head(R, fn_head, scale_head, base_head)      # (B, S, H)

Two TileKernels bugs are fixed here: ``mhc_pre`` without grad honours ``norm_weight`` (as upstream's later fix
does), and ``mhc_head``'s backward works although no ``mhc_post`` consumes its residual.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from tritile.runtime import check_same_device, check_shape, check_tensor

from .ops.expand import expand_to_mhc
from .ops.head_compute_mix import mhc_head_compute_mix
from .ops.norm_fn import merge_norm_weight, mhc_pre_norm_fn
from .ops.pre_apply_mix import mhc_pre_apply_mix
from .ops.pre_big_fuse import mhc_pre_big_fuse
from .ops.pre_split_mixes import mhc_pre_split_mixes
from .ops.sinkhorn import sinkhorn_normalize

__all__ = ["expand_from_embedding", "mhc_pre", "mhc_head"]


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """Turn an embedding into the mHC residual: every one of the ``mhc_mult`` streams is a copy of ``x``.

    Args:
        x: bfloat16 ``(..., H)``, contiguous.
        mhc_mult: number of residual streams ``n``.

    Returns:
        bfloat16 ``(..., n, H)`` (differentiable: the gradient of ``x`` is the stream sum).
    """
    return expand_to_mhc(x, mhc_mult)


def _check_mult(residual: torch.Tensor, mhc_mult: int) -> None:
    check_tensor("residual", residual, dtypes=(torch.bfloat16,))
    if residual.dim() < 2 or residual.shape[-2] != mhc_mult:
        raise ValueError(f"residual must be (..., mhc_mult, hidden_size) with mhc_mult = {mhc_mult}, "
                         f"got shape {tuple(residual.shape)}")


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
            norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, mhc_mult: int = 4,
            post_mult_value: float = 1.0, pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6,
            sinkhorn_repeat: int = 10, n_splits: int = 16) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The mHC step before a sublayer: the sublayer's input and the mixes ``mhc_post`` needs.

    With grad enabled, four autograd ops: ``mhc_pre_norm_fn`` (residual-gradient fusion on: the residual must then
    go through ``mhc_post``, whose backward provides the buffer; without it a separate gradient is returned) ->
    ``mhc_pre_split_mixes`` -> ``sinkhorn_normalize`` -> ``mhc_pre_apply_mix``.  Without grad (``no_grad`` /
    ``inference_mode``): ``fn * norm_weight`` then one ``mhc_pre_big_fuse``, bitwise the same outputs.
    TileKernels' no-grad path ignores ``norm_weight``; here it is folded in as in the training path.

    Args:
        residual: bfloat16 ``(B, S, n, H)`` contiguous (any leading dims without grad), ``n = mhc_mult = 4``.
        fn: float32 ``(n (n + 2), n H)``; scale: float32 ``(3,)``; base: float32 ``(n (n + 2),)``.
        norm_weight: ``None`` or float32 ``(n H,)``, the RMSNorm weight folded into ``fn``'s columns.
        norm_eps, pre_eps, sinkhorn_eps: epsilons of the RMS, the pre sigmoid and Sinkhorn.
        mhc_mult: ``n``; must match ``residual.shape[-2]``.
        post_mult_value: multiplier of the post sigmoid (non-zero).
        sinkhorn_repeat: Sinkhorn iterations (``>= 1``).
        n_splits: accepted for compatibility and ignored.

    Returns:
        ``(layer_input, (post_mix, comb_mix))``: bfloat16 ``(B, S, H)``, float32 ``(B, S, n, 1)`` and float32
        ``(B, S, n, n)`` (``[input stream, output stream]``).
    """
    _check_mult(residual, mhc_mult)
    if not torch.is_grad_enabled():
        if norm_weight is not None:
            check_tensor("norm_weight", norm_weight, dtypes=(torch.float32,), ndim=1)
            check_shape("norm_weight", norm_weight, (residual.shape[-2] * residual.shape[-1],))
            check_tensor("fn", fn, dtypes=(torch.float32,), ndim=2)
            check_same_device(fn=fn, norm_weight=norm_weight)
            if fn.shape[1] != norm_weight.shape[0]:
                raise ValueError(f"fn must have {norm_weight.shape[0]} columns (norm_weight's length), "
                                 f"got shape {tuple(fn.shape)}")
            fn = merge_norm_weight(fn, norm_weight)
        post_mix, comb_mix, layer_input = mhc_pre_big_fuse(
            residual, fn, scale, base, rms_eps=norm_eps, mhc_pre_eps=pre_eps, mhc_sinkhorn_eps=sinkhorn_eps,
            mhc_post_mult_value=post_mult_value, sinkhorn_repeat=sinkhorn_repeat, n_splits=n_splits)
        return layer_input, (post_mix, comb_mix)

    if residual.dim() != 4:
        raise ValueError(f"residual must be 4D (batch, seq, mhc_mult, hidden_size) when grad is enabled, "
                         f"got shape {tuple(residual.shape)}")
    mixes = mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)
    pre_mix, post_mix, comb_mix = mhc_pre_split_mixes(mixes, scale, base, mhc_mult, post_mult_value, pre_eps)
    comb_mix = sinkhorn_normalize(comb_mix, repeat=sinkhorn_repeat, eps=sinkhorn_eps)
    layer_input = mhc_pre_apply_mix(residual, pre_mix)
    return layer_input, (post_mix, comb_mix)


def mhc_head(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
             norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, mhc_mult: int = 4,
             pre_eps: float = 1e-6, n_splits: int = 16) -> torch.Tensor:
    """The mHC step before the LM head: ``sum_m mix_m R_m`` with ``mix = sigmoid(scale * mixes + base) + pre_eps``.

    ``fn`` is zero-padded (differentiably) to ``n (n + 2)`` rows to run ``mhc_pre_norm_fn``; its first ``n``
    outputs feed ``mhc_head_compute_mix``, then ``mhc_pre_apply_mix``.  No ``mhc_post`` consumes the head's
    residual, so the residual gradients of the two consumers are returned separately and summed by autograd
    (TileKernels' backward raises ``AttributeError`` here).

    Args:
        residual: bfloat16 ``(B, S, n, H)`` contiguous, ``n = mhc_mult``.
        fn: float32 ``(n, n H)`` (or already padded to ``(n (n + 2), n H)``); scale: float32 with one element;
            base: float32 ``(n,)``.
        norm_weight: ``None`` or float32 ``(n H,)``; norm_eps, pre_eps: epsilons; n_splits: ignored.

    Returns:
        bfloat16 ``(B, S, H)``.
    """
    _check_mult(residual, mhc_mult)
    if residual.dim() != 4:
        raise ValueError(f"residual must be 4D (batch, seq, mhc_mult, hidden_size), got shape {tuple(residual.shape)}")
    check_tensor("fn", fn, dtypes=(torch.float32,), ndim=2)
    check_tensor("scale", scale, dtypes=(torch.float32,))
    if scale.numel() != 1:
        raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
    mhc_mult3 = mhc_mult * (mhc_mult + 2)
    if fn.shape[0] not in (mhc_mult, mhc_mult3):
        raise ValueError(f"fn must have mhc_mult = {mhc_mult} (or {mhc_mult3}) rows, got shape {tuple(fn.shape)}")
    if fn.shape[0] < mhc_mult3:
        fn = F.pad(fn, (0, 0, 0, mhc_mult3 - fn.shape[0]))
    mixes = mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)
    mixes = mixes[..., :mhc_mult].contiguous()
    mix = mhc_head_compute_mix(mixes, scale.reshape(1), base, pre_eps)
    return mhc_pre_apply_mix(residual, mix.unsqueeze(-1))
