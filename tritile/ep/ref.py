"""Pure-PyTorch references of tritile.ep: every kernel's twin, and dispatch / combine built only from
``torch.distributed.all_to_all_single``.

Kernel twins (same arguments, same bits): :func:`dispatch_layout_ref`, :func:`pack_rows_ref`,
:func:`pack_meta_ref`, :func:`gather_rows_ref`, :func:`unpack_meta_ref`, :func:`combine_reduce_ref`,
:func:`ll_send_meta_ref`, :func:`ll_cast_send_ref`, :func:`ll_receive_ref`.  Rows a kernel leaves unwritten are zero
here.

Distributed references (the test oracle, and a "dedup in torch" baseline for benchmarks):

* :func:`dispatch_reference` sends each token once per destination rank with one count exchange and one
  ``all_to_all_single`` per tensor (x, scales, local ids, weights, source index).  Receive order: ascending
  source rank, then ascending source token (the contract of ``tritile.ep``).
* :func:`combine_reference` sends the rows back and sums, per token, ``0 + bias0 + bias1`` then the rows of
  the destination ranks in ascending rank order, in float32, one conversion to bf16.
* :func:`low_latency_reference` / :func:`low_latency_combine_reference`: the per-expert slabs of
  ``Buffer.low_latency_dispatch`` and its weighted combine, derived from the two above.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

__all__ = [
    "dispatch_layout_ref", "pack_rows_ref", "pack_meta_ref", "gather_rows_ref", "unpack_meta_ref",
    "combine_reduce_ref", "ll_send_meta_ref", "ll_cast_send_ref", "ll_receive_ref", "fused_mapping_ref",
    "dispatch_reference", "combine_reference", "low_latency_reference", "low_latency_combine_reference",
]


# ---------------------------------------------------------------------------------------------------------------
# kernel twins
# ---------------------------------------------------------------------------------------------------------------
def dispatch_layout_ref(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Twin of :func:`tritile.ep.layout.dispatch_layout` (same outputs, same bits)."""
    dev = topk_idx.device
    idx = topk_idx.long()
    t = idx.shape[0]
    valid = (idx >= 0) & (idx < num_experts)
    bad = ((idx != -1) & ~valid).sum().to(torch.int32).reshape(1)
    per_rank_experts = num_experts // num_ranks
    rank = torch.where(valid, torch.div(idx, per_rank_experts, rounding_mode="floor"), num_ranks)
    is_in = torch.zeros((t, num_ranks + 1), dtype=torch.bool, device=dev)
    is_in.scatter_(1, rank, True)
    is_in = is_in[:, :num_ranks].contiguous()
    per_rank = is_in.sum(0).to(torch.int32)
    per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    slot = torch.where(is_in, is_in.to(torch.int32).cumsum(0) - 1, -1).to(torch.int32)
    return per_rank, per_expert, is_in, slot, bad


