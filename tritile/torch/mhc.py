"""Pure-PyTorch references of the mHC (Manifold HyperConnection) ops (``tile_kernels.torch.mhc``).

Written from the math of the mHC spec (residual ``R`` of ``n`` streams, ``mixes`` rows of ``n3 = n (n + 2)``
values: pre logits, post logits, comb logits ``[i * n + o]``).  All functions are plain differentiable torch;
the tests get the reference gradients through autograd.  Sums over the stream axis of Sinkhorn run left to
right, as the kernels add them; ``exp`` computes as the kernels do on each backend (``_numerics.exp_f32``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._numerics import exp_f32

__all__ = [
    "expand_to_mhc_ref",
    "mhc_head_compute_mix_ref",
    "mhc_post_ref",
    "mhc_pre_apply_mix_ref",
    "mhc_pre_norm_fn_ref",
    "mhc_pre_split_mixes_ref",
    "sinkhorn_normalize_ref",
]


class _Exp(torch.autograd.Function):
    """``exp_f32`` with its derivative (``g * exp(x)``)."""

    @staticmethod
    def forward(ctx, x):
        y = exp_f32(x).to(x.device)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` added left to right, the dimension kept (size 1)."""
    s = x.narrow(dim, 0, 1)
    for k in range(1, x.size(dim)):
        s = s + x.narrow(dim, k, 1)
    return s


def expand_to_mhc_ref(hidden: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    """``hidden (..., H)`` copied to every stream: ``(..., mhc_mult, H)``, same dtype, contiguous."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], mhc_mult, hidden.shape[-1]).contiguous()


def sinkhorn_normalize_ref(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-Knopp on the last two dims of fp32 ``x (..., n, n)``: row softmax, ``+ eps``, a column
    normalisation, then ``repeat - 1`` (row, column) pairs; every normalisation divides by ``sum + eps``.
    ``repeat = 0`` behaves like 1.  Returns fp32 of ``x``'s shape."""
    x = x.float()
    e = _Exp.apply(x - x.amax(dim=-1, keepdim=True).detach())
    a = e / _ordered_sum(e, -1)
    a = a + eps
    a = a / (_ordered_sum(a, -2) + eps)
    for _ in range(max(repeat, 1) - 1):
        a = a / (_ordered_sum(a, -1) + eps)
        a = a / (_ordered_sum(a, -2) + eps)
    return a


def mhc_pre_split_mixes_ref(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                            mhc_mult: int, mhc_post_mult_value: float,
                            mhc_pre_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fp32 ``input_mixes (B, S, n3)`` with ``z = mixes * scale[min(2, j // n)] + base``.

    Returns fp32 ``pre = sigmoid(z[:n]) + pre_eps`` ``(B, S, n, 1)``, ``post = post_mult * sigmoid(z[n:2n])``
    ``(B, S, n, 1)`` and the raw comb logits ``z[2n:]`` as ``(B, S, n, n)`` (``[i, o]``)."""
    n = mhc_mult
    b, s, _ = input_mixes.shape
    scale = torch.cat([mhc_scale[0:1].expand(n), mhc_scale[1:2].expand(n), mhc_scale[2:3].expand(n * n)])
    z = input_mixes * scale + mhc_base
    pre = torch.sigmoid(z[..., :n]) + mhc_pre_eps
    post = torch.sigmoid(z[..., n:2 * n]) * mhc_post_mult_value
    comb = z[..., 2 * n:]
    return pre.view(b, s, n, 1), post.view(b, s, n, 1), comb.reshape(b, s, n, n)


def mhc_pre_apply_mix_ref(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``sum_m mix[..., m, 0] * x[..., m, :]`` in fp32, then bf16: bf16 ``x (..., n, H)``, fp32 ``mix (..., n, 1)``
    -> bf16 ``(..., H)``."""
    return (x.float() * mix).sum(-2).bfloat16()


def mhc_post_ref(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                 comb_res_mix: torch.Tensor) -> torch.Tensor:
    """``out[..., o, :] = post[..., o, 0] * x + sum_i comb[..., i, o] * residual[..., i, :]`` in fp32, then bf16.

    bf16 ``x (B, S, H)``, bf16 ``residual (B, S, n, H)``, fp32 ``post_layer_mix (B, S, n, 1)``, fp32
    ``comb_res_mix (B, S, n, n)`` -> bf16 ``(B, S, n, H)``."""
    term = post_layer_mix * x.float().unsqueeze(-2)
    mix = torch.einsum("bsio,bsih->bsoh", comb_res_mix, residual.float())
    return (term + mix).bfloat16()


def mhc_head_compute_mix_ref(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                             mhc_pre_eps: float) -> torch.Tensor:
    """fp32 ``sigmoid(input_mix * scale + base) + pre_eps`` for ``input_mix (B, S, n)``, ``scale (1,)``,
    ``base (n,)``."""
    return torch.sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps


def mhc_pre_norm_fn_ref(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: Optional[torch.Tensor],
                        mhc_norm_eps: float) -> torch.Tensor:
    """RMS-normalised projection: bf16 ``residual (a, b, n, H)`` flattened to ``x (a, b, D)``, fp32
    ``mhc_fn (n3, D)`` (times ``mhc_norm_weight (D,)`` per column when given) -> fp32
    ``(x @ fn.T) * rsqrt(mean(x^2) + eps)`` of shape ``(a, b, n3)``."""
    a, b, n, h = residual.shape
    x = residual.float().reshape(a, b, n * h)
    fn = mhc_fn if mhc_norm_weight is None else mhc_fn * mhc_norm_weight
    p = torch.einsum("abd,jd->abj", x, fn)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + mhc_norm_eps)
    return p * r
