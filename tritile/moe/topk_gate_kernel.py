"""``topk_gate``: stable top-k expert indices of a score matrix (``tile_kernels.moe.topk_gate``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile.runtime import check_contiguous, check_device, check_tensor, empty, interpreter_configs
from tritile.utils import next_power_of_two

from .common import KEY_TAKEN, f32_order_key, key_index, pack_key

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["topk_gate"]


@triton.jit
def _topk_gate_kernel(scores_ptr, out_ptr, num_tokens, stride_s,
                      NUM_EXPERTS: tl.constexpr, NUM_TOPK: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < NUM_EXPERTS
    x = tl.load(scores_ptr + rows[:, None] * stride_s + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    key = tl.where(col_ok[None, :], pack_key(f32_order_key(x), cols[None, :]), KEY_TAKEN)
    out_row = out_ptr + rows * NUM_TOPK
    for k in tl.static_range(NUM_TOPK):
        best = tl.max(key, axis=1)
        tl.store(out_row + k, key_index(best).to(tl.int64), mask=row_ok)
        key = tl.where(key == best[:, None], KEY_TAKEN, key)


@functools.lru_cache(maxsize=None)
def _config(num_experts: int, interpret: bool):
    block_e = next_power_of_two(num_experts)
    if interpret:
        return max(1, 16384 // block_e), block_e, 1
    # A [rows, E] tile of about 1024 scores per program (one warp per 256 scores, as TileKernels'
    # warp per token at E = 256).
    block_t = max(1, min(8, 1024 // block_e))
    return block_t, block_e, max(1, min(8, (block_t * block_e) // 256))


def _launch(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    num_tokens, num_experts = scores.shape
    out = empty((num_tokens, num_topk), torch.int64, scores.device)
    if num_tokens == 0:
        return out
    block_t, block_e, warps = _config(num_experts, _INTERPRET)
    _topk_gate_kernel[(triton.cdiv(num_tokens, block_t),)](
        scores, out, num_tokens, scores.stride(0),
        NUM_EXPERTS=num_experts, NUM_TOPK=num_topk, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps)
    return out


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
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=2)
    check_contiguous("scores", scores)
    check_device("scores", scores)
    num_experts = scores.shape[1]
    if isinstance(num_topk, bool) or not isinstance(num_topk, int):
        raise TypeError(f"num_topk must be an int, got {type(num_topk).__name__}")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    return _launch(scores, num_topk)
