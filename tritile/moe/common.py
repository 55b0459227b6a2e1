"""``@triton.jit`` helpers shared by the MoE gating kernels.

* Order-preserving sort keys: ``f32_order_key`` maps float32 to int32 so that integer order is
  float order (``-0.0 == +0.0``; NaN above +inf, as ``torch.sort(descending=True)`` puts NaN first);
  ``pack_key`` appends ``0x7FFFFFFF - index`` in the low 32 bits, so the int64 maximum is the largest
  value and, among equal values, the smallest index: one ``tl.max`` is a stable arg-max and every
  key of a row is unique.  ``KEY_TAKEN`` is below every packed key.
* ``sigmoid_f32`` / ``softplus_f32``: the gate's activations, computed the way the references in
  ``tritile.torch.topk`` compute them on each backend (libdevice on GPUs, numpy float32 under the
  interpreter), with IEEE division.
* ``group_scores_key`` / ``topk_group_rank``: group-limited routing (top-1 or top-2 sum per group,
  rank with ties to the smaller group index).
* GPU note: Triton compiles libdevice with FTZ (``enable_reflect_ftz``), so exp/log1p results in the
  float32 subnormal range flush to zero; torch CUDA keeps them.  Irrelevant for finite gate logits
  above -87.

TODO(integration): the sort-key helpers belong in ``tritile.language`` (DESIGN.md lists them there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritile.language import exp_f32
from tritile.language.cast import INTERPRET

if not bool(INTERPRET):
    from triton.language.extra import libdevice as _libdevice
else:  # the interpreter has no libdevice
    _libdevice = None

# Below every packed key: the smallest high word a key can have is f32_order_key(-inf) = -2139095041.
KEY_TAKEN = tl.constexpr(-(2 ** 63))


@triton.jit
def f32_order_key(x):
    """int32 key with key(a) < key(b) iff a < b (float order); -0.0 -> key(+0.0); NaN -> INT32_MAX."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def order_key_to_f32(key):
    """Inverse of ``f32_order_key`` (the map is an involution on the bits)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack_key(key32, idx):
    """int64 key: value key in the high word, ``0x7FFFFFFF - idx`` in the low word (ties -> smaller idx)."""
    return (key32.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def key_index(key64):
    """The index packed into ``key64`` (int32)."""
    return (0x7FFFFFFF - (key64 & 0x7FFFFFFF)).to(tl.int32)


@triton.jit
def key_value(key64):
    """The float32 value packed into ``key64`` (zeros come back as +0.0)."""
    return order_key_to_f32((key64 >> 32).to(tl.int32))


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
