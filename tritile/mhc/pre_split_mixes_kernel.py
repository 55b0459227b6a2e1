"""``mhc_pre_split_mixes`` kernels: the sigmoid-affine split of the mixes into pre / post / comb, and its backward.

The autograd op is ``tritile.modeling.mhc.ops.mhc_pre_split_mixes``.  The forward computes through
``tritile.mhc._common.load_split_mixes`` (shared with ``pre_big_fuse``).  The backward writes one row of partial
sums of the scale and base gradients per program, one program per SM (deterministic, no atomics), and the host adds
the rows with ``torch.sum``: TileKernels' plan and order, so these gradients depend on ``get_num_sms()`` as
TileKernels' do.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from tritile.language.pdl import pdl_args, pdl_enter
from tritile.config import get_num_sms
from tritile.mhc._common import (NO_FUSION, extract, load_split_mixes, mix_affine, mix_group, sigmoid_f32,
                                 token_block, token_config, tree_last)
from tritile.runtime import custom_op, empty, tuned
from tritile.runtime.plan import planned
from tritile.utils import ceil_div, next_power_of_two


@triton.jit
def _split_fwd_kernel(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, pre_eps, post_mult,
                      N: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tok, tm = token_block(T, BT)
    n = tl.arange(0, BN)
    pre, post, comb = load_split_mixes(mixes_ptr, N * (N + 2), scale_ptr, base_ptr, tok, tm, n, n,
                                       pre_eps, post_mult, N)
    m2 = tm[:, None] & (n[None, :] < N)
    tl.store(pre_ptr + tok[:, None] * N + n[None, :], pre, mask=m2)
    tl.store(post_ptr + tok[:, None] * N + n[None, :], post, mask=m2)
    i3 = n[None, :, None]
    o3 = n[None, None, :]
    tl.store(comb_ptr + tok[:, None, None] * (N * N) + i3 * N + o3, comb,
             mask=tm[:, None, None] & (i3 < N) & (o3 < N))


@triton.jit
def _split_bwd_kernel(mixes_ptr, scale_ptr, base_ptr, post_ptr, gpre_ptr, gpost_ptr, gcomb_ptr, gmix_ptr,
                      pscale_ptr, pbase_ptr, T, post_mult, N: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr,
                      PDL: tl.constexpr):
    """Program ``p`` of ``P`` (the grid: the SM count) takes the ``BT``-token blocks ``p, p + P, ...`` and writes
    row ``p`` of the partial sums, in TileKernels' order: ``pbase[p, j]`` adds each block's butterfly over its
    ``BT`` tokens of ``gz_j`` in turn; ``pscale[p, k]`` is, per token slot, a chain of fused multiply-adds
    ``gz_j mixes_j`` over the blocks and the ``j`` of group ``k`` in order, then a butterfly over the slots."""
    pdl_enter(PDL)
    NJ: tl.constexpr = N * (N + 2)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, BJ)
    jm = j < NJ
    j2 = j[None, :]
    grp = tl.minimum(j // N, 2)
    scale = tl.load(scale_ptr + grp, mask=jm, other=0.0)
    base = tl.load(base_ptr + j, mask=jm, other=0.0)
    is_pre = j < N
    is_post = (j >= N) & (j < 2 * N)
    is_comb = (j >= 2 * N) & jm
    k4 = tl.arange(0, 4)[None, :]
    acc_b = tl.zeros([BJ], tl.float32)
    acc_s = tl.zeros([BT, 4], tl.float32)  # [token slot, group]
    blk = pid
    while blk * BT < T:
        tok = blk.to(tl.int64) * BT + tl.arange(0, BT)
        tm = (tok < T)[:, None]
        t2 = tok[:, None]
        m = tl.load(mixes_ptr + t2 * NJ + j2, mask=tm & jm[None, :], other=0.0)
        gpre = tl.load(gpre_ptr + t2 * N + j2, mask=tm & is_pre[None, :], other=0.0)
        gpost = tl.load(gpost_ptr + t2 * N + (j2 - N), mask=tm & is_post[None, :], other=0.0)
        post = tl.load(post_ptr + t2 * N + (j2 - N), mask=tm & is_post[None, :], other=0.0)
        gcomb = tl.load(gcomb_ptr + t2 * (N * N) + (j2 - 2 * N), mask=tm & is_comb[None, :], other=0.0)
        sg = sigmoid_f32(mix_affine(m, scale[None, :], base[None, :]))
        gz_pre = (gpre * sg) * (1.0 - sg)
        gz_post = (gpost * post) * (1.0 - tl.math.div_rn(post, tl.full(post.shape, post_mult, tl.float32)))
        gz = tl.where(is_pre[None, :], gz_pre, tl.where(is_post[None, :], gz_post, gcomb))
        gz = tl.where(tm & jm[None, :], gz, 0.0)
        tl.store(gmix_ptr + t2 * NJ + j2, gz * scale[None, :], mask=tm & jm[None, :])
        acc_b = acc_b + tree_last(tl.trans(gz))
        for jj in tl.static_range(NJ):
            upd = tl.fma(extract(gz, j2, jj, 1)[:, None], extract(m, j2, jj, 1)[:, None], acc_s)
            acc_s = tl.where(k4 == mix_group(jj, N), upd, acc_s)
        blk += nprog
    tl.store(pbase_ptr + pid * NJ + j, acc_b, mask=jm)
    kk = tl.arange(0, 4)
    tl.store(pscale_ptr + pid * 3 + kk, tree_last(tl.trans(acc_s)), mask=kk < 3)


def _config() -> dict:
    return token_config(64, 256)


# Tokens per block of the backward: TileKernels' 32 (its sums over a block's tokens are butterflies of that width).
_BWD_BLOCK = 32


def _split_fwd_fake(mixes, scale, base, n, post_mult, pre_eps):
    t = mixes.shape[0]
    return mixes.new_empty((t, n)), mixes.new_empty((t, n)), mixes.new_empty((t, n, n))


@planned("mhc_pre_split_mixes_fwd")
@custom_op("mhc_pre_split_mixes_fwd", fake=_split_fwd_fake)
def split_fwd(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, post_mult: float,
              pre_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``mixes (T, n3)`` (contiguous, checked by the caller) -> fp32 ``pre (T, n)``, ``post (T, n)``,
    ``comb (T, n, n)`` (raw logits)."""
    t = mixes.shape[0]
    dev = mixes.device
    pre = empty((t, n), torch.float32, dev)
    post = empty((t, n), torch.float32, dev)
    comb = empty((t, n, n), torch.float32, dev)
    if t == 0:
        return pre, post, comb
    cfg = tuned("mhc_pre_split_mixes_fwd", _config())
    _split_fwd_kernel[(ceil_div(t, cfg["BT"]),)](mixes, scale, base, pre, post, comb, t, float(pre_eps),
                                                 float(post_mult), N=n, BN=next_power_of_two(n), BT=cfg["BT"],
                                                 num_warps=cfg["num_warps"], **NO_FUSION, **pdl_args(dev))
    return pre, post, comb


