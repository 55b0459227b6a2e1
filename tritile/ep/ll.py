"""Low-latency (fixed-capacity) dispatch kernels: the send side, and the receive layout into per-local-expert slabs
``[L, R*M, ...]``, without a host sync.

The low-latency path of :class:`tritile.ep.Buffer` sends each token once per destination rank (deduplicated, like
the high-throughput path) into fixed-capacity blocks of ``M`` rows per (source, destination) pair, so the
exchange is one equal-split ``all_to_all_single`` with no split lists, no host sync, and CUDA-graph capture works.
On the receiver the rows arrive as ``R`` blocks of ``M`` (valid rows first, in ascending source token order), each
with its metadata row (:func:`tritile.ep.pack.pack_meta`'s layout).

:func:`ll_send_meta` builds the sender's side in one launch (one program: a decode batch is small): the send slot of
every (token, rank), i.e. :func:`tritile.ep.layout.dispatch_layout`'s ``send_slot``, the metadata rows of the sent
tokens, and a source token ``-1`` on the rows of each block past its count, which marks them as padding;
:func:`ll_cast_send` then casts the rows to FP8 (``per_token_cast``'s bits) straight into their send rows, and their
scales into the metadata rows' last words.

:func:`ll_receive` reads the received metadata and places the rows into per-expert slabs in one launch: one program
per local expert scans the received rows in order (ascending source rank, then source token) and gives every
(row, slot) selecting the expert the next position of the expert's slab, copying the row's scale words to that
slab row; one more program marks the ``-1`` slots and unpacks the weights.  So, stronger than DeepEP's atomics,
block order across sources and row order inside a block are fixed.  It also writes ``recv_count``, ``src_info``
(``-1`` past the count) and ``layout_range`` (``(begin << 32) | count`` per source).  The rows themselves move
with :func:`tritile.ep.pack.scatter_rows_into` and the positions.

This is not DeepEP's zero-SM RDMA path: NCCL kernels occupy SMs while the exchange is in flight, and a
``return_recv_hook`` only defers the wait (see ``Buffer.low_latency_dispatch``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language.cast import quant_scale
from ..language.pdl import pdl_enter
from ..quant._block_cast_tiles import _amax_of, _load_tile, _scale_tile, _store_codes, _store_sf
from ..quant.common import FMT_CLAMP, FMT_MAX
from ..runtime import (check_tensor, checks_enabled, custom_op, empty, interpreter_configs,
                       kernel_device_ok)
from ..runtime.plan import planned
from ..utils import ceil_div, next_power_of_two
from .layout import check_layout_args, raise_on_bad_ids
from .pack import _store_meta_row, scatter_rows_into

__all__ = ["ll_send_meta", "ll_cast_send", "ll_receive", "ll_pack", "ll_unpack"]

_INTERPRET = interpreter_configs()


@triton.jit
def _ll_send_meta_kernel(idx_ptr, s_it, s_ik, w_ptr, s_wt, s_wk, slot_ptr, out_ptr, num_tokens, num_experts,
                         experts_per_rank,
                         META_W: tl.constexpr, NUM_TOPK: tl.constexpr, HAS_W: tl.constexpr, W_OFF: tl.constexpr,
                         NUM_RANKS: tl.constexpr, CAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    kk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    running = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, CAP, BLOCK_T):  # T <= CAP: a loop bound fixed by the capacity, not by T
        rows = start + tl.arange(0, BLOCK_T)
        row_ok = rows < num_tokens
        km = row_ok[:, None] & (kk[None, :] < NUM_TOPK)
        idx = tl.load(idx_ptr + rows[:, None].to(tl.int64) * s_it + kk[None, :] * s_ik, mask=km, other=-1)
        valid = (idx >= 0) & (idx < num_experts) & km  # on the loaded ids: an int32 cast would wrap large ones
        idx = tl.where(valid, idx, -1).to(tl.int32)
        rank = tl.where(valid, idx // experts_per_rank, -1)
        hit = tl.max((rank[:, :, None] == rr[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, BLOCK_R]
        hit = tl.where(row_ok[:, None] & (rr[None, :] < NUM_RANKS), hit, 0)
        slots = tl.where(hit != 0, running[None, :] + tl.cumsum(hit, axis=0) - 1, -1)
        tl.store(slot_ptr + rows[:, None] * NUM_RANKS + rr[None, :], slots,
                 mask=row_ok[:, None] & (rr[None, :] < NUM_RANKS))
        running += tl.sum(hit, axis=0)
        if HAS_W:
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * s_wt + kk[None, :] * s_wk, mask=km, other=0.0)
        else:
            w = idx  # unused (HAS_W is off)
        for r in tl.static_range(NUM_RANKS):
            slot = tl.sum(tl.where(rr[None, :] == r, slots, 0), axis=1)
            sent = tl.sum(tl.where(rr[None, :] == r, hit, 0), axis=1) != 0
            dst = (r * CAP + slot).to(tl.int64) * META_W
            _store_meta_row(out_ptr, dst, sent, rows, idx, w, r * experts_per_rank, experts_per_rank, kk, NUM_TOPK,
                            True, HAS_W, W_OFF)
    # the rows of each block past its count: source token -1 (padding)
    for r in tl.static_range(NUM_RANKS):
        n = tl.sum(tl.where(rr == r, running, 0), axis=0)
        for c in tl.static_range(0, CAP, BLOCK_M):
            j = c + tl.arange(0, BLOCK_M)
            tl.store(out_ptr + (r * CAP + j).to(tl.int64) * META_W, tl.full([BLOCK_M], -1, tl.int32),
                     mask=(j < CAP) & (j >= n))


def _ll_send_meta_fake(topk_idx, topk_weights, num_experts, num_ranks, capacity, out):
    return out.new_empty((topk_idx.shape[0], num_ranks))


@custom_op("ep_ll_send_meta", mutates_args=("out",), fake=_ll_send_meta_fake)
def _ll_send_meta_op(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], num_experts: int, num_ranks: int,
                     capacity: int, out: torch.Tensor) -> torch.Tensor:
    num_tokens, num_topk = topk_idx.shape
    dev = topk_idx.device
    slot = empty((num_tokens, num_ranks), torch.int32, dev)
    has_w = topk_weights is not None
    if not kernel_device_ok(dev):
        from .ref import ll_send_meta_ref

        ref_slot, ref_out = ll_send_meta_ref(topk_idx, topk_weights, num_experts, num_ranks, capacity, out.shape[1])
        slot.copy_(ref_slot)
        sent = ref_out[:, 0] >= 0
        n = 1 + num_topk * (2 if has_w else 1)
        out[sent, :n] = ref_out[sent, :n]
        out[~sent, 0] = -1
        return slot
    wt = topk_weights if has_w else topk_idx
    # BLOCK_R >= 2: with a rank axis of one (one rank), Triton 3.6 on sm_90 stores wrong metadata rows (the per-rank
    # sums over a size-1 axis); the padded ranks are masked off
    _ll_send_meta_kernel[(1,)](
        topk_idx, topk_idx.stride(0), topk_idx.stride(1), wt, wt.stride(0), wt.stride(-1), slot, out, num_tokens,
        num_experts, num_experts // num_ranks,
        META_W=out.shape[1], NUM_TOPK=num_topk, HAS_W=has_w, W_OFF=1 + num_topk, NUM_RANKS=num_ranks, CAP=capacity,
        BLOCK_T=64 if _INTERPRET else 32, BLOCK_K=next_power_of_two(max(num_topk, 1)),
        BLOCK_R=max(2, next_power_of_two(num_ranks)), BLOCK_M=min(next_power_of_two(capacity), 256 if _INTERPRET else 1024),
        PDL=False, num_warps=4)
    return slot


@planned("ep_ll_send_meta")
def ll_send_meta(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], num_experts: int, num_ranks: int,
                 capacity: int, out: torch.Tensor) -> torch.Tensor:
    """Send slots and metadata rows of a fixed-capacity dispatch.

    Args:
        topk_idx: int64 / int32 ``(T, k)`` (any strides), ``T <= capacity``: expert ids in ``[0, num_experts)``,
            ``-1`` = unused slot; ids outside ``[-1, num_experts)`` are ignored (with ``TRITILE_CHECKS=1`` they raise
            ``ValueError``, a host sync).
        topk_weights: float32 ``(T, k)`` (any strides) or None.
        num_experts: ``E``, divisible by ``num_ranks``; num_ranks: ``R``; capacity: ``M``.
        out: int32 ``(R*M, W)``, contiguous, ``W >= 1 + k`` (``1 + 2k`` with weights), written: block ``r`` holds
            the tokens sent to rank ``r`` in ascending order, :func:`tritile.ep.pack.pack_meta`'s row layout
            ``[t, ids..., weight bits...]`` with ids local to rank ``r``, then rows whose source token is ``-1``
            (padding; their other words are left as they are).  The words past the ids and weights (the FP8
            rows' scale words) are left to :func:`ll_cast_send`.

    Returns:
        int32 ``(T, R)``: the position of token ``t`` among the tokens sent to rank ``r``, ``-1`` where not sent
        (:func:`tritile.ep.layout.dispatch_layout`'s ``send_slot``).
    """
    check_layout_args(topk_idx, num_experts, num_ranks)
    num_tokens, k = topk_idx.shape
    if num_tokens > capacity:
        raise ValueError(f"topk_idx has {num_tokens} tokens, more than the capacity {capacity}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
        if tuple(topk_weights.shape) != (num_tokens, k):
            raise ValueError(f"topk_weights must have shape {(num_tokens, k)}, got {tuple(topk_weights.shape)}")
    width = 1 + k * (2 if topk_weights is not None else 1)
    check_tensor("out", out, dtypes=(torch.int32,), ndim=2)
    if out.shape[0] != num_ranks * capacity or out.shape[1] < width or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({num_ranks * capacity}, W >= {width}) tensor, got "
                         f"{tuple(out.shape)}")
    if checks_enabled():
        raise_on_bad_ids(topk_idx, num_experts)
    return _ll_send_meta_op(topk_idx, topk_weights, int(num_experts), int(num_ranks), int(capacity), out)


@triton.jit
def _ll_cast_send_kernel(x_ptr, stride_xm, slot_ptr, out_ptr, sf_ptr, num_tokens, K, num_ks,
                         META_W: tl.constexpr, NUM_RANKS: tl.constexpr, CAP: tl.constexpr, ROUND_SF: tl.constexpr,
                         PACKED: tl.constexpr, CLAMP: tl.constexpr, MAX: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    G: tl.constexpr = BLOCK_K // 128
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < num_tokens
    col0 = pk * BLOCK_K
    # per_token_cast's e4m3 cast with 1 x 128 scales (the same helpers, so the same bits), stored once per rank
    x = _load_tile(x_ptr, x_ptr, rows, row_ok, col0, K, stride_xm, 0, 0, 0, BLOCK_M, BLOCK_K, 0, 1, 1, False)
    sf, sf_inv = quant_scale(_amax_of(x, BLOCK_M, 1, G, 128, False), CLAMP, MAX, ROUND_SF)
    v = _scale_tile(x, sf_inv, BLOCK_M, 1, G, 128)
    NO_ROW: tl.constexpr = NUM_RANKS * CAP  # the destination of an unsent (token, rank): masked off
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(slot_ptr + rows * NUM_RANKS + r, mask=row_ok, other=-1)
        sent = row_ok & (slot >= 0)
        dst = tl.where(sent, r * CAP + slot, NO_ROW).to(tl.int64)
        _store_codes(out_ptr, x, v, dst, sent, col0, K, K, BLOCK_M, BLOCK_K, False)
        _store_sf(sf_ptr, sf, dst, pk * G, NO_ROW, num_ks, META_W, 1, BLOCK_M, G, PACKED)


def _ll_cast_send_fake(x, send_slot, capacity, round_sf, use_ue8m0, out, meta):
    return None


@custom_op("ep_ll_cast_send", mutates_args=("out", "meta"), fake=_ll_cast_send_fake)
def _ll_cast_send_op(x: torch.Tensor, send_slot: torch.Tensor, capacity: int, round_sf: bool, use_ue8m0: bool,
                     out: torch.Tensor, meta: torch.Tensor) -> None:
    num_tokens, hidden = x.shape
    num_ranks = send_slot.shape[1]
    num_ks = ceil_div(hidden, 128)
    sw = ceil_div(num_ks, 4) if use_ue8m0 else num_ks
    if not kernel_device_ok(x.device):
        from .ref import ll_cast_send_ref

        for dst, codes, words in ll_cast_send_ref(x, send_slot, capacity, round_sf, use_ue8m0):
            out.view(torch.uint8)[dst] = codes
            meta[dst, meta.shape[1] - sw:] = words
        return
    if num_tokens == 0 or hidden == 0:
        return
    bm = 16 if _INTERPRET else 8
    bk = 512  # four 128-wide groups: one packed UE8M0 word
    sf_base = meta[:, meta.shape[1] - sw:]
    _ll_cast_send_kernel[(ceil_div(num_tokens, bm), ceil_div(hidden, bk))](
        x.view(torch.int16), x.stride(0), send_slot, out.view(torch.uint8),
        sf_base if use_ue8m0 else sf_base.view(torch.float32), num_tokens, hidden, num_ks,
        META_W=meta.shape[1], NUM_RANKS=num_ranks, CAP=capacity, ROUND_SF=bool(round_sf), PACKED=bool(use_ue8m0),
        CLAMP=FMT_CLAMP["e4m3"], MAX=FMT_MAX["e4m3"], BLOCK_M=bm, BLOCK_K=bk, PDL=False, num_warps=4)


@planned("ep_ll_cast_send")
def ll_cast_send(x: torch.Tensor, send_slot: torch.Tensor, capacity: int, round_sf: bool, use_ue8m0: bool,
                 out: torch.Tensor, meta: torch.Tensor) -> None:
    """The FP8 cast of a fixed-capacity dispatch, written straight into the send buffers.

    Token ``t``'s row is cast as ``tritile.quant.per_token_cast(x, "e4m3", 128, round_sf=round_sf,
    use_packed_ue8m0=use_ue8m0)`` casts it (the same bits) and stored, for every rank ``r`` with
    ``send_slot[t, r] >= 0``, in row ``r * capacity + send_slot[t, r]`` of ``out`` with its scales in the last
    words of the same row of ``meta``.

    Args:
        x: bfloat16 ``(T, H)``, unit inner stride.
        send_slot: int32 ``(T, R)``, contiguous (:func:`ll_send_meta`'s).
        capacity: ``M``.
        round_sf, use_ue8m0: power-of-two scales; UE8M0 exponents packed four to an int32 word (``ceil(H/512)``
            words a row, else ``ceil(H/128)`` float32 scales as int32 words).
        out: float8_e4m3fn ``(R*M, H)``, contiguous, written on the sent rows.
        meta: int32 ``(R*M, W)``, contiguous: the scale words go into each sent row's last words.
    """
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    check_tensor("send_slot", send_slot, dtypes=(torch.int32,), ndim=2)
    check_tensor("out", out, dtypes=(torch.float8_e4m3fn,), ndim=2)
    check_tensor("meta", meta, dtypes=(torch.int32,), ndim=2)
    num_tokens, hidden = x.shape
    rm = send_slot.shape[1] * capacity
    num_ks = ceil_div(hidden, 128)
    sw = ceil_div(num_ks, 4) if use_ue8m0 else num_ks
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have a unit inner stride, got strides {tuple(x.stride())}")
    if send_slot.shape[0] != num_tokens or not send_slot.is_contiguous():
        raise ValueError(f"send_slot must be a contiguous ({num_tokens}, R) tensor, got {tuple(send_slot.shape)}")
    if tuple(out.shape) != (rm, hidden) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({rm}, {hidden}) tensor, got {tuple(out.shape)}")
    if meta.shape[0] != rm or meta.shape[1] < sw or not meta.is_contiguous():
        raise ValueError(f"meta must be a contiguous ({rm}, W >= {sw}) tensor, got {tuple(meta.shape)}")
    _ll_cast_send_op(x, send_slot, int(capacity), bool(round_sf), bool(use_ue8m0), out, meta)


@triton.jit
def _ll_receive_kernel(meta_ptr, pos_ptr, count_ptr, info_ptr, range_ptr, w_ptr, sf_ptr, s_se, s_sr, s_sw,
                       META_W: tl.constexpr, NUM_LOCAL: tl.constexpr, NUM_RANKS: tl.constexpr, CAP: tl.constexpr,
                       NUM_TOPK: tl.constexpr, HAS_W: tl.constexpr, W_OFF: tl.constexpr, SF_W: tl.constexpr,
                       SF_OFF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_enter(PDL)
    e = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    kin = kk[None, :] < NUM_TOPK
    ss = tl.arange(0, BLOCK_S)
    sin = ss[None, :] < SF_W
    RM: tl.constexpr = NUM_RANKS * CAP
    if e < NUM_LOCAL:
        running = tl.sum(tl.zeros([BLOCK_M], tl.int32), axis=0)
        for s in tl.static_range(NUM_RANKS):
            begin = running
            for c in tl.static_range(0, CAP, BLOCK_M):
                i = c + tl.arange(0, BLOCK_M)
                rows = (s * CAP + i).to(tl.int64)
                ok = i < CAP
                tok = tl.load(meta_ptr + rows * META_W, mask=ok, other=-1)
                live = ok & (tok >= 0)  # a padding row (source token -1) selects nothing
                idx = tl.load(meta_ptr + rows[:, None] * META_W + 1 + kk[None, :], mask=live[:, None] & kin,
                              other=-1)
                sel = (idx == e) & live[:, None] & kin
                hit = tl.max(sel.to(tl.int32), axis=1)
                p = running + tl.cumsum(hit, axis=0) - 1
                tl.store(pos_ptr + rows[:, None] * NUM_TOPK + kk[None, :], (e * RM + p)[:, None] + kk[None, :] * 0,
                         mask=sel)
                tl.store(info_ptr + e * RM + p, tok, mask=hit != 0)
                if SF_W > 0:
                    put = (hit != 0)[:, None] & sin
                    sf = tl.load(meta_ptr + rows[:, None] * META_W + SF_OFF + ss[None, :], mask=put, other=0)
                    tl.store(sf_ptr + e.to(tl.int64) * s_se + p[:, None].to(tl.int64) * s_sr + ss[None, :] * s_sw,
                             sf, mask=put)
                running += tl.sum(hit, axis=0)
            tl.store(range_ptr + e * NUM_RANKS + s, (begin.to(tl.int64) << 32) | (running - begin).to(tl.int64))
        tl.store(count_ptr + e, running)
        for c in tl.static_range(0, RM, BLOCK_M):
            j = c + tl.arange(0, BLOCK_M)
            tl.store(info_ptr + e * RM + j, tl.full([BLOCK_M], -1, tl.int32), mask=(j < RM) & (j >= running))
    else:
        for c in tl.static_range(0, RM, BLOCK_M):
            rows = (c + tl.arange(0, BLOCK_M)).to(tl.int64)
            ok = rows < RM
            tok = tl.load(meta_ptr + rows * META_W, mask=ok, other=-1)
            live = ok & (tok >= 0)
            idx = tl.load(meta_ptr + rows[:, None] * META_W + 1 + kk[None, :], mask=live[:, None] & kin, other=-1)
            bad = ok[:, None] & kin & ((idx < 0) | (idx >= NUM_LOCAL))
            tl.store(pos_ptr + rows[:, None] * NUM_TOPK + kk[None, :], tl.full([BLOCK_M, BLOCK_K], -1, tl.int32),
                     mask=bad)
            if HAS_W:
                w = tl.load(meta_ptr + rows[:, None] * META_W + W_OFF + kk[None, :], mask=live[:, None] & kin,
                            other=0)
                tl.store(w_ptr + rows[:, None] * NUM_TOPK + kk[None, :], w.to(tl.float32, bitcast=True),
                         mask=ok[:, None] & kin)


def _ll_receive_fake(meta, num_topk, has_w, sf_words, num_local_experts, num_ranks, capacity, recv_count, recv_sf):
    rm = num_ranks * capacity
    return (meta.new_empty((rm, num_topk)), meta.new_empty((num_local_experts, rm)),
            meta.new_empty((num_local_experts, num_ranks), dtype=torch.int64),
            meta.new_empty((rm, num_topk if has_w else 0), dtype=torch.float32))


@custom_op("ep_ll_receive", mutates_args=("recv_count", "recv_sf"), fake=_ll_receive_fake)
def _ll_receive_op(meta: torch.Tensor, num_topk: int, has_w: bool, sf_words: int, num_local_experts: int,
                   num_ranks: int, capacity: int, recv_count: torch.Tensor, recv_sf: Optional[torch.Tensor]
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = meta.device
    rm = num_ranks * capacity
    pos = empty((rm, num_topk), torch.int32, dev)
    info = empty((num_local_experts, rm), torch.int32, dev)
    rng = empty((num_local_experts, num_ranks), torch.int64, dev)
    w = empty((rm, num_topk if has_w else 0), torch.float32, dev)
    if not kernel_device_ok(dev) or rm == 0:
        from .ref import ll_receive_ref

        got = ll_receive_ref(meta, num_topk, has_w, sf_words, num_local_experts, num_ranks, capacity)
        for o, r in zip((pos, recv_count, info, rng, w), got[:5]):
            o.copy_(r)
        if recv_sf is not None:
            for e, n in enumerate(got[1].tolist()):
                recv_sf[e, :n] = got[5][e, :n]
        return pos, info, rng, w
    bm = min(next_power_of_two(capacity), 256 if _INTERPRET else 128)
    sf = recv_sf if recv_sf is not None else meta
    _ll_receive_kernel[(num_local_experts + 1,)](
        meta, pos, recv_count, info, rng, w, sf, sf.stride(0), sf.stride(1), sf.stride(-1),
        META_W=meta.shape[1], NUM_LOCAL=num_local_experts, NUM_RANKS=num_ranks, CAP=capacity, NUM_TOPK=num_topk,
        HAS_W=has_w, W_OFF=1 + num_topk, SF_W=sf_words, SF_OFF=meta.shape[1] - sf_words, BLOCK_M=bm,
        BLOCK_K=next_power_of_two(max(num_topk, 1)), BLOCK_S=next_power_of_two(max(sf_words, 1)), PDL=False,
        num_warps=4)
    return pos, info, rng, w


@planned("ep_ll_receive")
def ll_receive(meta: torch.Tensor, num_topk: int, has_w: bool, sf_words: int, num_local_experts: int, num_ranks: int,
               capacity: int, recv_count: torch.Tensor, recv_sf: Optional[torch.Tensor] = None):
    """Slab positions, counts and scales of the rows received in fixed-capacity blocks, from their metadata.

    Args:
        meta: int32 ``(R*M, W)``, contiguous: the received metadata rows, :func:`tritile.ep.pack.pack_meta`'s
            layout with local expert ids (``[t, ids..., weight bits..., scale words...]``, ``W =
            meta_width(k, True, has_w, sf_words)``); row ``s*M + i`` is the ``i``-th row from source rank ``s``;
            a row whose source token ``t`` is negative is padding.
        num_topk: ``k``; has_w: whether the rows carry weights; sf_words: scale words per row (0: none).
        num_local_experts: ``L``; num_ranks: ``R``; capacity: ``M``.
        recv_count: int32 ``(L,)``, written: rows per expert.
        recv_sf: int32 ``(L, R*M, sf_words)`` (any strides, e.g. the column-major receive scales viewed as int32),
            written: row ``j`` of slab ``e`` gets the scale words of the row placed there (rows past the count are
            left as they are); None when ``sf_words`` is 0.

    Returns:
        ``(pos, src_info, layout_range, recv_weights)``: int32 ``(R*M, k)`` flat slab row ``e*R*M + j`` of each
        (row, slot) (``-1`` for slots of other ranks' experts and of padding rows); int32 ``(L, R*M)`` source token
        of each slab row (``-1`` past the count); int64 ``(L, R)`` ``(begin << 32) | count`` per source rank;
        float32 ``(R*M, k)`` weights (0 on padding rows; ``(R*M, 0)`` without ``has_w``).
    """
    check_tensor("meta", meta, dtypes=(torch.int32,), ndim=2)
    check_tensor("recv_count", recv_count, dtypes=(torch.int32,), ndim=1)
    rm = num_ranks * capacity
    width = 1 + num_topk + (num_topk if has_w else 0) + sf_words
    if tuple(meta.shape) != (rm, width) or recv_count.shape[0] != num_local_experts:
        raise ValueError(f"meta must be (R*M, W) = ({rm}, {width}) and recv_count ({num_local_experts},), got "
                         f"{tuple(meta.shape)} and {tuple(recv_count.shape)}")
    if (recv_sf is None) != (sf_words == 0):
        raise ValueError(f"recv_sf must be given exactly when sf_words > 0 (sf_words={sf_words})")
    if recv_sf is not None:
        check_tensor("recv_sf", recv_sf, dtypes=(torch.int32,), ndim=3)
        if tuple(recv_sf.shape) != (num_local_experts, rm, sf_words):
            raise ValueError(f"recv_sf must be ({num_local_experts}, {rm}, {sf_words}), got {tuple(recv_sf.shape)}")
    return _ll_receive_op(meta.contiguous(), int(num_topk), bool(has_w), int(sf_words), int(num_local_experts),
                          int(num_ranks), int(capacity), recv_count, recv_sf)


# ---------------------------------------------------------------------------------------------------------------
# A dispatch's two sides of the exchange, one plan each (the eager host path replays one record, not two)
# ---------------------------------------------------------------------------------------------------------------
@planned("ep_ll_pack")
def ll_pack(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], x: torch.Tensor, num_experts: int,
            num_ranks: int, capacity: int, round_sf: bool, use_ue8m0: bool, meta: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
    """:func:`ll_send_meta` then :func:`ll_cast_send`: the send slots, the metadata rows and the FP8 rows of a
    fixed-capacity dispatch.  ``out``: float8_e4m3fn ``(R*M, H)``; ``meta``: int32 ``(R*M, W)`` with room for the
    scale words.  Returns the send slots (int32 ``(T, R)``)."""
    slot = ll_send_meta(topk_idx, topk_weights, num_experts, num_ranks, capacity, meta)
    ll_cast_send(x, slot, capacity, round_sf, use_ue8m0, out, meta)
    return slot


@planned("ep_ll_unpack")
def ll_unpack(meta: torch.Tensor, rows: torch.Tensor, num_topk: int, has_w: bool, sf_words: int,
              num_local_experts: int, num_ranks: int, capacity: int, recv_count: torch.Tensor,
              recv_sf: Optional[torch.Tensor], zeros_k: torch.Tensor, slab: torch.Tensor):
    """:func:`ll_receive` then the received ``rows`` (words, ``(R*M, W)``) into ``slab`` (``(L*R*M, W)``) at their
    slab positions (:func:`tritile.ep.pack.scatter_rows_into`; ``zeros_k``: int32 ``(k,)`` zeros).  Returns
    :func:`ll_receive`'s ``(pos, src_info, layout_range, recv_weights)``."""
    res = ll_receive(meta, num_topk, has_w, sf_words, num_local_experts, num_ranks, capacity, recv_count, recv_sf)
    scatter_rows_into(rows, res[0], zeros_k, slab)
    return res