def pack_rows_ref(x: torch.Tensor, send_slot: torch.Tensor, base: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Twin of :func:`tritile.ep.pack.pack_rows` (unwritten rows are zero)."""
    out = torch.zeros((num_rows, x.shape[1]), dtype=x.dtype, device=x.device)
    t, r = (send_slot >= 0).nonzero(as_tuple=True)
    out[base.long()[r] + send_slot[t, r].long()] = x[t]
    return out


def pack_meta_ref(topk_idx, topk_weights, sf, send_slot, base, num_rows: int, experts_per_rank: int,
                  num_topk: int) -> torch.Tensor:
    """Twin of :func:`tritile.ep.pack.pack_meta` (unwritten rows are zero)."""
    num_ranks = send_slot.shape[1]
    dev = send_slot.device
    cols = []
    for r in range(num_ranks):
        part = [torch.arange(send_slot.shape[0], dtype=torch.int32, device=dev)[:, None]]
        if topk_idx is not None:
            idx = topk_idx.long()
            lo = r * experts_per_rank
            local = (idx >= lo) & (idx < lo + experts_per_rank)
            part.append(torch.where(local, idx - lo, -1).to(torch.int32))
            if topk_weights is not None:
                part.append(torch.where(local, topk_weights, 0.0).to(torch.float32).view(torch.int32))
        if sf is not None:
            part.append(sf.to(torch.int32))
        cols.append(torch.cat(part, dim=1))
    width = cols[0].shape[1] if cols else 1
    out = torch.zeros((num_rows, width), dtype=torch.int32, device=dev)
    for r in range(num_ranks):
        sel = send_slot[:, r] >= 0
        out[base[r].long() + send_slot[sel, r].long()] = cols[r][sel]
    return out


def gather_rows_ref(src: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`tritile.ep.pack.gather_rows`."""
    out = torch.zeros((row_map.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    ok = row_map >= 0
    out[ok] = src[row_map[ok].long()]
    return out


def unpack_meta_ref(meta: torch.Tensor, row_map: Optional[torch.Tensor], num_topk: int, has_idx: bool, has_w: bool,
                    sf_words: int):
    """Twin of :func:`tritile.ep.pack.unpack_meta`."""
    if row_map is None:
        rows = meta
        ok = torch.ones((meta.shape[0],), dtype=torch.bool, device=meta.device)
    else:
        ok = row_map >= 0
        rows = torch.zeros((row_map.shape[0], meta.shape[1]), dtype=torch.int32, device=meta.device)
        rows[ok] = meta[row_map[ok].long()]
    ok = ok & (rows[:, 0] >= 0)
    n = rows.shape[0]
    k = num_topk if has_idx else 0
    kw = num_topk if (has_idx and has_w) else 0
    src = torch.where(ok, rows[:, 0], -1).to(torch.int32)
    idx = torch.where(ok[:, None], rows[:, 1:1 + k], -1).long()
    w = torch.where(ok[:, None], rows[:, 1 + k:1 + k + kw], 0).contiguous().view(torch.float32)
    sf = torch.where(ok[:, None], rows[:, rows.shape[1] - sf_words:], 0) if sf_words else \
        torch.zeros((n, 0), dtype=torch.int32, device=meta.device)
    return idx, w.reshape(n, kw), src, sf.contiguous()


def combine_reduce_ref(buf, send_slot, base, bias0=None, bias1=None, wbuf=None):
    """Twin of :func:`tritile.ep.reduce.combine_reduce`: float32 ``0 + bias0 + bias1 + rows`` in ascending rank
    order, one bf16 rounding; weights ``0 + w_0 + w_1 + ...``."""
    t, num_ranks = send_slot.shape
    acc = torch.zeros((t, buf.shape[1]), dtype=torch.float32, device=buf.device)
    if bias0 is not None:
        acc = acc + bias0.float()
    if bias1 is not None:
        acc = acc + bias1.float()
    k = 0 if wbuf is None else wbuf.shape[1]
    wacc = torch.zeros((t, k), dtype=torch.float32, device=buf.device)
    for r in range(num_ranks):
        sel = send_slot[:, r] >= 0
        rows = base[r].long() + send_slot[sel, r].long()
        acc[sel] = acc[sel] + buf[rows].float()
        if wbuf is not None:
            wacc[sel] = wacc[sel] + wbuf[rows]
    return acc.to(torch.bfloat16), (wacc if wbuf is not None else None)


def ll_send_meta_ref(topk_idx, topk_weights, num_experts: int, num_ranks: int, capacity: int, width: int):
    """Twin of :func:`tritile.ep.ll.ll_send_meta`: ``(send_slot, meta)``, ``meta`` int32 ``(R*M, width)`` with the
    sent rows' ids and weights, source token ``-1`` on the rows past each block's count, zeros elsewhere."""
    slot = dispatch_layout_ref(topk_idx, num_experts, num_ranks)[3]
    base = torch.arange(num_ranks, dtype=torch.int32, device=topk_idx.device) * capacity
    meta = pack_meta_ref(topk_idx, topk_weights, None, slot, base, num_ranks * capacity, num_experts // num_ranks,
                         topk_idx.shape[1])
    meta = torch.cat([meta, meta.new_zeros((meta.shape[0], width - meta.shape[1]))], dim=1)
    sent = torch.zeros((num_ranks * capacity,), dtype=torch.bool, device=topk_idx.device)
    for r in range(num_ranks):
        sent[r * capacity + slot[slot[:, r] >= 0, r].long()] = True
    meta[~sent, 0] = -1
    return slot, meta


def ll_cast_send_ref(x: torch.Tensor, send_slot: torch.Tensor, capacity: int, round_sf: bool, use_ue8m0: bool):
    """Twin of :func:`tritile.ep.ll.ll_cast_send`: per rank ``r``, ``(rows, codes, words)``: the destination rows
    ``r * M + send_slot[t, r]`` of the tokens sent to ``r``, their e4m3 codes (uint8 ``(n, H)``) and scale words
    (int32: float32 scales' bits, or packed UE8M0)."""
    from ..torch.cast import cast

    data, sf = cast(x, "e4m3", (1, 128), round_sf=round_sf, use_tma_aligned_col_major_sf=use_ue8m0,
                    use_packed_ue8m0=use_ue8m0)
    codes = data.view(torch.uint8)
    words = sf.contiguous() if sf.dtype == torch.int32 else sf.contiguous().view(torch.int32)
    out = []
    for r in range(send_slot.shape[1]):
        sel = send_slot[:, r] >= 0
        out.append((r * capacity + send_slot[sel, r].long(), codes[sel], words[sel]))
    return out


def ll_receive_ref(meta: torch.Tensor, num_topk: int, has_w: bool, sf_words: int, num_local_experts: int,
                   num_ranks: int, capacity: int):
    """Twin of :func:`tritile.ep.ll.ll_receive`: ``(pos, recv_count, src_info, layout_range, recv_weights,
    recv_sf)``, ``recv_sf`` int32 ``(L, R*M, sf_words)`` zero past each count."""
    dev = meta.device
    rm = num_ranks * capacity
    idx, w, src, sf = unpack_meta_ref(meta, None, num_topk, True, has_w, sf_words)
    pos = torch.full(idx.shape, -1, dtype=torch.int32, device=dev)
    src_info = torch.full((num_local_experts, rm), -1, dtype=torch.int32, device=dev)
    count = torch.zeros((num_local_experts,), dtype=torch.int32, device=dev)
    layout_range = torch.zeros((num_local_experts, num_ranks), dtype=torch.int64, device=dev)
    recv_sf = torch.zeros((num_local_experts, rm, sf_words), dtype=torch.int32, device=dev)
    for e in range(num_local_experts):
        sel = idx == e
        rowsel = sel.any(1)
        rank = rowsel.to(torch.int64).cumsum(0) - 1
        pos[sel] = (e * rm + rank[:, None].expand_as(sel)[sel]).to(torch.int32)
        n = int(rowsel.sum())
        count[e] = n
        src_info[e, :n] = src[rowsel]
        recv_sf[e, :n] = sf[rowsel]
        per_src = rowsel.reshape(num_ranks, capacity).sum(1)
        begin = per_src.cumsum(0) - per_src
        layout_range[e] = (begin << 32) | per_src
    return pos, count, src_info, layout_range, w, recv_sf


def fused_mapping_ref(topk_idx: torch.Tensor, num_experts: int, num_expanded: int, alignment: int):
    """Twin of the parts of :func:`tritile.moe.get_fused_mapping` the expand mode uses: ``(pos_to_expert,
    pos_to_token_topk, token_topk_to_pos, expert_start)``, int32, with ``num_expanded`` positions (slots past
    them are dropped).  Each expert's segment starts at the aligned sum of the earlier ones; inside it the valid
    slots come first in ascending flat index ``t*K + k``."""
    dev = topk_idx.device
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    seg = (counts + alignment - 1) // alignment * alignment
    start = seg.cumsum(0) - seg
    key = torch.where(valid, flat, num_experts)
    order = torch.argsort(key, stable=True)
    n_valid = int(valid.sum())
    order = order[:n_valid]
    e = key[order]
    first = counts.cumsum(0) - counts
    pos = start[e] + torch.arange(n_valid, device=dev) - first[e]
    keep = pos < num_expanded
    order, e, pos = order[keep], e[keep], pos[keep]
    ttp = torch.full((t * k,), -1, dtype=torch.int32, device=dev)
    ttp[order] = pos.to(torch.int32)
    p2tt = torch.full((num_expanded,), -1, dtype=torch.int32, device=dev)
    p2tt[pos] = order.to(torch.int32)
    p2e = torch.full((num_expanded,), -1, dtype=torch.int32, device=dev)
    p2e[pos] = e.to(torch.int32)
    return p2e, p2tt, ttp.reshape(t, k), start.to(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# distributed references
# ---------------------------------------------------------------------------------------------------------------
def _a2a(t: torch.Tensor, recv_rows: int, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    """all_to_all_single of a 2D tensor's rows, through a byte view (gloo has no FP8 dtype)."""
    t = t.contiguous()
    if t.dim() == 1:
        t = t.reshape(-1, 1)
    row_bytes = t.shape[1] * t.element_size()
    out = torch.empty((recv_rows, row_bytes), dtype=torch.uint8, device=t.device)
    src = t.view(torch.uint8).reshape(t.shape[0], row_bytes) if row_bytes else \
        torch.empty((t.shape[0], 0), dtype=torch.uint8, device=t.device)
    dist.all_to_all_single(out, src, out_splits, in_splits, group=group)
    return out


def dispatch_reference(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], topk_idx: torch.Tensor,
                       topk_weights: Optional[torch.Tensor], num_experts: int, group=None,
                       expert_alignment: int = 1):
    """Dispatch built only from torch ops and ``all_to_all_single``.

    Args:
        x: bfloat16 ``(T, H)`` or ``(fp8 (T, H), scales (T, S))`` (scales float32 or int32, any strides).
        topk_idx: int64/int32 ``(T, k)``, ``-1`` = unused; topk_weights: float32 ``(T, k)`` or None.
        num_experts: ``E`` (divisible by the group size).  expert_alignment: rounds the per-expert list.

    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``: ``recv_x``
        ``(N, H)`` (a tuple with scales ``(N, S)`` for FP8), int64 ``(N, k)`` local ids (``-1`` elsewhere), float32
        ``(N, k)`` (0 at ``-1`` slots) or None, ``list[L]`` aligned counts, and a dict with ``send_counts``,
        ``recv_counts`` (host lists), ``send_tokens`` (per rank, int64 token indices), ``recv_src_idx`` (int32
        ``(N,)``), ``recv_src_rank`` (int32 ``(N,)``), ``is_token_in_rank`` (bool ``(T, R)``), ``num_tokens``.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    per = num_experts // world
    fp8 = isinstance(x, (tuple, list))
    data, sf = (x[0], x[1]) if fp8 else (x, None)
    dev = data.device
    idx = topk_idx.long()
    t = idx.shape[0]
    valid = (idx >= 0) & (idx < num_experts)
    ranks_of = torch.where(valid, torch.div(idx, per, rounding_mode="floor"), -1)
    is_in = torch.stack([(ranks_of == r).any(1) for r in range(world)], 1) if t else \
        torch.zeros((0, world), dtype=torch.bool, device=dev)
    send_tokens = [is_in[:, r].nonzero().flatten() for r in range(world)]
    send_counts = [int(s.numel()) for s in send_tokens]
    cnt = torch.tensor(send_counts, dtype=torch.int64, device=dev)
    rcnt = torch.empty_like(cnt)
    dist.all_to_all_single(rcnt, cnt, group=group)
    recv_counts = [int(v) for v in rcnt.tolist()]
    n = sum(recv_counts)
    order = torch.cat(send_tokens) if send_tokens else torch.zeros(0, dtype=torch.long, device=dev)

    def send(rows: torch.Tensor) -> torch.Tensor:
        return _a2a(rows, n, recv_counts, send_counts, group)

    recv_data = send(data[order]).view(data.dtype).reshape(n, data.shape[1])
    recv_sf = None
    if sf is not None:
        recv_sf = send(sf[order]).view(sf.dtype).reshape(n, sf.shape[1])
    local_idx = []
    local_w = []
    for r in range(world):
        tok = send_tokens[r]
        i = idx[tok]
        loc = (i >= r * per) & (i < (r + 1) * per)
        local_idx.append(torch.where(loc, i - r * per, -1))
        if topk_weights is not None:
            local_w.append(torch.where(loc, topk_weights[tok], 0.0))
    k = idx.shape[1]
    recv_idx = send(torch.cat(local_idx) if local_idx else idx[:0]).view(torch.int64).reshape(n, k)
    recv_w = None
    if topk_weights is not None:
        recv_w = send(torch.cat(local_w)).view(torch.float32).reshape(n, k)
    recv_src = send(order.to(torch.int32)).view(torch.int32).reshape(n)
    recv_src_rank = torch.cat([torch.full((c,), s, dtype=torch.int32, device=dev) for s, c in enumerate(recv_counts)])
    counts = [int((recv_idx == e).sum()) for e in range(per)]
    lst = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in counts]
    handle = dict(send_counts=send_counts, recv_counts=recv_counts, send_tokens=send_tokens, recv_src_idx=recv_src,
                  recv_src_rank=recv_src_rank, is_token_in_rank=is_in, num_tokens=t, rank=me,
                  num_recv_tokens_per_expert=counts)
    recv_x = (recv_data, recv_sf) if fp8 else recv_data
    return recv_x, recv_idx, recv_w, lst, handle


def combine_reference(x: torch.Tensor, handle: dict, topk_weights: Optional[torch.Tensor] = None,
                      bias: Union[None, torch.Tensor, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                      group=None):
    """Combine built only from torch ops and ``all_to_all_single`` (``handle`` from :func:`dispatch_reference`).

    Args:
        x: bfloat16 ``(N, H)`` in the dispatch receive order; topk_weights: float32 ``(N, k)`` or None.
        bias: None, a bfloat16 ``(T, H)`` tensor or a pair of them (either may be None).

    Returns:
        ``(combined_x, combined_topk_weights)``: bfloat16 ``(T, H)`` = bf16(f32 ``0 + bias0 + bias1 + rows`` in
        ascending destination-rank order), float32 ``(T, k)`` summed the same way (None without weights).
    """
    send_counts, recv_counts = handle["send_counts"], handle["recv_counts"]
    t = handle["num_tokens"]
    s = sum(send_counts)
    back = _a2a(x, s, send_counts, recv_counts, group).view(x.dtype).reshape(s, x.shape[1])
    wback = None
    if topk_weights is not None:
        wback = _a2a(topk_weights, s, send_counts, recv_counts, group).view(torch.float32).reshape(
            s, topk_weights.shape[1])
    b0, b1 = (bias, None) if isinstance(bias, torch.Tensor) or bias is None else tuple(bias)
    acc = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    if b0 is not None:
        acc = acc + b0.float()
    if b1 is not None:
        acc = acc + b1.float()
    wacc = None if wback is None else torch.zeros((t, wback.shape[1]), dtype=torch.float32, device=x.device)
    off = 0
    for r, tok in enumerate(handle["send_tokens"]):
        c = send_counts[r]
        acc[tok] = acc[tok] + back[off:off + c].float()
        if wacc is not None:
            wacc[tok] = wacc[tok] + wback[off:off + c]
        off += c
    return acc.to(torch.bfloat16), wacc


def low_latency_reference(x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                          num_experts: int, group=None):
    """Per-expert slabs of ``Buffer.low_latency_dispatch`` (bf16 payload), from :func:`dispatch_reference`.

    Returns:
        ``(slabs, recv_count, src_info, layout_range, ref_handle)``: per local expert ``e`` the rows selecting
        it in receive order, as a list of bfloat16 ``(count_e, H)`` tensors; int32 ``(L,)``; list of int32
        ``(count_e,)`` source token indices; int64 ``(L, R)`` ``(begin << 32) | count``; the dispatch handle.
    """
    world = dist.get_world_size(group)
    recv_x, recv_idx, _, _, h = dispatch_reference(x, topk_idx, None, num_experts, group)
    per = num_experts // world
    slabs, src_info, counts = [], [], []
    layout = torch.zeros((per, world), dtype=torch.int64, device=x.device)
    for e in range(per):
        sel = (recv_idx == e).any(1)
        slabs.append(recv_x[sel])
        src_info.append(h["recv_src_idx"][sel])
        counts.append(int(sel.sum()))
        per_src = torch.stack([(sel & (h["recv_src_rank"] == s)).sum() for s in range(world)]).long()
        layout[e] = ((per_src.cumsum(0) - per_src) << 32) | per_src
    return slabs, torch.tensor(counts, dtype=torch.int32, device=x.device), src_info, layout, h


def low_latency_combine_reference(y: List[torch.Tensor], topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                  num_experts: int, ref_handle: dict, group=None) -> torch.Tensor:
    """Weighted combine: ``out[t] = sum over valid slots j of w[t, j] * y_e(t)`` (float32; per destination rank
    the local slots are summed in slot order and rounded to bf16 once, then the ranks are summed in ascending
    order).  ``y[e]`` holds expert ``e``'s outputs for its rows of :func:`low_latency_reference`."""
    world = dist.get_world_size(group)
    per = num_experts // world
    n = ref_handle["recv_src_idx"].shape[0]
    hidden = y[0].shape[1] if y else 0
    # send the weights to the expert ranks with the same routing as the rows
    send_counts, recv_counts = ref_handle["send_counts"], ref_handle["recv_counts"]
    idx = topk_idx.long()
    parts_i, parts_w = [], []
    for r, tok in enumerate(ref_handle["send_tokens"]):
        i = idx[tok]
        loc = (i >= r * per) & (i < (r + 1) * per)
        parts_i.append(torch.where(loc, i - r * per, -1))
        parts_w.append(torch.where(loc, topk_weights[tok], 0.0))
    k = idx.shape[1]
    ri = _a2a(torch.cat(parts_i), n, recv_counts, send_counts, group).view(torch.int64).reshape(n, k)
    rw = _a2a(torch.cat(parts_w), n, recv_counts, send_counts, group).view(torch.float32).reshape(n, k)
    dev = topk_weights.device
    # row of each (received row, slot) inside its expert's list, in receive order
    rowpos = torch.full((n, k), -1, dtype=torch.long, device=dev)
    for e in range(per):
        m = ri == e
        c = m.any(1).long().cumsum(0) - 1
        rowpos = torch.where(m, c[:, None], rowpos)
    sizes = torch.tensor([int(t.shape[0]) for t in y], dtype=torch.long, device=dev)
    offs = sizes.cumsum(0) - sizes
    ycat = torch.cat(list(y)) if y else torch.zeros((0, hidden), dtype=torch.bfloat16, device=dev)
    rows = torch.zeros((n, hidden), dtype=torch.float32, device=dev)
    for j in range(k):
        e = ri[:, j]
        ok = e >= 0
        vals = ycat[offs[e[ok]] + rowpos[ok, j]].float()
        rows[ok] = rows[ok] + rw[ok, j:j + 1] * vals
    part = rows.to(torch.bfloat16)
    return combine_reference(part, ref_handle, None, None, group)[0]
