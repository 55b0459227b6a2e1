"""The mHC layer API: embedding expansion, the per-sublayer pre step and the LM-head step
(``tile_kernels.modeling.mhc.functional``).

A model built from them (per sublayer ``mhc_pre`` -> sublayer -> ``mhc_post``)::

    R = expand_from_embedding(emb)                       # (B, S, n, H)
    for each sublayer:
        u, (post, comb) = mhc_pre(R, fn, scale, base, norm_weight=normw)
        R = mhc_post(sublayer(u), R, post, comb)
    h = mhc_head(R, fn_head, scale_head, base_head)      # (B, S, H)

Three TileKernels bugs are fixed here: ``mhc_pre`` without grad honours ``norm_weight`` (as upstream's later fix
does); ``mhc_head``'s backward works although no ``mhc_post`` consumes its residual; and ``mhc_head``'s forward
works: TileKernels' passes ``norm_fn``'s sliced mixes (``mixes[..., :n]``, row stride ``n (n + 2)``) straight to
its head kernel, whose compact-stride argument check rejects them ("violates packed ABI constraint").

Both functions check every argument by its public name and on the shapes as passed, the same way with and without
grad; the epsilons must be positive and ``post_mult_value`` non-zero.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from tritile.mhc._common import check_nonzero, check_positive
from tritile.runtime import (check_contiguous, check_device, check_int, check_same_device, check_shape,
                             check_tensor)

from .ops.expand import expand_to_mhc
from .ops.head_compute_mix import MHCHeadComputeMix
from .ops.norm_fn import MHCPreNormFn, merge_norm_weight
from .ops.pre_apply_mix import MHCPreApplyMix
from .ops.pre_big_fuse import mhc_pre_big_fuse
from .ops.pre_split_mixes import MHCPreSplitMixes
from .ops.sinkhorn import MHCSinkhorn

__all__ = ["expand_from_embedding", "mhc_pre", "mhc_head"]


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """Turn an embedding into the mHC residual: every one of the ``mhc_mult`` streams is a copy of ``x``.

    Args:
        x: bfloat16 ``(..., H)``, contiguous.
        mhc_mult: number of residual streams ``n`` (an int, at least 1).

    Returns:
        bfloat16 ``(..., n, H)`` (differentiable: the gradient of ``x`` is the stream sum).
    """
    check_tensor("x", x, dtypes=(torch.bfloat16,))
    if x.dim() < 1:
        raise ValueError("x must be (..., H), got a 0D tensor")
    check_contiguous("x", x)
    check_device("x", x)
    check_int("mhc_mult", mhc_mult, 1)
    return expand_to_mhc(x, mhc_mult)


def _check_common(residual: torch.Tensor, fn: torch.Tensor, norm_weight: Optional[torch.Tensor], mhc_mult: int,
                  norm_eps: float, pre_eps: float, n_splits: int, fn_rows: Tuple[int, ...]) -> int:
    """The checks ``mhc_pre`` and ``mhc_head`` share, by their public argument names and on the shapes as passed
    (whether or not grad is enabled); returns ``n (n + 2)``."""
    check_int("mhc_mult", mhc_mult, 1)
    check_tensor("residual", residual, dtypes=(torch.bfloat16,))
    if residual.dim() < 2 or residual.shape[-2] != mhc_mult:
        raise ValueError(f"residual must be (..., mhc_mult, hidden_size) with mhc_mult = {mhc_mult}, "
                         f"got shape {tuple(residual.shape)}")
    if mhc_mult != 4:
        raise ValueError(f"mhc_mult must be 4 (the only value the mHC kernels support), got {mhc_mult}")
    check_contiguous("residual", residual)
    check_device("residual", residual)
    d = mhc_mult * residual.shape[-1]
    check_tensor("fn", fn, dtypes=(torch.float32,), ndim=2)
    if fn.shape[0] not in fn_rows or fn.shape[1] != d:
        rows = " or ".join(str(r) for r in fn_rows)
        raise ValueError(f"fn must have shape ({rows}, mhc_mult * hidden_size = {d}), got {tuple(fn.shape)}")
    check_contiguous("fn", fn)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=(torch.float32,), ndim=1)
        check_shape("norm_weight", norm_weight, (d,))
    check_same_device(residual=residual, fn=fn, norm_weight=norm_weight)
    check_positive("norm_eps", norm_eps)
    check_positive("pre_eps", pre_eps)
    check_int("n_splits", n_splits, 1)
    return mhc_mult * (mhc_mult + 2)


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
        norm_eps, pre_eps, sinkhorn_eps: epsilons of the RMS, the pre sigmoid and Sinkhorn (positive).
        mhc_mult: ``n`` (an int); must match ``residual.shape[-2]``; 4 is the only supported value.
        post_mult_value: multiplier of the post sigmoid (non-zero and finite).
        sinkhorn_repeat: Sinkhorn iterations (an int, ``>= 1``).
        n_splits: an int ``>= 1``, accepted for compatibility and ignored.

    The arguments are checked the same way with and without grad (the residual must be 4D with grad only).
    Bits: every step after the projection GEMM is TileKernels' order, bit for bit; the GEMM's float32 accumulation
    is not (tensor cores, see ``mhc_pre_norm_fn``), so a layer input next to a bf16 rounding boundary can differ
    from TileKernels' by one bf16 ulp.

    Returns:
        ``(layer_input, (post_mix, comb_mix))``: bfloat16 ``(B, S, H)``, float32 ``(B, S, n, 1)`` and float32
        ``(B, S, n, n)`` (``[input stream, output stream]``).
    """
    n3 = _check_common(residual, fn, norm_weight, mhc_mult, norm_eps, pre_eps, n_splits, (mhc_mult * (mhc_mult + 2),))
    for name, t, shape in (("scale", scale, (3,)), ("base", base, (n3,))):
        check_tensor(name, t, dtypes=(torch.float32,))
        check_shape(name, t, shape)
        check_contiguous(name, t)
    check_same_device(residual=residual, scale=scale, base=base)
    check_positive("sinkhorn_eps", sinkhorn_eps)
    check_nonzero("post_mult_value", post_mult_value)
    check_int("sinkhorn_repeat", sinkhorn_repeat, 1)
    if not torch.is_grad_enabled():
        if norm_weight is not None:
            fn = merge_norm_weight(fn, norm_weight)
        post_mix, comb_mix, layer_input = mhc_pre_big_fuse(
            residual, fn, scale, base, rms_eps=norm_eps, mhc_pre_eps=pre_eps, mhc_sinkhorn_eps=sinkhorn_eps,
            mhc_post_mult_value=post_mult_value, sinkhorn_repeat=sinkhorn_repeat, n_splits=n_splits)
        return layer_input, (post_mix, comb_mix)

    if residual.dim() != 4:
        raise ValueError(f"residual must be 4D (batch, seq, mhc_mult, hidden_size) when grad is enabled, "
                         f"got shape {tuple(residual.shape)}")
    # every argument is checked above: the four autograd nodes directly, as their public ops would build them
    mixes = _norm_fn_node(residual, fn, norm_weight, norm_eps, n_splits)
    pre_mix, post_mix, comb_mix = MHCPreSplitMixes.apply(mixes, scale, base, mhc_mult, float(post_mult_value),
                                                         float(pre_eps))
    comb_mix = MHCSinkhorn.apply(comb_mix, sinkhorn_repeat, float(sinkhorn_eps))
    layer_input = MHCPreApplyMix.apply(residual, pre_mix, None)
    return layer_input, (post_mix, comb_mix)


