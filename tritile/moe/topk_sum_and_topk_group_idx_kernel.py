"""``topk_sum_and_topk_group_idx``: the best groups by their top-1 / top-2 score sum
(``tile_kernels.moe.topk_sum_and_topk_group_idx``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile.runtime import check_contiguous, check_device, check_tensor, empty, interpreter_configs
from tritile.utils import ceil_div, next_power_of_two

from .common import KEY_TAKEN, f32_order_key, group_scores_key, pack_key, topk_group_rank

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["topk_sum_and_topk_group_idx"]


@triton.jit
def _topk_sum_and_topk_group_idx_kernel(scores_ptr, out_ptr, num_tokens,
                                        NUM_GROUPS: tl.constexpr, EXPERTS_PER_GROUP: tl.constexpr,
                                        NUM_TOPK_SUM: tl.constexpr, NUM_TOPK_GROUPS: tl.constexpr,
                                        BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr):
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
    out = empty((num_tokens, num_topk_groups), torch.int64, scores.device)
    if num_tokens == 0:
        return out
    block_t, bg, beg, warps = _config(num_groups, per_group, _INTERPRET)
    _topk_sum_and_topk_group_idx_kernel[(ceil_div(num_tokens, block_t),)](
        scores, out, num_tokens, NUM_GROUPS=num_groups, EXPERTS_PER_GROUP=per_group, NUM_TOPK_SUM=num_topk_sum,
        NUM_TOPK_GROUPS=num_topk_groups, BLOCK_T=block_t, BLOCK_G=bg, BLOCK_EG=beg, num_warps=warps)
    return out
