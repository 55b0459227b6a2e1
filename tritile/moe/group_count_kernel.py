"""``group_count``: tokens per group (``tile_kernels.moe.group_count``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile.config import get_num_sms
from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import custom_op
from tritile.runtime import (check_contiguous, check_device, check_int, check_tensor, checks_enabled, empty,
                             interpreter_configs, override_key, tuned, zeroed_workspace)
from tritile.utils import ceil_div, next_power_of_two
from tritile.runtime.plan import planned

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
def arrive_counts(ws_ptr, hist, num_bins, num_programs, BINS: tl.constexpr):
    """Add this program's histogram into ``ws`` (int64 ``[num_bins]``, zero before the launch: word b accumulates
    ``arrivals << 32 | count_b``): every program adds ``1 << 32 | its count`` to every bin's word in one relaxed
    atomic and gets the old word back.  -> ``(last, counts)``: ``last`` marks the bins whose add completed the
    arrivals (``num_programs``), where ``counts`` (int32) is the final count; the arriving program stores 0 back
    there, so ``ws`` ends zeroed (``tritile.runtime.zeroed_workspace``'s contract).  No ticket, no fence: every
    other add to that word came before in its modification order."""
    bins = tl.arange(0, BINS)
    in_range = bins < num_bins
    add = hist.to(tl.int64) + 4294967296  # (1 << 32) | count
    new = tl.atomic_add(ws_ptr + bins, add, mask=in_range, sem="relaxed") + add
    last = in_range & ((new >> 32) == num_programs)
    tl.store(ws_ptr + bins, tl.zeros([BINS], tl.int64), mask=last)
    return last, (new & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _group_count_kernel(idx_ptr, out_ptr, ws_ptr, numel, num_groups, num_programs, BLOCK: tl.constexpr,
                        BINS: tl.constexpr, SINGLE: tl.constexpr = False, PDL: tl.constexpr = False):
    """``SINGLE``: one program counts everything (``BLOCK >= numel``) and stores the histogram (one launch).
    Otherwise every program adds its chunks' histogram into the zeroed workspace ``ws`` (``arrive_counts``:
    integer atomics, so the sum depends neither on the order nor on the grid size); the program whose add completes
    a bin stores its count and zeroes the word again (no fill launch before)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    hist = count_chunks(idx_ptr, numel, num_groups, pid, num_programs, BLOCK, BINS)
    bins = tl.arange(0, BINS)
    if SINGLE:
        tl.store(out_ptr + bins, hist, mask=bins < num_groups)
    else:
        last, counts = arrive_counts(ws_ptr, hist, num_groups, num_programs, BINS)
        tl.store(out_ptr + bins, counts, mask=last)


def single_config(numel: int, interpret: bool) -> dict:
    """Default of the one-program path shared by ``group_count`` and ``aux_fi``: ``T*K <= SINGLE_MAX`` is counted
    by one program of ``SINGLE_WARPS`` warps holding every entry at once (at least 2 a thread), which stores the
    result itself (no atomics, no workspace).
    Tuning keys ``SINGLE_MAX`` (0: off) and ``SINGLE_WARPS``."""
    # H200 (2026-12-02, CUPTI, K = 2, E = 9, when the grid still took a 0.8 us zero-fill launch before it): the one
    # program wins up to 2048 entries (group_count 1.83 us on 32 warps against 2.24 on the grid; aux_fi 2.13 against
    # 2.68) and loses from 4096 (2.62 against 2.35; at 16074 entries 6.16 against 2.51): one SM's histogram
    # throughput, not the loads, bounds it.  More warps are better up to 2 entries a thread (2048 entries: 32 warps
    # 1.83, 16 1.84, 8 1.92, 4 about 2.2).  Without the fill (commit f3eaa87, random ids): 1024 entries, one program
    # 1.53 us against 1.84 on the grid (aux_fi 1.77 / 2.05); 2048 1.85-1.88 against 1.82-1.90 (a tie); 4096 1.89
    # against 1.94, so the threshold stays.
    if interpret:
        return dict(SINGLE_MAX=256, SINGLE_WARPS=4)
    return dict(SINGLE_MAX=2048, SINGLE_WARPS=max(4, min(32, next_power_of_two(ceil_div(numel, 64)))))


