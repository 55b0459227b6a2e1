"""Pack and unpack: rows into per-destination send buffers, per-row metadata, row gathers.

Rows travel as raw words (int32 when the row's byte count is a multiple of 4, else int16 or uint8), so one
kernel moves bf16, FP8 and packed-scale payloads alike, and every collective sees plain integer bytes (gloo has
no FP8 dtype).

* :func:`pack_rows` scatters token rows to ``base[r] + send_slot[t, r]`` for every destination rank ``r``.
* :func:`pack_meta` builds the per-row metadata the receiver needs (int32 words, one row per sent copy):
  ``[source token, k local expert ids (-1 where the expert lives elsewhere), k weights (0.0 at -1 slots) as
  float32 bits, scale words]`` (the id / weight / scale groups present only when used).
* :func:`gather_rows` ``out[o] = src[row_map[o]]`` (zeros where ``row_map[o] < 0``): the fixed-capacity
  (sync-free) receive compaction and its reverse in combine.
* :func:`unpack_meta` splits received metadata into ``recv_topk_idx`` (int64), ``recv_topk_weights``,
  ``recv_src_idx`` and the scale words, optionally through a row map (padding rows: ids ``-1``, weights 0,
  source ``-1``, scales 0).

Every function has a pure-torch twin in :mod:`tritile.ep.ref`; CPU tensors without the interpreter use it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language.pdl import pdl_enter
from ..runtime import check_tensor, custom_op, empty, interpreter_configs, kernel_device_ok
from ..runtime.plan import planned
from ..utils import ceil_div, next_power_of_two

__all__ = ["as_words", "pack_rows", "pack_meta", "gather_rows", "unpack_meta", "meta_width", "scatter_rows_into",
           "pack_meta_into"]

_INTERPRET = interpreter_configs()


def as_words(t: torch.Tensor) -> torch.Tensor:
    """View a 2D tensor with unit inner stride as ``(rows, words)`` of the widest of int32 / int16 / uint8 that
    divides both its row's byte count and its row stride."""
    if t.dim() != 2:
        raise ValueError(f"expected a 2D tensor, got shape {tuple(t.shape)}")
    nbytes = t.shape[1] * t.element_size()
    sbytes = t.stride(0) * t.element_size()
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"rows must have a unit inner stride, got strides {tuple(t.stride())}")
    if t.shape[0] <= 1 or t.shape[1] <= 1:
        t = t.contiguous()  # at most one row (or column): a free or tiny copy, any stride is fine
        sbytes = t.stride(0) * t.element_size()
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    for dt, w in ((torch.int32, 4), (torch.int16, 2)):
        if nbytes % w == 0 and sbytes % w == 0 and u8.storage_offset() % w == 0:
            if t.shape[1] == 0:
                return torch.empty((t.shape[0], 0), dtype=dt, device=t.device)
            return u8.view(dt)
    return u8


def meta_width(num_topk: int, has_idx: bool, has_w: bool, sf_words: int) -> int:
    """Words per metadata row: source token, then k ids, k weights, scale words (when present)."""
    return 1 + (num_topk if has_idx else 0) + (num_topk if has_w else 0) + sf_words


@triton.jit
def _row_block(num_rows, BLOCK_T: tl.constexpr):
    """This program's ``BLOCK_T`` rows along grid axis 0 (int64) and their mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    return rows, rows < num_rows


@triton.jit
def _word_tile(num_rows, num_words, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    """This program's ``[BLOCK_T, BLOCK_W]`` tile of row words: rows (grid axis 0) and word columns (axis 1), int64,
    with their masks."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    return rows, cols, rows < num_rows, cols < num_words


@triton.jit
def _pack_rows_kernel(x_ptr, stride_x, out_ptr, slot_ptr, base_ptr, num_tokens, num_words,
                      NUM_RANKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rows, cols, row_ok, col_ok = _word_tile(num_tokens, num_words, BLOCK_T, BLOCK_W)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok[None, :])
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(slot_ptr + rows * NUM_RANKS + r, mask=row_ok, other=-1)
        dst = tl.load(base_ptr + r).to(tl.int64) + slot
        tl.store(out_ptr + dst[:, None] * num_words + cols[None, :], x, mask=(slot >= 0)[:, None] & col_ok[None, :])


