"""``inplace_unique_group_indices``: drop repeated group ids per row, in place
(``tile_kernels.moe.inplace_unique_group_indices``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import check_contiguous, check_device, check_tensor, interpreter_configs
from tritile.utils import ceil_div, next_power_of_two

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["inplace_unique_group_indices"]


@triton.jit
def _inplace_unique_group_indices_kernel(g_ptr, num_tokens, NUM_TOPK: tl.constexpr,
                                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_K)
    m = (rows < num_tokens)[:, None] & (cols[None, :] < NUM_TOPK)
    offs = rows[:, None] * NUM_TOPK + cols[None, :]
    g = tl.load(g_ptr + offs, mask=m, other=-1)
    # dup[t, j] = g[t, j] >= 0 and g[t, i] == g[t, j] for some i < j  (pairwise [T, i, j] compare)
    earlier = cols[:, None] < cols[None, :]
    same = (g[:, :, None] == g[:, None, :]) & earlier[None, :, :]
    dup = (tl.max(same.to(tl.int32), axis=1) > 0) & (g >= 0)
    tl.store(g_ptr + offs, tl.full([BLOCK_T, BLOCK_K], -1, tl.int64), mask=m & dup)  # write changed entries only


@functools.lru_cache(maxsize=None)
def _config(num_topk: int, interpret: bool):
    block_k = next_power_of_two(num_topk)
    if interpret:
        return max(16, 8192 // (block_k * block_k)), block_k
    return max(8, 2048 // (block_k * block_k)), block_k


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """Keep the first occurrence of every group id in each row; later repeats become -1, in place.

    Args:
        group_indices: int64 ``(num_tokens, num_topk)``, contiguous, modified in place.  Entries
            ``>= 0`` are deduplicated whatever their value; negative entries are never changed.
        num_groups: number of groups, ``1 <= num_groups <= 128`` (only checked, as TileKernels does).

    Returns:
        None.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(group_indices, torch.Tensor) and group_indices.dtype is torch.int64
            and group_indices.dim() == 2 and group_indices.is_contiguous()
            and (group_indices.device.type == "cuda" or _rt.kernel_device_ok(group_indices.device))
            and type(num_groups) is int and 1 <= num_groups <= 128):
        _check(group_indices, num_groups)
    num_tokens, num_topk = group_indices.shape
    if num_tokens == 0 or num_topk <= 1:
        return None
    grid, consts = _plan(num_tokens, num_topk)
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    _inplace_unique_group_indices_kernel.run(group_indices, num_tokens, *consts, grid=grid, warmup=False,
                                             num_warps=4, **pdl_args(group_indices.device))
    return None


def _check(group_indices, num_groups) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("group_indices", group_indices, dtypes=(torch.int64,), ndim=2)
    check_contiguous("group_indices", group_indices)
    check_device("group_indices", group_indices)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if not 1 <= num_groups <= 128:
        raise ValueError(f"num_groups must be in [1, 128], got {num_groups}")


@functools.lru_cache(maxsize=256)
def _plan(num_tokens: int, num_topk: int) -> tuple:
    """(grid, the kernel's constexprs in signature order); cached (the host path is latency-bound)."""
    block_t, block_k = _config(num_topk, _INTERPRET)
    return (ceil_div(num_tokens, block_t),), (num_topk, block_t, block_k)
