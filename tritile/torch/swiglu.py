"""Pure-PyTorch references for the fused SwiGLU casts (``tile_kernels.torch.swiglu``).

Written from the math of ``spec/quant.md`` §3.8-§3.10.  Every step is one float32 operation rounded
to nearest even, in the order the kernels use, so the kernels match these references bit for bit:
``exp`` comes from ``tritile.torch._numerics.exp_f32`` and the one fused multiply-add of the backward
from ``fma_f32`` (fused on CUDA, unfused on the CPU, as the Triton kernels compute on each backend).

Forward, per element of row ``e`` and column ``j < H`` (``l = x[e, j]``, ``r = x[e, j + H]``)::

    clamp c (optional):  l = min(l, c);  r = min(max(r, -c), c)
    act = (l / (1 + exp(-l))) * r
    act = act * w_e            (w_e = topk_weights.flat[pos_to_token_topk[e]], 0 where the index < 0)

Clamping uses comparisons (``where(l > c, c, l)``), so a NaN stays NaN.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..utils import ceil_div
from ._numerics import exp_f32, fma_f32
from .cast import transform_sf

__all__ = ["swiglu_forward", "swiglu_backward"]


def _routing_weight(pos_to_token_topk: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                    num_rows: int, device) -> Optional[torch.Tensor]:
    """Per-row weight ``weights.flat[idx]``; 0 where idx < 0 or idx >= weights.numel()."""
    if pos_to_token_topk is None:
        return None
    flat = weights.reshape(-1).float()
    idx = pos_to_token_topk.reshape(-1).to(torch.int64)
    ok = (idx >= 0) & (idx < flat.numel())
    w = flat[idx.clamp(0, max(flat.numel() - 1, 0))] if flat.numel() else torch.zeros(num_rows, device=device)
    return torch.where(ok, w, torch.zeros((), dtype=torch.float32, device=device))


def _clamp(l: torch.Tensor, r: torch.Tensor, c: float):
    cf = torch.tensor(c, dtype=torch.float32, device=l.device)
    l = torch.where(l > cf, cf, l)
    r = torch.where(r > cf, cf, torch.where(r < -cf, -cf, r))
    return l, r


def swiglu_forward(x: torch.Tensor, pos_to_token_topk: Optional[torch.Tensor] = None,
                   topk_weights: Optional[torch.Tensor] = None, swiglu_clamp_value: Optional[float] = None,
                   clamped_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference SwiGLU forward ``act = silu(l) * r`` (optionally clamped and routing-weighted).

    Args:
        x: ``(E, 2H)`` float tensor (bf16 or fp32); ``l = x[:, :H]``, ``r = x[:, H:]`` read as float32.
        pos_to_token_topk: optional int32 ``(E,)`` flat index ``t*K + k`` into ``topk_weights``; -1 (or any
            index outside ``topk_weights``) gives weight 0.
        topk_weights: float32 ``(T, K)``; required with ``pos_to_token_topk``.
        swiglu_clamp_value: optional c: ``l = min(l, c)``, ``r`` clamped to ``[-c, c]``.
        clamped_count: optional int64 ``(3,)``, updated in place (``+=``) with ``#(l > c)``, ``#(r > c)``,
            ``#(r < -c)`` counted before clamping over all rows.

    Returns:
        float32 ``(E, H)``.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be 2D (E, 2H), got shape {tuple(x.shape)}")
    h = x.shape[1] // 2
    l = x[:, :h].float()
    r = x[:, h:].float()
    if swiglu_clamp_value is not None:
        c = float(swiglu_clamp_value)
        if clamped_count is not None:
            cf = torch.tensor(c, dtype=torch.float32, device=x.device)
            counts = torch.stack([(l > cf).sum(), (r > cf).sum(), (r < -cf).sum()]).to(clamped_count.dtype)
            clamped_count += counts.to(clamped_count.device)
        l, r = _clamp(l, r, c)
    act = (l / (1.0 + exp_f32(-l))) * r
    w = _routing_weight(pos_to_token_topk, topk_weights, x.shape[0], x.device)
    if w is not None:
        act = act * w[:, None]
    return act


def _dequant(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], num_per_channels: int) -> torch.Tensor:
    if isinstance(x, (tuple, list)):
        data, sf = x
        data = data.reshape(-1, data.shape[-1])
        q = data.float()
        k = q.shape[1]
        sf = transform_sf(sf.reshape(-1, sf.shape[-1]), ceil_div(k, num_per_channels)).float()
        sfe = sf.repeat_interleave(num_per_channels, dim=1)[:, :k]
        return q * sfe
    return x.reshape(-1, x.shape[-1]).float()


def swiglu_backward(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], grad_out: torch.Tensor,
                    weight: torch.Tensor, pos_to_token_topk: torch.Tensor, token_topk_to_pos: torch.Tensor,
                    num_per_channels: int, swiglu_clamp_value: Optional[float] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference SwiGLU backward with routing weights (``spec/quant.md`` §3.9).

    Per row e: ``w = weight.flat[pos_to_token_topk[e]]`` (0 where the index < 0); per column j < H with
    ``xf = f32(q[e, j] * sf[e, j/npc])`` and ``yf`` likewise at ``j + H`` (clamp flags ``cx = xf > c``,
    ``cy = |yf| > c`` taken before clamping)::

        t = 1 + exp(-xf);  s = 1 / t;  g = f32(grad_out)
        act = (xf / t) * yf;            gws = (g * w) * s
        out[e, j]       = act * w
        x_grad[e, j]    = cx ? +0 : (gws * yf) * fma(xf, 1 - s, 1)
        x_grad[e, j+H]  = cy ? +0 : gws * xf
        rowsum[e]       = sum_j g * act          (float32, summed in float64 here)
        weight_grad[t, k] = rowsum[token_topk_to_pos[t, k]], 0 where token_topk_to_pos[t, k] < 0

    Args:
        x: QuantTensor ``(data e4m3 (E, 2H), sf float32 (E, 2H/npc))`` (leading dims flattened), or a
            plain float ``(E, 2H)`` tensor.
        grad_out: bf16/fp32 ``(E, H)``.
        weight: float32 ``(T, K)``.
        pos_to_token_topk: int32 ``(E,)``.
        token_topk_to_pos: int32 ``(T, K)``.
        num_per_channels: npc of x's sf.
        swiglu_clamp_value: optional clamp c.

    Returns:
        ``(out float32 (E, H), x_grad float32 (E, 2H), weight_grad float32 (T, K))``.
    """
    xv = _dequant(x, num_per_channels)
    e_rows, h2 = xv.shape
    h = h2 // 2
    xf = xv[:, :h]
    yf = xv[:, h:]
    dev = xv.device
    g = grad_out.reshape(-1, h).float()
    w = _routing_weight(pos_to_token_topk, weight, e_rows, dev)[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    if swiglu_clamp_value is not None:
        cf = torch.tensor(float(swiglu_clamp_value), dtype=torch.float32, device=dev)
        cx = xf > cf
        cy = (yf > cf) | (yf < -cf)
        xf, yf = _clamp(xf, yf, float(swiglu_clamp_value))
    else:
        cx = cy = torch.zeros_like(xf, dtype=torch.bool)
    t = 1.0 + exp_f32(-xf)
    s = 1.0 / t
    act = (xf / t) * yf
    gws = (g * w) * s
    out = act * w
    one = torch.ones((), dtype=torch.float32, device=dev)
    dxx = torch.where(cx, zero, (gws * yf) * fma_f32(xf, 1.0 - s, one.expand_as(xf)))
    dxy = torch.where(cy, zero, gws * xf)
    x_grad = torch.cat([dxx, dxy], dim=1)
    rowsum = (g.double() * act.double()).sum(dim=1).float()
    ttp = token_topk_to_pos.to(torch.int64)
    ok = (ttp >= 0) & (ttp < e_rows)
    if e_rows:
        wg = torch.where(ok, rowsum[ttp.clamp(0, e_rows - 1)], zero)
    else:
        wg = torch.zeros(ttp.shape, dtype=torch.float32, device=dev)
    return out, x_grad, wg.reshape(token_topk_to_pos.shape).float()
