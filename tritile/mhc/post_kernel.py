"""``mhc_post`` kernels: ``R'_o = post_o * y + sum_i comb[i][o] * R_i`` and its one-pass backward.

Public (as in ``tile_kernels.mhc.post_kernel``): :func:`mhc_post_fwd` and :func:`mhc_post_bwd`.  The autograd
op is ``tritile.modeling.mhc.ops.mhc_post``.  The forward computes through ``tritile.mhc._common.post_mix``
(shared with ``multilayer_recompute``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from tritile.language import f32_to_bf16
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.mhc._common import (LANE_COUNT, LANES, NO_FUSION, apply_mix, comb_block, extract, hidden_tile, post_mix,
                                 residual_offsets, residual_tile_config, set_post_grad_buffer, stream_block,
                                 tile_prologue, token_config, token_prologue, tree_last)
from tritile.runtime import (check_contiguous, check_device, check_same_device, check_shape, check_tensor, custom_op,
                             empty, interpreter_configs, tuned)
from tritile.runtime.plan import planned
from tritile.utils import ceil_div, next_power_of_two

__all__ = ["mhc_post_fwd", "mhc_post_bwd"]


@triton.jit
def _post_fwd_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, T, H: tl.constexpr, N: tl.constexpr,
                     BN: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """``out[t, o, h] = bf16(post[t, o] * y[t, h] + sum_i comb[t, i, o] * x[t, i, h])`` (``_common.post_mix``)."""
    pdl_enter(PDL)
    tok, h, n2, n3, o3, tm = tile_prologue(T, BT, BH, BN)
    hm = h < H
    post_ptrs, ms = stream_block(post_ptr, tok, tm, n2, N)
    post = tl.load(post_ptrs, mask=ms, other=0.0)
    comb_ptrs, mc = comb_block(comb_ptr, tok, tm, n3, o3, N)
    comb = tl.load(comb_ptrs, mask=mc, other=0.0)
    y_ptrs, m2 = hidden_tile(y_ptr, tok, tm, h, hm, H)
    y = tl.load(y_ptrs, mask=m2, other=0.0)
    offs, m3 = residual_offsets(tok, tm, n3, h, hm, N, H)
    x = tl.load(x_ptr + offs, mask=m3, other=0.0)
    out = post_mix(y.to(tl.float32), x.to(tl.float32), post, comb, n2, n3, N)
    tl.store(out_ptr + offs, f32_to_bf16(out), mask=m3)


@triton.jit
def _post_bwd_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, g_ptr, dy_ptr, dx_ptr, dpost_ptr, dcomb_ptr, T,
                     H: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, NC: tl.constexpr,
                     U: tl.constexpr, PDL: tl.constexpr):
    """One pass over ``y``, ``x``, ``g``; one program owns ``BT`` whole tokens and walks their rows of ``LANES``
    hidden columns (``h = j LANES + lane``), ``U`` rows a step (``NC`` steps; rows past ``H`` are masked: their zero
    products leave the sums unchanged), so that ``U`` rows' loads are in flight at once.

    ``dy[t, h] = bf16(sum_o post[o] g_o[h])``, ``dx[t, i, h] = bf16(sum_o comb[i, o] g_o[h])`` (fma chains in ``o``
    order from 0); ``dpost[t, o] = sum_h y[h] g_o[h]`` and ``dcomb[t, i, o] = sum_h x_i[h] g_o[h]`` in TileKernels'
    order: per lane a chain of fused multiply-adds over the rows in order, then a butterfly over the lanes."""
    pdl_enter(PDL)
    tok, n2, n3, o3, tm = token_prologue(T, BT, BN)
    post = tl.load(post_ptr + tok[:, None] * N + n2, mask=tm[:, None] & (n2 < N), other=0.0)
    cmask = tm[:, None, None] & (n3 < N) & (o3 < N)
    comb = tl.load(comb_ptr + tok[:, None, None] * (N * N) + n3 * N + o3, mask=cmask, other=0.0)
    lane = tl.arange(0, LANES)
    dpost = tl.zeros([BT, BN, LANES], tl.float32)
    dcomb = tl.zeros([BT, BN, BN, LANES], tl.float32)  # [token, i, o, lane]
    for c in range(NC):
        for u in tl.static_range(U):
            h = (c * U + u) * LANES + lane
            hm = h < H
            m2 = tm[:, None] & hm[None, :]
            m3 = tm[:, None, None] & (n3 < N) & hm[None, None, :]
            offs = tok[:, None, None] * (N * H) + n3 * H + h[None, None, :]
            y = tl.load(y_ptr + tok[:, None] * H + h[None, :], mask=m2, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=m3, other=0.0).to(tl.float32)
            tl.store(dy_ptr + tok[:, None] * H + h[None, :], f32_to_bf16(apply_mix(g, post, n2, n3, N)), mask=m2)
            dx = tl.zeros([BT, BN, LANES], tl.float32)
            for o in tl.static_range(N):
                dx = tl.fma(extract(comb, o3, o, 2)[:, :, None], extract(g, n3, o, 1)[:, None, :], dx)
            tl.store(dx_ptr + offs, f32_to_bf16(dx), mask=m3)
            dpost = tl.fma(y[:, None, :], g, dpost)
            dcomb = tl.fma(x[:, :, None, :], g[:, None, :, :], dcomb)
    tl.store(dpost_ptr + tok[:, None] * N + n2, tree_last(dpost), mask=tm[:, None] & (n2 < N))
    tl.store(dcomb_ptr + tok[:, None, None] * (N * N) + n3 * N + o3, tree_last(dcomb), mask=cmask)


def _check_post_args(x, residual, post_layer_mix, comb_res_mix, exact_n: Optional[int] = None) -> Tuple[int, int]:
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=3)
    check_tensor("residual", residual, dtypes=(torch.bfloat16,), ndim=4)
    check_tensor("post_layer_mix", post_layer_mix, dtypes=(torch.float32,), ndim=4)
    check_tensor("comb_res_mix", comb_res_mix, dtypes=(torch.float32,), ndim=4)
    b, s, n, h = residual.shape
    if exact_n is not None and n != exact_n:
        raise ValueError(f"residual must have {exact_n} streams (mhc_mult), got {n} (shape {tuple(residual.shape)})")
    check_shape("x", x, (b, s, h))
    check_shape("post_layer_mix", post_layer_mix, (b, s, n, 1))
    check_shape("comb_res_mix", comb_res_mix, (b, s, n, n))
    for name, t in (("x", x), ("post_layer_mix", post_layer_mix), ("comb_res_mix", comb_res_mix)):
        check_contiguous(name, t)
    check_device("residual", residual)
    check_same_device(x=x, residual=residual, post_layer_mix=post_layer_mix, comb_res_mix=comb_res_mix)
    return n, h


@planned("mhc_post_fwd")
def mhc_post_fwd(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """mHC post combination (no autograd).

    Args:
        x: bf16 ``(B, S, H)``, contiguous: the sublayer output ``y``.
        residual: bf16 ``(B, S, n, H)`` (copied when not contiguous).
        post_layer_mix: fp32 ``(B, S, n, 1)``, contiguous.
        comb_res_mix: fp32 ``(B, S, n, n)``, contiguous, indexed ``[input stream i, output stream o]``.
        out: optional bf16 ``(B, S, n, H)``, contiguous, written in place and returned.

    Returns:
        bf16 ``(B, S, n, H)``: ``out[..., o, :] = post[..., o] * x + sum_i comb[..., i, o] * residual[..., i, :]``,
        in fp32 (the post term first, then ``i = 0..n-1`` as fused multiply-adds), rounded once.
    """
    n, h = _check_post_args(x, residual, post_layer_mix, comb_res_mix)
    residual = residual.contiguous()
    if out is None:
        out = empty(residual.shape, torch.bfloat16, residual.device)
    else:
        check_tensor("out", out, dtypes=(torch.bfloat16,))
        check_shape("out", out, residual.shape)
        check_contiguous("out", out)
        check_same_device(out=out, residual=residual)
    _post_fwd_op(x, residual, post_layer_mix, comb_res_mix, out)
    return out


@planned("mhc_post_fwd_launch")
@custom_op("mhc_post_fwd", mutates_args=("out",), fake=lambda x, r, p, c, out: None)
def _post_fwd_op(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 out: torch.Tensor) -> None:
    b, s, n, h = residual.shape
    t = b * s
    if t == 0 or h == 0:
        return
    bn = next_power_of_two(n)
    cfg = tuned("mhc_post_fwd", residual_tile_config(h, bn))
    grid = (ceil_div(t, cfg["BT"]), ceil_div(h, cfg["BH"]))
    _post_fwd_kernel[grid](x, residual, post_layer_mix, comb_res_mix, out, t, H=h, N=n, BN=bn, BT=cfg["BT"],
                           BH=cfg["BH"], num_warps=cfg["num_warps"], **NO_FUSION, **pdl_args(x.device))


def _bwd_config(bn: int, rows: int) -> dict:
    """Backward launch plan: one token per program on the GPU (as TileKernels), a few under the interpreter; ``U``
    rows of ``LANES`` columns a step (8 on the GPU: 1024 columns, as TileKernels' 4-deep pipeline of 256; 2 under
    the interpreter, so that its tests walk several steps and a masked tail), at most ``rows``."""
    cfg = dict(token_config(1, max(1, 64 // (bn * bn))), U=2 if interpreter_configs() else 8)
    cfg = dict(tuned("mhc_post_bwd", cfg))
    cfg["U"] = max(1, min(int(cfg["U"]), rows))
    return cfg


def _post_bwd_fake(x, residual, post_layer_mix, comb_res_mix, d_o):
    return (x.new_empty(x.shape), residual.new_empty(residual.shape), post_layer_mix.new_empty(post_layer_mix.shape),
            comb_res_mix.new_empty(comb_res_mix.shape))


@planned("mhc_post_bwd_launch")
@custom_op("mhc_post_bwd", fake=_post_bwd_fake)
def _post_bwd_op(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 d_o: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = x.device
    b, s, n, h = residual.shape
    t = b * s
    d_x = empty((b, s, h), torch.bfloat16, dev)
    d_res = empty((b, s, n, h), torch.bfloat16, dev)
    d_post = empty((b, s, n, 1), torch.float32, dev)
    d_comb = empty((b, s, n, n), torch.float32, dev)
    if t > 0 and h == 0:
        d_post.zero_()
        d_comb.zero_()
    elif t > 0:
        bn = next_power_of_two(n)
        rows = ceil_div(h, LANE_COUNT)
        cfg = _bwd_config(bn, rows)
        _post_bwd_kernel[(ceil_div(t, cfg["BT"]),)](
            x, residual, post_layer_mix, comb_res_mix, d_o, d_x, d_res, d_post, d_comb, t, H=h, N=n, BN=bn,
            BT=cfg["BT"], NC=ceil_div(rows, cfg["U"]), U=cfg["U"], num_warps=cfg["num_warps"], **NO_FUSION,
            **pdl_args(dev))
    return d_x, d_res, d_post, d_comb


def mhc_post_bwd(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 d_o: torch.Tensor, fuse_grad_acc: bool = True
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`mhc_post_fwd` (``n = 4`` streams, as TileKernels), one kernel.

    Args:
        x, residual, post_layer_mix, comb_res_mix: as in :func:`mhc_post_fwd` (``residual`` contiguous).
        d_o: bf16 ``(B, S, 4, H)``: the output gradient (made contiguous).
        fuse_grad_acc: when True, ``residual.untyped_storage().grad_from_mhc_post`` is set to ``d_residual``, the
            buffer into which the other consumers of the residual (``mhc_pre_apply_mix``, ``mhc_pre_norm_fn``)
            accumulate their gradients in place.

    Returns:
        ``(d_x, d_residual, d_post_layer_mix, d_comb_res_mix)``: bf16 ``(B, S, H)`` ``= sum_o post_o g_o``, bf16
        ``(B, S, 4, H)`` ``d_residual_i = sum_o comb[i, o] g_o``, fp32 ``(B, S, 4, 1)`` ``sum_h x g_o`` and fp32
        ``(B, S, 4, 4)`` ``[i, o] = sum_h residual_i g_o``.
    """
    n, h = _check_post_args(x, residual, post_layer_mix, comb_res_mix, exact_n=4)
    check_contiguous("residual", residual)
    check_tensor("d_o", d_o, dtypes=(torch.bfloat16,))
    check_shape("d_o", d_o, residual.shape)
    check_same_device(d_o=d_o, residual=residual)
    d_x, d_res, d_post, d_comb = _post_bwd_op(x, residual, post_layer_mix, comb_res_mix, d_o.contiguous())
    if fuse_grad_acc:
        set_post_grad_buffer(residual, d_res)
    return d_x, d_res, d_post, d_comb