@functools.lru_cache(maxsize=None)
def grid_config(numel: int, num_bins: int, num_sms: int, interpret: bool):
    """(BLOCK, BINS, num_programs) for a persistent counting pass; the counts never depend on it."""
    bins = max(16, next_power_of_two(num_bins))
    if interpret:
        block = 2048  # small enough that CPU tests see several programs
    else:
        # about two programs per SM, 512 to 4096 entries each (H200, 2026-12-02, 16074 entries: 512-entry chunks
        # 2.51 us against 3.09 with 1024; 8192 entries: 2.52 against 2.60)
        block = max(512, min(4096, next_power_of_two(ceil_div(numel, 2 * num_sms))))
    programs = max(1, min(2 * num_sms, ceil_div(numel, block)))
    return block, bins, programs


def check_index_range(name: str, t: torch.Tensor, hi: int, hi_name: str) -> None:
    """Under ``TRITILE_CHECKS=1``: entries of ``t`` lie in ``[-1, hi)`` (syncs the host)."""
    if t.numel() > 0 and checks_enabled():
        lo, top = int(t.min()), int(t.max())
        if lo < -1 or top >= hi:
            raise ValueError(f"{name} entries must lie in [-1, {hi_name}={hi}), got values in [{lo}, {top}]")


@planned("group_count")
@custom_op("moe_group_count", fake=lambda group_idx, num_groups: group_idx.new_empty((num_groups,),
                                                                                     dtype=torch.int32))
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
    numel = group_idx.numel()
    if numel == 0:
        return torch.zeros(num_groups, dtype=torch.int32, device=group_idx.device)
    check_index_range("group_idx", group_idx, num_groups, "num_groups")
    single, programs, block, bins, warps = _plan(numel, num_groups, get_num_sms(), override_key("group_count"))
    out = empty((num_groups,), torch.int32, group_idx.device)
    # the grid accumulates in a workspace that it leaves zeroed (one launch, no fill)
    ws = out if single else zeroed_workspace("moe_count", num_groups, torch.int64, group_idx.device)
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    _group_count_kernel.run(group_idx, out, ws, numel, num_groups, programs, block, bins, single, grid=(programs,),
                            warmup=False, num_warps=warps, **pdl_args(out.device))
    return out


def _config(numel: int, num_groups: int, num_sms: int, interpret: bool) -> dict:
    """Default launch config (``tuned("group_count", ...)``; the counts never depend on it): the one-program path
    up to ``SINGLE_MAX`` entries (``single_config``), else ``grid_config``'s persistent grid of ``BLOCK``-entry
    chunks with ``num_warps``."""
    block, _, programs = grid_config(max(numel, 1), num_groups, num_sms, interpret)
    return dict(single_config(numel, interpret), BLOCK=block, num_warps=4)


@functools.lru_cache(maxsize=256)
def _plan(numel: int, num_groups: int, num_sms: int, override) -> tuple:
    """(single, programs, BLOCK, BINS, num_warps); cached (the host path is latency-bound).  ``override``:
    ``override_key("group_count")``, so tuning sweeps see their candidates."""
    return count_plan(tuned("group_count", _config(numel, num_groups, num_sms, _INTERPRET)), numel, num_groups,
                      num_sms)


def count_plan(cfg: dict, numel: int, num_bins: int, num_sms: int, programs_per_sm: int = 2) -> tuple:
    """(single, programs, BLOCK, BINS, num_warps) of a counting launch (``group_count``, ``aux_fi``) from its
    config: the one-program path up to ``SINGLE_MAX`` entries, else at most ``programs_per_sm`` programs per SM."""
    bins = max(16, next_power_of_two(num_bins))
    if numel <= cfg["SINGLE_MAX"]:
        return True, 1, max(16, next_power_of_two(numel)), bins, cfg["SINGLE_WARPS"]
    block = cfg["BLOCK"]
    programs = max(1, min(programs_per_sm * num_sms, ceil_div(max(numel, 1), block)))
    return False, programs, block, bins, cfg["num_warps"]


def _check(group_idx, num_groups) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("group_idx", group_idx, dtypes=(torch.int64,), ndim=2)
    check_contiguous("group_idx", group_idx)
    check_device("group_idx", group_idx)
    check_int("num_groups", num_groups, 1)
