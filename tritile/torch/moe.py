"""References for the MoE helper ops (names of ``tile_kernels.torch.moe``)."""

from __future__ import annotations

import torch

__all__ = ["normalize_weight", "aux_fi", "group_count", "mask_indices_by_tp", "inplace_unique_group_indices"]


def normalize_weight(topk_weights: torch.Tensor):
    """``(denominator (T,), normalized (T, K))``: denominator = ((1e-20 + w_0) + w_1) + ... in float32,
    left to right; normalized = w / denominator (IEEE division)."""
    w = topk_weights.float()
    denom = torch.full((w.size(0),), 1e-20, dtype=torch.float32, device=w.device)
    for k in range(w.size(1)):
        denom = denom + w[:, k]
    return denom, w / denom.unsqueeze(1)


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """``f[e] = count_e * E / (T * num_aux_topk)`` (float32); T counts every row; -1 entries ignored."""
    flat = topk_idx.flatten()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)[:num_experts]
    num_tokens = topk_idx.size(0)
    if num_tokens == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    num = (counts * num_experts).float()
    den = torch.tensor(float(num_tokens * num_aux_topk), dtype=torch.float32, device=topk_idx.device)
    return num / den


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """int32 ``(G,)`` histogram of the non-negative entries of ``group_idx``."""
    flat = group_idx.flatten()
    return torch.bincount(flat[flat >= 0], minlength=num_groups)[:num_groups].int()


def mask_indices_by_tp(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int):
    """Keep the experts of the GPUs ``r`` with ``r % num_tp_ranks == tp_rank`` and renumber them densely:
    g -> (g // P // R) * P + g % P with P = n // num_ep_ranks; everything else (and g < 0) -> -1."""
    per_rank = n // num_ep_ranks
    valid = indices >= 0
    g = torch.where(valid, indices, 0)
    q = g // per_rank
    keep = valid & (q % num_tp_ranks == tp_rank)
    return torch.where(keep, (q // num_tp_ranks) * per_rank + g % per_rank, -1).to(indices.dtype)


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """In place: an entry ``>= 0`` equal to an earlier entry of its row becomes -1 (the first stays).
    Negative entries are never changed.  ``num_groups`` is unused (API consistency)."""
    g = group_indices
    k = g.size(1)
    if k <= 1 or g.size(0) == 0:
        return None
    earlier = torch.ones(k, k, dtype=torch.bool, device=g.device).tril(-1)  # [j, i]: i < j
    dup = ((g.unsqueeze(2) == g.unsqueeze(1)) & earlier).any(dim=2) & (g >= 0)
    g.masked_fill_(dup, -1)
    return None
