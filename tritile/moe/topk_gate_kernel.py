"""``topk_gate``: stable top-k expert indices of a score matrix (``tile_kernels.moe.topk_gate``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import custom_op
from tritile.runtime import (check_contiguous, check_device, check_tensor, empty, interpreter_configs, override_key,
                             tuned)
from tritile.utils import ceil_div, next_power_of_two

from tritile.language.sort_keys import KEY_TAKEN, f32_order_key, key_index, pack_key
from tritile.runtime.plan import planned

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["topk_gate"]


@triton.jit
def _row_keys(scores_ptr, rows, row_ok, stride_s, cols, NUM_EXPERTS: tl.constexpr):
    """Packed keys of ``scores[rows, cols]`` (``[BLOCK_T, len(cols)]``); columns past ``NUM_EXPERTS`` are taken."""
    col_ok = cols < NUM_EXPERTS
    x = tl.load(scores_ptr + rows[:, None] * stride_s + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0)
    return tl.where(col_ok[None, :], pack_key(f32_order_key(x), cols[None, :]), KEY_TAKEN)


@triton.jit
def _row_keys32(scores_ptr, rows, row_ok, stride_s, cols, NUM_EXPERTS: tl.constexpr):
    """int32 order keys of ``scores[rows, cols]``; columns past ``NUM_EXPERTS`` get ``INT32_MIN`` (below
    every key, ``-inf`` included)."""
    col_ok = cols < NUM_EXPERTS
    x = tl.load(scores_ptr + rows[:, None] * stride_s + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0)
    return tl.where(col_ok[None, :], f32_order_key(x), -2147483648)


@triton.jit
def _topk_gate_kernel(scores_ptr, out_ptr, num_tokens, stride_s,
                      NUM_EXPERTS: tl.constexpr, NUM_TOPK: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SPLIT: tl.constexpr, KEY32: tl.constexpr, PDL: tl.constexpr = False):
    """``BLOCK_T`` rows per program.  With ``SPLIT`` a row is loaded as two halves of ``BLOCK_E // 2``
    experts joined along a new in-thread axis (``[BLOCK_T, BLOCK_E // 2, 2]``): at ``BLOCK_E // 2 <= 128``
    (4 fp32 per lane) a whole row then lies in one warp, so each arg-max is in-thread maxima plus warp
    shuffles (no shared memory, no barrier).

    ``KEY32``: each arg-max in two 32-bit passes (the largest value key, then the smallest column holding
    it) instead of one pass over 64-bit packed keys; ties still go to the smaller index."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    out_row = out_ptr + rows * NUM_TOPK
    if KEY32:  # (the 32-bit keys' columns: [1, BLOCK_E] or [1, BLOCK_E // 2, 2])
        if SPLIT:
            half = tl.arange(0, BLOCK_E // 2)
            v = tl.join(_row_keys32(scores_ptr, rows, row_ok, stride_s, half, NUM_EXPERTS),
                        _row_keys32(scores_ptr, rows, row_ok, stride_s, half + BLOCK_E // 2, NUM_EXPERTS))
            col = tl.join(half, half + BLOCK_E // 2)[None, :, :]
        else:
            col = tl.arange(0, BLOCK_E)[None, :]
            v = _row_keys32(scores_ptr, rows, row_ok, stride_s, tl.arange(0, BLOCK_E), NUM_EXPERTS)
        for k in tl.static_range(NUM_TOPK):
            if SPLIT:
                best = tl.max(tl.max(v, axis=2), axis=1)
                idx = tl.min(tl.min(tl.where(v == best[:, None, None], col, BLOCK_E), axis=2), axis=1)
                v = tl.where(col == idx[:, None, None], -2147483648, v)
            else:
                best = tl.max(v, axis=1)
                idx = tl.min(tl.where(v == best[:, None], col, BLOCK_E), axis=1)
                v = tl.where(col == idx[:, None], -2147483648, v)
            tl.store(out_row + k, idx.to(tl.int64), mask=row_ok)
    else:
        if SPLIT:
            half = tl.arange(0, BLOCK_E // 2)
            key = tl.join(_row_keys(scores_ptr, rows, row_ok, stride_s, half, NUM_EXPERTS),
                          _row_keys(scores_ptr, rows, row_ok, stride_s, half + BLOCK_E // 2, NUM_EXPERTS))
        else:
            key = _row_keys(scores_ptr, rows, row_ok, stride_s, tl.arange(0, BLOCK_E), NUM_EXPERTS)
        for k in tl.static_range(NUM_TOPK):
            if SPLIT:
                best = tl.max(tl.max(key, axis=2), axis=1)
                key = tl.where(key == best[:, None, None], KEY_TAKEN, key)
            else:
                best = tl.max(key, axis=1)
                key = tl.where(key == best[:, None], KEY_TAKEN, key)
            tl.store(out_row + k, key_index(best).to(tl.int64), mask=row_ok)


def _config(num_experts: int, interpret: bool) -> dict:
    """Default launch config: ``BLOCK_T`` rows per program, ``SPLIT`` rows into two halves (see the kernel),
    ``num_warps``.  Launch configs go through ``tritile.runtime.tuned("topk_gate", ...)``."""
    block_e = next_power_of_two(num_experts)
    if interpret:
        return dict(BLOCK_T=max(1, 16384 // block_e), SPLIT=False, num_warps=1, KEY32=True)
    # One warp per program: a row (two halves of <= 128 experts up to E = 256) never leaves its warp, and
    # with one warp per program the stored indices need no layout conversion through shared memory.
    # KEY32 (two 32-bit passes): each arg-max is one REDUX.MAX + one REDUX.MIN per row, no shuffles (sm_90 SASS
    # at E = 256: 464 instructions per row, against 800 with 80 SHFL for the 64-bit keys).  At E = 256 two rows
    # per warp (440 instructions per row, two independent REDUX chains, 4 LDG.128 in flight, 58 registers):
    # 4001 programs fit one wave at 32 one-warp programs per SM, where 8001 took two.
    split = block_e >= 256
    block_t = 2 if block_e == 256 else max(1, 128 // block_e)
    return dict(BLOCK_T=block_t, SPLIT=split, num_warps=1, KEY32=True)


@functools.lru_cache(maxsize=256)
def _plan(num_tokens: int, num_experts: int, num_topk: int, override) -> tuple:
    """(grid, the kernel's constexprs in signature order, num_warps) for a shape.  Cached (the host path is
    latency-bound); ``override``: ``override_key("topk_gate")``, so tuning sweeps see their candidates."""
    cfg = tuned("topk_gate", _config(num_experts, _INTERPRET))
    block_e = next_power_of_two(num_experts)
    consts = (num_experts, num_topk, cfg["BLOCK_T"], block_e, bool(cfg["SPLIT"]) and block_e >= 2,
              bool(cfg.get("KEY32", True)))
    return (ceil_div(num_tokens, cfg["BLOCK_T"]),), consts, cfg["num_warps"]


def _launch(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    num_tokens, num_experts = scores.shape
    out = empty((num_tokens, num_topk), torch.int64, scores.device)
    if num_tokens == 0:
        return out
    grid, consts, warps = _plan(num_tokens, num_experts, num_topk, override_key("topk_gate"))
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    _topk_gate_kernel.run(scores, out, num_tokens, scores.stride(0), *consts, grid=grid, warmup=False,
                          num_warps=warps, **pdl_args(out.device))
    return out


@planned("topk_gate")
@custom_op("moe_topk_gate", fake=lambda scores, num_topk: scores.new_empty((scores.shape[0], num_topk),
                                                                             dtype=torch.int64))
def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of the ``num_topk`` largest scores of every token, largest first.

    Args:
        scores: float32 ``(num_tokens, num_experts)``, contiguous.
        num_topk: ``1 <= num_topk <= num_experts``.

    Returns:
        int64 ``(num_tokens, num_topk)``, contiguous: column k holds the expert with the k-th largest
        score.  Ties go to the smaller expert index (a stable descending sort, as
        ``tritile.torch.stable_topk``); ``-0.0`` ties with ``+0.0``.  ``-inf`` scores are taken in index
        order (TileKernels can pick an index twice on rows with ``-inf``; tritile cannot).  NaN ranks
        above ``+inf``, as in ``torch.sort``.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(scores, torch.Tensor) and scores.dtype is torch.float32 and scores.dim() == 2
            and scores.is_contiguous() and (scores.device.type == "cuda" or _rt.kernel_device_ok(scores.device))
            and type(num_topk) is int and 1 <= num_topk <= scores.shape[1]):
        check_tensor("scores", scores, dtypes=(torch.float32,), ndim=2)
        check_contiguous("scores", scores)
        check_device("scores", scores)
        num_experts = scores.shape[1]
        if isinstance(num_topk, bool) or not isinstance(num_topk, int):
            raise TypeError(f"num_topk must be an int, got {type(num_topk).__name__}")
        if not 1 <= num_topk <= num_experts:
            raise ValueError(f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    return _launch(scores, num_topk)
