"""Engram gate: fused RMSNorm(x) . RMSNorm(k) gate, signed-sqrt, sigmoid and residual add; and its backward.

Per token t and hyper-connection head h (x = hidden_states[t, h], k = k[t, h], w = weight_fused[h], v = v[t]):

    D   = sum_d x_d * w_d * k_d                      (the raw dot, saved as ``dot``)
    r_x = rsqrt(sum_d x_d^2 / H + eps),  r_k = rsqrt(sum_d k_d^2 / H + eps)
    s   = D * r_x * r_k * H^-0.5
    g   = sigmoid(copysign(sqrt(max(|s|, clamp_value)), s))
    out = bf16(x + g * v)

The forward's default is ``_engram_gate_fwd_persist_kernel`` (program = one head of a token chunk, w[h] in
registers); ``_engram_gate_fwd_kernel`` (ROWS rows per program) is the tuning alternative.

The backward's default is one pass, ``_engram_gate_bwd_fused_kernel`` (program = one head of a token chunk: the
row's gamma = G . v, then grad_x, grad_k, the grad_w accumulator and a column slice of grad_v).  The earlier two
passes remain as tuning alternatives (``FUSED=False``):

1. ``_engram_gate_bwd_coef_kernel`` (or ``_engram_gate_bwd_gamma_kernel``), one program per token:
   ``gamma[t, h] = sum_d G_d v_d`` (dL/dg) and ``grad_v[t] = sum_h g_h G_h``.
2. ``_engram_gate_bwd_split_kernel`` (or ``_engram_gate_bwd_kernel``), programs over (token chunk p, H tiles):
   grad_x, grad_k and ``grad_w_partial[p] = sum_{t in chunk p} delta * x * k``, with ``delta = dL/dD`` (r held fixed).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..config import get_num_sms
from ..language import bf16_bits_to_f32, exp_f32, f32_to_bf16_bits
from ..runtime import check_contiguous, check_same_device, check_tensor, custom_op, empty, tuned
from ..utils import ceil_div, next_power_of_two
from ._utils import bits16, check_float, check_rows, empty_like, interp


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _gate_row_math(x, k, w, v, hf, eps, clamp_value, scale):
    """The gate of ``[ROWS, BLOCK_H]`` fp32 tiles (masked lanes 0): returns (out fp32, dot, g, rstd_x, rstd_k)."""
    sum_xx = tl.sum(x * x, axis=1)
    sum_kk = tl.sum(k * k, axis=1)
    dot = tl.sum((x * w) * k, axis=1)
    # a sum of signed zeros is +0 (as torch's sum and TileKernels' zero-initialised reduction give), whatever
    # order the backend's tree reduction adds them in
    dot = tl.where(dot == 0.0, 0.0, dot)
    rstd_x = tl.math.div_rn(tl.full(sum_xx.shape, 1.0, tl.float32), tl.sqrt_rn(tl.math.div_rn(sum_xx, hf) + eps))
    rstd_k = tl.math.div_rn(tl.full(sum_kk.shape, 1.0, tl.float32), tl.sqrt_rn(tl.math.div_rn(sum_kk, hf) + eps))
    s = dot * rstd_x * rstd_k * scale
    a = tl.abs(s)
    a = tl.where(a < clamp_value, clamp_value, a)  # NaN stays NaN
    # copysign: s == -0.0 gives -sqrt(clamp_value), as TileKernels' kernel does
    q = tl.sqrt_rn(a).to(tl.int32, bitcast=True)
    sign = (s.to(tl.int32, bitcast=True) >> 31) << 31
    u = ((q & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
    g = tl.math.div_rn(tl.full(u.shape, 1.0, tl.float32), 1.0 + exp_f32(-u))
    out = x + g[:, None] * v
    return out, dot, g, rstd_x, rstd_k


@triton.jit
def _engram_gate_fwd_kernel(
    x_ptr, k_ptr, v_ptr, w_ptr, out_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr,
    num_rows, hc, H, hidden_f, eps, clamp_value, scale,
    s_x0, s_x1, s_k0, s_k1, s_v0, s_w0, s_o0, s_o1,
    SAVE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # ROWS (token, head) rows per program, each held whole in registers: x, k, w and v are read once per row.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    t = rows // hc
    h = rows % hc
    d = tl.arange(0, BLOCK_H)
    mask = rmask[:, None] & (d < H)[None, :]
    x = bf16_bits_to_f32(tl.load(x_ptr + t[:, None] * s_x0 + h[:, None] * s_x1 + d[None, :], mask=mask, other=0))
    k = bf16_bits_to_f32(tl.load(k_ptr + t[:, None] * s_k0 + h[:, None] * s_k1 + d[None, :], mask=mask, other=0))
    w = tl.load(w_ptr + h[:, None] * s_w0 + d[None, :], mask=mask, other=0.0)
    v = bf16_bits_to_f32(tl.load(v_ptr + t[:, None] * s_v0 + d[None, :], mask=mask, other=0))
    # hidden_f: float(H), passed as fp32 so H keeps Triton's divisibility specialisation (vector loads)
    out, dot, g, rstd_x, rstd_k = _gate_row_math(x, k, w, v, hidden_f, eps, clamp_value, scale)
    tl.store(out_ptr + t[:, None] * s_o0 + h[:, None] * s_o1 + d[None, :], f32_to_bf16_bits(out), mask=mask)
    if SAVE:
        tl.store(dot_ptr + rows, dot, mask=rmask)
        tl.store(gate_ptr + rows, g, mask=rmask)
        tl.store(rstd_x_ptr + rows, rstd_x, mask=rmask)
        tl.store(rstd_k_ptr + rows, rstd_k, mask=rmask)


@triton.jit(do_not_specialize=["T", "chunk"])
def _engram_gate_fwd_persist_kernel(
    x_ptr, k_ptr, v_ptr, w_ptr, out_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr,
    T, hc, H, chunk, hidden_f, eps, clamp_value, scale,
    s_x0, s_x1, s_k0, s_k1, s_v0, s_w0, s_o0, s_o1,
    SAVE: tl.constexpr, BLOCK_H: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Program (c, h): head h of the tokens [c * chunk, (c + 1) * chunk), one token at a time.  w[h] is loaded
    # once and stays in registers (the row kernel re-reads it from L2 for every row); the hc programs of a
    # chunk are neighbours in the grid, so v[t] comes from DRAM once and from L2 for the other heads.
    # With PREFETCH, token t + 1's x, k and v are in flight while token t is reduced and stored.
    pid = tl.program_id(0)
    h = pid % hc
    t = (pid // hc).to(tl.int64) * chunk
    t_end = tl.minimum(t + chunk, T)
    d = tl.arange(0, BLOCK_H)[None, :]
    dmask = d < H
    w = tl.load(w_ptr + h * s_w0 + d, mask=dmask, other=0.0)
    xp = x_ptr + h * s_x1 + d
    kp = k_ptr + h * s_k1 + d
    vp = v_ptr + d
    op = out_ptr + h * s_o1 + d
    one = tl.full([1], 0, tl.int64) + h  # [1]-shaped row index of the saved tensors
    if PREFETCH:
        pm = dmask & (t < t_end)
        n_x = tl.load(xp + t * s_x0, mask=pm, other=0)
        n_k = tl.load(kp + t * s_k0, mask=pm, other=0)
        n_v = tl.load(vp + t * s_v0, mask=pm, other=0)
    while t < t_end:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        if PREFETCH:
            c_x = n_x
            c_k = n_k
            c_v = n_v
            pm = dmask & (t + 1 < t_end)
            n_x = tl.load(xp + (t + 1) * s_x0, mask=pm, other=0)
            n_k = tl.load(kp + (t + 1) * s_k0, mask=pm, other=0)
            n_v = tl.load(vp + (t + 1) * s_v0, mask=pm, other=0)
        else:
            c_x = tl.load(xp + t * s_x0, mask=dmask, other=0)
            c_k = tl.load(kp + t * s_k0, mask=dmask, other=0)
            c_v = tl.load(vp + t * s_v0, mask=dmask, other=0)
        x = bf16_bits_to_f32(c_x)
        k = bf16_bits_to_f32(c_k)
        v = bf16_bits_to_f32(c_v)
        out, dot, g, rstd_x, rstd_k = _gate_row_math(x, k, w, v, hidden_f, eps, clamp_value, scale)
        tl.store(op + t * s_o0, f32_to_bf16_bits(out), mask=dmask)
        if SAVE:
            row = t * hc + one
            tl.store(dot_ptr + row, dot)
            tl.store(gate_ptr + row, g)
            tl.store(rstd_x_ptr + row, rstd_x)
            tl.store(rstd_k_ptr + row, rstd_k)
        t += 1


def _scale(H: int) -> float:
    """fp32(H^-0.5), the 1/sqrt(H) of the scaled dot product."""
    return float(np.float32(H ** -0.5))


def _fwd_config(H: int):
    """(BLOCK_H, ROWS, num_warps) of the row kernel: ROWS whole rows per program, ~16 fp32 elements per thread."""
    block_h = next_power_of_two(H)
    if interp():
        return block_h, max(1, 32768 // block_h), 4
    rows = max(1, 4096 // block_h)
    num_warps = min(16, max(4, rows * block_h // 512))
    return block_h, rows, num_warps


def _fwd_launch_config(H: int) -> dict:
    """The fwd launch config, through ``tuned("engram_gate_fwd", ...)``.

    PERSIST: the persistent kernel (program = one head of a token chunk, w[h] held in registers, the next
    token's rows prefetched when PREFETCH); False: the row kernel (ROWS (token, head) rows per program, which
    re-reads w and v from L2 for every row: 519 us at T=8001, hc=4, H=7168 on the H200, 2026-11-30).
    WARPS: warps per program of either kernel.  WAVES: the persistent grid is about WAVES * num_sms programs
    (the programs per SM that fit: ~100 registers per thread at 16 fp32 elements per thread and tensor)."""
    block_h, rows, num_warps = _fwd_config(H)
    if interp():
        return tuned("engram_gate_fwd", dict(BLOCK_H=block_h, ROWS=rows, WARPS=num_warps, PERSIST=True,
                                             WAVES=1, PREFETCH=True))
    # SASS (sm_90, H = 7168, BLOCK_H = 8192, 16 warps): 16 bf16 of x, k, v per thread in 2 LDG.E.128 each,
    # w[h] in 4 LDG.E.128 once per program, out in 2 STG.E.128; no spills
    warps = min(16, max(4, block_h // 512))
    return tuned("engram_gate_fwd", dict(BLOCK_H=block_h, ROWS=rows, WARPS=warps, PERSIST=True,
                                         WAVES=max(1, 16 // warps), PREFETCH=True))


def _check_gate_inputs(hidden_states, k, v, weight_fused):
    check_tensor("hidden_states", hidden_states, dtypes=(torch.bfloat16,), ndim=3)
    T, hc, H = hidden_states.shape
    check_rows("hidden_states", hidden_states, torch.bfloat16, (T, hc, H))
    check_rows("k", k, torch.bfloat16, (T, hc, H))
    check_rows("v", v, torch.bfloat16, (T, H))
    check_rows("weight_fused", weight_fused, torch.float32, (hc, H))
    return T, hc, H


def _engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward):
    T, hc, H = hidden_states.shape
    dev = hidden_states.device
    out = empty_like(hidden_states)
    if save_for_backward:
        saved = [empty((T, hc), torch.float32, dev) for _ in range(4)]
    else:
        saved = [None] * 4
    num_rows = T * hc
    if num_rows == 0:
        return (out, *saved)
    # BLOCK_H, ROWS, WARPS, PERSIST change the reduction layout (so the last bits of dot / rstd, hence of the
    # output); save_for_backward never does (same config, same code, stores only added)
    cfg = _fwd_launch_config(H)
    block_h, num_warps = max(cfg["BLOCK_H"], next_power_of_two(H)), cfg["WARPS"]
    dummy = out
    ptrs = (bits16(hidden_states), bits16(k), bits16(v), weight_fused, bits16(out),
            *(s if s is not None else dummy for s in saved))
    strides = (hidden_states.stride(0), hidden_states.stride(1), k.stride(0), k.stride(1), v.stride(0),
               weight_fused.stride(0), out.stride(0), out.stride(1))
    if cfg["PERSIST"]:
        n_chunks = max(1, min(T, int(cfg["WAVES"]) * get_num_sms() // hc))
        chunk = ceil_div(T, n_chunks)
        n_chunks = ceil_div(T, chunk)
        _engram_gate_fwd_persist_kernel[(n_chunks * hc,)](
            *ptrs, T, hc, H, chunk, float(H), eps, clamp_value, _scale(H), *strides,
            SAVE=bool(save_for_backward), BLOCK_H=block_h, PREFETCH=bool(cfg["PREFETCH"]), num_warps=num_warps,
        )
    else:
        rows = cfg["ROWS"]
        _engram_gate_fwd_kernel[(ceil_div(num_rows, rows),)](
            *ptrs, num_rows, hc, H, float(H), eps, clamp_value, _scale(H), *strides,
            SAVE=bool(save_for_backward), ROWS=rows, BLOCK_H=block_h, num_warps=num_warps,
        )
    return (out, *saved)


_Opt = Optional[torch.Tensor]


def engram_gate_fwd(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
) -> Tuple[torch.Tensor, _Opt, _Opt, _Opt, _Opt]:
    """Engram gate forward: ``out = x + sigmoid(signed_sqrt(<RMSNorm(x), RMSNorm(k)>_w / sqrt(H))) * v``.

    Args:
        hidden_states: x, shape (num_tokens, hc_mult, hidden_size), bfloat16; any token/head strides,
            unit stride along hidden_size.
        k: keys, shape (num_tokens, hc_mult, hidden_size), bfloat16; any token/head strides (e.g. a slice
            of a fused projection), unit stride along hidden_size.
        v: values, shape (num_tokens, hidden_size), bfloat16, shared by all heads; any row stride,
            unit stride along hidden_size.
        weight_fused: ``weight_hidden * weight_embed``, shape (hc_mult, hidden_size), float32
            (see ``fused_weight``); unit stride along hidden_size.
        eps: RMSNorm epsilon, added to the mean square inside the rsqrt.
        clamp_value: floor on |s| before the square root (tau).
        save_for_backward: also return the four tensors ``engram_gate_bwd`` needs.

    Returns:
        ``(output, dot, gate_score, rstd_x, rstd_k)``:
        output: shape (num_tokens, hc_mult, hidden_size), bfloat16 (``empty_like(hidden_states)``), RNE;
        dot: the raw ``sum_d x*w*k`` (not normalised, not scaled), shape (num_tokens, hc_mult), float32;
        gate_score: sigmoid gate g, shape (num_tokens, hc_mult), float32;
        rstd_x, rstd_k: the RMSNorm reciprocal roots, shape (num_tokens, hc_mult), float32.
        With ``save_for_backward=False`` the last four are ``None``; ``output`` is bitwise the same.

    At s == 0 (e.g. an all-zero row) the gate is ``sigmoid(+-sqrt(clamp_value))`` by the sign bit of s, as
    in TileKernels' kernel (its PyTorch reference gives 0.5).  Any hidden_size >= 1 and any hc_mult work
    (TileKernels needs hidden_size >= 512 and a multiple of 256).  NaN/inf propagate.
    """
    T, hc, H = _check_gate_inputs(hidden_states, k, v, weight_fused)
    eps = check_float("eps", eps)
    clamp_value = check_float("clamp_value", clamp_value)
    check_same_device(hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused)
    if H == 0:
        raise ValueError("hidden_states must have a positive hidden size, got 0")
    save_for_backward = bool(save_for_backward)
    if torch.compiler.is_compiling():  # traced as the opaque custom op ``torch.ops.tritile.engram_gate_fwd``
        res = _engram_gate_fwd_op(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward)
        return tuple(res) if save_for_backward else (res[0], None, None, None, None)
    return _engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward)


def _fwd_fake(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward):
    T, hc, _ = hidden_states.shape
    out = torch.empty_like(hidden_states)
    n = (T, hc) if save_for_backward else (0,)
    return [out] + [hidden_states.new_empty(n, dtype=torch.float32) for _ in range(4)]


@custom_op("engram_gate_fwd", fake=_fwd_fake)
def _engram_gate_fwd_op(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_fused: torch.Tensor,
                        eps: float, clamp_value: float, save_for_backward: bool) -> List[torch.Tensor]:
    """The fwd as a custom op: without saving, the four saved tensors are empty (0,) placeholders."""
    res = _engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward)
    if save_for_backward:
        return list(res)
    return [res[0]] + [hidden_states.new_empty((0,), dtype=torch.float32) for _ in range(4)]


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_gamma_grad_v(go_ptr, v_ptr, gv_ptr, gate, t, hh, tmask, th_mask, H, s_g0, s_g1, s_v0, s_gv0,
                      HC_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pass 1's sweep over H for TOK tokens: stores grad_v = sum_h g_h G_h (bf16) and returns gamma = G . v
    ``[TOK, HC_P2]``."""
    g_row = t[:, None, None] * s_g0 + hh[None, :, None] * s_g1
    acc = tl.zeros((TOK, HC_P2, BLOCK_D), tl.float32)
    step = tl.program_id(0) * 0  # a run-time zero: the loop-carried value is a tensor from the start
    while step * BLOCK_D < H:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        d = step * BLOCK_D + tl.arange(0, BLOCK_D)  # (a multiple of BLOCK_D: vector loads)
        dmask = d < H
        m3 = th_mask[:, :, None] & dmask[None, None, :]
        go = bf16_bits_to_f32(tl.load(go_ptr + g_row + d[None, None, :], mask=m3, other=0))
        m2 = tmask[:, None] & dmask[None, :]
        v = bf16_bits_to_f32(tl.load(v_ptr + t[:, None] * s_v0 + d[None, :], mask=m2, other=0))
        acc += go * v[:, None, :]
        gv = tl.sum(gate[:, :, None] * go, axis=1)
        tl.store(gv_ptr + t[:, None] * s_gv0 + d[None, :], f32_to_bf16_bits(gv), mask=m2)
        step += 1
    gamma = tl.sum(acc, axis=2)
    return gamma


