"""PyTorch references for ``tritile.moe.expand_to_fused`` / ``expand_to_fused_with_sf``.

Pure copies done on byte views, so any dtype (bf16, fp8, int) is reproduced bit for bit on any device.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..utils import align

__all__ = ["expand_to_fused", "expand_to_fused_with_sf"]


def _scatter_rows(src: torch.Tensor, token_topk_to_pos: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``out[pos[t, k]] = src[t]`` for every ``pos >= 0``; all other rows are zero (byte-exact)."""
    num_tokens, num_topk = token_topk_to_pos.shape
    row_bytes = src.shape[1] * src.element_size()
    src_b = src.contiguous().view(torch.uint8).reshape(num_tokens, row_bytes)
    out_b = torch.zeros((num_rows, row_bytes), dtype=torch.uint8, device=src.device)
    pos = token_topk_to_pos.long()
    valid = pos >= 0
    tok = torch.arange(num_tokens, device=src.device)[:, None].expand(num_tokens, num_topk)
    out_b[pos[valid]] = src_b[tok[valid]]
    return out_b


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """Reference: ``out[pos[t, k]] = x[t]`` for ``pos >= 0``; every other row of ``out (N, H)`` is zero.

    x: ``(T, H)`` any dtype; token_topk_to_pos: int32 ``(T, K)``; pos_to_expert: int32 ``(N,)`` (only its
    length is used here).
    """
    num_expanded = pos_to_expert.shape[0]
    out_b = _scatter_rows(x, token_topk_to_pos, num_expanded)
    return out_b.view(x.dtype).reshape(num_expanded, x.shape[1])


def expand_to_fused_with_sf(x: Tuple[torch.Tensor, torch.Tensor], num_per_channels: int,
                            token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor,
                            use_tma_aligned_col_major_sf: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``expand_to_fused_with_sf``: data as ``expand_to_fused``, scale rows the same way.

    ``x = (data (T, H), x_sf (T, H_sf))``.  The sf output is ``(N, H_sf)`` row-major, or with
    ``use_tma_aligned_col_major_sf`` the ``[:, :N].T`` view of a zero-filled ``(H_sf, align(N, 4))`` storage
    (strides ``(1, align(N, 4))``).  ``num_per_channels`` is not needed here (the op validates it).
    """
    data, x_sf = x
    num_expanded = pos_to_expert.shape[0]
    hidden_sf = x_sf.shape[1]
    out = expand_to_fused(data, token_topk_to_pos, pos_to_expert)
    sf_rows = _scatter_rows(x_sf, token_topk_to_pos, num_expanded).view(x_sf.dtype).reshape(num_expanded, hidden_sf)
    if use_tma_aligned_col_major_sf:
        storage = torch.zeros((hidden_sf, align(num_expanded, 4)), dtype=x_sf.dtype, device=x_sf.device)
        storage[:, :num_expanded] = sf_rows.T
        sf_out = storage[:, :num_expanded].T
    else:
        sf_out = sf_rows
    return out, sf_out
