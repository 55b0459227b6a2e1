"""``inplace_unique_group_indices``: drop repeated group ids per row, in place
(``tile_kernels.moe.inplace_unique_group_indices``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.config import get_num_sms
from tritile.runtime import custom_op
from tritile.runtime import check_contiguous, check_device, check_tensor, interpreter_configs, override_key, tuned
from tritile.utils import ceil_div, next_power_of_two
from tritile.runtime.plan import planned

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


@triton.jit
def _inplace_unique_rows_kernel(g_ptr, num_tokens, NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                                PDL: tl.constexpr = False):
    """One row per thread: the K columns as K ``[BLOCK_T]`` vectors (all loads in flight at once), each compared
    with the earlier ones in registers (K (K-1) / 2 compares, no cross-lane traffic); only the repeats are stored."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = rows < num_tokens
    base = g_ptr + rows * NUM_TOPK
    cols = (tl.load(base, mask=m, other=-1),)  # a tuple (a list does not compile for the GPU)
    for k in tl.static_range(1, NUM_TOPK):
        cols = cols + (tl.load(base + k, mask=m, other=-1),)
    for j in tl.static_range(1, NUM_TOPK):
        dup = cols[0] == cols[j]
        for i in tl.static_range(1, j):
            dup = dup | (cols[i] == cols[j])
        tl.store(base + j, tl.full([BLOCK_T], -1, tl.int64), mask=m & dup & (cols[j] >= 0))


@triton.jit
def _inplace_unique_loop_kernel(g_ptr, num_tokens, NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                                PDL: tl.constexpr = False):
    """Wide rows (any K): one row per thread, column j compared with the K columns before it in a loop (loads
    from L1; no K^2 registers).  A repeat already replaced by -1 is still covered by its first occurrence."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = rows < num_tokens
    base = g_ptr + rows * NUM_TOPK
    for j in range(1, NUM_TOPK):
        gj = tl.load(base + j, mask=m, other=-1)
        dup = tl.zeros([BLOCK_T], tl.int32)
        for i in range(0, NUM_TOPK - 1):  # constexpr bounds (the interpreter cannot loop to j); i < j below
            gi = tl.load(base + i, mask=m & (i < j), other=-1)
            dup = dup | ((gi == gj) & (i < j)).to(tl.int32)
        tl.store(base + j, tl.full([BLOCK_T], -1, tl.int64), mask=m & (dup != 0) & (gj >= 0))


#: Largest ``num_topk`` (rows wider than 32 take the loop design on the GPU: K^2 / 2 loads a row).
MAX_TOPK = 256
#: Largest ``num_topk`` of the row-per-thread design (its compares are unrolled: K (K-1) / 2 of them).
ROWS_MAX_TOPK = 16


def _config(num_tokens: int, num_topk: int, num_sms: int, interpret: bool) -> dict:
    """Default launch config (``tuned("inplace_unique_group_indices", ...)``; keys ``ROWS``, ``LOOP``,
    ``BLOCK_T``, ``num_warps``).  ``ROWS`` (2 < K <= 16 on the GPU): one row per thread, ``BLOCK_T`` rows a
    program, sized for at least one program per SM (``BLOCK_T = clamp(next_pow2(T / num_sms), 32, 128)``, a warp
    per 32 rows).  ``LOOP`` (K > 32 on the GPU): the same rows, compared in loops.  Otherwise
    ``[BLOCK_T, next_pow2(K)]`` tiles with a pairwise ``[BLOCK_T, BK, BK]`` comparison (2048 pairs a program).
    The result never depends on it."""
    block_k = next_power_of_two(num_topk)
    if interpret:
        return dict(ROWS=num_topk <= 8, BLOCK_T=max(16, 8192 // (block_k * block_k)) if num_topk > 8 else 64,
                    num_warps=4)
    block_t = min(128, max(32, next_power_of_two(ceil_div(num_tokens, max(num_sms, 1)))))
    if 2 < num_topk <= ROWS_MAX_TOPK:
        return dict(ROWS=True, BLOCK_T=block_t, num_warps=block_t // 32)
    if num_topk > 32:  # the tile's [BLOCK_T, BK, BK] comparison would not fit in registers
        return dict(ROWS=False, LOOP=True, BLOCK_T=block_t, num_warps=block_t // 32)
    return dict(ROWS=False, BLOCK_T=max(8, 2048 // (block_k * block_k)), num_warps=4)


@planned("inplace_unique_group_indices")
@custom_op("moe_inplace_unique_group_indices", mutates_args=("group_indices",),
           fake=lambda group_indices, num_groups: None)
def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """Keep the first occurrence of every group id in each row; later repeats become -1, in place.

    Args:
        group_indices: int64 ``(num_tokens, num_topk)``, contiguous, modified in place; ``num_topk <= 256``
            (``ValueError`` above: the pairwise comparison grows with its square).  Entries ``>= 0`` are
            deduplicated whatever their value; negative entries are never changed.
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
    if num_topk > MAX_TOPK:
        raise ValueError(f"group_indices must have at most {MAX_TOPK} columns (num_topk), got {num_topk}")
    kernel, grid, consts, warps = _plan(num_tokens, num_topk, get_num_sms(),
                                        override_key("inplace_unique_group_indices"))
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    kernel.run(group_indices, num_tokens, *consts, grid=grid, warmup=False, num_warps=warps,
               **pdl_args(group_indices.device))
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
def _plan(num_tokens: int, num_topk: int, num_sms: int, override) -> tuple:
    """(kernel, grid, the kernel's constexprs in signature order, num_warps); cached (the host path is
    latency-bound).  ``override``: ``override_key(...)``, so tuning sweeps see their candidates."""
    cfg = tuned("inplace_unique_group_indices", _config(num_tokens, num_topk, num_sms, _INTERPRET))
    block_t = next_power_of_two(cfg["BLOCK_T"])
    grid = (ceil_div(num_tokens, block_t),)
    if cfg.get("LOOP", False):
        return _inplace_unique_loop_kernel, grid, (num_topk, block_t), cfg["num_warps"]
    if cfg["ROWS"] and num_topk <= ROWS_MAX_TOPK:
        return _inplace_unique_rows_kernel, grid, (num_topk, block_t), cfg["num_warps"]
    return (_inplace_unique_group_indices_kernel, grid, (num_topk, block_t, next_power_of_two(num_topk)),
            cfg["num_warps"])
