"""The MoE layer's bf16 SwiGLU with a per-row routing weight (the bf16 mode's activation; the FP8 mode uses
tritile.quant's fused casts): forward and backward kernels over bf16 bit patterns, as ``torch.library`` custom ops."""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, exp_f32, f32_to_bf16_bits
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import custom_op, interpreter_configs


@triton.jit
def _swiglu_fwd_kernel(h_ptr, w_ptr, out_ptr, num_rows, inter, stride_h, stride_o,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """``out[e, j] = bf16(silu(h[e, j]) * h[e, j + I] * w[e])`` over bf16 bit patterns (int16 views)."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < num_rows
    mask = rmask[:, None] & (cols < inter)[None, :]
    base = h_ptr + rows[:, None] * stride_h + cols[None, :]
    l = bf16_bits_to_f32(tl.load(base, mask=mask, other=0))
    r = bf16_bits_to_f32(tl.load(base + inter, mask=mask, other=0))
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    s = tl.math.div_rn(1.0, 1.0 + exp_f32(-l))
    a = l * s * r * w[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], f32_to_bf16_bits(a), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, w_ptr, g_ptr, dh_ptr, act_ptr, dw_ptr, num_rows, inter, stride_h, stride_g,
                       stride_dh, stride_a, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       NUM_C: tl.constexpr, PDL: tl.constexpr = False):
    """With ``s = sigmoid(l)``, ``a = l s r``, ``gw = g w``: ``dh[:, :I] = bf16(gw r s (1 + l (1 - s)))``,
    ``dh[:, I:] = bf16(gw l s)``, ``act = bf16(a w)`` and ``dw[e] = sum_j g a`` (float32)."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < num_rows
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for c in range(NUM_C):
        cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < inter)[None, :]
        base = h_ptr + rows[:, None] * stride_h + cols[None, :]
        l = bf16_bits_to_f32(tl.load(base, mask=mask, other=0))
        r = bf16_bits_to_f32(tl.load(base + inter, mask=mask, other=0))
        g = bf16_bits_to_f32(tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0))
        s = tl.math.div_rn(1.0, 1.0 + exp_f32(-l))
        silu = l * s
        a = silu * r
        gw = g * w[:, None]
        dl = gw * r * (s * (1.0 + l * (1.0 - s)))
        dr = gw * silu
        out = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        tl.store(out, f32_to_bf16_bits(dl), mask=mask)
        tl.store(out + inter, f32_to_bf16_bits(dr), mask=mask)
        tl.store(act_ptr + rows[:, None] * stride_a + cols[None, :], f32_to_bf16_bits(a * w[:, None]), mask=mask)
        acc += tl.sum(tl.where(mask, g * a, 0.0), axis=1)
    tl.store(dw_ptr + rows, acc, mask=rmask)


def _swiglu_blocks(inter: int) -> Tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): bigger tiles under the interpreter (its cost is per program)."""
    block_c = min(triton.next_power_of_2(inter), 256 if interpreter_configs() else 512)
    return (64 if interpreter_configs() else 4), block_c, 4


def _swiglu_bf16_fake(h, w_row):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@custom_op("moe_swiglu_bf16", fake=_swiglu_bf16_fake)
def _swiglu_bf16(h: torch.Tensor, w_row: torch.Tensor) -> torch.Tensor:
    """bf16 ``(N, I)``: ``silu(h[:, :I]) * h[:, I:] * w_row[:, None]`` (float32 maths, one bf16 rounding).

    h: bf16 ``(N, 2I)`` with unit column stride; w_row: float32 ``(N,)`` contiguous."""
    n, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty((n, inter), dtype=torch.bfloat16, device=h.device)
    if n == 0 or inter == 0:
        return out
    br, bc, warps = _swiglu_blocks(inter)
    hv = h.view(torch.int16)
    _swiglu_fwd_kernel[(triton.cdiv(n, br), triton.cdiv(inter, bc))](
        hv, w_row, out.view(torch.int16), n, inter, hv.stride(0), inter, BLOCK_R=br, BLOCK_C=bc,
        num_warps=warps, **pdl_args(h.device))
    return out


def _swiglu_bf16_backward_fake(h, w_row, grad):
    n, inter = h.shape[0], h.shape[1] // 2
    return h.new_empty((n, 2 * inter)), h.new_empty((n, inter)), w_row.new_empty((n,))


@custom_op("moe_swiglu_bf16_backward", fake=_swiglu_bf16_backward_fake)
def _swiglu_bf16_backward(h: torch.Tensor, w_row: torch.Tensor,
                          grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``_swiglu_bf16``: ``(dh bf16 (N, 2I), act * w bf16 (N, I), d w_row float32 (N,))``."""
    n, inter = h.shape[0], h.shape[1] // 2
    dh = torch.empty((n, 2 * inter), dtype=torch.bfloat16, device=h.device)
    act = torch.empty((n, inter), dtype=torch.bfloat16, device=h.device)
    dw = torch.zeros((n,), dtype=torch.float32, device=h.device)
    if n == 0 or inter == 0:
        return dh, act, dw
    br, bc, warps = _swiglu_blocks(inter)
    hv, gv = h.view(torch.int16), grad.contiguous().view(torch.int16)
    _swiglu_bwd_kernel[(triton.cdiv(n, br),)](
        hv, w_row, gv, dh.view(torch.int16), act.view(torch.int16), dw, n, inter, hv.stride(0), gv.stride(0),
        2 * inter, inter, BLOCK_R=br, BLOCK_C=bc, NUM_C=triton.cdiv(inter, bc), num_warps=warps,
        **pdl_args(h.device))
    return dh, act, dw
