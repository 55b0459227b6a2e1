"""Engram gate: fused RMSNorm(x) . RMSNorm(k) gate, signed-sqrt, sigmoid and residual add; and its backward.

Per token t and hyper-connection head h (x = hidden_states[t, h], k = k[t, h], w = weight_fused[h], v = v[t]):

    D   = sum_d x_d * w_d * k_d                      (the raw dot, saved as ``dot``)
    r_x = rsqrt(sum_d x_d^2 / H + eps),  r_k = rsqrt(sum_d k_d^2 / H + eps)
    s   = D * r_x * r_k * H^-0.5
    g   = sigmoid(copysign(sqrt(max(|s|, clamp_value)), s))
    out = bf16(x + g * v)

The forward's default is ``_engram_gate_fwd_persist_kernel`` (program = one head of a token chunk, w[h] in
registers); ``_engram_gate_fwd_kernel`` (ROWS rows per program) is the tuning alternative.

The backward, on Hopper GPUs with Triton 3.6's Gluon, is one pass: ``_engram_bwd_gluon`` (TMA rings, grad_out's row in
shared memory, the grad_w accumulator on chip), 636-638 us on the H200 at T=8001, hc=4, H=7168 (TileKernels 644 us;
H200, 2026-11-30, commit 31c87fe).  Everywhere else (other GPUs, other Tritons, shapes it does not cover: hc not in {1,
2, 4}, H not a multiple of 256 or above 8192, strides TMA cannot describe; and the interpreter) it is two passes,
731-737 us there (the kernels in ``_engram_bwd_two_pass``):

1. ``_engram_gate_bwd_coef_kernel`` (or ``_engram_gate_bwd_gamma_kernel``), one program per token:
   ``gamma[t, h] = sum_d G_d v_d`` (dL/dg) and ``grad_v[t] = sum_h g_h G_h``.
2. ``_engram_gate_bwd_split_kernel`` (or ``_engram_gate_bwd_kernel``), programs over (token chunk p, H tiles):
   grad_x, grad_k and ``grad_w_partial[p] = sum_{t in chunk p} delta * x * k``, with ``delta = dL/dD`` (r held fixed).

The two passes move 2.98 GB at T=8001, hc=4, H=7168 (G and v are read twice): 706 us at the copy rate, against 598 us
for one pass.  Three one-pass designs were built and measured on the H200 (2026-11-30, commits 8b7524c and 694bd6c) and
removed because each lost to the two passes (765 us CUPTI): a program per (token chunk, head) with the whole row in
registers (1211-1287 us: 128 registers, one block per SM, too few bytes in flight); a persistent kernel walking token
blocks with a gamma phase and an L2-hit second phase (1001 us at best); and the same with the two phases interleaved
across token blocks (1375 us at best; the configurations with enough bytes in flight need ~250 registers).  A fourth,
both passes per launch chunk of tokens so that pass 2 re-reads grad_out from L2 (same bits), took 865-1183 us (H200,
2026-11-30, commit 65d4724: the launches' ramps and tails and the grad_w_partial read-modify-write cost more than the L2
hits saved).  A fifth, one pass in "gangs" (H200, 2026-11-30, commit bc6f44a: units of 8-16 tokens run by one program
per H tile, exchanging partial gammas through global memory with release/acquire counters), was correct on the H200 and
took 1429-3666 us (the per-token polling kept the memory pipes busy at 13 % of DRAM throughput).  The Triton designs
were bound by the register file; the Gluon kernel keeps its rows in shared memory instead.  docs/PERFORMANCE.md has the
figures.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..config import get_num_sms
from ..language import bf16_bits_to_f32, exp_f32, f32_to_bf16_bits
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_contiguous, check_same_device, check_tensor, custom_op, empty, regs_per_thread, tuned
from ..utils import ceil_div, next_power_of_two
from . import _engram_bwd_gluon as onepass
from ._engram_bwd_two_pass import (
    _engram_gate_bwd_coef_kernel,
    _engram_gate_bwd_gamma_kernel,
    _engram_gate_bwd_kernel,
    _engram_gate_bwd_split_kernel,
)
from ._utils import bits16, check_float, check_rows, empty_like, interp
from tritile.runtime.plan import planned

__all__ = ["engram_gate_fwd", "engram_gate_bwd"]


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
    SAVE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
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
    SAVE: tl.constexpr, BLOCK_H: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
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
    (the programs per SM that fit: ~100 registers per thread at 16 fp32 elements per thread and tensor; CAP_REGS
    holds ptxas to it).  A row split in two power-of-two pieces (2560 = 2048 + 512: no masked lane) lost by 23-41 %
    at 2560, 3072 and 6144 (H200, 2026-12-02; not profiled: each token then takes two sets of cross-warp
    reductions)."""
    block_h, rows, num_warps = _fwd_config(H)
    if interp():
        return tuned("engram_gate_fwd", dict(BLOCK_H=block_h, ROWS=rows, WARPS=num_warps, PERSIST=True,
                                             WAVES=1, PREFETCH=True))
    # SASS (sm_90, H = 7168, BLOCK_H = 8192, 16 warps): 16 bf16 of x, k, v per thread in 2 LDG.E.128 each,
    # w[h] in 4 LDG.E.128 once per program, out in 2 STG.E.128; no spills.
    # CAP_REGS: cap ptxas' registers a thread so that WAVES programs of WARPS warps really fit an SM's 64K registers.
    # Without it ptxas took 141-142 registers at 2048 x 4 warps and 4096 x 8 warps with SAVE: one program fewer an SM
    # than the grid is planned for.  H200, CUPTI, T = 8001, hc = 4, save (2026-12-02): 2048 147 -> 108 us, 2560
    # 238 -> 165, 3072 247 -> 178, 4096 275 -> 213; 7168 unchanged (393).  At the defaults' cap, 128, none of their
    # variants spills (sm_90).
    warps = min(16, max(4, block_h // 512))
    return tuned("engram_gate_fwd", dict(BLOCK_H=block_h, ROWS=rows, WARPS=warps, PERSIST=True,
                                         WAVES=max(1, 16 // warps), PREFETCH=True, CAP_REGS=True))


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
    maxnreg = {}
    if cfg["PERSIST"] and cfg.get("CAP_REGS") and dev.type == "cuda":
        maxnreg = dict(maxnreg=regs_per_thread(int(cfg["WAVES"]) * int(num_warps)))
    if cfg["PERSIST"]:
        n_chunks = max(1, min(T, int(cfg["WAVES"]) * get_num_sms() // hc))
        chunk = ceil_div(T, n_chunks)
        n_chunks = ceil_div(T, chunk)
        _engram_gate_fwd_persist_kernel[(n_chunks * hc,)](
            *ptrs, T, hc, H, chunk, float(H), eps, clamp_value, _scale(H), *strides,
            SAVE=bool(save_for_backward), BLOCK_H=block_h, PREFETCH=bool(cfg["PREFETCH"]), num_warps=num_warps,
            **maxnreg,
            **pdl_args(hidden_states.device),
        )
    else:
        rows = cfg["ROWS"]
        _engram_gate_fwd_kernel[(ceil_div(num_rows, rows),)](
            *ptrs, num_rows, hc, H, float(H), eps, clamp_value, _scale(H), *strides,
            SAVE=bool(save_for_backward), ROWS=rows, BLOCK_H=block_h, num_warps=num_warps,
            **pdl_args(hidden_states.device),
        )
    return (out, *saved)


_Opt = Optional[torch.Tensor]


@planned("engram_gate_fwd")
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
    # pass 1 with 4 warps: H200 sweep (2026-11-30, commit 694bd6c, T=8001, hc=4, H=7168, CUDA graph) 767.8 us for the
    # whole backward against 1169.6 us with 8 warps on the same [1, 4, 1024] tile (the default before), 785.8 us with
    # TOK=2 at 8 warps; gamma's summation order follows the layout, so grad_x / grad_k may change in the last bit
    # (within the tests' calc_diff bounds; grad_v does not change)
    return hc_p2, 1, block_d1, block_d2, 4


def _bwd_launch_config(H: int, hc: int) -> dict:
    """The bwd launch config, through ``tuned("engram_gate_bwd", ...)``.

    TOK, BLOCK_D1, WARPS1: pass 1.  BLOCK_D2, WARPS2: pass 2's [HC_P2, BLOCK_D2] tile.  COEF: pass 1 also
    computes delta, a_x and a_k (pass 2 reads 3 scalars per (token, head) instead of 5 and does no sqrt or
    division; False: the first version).  SPLIT: pass 2's grid is (num_sms, SPLIT) and program (p, r) takes
    the H tiles r, r + SPLIT, ... of token chunk p (SPLIT >= the number of tiles: one tile per program).
    PREFETCH: pass 2 loads token t + 1's tiles while token t is computed.  PIPE (> 0, without PREFETCH): pass 2's
    token loop software-pipelined by the compiler with ``num_stages=PIPE`` (cp.async into shared memory; GPU only).
    MAXNREG2 (None: no cap): ptxas' register cap for pass 2.  ONEPASS: on Hopper GPUs with Triton's Gluon, the
    one-pass kernel of ``_engram_bwd_gluon`` where it covers the shape (NSLOT: its ring of x / k / w tiles); the
    two passes otherwise."""
    hc_p2, tok, bd1, bd2, nw = _bwd_config(H, hc)
    n_tiles = ceil_div(H, bd2)
    if interp():
        split, nw2, prefetch = max(1, n_tiles // 2), nw, True
    else:
        # one [HC_P2, BLOCK_D2] tile a program at 4 warps, no prefetch (a 132 x 14 grid at the anchor): 746.2 us CUPTI
        # in the sweep of 2026-11-30 (commit 65d4724; T=8001, hc=4, H=7168) against 765.9 us for two programs per SM at
        # 8 warps, each streaming half of the tiles with token t + 1's tiles prefetched (the default before); same bits
        split, nw2, prefetch = n_tiles, 4, False
    # H200, 2026-11-30, commit d53c6fa (same shape, CUPTI): pass 2's token loop pipelined by the compiler with 3 stages
    # (cp.async of the next two tokens' tiles into shared memory) 732.25 us against 747.27 without (same bits)
    pipe = 0 if interp() else 3
    return tuned("engram_gate_bwd", dict(TOK=tok, BLOCK_D1=bd1, WARPS1=nw, BLOCK_D2=bd2, WARPS2=nw2,
                                         COEF=True, SPLIT=split, PREFETCH=prefetch, PIPE=pipe, MAXNREG2=None,
                                         ONEPASS=True, NSLOT=3))


def _bwd_num_parts(H: int, hc: int) -> int:
    """P, the number of grad_w_partial rows: num_sms (one token chunk per row)."""
    return get_num_sms()


@planned("engram_gate_bwd")
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
    if (cfg["ONEPASS"] and not interp() and onepass.available(dev)
            and onepass.supports(grad_out, hidden_states, k, v, weight_fused, int(cfg["NSLOT"]))):
        onepass.launch(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
                       _scale(H), grad_x, grad_k, grad_v, grad_w_partial, chunk, int(cfg["NSLOT"]))
        return grad_x, grad_k, grad_v, grad_w_partial
    if not cfg["COEF"]:  # the first version: pass 2 recomputes delta from gamma and the saved tensors
        gamma = empty((T, hc), torch.float32, dev)
        _engram_gate_bwd_gamma_kernel[(ceil_div(T, cfg["TOK"]),)](
            bits16(grad_out), bits16(v), gate_score, gamma, bits16(grad_v),
            T, hc, H, grad_out.stride(0), grad_out.stride(1), v.stride(0), grad_v.stride(0),
            HC_P2=hc_p2, TOK=cfg["TOK"], BLOCK_D=cfg["BLOCK_D1"], num_warps=cfg["WARPS1"], **pdl_args(grad_out.device),
        )
        _engram_gate_bwd_kernel[(num_parts, ceil_div(H, cfg["BLOCK_D2"]))](
            bits16(grad_out), bits16(hidden_states), bits16(k), weight_fused, dot, gate_score, rstd_x, rstd_k,
            gamma, bits16(grad_x), bits16(grad_k), grad_w_partial,
            T, hc, H, float(H), chunk, clamp_value, _scale(H),
            grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
            k.stride(0), k.stride(1), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
            grad_k.stride(0), grad_k.stride(1), grad_w_partial.stride(0), grad_w_partial.stride(1),
            HC_P2=hc_p2, BLOCK_D=cfg["BLOCK_D2"], num_warps=cfg["WARPS2"], **pdl_args(grad_out.device, launch=False),
        )
        return grad_x, grad_k, grad_v, grad_w_partial
    coef = empty((3, T, hc), torch.float32, dev)  # delta, a_x, a_k
    split = max(1, min(int(cfg["SPLIT"]), ceil_div(H, cfg["BLOCK_D2"])))
    _engram_gate_bwd_coef_kernel[(ceil_div(T, cfg["TOK"]),)](
        bits16(grad_out), bits16(v), dot, gate_score, rstd_x, rstd_k, coef[0], coef[1], coef[2], bits16(grad_v),
        T, hc, H, float(H), clamp_value, _scale(H),
        grad_out.stride(0), grad_out.stride(1), v.stride(0), grad_v.stride(0),
        HC_P2=hc_p2, TOK=cfg["TOK"], BLOCK_D=cfg["BLOCK_D1"], num_warps=cfg["WARPS1"], **pdl_args(grad_out.device),
    )
    extra2 = {} if cfg["MAXNREG2"] is None else dict(maxnreg=int(cfg["MAXNREG2"]))
    _engram_gate_bwd_split_kernel[(num_parts, split)](
        bits16(grad_out), bits16(hidden_states), bits16(k), weight_fused, coef[0], coef[1], coef[2],
        bits16(grad_x), bits16(grad_k), grad_w_partial,
        T, hc, H, chunk,
        grad_out.stride(0), grad_out.stride(1), hidden_states.stride(0), hidden_states.stride(1),
        k.stride(0), k.stride(1), weight_fused.stride(0), grad_x.stride(0), grad_x.stride(1),
        grad_k.stride(0), grad_k.stride(1), grad_w_partial.stride(0), grad_w_partial.stride(1),
        HC_P2=hc_p2, BLOCK_D=cfg["BLOCK_D2"], SPLIT=split, PREFETCH=bool(cfg["PREFETCH"]),
        PIPE=0 if cfg["PREFETCH"] else int(cfg["PIPE"]), num_warps=cfg["WARPS2"], **extra2,
        **pdl_args(grad_out.device, launch=False),
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
