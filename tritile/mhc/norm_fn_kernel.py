"""mHC ``norm_fn``: the RMS-normalised projection of the residual onto the mix logits
(``tile_kernels.mhc.norm_fn_kernel``).

For a token ``v = vec(R_t)`` (``D = n * H`` bf16 values) and ``fn`` (``n3 x D`` float32)::

    p = fn'' . v          (fn'' = round_to_tf32(fn): TF32 operands, as TileKernels' tensor-core GEMM)
    s = sum(v * v)
    mixes = p * rsqrt(s / D + eps)

Kernels (all launched by the functions below):

- ``_norm_fn_gemm_kernel``: ``p`` and ``s`` over ``[BLOCK_T tokens] x [one of SPLITS column ranges]`` tiles (a
  split over ``D`` gives enough programs at a few thousand tokens); the partials go to ``(SPLITS, T, n3)`` /
  ``(SPLITS, T)`` float32 scratch.  ``mhc_pre_big_fuse`` runs this same kernel with the same partitioning
  (:func:`gemm_config`), then reduces the partials with the same helper (:func:`_normalise`), so its mixes
  are bitwise those of the unfused path.
- ``_norm_fn_norm_kernel``: sums the partials in split order and normalises (``mixes``, and ``p``, ``s`` for the
  backward).
- ``_norm_fn_bwd_norm_kernel`` + ``_norm_fn_bwd_mul_kernel``: the backward (spec: ``g_p = g r``,
  ``g_s = -(sum_j g_j p_j) r / (2 (s + eps D))``, ``g_fn'' = sum_t g_p^T x`` as per-program partials over token
  ranges summed in a fixed order, ``g_x = bf16(acc + g_p . fn'' + 2 x g_s)`` written in place into the
  accumulation buffer when one is given).

TF32: ``fn`` is rounded to TF32 inside the kernels (``round_to_tf32``, then the low 13 bits cleared, so the
operand is exact for any ``tl.dot``: the products of bf16 and TF32 values are exact in float32).  The backward
rounds ``g_p`` the same way where the reference GEMMs run in TF32 (CUDA, ``tf32=True``), and keeps it in float32
elsewhere (the CPU, whose torch reference has no TF32).  On the GPU the backward runs both TF32 operands (``fn``
and ``g_p``) as their exact bf16 hi/lo pairs (``_split_tf32``) through bf16 MMAs against the bf16 residual: the
same exact products as TF32 MMAs, at the bf16 rate and without widening the residual to float32.  The forward GEMM
does the same with ``fn`` (``SPLIT_BF16``, the GPU default; the interpreter, whose ``tl.dot`` mishandles bf16
operands, keeps float32 ones).  The products are TileKernels' exactly; the sums differ from its TF32 GEMM's by
float32 accumulation order only (``tests/mhc/test_norm_fn.py::test_forward_exact`` bounds ``p`` by ``2^-17 sum |x
f|`` against float64; ``tests/mhc/test_mhc_vs_tilekernels.py`` bounds the mixes against TileKernels).
"""

from __future__ import annotations

import struct
from typing import Tuple

import torch
import triton
import triton.language as tl

from tritile.language import f32_to_bf16
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.mhc._common import NO_FUSION, token_block, tree_last
from tritile.runtime import (check_contiguous, check_device, check_same_device, check_tensor, custom_op, empty,
                             interpreter_configs, tuned)
from tritile.runtime.plan import planned
from tritile.utils import ceil_div

__all__ = ["round_to_tf32"]

_INTERPRET = interpreter_configs()
# Columns of the padded projection (tl.dot needs N >= 16; n3 = 24 for mhc_mult = 4).
N3_PAD = 32


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """TileKernels' TF32 pre-rounding: the float32 bits as int32, plus ``0x1000``, back to float32.

    The low 13 bits are **not** cleared: tensor cores ignore them, so the value a TF32 GEMM uses is ``x`` rounded
    to 10 mantissa bits, ties away from zero (``1 + 2**-11 -> 1 + 2**-10``).

    Args:
        x: float32 tensor, any shape and strides.

    Returns:
        float32 tensor of ``x``'s shape (a new tensor).
    """
    check_tensor("x", x, dtypes=(torch.float32,))
    return (x.view(torch.int32) + 0x1000).view(torch.float32)


