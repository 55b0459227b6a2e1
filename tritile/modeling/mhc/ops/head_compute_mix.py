"""``mhc_head_compute_mix``: the head's pre-mix weights ``sigmoid(mix * scale + base) + eps``, with autograd
(``tile_kernels.modeling.mhc.ops.head_compute_mix``)."""

from __future__ import annotations

import torch

from tritile.mhc._common import check_positive
from tritile.mhc.head_compute_mix_kernel import head_bwd, head_fwd
from tritile.runtime import check_device, check_same_device, check_shape, check_tensor, records_graph

__all__ = ["mhc_head_compute_mix", "MHCHeadComputeMix"]


def _flat(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor):
    """The kernels' operands: ``input_mix`` as a contiguous ``(B S, n)``, ``mhc_scale`` as ``(1,)``, ``mhc_base``
    contiguous."""
    b, s, n = input_mix.shape
    x = input_mix if input_mix.is_contiguous() else input_mix.contiguous()
    scale = mhc_scale if mhc_scale.is_contiguous() else mhc_scale.contiguous()
    base = mhc_base if mhc_base.is_contiguous() else mhc_base.contiguous()
    return x.view(b * s, n), scale.view(1), base


class MHCHeadComputeMix(torch.autograd.Function):
    """Backward (``s`` the sigmoid, recomputed): ``q = g s (1 - s)``, ``g_in = q * scale``, ``g_scale = sum q * in``,
    ``g_base[j] = sum_tokens q_j`` (per-program partials, then a deterministic sum)."""

    @staticmethod
    def forward(ctx, input_mix, mhc_scale, mhc_base, mhc_pre_eps):
        x, scale, base = _flat(input_mix, mhc_scale, mhc_base)
        ctx.save_for_backward(x, scale, base)
        ctx.shape, ctx.scale_shape = input_mix.shape, mhc_scale.shape
        return head_fwd(x, scale, base, float(mhc_pre_eps)).view(input_mix.shape)

    @staticmethod
    def backward(ctx, grad):
        x, scale, base = ctx.saved_tensors
        dx, dscale, dbase = head_bwd(x, scale, base, grad.contiguous().view(x.shape))
        return dx.view(ctx.shape), dscale.view(ctx.scale_shape), dbase, None


def mhc_head_compute_mix(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                         mhc_pre_eps: float) -> torch.Tensor:
    """Head mix weights.

    Args:
        input_mix: fp32 ``(B, S, n)`` (any strides, e.g. the first ``n`` columns of the mixes).
        mhc_scale: fp32 with one element (``(1,)``).
        mhc_base: fp32 ``(n,)``.
        mhc_pre_eps: added after the sigmoid, positive.

    Returns:
        fp32 ``(B, S, n)`` contiguous: ``sigmoid(input_mix * scale + base) + mhc_pre_eps``.
    """
    check_tensor("input_mix", input_mix, dtypes=(torch.float32,), ndim=3)
    check_tensor("mhc_scale", mhc_scale, dtypes=(torch.float32,))
    check_tensor("mhc_base", mhc_base, dtypes=(torch.float32,), ndim=1)
    if mhc_scale.numel() != 1:
        raise ValueError(f"mhc_scale must hold one element, got shape {tuple(mhc_scale.shape)}")
    check_shape("mhc_base", mhc_base, (input_mix.shape[-1],))
    check_device("input_mix", input_mix)
    check_same_device(input_mix=input_mix, mhc_scale=mhc_scale, mhc_base=mhc_base)
    mhc_pre_eps = check_positive("mhc_pre_eps", mhc_pre_eps)
    if not records_graph(input_mix, mhc_scale, mhc_base):  # no graph to record: the launch alone
        return head_fwd(*_flat(input_mix, mhc_scale, mhc_base), mhc_pre_eps).view(input_mix.shape)
    return MHCHeadComputeMix.apply(input_mix, mhc_scale, mhc_base, mhc_pre_eps)
