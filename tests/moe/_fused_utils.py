"""Shared inputs for the fused-mapping tests (get_fused_mapping, expand_to_fused, reduce_fused, MoE layer).

``generate_moe_params`` / ``generate_topk_idx`` follow TileKernels' generator: (E_total, ep) in
{(72, 8), (256, 8), (256, 64)} x K in {2, 6, 8, 9}; the routing of ``num_send_tokens * ep`` senders is
drawn, ids outside the local expert range become -1 and rows without a local expert are dropped (the
receiving side of an EP dispatch).  On the CPU the senders are scaled down (29 per rank: about 100-250
received rows, an odd count) so the interpreter stays fast.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from tritile.testing.generator import generate_moe_params as _generate_moe_params
from tritile.testing.generator import generate_num_sms, generate_topk_idx  # noqa: F401


def generate_moe_params(is_benchmark: bool = False) -> List[Dict[str, int]]:
    return _generate_moe_params(is_benchmark, cpu_num_send_tokens=29, cpu_topks=(2, 6, 8, 9))


def moe_param_id(p: Dict[str, int]) -> str:
    return f"K{p['num_topk']}-E{p['num_experts']}-ep{p['num_ep_ranks']}"


def ref_fused_mapping(topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int,
                      sync: bool = True):
    """Stable-sort reference of ``get_fused_mapping`` (canonical order: ascending t*K+k inside each expert)."""
    num_tokens, num_topk = topk_idx.shape
    dev = topk_idx.device
    flat = topk_idx.flatten()
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)[:num_experts]
    aligned = (counts + alignment - 1) // alignment * alignment
    end = torch.cumsum(aligned, 0)
    start = end - aligned
    n = int(aligned.sum()) if sync else num_expanded_tokens
    pos_to = [torch.full((n,), -1, dtype=torch.int32, device=dev) for _ in range(3)]
    t2p = torch.full((num_tokens * num_topk,), -1, dtype=torch.int32, device=dev)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices[: int(valid.sum())]
    experts = key[order]
    rank = torch.arange(order.numel(), device=dev) - torch.searchsorted(experts, experts)
    pos = start[experts] + rank
    ok = pos < n
    pos, order, experts = pos[ok], order[ok], experts[ok]
    pos_to[0][pos] = experts.int()
    pos_to[1][pos] = (order // num_topk).int()
    pos_to[2][pos] = order.int()
    t2p[order] = pos.int()
    per_expert = aligned.int()
    return (*pos_to, t2p.view(num_tokens, num_topk), start.int(), end.int(), per_expert,
            per_expert.tolist() if sync else [])