def _norm_fn_node(residual: torch.Tensor, fn: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_eps: float,
                  n_splits: int) -> torch.Tensor:
    """``mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps)`` on arguments already checked (residual-gradient
    fusion on)."""
    if norm_weight is not None:
        fn = merge_norm_weight(fn, norm_weight)
    return MHCPreNormFn.apply(residual, fn, float(norm_eps), True, n_splits)


def mhc_head(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
             norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, mhc_mult: int = 4,
             pre_eps: float = 1e-6, n_splits: int = 16) -> torch.Tensor:
    """The mHC step before the LM head: ``sum_m mix_m R_m`` with ``mix = sigmoid(scale * mixes + base) + pre_eps``.

    ``fn`` is zero-padded (differentiably) to ``n (n + 2)`` rows to run ``mhc_pre_norm_fn``; its first ``n``
    outputs feed ``mhc_head_compute_mix``, then ``mhc_pre_apply_mix``.  No ``mhc_post`` consumes the head's
    residual, so the residual gradients of the two consumers are returned separately and summed by autograd
    (TileKernels' backward raises ``AttributeError`` here).  The sliced mixes are made contiguous for
    ``mhc_head_compute_mix`` (TileKernels' ``mhc_head`` fails there: its head kernel rejects the strided slice,
    "violates packed ABI constraint").

    Args:
        residual: bfloat16 ``(B, S, n, H)`` contiguous, ``n = mhc_mult``.
        fn: float32 ``(n, n H)`` (or already padded to ``(n (n + 2), n H)``); scale: float32 with one element;
            base: float32 ``(n,)``.
        norm_weight: ``None`` or float32 ``(n H,)``; norm_eps, pre_eps: positive epsilons; mhc_mult: ``n`` (4);
        n_splits: an int ``>= 1``, ignored.

    Returns:
        bfloat16 ``(B, S, H)``.
    """
    mhc_mult3 = _check_common(residual, fn, norm_weight, mhc_mult, norm_eps, pre_eps, n_splits,
                              (mhc_mult, mhc_mult * (mhc_mult + 2)))
    if residual.dim() != 4:
        raise ValueError(f"residual must be 4D (batch, seq, mhc_mult, hidden_size), got shape {tuple(residual.shape)}")
    check_tensor("scale", scale, dtypes=(torch.float32,))
    if scale.numel() != 1:
        raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
    check_tensor("base", base, dtypes=(torch.float32,))
    check_shape("base", base, (mhc_mult,))
    check_same_device(residual=residual, scale=scale, base=base)
    if fn.shape[0] < mhc_mult3:
        fn = F.pad(fn, (0, 0, 0, mhc_mult3 - fn.shape[0]))
    mixes = _norm_fn_node(residual, fn, norm_weight, norm_eps, n_splits)
    mixes = mixes[..., :mhc_mult].contiguous()
    mix = MHCHeadComputeMix.apply(mixes, scale.reshape(1), base, float(pre_eps))
    return MHCPreApplyMix.apply(residual, mix.unsqueeze(-1), None)