@triton.jit
def _bwd_pass1_tokens(gate_ptr, T, hc, HC_P2: tl.constexpr, TOK: tl.constexpr):
    """Pass 1's program: its TOK tokens ``t``, heads ``hh``, masks, the (token, head) offsets ``sc`` into the
    (T, hc) saved tensors and the gates ``[TOK, HC]`` (0 outside)."""
    t = tl.program_id(0).to(tl.int64) * TOK + tl.arange(0, TOK)
    hh = tl.arange(0, HC_P2)
    tmask = t < T
    th_mask = tmask[:, None] & (hh < hc)[None, :]
    sc = t[:, None] * hc + hh[None, :]
    return t, hh, tmask, th_mask, sc, tl.load(gate_ptr + sc, mask=th_mask, other=0.0)


@triton.jit
def _engram_gate_bwd_gamma_kernel(
    go_ptr, v_ptr, gate_ptr, gamma_ptr, gv_ptr,
    T, hc, H,
    s_g0, s_g1, s_v0, s_gv0,
    HC_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # TOK tokens per program, all heads, H in BLOCK_D-wide steps: gamma = G . v, grad_v = sum_h g_h G_h.
    t, hh, tmask, th_mask, sc, gate = _bwd_pass1_tokens(gate_ptr, T, hc, HC_P2, TOK)
    gamma = _bwd_gamma_grad_v(go_ptr, v_ptr, gv_ptr, gate, t, hh, tmask, th_mask, H, s_g0, s_g1, s_v0, s_gv0,
                              HC_P2, TOK, BLOCK_D)
    tl.store(gamma_ptr + t[:, None] * hc + hh[None, :], gamma, mask=th_mask)


@triton.jit(do_not_specialize=["T", "tokens_per_chunk"])
def _engram_gate_bwd_kernel(
    go_ptr, x_ptr, k_ptr, w_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr, gamma_ptr,
    gx_ptr, gk_ptr, gw_ptr,
    T, hc, H, hidden_f, tokens_per_chunk, clamp_value, scale,
    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gw0, s_gw1,
    HC_P2: tl.constexpr, BLOCK_D: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HC_P2)
    hmask = hh < hc
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d < H)[None, :]
    w = tl.load(w_ptr + hh[:, None] * s_w0 + d[None, :], mask=mask, other=0.0)
    hf = hidden_f
    acc = tl.zeros((HC_P2, BLOCK_D), tl.float32)
    t_begin = p * tokens_per_chunk
    t_end = tl.minimum(t_begin + tokens_per_chunk, T)
    t = t_begin
    while t < t_end:  # a while loop: range() over run-time bounds breaks the interpreter with numpy 2.4
        sc = t * hc + hh
        dot = tl.load(dot_ptr + sc, mask=hmask, other=1.0)  # padded heads: no 0/0
        g = tl.load(gate_ptr + sc, mask=hmask, other=0.0)
        rx = tl.load(rstd_x_ptr + sc, mask=hmask, other=0.0)
        rk = tl.load(rstd_k_ptr + sc, mask=hmask, other=0.0)
        gamma = tl.load(gamma_ptr + sc, mask=hmask, other=0.0)
        # delta = dL/dD with r held fixed: gamma * g(1-g) * du/ds * ds/dD, zero where |s| < clamp_value
        s = dot * rx * rk * scale
        ad = tl.abs(dot)
        dsqrt = tl.sqrt_rn(tl.math.div_rn(scale * rx * rk, ad))
        delta = gamma * (g * (1.0 - g)) * 0.5 * dsqrt
        delta = tl.where(tl.abs(s) < clamp_value, 0.0, delta)
        a_x = tl.math.div_rn(dot * rx * rx, hf)
        a_k = tl.math.div_rn(dot * rk * rk, hf)

        go = bf16_bits_to_f32(tl.load(go_ptr + t * s_g0 + hh[:, None] * s_g1 + d[None, :], mask=mask, other=0))
        x = bf16_bits_to_f32(tl.load(x_ptr + t * s_x0 + hh[:, None] * s_x1 + d[None, :], mask=mask, other=0))
        k = bf16_bits_to_f32(tl.load(k_ptr + t * s_k0 + hh[:, None] * s_k1 + d[None, :], mask=mask, other=0))
        gx = go + delta[:, None] * (w * k - x * a_x[:, None])
        gk = delta[:, None] * (w * x - k * a_k[:, None])
        tl.store(gx_ptr + t * s_gx0 + hh[:, None] * s_gx1 + d[None, :], f32_to_bf16_bits(gx), mask=mask)
        tl.store(gk_ptr + t * s_gk0 + hh[:, None] * s_gk1 + d[None, :], f32_to_bf16_bits(gk), mask=mask)
        acc += delta[:, None] * (x * k)
        t += 1
    tl.store(gw_ptr + p * s_gw0 + hh[:, None] * s_gw1 + d[None, :], acc, mask=mask)


