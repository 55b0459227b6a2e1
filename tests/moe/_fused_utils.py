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

from tritile.config import get_device_num_sms
from tritile.testing import full_test, is_gpu_run


def generate_moe_params(is_benchmark: bool = False) -> List[Dict[str, int]]:
    send = 4001 if is_gpu_run() else 29
    topks = [2, 6, 8, 9]
    pairs = [(72, 8), (256, 8), (256, 64)]
    params = [dict(num_send_tokens=send, num_topk=k, num_experts=e // ep, num_ep_ranks=ep)
              for k in topks for e, ep in pairs]
    if full_test() and not is_benchmark:
        params.insert(0, dict(num_send_tokens=0, num_topk=1, num_experts=1, num_ep_ranks=1))
    return params


def moe_param_id(p: Dict[str, int]) -> str:
    return f"K{p['num_topk']}-E{p['num_experts']}-ep{p['num_ep_ranks']}"


def generate_topk_idx(params: Dict[str, int], device=None) -> torch.Tensor:
    """int64 ``(T', K)``: distinct local expert ids per row, -1 elsewhere, every row with >= 1 valid slot."""
    from tritile.testing import get_device

    device = device if device is not None else get_device()
    ep = params["num_ep_ranks"]
    e_local = params["num_experts"]
    k = params["num_topk"]
    senders = params["num_send_tokens"] * ep
    scores = torch.rand((senders, e_local * ep), device=device).to(torch.bfloat16)
    idx = scores.float().topk(k, dim=1, sorted=False).indices
    idx = torch.where(idx < e_local, idx, torch.full_like(idx, -1))
    return idx[(idx >= 0).any(dim=1)].contiguous()


def generate_num_sms() -> List[int]:
    """Two launch hints (TileKernels: device - 20 and device); results must not depend on them."""
    n = get_device_num_sms()
    return [max(1, n - 20), n] if is_gpu_run() else [1, 3]


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
