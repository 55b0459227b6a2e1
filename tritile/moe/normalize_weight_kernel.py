"""``normalize_weight``: divide top-k weights by their sequential sum (``tile_kernels.moe.normalize_weight``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritile.runtime import check_contiguous, check_device, check_tensor, empty, interpreter_configs
from tritile.utils import next_power_of_two

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["normalize_weight"]


@triton.jit
def _normalize_weight_kernel(w_ptr, denom_ptr, out_ptr, num_tokens,
                             NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    m = row_ok[:, None] & (cols[None, :] < NUM_TOPK)
    offs = rows[:, None] * NUM_TOPK + cols[None, :]
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    # Strictly sequential float32 sum, left to right (tl.sum's tree order is unspecified).  Each
    # column is extracted exactly: a sum of one value and zeros (the running sum is never -0.0).
    denom = tl.full([BLOCK_T], 1e-20, tl.float32)
    for k in tl.static_range(NUM_TOPK):
        denom = denom + tl.sum(tl.where(cols[None, :] == k, w, 0.0), axis=1)
    tl.store(denom_ptr + rows, denom, mask=row_ok)
    tl.store(out_ptr + offs, tl.math.div_rn(w, denom[:, None]), mask=m)


@functools.lru_cache(maxsize=None)
def _config(num_topk: int, interpret: bool):
    block_k = next_power_of_two(num_topk)
    if interpret:
        return max(16, 1024 // block_k), block_k, 1
    return max(16, 1024 // block_k), block_k, 4


def normalize_weight(topk_weights: torch.Tensor):
    """Normalise every token's top-k weights by their sum.

    Args:
        topk_weights: float32 ``(num_tokens, num_topk)``, contiguous.

    Returns:
        ``(denominator, normalized_weights)``: float32 ``(num_tokens,)`` with
        ``((1e-20 + w[t,0]) + w[t,1]) + ... + w[t,K-1]`` summed left to right in float32, and float32
        ``(num_tokens, num_topk)`` with ``w / denominator`` (IEEE round-to-nearest division).  Bitwise
        equal to ``tritile.torch.normalize_weight`` on every backend.
    """
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
    check_contiguous("topk_weights", topk_weights)
    check_device("topk_weights", topk_weights)
    num_tokens, num_topk = topk_weights.shape
    dev = topk_weights.device
    denom = empty((num_tokens,), torch.float32, dev)
    out = empty((num_tokens, num_topk), torch.float32, dev)
    if num_tokens == 0 or num_topk == 0:
        if num_topk == 0 and num_tokens:
            denom.fill_(1e-20)
        return denom, out
    block_t, block_k, warps = _config(num_topk, _INTERPRET)
    _normalize_weight_kernel[(triton.cdiv(num_tokens, block_t),)](
        topk_weights, denom, out, num_tokens,
        NUM_TOPK=num_topk, BLOCK_T=block_t, BLOCK_K=block_k, num_warps=warps)
    return denom, out
