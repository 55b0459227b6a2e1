"""``sinkhorn_normalize``: Sinkhorn-Knopp normalisation of the mHC comb logits, with autograd
(``tile_kernels.modeling.mhc.ops.sinkhorn``)."""

from __future__ import annotations

import torch

from tritile.mhc._common import check_positive
from tritile.mhc.sinkhorn_kernel import sinkhorn_bwd_launch, sinkhorn_fwd_launch
from tritile.runtime import check_device, check_tensor, records_graph

__all__ = ["sinkhorn_normalize", "MHCSinkhorn"]


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x (..., n, n)`` as a contiguous ``(T, n, n)``."""
    n = x.shape[-1]
    return (x if x.is_contiguous() else x.contiguous()).view(-1, n, n)


class MHCSinkhorn(torch.autograd.Function):
    """Forward: spec §1.3 per matrix.  Backward: unrolled reverse mode, the forward recomputed from the saved
    input logits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
        xc = _flat(x)
        ctx.save_for_backward(xc)
        ctx.repeat, ctx.eps, ctx.shape = repeat, eps, x.shape
        return sinkhorn_fwd_launch(xc, repeat, eps).view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (xc,) = ctx.saved_tensors
        n = xc.shape[-1]
        g = sinkhorn_bwd_launch(xc, grad.contiguous().view(-1, n, n), ctx.repeat, ctx.eps)
        return g.view(ctx.shape), None, None


def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-Knopp of every ``n x n`` matrix in ``x``.

    Args:
        x: fp32 ``(..., n, n)`` logits (any strides: made contiguous).
        repeat: number of column normalisations (``>= 1``): row softmax, ``+ eps``, a column normalisation, then
            ``repeat - 1`` (row, column) pairs.
        eps: added to every normalisation's denominator (and once after the softmax), positive.

    Returns:
        fp32 ``(..., n, n)``, every column summing to about 1.
    """
    check_tensor("x", x, dtypes=(torch.float32,))
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"x must be (..., n, n) with square last two dims, got shape {tuple(x.shape)}")
    check_device("x", x)
    if isinstance(repeat, bool) or not isinstance(repeat, int):
        raise TypeError(f"repeat must be an int, got {type(repeat).__name__}")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    eps = check_positive("eps", eps)
    if not records_graph(x):  # no graph to record: the launch alone
        return sinkhorn_fwd_launch(_flat(x), repeat, eps).view(x.shape)
    return MHCSinkhorn.apply(x, repeat, eps)