def _rows_config(num_words: int) -> dict:
    """Row-copy tiles: the column block (a power of two, 256 to 2048 words) that wastes the fewest masked lanes
    (7168 bf16 = 3584 words: 512 x 7; 7168 fp8 = 1792 words: 256 x 7), and enough rows per program to move
    about 8 KiB."""
    if _INTERPRET:
        return dict(BLOCK_T=16, BLOCK_W=min(next_power_of_two(max(num_words, 1)), 1024), num_warps=1)
    w = max(num_words, 1)
    if w <= 2048:
        bw = next_power_of_two(w)
    else:
        bw = min((2048, 1024, 512, 256), key=lambda b: (ceil_div(w, b) * b - w, -b))
    bt = max(1, 2048 // bw)
    return dict(BLOCK_T=bt, BLOCK_W=bw, num_warps=4 if bt * bw >= 1024 else 2)


def _pack_rows_fake(x, send_slot, base, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


@custom_op("ep_pack_rows", fake=_pack_rows_fake)
def _pack_rows_op(x: torch.Tensor, send_slot: torch.Tensor, base: torch.Tensor, num_rows: int) -> torch.Tensor:
    return scatter_rows_into(x, send_slot, base, empty((num_rows, x.shape[1]), x.dtype, x.device))


@planned("ep_scatter_rows_into")
def scatter_rows_into(x: torch.Tensor, send_slot: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`pack_rows` into a given contiguous ``out`` (internal: no checks; rows no slot targets keep their
    contents)."""
    num_rows = out.shape[0]
    if not kernel_device_ok(x.device):
        from .ref import pack_rows_ref

        hit = torch.zeros((num_rows,), dtype=torch.bool, device=out.device)
        for r in range(send_slot.shape[1]):
            sel = send_slot[:, r] >= 0
            hit[base[r].long() + send_slot[sel, r].long()] = True
        out[hit] = pack_rows_ref(x, send_slot, base, num_rows)[hit]
        return out
    num_tokens, num_words = x.shape
    if num_tokens == 0 or num_words == 0 or num_rows == 0:
        return out
    cfg = _rows_config(num_words)
    grid = (ceil_div(num_tokens, cfg["BLOCK_T"]), ceil_div(num_words, cfg["BLOCK_W"]))
    _pack_rows_kernel[grid](x, x.stride(0), out, send_slot, base, num_tokens, num_words,
                            NUM_RANKS=send_slot.shape[1], BLOCK_T=cfg["BLOCK_T"], BLOCK_W=cfg["BLOCK_W"], PDL=False,
                            num_warps=cfg["num_warps"])
    return out


@planned("ep_pack_rows")
def pack_rows(x: torch.Tensor, send_slot: torch.Tensor, base: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Scatter token rows into a send buffer grouped by destination rank.

    Args:
        x: ``(T, W)`` words (int32 / int16 / uint8, see :func:`as_words`), unit inner stride, any row stride.
        send_slot: int32 ``(T, R)``, contiguous: position of token ``t`` among the rows sent to rank ``r``, or
            ``-1`` (from :func:`tritile.ep.layout.dispatch_layout`).
        base: int32 ``(R,)``: first row of rank ``r``'s block in the send buffer (the exclusive prefix of the
            send counts, or ``r * M`` for fixed-capacity blocks).
        num_rows: rows of the send buffer.

    Returns:
        ``(num_rows, W)`` of ``x.dtype``: ``out[base[r] + send_slot[t, r]] = x[t]``; rows no token targets are
        left unwritten.
    """
    check_tensor("x", x, dtypes=(torch.int32, torch.int16, torch.uint8), ndim=2)
    check_tensor("send_slot", send_slot, dtypes=(torch.int32,), ndim=2)
    check_tensor("base", base, dtypes=(torch.int32,), ndim=1)
    if send_slot.shape[0] != x.shape[0] or base.shape[0] != send_slot.shape[1]:
        raise ValueError(f"send_slot must be ({x.shape[0]}, R) and base (R,), got {tuple(send_slot.shape)} "
                         f"and {tuple(base.shape)}")
    return _pack_rows_op(x, send_slot.contiguous(), base.contiguous(), int(num_rows))


@triton.jit
def _store_meta_row(out_ptr, dst, sent, rows, idx, w, lo, experts_per_rank, kk, NUM_TOPK: tl.constexpr,
                    HAS_IDX: tl.constexpr, HAS_W: tl.constexpr, W_OFF: tl.constexpr):
    """Store the metadata words of the rows at word offsets ``dst`` (where ``sent``): the source token, then the ids
    local to the rank whose experts start at ``lo`` (others ``-1``) and their weights' bits (others ``0.0``)."""
    tl.store(out_ptr + dst, rows.to(tl.int32), mask=sent)
    if HAS_IDX:
        local = (idx >= lo) & (idx < lo + experts_per_rank)
        tl.store(out_ptr + dst[:, None] + 1 + kk[None, :], tl.where(local, idx - lo, -1),
                 mask=sent[:, None] & (kk[None, :] < NUM_TOPK))
        if HAS_W:
            wl = tl.where(local, w, 0.0)
            tl.store(out_ptr + dst[:, None] + W_OFF + kk[None, :], wl.to(tl.int32, bitcast=True),
                     mask=sent[:, None] & (kk[None, :] < NUM_TOPK))


@triton.jit
def _pack_meta_kernel(idx_ptr, s_it, s_ik, w_ptr, s_wt, s_wk, sf_ptr, s_st, s_sk, out_ptr, slot_ptr, base_ptr,
                      num_tokens, experts_per_rank,
                      META_W: tl.constexpr, NUM_TOPK: tl.constexpr, HAS_IDX: tl.constexpr, HAS_W: tl.constexpr,
                      SF_W: tl.constexpr, W_OFF: tl.constexpr, SF_OFF: tl.constexpr, NUM_RANKS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rows, row_ok = _row_block(num_tokens, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    km = row_ok[:, None] & (kk[None, :] < NUM_TOPK)
    ss = tl.arange(0, BLOCK_S)
    sm = row_ok[:, None] & (ss[None, :] < SF_W)
    if HAS_IDX:
        idx = tl.load(idx_ptr + rows[:, None] * s_it + kk[None, :] * s_ik, mask=km, other=-1)
        # ids outside [0, E) as -1 before the int32 cast (which would wrap ids past 2**31 into range)
        idx = tl.where((idx >= 0) & (idx < NUM_RANKS * experts_per_rank), idx, -1).to(tl.int32)
    else:
        idx = kk[None, :]  # unused (HAS_IDX is off)
    if HAS_W:
        w = tl.load(w_ptr + rows[:, None] * s_wt + kk[None, :] * s_wk, mask=km, other=0.0)
    else:
        w = idx  # unused (HAS_W is off)
    if SF_W > 0:
        sf = tl.load(sf_ptr + rows[:, None] * s_st + ss[None, :] * s_sk, mask=sm, other=0)
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(slot_ptr + rows * NUM_RANKS + r, mask=row_ok, other=-1)
        dst = (tl.load(base_ptr + r).to(tl.int64) + slot) * META_W
        sent = slot >= 0
        _store_meta_row(out_ptr, dst, sent, rows, idx, w, r * experts_per_rank, experts_per_rank, kk, NUM_TOPK,
                        HAS_IDX, HAS_W, W_OFF)
        if SF_W > 0:
            tl.store(out_ptr + dst[:, None] + SF_OFF + ss[None, :], sf, mask=sent[:, None] & (ss[None, :] < SF_W))


def _pack_meta_fake(topk_idx, topk_weights, sf, send_slot, base, num_rows, experts_per_rank, num_topk, fill):
    width = meta_width(num_topk, topk_idx is not None, topk_weights is not None, 0 if sf is None else sf.shape[1])
    return send_slot.new_empty((num_rows, width))


@custom_op("ep_pack_meta", fake=_pack_meta_fake)
def _pack_meta_op(topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], sf: Optional[torch.Tensor],
                  send_slot: torch.Tensor, base: torch.Tensor, num_rows: int, experts_per_rank: int,
                  num_topk: int, fill: Optional[int]) -> torch.Tensor:
    sf_w = 0 if sf is None else sf.shape[1]
    width = meta_width(num_topk, topk_idx is not None, topk_weights is not None, sf_w)
    if fill is None:
        out = empty((num_rows, width), torch.int32, send_slot.device)
    else:
        out = torch.full((num_rows, width), fill, dtype=torch.int32, device=send_slot.device)
    return pack_meta_into(topk_idx, topk_weights, sf, send_slot, base, experts_per_rank, num_topk, out)


@planned("ep_pack_meta_into")
def pack_meta_into(topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], sf: Optional[torch.Tensor],
                   send_slot: torch.Tensor, base: torch.Tensor, experts_per_rank: int, num_topk: int,
                   out: torch.Tensor) -> torch.Tensor:
    """:func:`pack_meta` into a given contiguous int32 ``out`` of the metadata width (internal: no checks; rows no
    slot targets keep their contents, so a caller that needs them marked fills ``out`` first)."""
    has_idx, has_w = topk_idx is not None, topk_weights is not None
    sf_w = 0 if sf is None else sf.shape[1]
    width = out.shape[1]
    num_rows = out.shape[0]
    if not kernel_device_ok(send_slot.device):
        from .ref import pack_meta_ref

        ref = pack_meta_ref(topk_idx, topk_weights, sf, send_slot, base, num_rows, experts_per_rank, num_topk)
        written = torch.zeros((num_rows,), dtype=torch.bool, device=out.device)
        for r in range(send_slot.shape[1]):
            sel = send_slot[:, r] >= 0
            written[base[r].long() + send_slot[sel, r].long()] = True
        out[written] = ref[written]
        return out
    num_tokens, num_ranks = send_slot.shape
    if num_tokens == 0 or num_rows == 0:
        return out
    bt = 64 if _INTERPRET else 32
    dummy = send_slot
    it = topk_idx if has_idx else dummy
    wt = topk_weights if has_w else dummy
    st = sf if sf_w else dummy
    _pack_meta_kernel[(ceil_div(num_tokens, bt),)](
        it, it.stride(0), it.stride(-1), wt, wt.stride(0), wt.stride(-1), st, st.stride(0), st.stride(-1), out,
        send_slot, base, num_tokens, experts_per_rank,
        META_W=width, NUM_TOPK=num_topk, HAS_IDX=has_idx, HAS_W=has_w, SF_W=sf_w, W_OFF=1 + num_topk,
        SF_OFF=width - sf_w, NUM_RANKS=num_ranks, BLOCK_T=bt,
        BLOCK_K=next_power_of_two(max(num_topk, 1)), BLOCK_S=next_power_of_two(max(sf_w, 1)), PDL=False,
        num_warps=1)
    return out


@planned("ep_pack_meta")
def pack_meta(topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], sf: Optional[torch.Tensor],
              send_slot: torch.Tensor, base: torch.Tensor, num_rows: int, experts_per_rank: int,
              num_topk: int, fill: Optional[int] = None) -> torch.Tensor:
    """Per-row metadata of a send buffer (the rows of :func:`pack_rows` with the same slots).

    Args:
        topk_idx: int64/int32 ``(T, k)`` global expert ids (any strides) or None.
        topk_weights: float32 ``(T, k)`` or None (only with ``topk_idx``).
        sf: int32 ``(T, SW)`` scale words (float32 scales viewed as int32, or packed UE8M0), any strides, or None.
        send_slot, base, num_rows: as :func:`pack_rows`.
        experts_per_rank: ``L``; expert ``e`` is local index ``e - r*L`` on rank ``r``.
        num_topk: ``k`` (the width of the id / weight groups).
        fill: the value of every word of the rows no token targets (None: left unwritten).

    Returns:
        int32 ``(num_rows, meta_width(k, ids?, weights?, SW))``: per row ``[t, local ids..., weight bits...,
        scale words...]``; ids outside rank ``r``'s experts become ``-1`` and their weights ``0.0``.
    """
    check_tensor("send_slot", send_slot, dtypes=(torch.int32,), ndim=2)
    if topk_weights is not None and topk_idx is None:
        raise ValueError("topk_weights needs topk_idx")
    return _pack_meta_op(topk_idx, topk_weights, sf, send_slot.contiguous(), base.contiguous(), int(num_rows),
                         int(experts_per_rank), int(num_topk), None if fill is None else int(fill))


@triton.jit
def _gather_rows_kernel(src_ptr, stride_s, map_ptr, out_ptr, num_out, num_words,
                        BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rows, cols, row_ok, col_ok = _word_tile(num_out, num_words, BLOCK_T, BLOCK_W)
    src = tl.load(map_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    v = tl.load(src_ptr + src[:, None] * stride_s + cols[None, :], mask=(src >= 0)[:, None] & col_ok[None, :],
                other=0)
    tl.store(out_ptr + rows[:, None] * num_words + cols[None, :], v, mask=row_ok[:, None] & col_ok[None, :])


def _gather_rows_fake(src, row_map):
    return src.new_empty((row_map.shape[0], src.shape[1]))


@custom_op("ep_gather_rows", fake=_gather_rows_fake)
def _gather_rows_op(src: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    out = empty((row_map.shape[0], src.shape[1]), src.dtype, src.device)
    if not kernel_device_ok(src.device):
        from .ref import gather_rows_ref

        out.copy_(gather_rows_ref(src, row_map))
        return out
    num_out, num_words = out.shape
    if num_out == 0 or num_words == 0:
        return out
    cfg = _rows_config(num_words)
    grid = (ceil_div(num_out, cfg["BLOCK_T"]), ceil_div(num_words, cfg["BLOCK_W"]))
    _gather_rows_kernel[grid](src, src.stride(0), row_map, out, num_out, num_words, BLOCK_T=cfg["BLOCK_T"],
                              BLOCK_W=cfg["BLOCK_W"], PDL=False, num_warps=cfg["num_warps"])
    return out


@planned("ep_gather_rows")
def gather_rows(src: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """``out[o] = src[row_map[o]]``, zeros where ``row_map[o] < 0``.

    Args:
        src: ``(S, W)`` words (int32 / int16 / uint8), unit inner stride.
        row_map: int32 ``(O,)`` source rows in ``[-1, S)``.

    Returns:
        ``(O, W)`` of ``src.dtype``, contiguous.
    """
    check_tensor("src", src, dtypes=(torch.int32, torch.int16, torch.uint8), ndim=2)
    check_tensor("row_map", row_map, dtypes=(torch.int32,), ndim=1)
    return _gather_rows_op(src, row_map.contiguous())


@triton.jit
def _unpack_meta_kernel(meta_ptr, map_ptr, idx_ptr, w_ptr, src_ptr, sf_ptr, num_out,
                        META_W: tl.constexpr, NUM_TOPK: tl.constexpr, HAS_IDX: tl.constexpr, HAS_W: tl.constexpr,
                        SF_W: tl.constexpr, W_OFF: tl.constexpr, SF_OFF: tl.constexpr, HAS_MAP: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rows, row_ok = _row_block(num_out, BLOCK_T)
    if HAS_MAP:
        src = tl.load(map_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    else:
        src = tl.where(row_ok, rows, -1)
    ok = src >= 0
    base = src * META_W
    tok = tl.load(meta_ptr + base, mask=ok, other=-1)
    ok = ok & (tok >= 0)  # a row sent as padding (source token -1) unpacks like a padding row
    tl.store(src_ptr + rows, tl.where(ok, tok, -1), mask=row_ok)
    kk = tl.arange(0, BLOCK_K)
    kin = kk[None, :] < NUM_TOPK
    if HAS_IDX:
        idx = tl.load(meta_ptr + base[:, None] + 1 + kk[None, :], mask=ok[:, None] & kin, other=-1)
        tl.store(idx_ptr + rows[:, None] * NUM_TOPK + kk[None, :], idx.to(tl.int64), mask=row_ok[:, None] & kin)
        if HAS_W:
            w = tl.load(meta_ptr + base[:, None] + W_OFF + kk[None, :], mask=ok[:, None] & kin, other=0)
            tl.store(w_ptr + rows[:, None] * NUM_TOPK + kk[None, :], w.to(tl.float32, bitcast=True),
                     mask=row_ok[:, None] & kin)
    if SF_W > 0:
        ss = tl.arange(0, BLOCK_S)
        sin = ss[None, :] < SF_W
        sf = tl.load(meta_ptr + base[:, None] + SF_OFF + ss[None, :], mask=ok[:, None] & sin, other=0)
        tl.store(sf_ptr + rows[:, None] * SF_W + ss[None, :], sf, mask=row_ok[:, None] & sin)


def _unpack_meta_fake(meta, row_map, num_topk, has_idx, has_w, sf_words):
    n = meta.shape[0] if row_map is None else row_map.shape[0]
    k = num_topk if has_idx else 0
    kw = num_topk if (has_idx and has_w) else 0
    return (meta.new_empty((n, k), dtype=torch.int64), meta.new_empty((n, kw), dtype=torch.float32),
            meta.new_empty((n,)), meta.new_empty((n, sf_words)))


@custom_op("ep_unpack_meta", fake=_unpack_meta_fake)
def _unpack_meta_op(meta: torch.Tensor, row_map: Optional[torch.Tensor], num_topk: int, has_idx: bool, has_w: bool,
                    sf_words: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = meta.shape[0] if row_map is None else row_map.shape[0]
    dev = meta.device
    k = num_topk if has_idx else 0
    kw = num_topk if (has_idx and has_w) else 0
    idx = empty((n, k), torch.int64, dev)
    w = empty((n, kw), torch.float32, dev)
    src = empty((n,), torch.int32, dev)
    sf = empty((n, sf_words), torch.int32, dev)
    if not kernel_device_ok(dev):
        from .ref import unpack_meta_ref

        for o, r in zip((idx, w, src, sf), unpack_meta_ref(meta, row_map, num_topk, has_idx, has_w, sf_words)):
            o.copy_(r)
        return idx, w, src, sf
    if n == 0:
        return idx, w, src, sf
    bt = 64 if _INTERPRET else 32
    _unpack_meta_kernel[(ceil_div(n, bt),)](
        meta, meta if row_map is None else row_map, idx, w, src, sf, n,
        META_W=meta.shape[1], NUM_TOPK=num_topk, HAS_IDX=has_idx, HAS_W=has_idx and has_w, SF_W=sf_words,
        W_OFF=1 + num_topk, SF_OFF=meta.shape[1] - sf_words, HAS_MAP=row_map is not None, BLOCK_T=bt,
        BLOCK_K=next_power_of_two(max(num_topk, 1)), BLOCK_S=next_power_of_two(max(sf_words, 1)), PDL=False,
        num_warps=1)
    return idx, w, src, sf


@planned("ep_unpack_meta")
def unpack_meta(meta: torch.Tensor, row_map: Optional[torch.Tensor], num_topk: int, has_idx: bool, has_w: bool,
                sf_words: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split received metadata rows (the layout of :func:`pack_meta`).

    Args:
        meta: int32 ``(S, meta_width(...))``, contiguous.
        row_map: int32 ``(O,)`` (output row ``o`` reads ``meta[row_map[o]]``; ``-1`` = padding) or None (``O = S``).
        num_topk, has_idx, has_w, sf_words: the metadata layout.

    Returns:
        ``(topk_idx, topk_weights, src_idx, sf)``: int64 ``(O, k)`` local expert ids (``-1`` elsewhere and on
        padding rows; ``(O, 0)`` without ids), float32 ``(O, k)`` (``(O, 0)`` without weights; 0 on padding),
        int32 ``(O,)`` source token index (``-1`` on padding), int32 ``(O, sf_words)`` (0 on padding).  Padding
        rows are those with ``row_map < 0`` and those whose stored source token is negative (rows of a
        ``pack_meta(..., fill=-1)`` buffer that no token targeted).
    """
    check_tensor("meta", meta, dtypes=(torch.int32,), ndim=2)
    if row_map is not None:
        check_tensor("row_map", row_map, dtypes=(torch.int32,), ndim=1)
        row_map = row_map.contiguous()
    return _unpack_meta_op(meta.contiguous(), row_map, int(num_topk), bool(has_idx), bool(has_w), int(sf_words))
