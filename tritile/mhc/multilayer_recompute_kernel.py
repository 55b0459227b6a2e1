"""``mhc_multilayer_recompute``: regenerate the layer inputs and residuals of ``L`` consecutive mHC sublayers.

One kernel keeps each ``[tokens, streams, hidden chunk]`` residual tile on chip across all layers:
``u_i = apply_mix(R, pre_i)`` and ``R <- bf16(post(y_i, R, post_i, comb_i))``, through the same
``tritile.mhc._common`` helpers as ``mhc_pre_apply_mix`` and ``mhc_post``, hence bitwise equal to chaining them.
The per-layer tensors are reached through int64 tables of data pointers on the data's device.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from tritile.language import f32_to_bf16
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.mhc._common import NO_FUSION, apply_mix, post_mix, residual_tile_config, tile_prologue
from tritile.runtime import check_contiguous, check_tensor, custom_op, tuned
from tritile.utils import ceil_div, next_power_of_two

__all__ = ["mhc_multilayer_recompute"]


@triton.jit
def _layer_inputs(pre_tab, y_tab, post_tab, comb_tab, i: tl.constexpr, tok, offs2, n2, n3, o3, wm, cm, m2,
                  N: tl.constexpr, LP: tl.constexpr):
    """Layer ``i``'s pre weights ``[BT, BN]``, and where ``i < LP`` its bf16 sublayer output ``[BT, BH]``, post
    weights ``[BT, BN]`` and comb ``[BT, BN, BN]`` (zeros otherwise: never used)."""
    pre_ptr = tl.load(pre_tab + i).to(tl.pointer_type(tl.float32))
    w = tl.load(pre_ptr + tok[:, None] * N + n2, mask=wm, other=0.0)
    if i < LP:
        y_ptr = tl.load(y_tab + i).to(tl.pointer_type(tl.bfloat16))
        post_ptr = tl.load(post_tab + i).to(tl.pointer_type(tl.float32))
        comb_ptr = tl.load(comb_tab + i).to(tl.pointer_type(tl.float32))
        y = tl.load(y_ptr + offs2, mask=m2, other=0.0)
        post = tl.load(post_ptr + tok[:, None] * N + n2, mask=wm, other=0.0)
        comb = tl.load(comb_ptr + tok[:, None, None] * (N * N) + n3 * N + o3, mask=cm, other=0.0)
    else:
        y = tl.zeros(offs2.shape, dtype=tl.bfloat16)
        post = tl.zeros(w.shape, dtype=tl.float32)
        comb = tl.zeros([w.shape[0], w.shape[1], w.shape[1]], dtype=tl.float32)
    return w, y, post, comb


@triton.jit
def _multilayer_kernel(r0_ptr, pre_tab, y_tab, post_tab, comb_tab, li_tab, res_tab, T, H: tl.constexpr,
                       N: tl.constexpr, BN: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr,
                       BH: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tok, h, n2, n3, o3, tm = tile_prologue(T, BT, BH, BN)
    hm = h < H
    wm = tm[:, None] & (n2 < N)
    cm = tm[:, None, None] & (n3 < N) & (o3 < N)
    m2 = tm[:, None] & hm[None, :]
    m3 = tm[:, None, None] & (n3 < N) & hm[None, None, :]
    offs2 = tok[:, None] * H + h[None, :]
    offs3 = tok[:, None, None] * (N * H) + n3 * H + h[None, None, :]
    r = tl.load(r0_ptr + offs3, mask=m3, other=0.0).to(tl.float32)
    # Software-pipelined over the (unrolled) layers: layer i + 1's small tensors and sublayer output are loaded
    # before layer i's stores, so their latency overlaps layer i's work (inputs and outputs never alias).
    w, y, post, comb = _layer_inputs(pre_tab, y_tab, post_tab, comb_tab, 0, tok, offs2, n2, n3, o3, wm, cm, m2,
                                     N, LP)
    for i in tl.static_range(L):
        if i + 1 < L:
            w_n, y_n, post_n, comb_n = _layer_inputs(pre_tab, y_tab, post_tab, comb_tab, i + 1, tok, offs2, n2, n3,
                                                     o3, wm, cm, m2, N, LP)
        li_ptr = tl.load(li_tab + i).to(tl.pointer_type(tl.bfloat16))
        tl.store(li_ptr + offs2, f32_to_bf16(apply_mix(r, w, n2, n3, N)), mask=m2)
        if i < LP:
            res_ptr = tl.load(res_tab + i).to(tl.pointer_type(tl.bfloat16))
            rb = f32_to_bf16(post_mix(y.to(tl.float32), r, post, comb, n2, n3, N))
            tl.store(res_ptr + offs3, rb, mask=m3)
            r = rb.to(tl.float32)
        if i + 1 < L:
            w, y, post, comb = w_n, y_n, post_n, comb_n


def _check_list(name: str, tensors, length: int, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != length:
        raise ValueError(f"{name} must hold {length} tensors, got {len(tensors)}")
    for k, t in enumerate(tensors):
        check_tensor(f"{name}[{k}]", t, dtypes=(dtype,))
        check_contiguous(f"{name}[{k}]", t)
        if t.numel() != numel:
            raise ValueError(f"{name}[{k}] must hold {numel} elements, got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}[{k}] must be on {device}, got {t.device}")


def _table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    ptrs: List[int] = [t.data_ptr() for t in tensors] or [0]
    return torch.tensor(ptrs, dtype=torch.int64).to(device, non_blocking=True)


def mhc_multilayer_recompute(initial_residual: torch.Tensor, pre_mix_list: List[torch.Tensor],
                             layer_output_list: List[torch.Tensor], post_mix_list: List[torch.Tensor],
                             comb_mix_list: List[torch.Tensor], layer_input_list: List[torch.Tensor],
                             residual_list: List[torch.Tensor]) -> None:
    """Recompute ``L`` sublayers' inputs and residuals from ``R_0``, in place.

    Args:
        initial_residual: bf16 ``(..., n, H)``, contiguous: ``R_0``.
        pre_mix_list: ``L >= 1`` fp32 tensors of ``T * n`` values (e.g. ``(..., n, 1)``), contiguous.
        layer_output_list: ``L_post`` bf16 ``(..., H)`` sublayer outputs ``y_i``, with ``L_post`` in ``{L - 1, L}``.
        post_mix_list: ``L_post`` fp32 ``(..., n, 1)``.
        comb_mix_list: ``L_post`` fp32 ``(..., n, n)`` (``[input stream, output stream]``).
        layer_input_list: ``L`` bf16 ``(..., H)`` outputs: ``u_i = mhc_pre_apply_mix(R_i, pre_i)``.
        residual_list: ``L_post`` bf16 ``(..., n, H)`` outputs: ``R_{i+1} = mhc_post(y_i, R_i, post_i, comb_i)``.

    Every tensor must be contiguous, on ``initial_residual``'s device, and hold the token count of
    ``initial_residual``.  Bitwise equal to chaining ``mhc_pre_apply_mix`` and ``mhc_post_fwd``.  Returns None.
    """
    check_tensor("initial_residual", initial_residual, dtypes=(torch.bfloat16,))
    if initial_residual.dim() < 2:
        raise ValueError(f"initial_residual must be (..., n, H), got shape {tuple(initial_residual.shape)}")
    check_contiguous("initial_residual", initial_residual)
    n, h = initial_residual.shape[-2], initial_residual.shape[-1]
    t = 1
    for d in initial_residual.shape[:-2]:
        t *= d
    dev = initial_residual.device
    if not isinstance(pre_mix_list, (list, tuple)):
        raise TypeError(f"pre_mix_list must be a list of tensors, got {type(pre_mix_list).__name__}")
    num_layers = len(pre_mix_list)
    if num_layers < 1:
        raise ValueError("pre_mix_list must hold at least one tensor, got 0")
    if not isinstance(layer_output_list, (list, tuple)):
        raise TypeError(f"layer_output_list must be a list of tensors, got {type(layer_output_list).__name__}")
    num_post = len(layer_output_list)
    if num_post not in (num_layers - 1, num_layers):
        raise ValueError(f"layer_output_list must hold L - 1 = {num_layers - 1} or L = {num_layers} tensors, "
                         f"got {num_post}")
    _check_list("pre_mix_list", pre_mix_list, num_layers, torch.float32, t * n, dev)
    _check_list("layer_output_list", layer_output_list, num_post, torch.bfloat16, t * h, dev)
    _check_list("post_mix_list", post_mix_list, num_post, torch.float32, t * n, dev)
    _check_list("comb_mix_list", comb_mix_list, num_post, torch.float32, t * n * n, dev)
    _check_list("layer_input_list", layer_input_list, num_layers, torch.bfloat16, t * h, dev)
    _check_list("residual_list", residual_list, num_post, torch.bfloat16, t * n * h, dev)
    if t == 0 or h == 0:
        return None
    _multilayer_op(initial_residual, list(pre_mix_list), list(layer_output_list), list(post_mix_list),
                   list(comb_mix_list), list(layer_input_list), list(residual_list))
    return None


@custom_op("mhc_multilayer_recompute", mutates_args=("layer_input_list", "residual_list"),
           fake=lambda r0, pre, y, post, comb, li, res: None)
def _multilayer_op(initial_residual: torch.Tensor, pre_mix_list: List[torch.Tensor],
                   layer_output_list: List[torch.Tensor], post_mix_list: List[torch.Tensor],
                   comb_mix_list: List[torch.Tensor], layer_input_list: List[torch.Tensor],
                   residual_list: List[torch.Tensor]) -> None:
    n, h = initial_residual.shape[-2], initial_residual.shape[-1]
    t = initial_residual.numel() // (n * h)
    dev = initial_residual.device
    num_layers, num_post = len(pre_mix_list), len(layer_output_list)
    bn = next_power_of_two(n)
    cfg = tuned("mhc_multilayer_recompute", residual_tile_config(h, bn))
    grid = (ceil_div(t, cfg["BT"]), ceil_div(h, cfg["BH"]))
    _multilayer_kernel[grid](
        initial_residual, _table(pre_mix_list, dev), _table(layer_output_list, dev), _table(post_mix_list, dev),
        _table(comb_mix_list, dev), _table(layer_input_list, dev), _table(residual_list, dev), t,
        H=h, N=n, BN=bn, L=num_layers, LP=num_post, BT=cfg["BT"], BH=cfg["BH"], num_warps=cfg["num_warps"],
        **NO_FUSION, **pdl_args(dev))
