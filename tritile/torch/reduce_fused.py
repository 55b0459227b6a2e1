"""PyTorch reference for ``tritile.moe.reduce_fused``.

Per token, slots ``k = 0..K-1`` in order: ``acc = fma(x[pos], s, acc)`` with ``s = w[t, k] (* x_sf[pos])``.
The kernel's ``tl.fma`` is one rounding on GPUs and two under the CPU interpreter (numpy), so the
reference fuses on CUDA (exactly, through float64 with round-to-odd) and does not fuse on the CPU: on
each backend it is bit-exact against the kernel.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._numerics import fma_f32

__all__ = ["reduce_fused"]


def reduce_fused(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], topk_weights: Optional[torch.Tensor],
                 token_topk_to_pos: torch.Tensor, fp8_format: str = "", sf: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """Reference: ``out[t] = cast(sf * sum_k fma-accumulated x[pos[t, k]] * w[t, k] * x_sf[pos[t, k]])``.

    x: ``(N, H)`` float32/bfloat16, or ``(x, x_sf)`` with x_sf float32 ``(N,)``; topk_weights: float32
    ``(T, K)`` or None; token_topk_to_pos: int32 ``(T, K)`` (``-1`` skipped); fp8_format ``''`` (output
    dtype = x.dtype) or ``'e4m3'``; sf: float32 ``(1,)`` (fp8 output only).  Returns ``(T, H)``.
    """
    x_sf = None
    if isinstance(x, tuple):
        x, x_sf = x
    num_tokens, num_topk = token_topk_to_pos.shape
    acc = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    for k in range(num_topk if x.shape[0] > 0 else 0):  # no rows: every slot is -1
        pos = token_topk_to_pos[:, k].long()
        valid = pos >= 0
        pc = pos.clamp(min=0)
        s = topk_weights[:, k].float() if topk_weights is not None else \
            torch.ones(num_tokens, dtype=torch.float32, device=x.device)
        if x_sf is not None:
            s = s * x_sf[pc].float()
        new = fma_f32(x[pc].float(), s[:, None], acc)
        acc = torch.where(valid[:, None], new, acc)
    if sf is not None:
        acc = acc * sf.float()[0]
    if fp8_format == "e4m3":
        return acc.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return acc.to(x.dtype)
