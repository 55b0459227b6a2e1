"""References for the MoE gates (names of ``tile_kernels.torch.topk``)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..moe.scoring import ScoringFunc
from ._numerics import exp_f32

__all__ = ["stable_topk", "topk_sum_and_topk_group_idx", "top2_sum_gate"]


def stable_topk(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of the ``num_topk`` largest scores per row, largest first, ties -> smaller index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :num_topk].contiguous()


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_group_sum_topk: int, num_topk_groups: int) -> torch.Tensor:
    """``scores (T, G, E/G)`` -> the ``num_topk_groups`` groups with the largest sum of their
    ``num_group_sum_topk`` (1 or 2) best scores, best first, ties -> smaller group index; int64 ``(T, Gk)``."""
    group_scores = scores.topk(num_group_sum_topk, dim=-1, sorted=False).values.sum(-1)
    return stable_topk(group_scores, num_topk_groups)


# ---- activations, computed the way the kernels compute them on each backend ------------------
def _log_f32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``log``: numpy's on the CPU (what the interpreter computes), torch's on CUDA."""
    if x.device.type == "cpu":
        with np.errstate(divide="ignore", invalid="ignore"):
            return torch.from_numpy(np.log(x.float().numpy())).reshape(x.shape)
    return torch.log(x.float())


def _sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt: numpy's on the CPU (torch's CPU sqrt is not always correctly
    rounded: 18% of rand()*3 differ by an ulp [measured, torch 2.13]), torch's on CUDA (IEEE)."""
    if x.device.type == "cpu":
        with np.errstate(invalid="ignore"):
            return torch.from_numpy(np.sqrt(x.float().numpy())).reshape(x.shape)
    return torch.sqrt(x.float())


def _log1p_f32(y: torch.Tensor) -> torch.Tensor:
    if y.device.type == "cpu":  # the interpreter's compensated log1p (see tritile.moe.common)
        u = 1.0 + y
        return torch.where(u == 1.0, y, _log_f32(u) * (y / (u - 1.0)))
    return torch.log1p(y)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + exp_f32(-x))


def _sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    sp = torch.where(x > 20.0, x, _log1p_f32(exp_f32(torch.clamp(x, max=20.0))))
    return _sqrt_f32(sp)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    e = exp_f32(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def top2_sum_gate(logits: torch.Tensor, bias: torch.Tensor, num_topk: int, num_topk_groups: int, num_groups: int,
                  use_shared_as_routed: bool, num_shared_experts: int, routed_scaling_factor: float,
                  ep_rank: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int, scoring_func: str,
                  mask: Optional[torch.Tensor] = None, fix_routing_mask: Optional[torch.Tensor] = None,
                  to_physical_map: Optional[torch.Tensor] = None, logical_count: Optional[torch.Tensor] = None,
                  unmapped_topk_idx: Optional[torch.Tensor] = None):
    """Reference of ``tritile.moe.top2_sum_gate`` (see its docstring and spec/moe.md §3.10).

    Scores use the same float32 formulas as the kernel (``exp``/``log`` per backend, IEEE division), so
    the selection is exact; the denominator is the kernel's sequential ``1e-20 + w_0 + ... + w_{K-1}``.
    ``unmapped_topk_idx`` is updated in place.  Returns ``(topk_idx int64 (T, K+S), topk_weights fp32 (T, K+S))``.
    """
    func = ScoringFunc.from_str(scoring_func)
    num_tokens, num_experts = logits.shape
    device = logits.device
    if not use_shared_as_routed:
        num_shared_experts = 0
    k, s_ = num_topk, num_shared_experts
    logits = logits.float()
    if func == ScoringFunc.SIGMOID:
        scores = _sigmoid(logits)
    elif func == ScoringFunc.SQRTSOFTPLUS:
        scores = _sqrtsoftplus(logits)
    elif func == ScoringFunc.SOFTMAX:
        scores = _softmax(logits)
    else:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported by top2_sum_gate")
    rank = (logits if func == ScoringFunc.SOFTMAX else scores) + bias.unsqueeze(0)

    if num_groups != num_topk_groups:
        group_idx = topk_sum_and_topk_group_idx(rank.view(num_tokens, num_groups, -1), 2, num_topk_groups)
        keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=device).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
        rank = rank.masked_fill(~keep, float("-inf"))
    sel = stable_topk(rank, k)
    if fix_routing_mask is not None:
        sel = torch.where(fix_routing_mask.view(-1, 1), unmapped_topk_idx, sel)
    w = scores.gather(1, sel)
    denom = torch.full((num_tokens,), 1e-20, dtype=torch.float32, device=device)
    for j in range(k):
        denom = denom + w[:, j]
    w = (w / denom.unsqueeze(1)) * routed_scaling_factor

    t_idx = torch.arange(num_tokens, dtype=torch.int64, device=device)
    logical = torch.cat([sel, (num_experts + torch.arange(s_, device=device)).expand(num_tokens, s_)], dim=1)
    weights = torch.cat([w, torch.ones(num_tokens, s_, dtype=torch.float32, device=device)], dim=1)
    num_extra = 0
    if to_physical_map is not None:
        num_extra = to_physical_map.size(1) - 1
        cnt = logical_count.long()[logical]
        dup = (ep_rank + t_idx.unsqueeze(1) * 23333) % cnt
        idx = to_physical_map.long()[logical, dup]
    else:
        idx = logical.clone()
    per_rank = (num_experts + num_extra) // num_ep_ranks
    valid = idx >= 0
    safe = torch.where(valid, idx, 0)
    q = safe // per_rank
    keep = valid & (q % num_tp_ranks == tp_rank)
    idx = torch.where(keep, (q // num_tp_ranks) * per_rank + safe % per_rank, -1)

    if mask is not None:
        routed = mask.view(-1, 1).to(device)
        idx = torch.where(routed, idx, -1)
        weights = torch.where(routed, weights, 0.0)
        sel = torch.where(routed, sel, -1)
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(sel)
    return idx, weights
