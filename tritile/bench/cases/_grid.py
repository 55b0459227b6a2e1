"""TileKernels' MoE benchmark grid (``generate_moe_params(is_benchmark=True)``) for ``python -m tritile bench --grid``.

Every routing op is benchmarked at ``num_topk`` in {2, 6, 8, 9} x ``(E_total, ep)`` in {(72, 8), (256, 8), (256, 64)}
(local experts ``E_total // ep``), with 4001 senders per rank before the rows without a local expert are dropped, times
the op's own extra parameters.  TileKernels draws the routing at random, so the received token count varies from run
to run: where a TileKernels figure exists for the shape (``tritile/data/tilekernels-h200*.json``) its token count is
used, so that the two figures compare the same shape; elsewhere the count of one seeded draw of TileKernels'
routing.  On the CPU every point keeps its
structure with 9 senders per rank (a correctness pass only: 12-110 tokens).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from tritile.testing.generator import generate_topk_idx_rows

#: ``(num_topk, E_total, num_ep_ranks)`` in TileKernels' order.
GRID: Tuple[Tuple[int, int, int], ...] = tuple((k, e, ep) for k in (2, 6, 8, 9) for e, ep in ((72, 8), (256, 8),
                                                                                            (256, 64)))
#: Senders per rank (TileKernels' benchmark; the CPU pass scales it down).
SEND_TOKENS = {"cuda": 4001, "cpu": 9}


def points(quick: bool, grid: bool, default: Tuple[int, int, int]) -> List[Tuple[int, int, int]]:
    """``(num_topk, num_experts (local), num_ep_ranks)`` to benchmark: the whole grid, else ``default``'s point."""
    if grid and not quick:
        return [(k, e // ep, ep) for k, e, ep in GRID]
    return [default]


@functools.lru_cache(maxsize=1)
def _anchor_records() -> Tuple[Dict[str, Any], ...]:
    from tritile.bench.runner import load_anchors

    return tuple(load_anchors()["records"])


def find_record(kernel: str, **params) -> Optional[Dict[str, Any]]:
    """The first TileKernels record of ``kernel`` whose parameters include ``params`` (None if there is none)."""
    for rec in _anchor_records():
        if rec["kernel"] == kernel and all(rec["params"].get(k) == v for k, v in params.items()):
            return rec
    return None


@functools.lru_cache(maxsize=64)
def received_tokens(num_send_tokens: int, num_topk: int, num_experts: int, num_ep_ranks: int,
                    device: str = "cpu") -> int:
    """Rows received by one rank in TileKernels' draw (``generate_topk_idx``: bf16 ``rand`` scores of
    ``num_send_tokens * ep`` senders over ``E * ep`` experts, their top ``num_topk``, rows keeping a local expert),
    drawn once with a fixed seed on ``device`` (on the GPU, the same torch kernels as TileKernels' draw: how bf16
    ties are broken moves the count by a few percent, e.g. 17747 rows drawn on the CPU against TileKernels' 18711
    at K = 6, E = 32, ep = 8)."""
    g = torch.Generator(device=device)
    g.manual_seed(0)
    total = num_experts * num_ep_ranks
    kept = 0
    for start in range(0, num_send_tokens * num_ep_ranks, 32768):  # in slices: bounded memory
        n = min(32768, num_send_tokens * num_ep_ranks - start)
        scores = torch.rand((n, total), generator=g, device=device).to(torch.bfloat16)
        idx = scores.topk(num_topk, dim=1, sorted=False).indices
        kept += int((idx < num_experts).any(dim=1).sum())
    return max(1, kept)


def num_tokens(device: torch.device, kernel: str, num_topk: int, num_experts: int, num_ep_ranks: int,
               **match) -> Tuple[int, Optional[Dict[str, Any]]]:
    """(token count, TileKernels' record or None) of a grid point.  ``match``: more parameters the record must have."""
    if device.type != "cuda":
        return received_tokens(SEND_TOKENS["cpu"], num_topk, num_experts, num_ep_ranks), None
    rec = find_record(kernel, num_topk=num_topk, num_experts=num_experts, num_ep_ranks=num_ep_ranks, **match)
    if rec is not None:
        return rec["params"]["num_tokens"], rec
    return received_tokens(SEND_TOKENS["cuda"], num_topk, num_experts, num_ep_ranks, "cuda"), None


def topk_idx(device: torch.device, num_tokens_: int, num_topk: int, num_experts: int, num_ep_ranks: int):
    """int64 ``(num_tokens_, num_topk)`` EP-receive routing (reproducible; see ``generate_topk_idx_rows``)."""
    return generate_topk_idx_rows(num_tokens_, num_topk, num_experts, num_ep_ranks, device)