def _split_bwd_fake(mixes, scale, base, post, g_pre, g_post, g_comb, n, post_mult):
    return mixes.new_empty(mixes.shape), mixes.new_empty((3,)), mixes.new_empty((mixes.shape[1],))


@planned("mhc_pre_split_mixes_bwd")
def _split_bwd_parts(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, post: torch.Tensor,
                     g_pre: torch.Tensor, g_post: torch.Tensor, g_comb: torch.Tensor, n: int,
                     post_mult: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g_mixes (T, n3)`` and the per-program partials of ``g_scale`` ``(P, 3)`` and ``g_base`` ``(P, n3)`` (one
    zero row when there is nothing to sum)."""
    t, nj = mixes.shape
    dev = mixes.device
    g_mixes = empty((t, nj), torch.float32, dev)
    if t == 0:
        return g_mixes, empty((1, 3), torch.float32, dev).zero_(), empty((1, nj), torch.float32, dev).zero_()
    nprog = get_num_sms()
    pscale = empty((nprog, 3), torch.float32, dev)
    pbase = empty((nprog, nj), torch.float32, dev)
    _split_bwd_kernel[(nprog,)](mixes, scale, base, post, g_pre, g_post, g_comb, g_mixes, pscale, pbase, t,
                                float(post_mult), N=n, BJ=next_power_of_two(nj), BT=_BWD_BLOCK, num_warps=4,
                                **NO_FUSION, **pdl_args(dev))
    return g_mixes, pscale, pbase


@custom_op("mhc_pre_split_mixes_bwd", fake=_split_bwd_fake)
def split_bwd(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, post: torch.Tensor,
              g_pre: torch.Tensor, g_post: torch.Tensor, g_comb: torch.Tensor, n: int,
              post_mult: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`split_fwd`: fp32 contiguous ``(T, n)`` / ``(T, n)`` / ``(T, n, n)`` gradients and the
    saved ``post`` output -> ``(g_mixes (T, n3), g_scale (3,), g_base (n3,))``, fp32 (the per-program partials
    added by ``torch.sum``, as TileKernels)."""
    g_mixes, pscale, pbase = _split_bwd_parts(mixes, scale, base, post, g_pre, g_post, g_comb, n, post_mult)
    return g_mixes, pscale.sum(0), pbase.sum(0)
