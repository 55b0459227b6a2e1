"""``swiglu_backward_and_per_token_cast``: SwiGLU backward with routing weights, fused with an FP8 cast of dx.

``tile_kernels.quant.swiglu_backward_and_per_token_cast`` (``spec/quant.md`` §3.9).  One pass over the
FP8 input: each program dequantizes ``[BLOCK_R, CH]`` tiles of both halves, recomputes the forward
activation, writes ``out`` (bf16), ``x_grad`` (bf16), the e4m3 codes and scales of the **float32**
dx, and the per-row sum ``sum_j g * act`` (on GPUs a row's chunks go to two programs, each writing its part's
sum: ``SPLIT``, for a shorter launch tail).  A second, tiny launch gathers those row sums into
``weight_grad[t, k]`` through ``token_topk_to_pos`` (0 where it is -1), so every element of
``weight_grad`` is written, whatever the maps hold, and no zero-fill is needed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor,
                       custom_op, empty, interpreter_configs, tuned)
from ..utils import ceil_div, next_power_of_two
from ..runtime.plan import planned
from .common import SFInfo, alloc_sf, sf_info
from ._swiglu_bwd_jit import _bwd_chunk
from .swiglu_forward_and_per_token_cast_kernel import _check_clamp_value, _check_int, _minmax_clamp_ok
from .types import QuantTensor

__all__ = ["swiglu_backward_and_per_token_cast"]


@triton.jit
def _swiglu_backward_and_per_token_cast_kernel(
        q_ptr, sfx_ptr, g_ptr, ptt_ptr, w_ptr,
        out_ptr, dq_ptr, dsf_ptr, xg_ptr, rowsum_ptr,
        num_rows, num_weights,
        stride_qm, stride_sfm, stride_sfk, stride_gm, stride_om, stride_dqm, stride_dsm, stride_xgm,
        clamp_value,
        H: tl.constexpr, NPC: tl.constexpr, SF_PACKED: tl.constexpr, HAS_CLAMP: tl.constexpr,
        ROUND_SF: tl.constexpr, BLOCK_R: tl.constexpr, CH: tl.constexpr,
        FAST_MAX: tl.constexpr, FAST_ENC: tl.constexpr, MINMAX_CLAMP: tl.constexpr, MASK_FLAGS: tl.constexpr,
        FAST_DIV: tl.constexpr, ROWSUM_PAIRS: tl.constexpr, FUSED_BWD: tl.constexpr = 0,
        XORSIGN_CLAMP: tl.constexpr = False, INT_SCALE: tl.constexpr = False, SPLIT: tl.constexpr = 1,
        PDL: tl.constexpr = False):
    """MINMAX_CLAMP: the clamp by NaN-propagating min/max (GPU).  MASK_FLAGS: the clamp flags kept as
    int32 masks (``|yf| > c`` in one compare) that clear dx by a bitwise and, instead of predicates
    held across the chunk.  FAST_DIV (with FAST_ENC): ``s`` and ``xf / t`` by ``_rcp_div_fast`` (one shared
    reciprocal, one range check per 4 elements).  ROWSUM_PAIRS (GPUs, CH = 512 x 1 warp): the row sum adds the sums
    of chunk pairs (2k, 2k + 1), so CH=512 with 1 warp gives the weight_grad bits of CH=1024 with 2 warps: both
    reduce each 128-group in the layout [1, 1, 16] per thread x [1, 4, 8] lanes, and the 2-warp kernel's two warp
    partials meet in one (commutative) add.

    Same-bits instruction cuts (GPUs; sm_90a counts in bench/cases/quant.py's _BWD_TUNE): FUSED_BWD=4 (with FAST_DIV,
    FAST_ENC, MASK_FLAGS and, with a clamp, MINMAX_CLAMP) the per-element backward in one PTX block per four elements
    (``_bwd_fused_ptx``: expf / division rewrites of the forward's FUSED_SILU, flags as ``set`` masks, grad_out
    widened in the block); XORSIGN_CLAMP (with FUSED_BWD) yf clamped by one ``min.NaN.xorsign.abs.f32``; INT_SCALE
    (ROUND_SF) dx's power-of-two scales from amax's bits.  Under the interpreter FUSED_BWD runs its element-wise
    stand-in.

    SPLIT (GPUs: 2): each row block's chunks over SPLIT programs (program ``pid`` takes part ``pid % SPLIT`` of row
    block ``pid // SPLIT``, ceil(chunks / SPLIT) chunks a part but the last; ROWSUM_PAIRS' pairs are the row's chunk
    pairs, cut at the parts' ends), so the programs are SPLIT times shorter and the launch's tail, which runs at low
    occupancy, too.  Each part writes its own row sums (``rowsum_ptr + part * num_rows``);
    ``_swiglu_weight_grad_kernel`` adds them in part order.  Every output but weight_grad keeps its bits; weight_grad
    is the same float32 sum in another order."""
    pdl_enter(PDL)
    G: tl.constexpr = CH // NPC
    num_rb = (num_rows + BLOCK_R - 1) // BLOCK_R
    NCH: tl.constexpr = (H + CH - 1) // CH
    PART: tl.constexpr = ((NCH + SPLIT - 1) // SPLIT) * CH  # SPLIT's columns a part
    part = tl.program_id(0) % SPLIT  # (0 without SPLIT)
    rb = tl.program_id(0) // SPLIT
    p_lo = part * PART  # SPLIT: this part's columns [p_lo, p_hi)
    p_hi = tl.minimum(p_lo + PART, H)
    # one row block a program: the loop below runs once (kept as a loop: the compiled code of the H200 figures)
    nprog = num_rb
    while rb < num_rb:
        rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        idx = tl.load(ptt_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        w_ok = row_ok & (idx >= 0) & (idx < num_weights)
        w = tl.where(w_ok, tl.load(w_ptr + idx, mask=w_ok, other=0.0), 0.0)
        rowsum = tl.zeros([BLOCK_R], tl.float32)
        pend = tl.zeros([BLOCK_R], tl.float32)  # ROWSUM_PAIRS: the last even chunk's sum
        w3 = w[:, None, None]
        if SPLIT > 1:  # this part's chunks (a while loop: range() over program ids breaks the interpreter)
            c0 = p_lo
            while c0 < p_hi:
                rowsum, pend = _bwd_chunk(
                    q_ptr, sfx_ptr, g_ptr, c0, rows, row_ok, w3, rowsum, pend, clamp_value, out_ptr, dq_ptr,
                    dsf_ptr, xg_ptr, stride_qm, stride_sfm, stride_sfk, stride_gm, stride_om, stride_dqm, stride_dsm,
                    stride_xgm, H, NPC, SF_PACKED, HAS_CLAMP, ROUND_SF, BLOCK_R, CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP,
                    MASK_FLAGS, FAST_DIV, ROWSUM_PAIRS, FUSED_BWD, XORSIGN_CLAMP, INT_SCALE)
                c0 += CH
        else:
            for c0 in range(0, H, CH):
                rowsum, pend = _bwd_chunk(
                    q_ptr, sfx_ptr, g_ptr, c0, rows, row_ok, w3, rowsum, pend, clamp_value, out_ptr, dq_ptr,
                    dsf_ptr, xg_ptr, stride_qm, stride_sfm, stride_sfk, stride_gm, stride_om, stride_dqm, stride_dsm,
                    stride_xgm, H, NPC, SF_PACKED, HAS_CLAMP, ROUND_SF, BLOCK_R, CH, FAST_MAX, FAST_ENC, MINMAX_CLAMP,
                    MASK_FLAGS, FAST_DIV, ROWSUM_PAIRS, FUSED_BWD, XORSIGN_CLAMP, INT_SCALE)
        if ROWSUM_PAIRS:
            if SPLIT > 1:  # the part's last chunk has an even index: no partner (a part may start at an odd one)
                rowsum = tl.where(((p_hi - 1) // CH) % 2 == 0, rowsum + pend, rowsum)
            elif ((H + CH - 1) // CH) % 2 == 1:
                rowsum += pend  # an odd chunk count: the last chunk has no partner
        tl.store(rowsum_ptr + part * num_rows + rows, rowsum, mask=row_ok)
        rb += nprog


@triton.jit
def _swiglu_weight_grad_kernel(ttp_ptr, rowsum_ptr, wg_ptr, n, num_rows, BLOCK: tl.constexpr,
                               SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False):
    """weight_grad[i] = the row sum of row ttp[i] (0 where ttp[i] is -1): the SPLIT parts' sums added in order."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = tl.load(ttp_ptr + offs, mask=ok, other=-1).to(tl.int64)
    hit = ok & (p >= 0) & (p < num_rows)
    v = tl.load(rowsum_ptr + p, mask=hit, other=0.0)
    for part in tl.static_range(1, SPLIT):
        v += tl.load(rowsum_ptr + part * num_rows + p, mask=hit, other=0.0)
    tl.store(wg_ptr + offs, tl.where(hit, v, 0.0), mask=ok)


