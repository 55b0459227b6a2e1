"""TileKernels' benchmark grids (``generate_test_params(is_benchmark=True)`` of its tests) for ``python -m tritile
bench --grid``, shared by the case files: the MoE routing points and their token counts, the quant ops' sizes and sf
configurations, and the MoE inputs of the fused casts.

MoE: every routing op is benchmarked at ``num_topk`` in {2, 6, 8, 9} x ``(E_total, ep)`` in {(72, 8), (256, 8), (256,
64)} (local experts ``E_total // ep``), with 4001 senders per rank before the rows without a local expert are dropped,
times the op's own extra parameters.  TileKernels draws the routing at random, so the received token count varies from
run to run: where a TileKernels figure exists for the shape (``tritile/data/tilekernels-h200*.json``) its token count
is used, so that the two figures compare the same shape; elsewhere the count of one seeded draw of TileKernels'
routing.  On the CPU every point keeps its structure with 9 senders per rank (a correctness pass only: 12-110 tokens).

Quant: TileKernels' sizes (``generate_num_tokens`` -> 4001 / 8001 aligned, ``generate_hidden_sizes`` -> 576 ... 7168
filtered by an alignment, ``generate_moe_params`` -> 12 routing points).  CPU: the same structure (every flag,
format, block and npc of the grid) at tiny sizes, a correctness pass only: 33 tokens (aligned like 4001: a partial
last block), hidden 192 and 576 (partial last 128-groups; npc K stays apart from 32 / 64 / 128), one MoE point at
9 senders per rank.
"""


from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from tritile.testing.generator import generate_topk_idx_rows
from tritile.utils import align

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


# ---------------------------------------------------------------------------------------- quant
#: The two sf configurations of TileKernels' tests, ``(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)``;
#: the benchmark grids that filter on them keep the second (packed).
CONFIGS: Tuple[Tuple[bool, bool, bool], ...] = ((False, True, False), (True, True, True))
PACKED = CONFIGS[1]

_TOKENS = {"cuda": (4001, 8001), "cpu": (33,)}
_HIDDEN = {"cuda": (576, 2048, 2560, 3072, 4096, 6144, 7168), "cpu": (192, 576)}


def on(quick: bool, grid: bool) -> bool:
    """Whether a generator yields the whole grid (``--grid`` without ``--quick``)."""
    return grid and not quick


def _kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def token_counts(device: torch.device, alignment: int = 1) -> List[int]:
    """``generate_num_tokens(alignment, is_benchmark=True)``: [4001, 8001] aligned (CPU: [33] aligned)."""
    return [align(m, alignment) for m in _TOKENS[_kind(device)]]


def hidden_sizes(device: torch.device, align_to: int = 64, cpu: Optional[Sequence[int]] = None) -> List[int]:
    """``generate_hidden_sizes(align_to)`` (CPU: ``cpu`` if given, else the small sizes that are multiples of
    ``align_to``, else ``[align_to]``)."""
    if device.type != "cuda" and cpu is not None:
        return list(cpu)
    sizes = [h for h in _HIDDEN[_kind(device)] if h % align_to == 0]
    return sizes or [align_to]


def shapes(device: torch.device, alignment: int = 1, align_to: int = 64) -> List[Tuple[int, int]]:
    """``(num_tokens, hidden)`` in TileKernels' order: tokens outer, hidden inner."""
    return [(m, k) for m in token_counts(device, alignment) for k in hidden_sizes(device, align_to)]


def sf_flags(config: Tuple[bool, bool, bool], prefix: str = "") -> Dict[str, bool]:
    """A config's flags under TileKernels' parameter names (``prefix`` e.g. ``"in_"``)."""
    col, rnd, packed = config
    return {f"{prefix}round_sf": rnd, f"{prefix}use_packed_ue8m0": packed,
            f"{prefix}use_tma_aligned_col_major_sf": col}


def moe_points(device: torch.device, kernel: str, topk: Optional[Tuple[int, ...]] = None
               ) -> Iterator[Tuple[int, int, int, int]]:
    """``(num_tokens, num_topk, num_experts (local), num_ep_ranks)`` of ``generate_moe_params(is_benchmark=True)``
    (``topk``: only these ``num_topk``).  The token count is that of TileKernels' record of ``kernel`` at the point
    where there is one, else of one seeded draw of its routing (:func:`num_tokens`).  The CPU pass keeps
    the last point alone (9 senders per rank): the fused kernels' interpreted calls take seconds each."""
    points = [(k, e_total // ep, ep) for k, e_total, ep in GRID if topk is None or k in topk]
    for k, e, ep in points if device.type == "cuda" else points[-1:]:
        t, _ = num_tokens(device, kernel, k, e, ep)
        yield t, k, e, ep


def fused_maps(topk_idx: torch.Tensor, num_experts: int, alignment: int):
    """(pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos), int32, in the canonical order of
    ``get_fused_mapping`` (stable by ``t*K + k`` inside each expert, segments aligned, padding rows -1)."""
    dev = topk_idx.device
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    slots = torch.nonzero(flat >= 0).flatten()
    experts = flat[slots]
    order = torch.sort(experts, stable=True).indices
    slots, experts = slots[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts)
    aligned = (counts + alignment - 1) // alignment * alignment
    start = torch.cumsum(aligned, 0) - aligned
    first = torch.cumsum(counts, 0) - counts
    pos = start[experts] + torch.arange(slots.numel(), device=dev) - first[experts]
    n = int(aligned.sum())
    p2e = torch.full((n,), -1, dtype=torch.int32, device=dev)
    p2t = torch.full((n,), -1, dtype=torch.int32, device=dev)
    p2tk = torch.full((n,), -1, dtype=torch.int32, device=dev)
    tk2p = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    p2e[pos] = experts.to(torch.int32)
    p2t[pos] = (slots // K).to(torch.int32)
    p2tk[pos] = slots.to(torch.int32)
    tk2p[slots] = pos.to(torch.int32)
    return p2e, p2t, p2tk, tk2p.reshape(T, K)


def expand(x: torch.Tensor, pos_to_token: torch.Tensor) -> torch.Tensor:
    """``expand_to_fused``: row ``i`` is ``x[pos_to_token[i]]``, padding rows (-1) zero."""
    out = torch.zeros((pos_to_token.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    ok = pos_to_token >= 0
    out[ok] = x[pos_to_token[ok].long()]
    return out


def moe_inputs(device: torch.device, num_tokens_: int, num_topk: int, num_experts: int, num_ep_ranks: int,
               width: int, alignment: int):
    """TileKernels' fused-MoE test data: routing of ``num_tokens_`` received rows, its fused maps at
    ``alignment``, and ``expand_to_fused`` of a bf16 ``randn (num_tokens_, width)``.
    Returns ``(x (rows, width) bf16, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos)``."""
    topk_idx = generate_topk_idx_rows(num_tokens_, num_topk, num_experts, num_ep_ranks, device)
    p2e, p2t, p2tk, tk2p = fused_maps(topk_idx, num_experts, alignment)
    x = expand(torch.randn((num_tokens_, width), dtype=torch.bfloat16, device=device), p2t)
    return x, p2e, p2t, p2tk, tk2p
