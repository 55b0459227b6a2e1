"""Combine reduction: sum the rows returned by each destination rank, in ascending rank order, plus biases.

``out[t] = bf16(((0 + f32(bias0[t])) + f32(bias1[t])) + f32(buf[base[0] + slot[t, 0]]) + ... )`` over the ranks
``r = 0..R-1`` with ``slot[t, r] >= 0``, every add in float32, one round-to-nearest-even conversion at the end
(pure adds: no fused multiply-add can change the bits, so the GPU and the interpreter agree bit for bit).
Weights likewise: ``w_out[t] = 0 + w_buf[row_0] + w_buf[row_1] + ...`` in float32.

One launch; programs over ``(BLOCK_T tokens) x (BLOCK_H columns)``; bf16 values are read as int16 bit patterns
and widened exactly (the 3.6 interpreter mis-loads bf16 subnormals).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, f32_to_bf16_bits
from ..language.pdl import pdl_enter
from ..runtime import check_inner_contiguous, check_shape, check_tensor, custom_op, empty, interpreter_configs
from ..runtime import kernel_device_ok
from ..runtime.plan import planned
from ..utils import ceil_div, next_power_of_two

__all__ = ["combine_reduce"]

_INTERPRET = interpreter_configs()


@triton.jit
def _combine_reduce_kernel(buf_ptr, stride_b, slot_ptr, base_ptr, b0_ptr, s_b0, b1_ptr, s_b1, out_ptr,
                           wbuf_ptr, wout_ptr, num_tokens, hidden,
                           NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr, HAS_B0: tl.constexpr,
                           HAS_B1: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid_h = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_h.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_tokens
    m = row_ok[:, None] & (cols[None, :] < hidden)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    if HAS_B0:
        acc += bf16_bits_to_f32(tl.load(b0_ptr + rows[:, None] * s_b0 + cols[None, :], mask=m, other=0))
    if HAS_B1:
        acc += bf16_bits_to_f32(tl.load(b1_ptr + rows[:, None] * s_b1 + cols[None, :], mask=m, other=0))
    kk = tl.arange(0, BLOCK_K)
    kin = row_ok[:, None] & (kk[None, :] < NUM_TOPK)
    wacc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(slot_ptr + rows * NUM_RANKS + r, mask=row_ok, other=-1)
        src = tl.load(base_ptr + r).to(tl.int64) + slot
        ok = slot >= 0
        v = tl.load(buf_ptr + src[:, None] * stride_b + cols[None, :], mask=m & ok[:, None], other=0)
        acc = tl.where(ok[:, None], acc + bf16_bits_to_f32(v), acc)
        if HAS_W:
            if pid_h == 0:
                wv = tl.load(wbuf_ptr + src[:, None] * NUM_TOPK + kk[None, :], mask=kin & ok[:, None], other=0.0)
                wacc = tl.where(ok[:, None], wacc + wv, wacc)
    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], f32_to_bf16_bits(acc), mask=m)
    if HAS_W:
        if pid_h == 0:
            tl.store(wout_ptr + rows[:, None] * NUM_TOPK + kk[None, :], wacc, mask=kin)


def _config(hidden: int) -> dict:
    if _INTERPRET:
        return dict(BLOCK_T=16, BLOCK_H=min(next_power_of_two(max(hidden, 1)), 512), num_warps=1)
    h = max(hidden, 1)
    bh = next_power_of_two(h) if h <= 2048 else min((2048, 1024, 512), key=lambda b: (ceil_div(h, b) * b - h, -b))
    return dict(BLOCK_T=1, BLOCK_H=bh, num_warps=4 if bh >= 1024 else 2)


def _combine_reduce_fake(buf, send_slot, base, bias0, bias1, wbuf):
    t = send_slot.shape[0]
    k = 0 if wbuf is None else wbuf.shape[1]
    return buf.new_empty((t, buf.shape[1])), buf.new_empty((t, k), dtype=torch.float32)


@custom_op("ep_combine_reduce", fake=_combine_reduce_fake)
def _combine_reduce_op(buf: torch.Tensor, send_slot: torch.Tensor, base: torch.Tensor, bias0: Optional[torch.Tensor],
                       bias1: Optional[torch.Tensor], wbuf: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_ranks = send_slot.shape
    hidden = buf.shape[1]
    k = 0 if wbuf is None else wbuf.shape[1]
    dev = buf.device
    out = empty((num_tokens, hidden), torch.bfloat16, dev)
    wout = empty((num_tokens, k), torch.float32, dev)
    if not kernel_device_ok(dev):
        from .ref import combine_reduce_ref

        o, w = combine_reduce_ref(buf, send_slot, base, bias0, bias1, wbuf)
        out.copy_(o)
        if wbuf is not None:
            wout.copy_(w)
        return out, wout
    if num_tokens == 0:
        return out, wout
    if hidden == 0 and wbuf is None:
        return out, wout
    cfg = _config(hidden)
    dummy = buf.view(torch.int16)
    b0 = dummy if bias0 is None else bias0.view(torch.int16)
    b1 = dummy if bias1 is None else bias1.view(torch.int16)
    grid = (ceil_div(num_tokens, cfg["BLOCK_T"]), max(1, ceil_div(hidden, cfg["BLOCK_H"])))
    _combine_reduce_kernel[grid](
        buf.view(torch.int16), buf.stride(0), send_slot, base, b0, b0.stride(0), b1, b1.stride(0),
        out.view(torch.int16), wbuf if wbuf is not None else out, wout, num_tokens, hidden,
        NUM_RANKS=num_ranks, NUM_TOPK=max(k, 1), HAS_B0=bias0 is not None, HAS_B1=bias1 is not None,
        HAS_W=wbuf is not None and k > 0, BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"],
        BLOCK_K=next_power_of_two(max(k, 1)), PDL=False, num_warps=cfg["num_warps"])
    return out, wout


@planned("ep_combine_reduce")
def combine_reduce(buf: torch.Tensor, send_slot: torch.Tensor, base: torch.Tensor,
                   bias0: Optional[torch.Tensor] = None, bias1: Optional[torch.Tensor] = None,
                   wbuf: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reduce the rows returned by the destination ranks onto the original tokens.

    Args:
        buf: bfloat16 ``(S, H)``, unit inner stride: rows received back, rank ``r``'s block starting at ``base[r]``.
        send_slot: int32 ``(T, R)``: row of token ``t`` inside rank ``r``'s block, ``-1`` = not sent.
        base: int32 ``(R,)``.
        bias0, bias1: optional bfloat16 ``(T, H)`` with unit inner stride.
        wbuf: optional float32 ``(S, k)``, contiguous: weights returned with the rows.

    Returns:
        ``(out, w_out)``: bfloat16 ``(T, H)`` (the sum in the order of the module docstring) and float32
        ``(T, k)`` (None without ``wbuf``).
    """
    check_tensor("buf", buf, dtypes=(torch.bfloat16,), ndim=2)
    check_inner_contiguous("buf", buf)
    check_tensor("send_slot", send_slot, dtypes=(torch.int32,), ndim=2)
    check_tensor("base", base, dtypes=(torch.int32,), ndim=1)
    t = send_slot.shape[0]
    for name, b in (("bias0", bias0), ("bias1", bias1)):
        if b is not None:
            check_tensor(name, b, dtypes=(torch.bfloat16,), ndim=2)
            check_shape(name, b, (t, buf.shape[1]))
            check_inner_contiguous(name, b)
    if wbuf is not None:
        check_tensor("wbuf", wbuf, dtypes=(torch.float32,), ndim=2)
        if wbuf.shape[0] != buf.shape[0]:
            raise ValueError(f"wbuf must have {buf.shape[0]} rows, got {tuple(wbuf.shape)}")
        wbuf = wbuf.contiguous()
    out, wout = _combine_reduce_op(buf, send_slot.contiguous(), base.contiguous(), bias0, bias1, wbuf)
    return out, (wout if wbuf is not None else None)
