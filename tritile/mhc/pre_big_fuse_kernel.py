"""mHC inference pre-step in two launches (``tile_kernels.mhc.pre_big_fuse_kernel``).

1. ``norm_fn``'s GEMM + sum-of-squares kernel, with the same partitioning as ``mhc_pre_norm_fn``
   (:func:`tritile.mhc.norm_fn_kernel.gemm_config`).
2. ``_pre_big_fuse_kernel``, per block of tokens: the split reduction and RMS normalisation of ``norm_fn``
   (the same helpers), the sigmoid-affine split of ``pre_split_mixes``, the Sinkhorn forward and the pre
   apply-mix, all through :mod:`tritile.mhc._common`.

The normalised mixes pass through a small float32 scratch (the layout ``pre_split_mixes`` reads them in), so every
output is bitwise that of ``mhc_pre_norm_fn(fuse_grad_acc=False) -> mhc_pre_split_mixes -> sinkhorn_normalize ->
mhc_pre_apply_mix``.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from tritile.language import f32_to_bf16
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import empty, interpreter_configs, tuned
from tritile.utils import ceil_div, next_power_of_two

from ._common import NO_FUSION, apply_mix, load_split_mixes, sinkhorn_fwd, token_block
from .norm_fn_kernel import N3_PAD, _normalise, norm_fn_gemm

_INTERPRET = interpreter_configs()


@triton.jit
def _pre_big_fuse_kernel(p_part_ptr, s_part_ptr, scale_ptr, base_ptr, x_ptr, mixes_ptr, post_ptr, comb_ptr, out_ptr,
                         num_tokens, H, D_f, rms_eps, pre_eps, sk_eps, post_mult,
                         N: tl.constexpr, BN: tl.constexpr, N3: tl.constexpr, N3P: tl.constexpr,
                         SPLITS: tl.constexpr, REPEAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                         H_ITERS: tl.constexpr, PDL: tl.constexpr):
    """Program: ``BLOCK_T`` tokens.  ``mixes`` (float32 ``(T, N3)`` scratch), ``post (T, N)``, ``comb (T, N, N)``
    and ``layer_input (T, H)`` bf16."""
    pdl_enter(PDL)
    tok, tok_ok = token_block(num_tokens, BLOCK_T)
    # norm_fn's normalisation (the helper of _norm_fn_norm_kernel; the mixes are the plain product p r here, as in
    # TileKernels' fused kernel, where its normalisation kernel has fma(p, r, 0): they differ only in a zero's sign)
    j, j_ok, p, _, r = _normalise(p_part_ptr, s_part_ptr, tok, tok_ok, num_tokens, D_f, rms_eps, SPLITS, N3, N3P)
    tl.store(mixes_ptr + tok[:, None] * N3 + j[None, :], p * r[:, None], mask=tok_ok[:, None] & j_ok[None, :])
    tl.debug_barrier()  # the rows are read back below by other threads of the program
    # pre_split_mixes + sinkhorn
    n_i = tl.arange(0, BN)
    pre, post, comb = load_split_mixes(mixes_ptr, N3, scale_ptr, base_ptr, tok, tok_ok, n_i, n_i,
                                       pre_eps, post_mult, N)
    i3 = n_i[None, :, None]
    o3 = n_i[None, None, :]
    comb = sinkhorn_fwd(comb, i3, o3, sk_eps, N, REPEAT)
    s_ok = tok_ok[:, None] & (n_i[None, :] < N)
    tl.store(post_ptr + tok[:, None] * N + n_i[None, :], post, mask=s_ok)
    c_ok = s_ok[:, :, None] & (o3 < N)
    tl.store(comb_ptr + tok[:, None, None] * (N * N) + i3 * N + o3, comb, mask=c_ok)
    # pre_apply_mix
    n2 = n_i[None, :]
    h = tl.arange(0, BLOCK_H)
    for it in range(H_ITERS):
        hh = it * BLOCK_H + h
        h_ok = hh < H
        m3 = s_ok[:, :, None] & h_ok[None, None, :]
        x = tl.load(x_ptr + tok[:, None, None] * (N * H) + i3 * H + hh[None, None, :], mask=m3, other=0.0)
        u = apply_mix(x.to(tl.float32), pre, n2, i3, N)
        tl.store(out_ptr + tok[:, None] * H + hh[None, :], f32_to_bf16(u), mask=tok_ok[:, None] & h_ok[None, :])


def _config(num_tokens: int, H: int) -> dict:
    """Launch plan (``tuned("mhc_pre_big_fuse", ...)``): ``BLOCK_T`` tokens per program, ``BLOCK_H`` hidden columns
    per step, ``num_warps``.  The GPU default follows TileKernels' one token per CTA with a 1024-wide step."""
    if _INTERPRET:
        cfg = dict(BLOCK_T=64, BLOCK_H=128, num_warps=4)
    else:
        cfg = dict(BLOCK_T=1, BLOCK_H=1024, num_warps=4)
    cfg = dict(tuned("mhc_pre_big_fuse", cfg))
    cfg["BLOCK_H"] = min(cfg["BLOCK_H"], max(16, next_power_of_two(H)))
    return cfg


def pre_big_fuse(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
                 pre_eps: float, sk_eps: float, post_mult: float, repeat: int, n: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the GEMM and the fused kernel (inputs validated by the caller).

    Args:
        x: bfloat16 ``(T, n H)`` contiguous residual; fn: float32 ``(n3, n H)`` contiguous;
        scale: float32 ``(3,)``; base: float32 ``(n3,)``; the epsilons, ``post_mult`` and ``repeat >= 1``.

    Returns:
        float32 ``post (T, n)``, float32 ``comb (T, n, n)``, bfloat16 ``layer_input (T, H)``.
    """
    T = x.shape[0]
    if T == 0:
        H = x.shape[1] // n
        return (empty((0, n), torch.float32, x.device), empty((0, n, n), torch.float32, x.device),
                empty((0, H), torch.bfloat16, x.device))
    p_part, s_part, _ = norm_fn_gemm(x, fn)
    return big_fuse_tail(p_part, s_part, x, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat, n)


def big_fuse_tail(p_part: torch.Tensor, s_part: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                  base: torch.Tensor, rms_eps: float, pre_eps: float, sk_eps: float, post_mult: float, repeat: int,
                  n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel on the GEMM's float32 partials ``p_part (SPLITS, T, n3)`` and ``s_part (SPLITS, T)``
    (contiguous; ``x``, ``scale``, ``base`` and the scalars as in :func:`pre_big_fuse`): ``(post, comb,
    layer_input)``, in TileKernels' order from the partials on."""
    splits, T, n3 = p_part.shape
    D = x.shape[1]
    H = D // n
    dev = x.device
    post = empty((T, n), torch.float32, dev)
    comb = empty((T, n, n), torch.float32, dev)
    out = empty((T, H), torch.bfloat16, dev)
    if T == 0:
        return post, comb, out
    mixes = torch.empty((T, n3), dtype=torch.float32, device=dev)
    cfg = _config(T, H)
    _pre_big_fuse_kernel[(ceil_div(T, cfg["BLOCK_T"]),)](
        p_part, s_part, scale, base, x, mixes, post, comb, out,
        T, H, float(D), float(rms_eps), float(pre_eps), float(sk_eps), float(post_mult),
        N=n, BN=next_power_of_two(n), N3=n3, N3P=N3_PAD, SPLITS=splits, REPEAT=int(repeat),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"], H_ITERS=ceil_div(H, cfg["BLOCK_H"]),
        num_warps=cfg["num_warps"], **NO_FUSION, **pdl_args(dev, launch=False))
    return post, comb, out
