"""Plain-torch MoE fused maps and expanded inputs for the quant tests.

The quant tests (per-channel fused cast, the SwiGLU casts) need the maps that
``tile_kernels.moe.get_fused_mapping`` builds and the rows that ``expand_to_fused`` gathers.
They are built here with plain torch so the quant tests do not depend on ``tritile.moe``.

Canonical order (``spec/moe.md`` §3.1, the order tritile's ``get_fused_mapping`` produces): expert
``e`` owns the segment ``[start_e, start_e + a_e)`` with ``a_e = align(c_e, alignment)`` (0 when the
expert got no slot) and ``start_e = sum(a_e' for e' < e)``; its ``c_e`` valid slots ``(t, k)`` sit at
the front of the segment in ascending ``(t, k)`` order (a stable sort of the flat index ``t*K + k``);
the rest of the segment is padding, marked -1 in every ``pos_to_*`` map.

Example::

    topk_idx = generate_topk_idx(129, 6, 9, 8)                  # int64 (T', 6), -1 = not local
    p2e, p2t, p2tk, tk2p = get_fused_mapping(topk_idx, 9, 128)  # int32 maps, N % 128 == 0
    x_f = expand(x, tk2p, p2e.numel())                          # (N, H), padding rows zero
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

__all__ = ["generate_topk_idx", "get_fused_mapping", "expand", "MOE_CONFIGS"]

#: ``(num_topk, num_experts_total, num_ep_ranks)`` of TileKernels' ``generate_moe_params`` base grid;
#: the local expert count is ``num_experts_total // num_ep_ranks``.
MOE_CONFIGS = [(k, e, ep) for k in (2, 6, 8, 9) for (e, ep) in ((72, 8), (256, 8), (256, 64))]


def generate_topk_idx(num_tokens: int, num_topk: int, num_experts: int, num_ep_ranks: int,
                      device=None) -> torch.Tensor:
    """Routing of the tokens one EP rank receives, as TileKernels' test generator simulates it.

    Draws scores ``rand(num_tokens * num_ep_ranks, num_experts * num_ep_ranks)``, takes each row's
    top ``num_topk`` experts (distinct, unsorted), keeps the ids of the local experts
    ``[0, num_experts)`` and writes -1 for the others, then drops the rows with no local expert.

    Args:
        num_tokens: tokens sent by each rank.
        num_topk: experts per token (<= num_experts * num_ep_ranks).
        num_experts: LOCAL experts (the global count divided by num_ep_ranks).
        num_ep_ranks: expert-parallel ranks.
        device: where to build it (default CPU).

    Returns:
        int64 ``(T', num_topk)`` with values in ``[-1, num_experts)``; every row has a valid id.
        ``T'`` is random (about ``num_tokens * num_ep_ranks * P(row hits a local expert)``).
    """
    total = num_experts * num_ep_ranks
    if not 0 < num_topk <= total:
        raise ValueError(f"num_topk must be in [1, {total}], got {num_topk}")
    scores = torch.rand(num_tokens * num_ep_ranks, total, device=device)
    idx = scores.topk(num_topk, dim=1, sorted=False).indices
    idx = torch.where(idx < num_experts, idx, torch.full_like(idx, -1))
    keep = (idx >= 0).any(dim=1)
    return idx[keep].contiguous()


def get_fused_mapping(topk_idx: torch.Tensor, num_experts: int, alignment: int
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused MoE maps in the canonical order (see the module docstring).

    Args:
        topk_idx: int64 ``(T, K)``, values in ``[-1, num_experts)``; -1 = slot not routed here.
        num_experts: local expert count E.
        alignment: each expert's segment length is rounded up to a multiple of this (>= 1).

    Returns:
        ``(pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos)``:
        three int32 ``(N,)`` maps with ``N = sum_e align(c_e, alignment)`` (expert id, token ``t``,
        flat slot ``t*K + k``; -1 on padding rows) and int32 ``(T, K)`` ``token_topk_to_pos``
        (the row of slot ``(t, k)``, -1 where ``topk_idx`` is -1).  All on ``topk_idx.device``.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2D, got shape {tuple(topk_idx.shape)}")
    dev = topk_idx.device
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1).to(torch.int64)
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)[:num_experts]
    aligned = (counts + alignment - 1) // alignment * alignment
    start = torch.cumsum(aligned, 0) - aligned
    n = int(aligned.sum())
    # stable sort of the valid slots by expert keeps ascending flat index (t, k) inside each expert
    slots = torch.nonzero(valid).flatten()
    experts = flat[slots]
    order = torch.sort(experts, stable=True).indices
    slots, experts = slots[order], experts[order]
    first = torch.cumsum(counts, 0) - counts                 # first sorted index of each expert
    rank = torch.arange(slots.numel(), device=dev) - first[experts]
    pos = start[experts] + rank
    pos_to_expert = torch.full((n,), -1, dtype=torch.int32, device=dev)
    pos_to_token = torch.full((n,), -1, dtype=torch.int32, device=dev)
    pos_to_token_topk = torch.full((n,), -1, dtype=torch.int32, device=dev)
    token_topk_to_pos = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    pos_to_expert[pos] = experts.to(torch.int32)
    pos_to_token[pos] = (slots // max(K, 1)).to(torch.int32)
    pos_to_token_topk[pos] = slots.to(torch.int32)
    token_topk_to_pos[slots] = pos.to(torch.int32)
    return pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos.reshape(T, K)


def expand(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], token_topk_to_pos: torch.Tensor,
           num_rows: int):
    """``expand_to_fused``: row ``p = token_topk_to_pos[t, k]`` of the result is ``x[t]``; other rows are 0.

    Args:
        x: ``(T, H)`` tensor of any dtype (copied bit for bit), or a tuple ``(data (T, H), sf (T, S))``,
            expanded row by row alike (the sf comes back contiguous, row-major).
        token_topk_to_pos: int32/int64 ``(T, K)``, -1 = slot not present.
        num_rows: N, the number of fused rows.

    Returns:
        ``(N, H)`` contiguous tensor of ``x``'s dtype (a tuple for a tuple input), zero bytes on
        padding rows.
    """
    if isinstance(x, (tuple, list)):
        return tuple(expand(t, token_topk_to_pos, num_rows) for t in x)
    T = token_topk_to_pos.shape[0]
    if x.shape[0] != T:
        raise ValueError(f"x has {x.shape[0]} rows but token_topk_to_pos has {T}")
    raw = x.contiguous().view(torch.uint8) if x.element_size() == 1 else x.contiguous()
    out = torch.zeros((num_rows, *x.shape[1:]), dtype=raw.dtype, device=x.device)
    p = token_topk_to_pos.to(torch.int64)
    tok = torch.arange(T, device=x.device).unsqueeze(1).expand_as(p)
    ok = p >= 0
    out[p[ok]] = raw[tok[ok]]
    return out.view(x.dtype) if x.element_size() == 1 else out
