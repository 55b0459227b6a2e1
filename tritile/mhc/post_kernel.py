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
from tritile.mhc._common import (LANE_COUNT, LANES, NO_FUSION, comb_block, hidden_tile, post_mix,
                                 residual_offsets, residual_tile_config, set_post_grad_buffer, stream_block,
                                 tile_prologue, token_block, token_config, tree_last)
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
def _rows4(ptr, base, H, h, m):
    """A token's four stream rows at columns ``h`` (``base``: the token's first element), fp32 ``[BT, LANES]`` each."""
    r0 = tl.load(ptr + base + h, mask=m, other=0.0).to(tl.float32)
    r1 = tl.load(ptr + base + H + h, mask=m, other=0.0).to(tl.float32)
    r2 = tl.load(ptr + base + 2 * H + h, mask=m, other=0.0).to(tl.float32)
    r3 = tl.load(ptr + base + 3 * H + h, mask=m, other=0.0).to(tl.float32)
    return r0, r1, r2, r3


@triton.jit
def _mix4(w0, w1, w2, w3, g0, g1, g2, g3):
    """``sum_o w_o g_o`` as TileKernels: ``acc = 0``, then ``acc = fma(w_o, g_o, acc)`` for ``o = 0..3``."""
    return tl.fma(w3, g3, tl.fma(w2, g2, tl.fma(w1, g1, tl.fma(w0, g0, 0.0))))


@triton.jit
def _fma4(x, g0, g1, g2, g3, a0, a1, a2, a3):
    """One step of four per-lane chains: ``a_o = fma(x, g_o, a_o)``."""
    return tl.fma(x, g0, a0), tl.fma(x, g1, a1), tl.fma(x, g2, a2), tl.fma(x, g3, a3)


@triton.jit
def _store4(ptr, tok, tm, stride, a0, a1, a2, a3):
    """The lanes' butterfly sums of four ``[BT, LANES]`` chains to ``ptr + tok * stride + o``."""
    tl.store(ptr + tok * stride, tree_last(a0), mask=tm)
    tl.store(ptr + tok * stride + 1, tree_last(a1), mask=tm)
    tl.store(ptr + tok * stride + 2, tree_last(a2), mask=tm)
    tl.store(ptr + tok * stride + 3, tree_last(a3), mask=tm)


@triton.jit
def _post_bwd_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, g_ptr, dy_ptr, dx_ptr, dpost_ptr, dcomb_ptr, T,
                     H: tl.constexpr, BT: tl.constexpr, NC: tl.constexpr, U: tl.constexpr, PDL: tl.constexpr):
    """The backward for four streams, one pass over ``y``, ``x``, ``g``.  One program owns ``BT`` whole tokens and
    walks their rows of ``LANES`` hidden columns (``h = j LANES + lane``), ``U`` rows a step (``NC`` steps; rows past
    ``H`` are masked: their zero products leave the sums unchanged).  Every stream is its own ``[BT, LANES]`` tile,
    so all the work is per lane until the final butterflies.

    ``dy[t, h] = bf16(sum_o post[o] g_o[h])``, ``dx[t, i, h] = bf16(sum_o comb[i, o] g_o[h])`` (fma chains in ``o``
    order from 0); ``dpost[t, o] = sum_h y[h] g_o[h]`` and ``dcomb[t, i, o] = sum_h x_i[h] g_o[h]`` in TileKernels'
    order: per lane a chain of fused multiply-adds over the rows in order, then a butterfly over the lanes."""
    pdl_enter(PDL)
    tok, tm = token_block(T, BT)
    t2 = tok[:, None]
    m2 = tm[:, None]
    p0 = tl.load(post_ptr + t2 * 4, mask=m2, other=0.0)
    p1 = tl.load(post_ptr + t2 * 4 + 1, mask=m2, other=0.0)
    p2 = tl.load(post_ptr + t2 * 4 + 2, mask=m2, other=0.0)
    p3 = tl.load(post_ptr + t2 * 4 + 3, mask=m2, other=0.0)
    c00, c01, c02, c03 = _rows4(comb_ptr, t2 * 16, 1, 0, m2)  # comb[i, o] at t * 16 + i * 4 + o
    c10, c11, c12, c13 = _rows4(comb_ptr, t2 * 16 + 4, 1, 0, m2)
    c20, c21, c22, c23 = _rows4(comb_ptr, t2 * 16 + 8, 1, 0, m2)
    c30, c31, c32, c33 = _rows4(comb_ptr, t2 * 16 + 12, 1, 0, m2)
    zero = tl.zeros([BT, LANES], tl.float32)
    dp0, dp1, dp2, dp3 = zero, zero, zero, zero
    d00, d01, d02, d03 = zero, zero, zero, zero
    d10, d11, d12, d13 = zero, zero, zero, zero
    d20, d21, d22, d23 = zero, zero, zero, zero
    d30, d31, d32, d33 = zero, zero, zero, zero
    lane = tl.arange(0, LANES)[None, :]
    for c in range(NC):
        for u in tl.static_range(U):
            h = (c * U + u) * LANES + lane
            m = m2 & (h < H)
            y = tl.load(y_ptr + t2 * H + h, mask=m, other=0.0).to(tl.float32)
            x0, x1, x2, x3 = _rows4(x_ptr, t2 * (4 * H), H, h, m)
            g0, g1, g2, g3 = _rows4(g_ptr, t2 * (4 * H), H, h, m)
            tl.store(dy_ptr + t2 * H + h, f32_to_bf16(_mix4(p0, p1, p2, p3, g0, g1, g2, g3)), mask=m)
            dxp = dx_ptr + t2 * (4 * H) + h
            tl.store(dxp, f32_to_bf16(_mix4(c00, c01, c02, c03, g0, g1, g2, g3)), mask=m)
            tl.store(dxp + H, f32_to_bf16(_mix4(c10, c11, c12, c13, g0, g1, g2, g3)), mask=m)
            tl.store(dxp + 2 * H, f32_to_bf16(_mix4(c20, c21, c22, c23, g0, g1, g2, g3)), mask=m)
            tl.store(dxp + 3 * H, f32_to_bf16(_mix4(c30, c31, c32, c33, g0, g1, g2, g3)), mask=m)
            dp0, dp1, dp2, dp3 = _fma4(y, g0, g1, g2, g3, dp0, dp1, dp2, dp3)
            d00, d01, d02, d03 = _fma4(x0, g0, g1, g2, g3, d00, d01, d02, d03)
            d10, d11, d12, d13 = _fma4(x1, g0, g1, g2, g3, d10, d11, d12, d13)
            d20, d21, d22, d23 = _fma4(x2, g0, g1, g2, g3, d20, d21, d22, d23)
            d30, d31, d32, d33 = _fma4(x3, g0, g1, g2, g3, d30, d31, d32, d33)
    _store4(dpost_ptr, tok, tm, 4, dp0, dp1, dp2, dp3)
    _store4(dcomb_ptr, tok, tm, 16, d00, d01, d02, d03)
    _store4(dcomb_ptr + 4, tok, tm, 16, d10, d11, d12, d13)
    _store4(dcomb_ptr + 8, tok, tm, 16, d20, d21, d22, d23)
    _store4(dcomb_ptr + 12, tok, tm, 16, d30, d31, d32, d33)


