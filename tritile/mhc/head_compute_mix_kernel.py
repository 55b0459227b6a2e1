"""``mhc_head_compute_mix`` kernels: ``sigmoid(mix * scale + base) + eps`` for the head, and its backward.

The autograd op is ``tritile.modeling.mhc.ops.mhc_head_compute_mix``.  The backward writes one row of partial sums
of the scale and base gradients per program, one program per SM (deterministic, no atomics), and the host adds the
rows with ``torch.sum``: TileKernels' plan and order, so these gradients depend on ``get_num_sms()`` as
TileKernels' do.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from tritile.language.pdl import pdl_args, pdl_enter
from tritile.config import get_num_sms
from tritile.mhc._common import NO_FUSION, mix_affine, pre_from_logit, sigmoid_f32, token_config, tree_last
from tritile.runtime import custom_op, empty
from tritile.runtime.plan import planned
from tritile.utils import ceil_div, next_power_of_two


@triton.jit
def _head_fwd_kernel(x_ptr, scale_ptr, base_ptr, out_ptr, T, pre_eps, N: tl.constexpr, BN: tl.constexpr,
                     BT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    n = tl.arange(0, BN)
    m2 = (tok < T)[:, None] & (n < N)[None, :]
    offs = tok[:, None] * N + n[None, :]
    x = tl.load(x_ptr + offs, mask=m2, other=0.0)
    base = tl.load(base_ptr + n, mask=n < N, other=0.0)
    tl.store(out_ptr + offs, pre_from_logit(mix_affine(x, tl.load(scale_ptr), base[None, :]), pre_eps), mask=m2)


@triton.jit
def _head_bwd_kernel(x_ptr, scale_ptr, base_ptr, g_ptr, dx_ptr, pscale_ptr, pbase_ptr, T, N: tl.constexpr,
                     BN: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    """``q = (s (1 - s)) g`` with ``s`` the recomputed sigmoid; ``dx = q * scale``.  Program ``p`` of ``P`` (the grid:
    the SM count) takes the ``BT``-token blocks ``p, p + P, ...``; its lanes are (token slot, ``j``), each with a
    chain of fused multiply-adds ``q x`` and a running sum of ``q`` over its blocks (TileKernels' order).  It
    writes ``pscale[p] =`` the butterfly over all lanes (token-major) and ``pbase[p, j] =`` the butterfly over the
    token slots."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = tl.arange(0, BN)
    scale = tl.load(scale_ptr)
    base = tl.load(base_ptr + n, mask=n < N, other=0.0)
    acc_s = tl.zeros([BT, BN], tl.float32)
    acc_b = tl.zeros([BT, BN], tl.float32)
    blk = pid
    while blk * BT < T:
        tok = blk.to(tl.int64) * BT + tl.arange(0, BT)
        m2 = (tok < T)[:, None] & (n < N)[None, :]
        offs = tok[:, None] * N + n[None, :]
        x = tl.load(x_ptr + offs, mask=m2, other=0.0)
        g = tl.load(g_ptr + offs, mask=m2, other=0.0)
        s = sigmoid_f32(mix_affine(x, scale, base[None, :]))
        q = tl.where(m2, (s * (1.0 - s)) * g, 0.0)
        tl.store(dx_ptr + offs, q * scale, mask=m2)
        acc_s = tl.fma(q, x, acc_s)
        acc_b = acc_b + q
        blk += nprog
    tl.store(pscale_ptr + pid + tl.arange(0, 1), tree_last(tl.reshape(acc_s, [1, BT * BN])))
    tl.store(pbase_ptr + pid * N + n, tree_last(tl.trans(acc_b)), mask=n < N)


# Tokens per block of the backward: TileKernels' 32 (its sums over a block's tokens are butterflies of that width).
_BWD_BLOCK = 32


def _config(n: int) -> dict:
    return token_config(max(1, 512 // next_power_of_two(n)), 1024)


@planned("mhc_head_compute_mix_fwd")
@custom_op("mhc_head_compute_mix_fwd", fake=lambda x, scale, base, eps: x.new_empty(x.shape))
def head_fwd(x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, pre_eps: float) -> torch.Tensor:
    """fp32 ``x (T, n)`` (contiguous, checked by the caller), ``scale (1,)``, ``base (n,)`` -> fp32 ``(T, n)``."""
    t, n = x.shape
    out = empty((t, n), torch.float32, x.device)
    if t == 0 or n == 0:
        return out
    cfg = _config(n)
    _head_fwd_kernel[(ceil_div(t, cfg["BT"]),)](x, scale, base, out, t, float(pre_eps), N=n, BN=next_power_of_two(n),
                                                BT=cfg["BT"], num_warps=cfg["num_warps"], **NO_FUSION,
                                                **pdl_args(x.device))
    return out


@planned("mhc_head_compute_mix_bwd")
def _head_bwd_parts(x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dx (T, n)`` and the per-program partials of ``dscale`` ``(P, 1)`` and ``dbase`` ``(P, n)`` (one zero row
    when there is nothing to sum)."""
    t, n = x.shape
    dev = x.device
    dx = empty((t, n), torch.float32, dev)
    if t == 0 or n == 0:
        return dx, empty((1, 1), torch.float32, dev).zero_(), empty((1, n), torch.float32, dev).zero_()
    nprog = get_num_sms()
    pscale = empty((nprog, 1), torch.float32, dev)
    pbase = empty((nprog, n), torch.float32, dev)
    _head_bwd_kernel[(nprog,)](x, scale, base, grad, dx, pscale, pbase, t, N=n, BN=next_power_of_two(n),
                               BT=_BWD_BLOCK, num_warps=4, **NO_FUSION, **pdl_args(dev))
    return dx, pscale, pbase


@custom_op("mhc_head_compute_mix_bwd",
           fake=lambda x, scale, base, g: (x.new_empty(x.shape), x.new_empty((1,)), x.new_empty((x.shape[1],))))
def head_bwd(x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`head_fwd` for fp32 ``grad (T, n)`` -> ``(dx (T, n), dscale (1,), dbase (n,))`` (the
    per-program partials added by ``torch.sum``, as TileKernels)."""
    dx, pscale, pbase = _head_bwd_parts(x, scale, base, grad)
    return dx, pscale.sum(0), pbase.sum(0)
