"""``topk_sum_and_topk_group_idx``: the best groups by their top-1 / top-2 score sum
(``tile_kernels.moe.topk_sum_and_topk_group_idx``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import custom_op
from tritile.runtime import check_contiguous, check_device, check_tensor, empty, interpreter_configs
from tritile.utils import ceil_div, next_power_of_two

from tritile.language.sort_keys import KEY_TAKEN, f32_order_key, pack_key

from .common import group_scores_key, topk_group_rank
from tritile.runtime.plan import planned

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["topk_sum_and_topk_group_idx"]


@triton.jit
def _topk_sum_and_topk_group_idx_kernel(scores_ptr, out_ptr, num_tokens,
                                        NUM_GROUPS: tl.constexpr, EXPERTS_PER_GROUP: tl.constexpr,
                                        NUM_TOPK_SUM: tl.constexpr, NUM_TOPK_GROUPS: tl.constexpr,
                                        BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    row_ok = rows < num_tokens
    col = g[:, None] * EXPERTS_PER_GROUP + j[None, :]                       # [G, EG] expert index
    col_ok = (g[:, None] < NUM_GROUPS) & (j[None, :] < EXPERTS_PER_GROUP)
    x = tl.load(scores_ptr + rows[:, None, None] * (NUM_GROUPS * EXPERTS_PER_GROUP) + col[None, :, :],
                mask=row_ok[:, None, None] & col_ok[None, :, :], other=0.0)
    key = tl.where(col_ok[None, :, :], pack_key(f32_order_key(x), j[None, None, :]), KEY_TAKEN)
    gkey = group_scores_key(key, (g < NUM_GROUPS)[None, :], NUM_TOPK_SUM)   # [T, G]
    rank = topk_group_rank(gkey)
    # out[t, rank] = g for the NUM_TOPK_GROUPS best groups: every slot is written exactly once.
    ok = row_ok[:, None] & (g[None, :] < NUM_GROUPS) & (rank < NUM_TOPK_GROUPS)
    tl.store(out_ptr + rows[:, None] * NUM_TOPK_GROUPS + rank, tl.broadcast_to(g[None, :], rank.shape).to(tl.int64),
             mask=ok)


@functools.lru_cache(maxsize=None)
def _config(num_groups: int, per_group: int, interpret: bool):
    bg, beg = next_power_of_two(num_groups), next_power_of_two(per_group)
    if interpret:
        return max(1, 16384 // (bg * beg)), bg, beg, 1
    return max(1, min(8, 512 // (bg * beg))), bg, beg, 4


@planned("topk_sum_and_topk_group_idx")
@custom_op("moe_topk_sum_and_topk_group_idx", fake=lambda scores, num_topk_sum, num_topk_groups: scores.new_empty(
    (scores.shape[0], num_topk_groups), dtype=torch.int64))
def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """The ``num_topk_groups`` best expert groups of every token.

    A group's score is its largest expert score (``num_topk_sum == 1``) or the sum of its two
    largest, counting duplicates (``num_topk_sum == 2``).

    Args:
        scores: float32 ``(num_tokens, num_groups, num_experts_per_group)``, contiguous;
            ``num_groups <= 32``.
        num_topk_sum: 1 or 2, at most ``num_experts_per_group``.
        num_topk_groups: ``1 <= num_topk_groups <= num_groups``.

    Returns:
        int64 ``(num_tokens, num_topk_groups)``: group ids in rank order (best first; ties -> smaller
        group id), bitwise equal to ``tritile.torch.topk_sum_and_topk_group_idx``.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(scores, torch.Tensor) and scores.dtype is torch.float32 and scores.dim() == 3
            and scores.is_contiguous() and (scores.device.type == "cuda" or _rt.kernel_device_ok(scores.device))
            and type(num_topk_sum) is int and type(num_topk_groups) is int
            and (num_topk_sum == 1 or num_topk_sum == 2) and num_topk_sum <= scores.shape[2]
            and 1 <= num_topk_groups <= scores.shape[1] <= 32):
        _check(scores, num_topk_sum, num_topk_groups)
    num_tokens, num_groups, per_group = scores.shape
    out = empty((num_tokens, num_topk_groups), torch.int64, scores.device)
    if num_tokens == 0:
        return out
    grid, consts, warps = _plan(num_tokens, num_groups, per_group, num_topk_sum, num_topk_groups)
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (fewer dicts on the launch path)
    _topk_sum_and_topk_group_idx_kernel.run(scores, out, num_tokens, *consts, grid=grid, warmup=False,
                                            num_warps=warps, **pdl_args(out.device))
    return out


def _check(scores, num_topk_sum, num_topk_groups) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=3)
    check_contiguous("scores", scores)
    check_device("scores", scores)
    num_tokens, num_groups, per_group = scores.shape
    for name, v in (("num_topk_sum", num_topk_sum), ("num_topk_groups", num_topk_groups)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if num_topk_sum not in (1, 2) or num_topk_sum > per_group:
        raise ValueError(f"num_topk_sum must be 1 or 2 and at most num_experts_per_group={per_group}, "
                         f"got {num_topk_sum}")
    if not 1 <= num_groups <= 32:
        raise ValueError(f"scores must have 1 to 32 groups (dim 1), got {num_groups}")
    if not 1 <= num_topk_groups <= num_groups:
        raise ValueError(f"num_topk_groups must be in [1, num_groups={num_groups}], got {num_topk_groups}")


@functools.lru_cache(maxsize=256)
def _plan(num_tokens: int, num_groups: int, per_group: int, num_topk_sum: int, num_topk_groups: int) -> tuple:
    """(grid, the kernel's constexprs in signature order, num_warps); cached (the host path is latency-bound)."""
    block_t, bg, beg, warps = _config(num_groups, per_group, _INTERPRET)
    return ((ceil_div(num_tokens, block_t),),
            (num_groups, per_group, num_topk_sum, num_topk_groups, block_t, bg, beg), warps)