def _chunk(H: int, npc: int) -> int:
    """Chunk width: on GPUs the largest of 1024..32 dividing H (no masked lanes); under the
    interpreter one masked chunk as wide as the row (up to 1024), so a row block runs few steps."""
    if interpreter_configs():
        return max(npc, min(1024, next_power_of_two(H)))
    for ch in (1024, 512, 256, 128, 64, 32):
        if ch >= npc and H % ch == 0:
            return ch
    return npc


def _config(H: int, npc: int) -> dict:
    """Default launch config (passed through ``tuned("swiglu_backward_and_per_token_cast")``).

    16 columns per thread.  sm_90a SASS at the anchor (H = 7168, npc = 128, clamp, round_sf):
    109.2 executed instructions per column (x and y element) with every flag off, 75.2 with FAST_MAX,
    FAST_ENC, MINMAX_CLAMP, MASK_FLAGS (164 registers), 61.2 adding FAST_DIV (the default since
    2026-11-30; 168 registers, no spills).  CH = 1024 with 4 warps: 68.5 per column, but 96 registers
    and no shared-memory round trips for the bf16 stores (the 2-warp layout holds 16 columns per
    thread, the stores 8).  H200 sweep (2026-11-30, commit 694bd6c, the anchor, CUDA graph): registers capped at
    128 (8 blocks of 2 warps per SM instead of 6) 958.3 us, against 1049.6 us uncapped."""
    ch = _chunk(H, npc)
    gpu = not interpreter_configs()
    # Sweep of 2026-11-30 (H200, commit 694bd6c; CUPTI, L2 flushed): a 1024-wide chunk as two 512-wide chunks of 1 warp
    # with ROWSUM_PAIRS (the 2-warp layout's weight_grad summation order: same bits; no shared-memory relayout, no
    # barrier) 906.5 us against 950.0 us for [1, 1024] x 2 warps
    pairs = gpu and ch == 1024 and npc <= 512
    # Sweep of 2026-11-30 (H200, commit 65d4724; CUPTI, L2 flushed, the anchor): the same-bits instruction cuts
    # FUSED_BWD=4, XORSIGN_CLAMP and INT_SCALE (64.0 -> 56.1 sm_90a instructions per column, 114 registers, no stack)
    # capped at 112 registers 884.2 us against 907.2 us for the default of commit 694bd6c (FUSED_BWD alone 889.3,
    # uncapped 885.0, cap 104 889.1).  H200, 2026-11-30, commit fd8764c (CUPTI, L2 flushed): SPLIT=2 (a row's 14 chunks
    # over two programs: the launch's tail at half the length) 878.5-878.8 us against 890.9-891.2 in three sweeps (8 + 6
    # chunks); weight_grad sums in another order
    return dict(BLOCK_R=1 if gpu else 64, CH=512 if pairs else ch, num_warps=1 if pairs else max(1, ch // 512),
                FAST_MAX=True, FAST_ENC=True, MINMAX_CLAMP=True, MASK_FLAGS=True, FAST_DIV=True, ROWSUM_PAIRS=pairs,
                maxnreg=112 if gpu else None, FUSED_BWD=4 if gpu else 0, XORSIGN_CLAMP=gpu, INT_SCALE=gpu,
                SPLIT=2 if gpu else 1)


def _split_parts(num_chunks: int, split: int) -> int:
    """The part count the kernel's SPLIT gets: at most ``split``, ceil(num_chunks / SPLIT) chunks a part (the kernel's
    PART) but the last, no empty part."""
    split = max(1, min(split, num_chunks))
    while split > 1 and (split - 1) * ceil_div(num_chunks, split) >= num_chunks:
        split -= 1
    return split


def _check_config(cfg: dict, npc: int) -> None:
    """Reject a (tuning) config the kernel cannot run, with a ValueError."""
    unknown = sorted(set(cfg) - set(_config(128, 128)))
    if unknown:
        raise ValueError(f"swiglu_backward_and_per_token_cast launch config: unknown keys {unknown}")
    pow2 = lambda v: isinstance(v, int) and v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg["CH"]) and pow2(cfg["BLOCK_R"]) and pow2(cfg["num_warps"])) or cfg["CH"] < npc:
        raise ValueError(f"CH (>= npc = {npc}), BLOCK_R and num_warps must be powers of two, got {cfg}")
    if cfg["FUSED_BWD"] not in (0, 4):
        raise ValueError(f"FUSED_BWD must be 0 or 4, got {cfg['FUSED_BWD']!r}")


