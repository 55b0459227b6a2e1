"""``group_count``: tokens per group (``tile_kernels.moe.group_count``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile.config import get_num_sms
from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import check_contiguous, check_device, check_tensor, checks_enabled, interpreter_configs
from tritile.utils import ceil_div, next_power_of_two

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["group_count"]


@triton.jit
def count_chunks(idx_ptr, numel, num_bins, pid, num_programs,
                 BLOCK: tl.constexpr, BINS: tl.constexpr):
    """int32 histogram ``[BINS]`` of the entries in ``[0, num_bins)`` of this program's chunks
    (chunks ``pid, pid + num_programs, ...`` of ``BLOCK`` flat elements)."""
    hist = tl.zeros([BINS], tl.int32)
    num_chunks = (numel + BLOCK - 1) // BLOCK
    c = pid
    while c < num_chunks:  # a while loop: range() over run-time bounds breaks the interpreter (numpy 2.4)
        offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(idx_ptr + offs, mask=offs < numel, other=-1)
        ok = (v >= 0) & (v < num_bins)
        hist += tl.histogram(tl.where(ok, v, 0).to(tl.int32), BINS, mask=ok)
        c += num_programs
    return hist


@triton.jit
def _group_count_kernel(idx_ptr, out_ptr, numel, num_groups, num_programs, BLOCK: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    hist = count_chunks(idx_ptr, numel, num_groups, pid, num_programs, BLOCK, BINS)
    bins = tl.arange(0, BINS)
    # Integer atomics: the sum does not depend on the order (nor on the grid size).
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_groups) & (hist != 0), sem="relaxed")


@functools.lru_cache(maxsize=None)
def grid_config(numel: int, num_bins: int, num_sms: int, interpret: bool):
    """(BLOCK, BINS, num_programs) for a persistent counting pass; the counts never depend on it."""
    bins = max(16, next_power_of_two(num_bins))
    if interpret:
        block = 2048  # small enough that CPU tests see several programs
    else:
        block = max(1024, min(4096, next_power_of_two(ceil_div(numel, 2 * num_sms))))
    programs = max(1, min(2 * num_sms, ceil_div(numel, block)))
    return block, bins, programs


def check_index_range(name: str, t: torch.Tensor, hi: int, hi_name: str) -> None:
    """Under ``TRITILE_CHECKS=1``: entries of ``t`` lie in ``[-1, hi)`` (syncs the host)."""
    if t.numel() > 0 and checks_enabled():
        lo, top = int(t.min()), int(t.max())
        if lo < -1 or top >= hi:
            raise ValueError(f"{name} entries must lie in [-1, {hi_name}={hi}), got values in [{lo}, {top}]")


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Number of entries equal to each group id.

    Args:
        group_idx: int64 ``(num_tokens, num_topk)``, contiguous; entries in ``[-1, num_groups)``, -1 is
            skipped (entries outside are ignored; ``TRITILE_CHECKS=1`` raises on them instead).
        num_groups: ``G >= 1``.

    Returns:
        int32 ``(num_groups,)``: the histogram (zeros for 0 tokens).  Exact and independent of
        ``set_num_sms``.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(group_idx, torch.Tensor) and group_idx.dtype is torch.int64 and group_idx.dim() == 2
            and group_idx.is_contiguous()
            and (group_idx.device.type == "cuda" or _rt.kernel_device_ok(group_idx.device))
            and type(num_groups) is int and num_groups >= 1):
        _check(group_idx, num_groups)
    out = torch.zeros(num_groups, dtype=torch.int32, device=group_idx.device)  # the atomic accumulator
    numel = group_idx.numel()
    if numel == 0:
        return out
    check_index_range("group_idx", group_idx, num_groups, "num_groups")
    block, bins, programs = grid_config(numel, num_groups, get_num_sms(), _INTERPRET)
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    _group_count_kernel.run(group_idx, out, numel, num_groups, programs, block, bins, grid=(programs,), warmup=False,
                            num_warps=4, **pdl_args(out.device))
    return out


def _check(group_idx, num_groups) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("group_idx", group_idx, dtypes=(torch.int64,), ndim=2)
    check_contiguous("group_idx", group_idx)
    check_device("group_idx", group_idx)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
