"""``expand_to_mhc``: copy a hidden state into the ``n`` mHC residual streams, with autograd
(``tile_kernels.modeling.mhc.ops.expand``)."""

from __future__ import annotations

from typing import Optional

import torch

from tritile.mhc.expand_kernel import expand_alloc, expand_bwd, expand_fwd
from tritile.runtime import (check_contiguous, check_device, check_int, check_same_device, check_shape,
                             check_tensor, records_graph)

__all__ = ["expand_to_mhc", "MHCExpand"]


def _expand(hidden: torch.Tensor, mhc_mult: int, out: Optional[torch.Tensor]) -> torch.Tensor:
    """The copy into ``out``, or into a new tensor allocated inside the op (no in-place tensor op in a traced
    forward: see :func:`tritile.mhc.expand_kernel.expand_alloc`)."""
    if out is None:
        return expand_alloc(hidden, mhc_mult)
    h = hidden.shape[-1]
    expand_fwd(hidden.view(-1, h), out.view(-1, mhc_mult, h))
    return out


class MHCExpand(torch.autograd.Function):
    """Forward ``out[..., m, :] = hidden``; backward ``g_hidden = bf16(sum_m g[..., m, :])`` (fp32, stream order)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mhc_mult: int, out: Optional[torch.Tensor]) -> torch.Tensor:
        out = _expand(hidden, mhc_mult, out)
        ctx.hidden_shape = tuple(hidden.shape)
        ctx.mhc_mult = mhc_mult
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h = ctx.hidden_shape[-1]
        g = expand_bwd(grad.contiguous().view(-1, ctx.mhc_mult, h))
        return g.view(ctx.hidden_shape), None, None


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expand a hidden state into ``mhc_mult`` residual streams.

    Args:
        hidden: bf16 ``(..., H)``, contiguous.
        mhc_mult: number of streams ``n >= 1``.
        out: optional bf16 ``(..., n, H)``, contiguous, written in place (the result aliases it).

    Returns:
        bf16 ``(..., n, H)`` with every stream equal to ``hidden``.  Backward: the fp32 sum over the streams
        (``m = 0..n-1``), rounded once to bf16.
    """
    check_tensor("hidden", hidden, dtypes=(torch.bfloat16,))
    if hidden.dim() < 1:
        raise ValueError("hidden must be (..., H), got a 0D tensor")
    check_contiguous("hidden", hidden)
    check_device("hidden", hidden)
    check_int("mhc_mult", mhc_mult, 1)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,))
        check_shape("out", out, tuple(hidden.shape[:-1]) + (mhc_mult, hidden.shape[-1]))
        check_contiguous("out", out)
        check_same_device(hidden=hidden, out=out)
    if not records_graph(hidden):  # no graph to record: the launch alone
        return _expand(hidden, mhc_mult, out)
    return MHCExpand.apply(hidden, mhc_mult, out)