def _launch(q, sfi, grad_out, weight, ptt, ttp, npc, round_sf, clamp):
    num_rows, two_h = q.shape
    H = two_h // 2
    dev = q.device
    out = empty((num_rows, H), torch.bfloat16, dev)
    dq = empty((num_rows, two_h), torch.float8_e4m3fn, dev)
    dsf = alloc_sf(num_rows, two_h, (1, npc), False, False, dev)
    xg = empty((num_rows, two_h), torch.bfloat16, dev)
    wg = empty(tuple(weight.shape), torch.float32, dev)
    split = 1
    rowsum = empty((1,), torch.float32, dev)  # E = 0: weight_grad reads no row sum
    if num_rows > 0:
        cfg = tuned("swiglu_backward_and_per_token_cast", _config(H, npc))
        _check_config(cfg, npc)
        block_r = cfg["BLOCK_R"]
        extra = {} if cfg.get("maxnreg") is None else dict(maxnreg=cfg["maxnreg"])
        fused = int(cfg["FUSED_BWD"])
        num_rb = ceil_div(num_rows, block_r)
        split = _split_parts(ceil_div(H, cfg["CH"]), int(cfg.get("SPLIT", 1) or 1))
        rowsum = empty((max(num_rows, 1) * split,), torch.float32, dev)
        _swiglu_backward_and_per_token_cast_kernel[(num_rb * split,)](
            q.view(torch.uint8), sfi.tensor, grad_out.view(torch.int16), ptt, weight,
            out.view(torch.int16), dq.view(torch.uint8), dsf, xg.view(torch.int16), rowsum,
            num_rows, weight.numel(),
            q.stride(0), sfi.stride_m, sfi.stride_k, grad_out.stride(0), out.stride(0), dq.stride(0),
            dsf.stride(0), xg.stride(0),
            clamp if clamp is not None else 0.0,
            H=H, NPC=npc, SF_PACKED=sfi.packed, HAS_CLAMP=clamp is not None, ROUND_SF=round_sf,
            BLOCK_R=block_r, CH=cfg["CH"], FAST_MAX=bool(cfg["FAST_MAX"]), FAST_ENC=bool(cfg["FAST_ENC"]),
            MINMAX_CLAMP=bool(cfg["MINMAX_CLAMP"]) and _minmax_clamp_ok(clamp), MASK_FLAGS=bool(cfg["MASK_FLAGS"]),
            FAST_DIV=bool(cfg["FAST_DIV"]),
            ROWSUM_PAIRS=bool(cfg["ROWSUM_PAIRS"]),
            # same-bits instruction cuts (GPU defaults): the fused PTX backward over 4 elements (FUSED_BWD=4) needs 4
            # per thread in a row (CH >= 128 * num_warps) and, with a clamp, the min/max clamp (not c = -0.0)
            FUSED_BWD=fused if cfg["CH"] >= 32 * fused * cfg["num_warps"] else 0,
            XORSIGN_CLAMP=bool(cfg.get("XORSIGN_CLAMP", False)),
            INT_SCALE=bool(cfg.get("INT_SCALE", False)) and round_sf,
            SPLIT=split,
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,  # no FMA contraction of 1 + exp(-x); tl.fma stays fused
            **extra, **pdl_args(out.device))
    n = ttp.numel()
    if n > 0:
        block = 16384 if interpreter_configs() else 1024
        _swiglu_weight_grad_kernel[(ceil_div(n, block),)](ttp, rowsum, wg, n, num_rows, BLOCK=block, SPLIT=split,
                                                          num_warps=4, **pdl_args(wg.device, launch=False))
    return out, (dq, dsf), xg, wg


