"""``aux_fi``: per-expert load fraction for the auxiliary balance loss (``tile_kernels.moe.aux_fi``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile.config import get_num_sms
from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import custom_op
from tritile.runtime import (check_contiguous, check_device, check_int, check_tensor, empty, interpreter_configs,
                             override_key, tuned, zeroed_workspace)
from tritile.utils import ceil_div, next_power_of_two

from .group_count_kernel import (arrive_counts, check_index_range, count_chunks, count_plan, grid_config,
                                 single_config)
from ..runtime.plan import planned

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["aux_fi"]


@triton.jit
def _aux_fi_single_kernel(idx_ptr, out_ptr, numel, num_experts, scale_num, denom, BLOCK: tl.constexpr,
                          BINS: tl.constexpr, PDL: tl.constexpr = False):
    """One program (``BLOCK >= numel``): count, then f = float(count * E) / float(T * aux) (IEEE); no workspace."""
    pdl_enter(PDL)
    counts = count_chunks(idx_ptr, numel, num_experts, 0, 1, BLOCK, BINS)
    bins = tl.arange(0, BINS)
    f = tl.math.div_rn((counts * scale_num).to(tl.float32), tl.full([BINS], denom, tl.float32))
    tl.store(out_ptr + bins, f, mask=bins < num_experts)


@triton.jit
def _aux_fi_kernel(idx_ptr, ws_ptr, out_ptr, numel, num_experts, scale_num, denom, nprog,
                   BLOCK: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr = False):
    """``ws`` = int64 ``[num_experts]`` zeros, left zeroed (``arrive_counts``: every program adds its counts in one
    relaxed atomic round trip); the program whose add completes an expert's arrivals holds the final count and
    writes f = float(count * E) / float(T * aux) (IEEE)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    hist = count_chunks(idx_ptr, numel, num_experts, pid, nprog, BLOCK, BINS)
    bins = tl.arange(0, BINS)
    last, counts = arrive_counts(ws_ptr, hist, num_experts, nprog, BINS)
    f = tl.math.div_rn((counts * scale_num).to(tl.float32), tl.full([BINS], denom, tl.float32))
    tl.store(out_ptr + bins, f, mask=last)


def _config(numel: int, num_experts: int, num_sms: int, interpret: bool) -> dict:
    """Default launch config: ``group_count``'s persistent counting grid (``BLOCK`` flat entries per chunk,
    at most ``PROGRAMS_PER_SM * num_sms`` programs) and ``num_warps``.  Launch configs go through
    ``tritile.runtime.tuned("aux_fi", ...)``; the result never depends on them."""
    block, _, programs = grid_config(max(numel, 1), num_experts, num_sms, interpret)
    return dict(single_config(numel, interpret), BLOCK=block,
                PROGRAMS_PER_SM=max(1, -(-programs // max(num_sms, 1))), num_warps=4)


@planned("aux_fi")
@custom_op("moe_aux_fi", fake=lambda topk_idx, num_experts, num_aux_topk: topk_idx.new_empty(
    (num_experts,), dtype=torch.float32))
def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """Fraction of routed slots per expert, scaled for the auxiliary loss.

    ``f[e] = count_e * num_experts / (num_tokens * num_aux_topk)`` where ``count_e`` counts the
    entries equal to e and ``num_tokens`` counts every row (also rows whose slots are all -1).

    Args:
        topk_idx: int64 ``(num_tokens, num_topk)``, contiguous; entries in ``[-1, num_experts)``, -1 is
            skipped (entries outside are ignored; ``TRITILE_CHECKS=1`` raises on them instead).
        num_experts: ``E >= 1``.
        num_aux_topk: ``>= 1``.

    Returns:
        float32 ``(num_experts,)``; zeros for 0 tokens.  Counted exactly in int32 and divided once
        (IEEE), so the result is deterministic and independent of ``set_num_sms`` (TileKernels adds
        per-block fractions with float atomics).  Exact while ``count * E`` and
        ``num_tokens * num_aux_topk`` stay below 2**24.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(topk_idx, torch.Tensor) and topk_idx.dtype is torch.int64 and topk_idx.dim() == 2
            and topk_idx.is_contiguous() and (topk_idx.device.type == "cuda" or _rt.kernel_device_ok(topk_idx.device))
            and type(num_experts) is int and type(num_aux_topk) is int and num_experts >= 1 and num_aux_topk >= 1):
        _check(topk_idx, num_experts, num_aux_topk)
    dev = topk_idx.device
    num_tokens = topk_idx.size(0)
    numel = topk_idx.numel()
    if num_tokens == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=dev)
    check_index_range("topk_idx", topk_idx, num_experts, "num_experts")
    out = empty((num_experts,), torch.float32, dev)
    single, programs, block, bins, warps = _plan(numel, num_experts, get_num_sms(), override_key("aux_fi"))
    denom = float(num_tokens * num_aux_topk)
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    if single:  # one program, one launch (no zero-filled workspace)
        _aux_fi_single_kernel.run(topk_idx, out, numel, num_experts, num_experts, denom, block, bins, grid=(1,),
                                  warmup=False, num_warps=warps, **pdl_args(dev))
        return out
    ws = zeroed_workspace("moe_count", num_experts, torch.int64, dev)  # left zeroed by the kernel: no fill launch
    _aux_fi_kernel.run(topk_idx, ws, out, numel, num_experts, num_experts, denom, programs,
                       block, bins, grid=(programs,), warmup=False, num_warps=warps, **pdl_args(out.device))
    return out


def _check(topk_idx, num_experts, num_aux_topk) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    check_contiguous("topk_idx", topk_idx)
    check_device("topk_idx", topk_idx)
    check_int("num_experts", num_experts, 1)
    check_int("num_aux_topk", num_aux_topk, 1)


@functools.lru_cache(maxsize=256)
def _plan(numel: int, num_experts: int, num_sms: int, override) -> tuple:
    """(single, programs, BLOCK, BINS, num_warps); cached (the host path is latency-bound).  ``override``:
    ``override_key("aux_fi")``, so tuning sweeps see their candidates."""
    cfg = tuned("aux_fi", _config(numel, num_experts, num_sms, _INTERPRET))
    return count_plan(cfg, numel, num_experts, num_sms, cfg["PROGRAMS_PER_SM"])