def _check_post_args(x, residual, post_layer_mix, comb_res_mix) -> Tuple[int, int]:
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=3)
    check_tensor("residual", residual, dtypes=(torch.bfloat16,), ndim=4)
    check_tensor("post_layer_mix", post_layer_mix, dtypes=(torch.float32,), ndim=4)
    check_tensor("comb_res_mix", comb_res_mix, dtypes=(torch.float32,), ndim=4)
    b, s, n, h = residual.shape
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


def _bwd_config(rows: int) -> dict:
    """Backward launch plan: one token per program on the GPU (as TileKernels: 128 threads, a lane each), four under
    the interpreter; ``U`` rows of ``LANES`` columns a step (4 on the GPU, so that a token's loads overlap; 2 under
    the interpreter, so that its tests walk several steps and a masked tail), at most ``rows``."""
    cfg = dict(token_config(1, 4), U=2 if interpreter_configs() else 4)
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
        rows = ceil_div(h, LANE_COUNT)
        cfg = _bwd_config(rows)
        _post_bwd_kernel[(ceil_div(t, cfg["BT"]),)](
            x, residual, post_layer_mix, comb_res_mix, d_o, d_x, d_res, d_post, d_comb, t, H=h, BT=cfg["BT"],
            NC=ceil_div(rows, cfg["U"]), U=cfg["U"], num_warps=cfg["num_warps"], **NO_FUSION, **pdl_args(dev))
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
    _check_post_args(x, residual, post_layer_mix, comb_res_mix)
    check_four_streams(residual)
    check_contiguous("residual", residual)
    check_tensor("d_o", d_o, dtypes=(torch.bfloat16,))
    check_shape("d_o", d_o, residual.shape)
    check_same_device(d_o=d_o, residual=residual)
    return post_bwd(x, residual, post_layer_mix, comb_res_mix, d_o, fuse_grad_acc)


def check_four_streams(residual: torch.Tensor) -> None:
    """The backward's one limit beyond the forward's checks: four streams (``mhc_mult = 4``, as TileKernels)."""
    if residual.shape[2] != 4:
        raise ValueError(f"mhc_post's backward supports 4 streams (mhc_mult = 4, as TileKernels), got residual of "
                         f"shape {tuple(residual.shape)}")


def post_bwd(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
             d_o: torch.Tensor, fuse_grad_acc: bool = True
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mhc_post_bwd` on arguments already checked (the autograd op's backward: its forward checked them)."""
    d_x, d_res, d_post, d_comb = _post_bwd_op(x, residual, post_layer_mix, comb_res_mix, d_o.contiguous())
    if fuse_grad_acc:
        set_post_grad_buffer(residual, d_res)
    return d_x, d_res, d_post, d_comb
