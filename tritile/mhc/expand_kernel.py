"""``expand_to_mhc`` kernels: copy a hidden state into ``n`` residual streams, and the backward stream sum.

Public (as in ``tile_kernels.mhc.expand_kernel``): the launcher factories :func:`expand_to_mhc_fwd_tl` and
:func:`expand_to_mhc_bwd_tl`.  The autograd op is ``tritile.modeling.mhc.ops.expand_to_mhc``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import triton
import triton.language as tl

from tritile.language import f32_to_bf16
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.mhc._common import hidden_block
from tritile.runtime import (check_contiguous, check_device, check_shape, check_tensor, custom_op, empty,
                             interpreter_configs, tuned)
from tritile.runtime.plan import planned
from tritile.utils import ceil_div

__all__ = ["expand_to_mhc_fwd_tl", "expand_to_mhc_bwd_tl"]


@triton.jit
def _expand_tile(T, H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """This program's ``[BT, BH]`` tile: tokens (grid axis 0, int64), hidden columns (axis 1) and the mask."""
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    return tok, h, (tok < T)[:, None] & (h < H)[None, :]


@triton.jit
def _expand_fwd_kernel(x_ptr, out_ptr, T, H: tl.constexpr, N: tl.constexpr,
                       BT: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """``out[t, m, h] = x[t, h]`` for every stream ``m`` (a bit copy)."""
    pdl_enter(PDL)
    tok, h, mask = _expand_tile(T, H, BT, BH)
    x = tl.load(x_ptr + tok[:, None] * H + h[None, :], mask=mask)
    base = out_ptr + tok[:, None] * (N * H) + h[None, :]
    for m in tl.static_range(N):
        tl.store(base + m * H, x, mask=mask)


@triton.jit
def _expand_bwd_kernel(g_ptr, out_ptr, T, H: tl.constexpr, N: tl.constexpr,
                       BT: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """``out[t, h] = bf16(sum_m fp32(g[t, m, h]))``, added ``m = 0..N-1`` left to right from 0 (TileKernels')."""
    pdl_enter(PDL)
    tok, h, mask = _expand_tile(T, H, BT, BH)
    base = g_ptr + tok[:, None] * (N * H) + h[None, :]
    acc = tl.zeros([BT, BH], tl.float32)
    for m in tl.static_range(N):
        acc = acc + tl.load(base + m * H, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok[:, None] * H + h[None, :], f32_to_bf16(acc), mask=mask)


def _config(num_tokens: int, hidden: int) -> dict:
    """``[BT, BH]`` tiles of about 4096 elements (the whole problem in few programs under the interpreter)."""
    if interpreter_configs():
        bh = hidden_block(hidden, cap=4096)
        return dict(BT=max(1, min(64, 8192 // bh)), BH=bh, num_warps=4)
    bh = hidden_block(hidden)
    return dict(BT=max(1, 4096 // bh), BH=bh, num_warps=4)


def _launch(kernel, src: torch.Tensor, dst: torch.Tensor, num_tokens: int, hidden: int, mhc_mult: int) -> None:
    """``kernel`` over ``[BT, BH]`` tiles (``tuned("mhc_expand")`` for the copy, ``tuned("mhc_expand_bwd")`` for the
    stream sum)."""
    if num_tokens == 0 or hidden == 0:
        return
    cfg = tuned("mhc_expand_bwd" if kernel is _expand_bwd_kernel else "mhc_expand", _config(num_tokens, hidden))
    grid = (ceil_div(num_tokens, cfg["BT"]), ceil_div(hidden, cfg["BH"]))
    kernel[grid](src, dst, num_tokens, H=hidden, N=mhc_mult, BT=cfg["BT"], BH=cfg["BH"],
                 num_warps=cfg["num_warps"], **pdl_args(src.device))


@planned("mhc_expand_fwd")
@custom_op("mhc_expand_fwd", mutates_args=("out",), fake=lambda x, out: None)
def expand_fwd(x: torch.Tensor, out: torch.Tensor) -> None:
    """Write bf16 ``x (T, H)`` into every stream of bf16 ``out (T, n, H)`` (both contiguous, checked by the
    caller)."""
    _launch(_expand_fwd_kernel, x, out, x.shape[0], x.shape[1], out.shape[1])


def _expand_fake(x: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    return x.new_empty(tuple(x.shape[:-1]) + (mhc_mult, x.shape[-1]))


@planned("mhc_expand_alloc")
@custom_op("mhc_expand_alloc", fake=_expand_fake)
def expand_alloc(x: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    """bf16 ``(..., mhc_mult, H)`` with every stream equal to bf16 ``x (..., H)`` (contiguous, checked by the
    caller), in a new tensor.

    The output is allocated (and, in tests, poisoned) inside the op, so a traced ``autograd.Function.forward``
    holds no in-place tensor op: with one there, torch 2.11's ``torch.compile`` routes the output's gradient to
    the wrong slot of the traced forward, and the backward receives zeros (pytorch/pytorch#180642)."""
    h = x.shape[-1]
    out = empty(tuple(x.shape[:-1]) + (mhc_mult, h), torch.bfloat16, x.device)
    _launch(_expand_fwd_kernel, x, out, math.prod(x.shape[:-1]), h, mhc_mult)
    return out


def _expand_bwd_into(grad: torch.Tensor, out: torch.Tensor) -> None:
    _launch(_expand_bwd_kernel, grad, out, grad.shape[0], grad.shape[2], grad.shape[1])


@planned("mhc_expand_bwd")
@custom_op("mhc_expand_bwd", fake=lambda g: g.new_empty((g.shape[0], g.shape[2])))
def expand_bwd(grad: torch.Tensor) -> torch.Tensor:
    """bf16 ``(T, H) = bf16(sum_m grad[:, m, :])`` (fp32 sum in stream order) for bf16 ``grad (T, n, H)``
    (contiguous)."""
    out = empty((grad.shape[0], grad.shape[2]), torch.bfloat16, grad.device)
    _expand_bwd_into(grad, out)
    return out


def _check_2d_3d(name2: str, t2: torch.Tensor, name3: str, t3: torch.Tensor, hidden: int, mhc_mult: int) -> None:
    check_tensor(name2, t2, dtypes=(torch.bfloat16,), ndim=2)
    check_tensor(name3, t3, dtypes=(torch.bfloat16,), ndim=3)
    check_contiguous(name2, t2)
    check_contiguous(name3, t3)
    check_device(name2, t2)
    check_device(name3, t3)
    check_shape(name2, t2, (t2.shape[0], hidden))
    check_shape(name3, t3, (t2.shape[0], mhc_mult, hidden))


def expand_to_mhc_fwd_tl(hidden: int, mhc_mult: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Launcher factory (TileKernels' TileLang factory, here a Triton launcher with the same call order).

    Returns ``launch(x, out)``: bf16 ``x (T, hidden)`` copied into every stream of bf16 ``out (T, mhc_mult,
    hidden)``, both contiguous, ``out`` written in place."""

    def launch(x: torch.Tensor, out: torch.Tensor) -> None:
        _check_2d_3d("x", x, "out", out, hidden, mhc_mult)
        expand_fwd(x, out)

    return launch


def expand_to_mhc_bwd_tl(hidden: int, mhc_mult: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Launcher factory for the backward: ``launch(grad, out)`` with bf16 ``grad (T, mhc_mult, hidden)`` and bf16
    ``out (T, hidden) = sum over streams`` (fp32 sum in stream order, one rounding), written in place."""

    def launch(grad: torch.Tensor, out: torch.Tensor) -> None:
        _check_2d_3d("out", out, "grad", grad, hidden, mhc_mult)
        _expand_bwd_into(grad, out)

    return launch
