"""Numeric comparison helpers (same names and semantics as ``tile_kernels.testing.numeric``)."""

from __future__ import annotations

import math

import torch

__all__ = ["assert_equal", "assert_tree_equal", "calc_diff", "check_bias", "count_bytes"]


def assert_equal(x: torch.Tensor, y: torch.Tensor, check_dtype: bool = True, check_shape: bool = True,
                 check_stride: bool = True) -> None:
    """Bitwise equality of the bytes of ``x`` and ``y``; also dtype, shape, device and (numel > 0) strides."""
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), (type(x), type(y))
    assert x.device == y.device, f"device differs: {x.device} vs {y.device}"
    if check_dtype:
        assert x.dtype == y.dtype, f"dtype differs: {x.dtype} vs {y.dtype}"
    if check_shape:
        assert x.shape == y.shape, f"shape differs: {tuple(x.shape)} vs {tuple(y.shape)}"
    if check_stride and x.numel() > 0:
        assert x.stride() == y.stride(), f"stride differs: {x.stride()} vs {y.stride()}"
    xb = _bytes(x)
    yb = _bytes(y)
    if xb.numel() != yb.numel():
        raise AssertionError(f"byte count differs: {xb.numel()} vs {yb.numel()}")
    diff = xb != yb
    if bool(diff.any()):
        n_bad = int(diff.sum())
        esz = x.element_size()
        first = int(diff.nonzero()[0, 0]) // max(esz, 1)
        xs = x.contiguous().flatten()
        ys = y.contiguous().flatten()
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape)) if x.dim() else ()
        raise AssertionError(
            f"{n_bad} of {xb.numel()} bytes differ; first at element {idx}: {_show(xs, first)} vs {_show(ys, first)}")


def assert_tree_equal(x: object, y: object) -> None:
    """:func:`assert_equal` over nested tuples / lists of tensors (an op's return structure); None where both are."""
    if isinstance(y, (tuple, list)):
        assert isinstance(x, (tuple, list)) and len(x) == len(y), f"structure differs: {type(x)} vs {type(y)}"
        for a, b in zip(x, y):
            assert_tree_equal(a, b)
    elif y is None:
        assert x is None, f"{type(x).__name__} vs None"
    else:
        assert_equal(x, y)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in row-major order, as bytes (copies when the layout needs it, e.g. a (1, 1)
    tensor with strides (1, 4), which is "contiguous" but cannot be viewed as bytes)."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _show(t: torch.Tensor, i: int) -> str:
    v = t[i]
    raw = v.view(torch.uint8) if t.element_size() == 1 else None
    if raw is not None:
        return f"0x{int(raw):02x}"
    try:
        return f"{v.item()!r}"
    except Exception:  # pragma: no cover
        return str(v)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2*sum(x*y) / sum(x*x + y*y)`` in float64 (0 when both are zero)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if float(denom) == 0.0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def check_bias(x: torch.Tensor, ref: torch.Tensor) -> None:
    """Rounding is unbiased: ``(#(x < ref) + #(x == ref)/2) / n`` lies within ``10/sqrt(n)`` of 0.5."""
    x, ref = x.float().flatten(), ref.float().flatten()
    n = x.numel()
    if n == 0:
        return
    less = (x < ref).sum().item()
    equal = (x == ref).sum().item()
    ratio = (less + equal / 2) / n
    tol = 10 / math.sqrt(n)
    assert abs(ratio - 0.5) <= tol, f"rounding is biased: ratio {ratio:.5f} not within {tol:.5f} of 0.5"


def count_bytes(*tensors: object) -> int:
    """Sum of ``numel * element_size`` over tensors, recursing into tuples/lists and skipping None."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        else:
            raise TypeError(f"count_bytes takes tensors, tuples, lists or None, got {type(t).__name__}")
    return total
