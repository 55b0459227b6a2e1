"""``expand_to_fused`` / ``expand_to_fused_with_sf``: copy token rows (and their scale rows) to their
expert-major positions; zero the padding rows.

One launch.  The grid has two parts:

* token programs, one per ``[BT tokens, BH words]`` tile: load the tile once, store it to the ``K``
  positions of each token (``token_topk_to_pos``, ``-1`` skipped); the first column block also copies the
  tokens' scale rows;
* padding programs, one per ``PBT * PSUB`` output rows: rows with ``pos_to_expert < 0`` (only the sign is read)
  are zeroed, data and scales; blocks without padding exit after one small load.

``COMPACT`` loads a tile's ``[BT, K]`` positions at once and stores once per rank of valid slot instead of ``K``
times; ``PAD_FIRST`` gives the padding programs the low program ids.  Both are the default of
``expand_to_fused_with_sf`` (measured there); ``expand_to_fused`` keeps them as tune candidates.  A persistent
variant that loaded the next tile before storing the current one measured 108.7-149.0 us against 101.7-133.2 us
(H200, H200 @ 694bd6c) and was removed.

Data moves through an integer view of the widest word that divides the row (int32/int16/int8), so the
copy is bit-exact for every dtype on every backend.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..quant.types import QuantTensor
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import custom_op
from ..runtime import (check_device, check_inner_contiguous, check_same_device, check_tensor, checks_enabled, empty,
                       interpreter_configs, tuned)
from ..utils import align, ceil_div, next_power_of_two
from ..runtime.plan import planned

__all__ = ["expand_to_fused", "expand_to_fused_with_sf"]

_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


@triton.jit
def _tile_load(x_ptr, xs_ptr, pos_ptr, tile_id, num_tokens, num_expanded, hidden_w, hidden_sf,
               stride_x, stride_xs, stride_pt, stride_pk, num_col_blocks,
               K: tl.constexpr, KP: tl.constexpr, WITH_SF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
               BSF: tl.constexpr):
    """Token tile ``tile_id``: data ``[BT, BH]``, scales ``[BT, BSF]`` (column
    block 0 only; zeros without scales) and the ``[BT, KP]`` positions (``-1`` = none or out of range)."""
    rows = (tile_id // num_col_blocks).to(tl.int64) * BT + tl.arange(0, BT)
    cb = tile_id % num_col_blocks
    cols = cb * BH + tl.arange(0, BH)
    rm = rows < num_tokens
    k_ar = tl.arange(0, KP)
    pk = tl.load(pos_ptr + rows[:, None] * stride_pt + k_ar[None, :] * stride_pk,
                 mask=rm[:, None] & (k_ar < K)[None, :], other=-1)
    pk = tl.where((pk >= 0) & (pk < num_expanded), pk, -1)
    tile = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rm[:, None] & (cols < hidden_w)[None, :])
    s_ar = tl.arange(0, BSF)
    if WITH_SF:
        sft = tl.load(xs_ptr + rows[:, None] * stride_xs + s_ar[None, :],
                      mask=rm[:, None] & (s_ar < hidden_sf)[None, :] & (cb == 0))
    else:
        sft = tl.zeros([BT, BSF], dtype=tl.int32)
    return tile, sft, pk


@triton.jit
def _tile_store(out_ptr, outs_ptr, tile, sft, pk, tile_id, num_col_blocks, hidden_w, hidden_sf,
                stride_out, stride_os0, stride_os1,
                WITH_SF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BSF: tl.constexpr):
    """Store a tile of :func:`_tile_load` to each row's valid positions: each row's largest remaining position,
    drop it, repeat, so as many (predicated) stores as the tile's most valid slots per token.  A token's
    positions are distinct in a valid mapping; equal ones would get the same row anyway."""
    cb = tile_id % num_col_blocks
    cols = cb * BH + tl.arange(0, BH)
    cm = cols < hidden_w
    s_ar = tl.arange(0, BSF)
    sfm = (s_ar < hidden_sf) & (cb == 0)
    p = tl.max(pk, axis=1)
    while tl.max(p, axis=0) >= 0:
        ok = p >= 0
        p64 = tl.where(ok, p, 0).to(tl.int64)
        tl.store(out_ptr + p64[:, None] * stride_out + cols[None, :], tile, mask=ok[:, None] & cm[None, :])
        if WITH_SF:
            tl.store(outs_ptr + p64[:, None] * stride_os0 + s_ar[None, :] * stride_os1, sft,
                     mask=ok[:, None] & sfm[None, :])
        pk = tl.where(pk == p[:, None], -1, pk)
        p = tl.max(pk, axis=1)


@triton.jit
def _expand_to_fused_kernel(x_ptr, xs_ptr, out_ptr, outs_ptr, pos_ptr, pe_ptr,
                            num_tokens, num_expanded, hidden_w, hidden_sf,
                            stride_x, stride_xs, stride_out, stride_os0, stride_os1,
                            stride_pt, stride_pk, stride_pe, num_token_progs, num_col_blocks,
                            K: tl.constexpr, WITH_SF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                            BSF: tl.constexpr, PBT: tl.constexpr, PSUB: tl.constexpr, COL_ITERS: tl.constexpr,
                            KP: tl.constexpr, COMPACT: tl.constexpr, PAD_FIRST: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    t_ar = tl.arange(0, BT)
    h_ar = tl.arange(0, BH)
    s_ar = tl.arange(0, BSF)
    num_pad_progs = tl.num_programs(0) - num_token_progs
    if PAD_FIRST:
        # padding programs on the low ids: they start in the first wave and overlap the copy instead of
        # forming a tail of short programs after the last token tiles
        is_tok = pid >= num_pad_progs
        tok_pid = pid - num_pad_progs
        pad_pid = pid
    else:
        is_tok = pid < num_token_progs
        tok_pid = pid
        pad_pid = pid - num_token_progs
    if is_tok:
        if COMPACT:
            # all K positions of the tile in one [BT, KP] load (BT * K contiguous words) issued with the data
            # tile; then one store per rank of valid slot (1-2 at ep 64, each predicated store instruction of
            # the default's K per tile issues whether or not a row has that slot)
            tile, sft, pk = _tile_load(x_ptr, xs_ptr, pos_ptr, tok_pid, num_tokens, num_expanded, hidden_w,
                                       hidden_sf, stride_x, stride_xs, stride_pt, stride_pk, num_col_blocks,
                                       K, KP, WITH_SF, BT, BH, BSF)
            _tile_store(out_ptr, outs_ptr, tile, sft, pk, tok_pid, num_col_blocks, hidden_w, hidden_sf,
                        stride_out, stride_os0, stride_os1, WITH_SF, BT, BH, BSF)
        else:
            tb = tok_pid // num_col_blocks
            cb = tok_pid % num_col_blocks
            rows = tb.to(tl.int64) * BT + t_ar
            cols = cb * BH + h_ar
            rm = rows < num_tokens
            cm = cols < hidden_w
            tile = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rm[:, None] & cm[None, :])
            if WITH_SF:
                sfm = rm[:, None] & (s_ar < hidden_sf)[None, :] & (cb == 0)
                sft = tl.load(xs_ptr + rows[:, None] * stride_xs + s_ar[None, :], mask=sfm)
            for k in tl.static_range(K):
                p = tl.load(pos_ptr + rows * stride_pt + k * stride_pk, mask=rm, other=-1)
                ok = rm & (p >= 0) & (p < num_expanded)
                p64 = tl.where(ok, p, 0).to(tl.int64)
                tl.store(out_ptr + p64[:, None] * stride_out + cols[None, :], tile, mask=ok[:, None] & cm[None, :])
                if WITH_SF:
                    tl.store(outs_ptr + p64[:, None] * stride_os0 + s_ar[None, :] * stride_os1, sft,
                             mask=ok[:, None] & sfm)
    else:
        base = pad_pid.to(tl.int64) * (PBT * PSUB)
        pr_ar = tl.arange(0, PBT)
        for r in tl.static_range(PSUB):
            prow = base + r * PBT + pr_ar
            pm = prow < num_expanded
            pe = tl.load(pe_ptr + prow * stride_pe, mask=pm, other=0)
            pad = pm & (pe < 0)
            if tl.max(pad.to(tl.int32), axis=0) > 0:
                zero = tl.zeros([PBT, BH], dtype=out_ptr.dtype.element_ty)
                for c in tl.static_range(COL_ITERS):
                    cols = c * BH + h_ar
                    tl.store(out_ptr + prow[:, None] * stride_out + cols[None, :], zero,
                             mask=pad[:, None] & (cols < hidden_w)[None, :])
                if WITH_SF:
                    zs = tl.zeros([PBT, BSF], dtype=outs_ptr.dtype.element_ty)
                    tl.store(outs_ptr + prow[:, None] * stride_os0 + s_ar[None, :] * stride_os1, zs,
                             mask=pad[:, None] & (s_ar < hidden_sf)[None, :])


def _word_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (2D, unit inner stride) seen as the widest int words that tile its rows exactly."""
    es = t.element_size()
    row_bytes = t.shape[1] * es
    for w in (4, 2, 1):
        if row_bytes % w == 0 and (t.stride(0) * es) % w == 0 and (t.storage_offset() * es) % w == 0 \
                and (w >= es or es % w == 0):
            if t.shape[0] == 0 or t.shape[1] == 0:
                return torch.empty((t.shape[0], row_bytes // w), dtype=_WORDS[w], device=t.device)
            return t.view(_WORDS[w])
    raise ValueError(f"{name} rows cannot be copied as whole words")  # unreachable: w = 1 always fits


def _check_mapping(token_topk_to_pos, pos_to_expert, num_tokens: int):
    check_tensor("token_topk_to_pos", token_topk_to_pos, dtypes=(torch.int32,), ndim=2)
    check_tensor("pos_to_expert", pos_to_expert, dtypes=(torch.int32,), ndim=1)
    if token_topk_to_pos.shape[0] != num_tokens:
        raise ValueError(f"token_topk_to_pos must have {num_tokens} rows (the tokens of x), "
                         f"got shape {tuple(token_topk_to_pos.shape)}")
    if checks_enabled() and token_topk_to_pos.numel() > 0:
        hi = int(token_topk_to_pos.max())
        lo = int(token_topk_to_pos.min())
        n = pos_to_expert.shape[0]
        if lo < -1 or hi >= n:
            raise ValueError(f"token_topk_to_pos values must be in [-1, {n}) (the length of pos_to_expert), "
                             f"got values in [{lo}, {hi}]")


def _config(hidden_w: int, num_tokens: int, num_expanded: int, interp: bool, with_sf: bool) -> dict:
    """Default launch config (deterministic in the shape).  ``BT x BH`` words per token tile (about 4096 on
    GPUs: 32 words = 8 16-byte vectors per thread at 4 warps), ``BH`` the widest power of two in [512, 2048]
    whose column blocks waste at most 1/16 of a row of at least 2048 words (narrower rows: one 2048-wide
    block); padding programs zero ``PSUB`` sub-blocks of ``PBT`` rows."""
    if interp:
        budget, bh = 65536, max(16, min(next_power_of_two(max(hidden_w, 1)), 8192))
    else:
        budget = 4096
        bh = max(16, min(next_power_of_two(max(hidden_w, 1)), 2048))
        # H200 (2026-11-30): bf16 H = 7168 (3584 words) as [8, 512] tiles: 205 us against 215 us with [2, 2048];
        # fp8 H = 7168 (1792 words) as [16, 256]: 163 us against 141 us with [2, 2048], so rows narrower than
        # 2048 words keep one 2048-wide block and the halving stops at 512
        while bh > 512 and hidden_w >= 2048 and (ceil_div(hidden_w, bh) * bh - hidden_w) * 16 > hidden_w:
            bh //= 2
    bt = max(1, min(budget // bh, next_power_of_two(max(num_tokens, 1))))
    pbt = max(1, min(budget // bh, next_power_of_two(num_expanded)))
    psub = 1 if interp else max(1, 64 // pbt)
    # COMPACT + PAD_FIRST: H200 @ 694bd6c sweep (fp8 with sf, CUPTI, L2 flushed): ep 64 133.2 us against 141.5, ep 8
    # 101.7 us against 117.0 (TileKernels 137.8 and 105.2); the bf16 path was not swept and keeps them off
    return dict(BT=bt, BH=bh, PBT=pbt, PSUB=psub, num_warps=4, COMPACT=with_sf, PAD_FIRST=with_sf)


def _launch(data: torch.Tensor, x_sf, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor,
            out: torch.Tensor, out_sf):
    num_tokens, num_topk = token_topk_to_pos.shape
    num_expanded = pos_to_expert.shape[0]
    if num_expanded == 0:
        return
    xw = _word_view("x", data)
    ow = _word_view("out", out)
    hidden_w = xw.shape[1]
    with_sf = x_sf is not None
    cfg = tuned("expand_to_fused_with_sf" if with_sf else "expand_to_fused",
                _config(hidden_w, num_tokens, num_expanded, interpreter_configs(), with_sf))
    bt, bh, pbt, psub = cfg["BT"], cfg["BH"], cfg["PBT"], cfg["PSUB"]
    num_col_blocks = ceil_div(max(hidden_w, 1), bh)
    num_token_progs = ceil_div(num_tokens, bt) * num_col_blocks
    num_pad_progs = ceil_div(num_expanded, pbt * psub)
    if with_sf:
        hidden_sf = x_sf.shape[1]
        xs, os_ = x_sf.view(torch.int32), out_sf.view(torch.int32)
        sxs, sos0, sos1 = x_sf.stride(0), out_sf.stride(0), out_sf.stride(1)
    else:
        hidden_sf, xs, os_, sxs, sos0, sos1 = 0, xw, ow, 0, 0, 0
    bsf = max(2, next_power_of_two(max(hidden_sf, 1)))
    _expand_to_fused_kernel[(num_token_progs + num_pad_progs,)](
        xw, xs, ow, os_, token_topk_to_pos, pos_to_expert,
        num_tokens, num_expanded, hidden_w, hidden_sf,
        xw.stride(0), sxs, ow.stride(0), sos0, sos1,
        token_topk_to_pos.stride(0), token_topk_to_pos.stride(1), pos_to_expert.stride(0),
        num_token_progs, num_col_blocks,
        K=num_topk, WITH_SF=with_sf, BT=bt, BH=bh, BSF=bsf, PBT=pbt, PSUB=psub, COL_ITERS=num_col_blocks,
        KP=max(2, next_power_of_two(num_topk)), COMPACT=bool(cfg["COMPACT"]), PAD_FIRST=bool(cfg["PAD_FIRST"]),
        num_warps=cfg["num_warps"], **pdl_args(out.device))


@planned("expand_to_fused")
@custom_op("moe_expand_to_fused", fake=lambda x, token_topk_to_pos, pos_to_expert: x.new_empty(
    (pos_to_expert.shape[0], x.shape[1])))
def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """Copy each token's row to its expert-major positions; zero the padding rows.

    Args:
        x: ``(T, H)``, any dtype, unit stride along ``H`` (any row stride).
        token_topk_to_pos: int32 ``(T, K)``: the position of each top-k slot, ``-1`` = none
            (from ``get_fused_mapping``).  Positions outside ``[0, N)`` are skipped (with
            ``TRITILE_CHECKS=1`` they raise ``ValueError``).
        pos_to_expert: int32 ``(N,)``; only its sign is read (``< 0`` = padding row), so any
            ``pos_to_*`` array of the mapping works.

    Returns:
        ``out``: ``(N, H)``, ``x.dtype``: ``out[token_topk_to_pos[t, k]] = x[t]``, padding rows zero.
        Valid rows that no slot targets (an inconsistent mapping) are left unwritten.
    """
    check_tensor("x", x, ndim=2)
    check_inner_contiguous("x", x)
    _check_mapping(token_topk_to_pos, pos_to_expert, x.shape[0])
    device = check_same_device(x=x, token_topk_to_pos=token_topk_to_pos, pos_to_expert=pos_to_expert)
    out = empty((pos_to_expert.shape[0], x.shape[1]), x.dtype, device)
    _launch(x, None, token_topk_to_pos, pos_to_expert, out, None)
    return out


@planned("expand_to_fused_with_sf")
def expand_to_fused_with_sf(
    x: QuantTensor,
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``expand_to_fused`` of quantized data together with its per-token scale rows.

    Args:
        x: ``(data, x_sf)``: ``data`` ``(T, H)`` (e.g. float8_e4m3fn), unit stride along ``H``; ``x_sf``
            row-major ``(T, H_sf)``, float32 scales with ``H_sf = ceil(H / num_per_channels)``, or int32
            packed UE8M0 (4 exponents per word) with ``H_sf = ceil(ceil(H / num_per_channels) / 4)``.
        num_per_channels: 32 or 128 (channels per scale).
        token_topk_to_pos: int32 ``(T, K)`` as in ``expand_to_fused``.
        pos_to_expert: int32 ``(N,)``; only its sign is read.
        use_tma_aligned_col_major_sf: write the scales column-major (required for packed int32 scales).

    Returns:
        ``(out, out_sf)``: ``out`` ``(N, H)`` as ``expand_to_fused``; ``out_sf`` ``(N, H_sf)`` of ``x_sf.dtype``,
        contiguous, or with ``use_tma_aligned_col_major_sf`` the ``[:, :N].T`` view of an ``(H_sf, align(N, 4))``
        storage (strides ``(1, align(N, 4))``).  Padding rows are zero in both.
    """
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"x must be a (data, x_sf) tuple, got {type(x).__name__}")
    data, x_sf = x
    check_tensor("x[0] (data)", data, ndim=2)
    check_inner_contiguous("x[0] (data)", data)
    check_tensor("x[1] (x_sf)", x_sf, dtypes=(torch.float32, torch.int32), ndim=2)
    check_inner_contiguous("x[1] (x_sf)", x_sf)
    if isinstance(num_per_channels, bool) or num_per_channels not in (32, 128):
        raise ValueError(f"num_per_channels must be 32 or 128, got {num_per_channels!r}")
    if not isinstance(use_tma_aligned_col_major_sf, bool):
        raise TypeError("use_tma_aligned_col_major_sf must be a bool, "
                        f"got {type(use_tma_aligned_col_major_sf).__name__}")
    num_tokens, hidden = data.shape
    hidden_sf = ceil_div(hidden, num_per_channels)
    packed = x_sf.dtype == torch.int32
    if packed:
        if not use_tma_aligned_col_major_sf:
            raise ValueError("x[1] (x_sf) is int32 (packed UE8M0), which requires use_tma_aligned_col_major_sf=True")
        hidden_sf = ceil_div(hidden_sf, 4)
    if tuple(x_sf.shape) != (num_tokens, hidden_sf):
        kind = "packed UE8M0 int32" if packed else "float32"
        raise ValueError(f"x[1] (x_sf) ({kind}) must have shape {(num_tokens, hidden_sf)} for H={hidden} and "
                         f"num_per_channels={num_per_channels}, got {tuple(x_sf.shape)}")
    _check_mapping(token_topk_to_pos, pos_to_expert, num_tokens)
    device = check_same_device(x=data, x_sf=x_sf, token_topk_to_pos=token_topk_to_pos, pos_to_expert=pos_to_expert)
    check_device("x", data)
    return _expand_with_sf(data, x_sf, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf)


def _expand_with_sf_fake(data, x_sf, token_topk_to_pos, pos_to_expert, col_major):
    n, hidden_sf = pos_to_expert.shape[0], x_sf.shape[1]
    out = data.new_empty((n, data.shape[1]))
    if col_major:
        return out, torch.empty_strided((n, hidden_sf), (1, align(n, 4)), dtype=x_sf.dtype, device=x_sf.device)
    return out, x_sf.new_empty((n, hidden_sf))


@custom_op("moe_expand_to_fused_with_sf", fake=_expand_with_sf_fake)
def _expand_with_sf(data: torch.Tensor, x_sf: torch.Tensor, token_topk_to_pos: torch.Tensor,
                    pos_to_expert: torch.Tensor, col_major: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``expand_to_fused_with_sf`` after its checks (the registered op): allocate, launch."""
    num_expanded, hidden_sf, device = pos_to_expert.shape[0], x_sf.shape[1], data.device
    out = empty((num_expanded, data.shape[1]), data.dtype, device)
    if col_major:
        out_sf = empty((hidden_sf, align(num_expanded, 4)), x_sf.dtype, device)[:, :num_expanded].T
    else:
        out_sf = empty((num_expanded, hidden_sf), x_sf.dtype, device)
    _launch(data, x_sf, token_topk_to_pos, pos_to_expert, out, out_sf)
    return out, out_sf
