"""The two-pass ``engram_gate_bwd`` Triton kernels (every device but Hopper with Gluon, and the interpreter):
pass 1 (``_engram_gate_bwd_coef_kernel`` or ``_engram_gate_bwd_gamma_kernel``) per token, pass 2
(``_engram_gate_bwd_split_kernel`` or ``_engram_gate_bwd_kernel``) over token chunks and H tiles.  The launcher and
the design notes are in ``engram_gate_kernel``."""

from __future__ import annotations

import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, f32_to_bf16_bits
from ..language.cast import EMULATE
from ..language.pdl import pdl_enter


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
def _bwd_pass1(go_ptr, v_ptr, gate_ptr, gv_ptr, T, hc, H, s_g0, s_g1, s_v0, s_gv0,
               HC_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pass 1's program, TOK tokens ``t``, all heads: loads the gates, stores grad_v (:func:`_bwd_gamma_grad_v`).
    Returns the (token, head) offsets ``sc`` into the (T, hc) saved tensors, their mask, the gates and
    gamma = G . v, each ``[TOK, HC_P2]`` (0 outside)."""
    t = tl.program_id(0).to(tl.int64) * TOK + tl.arange(0, TOK)
    hh = tl.arange(0, HC_P2)
    tmask = t < T
    th_mask = tmask[:, None] & (hh < hc)[None, :]
    sc = t[:, None] * hc + hh[None, :]
    gate = tl.load(gate_ptr + sc, mask=th_mask, other=0.0)
    gamma = _bwd_gamma_grad_v(go_ptr, v_ptr, gv_ptr, gate, t, hh, tmask, th_mask, H, s_g0, s_g1, s_v0, s_gv0,
                              HC_P2, TOK, BLOCK_D)
    return sc, th_mask, gate, gamma


@triton.jit
def _engram_gate_bwd_gamma_kernel(
    go_ptr, v_ptr, gate_ptr, gamma_ptr, gv_ptr,
    T, hc, H,
    s_g0, s_g1, s_v0, s_gv0,
    HC_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
    # TOK tokens per program, all heads, H in BLOCK_D-wide steps: gamma = G . v, grad_v = sum_h g_h G_h.
    sc, th_mask, _, gamma = _bwd_pass1(go_ptr, v_ptr, gate_ptr, gv_ptr, T, hc, H, s_g0, s_g1, s_v0, s_gv0,
                                       HC_P2, TOK, BLOCK_D)
    tl.store(gamma_ptr + sc, gamma, mask=th_mask)


@triton.jit(do_not_specialize=["T", "tokens_per_chunk"])
def _engram_gate_bwd_kernel(
    go_ptr, x_ptr, k_ptr, w_ptr, dot_ptr, gate_ptr, rstd_x_ptr, rstd_k_ptr, gamma_ptr,
    gx_ptr, gk_ptr, gw_ptr,
    T, hc, H, hidden_f, tokens_per_chunk, clamp_value, scale,
    s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gw0, s_gw1,
    HC_P2: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
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
    HC_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
    # TOK tokens per program, all heads, H in BLOCK_D-wide steps: gamma = G . v (dL/dg), grad_v = sum_h g_h G_h;
    # then the per-(token, head) coefficients of pass 2: delta = dL/dD (r held fixed), a_x, a_k.
    sc, th_mask, gate, gamma = _bwd_pass1(go_ptr, v_ptr, gate_ptr, gv_ptr, T, hc, H, s_g0, s_g1, s_v0, s_gv0,
                                          HC_P2, TOK, BLOCK_D)
    dot = tl.load(dot_ptr + sc, mask=th_mask, other=1.0)  # padded lanes: no 0/0
    rx = tl.load(rstd_x_ptr + sc, mask=th_mask, other=0.0)
    rk = tl.load(rstd_k_ptr + sc, mask=th_mask, other=0.0)
    delta, a_x, a_k = _bwd_coefs(gamma, dot, gate, rx, rk, clamp_value, scale, hidden_f)
    tl.store(delta_ptr + sc, delta, mask=th_mask)
    tl.store(ax_ptr + sc, a_x, mask=th_mask)
    tl.store(ak_ptr + sc, a_k, mask=th_mask)


@triton.jit
def _bwd_coefs(gamma, dot, gate, rx, rk, clamp_value, scale, hidden_f):
    """(delta, a_x, a_k) per (token, head): delta = dL/dD with r held fixed, gamma * g(1-g) * du/ds * ds/dD, zero
    where |s| < clamp_value; a_x = D r_x^2 / H, a_k = D r_k^2 / H."""
    s = dot * rx * rk * scale
    dsqrt = tl.sqrt_rn(tl.math.div_rn(scale * rx * rk, tl.abs(dot)))
    delta = gamma * (gate * (1.0 - gate)) * 0.5 * dsqrt
    delta = tl.where(tl.abs(s) < clamp_value, 0.0, delta)
    return delta, tl.math.div_rn(dot * rx * rx, hidden_f), tl.math.div_rn(dot * rk * rk, hidden_f)


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
    HC_P2: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
    PIPE: tl.constexpr = 0
):
    pdl_enter(PDL)
    # Program (p, r): token chunk p (its grad_w_partial row), H tiles r, r + SPLIT, ...; tokens inner, so the
    # [HC, BLOCK_D] grad_w accumulator of a tile stays in registers.  SPLIT = number of H tiles gives one tile
    # per program; a smaller SPLIT gives fewer, longer programs (one wave, no tail).
    _bwd_split_tiles(go_ptr, x_ptr, k_ptr, w_ptr, delta_ptr, ax_ptr, ak_ptr, gx_ptr, gk_ptr, gw_ptr,
                     T, hc, H, tokens_per_chunk,
                     s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gw0, s_gw1,
                     HC_P2, BLOCK_D, SPLIT, PREFETCH, PIPE)


@triton.jit
def _bwd_token_coefs(delta_ptr, ax_ptr, ak_ptr, t, hc, hh, hmask):
    """Pass 1's coefficients (delta, a_x, a_k) of token ``t``, ``[HC_P2]`` (0 on padded heads)."""
    sc = t * hc + hh
    delta = tl.load(delta_ptr + sc, mask=hmask, other=0.0)
    a_x = tl.load(ax_ptr + sc, mask=hmask, other=0.0)
    a_k = tl.load(ak_ptr + sc, mask=hmask, other=0.0)
    return delta, a_x, a_k


@triton.jit
def _bwd_token_tiles(go_ptr, x_ptr, k_ptr, t, go_h, x_h, k_h, d, mask, s_g0, s_x0, s_k0):
    """Token ``t``'s bf16 ``[HC_P2, BLOCK_D]`` tiles of grad_out, x and k (as bits, 0 outside ``mask``)."""
    c_go = tl.load(go_ptr + t * s_g0 + go_h + d[None, :], mask=mask, other=0)
    c_x = tl.load(x_ptr + t * s_x0 + x_h + d[None, :], mask=mask, other=0)
    c_k = tl.load(k_ptr + t * s_k0 + k_h + d[None, :], mask=mask, other=0)
    return c_go, c_x, c_k


@triton.jit
def _bwd_token_store(gx_ptr, gk_ptr, gx, gk, t, hh, d, mask, s_gx0, s_gx1, s_gk0, s_gk1):
    """Store token ``t``'s grad_x and grad_k tiles."""
    tl.store(gx_ptr + t * s_gx0 + hh[:, None] * s_gx1 + d[None, :], gx, mask=mask)
    tl.store(gk_ptr + t * s_gk0 + hh[:, None] * s_gk1 + d[None, :], gk, mask=mask)


@triton.jit
def _bwd_split_token(go_ptr, x_ptr, k_ptr, w, delta_ptr, ax_ptr, ak_ptr, gx_ptr, gk_ptr, t, hc, hh, hmask, d, mask,
                     go_h, x_h, k_h, s_g0, s_x0, s_k0, s_gx0, s_gx1, s_gk0, s_gk1):
    """Pass 2 for token ``t`` on one ``[HC_P2, BLOCK_D]`` tile: stores grad_x and grad_k, returns its grad_w term."""
    delta, a_x, a_k = _bwd_token_coefs(delta_ptr, ax_ptr, ak_ptr, t, hc, hh, hmask)
    c_go, c_x, c_k = _bwd_token_tiles(go_ptr, x_ptr, k_ptr, t, go_h, x_h, k_h, d, mask, s_g0, s_x0, s_k0)
    gx, gk, dw = _bwd_tile_math(c_go, c_x, c_k, w, delta, a_x, a_k)
    _bwd_token_store(gx_ptr, gk_ptr, gx, gk, t, hh, d, mask, s_gx0, s_gx1, s_gk0, s_gk1)
    return dw


@triton.jit
def _bwd_split_tiles(go_ptr, x_ptr, k_ptr, w_ptr, delta_ptr, ax_ptr, ak_ptr, gx_ptr, gk_ptr, gw_ptr,
                     T, hc, H, tokens_per_chunk,
                     s_g0, s_g1, s_x0, s_x1, s_k0, s_k1, s_w0, s_gx0, s_gx1, s_gk0, s_gk1, s_gw0, s_gw1,
                     HC_P2: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
                     PIPE: tl.constexpr = 0):
    """Pass 2 of program (p, r): the tokens of chunk p, ascending: grad_x, grad_k and row p of grad_w_partial.
    PREFETCH: token t + 1's tiles loaded by hand while token t is computed; PIPE (> 0, without PREFETCH): the token
    loop as a ``tl.range`` with ``num_stages=PIPE`` (GPU; a while loop under the interpreter)."""
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
            n_go, n_x, n_k = _bwd_token_tiles(go_ptr, x_ptr, k_ptr, t, go_h, x_h, k_h, d, mask & (t < t_end),
                                              s_g0, s_x0, s_k0)
            while t < t_end:
                delta, a_x, a_k = _bwd_token_coefs(delta_ptr, ax_ptr, ak_ptr, t, hc, hh, hmask)
                c_go = n_go
                c_x = n_x
                c_k = n_k
                tn = t + 1
                n_go, n_x, n_k = _bwd_token_tiles(go_ptr, x_ptr, k_ptr, tn, go_h, x_h, k_h, d, mask & (tn < t_end),
                                                  s_g0, s_x0, s_k0)
                gx, gk, dw = _bwd_tile_math(c_go, c_x, c_k, w, delta, a_x, a_k)
                _bwd_token_store(gx_ptr, gk_ptr, gx, gk, t, hh, d, mask, s_gx0, s_gx1, s_gk0, s_gk1)
                acc += dw
                t = tn
        elif PIPE > 0 and not EMULATE:
            # the compiler's software pipelining: the loads of the next PIPE - 1 tokens go to shared memory by
            # asynchronous copies (cp.async) while this token is computed: bytes in flight without registers
            for tt in tl.range(t_begin, t_end, num_stages=PIPE):
                acc += _bwd_split_token(go_ptr, x_ptr, k_ptr, w, delta_ptr, ax_ptr, ak_ptr, gx_ptr, gk_ptr, tt, hc,
                                        hh, hmask, d, mask, go_h, x_h, k_h, s_g0, s_x0, s_k0, s_gx0, s_gx1, s_gk0,
                                        s_gk1)
        else:  # (PIPE under the interpreter too: its tl.range takes no run-time bounds)
            while t < t_end:
                acc += _bwd_split_token(go_ptr, x_ptr, k_ptr, w, delta_ptr, ax_ptr, ak_ptr, gx_ptr, gk_ptr, t, hc,
                                        hh, hmask, d, mask, go_h, x_h, k_h, s_g0, s_x0, s_k0, s_gx0, s_gx1, s_gk0,
                                        s_gk1)
                t += 1
        tl.store(gw_ptr + p * s_gw0 + hh[:, None] * s_gw1 + d[None, :], acc, mask=mask)
        j += SPLIT
