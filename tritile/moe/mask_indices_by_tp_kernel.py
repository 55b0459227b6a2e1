"""``mask_indices_by_tp``: keep the experts of this TP rank, renumbered (``tile_kernels.moe.mask_indices_by_tp``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.config import get_num_sms
from tritile.runtime import custom_op
from tritile.runtime import (check_contiguous, check_device, check_tensor, checks_enabled, empty, interpreter_configs,
                             override_key, tuned)
from tritile.utils import ceil_div, next_power_of_two
from tritile.runtime.plan import planned

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["mask_indices_by_tp"]


@triton.jit
def _mask_indices_by_tp_kernel(idx_ptr, out_ptr, numel, per_rank, tp_rank, num_tp_ranks, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    g = tl.load(idx_ptr + offs, mask=m, other=-1)
    # int32 arithmetic (int64 division costs ~5x more on GPUs): exact for 0 <= g < 2**31, which covers
    # every valid id (n < 2**31); larger (invalid) entries become -1.
    valid = (g >= 0) & (g <= 0x7FFFFFFF)
    g = tl.where(valid, g, 0).to(tl.int32)  # divide non-negative values only (Triton's // truncates)
    q = g // per_rank
    keep = valid & (q % num_tp_ranks == tp_rank)
    res = tl.where(keep, (q // num_tp_ranks) * per_rank + g % per_rank, -1)
    tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=m)


def _as_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return v


@planned("mask_indices_by_tp")
@custom_op("moe_mask_indices_by_tp", fake=lambda indices, n, num_ep_ranks, tp_rank, num_tp_ranks: torch.empty_like(
    indices, memory_format=torch.contiguous_format))
def mask_indices_by_tp(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                       num_tp_ranks: int) -> torch.Tensor:
    """Keep only the experts owned by TP rank ``tp_rank`` and renumber them densely.

    With P = ``n // num_ep_ranks`` experts per GPU and R = ``num_tp_ranks``, an index g >= 0 on GPU
    ``g // P`` is kept when ``(g // P) % R == tp_rank`` and becomes ``(g // P // R) * P + g % P``
    (the kept GPUs' experts numbered contiguously in ``[0, n / R)``); every other entry becomes -1.

    Args:
        indices: int32 or int64 ``(num_tokens, num_topk)``, contiguous; -1 = no expert.  Entries are
            expected in ``[-1, n)`` (checked when ``TRITILE_CHECKS=1``); entries >= 2**31 give -1.
        n: total number of experts (all EP ranks), at least ``num_ep_ranks``.
        num_ep_ranks, num_tp_ranks: positive; ``0 <= tp_rank < num_tp_ranks``.

    Returns:
        a new tensor like ``indices`` (same dtype and shape).
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(indices, torch.Tensor) and (indices.dtype is torch.int64 or indices.dtype is torch.int32)
            and indices.dim() == 2 and indices.is_contiguous()
            and (indices.device.type == "cuda" or _rt.kernel_device_ok(indices.device))
            and type(n) is int and type(num_ep_ranks) is int and type(tp_rank) is int and type(num_tp_ranks) is int
            and 1 <= num_ep_ranks <= n < 2**31 and 0 <= tp_rank < num_tp_ranks):
        _check(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
    out = empty(indices.shape, indices.dtype, indices.device)
    numel = indices.numel()
    if numel == 0:
        return out
    if checks_enabled():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= n:
            raise ValueError(f"indices must lie in [-1, n={n}), got values in [{lo}, {hi}]")
    block, warps = _plan(numel, get_num_sms(), override_key("mask_indices_by_tp"))
    # ``.run`` is what ``kernel[grid](...)`` calls (one lambda and two keyword dicts fewer)
    _mask_indices_by_tp_kernel.run(indices, out, numel, n // num_ep_ranks, tp_rank, num_tp_ranks, block,
                                   grid=(ceil_div(numel, block),), warmup=False, num_warps=warps,
                                   **pdl_args(out.device))
    return out


def _config(numel: int, num_sms: int, interpret: bool) -> dict:
    """Default launch config (``tuned("mask_indices_by_tp", ...)``; keys ``BLOCK``, ``num_warps``): ``BLOCK``
    entries a program, ``next_pow2(T*K / (2 num_sms))`` clamped to [256, 1024], so that small inputs still
    spread over every SM, two programs each (more loads in flight), and large ones keep 8 entries a thread;
    4 warps from 512 entries, else 2.  The interpreter keeps 1024 (CPU tests still run several programs)."""
    if interpret:
        return dict(BLOCK=1024, num_warps=4)
    block = min(1024, max(256, next_power_of_two(ceil_div(numel, 2 * max(num_sms, 1)))))
    return dict(BLOCK=block, num_warps=4 if block >= 512 else 2)


@functools.lru_cache(maxsize=256)
def _plan(numel: int, num_sms: int, override) -> tuple:
    """(BLOCK, num_warps), cached (the host path is latency-bound); ``override``: ``override_key(...)``."""
    cfg = tuned("mask_indices_by_tp", _config(numel, num_sms, _INTERPRET))
    return next_power_of_two(cfg["BLOCK"]), cfg["num_warps"]


def _check(indices, n, num_ep_ranks, tp_rank, num_tp_ranks) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("indices", indices, dtypes=(torch.int64, torch.int32), ndim=2)
    check_contiguous("indices", indices)
    check_device("indices", indices)
    n = _as_int("n", n)
    if n >= 2**31:
        raise ValueError(f"n must be below 2**31, got {n}")
    num_ep_ranks = _as_int("num_ep_ranks", num_ep_ranks)
    tp_rank = _as_int("tp_rank", tp_rank)
    num_tp_ranks = _as_int("num_tp_ranks", num_tp_ranks)
    if num_ep_ranks < 1 or n < num_ep_ranks:
        raise ValueError(f"num_ep_ranks must be in [1, n={n}] (at least one expert per rank), got {num_ep_ranks}")
    if num_tp_ranks < 1:
        raise ValueError(f"num_tp_ranks must be positive, got {num_tp_ranks}")
    if not 0 <= tp_rank < num_tp_ranks:
        raise ValueError(f"tp_rank must be in [0, num_tp_ranks={num_tp_ranks}), got {tp_rank}")

