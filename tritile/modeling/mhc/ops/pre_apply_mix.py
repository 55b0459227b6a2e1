"""``mhc_pre_apply_mix``: the pre-mix ``u = sum_m mix_m x_m`` of the mHC residual streams, with autograd and the
in-place residual-gradient accumulation (``tile_kernels.modeling.mhc.ops.pre_apply_mix``)."""

from __future__ import annotations

from typing import Optional

import torch

from tritile.mhc._common import get_post_grad_buffer
from tritile.mhc.pre_apply_mix_kernel import apply_mix_bwd, apply_mix_bwd_acc, apply_mix_fwd
from tritile.runtime import (check_contiguous, check_device, check_same_device, check_shape, check_tensor, custom_op,
                             empty, records_graph)

__all__ = ["mhc_pre_apply_mix", "MHCPreApplyMix"]


def _apply_mix_alloc_fake(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    return x.new_empty(tuple(x.shape[:-2]) + (x.shape[-1],))


@custom_op("mhc_pre_apply_mix_alloc", fake=_apply_mix_alloc_fake)
def _apply_mix_alloc(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """bf16 ``(..., H)`` pre-mix of bf16 ``x (..., n, H)`` with fp32 ``mix (..., n, 1)`` (contiguous, checked by
    the caller), in a new tensor.

    The output is allocated (and, in tests, poisoned) inside the op, so the traced ``MHCPreApplyMix.forward``
    holds no in-place tensor op: with one there, torch 2.11's ``torch.compile`` routes the output's gradient to
    the wrong slot of the traced forward, and the backward receives zeros."""
    n, h = x.shape[-2], x.shape[-1]
    out = empty(tuple(x.shape[:-2]) + (h,), torch.bfloat16, x.device)
    apply_mix_fwd(x.view(-1, n, h), mix.view(-1, n), out.view(-1, h))
    return out


def _apply(x: torch.Tensor, mix: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """The forward kernel into ``out``, or into a new tensor allocated inside the op (no in-place tensor op in a
    traced forward: see :func:`_apply_mix_alloc`)."""
    if out is None:
        return _apply_mix_alloc(x, mix)
    n, h = x.shape[-2], x.shape[-1]
    apply_mix_fwd(x.view(-1, n, h), mix.view(-1, n), out.view(-1, h))
    return out


class MHCPreApplyMix(torch.autograd.Function):
    """Backward: ``g_mix[m] = sum_h g x_m`` (fp32, the shape of ``mix``).  When ``x``'s storage carries
    ``grad_from_mhc_post`` (set by ``mhc_post``'s backward), ``x``'s gradient is accumulated into that buffer in
    place (``buf = bf16(buf + mix_m g)``) and None is returned for ``x``; else ``bf16(mix_m g)`` is returned."""

    @staticmethod
    def forward(ctx, x, mix, out):
        out = _apply(x, mix, out)
        ctx.save_for_backward(x, mix)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, mix = ctx.saved_tensors
        n, h = x.shape[-2], x.shape[-1]
        x3 = x.view(-1, n, h)
        mix2 = mix.view(-1, n)
        g = grad.contiguous().view(-1, h)
        buf = get_post_grad_buffer(x)
        if buf is not None:
            check_tensor("grad_from_mhc_post", buf, dtypes=(torch.bfloat16,))
            if not buf.is_contiguous() or buf.numel() != x.numel():
                raise ValueError(f"grad_from_mhc_post must be a contiguous bfloat16 tensor of {x.numel()} elements, "
                                 f"got shape {tuple(buf.shape)} with strides {tuple(buf.stride())}")
            dmix = apply_mix_bwd_acc(x3, mix2, g, buf.view(-1, n, h))
            return None, dmix.view(mix.shape), None
        dx, dmix = apply_mix_bwd(x3, mix2, g)
        return dx.view(x.shape), dmix.view(mix.shape), None


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mix the residual streams into one layer input.

    Args:
        x: bf16 ``(..., n, H)``, contiguous: the residual.
        mix: fp32 ``(..., n, 1)``, contiguous: the pre weights.
        out: optional bf16 ``(..., H)``, contiguous, written in place (the result aliases it).

    Returns:
        bf16 ``(..., H)``: ``sum_m mix[..., m, 0] * x[..., m, :]`` accumulated in fp32 in stream order (fused
        multiply-adds), rounded once.
    """
    check_tensor("x", x, dtypes=(torch.bfloat16,))
    check_tensor("mix", mix, dtypes=(torch.float32,))
    if x.dim() < 2:
        raise ValueError(f"x must be (..., n, H), got shape {tuple(x.shape)}")
    h = x.shape[-1]
    check_shape("mix", mix, tuple(x.shape[:-1]) + (1,))
    check_contiguous("x", x)
    check_contiguous("mix", mix)
    check_device("x", x)
    check_same_device(x=x, mix=mix)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,))
        check_shape("out", out, tuple(x.shape[:-2]) + (h,))
        check_contiguous("out", out)
        check_same_device(x=x, out=out)
    if not records_graph(x, mix):  # no graph to record: the launch alone
        return _apply(x, mix, out)
    return MHCPreApplyMix.apply(x, mix, out)
