"""``mhc_pre_split_mixes``: split the mixes into pre / post weights and comb logits, with autograd
(``tile_kernels.modeling.mhc.ops.pre_split_mixes``)."""

from __future__ import annotations

from typing import Tuple

import torch

from tritile.mhc._common import check_nonzero, check_positive
from tritile.mhc.pre_split_mixes_kernel import split_bwd, split_fwd
from tritile.runtime import (check_contiguous, check_device, check_same_device, check_shape, check_tensor,
                             records_graph)

__all__ = ["mhc_pre_split_mixes", "MHCPreSplitMixes"]


def _split(input_mixes, mhc_scale, mhc_base, n, post_mult, pre_eps):
    """The forward kernel on the flattened tokens: ``(mixes (T, n3), post (T, n), (pre, post, comb))``, the last
    shaped as the op returns them."""
    b, s, nj = input_mixes.shape
    mixes = input_mixes.view(b * s, nj)
    pre, post, comb = split_fwd(mixes, mhc_scale, mhc_base, n, float(post_mult), float(pre_eps))
    return mixes, post, (pre.view(b, s, n, 1), post.view(b, s, n, 1), comb.view(b, s, n, n))


class MHCPreSplitMixes(torch.autograd.Function):
    """Backward: ``gz_pre = g_pre s (1 - s)`` (``s`` recomputed), ``gz_post = g_post post (1 - post / mult)`` (the
    saved output), ``gz_comb = g_comb``; ``g_mixes = gz * scale[group]``; ``g_scale[k] = sum gz_j mixes_j`` over
    group ``k``, ``g_base = sum_tokens gz`` (per-program partials, then deterministic sums).  ``main_grad``
    attributes of scale / base are ignored, as in TileKernels."""

    @staticmethod
    def forward(ctx, input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps):
        mixes, post, out = _split(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps)
        ctx.save_for_backward(mixes, mhc_scale, mhc_base, post)
        ctx.n, ctx.post_mult, ctx.bs = mhc_mult, float(mhc_post_mult_value), tuple(input_mixes.shape[:2])
        return out

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        mixes, scale, base, post = ctx.saved_tensors
        n, t = ctx.n, mixes.shape[0]

        def flat(g, shape):
            if g is None:
                return torch.zeros(shape, dtype=torch.float32, device=mixes.device)
            return g.contiguous().view(shape)

        g_mixes, g_scale, g_base = split_bwd(mixes, scale, base, post, flat(g_pre, (t, n)), flat(g_post, (t, n)),
                                             flat(g_comb, (t, n, n)), n, ctx.post_mult)
        return g_mixes.view(*ctx.bs, mixes.shape[1]), g_scale, g_base, None, None, None


def mhc_pre_split_mixes(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor, mhc_mult: int,
                        mhc_post_mult_value: float,
                        mhc_pre_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split each token's mixes (``z = mixes * scale[min(2, j // n)] + base``).

    Args:
        input_mixes: fp32 ``(B, S, n3)``, contiguous, ``n3 = n (n + 2)``.
        mhc_scale: fp32 ``(3,)``; mhc_base: fp32 ``(n3,)``.
        mhc_mult: ``n``.
        mhc_post_mult_value: post multiplier (non-zero and finite: the backward divides by it).
        mhc_pre_eps: added to the pre weights, positive.

    Returns:
        fp32 ``pre (B, S, n, 1) = sigmoid(z[:n]) + pre_eps``, ``post (B, S, n, 1) = mult * sigmoid(z[n:2n])`` and
        ``comb (B, S, n, n) = z[2n:]`` (raw logits, ``[input stream, output stream]``).
    """
    check_tensor("input_mixes", input_mixes, dtypes=(torch.float32,), ndim=3)
    check_tensor("mhc_scale", mhc_scale, dtypes=(torch.float32,))
    check_tensor("mhc_base", mhc_base, dtypes=(torch.float32,))
    if isinstance(mhc_mult, bool) or not isinstance(mhc_mult, int):
        raise TypeError(f"mhc_mult must be an int, got {type(mhc_mult).__name__}")
    if mhc_mult < 1:
        raise ValueError(f"mhc_mult must be at least 1, got {mhc_mult}")
    n3 = mhc_mult * (mhc_mult + 2)
    if input_mixes.shape[-1] != n3:
        raise ValueError(f"input_mixes must have mhc_mult * (mhc_mult + 2) = {n3} values per token for "
                         f"mhc_mult = {mhc_mult}, got shape {tuple(input_mixes.shape)}")
    check_shape("mhc_scale", mhc_scale, (3,))
    check_shape("mhc_base", mhc_base, (n3,))
    check_contiguous("input_mixes", input_mixes)
    check_contiguous("mhc_scale", mhc_scale)
    check_contiguous("mhc_base", mhc_base)
    mhc_post_mult_value = check_nonzero("mhc_post_mult_value", mhc_post_mult_value)
    mhc_pre_eps = check_positive("mhc_pre_eps", mhc_pre_eps)
    check_device("input_mixes", input_mixes)
    check_same_device(input_mixes=input_mixes, mhc_scale=mhc_scale, mhc_base=mhc_base)
    if not records_graph(input_mixes, mhc_scale, mhc_base):  # no graph to record: the launch alone
        return _split(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps)[2]
    return MHCPreSplitMixes.apply(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps)