@triton.jit
def _engram_gate_bwd_coef_kernel(
    go_ptr, v_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr, delta_ptr, ax_ptr, ak_ptr, gv_ptr,
    T, hc, H, hidden_f, clamp_value, scale,
    s_g0, s_g1, s_v0, s_gv0,
    HC_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # TOK tokens per program, all heads, H in BLOCK_D-wide steps: gamma = G . v (dL/dg), grad_v = sum_h g_h G_h;
    # then the per-(token, head) coefficients of pass 2: delta = dL/dD (r held fixed), a_x, a_k.
    t, hh, tmask, th_mask, sc, gate = _bwd_pass1_tokens(gate_ptr, T, hc, HC_P2, TOK)
    gamma = _bwd_gamma_grad_v(go_ptr, v_ptr, gv_ptr, gate, t, hh, tmask, th_mask, H, s_g0, s_g1, s_v0, s_gv0,
                              HC_P2, TOK, BLOCK_D)
    dot = tl.load(dot_ptr + sc, mask=th_mask, other=1.0)  # padded lanes: no 0/0
    rx = tl.load(rstd_x_ptr + sc, mask=th_mask, other=0.0)
    rk = tl.load(rstd_k_ptr + sc, mask=th_mask, other=0.0)
    # delta = dL/dD with r held fixed: gamma * g(1-g) * du/ds * ds/dD, zero where |s| < clamp_value
    s = dot * rx * rk * scale
    dsqrt = tl.sqrt_rn(tl.math.div_rn(scale * rx * rk, tl.abs(dot)))
    delta = gamma * (gate * (1.0 - gate)) * 0.5 * dsqrt
    delta = tl.where(tl.abs(s) < clamp_value, 0.0, delta)
    tl.store(delta_ptr + sc, delta, mask=th_mask)
    tl.store(ax_ptr + sc, tl.math.div_rn(dot * rx * rx, hidden_f), mask=th_mask)
    tl.store(ak_ptr + sc, tl.math.div_rn(dot * rk * rk, hidden_f), mask=th_mask)


@triton.jit
def _bwd_tile_math(go_b, x_b, k_b, w, delta, a_x, a_k):
    go = bf16_bits_to_f32(go_b)
    x = bf16_bits_to_f32(x_b)
    k = bf16_bits_to_f32(k_b)
    gx = go + delta[:, None] * (w * k - x * a_x[:, None])
    gk = delta[:, None] * (w * x - k * a_k[:, None])
    return f32_to_bf16_bits(gx), f32_to_bf16_bits(gk), delta[:, None] * (x * k)


@triton.jit(do_not_specialize=["T", "tokens_per_chunk"])
def _engram_gate_bwd_split_kernel(
    go_ptr, x_ptr, k_ptr, w_ptr, delta_ptr, ax_ptr, ak_ptr,
    gx_ptr, gk_ptr, gw_ptr,
    T, hc, H, tokens_per_chunk,
    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gw0, s_gw1,
    HC_P2: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Program (p, r): token chunk p (its grad_w_partial row), H tiles r, r + SPLIT, ...; tokens inner, so the
    # [HC, BLOCK_D] grad_w accumulator of a tile stays in registers.  SPLIT = number of H tiles gives one tile
    # per program; a smaller SPLIT gives fewer, longer programs (one wave, no tail).
    p = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HC_P2)
    hmask = hh < hc
    t_begin = p * tokens_per_chunk
    t_end = tl.minimum(t_begin + tokens_per_chunk, T)
    go_h = hh[:, None] * s_g1
    x_h = hh[:, None] * s_x1
    k_h = hh[:, None] * s_k1
    j = tl.program_id(1)
    while j * BLOCK_D < H:  # while loops: range() over run-time bounds breaks the interpreter (numpy 2.4)
        d = j * BLOCK_D + tl.arange(0, BLOCK_D)  # int32 in-row offsets (rows are < 2^31 elements)
        mask = hmask[:, None] & (d < H)[None, :]
        w = tl.load(w_ptr + hh[:, None] * s_w0 + d[None, :], mask=mask, other=0.0)
        acc = tl.zeros((HC_P2, BLOCK_D), tl.float32)
        t = t_begin
        if PREFETCH:
            # software pipelining by hand: token t + 1's tiles are in flight while token t is computed
            pm = mask & (t < t_end)
            n_go = tl.load(go_ptr + t * s_g0 + go_h + d[None, :], mask=pm, other=0)
            n_x = tl.load(x_ptr + t * s_x0 + x_h + d[None, :], mask=pm, other=0)
            n_k = tl.load(k_ptr + t * s_k0 + k_h + d[None, :], mask=pm, other=0)
            while t < t_end:
                sc = t * hc + hh
                delta = tl.load(delta_ptr + sc, mask=hmask, other=0.0)
                a_x = tl.load(ax_ptr + sc, mask=hmask, other=0.0)
                a_k = tl.load(ak_ptr + sc, mask=hmask, other=0.0)
                c_go = n_go
                c_x = n_x
                c_k = n_k
                tn = t + 1
                pm = mask & (tn < t_end)
                n_go = tl.load(go_ptr + tn * s_g0 + go_h + d[None, :], mask=pm, other=0)
                n_x = tl.load(x_ptr + tn * s_x0 + x_h + d[None, :], mask=pm, other=0)
                n_k = tl.load(k_ptr + tn * s_k0 + k_h + d[None, :], mask=pm, other=0)
                gx, gk, dw = _bwd_tile_math(c_go, c_x, c_k, w, delta, a_x, a_k)
                tl.store(gx_ptr + t * s_gx0 + hh[:, None] * s_gx1 + d[None, :], gx, mask=mask)
                tl.store(gk_ptr + t * s_gk0 + hh[:, None] * s_gk1 + d[None, :], gk, mask=mask)
                acc += dw
                t = tn
        else:
            while t < t_end:
                sc = t * hc + hh
                delta = tl.load(delta_ptr + sc, mask=hmask, other=0.0)
                a_x = tl.load(ax_ptr + sc, mask=hmask, other=0.0)
                a_k = tl.load(ak_ptr + sc, mask=hmask, other=0.0)
                c_go = tl.load(go_ptr + t * s_g0 + go_h + d[None, :], mask=mask, other=0)
                c_x = tl.load(x_ptr + t * s_x0 + x_h + d[None, :], mask=mask, other=0)
                c_k = tl.load(k_ptr + t * s_k0 + k_h + d[None, :], mask=mask, other=0)
                gx, gk, dw = _bwd_tile_math(c_go, c_x, c_k, w, delta, a_x, a_k)
                tl.store(gx_ptr + t * s_gx0 + hh[:, None] * s_gx1 + d[None, :], gx, mask=mask)
                tl.store(gk_ptr + t * s_gk0 + hh[:, None] * s_gk1 + d[None, :], gk, mask=mask)
                acc += dw
                t += 1
        tl.store(gw_ptr + p * s_gw0 + hh[:, None] * s_gw1 + d[None, :], acc, mask=mask)
        j += SPLIT


@triton.jit(do_not_specialize=["T", "tokens_per_chunk"])
def _engram_gate_bwd_fused_kernel(
    go_ptr, x_ptr, k_ptr, v_ptr, w_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr,
    gx_ptr, gk_ptr, gv_ptr, gw_ptr,
    T, hc, H, SW, hidden_f, tokens_per_chunk, clamp_value, scale,
    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_v0, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gv0, s_gw0, s_gw1,
    HC_P2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, PREFETCH: tl.constexpr,
    W_RESIDENT: tl.constexpr,
):
    # One pass.  Program (p, h): head h of token chunk p (grad_w_partial[p, h]), one whole row at a time:
    # gamma = G . v (dL/dg) reduced over the row held in registers, then delta, grad_x, grad_k and the grad_w
    # accumulator (w[h] and the accumulator stay in registers).  grad_v[t] = sum_h g_h G_h is split by columns:
    # this program writes columns [h * SW, (h + 1) * SW), reading the other heads' G slices, which the hc
    # programs of the chunk (neighbours in the grid, in step) have just brought into L2.
    pid = tl.program_id(0)
    h = pid % hc
    p = (pid // hc).to(tl.int64)
    t = p * tokens_per_chunk
    t_end = tl.minimum(t + tokens_per_chunk, T)
    d = tl.arange(0, BLOCK_H)[None, :]
    dmask = d < H
    if W_RESIDENT:
        w = tl.load(w_ptr + h * s_w0 + d, mask=dmask, other=0.0)
    gp = go_ptr + h * s_g1 + d
    xp = x_ptr + h * s_x1 + d
    kp = k_ptr + h * s_k1 + d
    vp = v_ptr + d
    one = tl.full([1], 0, tl.int64) + h  # [1]-shaped head index into the (T, hc) saved tensors
    # grad_v slice
    hh = tl.arange(0, HC_P2)
    e = h * SW + tl.arange(0, BLOCK_S)
    smask = (tl.arange(0, BLOCK_S) < SW) & (e < H)
    s2 = (hh < hc)[:, None] & smask[None, :]
    gsp = go_ptr + hh[:, None] * s_g1 + e[None, :]
    hf = hidden_f
    acc = tl.zeros((1, BLOCK_H), tl.float32)
    if PREFETCH >= 1:
        pm = dmask & (t < t_end)
        n_go = tl.load(gp + t * s_g0, mask=pm, other=0)
        n_v = tl.load(vp + t * s_v0, mask=pm, other=0)
    if PREFETCH >= 2:
        n_x = tl.load(xp + t * s_x0, mask=pm, other=0)
        n_k = tl.load(kp + t * s_k0, mask=pm, other=0)
    while t < t_end:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        if PREFETCH >= 1:  # 1: G and v (the reduction's inputs) of token t + 1 in flight; 2: also x and k
            c_go = n_go
            c_v = n_v
            pm = dmask & (t + 1 < t_end)
            n_go = tl.load(gp + (t + 1) * s_g0, mask=pm, other=0)
            n_v = tl.load(vp + (t + 1) * s_v0, mask=pm, other=0)
        else:
            c_go = tl.load(gp + t * s_g0, mask=dmask, other=0)
            c_v = tl.load(vp + t * s_v0, mask=dmask, other=0)
        if PREFETCH >= 2:
            c_x = n_x
            c_k = n_k
            n_x = tl.load(xp + (t + 1) * s_x0, mask=pm, other=0)
            n_k = tl.load(kp + (t + 1) * s_k0, mask=pm, other=0)
        else:
            c_x = tl.load(xp + t * s_x0, mask=dmask, other=0)
            c_k = tl.load(kp + t * s_k0, mask=dmask, other=0)
        if not W_RESIDENT:  # w[h] again for every token (an L1 hit): 16 fewer registers at 16 warps
            w = tl.load(w_ptr + h * s_w0 + d, mask=dmask, other=0.0, eviction_policy="evict_last")
        row = t * hc + one
        dot = tl.load(dot_ptr + row)
        g = tl.load(gate_ptr + row)
        rx = tl.load(rstd_x_ptr + row)
        rk = tl.load(rstd_k_ptr + row)
        go = bf16_bits_to_f32(c_go)
        gamma = tl.sum(go * bf16_bits_to_f32(c_v), axis=1)
        # delta = dL/dD with r held fixed: gamma * g(1-g) * du/ds * ds/dD, zero where |s| < clamp_value
        s = dot * rx * rk * scale
        dsqrt = tl.sqrt_rn(tl.math.div_rn(scale * rx * rk, tl.abs(dot)))
        delta = gamma * (g * (1.0 - g)) * 0.5 * dsqrt
        delta = tl.where(tl.abs(s) < clamp_value, 0.0, delta)
        a_x = tl.math.div_rn(dot * rx * rx, hf)
        a_k = tl.math.div_rn(dot * rk * rk, hf)
        x = bf16_bits_to_f32(c_x)
        k = bf16_bits_to_f32(c_k)
        gx = go + delta[:, None] * (w * k - x * a_x[:, None])
        gk = delta[:, None] * (w * x - k * a_k[:, None])
        tl.store(gx_ptr + t * s_gx0 + h * s_gx1 + d, f32_to_bf16_bits(gx), mask=dmask)
        tl.store(gk_ptr + t * s_gk0 + h * s_gk1 + d, f32_to_bf16_bits(gk), mask=dmask)
        acc += delta[:, None] * (x * k)
        # grad_v columns of this program: all heads' G (L2 hits), summed over the heads
        gates = tl.load(gate_ptr + t * hc + hh, mask=hh < hc, other=0.0)
        gs = bf16_bits_to_f32(tl.load(gsp + t * s_g0, mask=s2, other=0))
        gv = tl.sum(gates[:, None] * gs, axis=0)
        tl.store(gv_ptr + t * s_gv0 + e, f32_to_bf16_bits(gv), mask=smask)
        t += 1
    tl.store(gw_ptr + p * s_gw0 + h * s_gw1 + d, acc, mask=dmask)


@triton.jit
def _sum_heads(p, TB: tl.constexpr, HC_P2: tl.constexpr, BLOCK_D: tl.constexpr, PAIRS: tl.constexpr):
    """``sum_h p[:, h, :]`` of a ``[TB, HC_P2, BLOCK_D]`` tile -> ``[TB, BLOCK_D]``.

    PAIRS: by halving, head h with head h + HC_P2 / 2 first: (p0 + p2) + (p1 + p3) at hc = 4.  Each step adds two
    values (commutative, so one rounding whatever the layout): the order the pass-1 kernel's [1, 4, 1024] x 8
    warps layout gives on sm_90 (warpsPerCTA [1, 2, 4]: heads h and h + 2 in one thread's registers, the two
    halves in two warps), on any tile shape and warp count.  Else tl.sum, whose order follows the layout (the
    same as pass 1's for the same tile and warps, and numpy's sequential order under the interpreter)."""
    if not PAIRS:
        return tl.sum(p, axis=1)
    s = p
    if HC_P2 >= 2:
        s = tl.sum(tl.reshape(s, (TB, 2, HC_P2 // 2, BLOCK_D)), axis=1)
    if HC_P2 >= 4:
        s = tl.sum(tl.reshape(s, (TB, 2, HC_P2 // 4, BLOCK_D)), axis=1)
    if HC_P2 >= 8:
        s = tl.sum(tl.reshape(s, (TB, 2, HC_P2 // 8, BLOCK_D)), axis=1)
    if HC_P2 >= 16:  # hc > 8 (TileKernels takes hc = 4 only): the rest in tl.sum's order
        s = tl.sum(s, axis=1, keep_dims=True)
    return tl.reshape(s, (TB, BLOCK_D))


@triton.jit
def _onepass_load_a(go_ptr, v_ptr, tok, hh, hmask, t_end, j, H, s_g0, s_g1, s_v0,
                    BLOCK_D: tl.constexpr, EV_KEEP: tl.constexpr, EV_STREAM: tl.constexpr):
    """Phase A's tile j of tokens ``tok`` [TB]: G and v [TB, HC_P2, BLOCK_D] (bf16 bits; v broadcast over the
    heads through a zero head stride, so that it comes in G's layout: no shared-memory layout conversion)."""
    d = j * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < H
    tm = tok < t_end
    m3 = (tm[:, None] & hmask[None, :])[:, :, None] & dm[None, None, :]
    # G is read again by phase B a few microseconds later: keep it in L2
    go = tl.load(go_ptr + tok[:, None, None] * s_g0 + hh[None, :, None] * s_g1 + d[None, None, :], mask=m3,
                 other=0, eviction_policy=EV_KEEP)
    v = tl.load(v_ptr + tok[:, None, None] * s_v0 + hh[None, :, None] * 0 + d[None, None, :], mask=m3, other=0,
                eviction_policy=EV_STREAM)
    return go, v


@triton.jit
def _onepass_load_b(go_ptr, x_ptr, k_ptr, w_ptr, gw_ptr, tok, hh, hmask, t_end, first, j, H,
                    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gw1,
                    BLOCK_D: tl.constexpr, EV_KEEP: tl.constexpr, EV_STREAM: tl.constexpr):
    """Phase B's tile j: G (an L2 hit), x, k [TB, HC_P2, BLOCK_D] (bf16 bits), w[:, tile] and the grad_w_partial
    row's running sum [1, HC_P2, BLOCK_D] (fp32; 0 for the chunk's first token block, which stores instead of
    adds).  All 3D, so that they share the tiles' layout (2D [HC_P2, BLOCK_D] loads were given another one and
    converted through shared memory)."""
    d = j * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < H
    tm = tok < t_end
    m3 = (tm[:, None] & hmask[None, :])[:, :, None] & dm[None, None, :]
    m2 = (hmask[:, None] & dm[None, :])[None, :, :]
    go = tl.load(go_ptr + tok[:, None, None] * s_g0 + hh[None, :, None] * s_g1 + d[None, None, :], mask=m3,
                 other=0, eviction_policy=EV_STREAM)
    x = tl.load(x_ptr + tok[:, None, None] * s_x0 + hh[None, :, None] * s_x1 + d[None, None, :], mask=m3,
                other=0, eviction_policy=EV_STREAM)
    k = tl.load(k_ptr + tok[:, None, None] * s_k0 + hh[None, :, None] * s_k1 + d[None, None, :], mask=m3,
                other=0, eviction_policy=EV_STREAM)
    w = tl.load(w_ptr + (hh[:, None] * s_w0 + d[None, :])[None, :, :], mask=m2, other=0.0, eviction_policy=EV_KEEP)
    gw = tl.load(gw_ptr + (hh[:, None] * s_gw1 + d[None, :])[None, :, :], mask=m2 & (first == 0), other=0.0,
                 eviction_policy=EV_KEEP)
    return go, x, k, w, gw


@triton.jit(do_not_specialize=["T", "tokens_per_chunk"])
def _engram_gate_bwd_onepass_kernel(
    go_ptr, x_ptr, k_ptr, v_ptr, w_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr,
    gx_ptr, gk_ptr, gv_ptr, gw_ptr,
    T, hc, H, hidden_f, tokens_per_chunk, clamp_value, scale,
    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_v0, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gv0, s_gw0, s_gw1,
    HC_P2: tl.constexpr, TB: tl.constexpr, BLOCK_D: tl.constexpr, N_TILES: tl.constexpr,
    PF_A: tl.constexpr, PF_B: tl.constexpr, STAGES: tl.constexpr, EV_KEEP: tl.constexpr, EV_STREAM: tl.constexpr,
    HEAD_PAIRS: tl.constexpr,
):
    # One pass, persistent: program p owns token chunk p and grad_w_partial row p, and walks its tokens in
    # blocks of TB.  Phase A sweeps H in BLOCK_D tiles over all heads: gamma = G . v (dL/dg) and grad_v; then
    # delta, a_x, a_k of the block; phase B sweeps H again: G (read again, from L2: the block's TB x hc x H x 2
    # bytes were loaded moments ago), x, k -> grad_x, grad_k, and grad_w_partial[p] += sum over the block of
    # delta * x * k (a read-modify-write of an L2-resident row).  G, x, k, v come from DRAM once.
    # PF_A / PF_B: the tile after the current one is in flight while the current one is computed (phase A's
    # last tile prefetches the next block's first; phase B's first tile is issued before the gamma reduction).
    p = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HC_P2)
    hmask = hh < hc
    tt = tl.arange(0, TB)
    dd = tl.arange(0, BLOCK_D)
    t_begin = p * tokens_per_chunk
    t_end = tl.minimum(t_begin + tokens_per_chunk, T)
    gw_row = gw_ptr + p * s_gw0
    if t_begin >= t_end:  # a chunk without tokens: its row is zero
        for j in tl.range(0, N_TILES):
            d = j * BLOCK_D + dd
            tl.store(gw_row + hh[:, None] * s_gw1 + d[None, :], tl.zeros((HC_P2, BLOCK_D), tl.float32),
                     mask=hmask[:, None] & (d < H)[None, :])
    hf = hidden_f
    t = t_begin
    if PF_A:
        n_go, n_v = _onepass_load_a(go_ptr, v_ptr, t + tt, hh, hmask, t_end, 0, H, s_g0, s_g1, s_v0,
                                    BLOCK_D, EV_KEEP, EV_STREAM)
    while t < t_end:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        tok = t + tt
        tmask = tok < t_end
        th_mask = tmask[:, None] & hmask[None, :]
        sc = tok[:, None] * hc + hh[None, :]
        gate = tl.load(gate_ptr + sc, mask=th_mask, other=0.0)
        # phase A: gamma and grad_v (the same [TB, HC_P2, BLOCK_D] accumulation as the pass-1 kernel)
        acc = tl.zeros((TB, HC_P2, BLOCK_D), tl.float32)
        for j in tl.range(0, N_TILES, num_stages=STAGES):
            if PF_A:
                c_go = n_go
                c_v = n_v
                jn = j + 1  # the next tile: tile j + 1, or after the last one the next block's tile 0
                wrap = jn // N_TILES
                n_go, n_v = _onepass_load_a(go_ptr, v_ptr, tok + wrap * TB, hh, hmask, t_end, jn - wrap * N_TILES,
                                            H, s_g0, s_g1, s_v0, BLOCK_D, EV_KEEP, EV_STREAM)
            else:
                c_go, c_v = _onepass_load_a(go_ptr, v_ptr, tok, hh, hmask, t_end, j, H, s_g0, s_g1, s_v0,
                                            BLOCK_D, EV_KEEP, EV_STREAM)
            go = bf16_bits_to_f32(c_go)
            acc += go * bf16_bits_to_f32(c_v)
            gv = _sum_heads(gate[:, :, None] * go, TB, HC_P2, BLOCK_D, HEAD_PAIRS)
            d = j * BLOCK_D + dd
            tl.store(gv_ptr + tok[:, None] * s_gv0 + d[None, :], f32_to_bf16_bits(gv),
                     mask=tmask[:, None] & (d < H)[None, :], eviction_policy=EV_STREAM)
        first = (t == t_begin).to(tl.int32)
        # grad_w_partial[p] was last written by the previous block's phase B, possibly by other threads
        tl.debug_barrier()
        if PF_B:
            b_go, b_x, b_k, b_w, b_gw = _onepass_load_b(
                go_ptr, x_ptr, k_ptr, w_ptr, gw_row, tok, hh, hmask, t_end, first, 0, H,
                s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gw1, BLOCK_D, EV_KEEP, EV_STREAM)
        gamma = tl.sum(acc, axis=2)
        dot = tl.load(dot_ptr + sc, mask=th_mask, other=1.0)  # padded lanes: no 0/0
        rx = tl.load(rstd_x_ptr + sc, mask=th_mask, other=0.0)
        rk = tl.load(rstd_k_ptr + sc, mask=th_mask, other=0.0)
        # delta = dL/dD with r held fixed: gamma * g(1-g) * du/ds * ds/dD, zero where |s| < clamp_value
        s = dot * rx * rk * scale
        dsqrt = tl.sqrt_rn(tl.math.div_rn(scale * rx * rk, tl.abs(dot)))
        delta = gamma * (gate * (1.0 - gate)) * 0.5 * dsqrt
        delta = tl.where(tl.abs(s) < clamp_value, 0.0, delta)
        a_x = tl.math.div_rn(dot * rx * rx, hf)
        a_k = tl.math.div_rn(dot * rk * rk, hf)
        # phase B: grad_x, grad_k and the grad_w_partial row
        gx_rows = tok[:, None, None] * s_gx0 + hh[None, :, None] * s_gx1
        gk_rows = tok[:, None, None] * s_gk0 + hh[None, :, None] * s_gk1
        for j in tl.range(0, N_TILES, num_stages=STAGES):
            if PF_B:
                c_go = b_go
                c_x = b_x
                c_k = b_k
                c_w = b_w
                c_gw = b_gw
                # tile j + 1 (past the row after the last tile: all masked, no traffic)
                b_go, b_x, b_k, b_w, b_gw = _onepass_load_b(
                    go_ptr, x_ptr, k_ptr, w_ptr, gw_row, tok, hh, hmask, t_end, first, j + 1, H,
                    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gw1, BLOCK_D, EV_KEEP, EV_STREAM)
            else:
                c_go, c_x, c_k, c_w, c_gw = _onepass_load_b(
                    go_ptr, x_ptr, k_ptr, w_ptr, gw_row, tok, hh, hmask, t_end, first, j, H,
                    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gw1, BLOCK_D, EV_KEEP, EV_STREAM)
            go = bf16_bits_to_f32(c_go)
            x = bf16_bits_to_f32(c_x)
            k = bf16_bits_to_f32(c_k)
            w = c_w
            # the pass-2 kernel's per-element formulas (_bwd_tile_math), on [TB, HC_P2, BLOCK_D]
            gx = go + delta[:, :, None] * (w * k - x * a_x[:, :, None])
            gk = delta[:, :, None] * (w * x - k * a_k[:, :, None])
            d = j * BLOCK_D + dd
            m3 = th_mask[:, :, None] & (d < H)[None, None, :]
            tl.store(gx_ptr + gx_rows + d[None, None, :], f32_to_bf16_bits(gx), mask=m3, eviction_policy=EV_STREAM)
            tl.store(gk_ptr + gk_rows + d[None, None, :], f32_to_bf16_bits(gk), mask=m3, eviction_policy=EV_STREAM)
            gw = c_gw + tl.sum(delta[:, :, None] * (x * k), axis=0, keep_dims=True)
            tl.store(gw_row + (hh[:, None] * s_gw1 + d[None, :])[None, :, :], gw,
                     mask=(hmask[:, None] & (d < H)[None, :])[None, :, :], eviction_policy=EV_KEEP)
        t += TB


@triton.jit(do_not_specialize=["T", "tokens_per_chunk"])
def _engram_gate_bwd_il_kernel(
    go_ptr, x_ptr, k_ptr, v_ptr, w_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr,
    gx_ptr, gk_ptr, gv_ptr, gw_ptr,
    T, hc, H, hidden_f, tokens_per_chunk, clamp_value, scale,
    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_v0, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gv0, s_gw0, s_gw1,
    HC_P2: tl.constexpr, TB: tl.constexpr, BLOCK_D: tl.constexpr, N_TILES: tl.constexpr,
    STAGES: tl.constexpr, EV_KEEP: tl.constexpr, EV_STREAM: tl.constexpr, HEAD_PAIRS: tl.constexpr,
):
    # One pass, persistent, the two phases of _engram_gate_bwd_onepass_kernel software-pipelined across token
    # blocks: program p owns token chunk p and grad_w_partial row p.  Sweep i over the H tiles does, per tile j,
    # phase A of block i + 1 (G, v -> the gamma accumulator and grad_v) and phase B of block i (G again, an L2
    # hit since sweep i - 1 read it with evict_last, x, k -> grad_x, grad_k and the grad_w_partial row's tile j,
    # read-modify-written in L2), with delta, a_x, a_k of block i computed at the end of sweep i - 1.  No phase
    # boundary inside a sweep: each tile step has both blocks' loads (five tiles) independent and in flight.
    # The first sweep (block i = -1) only does A (B masked off: no traffic), the last only B (A masked off).
    p = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HC_P2)
    hmask = hh < hc
    tt = tl.arange(0, TB)
    dd = tl.arange(0, BLOCK_D)
    t_begin = p * tokens_per_chunk
    t_end = tl.minimum(t_begin + tokens_per_chunk, T)
    gw_row = gw_ptr + p * s_gw0
    if t_begin >= t_end:  # a chunk without tokens: its row is zero
        for j in tl.range(0, N_TILES):
            d = j * BLOCK_D + dd
            tl.store(gw_row + hh[:, None] * s_gw1 + d[None, :], tl.zeros((HC_P2, BLOCK_D), tl.float32),
                     mask=hmask[:, None] & (d < H)[None, :])
    hf = hidden_f
    # block B's coefficients, carried from the sweep that reduced its gamma (zero for the A-only first sweep)
    delta = tl.zeros((TB, HC_P2), tl.float32)
    a_x = tl.zeros((TB, HC_P2), tl.float32)
    a_k = tl.zeros((TB, HC_P2), tl.float32)
    t = t_begin - TB  # block B's first token
    while t < t_end:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        tok_b = t + tt
        tok_a = tok_b + TB
        ma = tok_a < t_end
        mb = (tok_b >= t_begin) & (tok_b < t_end)
        tok_b = tl.maximum(tok_b, 0)  # the first sweep's block B lies before the chunk: masked, kept in bounds
        tha = ma[:, None] & hmask[None, :]
        thb = mb[:, None] & hmask[None, :]
        sca = tok_a[:, None] * hc + hh[None, :]
        gate = tl.load(gate_ptr + sca, mask=tha, other=0.0)
        b_on = t >= t_begin  # block B exists (not the first sweep)
        gw_in = (t > t_begin).to(tl.int32)  # the row already holds earlier blocks' sums (else: store, not add)
        ga_rows = tok_a[:, None, None] * s_g0 + hh[None, :, None] * s_g1
        va_rows = tok_a[:, None, None] * s_v0 + hh[None, :, None] * 0  # v in G's layout (zero head stride)
        gb_rows = tok_b[:, None, None] * s_g0 + hh[None, :, None] * s_g1
        xb_rows = tok_b[:, None, None] * s_x0 + hh[None, :, None] * s_x1
        kb_rows = tok_b[:, None, None] * s_k0 + hh[None, :, None] * s_k1
        gx_rows = tok_b[:, None, None] * s_gx0 + hh[None, :, None] * s_gx1
        gk_rows = tok_b[:, None, None] * s_gk0 + hh[None, :, None] * s_gk1
        acc = tl.zeros((TB, HC_P2, BLOCK_D), tl.float32)
        for j in tl.range(0, N_TILES, num_stages=STAGES):
            d = j * BLOCK_D + dd
            dm = d < H
            m3a = tha[:, :, None] & dm[None, None, :]
            m3b = thb[:, :, None] & dm[None, None, :]
            m2 = (hmask[:, None] & dm[None, :])[None, :, :]
            d3 = d[None, None, :]
            w_offs = (hh[:, None] * s_w0 + d[None, :])[None, :, :]
            gw_offs = (hh[:, None] * s_gw1 + d[None, :])[None, :, :]
            # every load of the step first: A's G (read again by the next sweep's B: keep it in L2) and v,
            # B's G (its last use), x, k, w and the row tile (L2-resident, 3D: in the tiles' layout)
            c_ga = tl.load(go_ptr + ga_rows + d3, mask=m3a, other=0, eviction_policy=EV_KEEP)
            c_va = tl.load(v_ptr + va_rows + d3, mask=m3a, other=0, eviction_policy=EV_STREAM)
            c_gb = tl.load(go_ptr + gb_rows + d3, mask=m3b, other=0, eviction_policy=EV_STREAM)
            c_x = tl.load(x_ptr + xb_rows + d3, mask=m3b, other=0, eviction_policy=EV_STREAM)
            c_k = tl.load(k_ptr + kb_rows + d3, mask=m3b, other=0, eviction_policy=EV_STREAM)
            w = tl.load(w_ptr + w_offs, mask=m2 & b_on, other=0.0, eviction_policy=EV_KEEP)
            c_gw = tl.load(gw_row + gw_offs, mask=m2 & (gw_in != 0), other=0.0, eviction_policy=EV_KEEP)
            # phase A of the next block: the pass-1 kernel's accumulation and grad_v
            ga = bf16_bits_to_f32(c_ga)
            acc += ga * bf16_bits_to_f32(c_va)
            gv = _sum_heads(gate[:, :, None] * ga, TB, HC_P2, BLOCK_D, HEAD_PAIRS)
            tl.store(gv_ptr + tok_a[:, None] * s_gv0 + d[None, :], f32_to_bf16_bits(gv),
                     mask=ma[:, None] & dm[None, :], eviction_policy=EV_STREAM)
            # phase B of this block: the pass-2 kernel's per-element formulas (_bwd_tile_math)
            go = bf16_bits_to_f32(c_gb)
            x = bf16_bits_to_f32(c_x)
            k = bf16_bits_to_f32(c_k)
            gx = go + delta[:, :, None] * (w * k - x * a_x[:, :, None])
            gk = delta[:, :, None] * (w * x - k * a_k[:, :, None])
            tl.store(gx_ptr + gx_rows + d3, f32_to_bf16_bits(gx), mask=m3b, eviction_policy=EV_STREAM)
            tl.store(gk_ptr + gk_rows + d3, f32_to_bf16_bits(gk), mask=m3b, eviction_policy=EV_STREAM)
            gw = c_gw + tl.sum(delta[:, :, None] * (x * k), axis=0, keep_dims=True)
            tl.store(gw_row + gw_offs, gw, mask=m2 & b_on, eviction_policy=EV_KEEP)
        # the next block's coefficients, exactly as the coef kernel computes them
        gamma = tl.sum(acc, axis=2)
        dot = tl.load(dot_ptr + sca, mask=tha, other=1.0)  # padded lanes: no 0/0
        rx = tl.load(rstd_x_ptr + sca, mask=tha, other=0.0)
        rk = tl.load(rstd_k_ptr + sca, mask=tha, other=0.0)
        # delta = dL/dD with r held fixed: gamma * g(1-g) * du/ds * ds/dD, zero where |s| < clamp_value
        s = dot * rx * rk * scale
        dsqrt = tl.sqrt_rn(tl.math.div_rn(scale * rx * rk, tl.abs(dot)))
        delta = gamma * (gate * (1.0 - gate)) * 0.5 * dsqrt
        delta = tl.where(tl.abs(s) < clamp_value, 0.0, delta)
        a_x = tl.math.div_rn(dot * rx * rx, hf)
        a_k = tl.math.div_rn(dot * rk * rk, hf)
        # the row tiles written in this sweep are read back next sweep, maybe by other threads of the program
        tl.debug_barrier()
        t += TB


def _bwd_config(H: int, hc: int):
    """(HC_P2, TOK, BLOCK_D1, BLOCK_D2, num_warps): the shape rule of the two passes.

    Pass 1 (gamma or delta, grad_v): TOK tokens per program, H in BLOCK_D1 steps.  Pass 2: [HC_P2, BLOCK_D2]
    tiles of one token chunk (the grad_w_partial row) per program."""
    hc_p2 = next_power_of_two(max(hc, 1))
    if interp():
        block_d = min(next_power_of_two(H), 8192)
        return hc_p2, 8, block_d, block_d, 4
    block_d1 = min(next_power_of_two(H), max(256, 4096 // hc_p2))
    block_d2 = min(next_power_of_two(H), max(128, 2048 // hc_p2))
    # pass 1 with 4 warps: H200 sweep (session 4, T=8001, hc=4, H=7168, CUDA graph) 767.8 us for the whole
    # backward against 1169.6 us with 8 warps on the same [1, 4, 1024] tile (the default before), 785.8 us with
    # TOK=2 at 8 warps; gamma's summation order follows the layout, so grad_x / grad_k may change in the last
    # bit (within the tests' calc_diff bounds; grad_v does not change)
    return hc_p2, 1, block_d1, block_d2, 4


def _bwd_launch_config(H: int, hc: int) -> dict:
    """The bwd launch config, through ``tuned("engram_gate_bwd", ...)``.

    TOK, BLOCK_D1, WARPS1: pass 1.  BLOCK_D2, WARPS2: pass 2's [HC_P2, BLOCK_D2] tile.  COEF: pass 1 also
    computes delta, a_x and a_k (pass 2 reads 3 scalars per (token, head) instead of 5 and does no sqrt or
    division; False: the first version).  SPLIT: pass 2's grid is (num_sms, SPLIT) and program (p, r) takes
    the H tiles r, r + SPLIT, ... of token chunk p (SPLIT >= the number of tiles: one tile per program).
    PREFETCH: pass 2 loads token t + 1's tiles while token t is computed.
    FUSED: one pass instead (``_engram_gate_bwd_fused_kernel``, program = one head of a token chunk, the
    other knobs unused); FWARPS: its warps; FPREFETCH: 0, 1 (token t + 1's G and v in flight while token t is
    computed), 2 (also its x and k); W_RESIDENT: w[h] held in registers (else re-read from L1 every token)."""
    hc_p2, tok, bd1, bd2, nw = _bwd_config(H, hc)
    n_tiles = ceil_div(H, bd2)
    if interp():
        split, nw2 = max(1, n_tiles // 2), nw
    else:
        # 2 programs per SM (about 110 registers at [4, 512] x 8 warps), each streaming half of the H tiles of
        # its token chunk: one wave, no tail (one tile per program gave 3.5 waves of long programs)
        split = min(2, n_tiles)
        nw2 = 8 if hc_p2 * bd2 >= 2048 else 4
    # FUSED: the one-pass kernel (G, x, k, v read once from DRAM: 2.52 GB at T=8001, hc=4, H=7168, against 2.98 GB
    # for the two passes, which took 1165 us on the H200, 2026-11-30).  SASS (sm_90, BLOCK_H = 8192, 16 warps,
    # FPREFETCH=1, W_RESIDENT): 128 registers, 4 scalar spills (16 bytes) per token, 16-byte loads and stores of
    # every row; FPREFETCH=2 spills 104 bytes, 32 warps cap at 64 registers and spill in the loop.
    # H200 sweep (2026-11-30, T=8001, hc=4, H=7168, CUDA-graph us): the one-pass kernel took 1211 us, the two
    # passes 1167 us (both far from TileKernels' 644 us): FUSED stays a candidate, off by default.
    fwarps = min(16, max(4, next_power_of_two(H) // 512)) if not interp() else 4
    # ONEPASS: the persistent one-pass kernel (``_engram_gate_bwd_onepass_kernel``, OWAVES * num_sms programs,
    # program p = token chunk p and grad_w_partial row p; the FUSED and two-pass knobs unused).  DRAM traffic
    # ~2.52 GB + 15 MB at T=8001, hc=4, H=7168 (floor 598 us at 4.22 TB/s); G's second read, w and the
    # grad_w_partial row's read-modify-write are L2 traffic.  TB: tokens per block (1, 2, 4); OBLOCK_D, OWARPS:
    # the [TB, HC_P2, OBLOCK_D] tile and its warps (OBLOCK_D = BLOCK_D1 = 1024 with >= 4 warps lays the H axis
    # out as pass 1 does: gamma, hence every output, bitwise the default's; another OBLOCK_D sums gamma in
    # another order).  OPF_A / OPF_B: prefetch the next tile in phase A / B.  OHINTS: evict_last on G's first
    # read, w and the grad_w_partial row, evict_first on the streamed tensors.  OSTAGES: num_stages of the
    # H loops (Triton's pipeliner).  OWAVES: programs per SM (P = OWAVES * num_sms rows of grad_w_partial).
    # OPAIRS: grad_v's head sum in the pass-1 kernel's sm_90 order, (g0 G0 + g2 G2) + (g1 G1 + g3 G3), whatever
    # the tile (for TB > 1 or another OWARPS, whose layouts would put the heads elsewhere); False: tl.sum (the
    # same order as pass 1 with pass 1's tile and warps; numpy's under the interpreter).
    # IL: the persistent one-pass kernel with its phases interleaved across token blocks
    # (``_engram_gate_bwd_il_kernel``: one H sweep does phase A of block b + 1 and phase B of block b, so no
    # gamma reduction stalls a sweep); it reads TB, OBLOCK_D, OWARPS, OHINTS, OSTAGES, OWAVES, OPAIRS as ONEPASS
    # does (no manual prefetch: the two blocks' five tile loads of a step are already independent), and takes
    # precedence over ONEPASS.  Same traffic and floor as ONEPASS; G's second read is one sweep later (L2:
    # OWAVES * num_sms * TB * hc * H * 2 bytes of G plus the grad_w_partial rows, 22.6 MB at TB=1, OWAVES=1).
    return tuned("engram_gate_bwd", dict(TOK=tok, BLOCK_D1=bd1, WARPS1=nw, BLOCK_D2=bd2, WARPS2=nw2,
                                         COEF=True, SPLIT=split, PREFETCH=True,
                                         FUSED=False, FWARPS=fwarps, FPREFETCH=1, W_RESIDENT=True,
                                         ONEPASS=False, TB=1, OBLOCK_D=bd1, OWARPS=nw, OPF_A=True, OPF_B=True,
                                         OHINTS=True, OSTAGES=1, OWAVES=1, OPAIRS=False, IL=False))


def _bwd_num_parts(H: int, hc: int) -> int:
    """P, the number of grad_w_partial rows: num_sms, or OWAVES * num_sms for the persistent one-pass kernels."""
    cfg = _bwd_launch_config(H, hc)
    return get_num_sms() * (max(1, int(cfg["OWAVES"])) if (cfg["ONEPASS"] or cfg["IL"]) and cfg["COEF"] else 1)


def engram_gate_bwd(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Engram gate backward (deterministic, no atomics).

    Args:
        grad_out: G, shape (num_tokens, hc_mult, hidden_size), bfloat16; any token/head strides, unit
            stride along hidden_size.
        hidden_states, k, v, weight_fused: the forward's inputs (same shapes, dtypes and layout rules as in
            ``engram_gate_fwd``).
        dot, gate_score, rstd_x, rstd_k: the forward's saved tensors, shape (num_tokens, hc_mult), float32,
            contiguous (``dot`` is the raw, unscaled dot product).
        clamp_value: the forward's clamp value (eps only enters through rstd_x / rstd_k).

    Returns:
        ``(grad_hidden_states, grad_k, grad_v, grad_w_partial)``:
        grad_hidden_states: like ``hidden_states`` (``empty_like``), bfloat16;
        grad_k: like ``k`` (``empty_like``: k's strides when k is dense, else contiguous), bfloat16;
        grad_v: like ``v`` (``empty_like``), bfloat16;
        grad_w_partial: shape (num_sms, hc_mult, hidden_size), float32, with ``num_sms = get_num_sms()``:
        row p holds the gradient of ``weight_fused`` summed over the p-th contiguous chunk of
        ``ceil(num_tokens / num_sms)`` tokens (rows without tokens are zero); ``grad_w_partial.sum(0)`` is
        dL/d(weight_fused).  Any hc_mult and hidden_size work (TileKernels needs hc_mult == 4 and
        hidden_size a multiple of 512).
    """
    T, hc, H = _check_gate_inputs(hidden_states, k, v, weight_fused)
    check_rows("grad_out", grad_out, torch.bfloat16, (T, hc, H))
    for name, t in (("dot", dot), ("gate_score", gate_score), ("rstd_x", rstd_x), ("rstd_k", rstd_k)):
        check_rows(name, t, torch.float32, (T, hc))
        check_contiguous(name, t)
    clamp_value = check_float("clamp_value", clamp_value)
    check_same_device(grad_out=grad_out, hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused,
                      dot=dot, gate_score=gate_score, rstd_x=rstd_x, rstd_k=rstd_k)
    if H == 0:
        raise ValueError("hidden_states must have a positive hidden size, got 0")
    args = (grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value)
    if torch.compiler.is_compiling():  # traced as the opaque custom op ``torch.ops.tritile.engram_gate_bwd``
        return tuple(_engram_gate_bwd_op(*args))
    return _engram_gate_bwd(*args)


def _engram_gate_bwd(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value):
    T, hc, H = hidden_states.shape
    dev = hidden_states.device
    num_parts = _bwd_num_parts(H, hc)
    grad_x = empty_like(hidden_states)
    grad_k = empty_like(k)
    grad_v = empty_like(v)
    if T == 0 or hc == 0:
        grad_w_partial = torch.zeros((num_parts, hc, H), dtype=torch.float32, device=dev)
        if T and hc == 0:
            grad_v.zero_()
        return grad_x, grad_k, grad_v, grad_w_partial
    grad_w_partial = empty((num_parts, hc, H), torch.float32, dev)
    cfg = _bwd_launch_config(H, hc)
    hc_p2 = next_power_of_two(hc)
    chunk = ceil_div(T, num_parts)
    if not cfg["COEF"]:  # the first version: pass 2 recomputes delta from gamma and the saved tensors
        gamma = empty((T, hc), torch.float32, dev)
        _engram_gate_bwd_gamma_kernel[(ceil_div(T, cfg["TOK"]),)](
            bits16(grad_out), bits16(v), gate_score, gamma, bits16(grad_v),
            T, hc, H, grad_out.stride(0), grad_out.stride(1), v.stride(0), grad_v.stride(0),
            HC_P2=hc_p2, TOK=cfg["TOK"], BLOCK_D=cfg["BLOCK_D1"], num_warps=cfg["WARPS1"],
        )
        _engram_gate_bwd_kernel[(num_parts, ceil_div(H, cfg["BLOCK_D2"]))](
            bits16(grad_out), bits16(hidden_states), bits16(k), weight_fused, dot, gate_score, rstd_x, rstd_k,
            gamma, bits16(grad_x), bits16(grad_k), grad_w_partial,
            T, hc, H, float(H), chunk, clamp_value, _scale(H),
            grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
            k.stride(0), k.stride(1), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
            grad_k.stride(0), grad_k.stride(1), grad_w_partial.stride(0), grad_w_partial.stride(1),
            HC_P2=hc_p2, BLOCK_D=cfg["BLOCK_D2"], num_warps=cfg["WARPS2"],
        )
        return grad_x, grad_k, grad_v, grad_w_partial
    if cfg["IL"]:
        block_d = min(next_power_of_two(int(cfg["OBLOCK_D"])), next_power_of_two(H))
        ev_keep, ev_stream = ("evict_last", "evict_first") if cfg["OHINTS"] else ("", "")
        _engram_gate_bwd_il_kernel[(num_parts,)](
            bits16(grad_out), bits16(hidden_states), bits16(k), bits16(v), weight_fused, dot, gate_score, rstd_x,
            rstd_k, bits16(grad_x), bits16(grad_k), bits16(grad_v), grad_w_partial,
            T, hc, H, float(H), chunk, clamp_value, _scale(H),
            grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
            k.stride(0), k.stride(1), v.stride(0), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
            grad_k.stride(0), grad_k.stride(1), grad_v.stride(0), grad_w_partial.stride(0), grad_w_partial.stride(1),
            HC_P2=hc_p2, TB=int(cfg["TB"]), BLOCK_D=block_d, N_TILES=ceil_div(H, block_d),
            STAGES=int(cfg["OSTAGES"]), EV_KEEP=ev_keep, EV_STREAM=ev_stream, HEAD_PAIRS=bool(cfg["OPAIRS"]),
            num_warps=int(cfg["OWARPS"]),
        )
        return grad_x, grad_k, grad_v, grad_w_partial
    if cfg["ONEPASS"]:
        block_d = min(next_power_of_two(int(cfg["OBLOCK_D"])), next_power_of_two(H))
        ev_keep, ev_stream = ("evict_last", "evict_first") if cfg["OHINTS"] else ("", "")
        _engram_gate_bwd_onepass_kernel[(num_parts,)](
            bits16(grad_out), bits16(hidden_states), bits16(k), bits16(v), weight_fused, dot, gate_score, rstd_x,
            rstd_k, bits16(grad_x), bits16(grad_k), bits16(grad_v), grad_w_partial,
            T, hc, H, float(H), chunk, clamp_value, _scale(H),
            grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
            k.stride(0), k.stride(1), v.stride(0), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
            grad_k.stride(0), grad_k.stride(1), grad_v.stride(0), grad_w_partial.stride(0), grad_w_partial.stride(1),
            HC_P2=hc_p2, TB=int(cfg["TB"]), BLOCK_D=block_d,
            N_TILES=ceil_div(H, block_d), PF_A=bool(cfg["OPF_A"]), PF_B=bool(cfg["OPF_B"]),
            STAGES=int(cfg["OSTAGES"]), EV_KEEP=ev_keep, EV_STREAM=ev_stream, HEAD_PAIRS=bool(cfg["OPAIRS"]),
            num_warps=int(cfg["OWARPS"]),
        )
        return grad_x, grad_k, grad_v, grad_w_partial
    if cfg["FUSED"]:
        sw = ceil_div(ceil_div(H, hc), 16) * 16  # grad_v columns per program: a multiple of 16 (vector access)
        _engram_gate_bwd_fused_kernel[(num_parts * hc,)](
            bits16(grad_out), bits16(hidden_states), bits16(k), bits16(v), weight_fused, dot, gate_score, rstd_x,
            rstd_k, bits16(grad_x), bits16(grad_k), bits16(grad_v), grad_w_partial,
            T, hc, H, sw, float(H), chunk, clamp_value, _scale(H),
            grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
            k.stride(0), k.stride(1), v.stride(0), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
            grad_k.stride(0), grad_k.stride(1), grad_v.stride(0), grad_w_partial.stride(0), grad_w_partial.stride(1),
            HC_P2=hc_p2, BLOCK_H=next_power_of_two(H), BLOCK_S=next_power_of_two(sw),
            PREFETCH=int(cfg["FPREFETCH"]), W_RESIDENT=bool(cfg["W_RESIDENT"]), num_warps=cfg["FWARPS"],
        )
        return grad_x, grad_k, grad_v, grad_w_partial
    coef = empty((3, T, hc), torch.float32, dev)  # delta, a_x, a_k
    _engram_gate_bwd_coef_kernel[(ceil_div(T, cfg["TOK"]),)](
        bits16(grad_out), bits16(v), dot, gate_score, rstd_x, rstd_k, coef[0], coef[1], coef[2], bits16(grad_v),
        T, hc, H, float(H), clamp_value, _scale(H),
        grad_out.stride(0), grad_out.stride(1), v.stride(0), grad_v.stride(0),
        HC_P2=hc_p2, TOK=cfg["TOK"], BLOCK_D=cfg["BLOCK_D1"], num_warps=cfg["WARPS1"],
    )
    split = max(1, min(int(cfg["SPLIT"]), ceil_div(H, cfg["BLOCK_D2"])))
    _engram_gate_bwd_split_kernel[(num_parts, split)](
        bits16(grad_out), bits16(hidden_states), bits16(k), weight_fused, coef[0], coef[1], coef[2],
        bits16(grad_x), bits16(grad_k), grad_w_partial,
        T, hc, H, chunk,
        grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
        k.stride(0), k.stride(1), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
        grad_k.stride(0), grad_k.stride(1), grad_w_partial.stride(0), grad_w_partial.stride(1),
        HC_P2=hc_p2, BLOCK_D=cfg["BLOCK_D2"], SPLIT=split, PREFETCH=bool(cfg["PREFETCH"]),
        num_warps=cfg["WARPS2"],
    )
    return grad_x, grad_k, grad_v, grad_w_partial


def _bwd_fake(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value):
    _, hc, H = hidden_states.shape
    return [torch.empty_like(hidden_states), torch.empty_like(k), torch.empty_like(v),
            hidden_states.new_empty((_bwd_num_parts(H, hc), hc, H), dtype=torch.float32)]


@custom_op("engram_gate_bwd", fake=_bwd_fake)
def _engram_gate_bwd_op(grad_out: torch.Tensor, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        weight_fused: torch.Tensor, dot: torch.Tensor, gate_score: torch.Tensor,
                        rstd_x: torch.Tensor, rstd_k: torch.Tensor, clamp_value: float) -> List[torch.Tensor]:
    return list(_engram_gate_bwd(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k,
                                 clamp_value))
