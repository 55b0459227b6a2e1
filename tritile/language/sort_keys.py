"""Order-preserving sort keys for stable top-k (``@triton.jit``).

``f32_order_key`` maps float32 to int32 so that integer order is float order (``-0.0 == +0.0``; NaN above +inf, as
``torch.sort(descending=True)`` puts NaN first); ``pack_key`` appends ``0x7FFFFFFF - index`` in the low 32 bits, so
the int64 maximum is the largest value and, among equal values, the smallest index: one ``tl.max`` is a stable
arg-max and every key of a row is unique.  ``KEY_TAKEN`` is below every packed key.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
