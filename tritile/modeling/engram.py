"""``EngramGateFn`` / ``engram_gate``: the Engram gate as an autograd function (``tile_kernels.modeling.engram``).

Forward: ``fused_weight`` + ``engram_gate_fwd`` (saving for backward).  Backward: ``engram_gate_bwd`` +
``grad_w_reduce``, accumulating the weight gradients into ``weight.main_grad`` when the weight has one
(Megatron style; the weight then gets ``None`` as its gradient), else into new float32 buffers.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..engram import engram_gate_bwd, engram_gate_fwd, fused_weight, grad_w_reduce
from ..runtime import check_tensor

__all__ = ["EngramGateFn", "engram_gate"]


def _view(name: str, t: torch.Tensor, shape) -> torch.Tensor:
    try:
        return t.view(shape)
    except RuntimeError as e:
        raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} cannot be viewed as "
                         f"{tuple(shape)} without a copy: {e}") from None


def _grad_buffer(name: str, weight: torch.Tensor):
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device), False
    check_tensor(f"{name}.main_grad", main_grad, dtypes=(torch.float32,))
    if main_grad.shape != weight.shape:
        raise ValueError(f"{name}.main_grad must have shape {tuple(weight.shape)}, got {tuple(main_grad.shape)}")
    return main_grad, True


class EngramGateFn(torch.autograd.Function):
    """``out = x + sigmoid(signed_sqrt(<RMSNorm(x) * wh, RMSNorm(k) * we> / sqrt(H))) * v`` per head.

    ``forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps)`` (note: clamp_value
    before eps):

    - hidden_states: (..., hc_mult, hidden_size), bfloat16;
    - k: (..., hc_mult, hidden_size), bfloat16 (may be a strided slice; unit stride along hidden_size);
    - v: (..., hidden_size), bfloat16;
    - weight_hidden, weight_embed: (hc_mult, hidden_size), bfloat16;
    - returns the output, bfloat16, shape of hidden_states.

    Leading dimensions are flattened with ``view`` (they must be view-compatible).  Backward always computes
    every gradient; the weights' gradients are float32 (autograd casts them to the weights' dtype), or
    accumulated into ``weight.main_grad`` (float32, in place) with ``None`` returned when that attribute is set.
    """

    @staticmethod
    def forward(ctx: Any, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_hidden: torch.Tensor,
                weight_embed: torch.Tensor, clamp_value: float, eps: float) -> torch.Tensor:
        check_tensor("hidden_states", hidden_states, dtypes=(torch.bfloat16,))
        if hidden_states.dim() < 2:
            raise ValueError(f"hidden_states must be (..., hc_mult, hidden_size), "
                             f"got shape {tuple(hidden_states.shape)}")
        check_tensor("weight_hidden", weight_hidden, dtypes=(torch.bfloat16,), ndim=2)
        check_tensor("k", k, dtypes=(torch.bfloat16,))
        check_tensor("v", v, dtypes=(torch.bfloat16,))
        origin_shape = hidden_states.shape
        hc, H = origin_shape[-2], origin_shape[-1]
        if tuple(k.shape) != tuple(origin_shape):
            raise ValueError(f"k must have the shape of hidden_states {tuple(origin_shape)}, got {tuple(k.shape)}")
        if tuple(v.shape) != tuple(origin_shape[:-2]) + (H,):
            raise ValueError(f"v must have shape {tuple(origin_shape[:-2]) + (H,)}, got {tuple(v.shape)}")
        for name, w in (("weight_hidden", weight_hidden), ("weight_embed", weight_embed)):
            check_tensor(name, w, dtypes=(torch.bfloat16,), ndim=2)
            if tuple(w.shape) != (hc, H):
                raise ValueError(f"{name} must have shape (hc_mult, hidden_size) = {(hc, H)} (from hidden_states), "
                                 f"got {tuple(w.shape)}")
        x2 = _view("hidden_states", hidden_states, (-1, hc, H))
        k2 = _view("k", k, (-1, hc, H))
        v2 = _view("v", v, (-1, H))
        wf = fused_weight(weight_hidden, weight_embed)
        out, dot, gate, rstd_x, rstd_k = engram_gate_fwd(x2, k2, v2, wf, eps, clamp_value, True)
        ctx.save_for_backward(x2, k2, v2, weight_hidden, weight_embed, wf, dot, gate, rstd_x, rstd_k)
        ctx.clamp_value = clamp_value
        ctx.origin_shape = origin_shape
        return out.view(origin_shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x2, k2, v2, wh, we, wf, dot, gate, rstd_x, rstd_k = ctx.saved_tensors
        origin_shape = ctx.origin_shape
        hc, H = origin_shape[-2], origin_shape[-1]
        go = grad_output.reshape(-1, hc, H)
        if H > 1 and go.stride(-1) != 1:  # e.g. the stride-0 gradient of a .sum() loss
            go = go.contiguous()
        grad_x, grad_k, grad_v, grad_w_partial = engram_gate_bwd(go, x2, k2, v2, wf, dot, gate, rstd_x, rstd_k,
                                                                 ctx.clamp_value)
        gwh, wh_main = _grad_buffer("weight_hidden", wh)
        gwe, we_main = _grad_buffer("weight_embed", we)
        grad_w_reduce(grad_w_partial, wh, we, gwh, gwe)
        return (grad_x.view(origin_shape), grad_k.view(origin_shape), grad_v.view(tuple(origin_shape[:-2]) + (H,)),
                None if wh_main else gwh, None if we_main else gwe, None, None)


engram_gate = EngramGateFn.apply