# ------------------------------------------------------------------------------------------------
# @triton.jit helpers shared with pre_big_fuse_kernel
# ------------------------------------------------------------------------------------------------
@triton.jit
def _tf32(x):
    """float32 -> the TF32 value TileKernels' tensor cores use for ``round_to_tf32(x)``: +0x1000 on the bits, then
    the low 13 bits cleared (round to nearest, ties away from zero).  Exact input for any ``tl.dot`` precision."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _rms_scale(s, D, eps):
    """``rsqrt(s / D + eps)``: the RMS factor of a token from its sum of squares (``D`` float32)."""
    return tl.rsqrt(tl.math.div_rn(s, D) + eps)


@triton.jit
def _mix_cols(N3: tl.constexpr, N3P: tl.constexpr):
    """The projection's columns ``j [N3P]`` (padded for ``tl.dot``) and their mask ``j < N3``."""
    j = tl.arange(0, N3P)
    return j, j < N3


@triton.jit
def _split_grid_block(n, BLOCK: tl.constexpr, N3: tl.constexpr, N3P: tl.constexpr):
    """Prologue of the kernels over ``(block, split)`` grids: the split ``k`` (grid axis 1, int64), this program's
    ``BLOCK`` indices along grid axis 0 (int64) with their mask ``< n``, and the columns ``j``, ``j_ok``
    (:func:`_mix_cols`)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    j, j_ok = _mix_cols(N3, N3P)
    return pid_k, idx, ok, j, j_ok


@triton.jit
def _reduce_splits(p_ptr, s_ptr, rows, row_ok, cols, col_ok, num_tokens, SPLITS: tl.constexpr, N3: tl.constexpr):
    """Sum the GEMM's ``SPLITS`` partials of ``p`` (``[rows, cols]``) and ``s`` (``[rows]``) in split order."""
    m = row_ok[:, None] & col_ok[None, :]
    p = tl.load(p_ptr + rows[:, None] * N3 + cols[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    for k in tl.static_range(1, SPLITS):
        p += tl.load(p_ptr + (k * num_tokens + rows)[:, None] * N3 + cols[None, :], mask=m, other=0.0)
        s += tl.load(s_ptr + k * num_tokens + rows, mask=row_ok, other=0.0)
    return p, s


@triton.jit
def _normalise(p_part_ptr, s_part_ptr, rows, row_ok, num_tokens, D, eps, SPLITS: tl.constexpr, N3: tl.constexpr,
               N3P: tl.constexpr):
    """``norm_fn``'s normalisation of a block of tokens: the columns ``j``, ``j_ok`` (:func:`_mix_cols`), the GEMM's
    partials summed in split order (:func:`_reduce_splits`: ``p [rows, N3P]``, ``s [rows]``) and the RMS factor
    ``r = rsqrt(s / D + eps)``; the mixes are ``p * r[:, None]``."""
    j, j_ok = _mix_cols(N3, N3P)
    p, s = _reduce_splits(p_part_ptr, s_part_ptr, rows, row_ok, j, j_ok, num_tokens, SPLITS, N3)
    return j, j_ok, p, s, _rms_scale(s, D, eps)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _split_tf32(v):
    """Split a TF32 value ``v`` (float32 with the low 13 bits clear: 11 significant bits) exactly into two bf16
    values, ``v = hi + lo``: ``hi`` is ``v`` with its low 16 bits cleared (8 significant bits), ``lo = v - hi``
    (the remaining 3 bits; exact in float32, and in bf16 unless it is below bf16's normal range, i.e.
    ``|v| < 2**-116``).  Infinities and NaNs go to ``hi`` with ``lo = 0``.  Products of bf16 values are exact in
    float32, so two bf16 MMAs ``x hi + x lo`` give every product ``x v`` exactly, as a TF32 MMA does."""
    hi = (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    finite = tl.abs(hi) < float("inf")
    lo = tl.where(finite, v, 0.0) - tl.where(finite, hi, 0.0)
    return f32_to_bf16(hi), f32_to_bf16(lo)


@triton.jit
def _norm_fn_gemm_kernel(x_ptr, fn_ptr, p_ptr, s_ptr, num_tokens, D, stride_x,
                         N3: tl.constexpr, N3P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         ITERS: tl.constexpr, PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr,
                         PDL: tl.constexpr):
    """Program ``(t, k)``: tokens ``[t BLOCK_T, (t+1) BLOCK_T)``, columns ``[k ITERS BLOCK_D, (k+1) ITERS BLOCK_D)``.
    Writes ``p[k, rows, :N3] = x . tf32(fn)^T`` and ``s[k, rows] = sum x^2`` (float32).  ``SPLIT_BF16``: the TF32
    ``fn`` as its exact bf16 hi/lo pair (:func:`_split_tf32`) through two bf16 MMAs against the bf16 ``x`` (exact
    products, float32 accumulation), the low parts into an accumulator of their own, added once at the end: the
    tensor cores' float32 accumulation is not round-to-nearest, and adding the small low products into the large
    accumulator step by step doubled its error (H100, D = 28672); otherwise ``x`` widened to float32 on
    ``PRECISION`` MMAs."""
    pdl_enter(PDL)
    pid_k, rows, row_ok, j, j_ok = _split_grid_block(num_tokens, BLOCK_T, N3, N3P)
    acc = tl.zeros([BLOCK_T, N3P], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_T, N3P], dtype=tl.float32)  # the low parts' products, ~2^-8 of acc's (SPLIT_BF16)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    d0 = pid_k * (ITERS * BLOCK_D)
    for it in range(ITERS):
        cols = d0 + it * BLOCK_D + tl.arange(0, BLOCK_D)
        c_ok = cols < D
        xb = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & c_ok[None, :],
                     other=0.0)
        x = xb.to(tl.float32)
        f = _tf32(tl.load(fn_ptr + j[:, None] * D + cols[None, :], mask=j_ok[:, None] & c_ok[None, :], other=0.0))
        if SPLIT_BF16:
            f_hi, f_lo = _split_tf32(f)
            acc = tl.dot(xb, tl.trans(f_hi), acc)
            acc_lo = tl.dot(xb, tl.trans(f_lo), acc_lo)
        else:
            acc = tl.dot(x, tl.trans(f), acc, input_precision=PRECISION)
        sq += tl.sum(x * x, axis=1)
    if SPLIT_BF16:
        acc += acc_lo
    out = pid_k * num_tokens + rows
    tl.store(p_ptr + out[:, None] * N3 + j[None, :], acc, mask=row_ok[:, None] & j_ok[None, :])
    tl.store(s_ptr + out, sq, mask=row_ok)


@triton.jit
def _norm_fn_norm_kernel(p_part_ptr, s_part_ptr, mixes_ptr, p_ptr, s_ptr, num_tokens, D, eps,
                         N3: tl.constexpr, N3P: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                         SAVE: tl.constexpr, PDL: tl.constexpr):
    """``mixes = fma(p, r, 0)`` (TileKernels' normalisation kernel) from the split partials; with ``SAVE`` also the
    summed ``p`` and ``s``."""
    pdl_enter(PDL)
    rows, row_ok = token_block(num_tokens, BLOCK_T)
    j, j_ok, p, s, r = _normalise(p_part_ptr, s_part_ptr, rows, row_ok, num_tokens, D, eps, SPLITS, N3, N3P)
    m = row_ok[:, None] & j_ok[None, :]
    offs = rows[:, None] * N3 + j[None, :]
    tl.store(mixes_ptr + offs, tl.fma(p, r[:, None], 0.0), mask=m)
    if SAVE:
        tl.store(p_ptr + offs, p, mask=m)
        tl.store(s_ptr + rows, s, mask=row_ok)


@triton.jit
def _norm_fn_bwd_norm_kernel(g_ptr, p_ptr, s_ptr, gp_ptr, gs_ptr, num_tokens, D, eps, eps_d,
                             N3: tl.constexpr, N3P: tl.constexpr, BLOCK_T: tl.constexpr, TF32: tl.constexpr,
                             PDL: tl.constexpr):
    """``g_p = g r`` (TF32-rounded with ``TF32``; zero-padded to ``N3P`` columns) and
    ``g_s = ((sum_j g_j p_j) r / (s + eps_d)) / -2`` in TileKernels' order: the sum a butterfly over the ``N3P``
    (zero-padded) rounded products, ``eps_d = fp32(eps D)`` rounded once on the host."""
    pdl_enter(PDL)
    rows, row_ok = token_block(num_tokens, BLOCK_T)
    j, j_ok = _mix_cols(N3, N3P)
    m = row_ok[:, None] & j_ok[None, :]
    g = tl.load(g_ptr + rows[:, None] * N3 + j[None, :], mask=m, other=0.0)
    p = tl.load(p_ptr + rows[:, None] * N3 + j[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    r = _rms_scale(s, D, eps)
    gp = g * r[:, None]
    if TF32:
        gp = _tf32(gp)
    gs = tl.math.div_rn(tree_last(g * p) * r, s + eps_d) * -0.5
    tl.store(gp_ptr + rows[:, None] * N3P + j[None, :], gp, mask=row_ok[:, None])
    tl.store(gs_ptr + rows, gs, mask=row_ok)


@triton.jit
def _norm_fn_bwd_mul_kernel(gp_ptr, gs_ptr, x_ptr, fn_ptr, acc_ptr, gx_ptr, gfn_ptr, num_tokens, D, tokens_per_split,
                            N3: tl.constexpr, N3P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_ACC: tl.constexpr, PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr,
                            PDL: tl.constexpr):
    """Program ``(c, k)``: columns ``[c BLOCK_D, (c+1) BLOCK_D)`` over the tokens of split ``k``.
    ``g_x = bf16(acc + g_p . tf32(fn) + 2 x g_s)`` per tile; ``gfn[k] = sum_t g_p^T x`` (float32 partial).
    ``SPLIT_BF16`` (``g_p`` holds TF32 values): both TF32 operands run as exact bf16 hi/lo pairs
    (:func:`_split_tf32`) through bf16 MMAs with the bf16 ``x`` (exact products, float32 accumulation)."""
    pdl_enter(PDL)
    pid_k, cols, c_ok, j, j_ok = _split_grid_block(D, BLOCK_D, N3, N3P)
    f = _tf32(tl.load(fn_ptr + j[:, None] * D + cols[None, :], mask=j_ok[:, None] & c_ok[None, :], other=0.0))
    f_hi, f_lo = _split_tf32(f)
    gfn = tl.zeros([N3P, BLOCK_D], dtype=tl.float32)
    t = pid_k * tokens_per_split
    t_end = tl.minimum(t + tokens_per_split, num_tokens)
    while t < t_end:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        rows = t + tl.arange(0, BLOCK_T)
        row_ok = rows < t_end
        m = row_ok[:, None] & c_ok[None, :]
        offs = rows[:, None] * D + cols[None, :]
        xb = tl.load(x_ptr + offs, mask=m, other=0.0)
        x = xb.to(tl.float32)
        gp = tl.load(gp_ptr + rows[:, None] * N3P + j[None, :], mask=row_ok[:, None], other=0.0)
        gs = tl.load(gs_ptr + rows, mask=row_ok, other=0.0)
        if HAS_ACC:
            gx = tl.load(acc_ptr + offs, mask=m, other=0.0).to(tl.float32)
        else:
            gx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        if SPLIT_BF16:
            gp_hi, gp_lo = _split_tf32(gp)
            gfn = tl.dot(tl.trans(gp_hi), xb, gfn)
            gfn = tl.dot(tl.trans(gp_lo), xb, gfn)
            gx = tl.dot(gp_hi, f_hi, gx)
            gx = tl.dot(gp_hi, f_lo, gx)
            gx = tl.dot(gp_lo, f_hi, gx)
            gx = tl.dot(gp_lo, f_lo, gx)
        else:
            gfn = tl.dot(tl.trans(gp), x, gfn, input_precision=PRECISION)
            gx = tl.dot(gp, f, gx, input_precision=PRECISION)
        gx = gx + (2.0 * x) * gs[:, None]
        tl.store(gx_ptr + offs, f32_to_bf16(gx), mask=m)
        t += BLOCK_T
    tl.store(gfn_ptr + (pid_k * N3 + j)[:, None] * D + cols[None, :], gfn, mask=j_ok[:, None] & c_ok[None, :])


# ------------------------------------------------------------------------------------------------
# Launch rules
# ------------------------------------------------------------------------------------------------
def _precision(device: torch.device) -> str:
    # operands are exact TF32 values, so "tf32" (tensor cores) and "ieee" give the same products; the
    # interpreter ignores the setting (numpy float32 matmul)
    return "tf32" if device.type == "cuda" and torch.version.hip is None else "ieee"


def gemm_config(num_tokens: int, D: int) -> dict:
    """Launch plan of the forward GEMM, shared by ``mhc_pre_norm_fn`` and ``mhc_pre_big_fuse`` (their mixes are
    bitwise equal only if both use the same partitioning).  Keys (``tuned("mhc_norm_fn_gemm", ...)``): ``BLOCK_T``,
    ``BLOCK_D``, ``num_warps``, ``PROGRAMS`` (the split count over ``D`` is the smallest that reaches this many
    programs, each split keeping at least ``MIN_COLS`` columns: a rule in columns, so a wider ``BLOCK_D`` does not
    halve the programs of a few-token call), or ``SPLITS`` to fix the split count;
    ``SPLIT_BF16`` (the GPU default: ``fn`` as exact bf16 hi/lo pairs on bf16 MMAs, not ``x`` widened to float32).
    The plan depends on the shape only (not on the GPU's SM count), so the mixes' bits do too.  Returns the config
    with ``SPLITS`` and ``ITERS`` (column blocks per split) filled."""
    if _INTERPRET:
        cfg = dict(BLOCK_T=32, BLOCK_D=128, num_warps=4, PROGRAMS=16, MIN_COLS=256, SPLIT_BF16=False)
    else:  # about four programs per SM of an H100/H200 (132 SMs); 128-token tiles read fn half as often as 64
        cfg = dict(BLOCK_T=128, BLOCK_D=128, num_warps=4, num_stages=2, PROGRAMS=512, MIN_COLS=512, SPLIT_BF16=True)
    cfg = dict(tuned("mhc_norm_fn_gemm", cfg))
    n_blocks = max(1, ceil_div(D, cfg["BLOCK_D"]))
    splits = cfg.get("SPLITS")
    if splits is None:
        want = ceil_div(cfg["PROGRAMS"], max(1, ceil_div(num_tokens, cfg["BLOCK_T"])))
        splits = max(1, min(want, n_blocks // max(1, ceil_div(cfg["MIN_COLS"], cfg["BLOCK_D"]))))
    splits = max(1, min(int(splits), n_blocks))
    iters = ceil_div(n_blocks, splits)
    cfg["SPLITS"] = ceil_div(n_blocks, iters)  # no empty split
    cfg["ITERS"] = iters
    return cfg


def _bwd_config(num_tokens: int, D: int) -> dict:
    """Backward launch plan (``tuned("mhc_norm_fn_bwd", ...)``): ``BLOCK_T``/``BLOCK_D`` tiles, ``num_warps``,
    ``PROGRAMS`` (the tokens are cut into the fewest ranges that reach this many programs) or ``TOKEN_SPLITS``.
    Shape-only, like :func:`gemm_config` (``fn``'s gradient sums the ranges' partials in order)."""
    if _INTERPRET:
        cfg = dict(BLOCK_T=32, BLOCK_D=128, num_warps=4, PROGRAMS=4)
    else:
        cfg = dict(BLOCK_T=64, BLOCK_D=128, num_warps=4, num_stages=3, PROGRAMS=512)
    cfg = dict(tuned("mhc_norm_fn_bwd", cfg))
    n_col = max(1, ceil_div(D, cfg["BLOCK_D"]))
    n_tb = max(1, ceil_div(num_tokens, cfg["BLOCK_T"]))
    splits = cfg.get("TOKEN_SPLITS")
    if splits is None:
        splits = ceil_div(cfg["PROGRAMS"], n_col)
    splits = max(1, min(int(splits), n_tb))
    per = ceil_div(n_tb, splits) * cfg["BLOCK_T"]
    cfg["TOKEN_SPLITS"] = ceil_div(num_tokens, per) if num_tokens else 1
    cfg["TOKENS_PER_SPLIT"] = per
    return cfg


# ------------------------------------------------------------------------------------------------
# Host launchers (no argument checks: callers validate)
# ------------------------------------------------------------------------------------------------
def norm_fn_gemm(x: torch.Tensor, fn: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """Launch the GEMM + sum-of-squares kernel.

    Args:
        x: bfloat16 ``(T, D)``, unit stride along ``D``.
        fn: float32 ``(n3, D)`` contiguous (rounded to TF32 inside the kernel).

    Returns:
        ``(p_part, s_part, cfg)``: float32 ``(SPLITS, T, n3)`` and ``(SPLITS, T)`` partials and the launch plan.
    """
    T, D = x.shape
    n3 = fn.shape[0]
    cfg = gemm_config(T, D)
    dev = x.device
    p_part = empty((cfg["SPLITS"], T, n3), torch.float32, dev)
    s_part = empty((cfg["SPLITS"], T), torch.float32, dev)
    if T == 0:
        return p_part, s_part, cfg
    _norm_fn_gemm_kernel[(ceil_div(T, cfg["BLOCK_T"]), cfg["SPLITS"])](
        x, fn, p_part, s_part, T, D, x.stride(0),
        N3=n3, N3P=N3_PAD, BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], ITERS=cfg["ITERS"],
        PRECISION=_precision(dev), SPLIT_BF16=bool(cfg["SPLIT_BF16"]), num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 3), **pdl_args(dev, cfg.get("PDL", True)))
    return p_part, s_part, cfg


def eps_d_f32(eps: float, d: int) -> float:
    """``eps * D`` computed in double and rounded once to float32, as TileKernels' kernels get it (a constant folded
    at compile time)."""
    return struct.unpack("<f", struct.pack("<f", float(eps) * d))[0]


def _norm_block_t() -> int:
    """Tokens per program of the small per-token kernels (normalisation, backward normalisation)."""
    return 64 if _INTERPRET else 32


def _fake_fwd(x, fn, eps):
    T, n3 = x.shape[0], fn.shape[0]
    return x.new_empty((T, n3), dtype=torch.float32), x.new_empty((T, n3), dtype=torch.float32), \
        x.new_empty((T,), dtype=torch.float32)


@planned("mhc_pre_norm_fn_fwd")
@custom_op("mhc_pre_norm_fn_fwd", fake=_fake_fwd)
def norm_fn_fwd(x: torch.Tensor, fn: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of ``mhc_pre_norm_fn`` on flattened tokens.

    Args:
        x: bfloat16 ``(T, D)`` with a unit stride along ``D``; fn: float32 ``(n3, D)`` contiguous; eps: ``eps_rms``.

    Returns:
        ``(mixes, p, s)``: float32 ``(T, n3)`` normalised projections, ``(T, n3)`` unnormalised projections and
        ``(T,)`` sums of squares (the last two are saved for the backward).
    """
    T, D = x.shape
    n3 = fn.shape[0]
    dev = x.device
    p_part, s_part, cfg = norm_fn_gemm(x, fn)
    return normalise(p_part, s_part, D, eps)


def normalise(p_part: torch.Tensor, s_part: torch.Tensor, D: int, eps: float
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``norm_fn``'s normalisation of the GEMM's float32 partials ``p_part (SPLITS, T, n3)`` and ``s_part (SPLITS,
    T)`` (contiguous): ``(mixes, p, s)`` with ``p``, ``s`` the partials summed in split order and
    ``mixes = fma(p, rsqrt(s / D + eps), 0)``."""
    splits, T, n3 = p_part.shape
    dev = p_part.device
    mixes = empty((T, n3), torch.float32, dev)
    if splits == 1:
        p, s = p_part[0], s_part[0]
    else:
        p = empty((T, n3), torch.float32, dev)
        s = empty((T,), torch.float32, dev)
    if T == 0:
        return mixes, p, s
    bt = _norm_block_t()
    _norm_fn_norm_kernel[(ceil_div(T, bt),)](
        p_part, s_part, mixes, p, s, T, float(D), float(eps),
        N3=n3, N3P=N3_PAD, SPLITS=splits, BLOCK_T=bt, SAVE=splits > 1, num_warps=4, **NO_FUSION,
        **pdl_args(dev, launch=False))
    return mixes, p, s


def bwd_normalise(g: torch.Tensor, p: torch.Tensor, s: torch.Tensor, D: int, eps: float, tf32: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The backward's normalisation step (TileKernels' order) for float32 ``g``, ``p`` ``(T, n3)`` and ``s (T,)``
    (contiguous): ``g_p (T, 32)`` (``g r``, TF32-rounded with ``tf32``, zero columns past ``n3``) and ``g_s (T,)``."""
    T, n3 = g.shape
    dev = g.device
    gp = empty((T, N3_PAD), torch.float32, dev)
    gs = empty((T,), torch.float32, dev)
    if T == 0:
        return gp, gs
    bt = _norm_block_t()
    _norm_fn_bwd_norm_kernel[(ceil_div(T, bt),)](
        g, p, s, gp, gs, T, float(D), float(eps), eps_d_f32(eps, D), N3=n3, N3P=N3_PAD, BLOCK_T=bt,
        TF32=bool(tf32), num_warps=4, **NO_FUSION, **pdl_args(dev))
    return gp, gs


def _fake_bwd(g, x, fn, p, s, eps, x_grad, has_acc, tf32):
    return fn.new_empty(fn.shape)


@planned("mhc_pre_norm_fn_bwd")
def _norm_fn_bwd_parts(g: torch.Tensor, x: torch.Tensor, fn: torch.Tensor, p: torch.Tensor, s: torch.Tensor,
                       eps: float, x_grad: torch.Tensor, has_acc: bool, tf32: bool) -> torch.Tensor:
    """:func:`norm_fn_bwd`'s kernels: ``x_grad`` written, and ``fn``'s gradient as float32 ``(TOKEN_SPLITS, n3,
    D)`` partials over token ranges (one zero partial when there are no tokens)."""
    T, D = x.shape
    n3 = fn.shape[0]
    dev = x.device
    if T == 0:
        return empty((1, n3, D), torch.float32, dev).zero_()
    gp, gs = bwd_normalise(g, p, s, D, eps, tf32)
    cfg = _bwd_config(T, D)
    splits = cfg["TOKEN_SPLITS"]
    gfn_part = empty((splits, n3, D), torch.float32, dev)
    _norm_fn_bwd_mul_kernel[(ceil_div(D, cfg["BLOCK_D"]), splits)](
        gp, gs, x, fn, x_grad, x_grad, gfn_part, T, D, cfg["TOKENS_PER_SPLIT"],
        N3=n3, N3P=N3_PAD, BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], HAS_ACC=bool(has_acc),
        PRECISION=_precision(dev), SPLIT_BF16=bool(tf32) and not _INTERPRET, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 3), **pdl_args(dev, launch=False))
    return gfn_part


@custom_op("mhc_pre_norm_fn_bwd", mutates_args=("x_grad",), fake=_fake_bwd)
def norm_fn_bwd(g: torch.Tensor, x: torch.Tensor, fn: torch.Tensor, p: torch.Tensor, s: torch.Tensor, eps: float,
                x_grad: torch.Tensor, has_acc: bool, tf32: bool) -> torch.Tensor:
    """Backward of ``mhc_pre_norm_fn`` on flattened tokens.

    Args:
        g: float32 ``(T, n3)`` contiguous, the gradient of ``mixes``.
        x: bfloat16 ``(T, D)`` contiguous; fn: float32 ``(n3, D)`` contiguous (unrounded);
        p, s: float32 ``(T, n3)``, ``(T,)`` from :func:`norm_fn_fwd`; eps: ``eps_rms``.
        x_grad: bfloat16 ``(T, D)`` contiguous, overwritten with ``bf16(acc + g_p . fn'' + 2 x g_s)``, where
            ``acc`` is its previous content when ``has_acc`` and zero otherwise.
        tf32: round ``g_p`` to TF32 before the GEMMs (as a TF32 reference does).

    Returns:
        float32 ``(n3, D)``: the gradient of ``fn`` (straight through the TF32 rounding; the token ranges'
        partials added by ``torch.sum``).
    """
    gfn_part = _norm_fn_bwd_parts(g, x, fn, p, s, eps, x_grad, has_acc, tf32)
    return gfn_part[0] if gfn_part.shape[0] == 1 else gfn_part.sum(0)


def check_norm_fn_inputs(residual: torch.Tensor, fn: torch.Tensor, fn_name: str = "mhc_fn") -> Tuple[int, int, int]:
    """Validate ``residual`` (bf16 ``(..., n, H)``) against ``fn`` (float32 ``(n3, n H)``, n3 = 24); returns
    ``(n, H, n3)``."""
    check_tensor("residual", residual, dtypes=(torch.bfloat16,))
    if residual.dim() < 2:
        raise ValueError(f"residual must be (..., mhc_mult, hidden_size), got shape {tuple(residual.shape)}")
    check_tensor(fn_name, fn, dtypes=(torch.float32,), ndim=2)
    check_same_device(residual=residual, **{fn_name: fn})
    check_device("residual", residual)
    n, H = residual.shape[-2], residual.shape[-1]
    n3 = fn.shape[0]
    if fn.shape[1] != n * H:
        raise ValueError(f"{fn_name} must have mhc_mult * hidden_size = {n} * {H} = {n * H} columns (residual "
                         f"shape {tuple(residual.shape)}), got shape {tuple(fn.shape)}")
    if n != 4 or n3 != 24:
        raise ValueError(f"{fn_name} must have mhc_mult * (mhc_mult + 2) = 24 rows (mhc_mult = 4 is the only "
                         f"supported value), got {n3} rows for mhc_mult = {n}")
    check_contiguous(fn_name, fn)
    return n, H, n3


def flatten_residual(residual: torch.Tensor) -> torch.Tensor:
    """``residual`` (..., n, H) as ``(T, n H)``; raises if it is not contiguous."""
    check_contiguous("residual", residual)
    n, H = residual.shape[-2], residual.shape[-1]
    return residual.view(-1, n * H)


def empty_grad_like(x: torch.Tensor) -> torch.Tensor:
    """A bf16 buffer for :func:`norm_fn_bwd`'s ``x_grad`` without accumulation."""
    return empty(tuple(x.shape), torch.bfloat16, x.device)

