"""``grad_w_reduce``: sum the gate backward's partial weight gradients and apply the chain rule of
``weight_fused = weight_hidden * weight_embed``, accumulating in place (e.g. into Megatron ``main_grad``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32
from .. import runtime as _rt
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_no_overlap, check_same_device, check_tensor, custom_op, override_key, tuned
from ..utils import ceil_div, next_power_of_two
from ._utils import bits16, check_rows, interp
from tritile.runtime.plan import planned

__all__ = ["grad_w_reduce"]


@triton.jit
def _epilogue_loads(wh_ptr, we_ptr, gwh_ptr, gwe_ptr, h, d, dmask, s_wh0, s_we0, s_gwh0, s_gwe0):
    """The weights (bf16 bits) and the float32 gradients the sum is accumulated into, at head h, columns d."""
    return (tl.load(wh_ptr + h * s_wh0 + d, mask=dmask, other=0), tl.load(we_ptr + h * s_we0 + d, mask=dmask, other=0),
            tl.load(gwh_ptr + h * s_gwh0 + d, mask=dmask, other=0.0),
            tl.load(gwe_ptr + h * s_gwe0 + d, mask=dmask, other=0.0))


@triton.jit
def _grad_w_reduce_kernel(
    part_ptr, wh_ptr, we_ptr, gwh_ptr, gwe_ptr,
    P, H,
    s_p0, s_p1, s_wh0, s_we0, s_gwh0, s_gwe0,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, EARLY: tl.constexpr, SWAP: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr = False
):
    """``SWAP``: grid (column strips, hc) instead of (hc, column strips), so programs launched one after another
    read neighbouring strips of the same partial rows (DRAM page locality) rather than rows H floats apart.
    ``TAIL`` (> 0, the wrapper sets it only when ``ROWS < P <= ROWS + TAIL``): all P rows as one [ROWS, BLOCK_D]
    and one [TAIL, BLOCK_D] tile, both loads issued before any add: one DRAM round trip without padding the
    tile to the next power of two (P = 132: 128 + 4 rows, not 256)."""
    pdl_enter(PDL)
    if SWAP:
        h = tl.program_id(1).to(tl.int64)
        d = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    else:
        h = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < H
    if EARLY:  # the epilogue's four loads issued with the first partial rows: no extra DRAM round trip at the end
        wh_b, we_b, gwh, gwe = _epilogue_loads(wh_ptr, we_ptr, gwh_ptr, gwe_ptr, h, d, dmask, s_wh0, s_we0, s_gwh0,
                                               s_gwe0)
    r = tl.arange(0, ROWS).to(tl.int64)
    if TAIL > 0:
        # rows [0, ROWS) and [ROWS, P): both tiles in flight together; a fixed order (main tile's sum, then tail's)
        rt = ROWS + tl.arange(0, TAIL).to(tl.int64)
        main = tl.load(part_ptr + r[:, None] * s_p0 + h * s_p1 + d[None, :], mask=dmask[None, :], other=0.0)
        tail = tl.load(part_ptr + rt[:, None] * s_p0 + h * s_p1 + d[None, :],
                       mask=(rt < P)[:, None] & dmask[None, :], other=0.0)
        total = tl.sum(main, axis=0) + tl.sum(tail, axis=0)
    else:
        # ROWS partial rows in flight per step; a fixed summation order (deterministic for a given P)
        acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
        p0 = tl.program_id(0) * 0  # a run-time zero: the loop-carried value is a tensor from the start
        while p0 < P:  # a while loop: range() over run-time bounds breaks the interpreter with numpy 2.4
            p = p0 + r
            m = (p < P)[:, None] & dmask[None, :]
            acc += tl.load(part_ptr + p[:, None] * s_p0 + h * s_p1 + d[None, :], mask=m, other=0.0)
            p0 += ROWS
        total = tl.sum(acc, axis=0)
    if not EARLY:
        wh_b, we_b, gwh, gwe = _epilogue_loads(wh_ptr, we_ptr, gwh_ptr, gwe_ptr, h, d, dmask, s_wh0, s_we0, s_gwh0,
                                               s_gwe0)
    wh = bf16_bits_to_f32(wh_b)
    we = bf16_bits_to_f32(we_b)
    tl.store(gwh_ptr + h * s_gwh0 + d, gwh + total * we, mask=dmask)
    tl.store(gwe_ptr + h * s_gwe0 + d, gwe + total * wh, mask=dmask)


def _config(P: int, H: int):
    """(ROWS, BLOCK_D, num_warps, EARLY, SWAP, TAIL), through ``tuned("grad_w_reduce", ...)``: [ROWS, BLOCK_D]
    partial rows in flight per step, plus a [TAIL, BLOCK_D] tile issued with the first when ``ROWS < P <= ROWS +
    TAIL`` (see the kernel).  The summation order follows ROWS and TAIL (fixed for a given config and P).
    SWAP: the grid order.

    GPU: all P rows of a 32-column strip in flight at once (one DRAM round trip per program; the first
    version's [32, 128] steps made 5 dependent round trips at P = 132: 9.4 us CUPTI, L2 flushed).  EARLY: the
    weights and the gradients to accumulate into are loaded before the partial rows, not after their sum."""
    if interp():
        rows, block_d, warps = min(64, next_power_of_two(P)), min(2048, next_power_of_two(H)), 4
    else:
        # H200 sweep (2026-11-30, P=132, hc=4, H=7168, CUDA-graph us): [128, 32] x 4 warps 5.05, [256, 32] 5.34,
        # [32, 128] (the first version) 5.18
        rows, block_d, warps = min(128, next_power_of_two(P)), min(32, next_power_of_two(H)), 4
    # H200, 2026-11-30, commit 694bd6c (CUPTI, L2 flushed, P=132): the 4 rows past 128 as a tail tile issued with the
    # first, and the epilogue's loads first (EARLY): one DRAM round trip, 7.17 us against 8.02 us (TileKernels 6.94)
    tail = next_power_of_two(P - rows) if P > rows else 0
    cfg = tuned("grad_w_reduce", dict(ROWS=rows, BLOCK_D=block_d, num_warps=warps, EARLY=not interp(), SWAP=False,
                                      TAIL=tail))
    return (cfg["ROWS"], cfg["BLOCK_D"], cfg["num_warps"], bool(cfg["EARLY"]), bool(cfg["SWAP"]),
            int(cfg["TAIL"]))


def _recheck(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed) -> None:
    """Before every replay of a cached plan: the two accumulators are different tensors (the plan replays the
    overlap check itself)."""
    _check_distinct(grad_weight_hidden, grad_weight_embed)


@planned("grad_w_reduce", recheck=_recheck)
def grad_w_reduce(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    """Reduce ``grad_w_partial`` over its rows and accumulate the weight gradients in place.

    ``S = grad_w_partial.sum(0)`` (float32); ``grad_weight_hidden += S * weight_embed``;
    ``grad_weight_embed += S * weight_hidden``.

    Args:
        grad_w_partial: partial gradients of ``weight_fused``, shape (num_parts, hc_mult, hidden_size),
            float32, any num_parts >= 1 (TileKernels asks for a multiple of 4).
        weight_hidden: shape (hc_mult, hidden_size), bfloat16.
        weight_embed: shape (hc_mult, hidden_size), bfloat16.
        grad_weight_hidden: shape (hc_mult, hidden_size), float32, modified in place (accumulated).
        grad_weight_embed: shape (hc_mult, hidden_size), float32, modified in place (accumulated).

    All take any row strides with a unit stride along hidden_size.  Returns None.  Deterministic.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not _fast_ok(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed):
        check_tensor("grad_w_partial", grad_w_partial, dtypes=(torch.float32,), ndim=3)
        P, hc, H = grad_w_partial.shape
        check_rows("grad_w_partial", grad_w_partial, torch.float32, (P, hc, H))
        check_rows("weight_hidden", weight_hidden, torch.bfloat16, (hc, H))
        check_rows("weight_embed", weight_embed, torch.bfloat16, (hc, H))
        check_rows("grad_weight_hidden", grad_weight_hidden, torch.float32, (hc, H))
        check_rows("grad_weight_embed", grad_weight_embed, torch.float32, (hc, H))
        check_same_device(grad_w_partial=grad_w_partial, weight_hidden=weight_hidden, weight_embed=weight_embed,
                          grad_weight_hidden=grad_weight_hidden, grad_weight_embed=grad_weight_embed)
    if torch.compiler.is_compiling():  # traced as the opaque custom op ``torch.ops.tritile.engram_grad_w_reduce``
        _grad_w_reduce_op(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
        return None
    _check_outputs(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
    _launch(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
    return None


def _fast_ok(part, wh, we, gwh, gwe) -> bool:
    """The checks of ``grad_w_reduce`` hold: types, dtypes, shapes, unit last strides, one kernel device."""
    if not (isinstance(part, torch.Tensor) and part.dtype is torch.float32 and part.dim() == 3
            and isinstance(wh, torch.Tensor) and wh.dtype is torch.bfloat16
            and isinstance(we, torch.Tensor) and we.dtype is torch.bfloat16
            and isinstance(gwh, torch.Tensor) and gwh.dtype is torch.float32
            and isinstance(gwe, torch.Tensor) and gwe.dtype is torch.float32):
        return False
    shape = part.shape[1:]
    if not (wh.shape == shape and we.shape == shape and gwh.shape == shape and gwe.shape == shape):
        return False
    if shape[1] > 1 and not (part.stride(2) == 1 and wh.stride(1) == 1 and we.stride(1) == 1 and gwh.stride(1) == 1
                             and gwe.stride(1) == 1):
        return False
    dev = part.device
    return (wh.device == dev and we.device == dev and gwh.device == dev and gwe.device == dev
            and (dev.type == "cuda" or _rt.kernel_device_ok(dev)))


def _check_distinct(gwh, gwe) -> None:
    if gwh.numel() and gwh.data_ptr() == gwe.data_ptr():
        raise ValueError("grad_weight_hidden and grad_weight_embed must be different tensors, got the same memory")


def _check_outputs(part, wh, we, gwh, gwe) -> None:
    """The two accumulators are distinct tensors sharing no memory with each other or with an input."""
    _check_distinct(gwh, gwe)
    check_no_overlap(dict(grad_weight_hidden=gwh, grad_weight_embed=gwe),
                     dict(grad_w_partial=part, weight_hidden=wh, weight_embed=we))


def _launch(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed) -> None:
    P, hc, H = grad_w_partial.shape
    if hc == 0 or H == 0 or P == 0:  # nothing to add
        return
    grid, consts, num_warps = _plan(P, hc, H, override_key("grad_w_reduce"))
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (no keyword dicts)
    _grad_w_reduce_kernel.run(
        grad_w_partial, bits16(weight_hidden), bits16(weight_embed), grad_weight_hidden, grad_weight_embed,
        P, H, grad_w_partial.stride(0), grad_w_partial.stride(1), weight_hidden.stride(0), weight_embed.stride(0),
        grad_weight_hidden.stride(0), grad_weight_embed.stride(0), *consts, grid=grid, warmup=False,
        num_warps=num_warps, **pdl_args(grad_weight_hidden.device))


@functools.lru_cache(maxsize=64)
def _plan(P: int, hc: int, H: int, override) -> tuple:
    """(grid, (ROWS, BLOCK_D, EARLY, SWAP, TAIL), num_warps), cached (the host path is latency-bound);
    ``override``: ``override_key("grad_w_reduce")``, so tuning sweeps see their candidates."""
    rows, block_d, num_warps, early, swap, tail = _config(P, H)
    if not rows < P <= rows + tail:  # the one-shot tiles hold exactly rows + tail >= P rows (tail a power of 2)
        tail = 0
    grid = (ceil_div(H, block_d), hc) if swap else (hc, ceil_div(H, block_d))
    return grid, (rows, block_d, early, swap, tail), num_warps


@custom_op("engram_grad_w_reduce", mutates_args=("grad_weight_hidden", "grad_weight_embed"),
           fake=lambda *args: None)
def _grad_w_reduce_op(grad_w_partial: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                      grad_weight_hidden: torch.Tensor, grad_weight_embed: torch.Tensor) -> None:
    _check_outputs(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
    _launch(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
