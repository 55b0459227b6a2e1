"""``@triton.jit`` helpers shared by the MoE gating kernels.

* The order-preserving sort keys of the top-k kernels live in :mod:`tritile.language.sort_keys`.
* ``sigmoid_f32`` / ``softplus_f32``: the gate's activations, computed the way the references in
  ``tritile.torch.topk`` compute them on each backend (libdevice on GPUs, numpy float32 under the
  interpreter), with IEEE division.
* ``group_scores_key`` / ``topk_group_rank``: group-limited routing (top-1 or top-2 sum per group,
  rank with ties to the smaller group index).
* GPU note: Triton compiles libdevice with FTZ (``enable_reflect_ftz``), so exp/log1p results in the
  float32 subnormal range flush to zero; torch CUDA keeps them.  Irrelevant for finite gate logits
  above -87.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritile.language import exp_f32
from tritile.language.cast import INTERPRET
from tritile.language.sort_keys import KEY_TAKEN, f32_order_key, key_value, pack_key

if not bool(INTERPRET):
    from triton.language.extra import libdevice as _libdevice
else:  # the interpreter has no libdevice
    _libdevice = None

@triton.jit
def log1p_f32(y):
    """log(1 + y): libdevice ``log1pf`` on GPUs; under the interpreter (no log1p there) the
    compensated ``log(u) * (y / (u - 1))`` with u = 1 + y, exactly as ``tritile.torch.topk`` computes it."""
    if INTERPRET:
        u = 1.0 + y
        return tl.where(u == 1.0, y, tl.log(u) * tl.math.div_rn(y, u - 1.0))
    else:
        return _libdevice.log1p(y)


@triton.jit
def softplus_f32(x):
    """torch's softplus (beta 1, threshold 20): x for x > 20, else log1p(exp(x))."""
    return tl.where(x > 20.0, x, log1p_f32(exp_f32(tl.minimum(x, 20.0))))


@triton.jit
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) with an IEEE division."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x))


@triton.jit
def topk_group_rank(gkey):
    """Rank of every group of a ``[rows, G]`` int64 key tile: the number of larger keys (keys are unique)."""
    bigger = (gkey[:, :, None] > gkey[:, None, :]).to(tl.int32)
    return tl.sum(bigger, axis=1)


@triton.jit
def group_scores_key(key, valid_group, NUM_TOPK_SUM: tl.constexpr):
    """Packed keys of the group scores of a ``[rows, G_PAD, EPG_PAD]`` expert-key tile.

    The score is the largest value (NUM_TOPK_SUM == 1) or the largest plus the second largest,
    counting duplicates (NUM_TOPK_SUM == 2).  Groups outside ``valid_group`` get ``KEY_TAKEN``.
    """
    k1 = tl.max(key, axis=2)
    score = key_value(k1)
    if NUM_TOPK_SUM == 2:
        k2 = tl.max(tl.where(key == k1[:, :, None], KEY_TAKEN, key), axis=2)
        score = score + key_value(k2)
    gidx = tl.arange(0, key.shape[1])[None, :]
    gkey = pack_key(f32_order_key(score), gidx)
    return tl.where(valid_group, gkey, KEY_TAKEN)