def _launch_fake(q, sf, grad_out, weight, ptt, ttp, npc, round_sf, clamp):
    num_rows, two_h = q.shape
    return (q.new_empty((num_rows, two_h // 2), dtype=torch.bfloat16),
            q.new_empty((num_rows, two_h), dtype=torch.float8_e4m3fn),
            alloc_sf(num_rows, two_h, (1, npc), False, False, q.device),
            q.new_empty((num_rows, two_h), dtype=torch.bfloat16),
            weight.new_empty(tuple(weight.shape), dtype=torch.float32))


@custom_op("swiglu_backward_and_per_token_cast", fake=_launch_fake)
def _launch_op(q: torch.Tensor, sf: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor, ptt: torch.Tensor,
               ttp: torch.Tensor, npc: int, round_sf: bool, clamp: Optional[float]
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::swiglu_backward_and_per_token_cast`` (validated arguments; flat outputs)."""
    sfi = SFInfo(sf, sf.stride(0), sf.stride(1), sf.dtype == torch.int32)
    out, (dq, dsf), xg, wg = _launch(q, sfi, grad_out, weight, ptt, ttp, npc, round_sf, clamp)
    return out, dq, dsf, xg, wg


@planned("swiglu_backward_and_per_token_cast")
def swiglu_backward_and_per_token_cast(
        x: QuantTensor, grad_out: torch.Tensor, weight: torch.Tensor, pos_to_token_topk: torch.Tensor,
        token_topk_to_pos: torch.Tensor, num_per_channels: int, round_sf: bool = False,
        swiglu_clamp_value: Optional[float] = None
) -> Tuple[torch.Tensor, QuantTensor, torch.Tensor, torch.Tensor]:
    """Backward of the routing-weighted SwiGLU over fused MoE rows, with a per-token FP8 cast of dx.

    Per row e: ``w = weight.flat[pos_to_token_topk[e]]``, 0 where the index is negative (or past
    ``weight``).  Per column j < H: ``xf = f32(q[e, j] * sf[e, j/npc])``, ``yf`` likewise at ``j + H``;
    with a clamp c the flags ``cx = xf > c`` and ``cy = |yf| > c`` are taken, then ``xf = min(xf, c)``
    and ``yf`` is clamped to ``[-c, c]``::

        t = 1 + exp(-xf);  s = 1 / t;  g = f32(grad_out)
        act = (xf / t) * yf;            gws = (g * w) * s
        out[e, j]     = bf16(act * w)
        dx[e, j]      = cx ? +0 : (gws * yf) * fma(xf, 1 - s, 1)     (one rounding on GPUs)
        dx[e, j + H]  = cy ? +0 : gws * xf
        weight_grad[t, k] = sum_j g * act of row token_topk_to_pos[t, k]  (0 where that is -1; a float32 sum whose
                            order is the kernel's: compare it with a tolerance, as TileKernels' test does)

    ``dx`` (float32) is quantized per (row, npc columns) as ``spec/quant.md`` §2.2 says (clamp 1e-4).

    Args:
        x: QuantTensor ``(data, sf)``: data float8_e4m3fn ``(E, 2H)`` (leading dims of a 3D tensor are
            flattened), unit column stride; sf ``(E, 2H/npc)`` float32 (any strides) or packed UE8M0 int32
            ``(E, ceil(2H/npc/4))``.
        grad_out: bf16 ``(E, H)`` (leading dims flattened), unit column stride.
        weight: float32 ``(T, K)`` contiguous.
        pos_to_token_topk: int32 ``(E,)`` contiguous, flat index ``t*K + k`` or -1.
        token_topk_to_pos: int32 ``(T, K)`` contiguous, row of slot ``(t, k)`` or -1.
        num_per_channels: npc of both x's sf and dx's sf, 32 or 128; H % npc == 0.
        round_sf: round dx's scales up to powers of two.
        swiglu_clamp_value: optional clamp c >= 0.

    Returns:
        ``(out, (dx_fp8, dx_sf), x_grad, weight_grad)``: out bf16 ``(E, H)``; dx_fp8 float8_e4m3fn
        ``(E, 2H)``; dx_sf float32 ``(E, 2H/npc)`` row-major; x_grad bf16 ``(E, 2H)``; weight_grad float32
        ``(T, K)`` (zeros when E = 0).

    Non-finite dx: a group holding inf or NaN gets sf = +inf and codes ``e4m3(dx * 0)`` (NaN for the
    non-finite elements), so it dequantizes to NaN.
    """
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"x must be a QuantTensor (data, sf), got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0]", data, dtypes=(torch.float8_e4m3fn,), ndim=(2, 3))
    if data.dim() == 3:
        data = data.flatten(0, 1)
    check_inner_contiguous("x[0]", data)
    npc = _check_int("num_per_channels", num_per_channels)
    if npc not in (32, 128):
        raise ValueError(f"num_per_channels must be 32 or 128, got {npc}")
    num_rows, two_h = data.shape
    if two_h % (2 * npc) != 0 or two_h == 0:
        raise ValueError(f"x[0] must have 2*H columns with H a multiple of num_per_channels={npc}, "
                         f"got shape {tuple(data.shape)}")
    H = two_h // 2
    if isinstance(sf, torch.Tensor) and sf.dim() == 3:
        sf = sf.flatten(0, 1)
    sfi = sf_info("x[1]", sf, num_rows, two_h // npc)
    check_tensor("grad_out", grad_out, dtypes=(torch.bfloat16,), ndim=(2, 3))
    if grad_out.dim() == 3:
        grad_out = grad_out.flatten(0, 1)
    check_shape("grad_out", grad_out, (num_rows, H))
    check_inner_contiguous("grad_out", grad_out)
    check_tensor("weight", weight, dtypes=(torch.float32,), ndim=2)
    check_contiguous("weight", weight)
    check_tensor("pos_to_token_topk", pos_to_token_topk, dtypes=(torch.int32,), ndim=1)
    check_shape("pos_to_token_topk", pos_to_token_topk, (num_rows,))
    check_contiguous("pos_to_token_topk", pos_to_token_topk)
    check_tensor("token_topk_to_pos", token_topk_to_pos, dtypes=(torch.int32,), ndim=2)
    check_shape("token_topk_to_pos", token_topk_to_pos, tuple(weight.shape))
    check_contiguous("token_topk_to_pos", token_topk_to_pos)
    if not isinstance(round_sf, bool):
        raise TypeError(f"round_sf must be a bool, got {type(round_sf).__name__}")
    clamp = _check_clamp_value("swiglu_clamp_value", swiglu_clamp_value)
    check_same_device(x=data, x_sf=sfi.tensor, grad_out=grad_out, weight=weight, pos_to_token_topk=pos_to_token_topk,
                      token_topk_to_pos=token_topk_to_pos)
    out, dq, dsf, xg, wg = _launch_op(data, sfi.tensor, grad_out, weight, pos_to_token_topk, token_topk_to_pos, npc,
                                      round_sf, clamp)
    return out, (dq, dsf), xg, wg

