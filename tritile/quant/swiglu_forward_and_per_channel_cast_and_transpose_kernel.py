"""``swiglu_forward_and_per_channel_cast_and_transpose``: SwiGLU, bf16 rounding, per-channel FP8 cast.

``tile_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose`` (``spec/quant.md`` §3.10).
Each program loads ``[BM, BK]`` tiles of both halves of x, computes the (optionally clamped) SwiGLU
activation, rounds it to bf16 (as the reference's ``.bfloat16()``), and quantizes it with one scale
per (``npt`` rows x 1 column) block through the shared per-channel epilogue
(``_per_channel_common.per_channel_quant_tile``); the codes are stored transposed ``(H, M)`` or as
``(M, H)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, exp_f32, f32_to_bf16_bits
from ..runtime import (check_choice, check_device, check_inner_contiguous, check_tensor, empty, interpreter_configs,
                       tuned)
from ..utils import ceil_div, next_power_of_two
from ._per_channel_common import per_channel_quant_tile_bf16
from .swiglu_forward_and_per_token_cast_kernel import (_check_clamp_value, _check_int, _div_neg_fast, _swiglu_act,
                                                        _swiglu_clamp)
from .types import QuantTensor

__all__ = ["swiglu_forward_and_per_channel_cast_and_transpose"]


@triton.jit
def _swiglu_forward_and_per_channel_cast_and_transpose_kernel(
        x_ptr, out_ptr, sf_ptr, num_rows, stride_xm, stride_om, stride_sm, clamp_value,
        H: tl.constexpr, NPT: tl.constexpr, ROUND_SF: tl.constexpr, HAS_CLAMP: tl.constexpr,
        TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FINITE_BRANCH: tl.constexpr,
        VEC: tl.constexpr = 0, FAST_DIV: tl.constexpr = False, SIGNED_ENC: tl.constexpr = 0,
        INT_POW2: tl.constexpr = False):
    """``VEC`` (> 0): the column offsets are declared contiguous in runs of ``VEC`` only, so Triton's
    coalescing gives each thread ``VEC`` columns (8: 16-byte bf16 loads, 8-byte code stores) and more
    rows: fewer shuffles in the column max.  The column max is taken on the activation's bf16 patterns.

    ``FAST_DIV``: ``l / (1 + exp(-l))`` through ``_div_neg_fast`` (the per-token kernel's default: the
    fast path of ``div.rn.f32`` per four elements without its per-element range check and branch; the
    same bits) with ``-l`` written ``l * -1`` (exp(+-0) = 1 either way).  ``SIGNED_ENC`` (1, or 2 with
    ``BM == NPT``): the e4m3 encode's NaN patch as a sign merge from the activation's bf16 patterns; 2 also
    unpacks and multiplies inside the per-four assembly (``_per_channel_common``; same bits).  ``INT_POW2``
    (round_sf): the power-of-two scales from amax's bits, no division (``per_channel_scale``; same bits)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    if VEC > 0:
        cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
    row_ok = rows < num_rows
    col_ok = cols < H
    m = row_ok[:, None] & col_ok[None, :]
    x_row = x_ptr + rows[:, None] * stride_xm
    l = bf16_bits_to_f32(tl.load(x_row + cols[None, :], mask=m, other=0))
    r = bf16_bits_to_f32(tl.load(x_row + (cols[None, :] + H), mask=m, other=0))
    if HAS_CLAMP:
        l, r = _swiglu_clamp(l, r, clamp_value)
    if FAST_DIV:
        nl = l * -1.0
        act = _div_neg_fast(nl, 1.0 + exp_f32(nl), HAS_CLAMP) * r  # HAS_CLAMP: l <= c, so -l > -inf
    else:
        act = _swiglu_act(l, r)
    # act rounded to bf16 before the amax and the cast; masked elements are +0
    codes, sf = per_channel_quant_tile_bf16(f32_to_bf16_bits(act), NPT, ROUND_SF, FINITE_BRANCH, SIGNED_ENC,
                                            INT_POW2)
    if TRANSPOSE:
        tl.store(out_ptr + cols[:, None] * stride_om + rows[None, :], tl.trans(codes),
                 mask=col_ok[:, None] & row_ok[None, :])
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], codes, mask=m)
    groups = pid_m * (BM // NPT) + tl.arange(0, BM // NPT)
    tl.store(sf_ptr + groups[:, None] * stride_sm + cols[None, :], sf,
             mask=(groups < num_rows // NPT)[:, None] & col_ok[None, :])


def _config(H: int, npt: int):
    """(BM, BK, num_warps).  GPU: one scale block of rows per tile, 4096 elements of each half (32
    per thread with 4 warps; ptxas: 152 registers for [32, 128], no spills; [128, 128] with 8 warps
    spilled), i.e. ``[32, 128]`` for npt = 32 and ``[128, 32]`` for npt = 128.  Interpreter: 128 rows
    and one tile as wide as the row (up to 1024 columns).

    H200 sweep (2026-11-30, 4096 x 7168, npt 32, no transpose, VEC=8): [32, 32] x 1 warp (the same 32
    elements per thread) 66.7 us, [32, 64] x 2 warps 68.5 us, [32, 128] x 4 warps 77.8 us: npt 32 takes
    [32, 32] x 1 warp; npt 128 (not swept) keeps [128, 32] x 4 warps.  Session 4 sweep (same shape): with
    SIGNED_ENC=2, FAST_DIV and INT_POW2 (same bits, fewer instructions), [32, 64] x 2 warps 54.7 us, [32, 32] x
    1 warp 55.6 us (TileKernels 45.1)."""
    if interpreter_configs():
        return max(128, npt), min(max(next_power_of_two(H), 16), 1024), 4
    if npt == 32:
        return 32, 64, 2
    return npt, 4096 // npt, 4


def _launch(x, npt, round_sf, without_transpose, clamp):
    m, two_h = x.shape
    H = two_h // 2
    dev = x.device
    out = empty((m, H) if without_transpose else (H, m), torch.float8_e4m3fn, dev)
    sf = empty((m // npt, H), torch.float32, dev)
    if m == 0 or H == 0:
        return out, sf
    bm, bk, num_warps = _config(H, npt)
    # tritile.runtime.tuned("swiglu_forward_and_per_channel_cast_and_transpose", ...): BLOCK_M (a multiple of
    # npt), BLOCK_K (a power of two), num_warps, FINITE_BRANCH (GPU: a uniform branch drops the NaN patch of
    # the e4m3 encode when the tile is finite; fewer instructions, more registers), FAST_DIV, SIGNED_ENC, INT_POW2
    # (same bits, fewer instructions: see the kernel)
    c = tuned("swiglu_forward_and_per_channel_cast_and_transpose",
              {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": num_warps, "FINITE_BRANCH": False,
               "VEC": 0 if interpreter_configs() else 8, "FAST_DIV": True, "SIGNED_ENC": 2,
               "INT_POW2": True})
    bm, bk, num_warps = c["BLOCK_M"], c["BLOCK_K"], c["num_warps"]
    if bm % npt or bm & (bm - 1) or bk < 1 or bk & (bk - 1):
        raise ValueError(f"bad swiglu_forward_and_per_channel_cast_and_transpose launch config {c}: BLOCK_M a "
                         f"power of two and a multiple of num_per_tokens={npt}, BLOCK_K a power of two")
    grid = (ceil_div(m, bm), ceil_div(H, bk))
    _swiglu_forward_and_per_channel_cast_and_transpose_kernel[grid](
        x.view(torch.int16), out.view(torch.uint8), sf, m, x.stride(0), out.stride(0), sf.stride(0),
        clamp if clamp is not None else 0.0,
        H=H, NPT=npt, ROUND_SF=round_sf, HAS_CLAMP=clamp is not None, TRANSPOSE=not without_transpose,
        BM=bm, BK=bk, FINITE_BRANCH=bool(c["FINITE_BRANCH"]), VEC=int(c["VEC"]), FAST_DIV=bool(c["FAST_DIV"]),
        SIGNED_ENC=int(c["SIGNED_ENC"]) if bm == npt else min(int(c["SIGNED_ENC"]), 1),
        INT_POW2=bool(c["INT_POW2"]), num_warps=num_warps,
        enable_fp_fusion=False)  # no FMA contraction of 1 + exp(-l) (see swiglu_forward_and_per_token_cast_kernel)
    return out, sf


def swiglu_forward_and_per_channel_cast_and_transpose(
        x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False, without_transpose: bool = False,
        swiglu_clamp_value: Optional[float] = None) -> QuantTensor:
    """SwiGLU of ``x``, rounded to bf16, then an FP8 e4m3 cast with one scale per (npt rows x 1 column).

    Per element: ``l = x[m, j]``, ``r = x[m, j + H]``; with a clamp c, ``l = min(l, c)`` and ``r`` into
    ``[-c, c]``; ``act = bf16((l / (1 + exp(-l))) * r)``.  Per column j of each block of npt rows:
    ``amax = max |act|``, ``sf = max(amax, 1e-4) / 448`` (IEEE; ``round_sf`` rounds it up to a power of
    two), codes ``e4m3(act * sf_inv)``.  A block holding inf or NaN gets sf = +inf and codes
    ``e4m3(act * 0)`` (NaN for the non-finite elements), so it dequantizes to NaN.

    Args:
        x: bfloat16 ``(M, 2H)``, ``M % 128 == 0``, ``2H % 128 == 0``, unit column stride (rows may be
            strided).
        fmt: ``'e4m3'`` (the only format).
        num_per_tokens: npt, rows per scale block: 32 or 128.
        round_sf: round the scales up to powers of two.
        without_transpose: store the codes as ``(M, H)`` instead of transposed ``(H, M)``.
        swiglu_clamp_value: optional clamp c >= 0.

    Returns:
        ``(out, sf)``: out float8_e4m3fn ``(H, M)`` (or ``(M, H)``) contiguous; sf float32 ``(M/npt, H)``
        contiguous (never transposed).
    """
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    check_choice("fmt", fmt, ("e4m3",))
    npt = _check_int("num_per_tokens", num_per_tokens)
    check_choice("num_per_tokens", npt, (32, 128))
    for name, v in (("round_sf", round_sf), ("without_transpose", without_transpose)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    m, two_h = x.shape
    if m % 128 != 0:
        raise ValueError(f"x must have a multiple of 128 rows, got shape {tuple(x.shape)}")
    if two_h % 128 != 0 or two_h == 0:
        raise ValueError(f"x must have 2*H columns with 2*H a multiple of 128, got shape {tuple(x.shape)}")
    check_inner_contiguous("x", x)
    check_device("x", x)
    clamp = _check_clamp_value("swiglu_clamp_value", swiglu_clamp_value)
    return _launch(x, npt, round_sf, without_transpose, clamp)
