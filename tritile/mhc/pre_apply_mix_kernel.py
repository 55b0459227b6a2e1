"""``mhc_pre_apply_mix`` kernels: ``u = sum_m mix_m * x_m`` over the residual streams, and its backward.

The autograd op is ``tritile.modeling.mhc.ops.mhc_pre_apply_mix``.  The forward computes through
``tritile.mhc._common.apply_mix`` (shared with ``pre_big_fuse`` and ``multilayer_recompute``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from tritile.language import f32_to_bf16
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.mhc._common import (LANE_COUNT, LANES, NO_FUSION, apply_mix, fma_chain_last, residual_tile_config,
                                 stream_block, tile_prologue, token_config, token_prologue, tree_last)
from tritile.runtime import custom_op, empty, tuned
from tritile.runtime.plan import planned
from tritile.utils import ceil_div, next_power_of_two


@triton.jit
def _apply_mix_fwd_kernel(x_ptr, mix_ptr, out_ptr, T, H: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                          BT: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """``out[t, h] = bf16(sum_m mix[t, m] * x[t, m, h])`` (``_common.apply_mix`` order)."""
    pdl_enter(PDL)
    tok, h, n2, n3, _, tm = tile_prologue(T, BT, BH, BN)
    w_ptrs, ms = stream_block(mix_ptr, tok, tm, n2, N)
    w = tl.load(w_ptrs, mask=ms, other=0.0)
    m3 = tm[:, None, None] & (n3 < N) & (h < H)[None, None, :]
    x = tl.load(x_ptr + tok[:, None, None] * (N * H) + n3 * H + h[None, None, :], mask=m3, other=0.0)
    u = apply_mix(x.to(tl.float32), w, n2, n3, N)
    tl.store(out_ptr + tok[:, None] * H + h[None, :], f32_to_bf16(u), mask=tm[:, None] & (h < H)[None, :])


@triton.jit
def _apply_mix_bwd_kernel(x_ptr, mix_ptr, g_ptr, dx_ptr, dmix_ptr, T, H: tl.constexpr, N: tl.constexpr,
                          BN: tl.constexpr, BT: tl.constexpr, V: tl.constexpr, NC: tl.constexpr,
                          ACC: tl.constexpr, PDL: tl.constexpr):
    """One program owns ``BT`` whole tokens and walks their chunks of ``LANES * V`` hidden columns, lane ``l``
    holding the ``V`` contiguous columns ``h = c LANES V + l V + k`` of chunk ``c``.

    ``dx[t, m, h] = bf16(fma(mix[t, m], g[t, h], acc))`` with ``acc`` the fp32 value already in ``dx`` when ``ACC``
    (in-place accumulation), else 0.  ``dmix[t, m] = sum_h g[t, h] x[t, m, h]`` in TileKernels' order: per lane a
    chain of fused multiply-adds over its columns (chunks, then ``k``), then a butterfly over the lanes."""
    pdl_enter(PDL)
    tok, n2, n3, _, tm = token_prologue(T, BT, BN)
    w_ptrs, ms = stream_block(mix_ptr, tok, tm, n2, N)
    w = tl.load(w_ptrs, mask=ms, other=0.0)
    lk = tl.arange(0, LANES)[:, None] * V + tl.arange(0, V)[None, :]      # [LANES, V]
    n4 = n3[:, :, :, None]
    dmix = tl.zeros([BT, BN, LANES], tl.float32)
    for c in range(NC):
        h = c * (LANES * V) + lk
        hm = h < H
        m3 = tm[:, None, None] & hm[None, :, :]
        g = tl.load(g_ptr + tok[:, None, None] * H + h[None, :, :], mask=m3, other=0.0).to(tl.float32)
        m4 = tm[:, None, None, None] & (n4 < N) & hm[None, None, :, :]
        offs = tok[:, None, None, None] * (N * H) + n4 * H + h[None, None, :, :]
        x = tl.load(x_ptr + offs, mask=m4, other=0.0).to(tl.float32)
        if ACC:
            acc = tl.load(dx_ptr + offs, mask=m4, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BT, BN, LANES, V], tl.float32)
        tl.store(dx_ptr + offs, f32_to_bf16(tl.fma(w[:, :, None, None], g[:, None, :, :], acc)), mask=m4)
        dmix = fma_chain_last(g[:, None, :, :], x, dmix)
    dmix_ptrs, _ = stream_block(dmix_ptr, tok, tm, n2, N)
    tl.store(dmix_ptrs, tree_last(dmix), mask=ms)


def apply_mix_vec(hidden: int) -> int:
    """Columns a lane holds per chunk in the backward: ``gcd(1024, H) / LANES`` as TileKernels' ``1024``-wide (or
    narrower) chunks over 128 threads give; 1 where ``H`` is not a multiple of 128."""
    g = math.gcd(1024, hidden)
    return g // LANE_COUNT if g >= LANE_COUNT else 1


@planned("mhc_pre_apply_mix_fwd")
@custom_op("mhc_pre_apply_mix_fwd", mutates_args=("out",), fake=lambda x, mix, out: None)
def apply_mix_fwd(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor) -> None:
    """bf16 ``x (T, n, H)`` and fp32 ``mix (T, n)`` (contiguous, checked by the caller) -> bf16 ``out (T, H)``,
    written in place."""
    t, n, hdim = x.shape
    if t == 0 or hdim == 0:
        return
    bn = next_power_of_two(n)
    cfg = tuned("mhc_pre_apply_mix_fwd", residual_tile_config(hdim, bn, interp_elems=4096))
    grid = (ceil_div(t, cfg["BT"]), ceil_div(hdim, cfg["BH"]))
    _apply_mix_fwd_kernel[grid](x, mix, out, t, H=hdim, N=n, BN=bn, BT=cfg["BT"], BH=cfg["BH"],
                                num_warps=cfg["num_warps"], **NO_FUSION, **pdl_args(x.device))


def _apply_mix_bwd(x: torch.Tensor, mix: torch.Tensor, grad: torch.Tensor,
                   dx: Optional[torch.Tensor] = None) -> tuple:
    """Backward of :func:`apply_mix_fwd`: bf16 ``grad (T, H)`` (contiguous) -> ``(dx, dmix)``.

    ``dx``: bf16 ``(T, n, H)``; when given it is accumulated into in place (``dx += mix * grad``, one rounding),
    else a new ``mix * grad``.  ``dmix``: fp32 ``(T, n)``."""
    t, n, hdim = x.shape
    acc = dx is not None
    if dx is None:
        dx = empty((t, n, hdim), torch.bfloat16, x.device)
    dmix = empty((t, n), torch.float32, x.device)
    if t == 0:
        return dx, dmix
    if hdim == 0:
        dmix.zero_()
        return dx, dmix
    bn = next_power_of_two(n)
    v = apply_mix_vec(hdim)
    cfg = tuned("mhc_pre_apply_mix_bwd", token_config(1, max(1, 64 // bn)))
    _apply_mix_bwd_kernel[(ceil_div(t, cfg["BT"]),)](
        x, mix, grad, dx, dmix, t, H=hdim, N=n, BN=bn, BT=cfg["BT"], V=v, NC=ceil_div(hdim, LANE_COUNT * v),
        ACC=acc, num_warps=cfg["num_warps"], **NO_FUSION, **pdl_args(x.device))
    return dx, dmix


@planned("mhc_pre_apply_mix_bwd")
@custom_op("mhc_pre_apply_mix_bwd",
           fake=lambda x, mix, g: (x.new_empty(x.shape), mix.new_empty(mix.shape)))
def apply_mix_bwd(x: torch.Tensor, mix: torch.Tensor, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`apply_mix_fwd` for bf16 ``grad (T, H)``: ``(bf16 dx (T, n, H) = mix * grad,
    fp32 dmix (T, n) = sum_h grad * x)``."""
    return _apply_mix_bwd(x, mix, grad)


@planned("mhc_pre_apply_mix_bwd_acc")
@custom_op("mhc_pre_apply_mix_bwd_acc", mutates_args=("dx",), fake=lambda x, mix, g, dx: mix.new_empty(mix.shape))
def apply_mix_bwd_acc(x: torch.Tensor, mix: torch.Tensor, grad: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Backward of :func:`apply_mix_fwd` accumulating into bf16 ``dx (T, n, H)`` in place
    (``dx = bf16(dx + mix * grad)``, one rounding); returns fp32 ``dmix (T, n)``."""
    return _apply_mix_bwd(x, mix, grad, dx)[1]
