"""Host helpers shared by the engram launchers (argument checks, ``empty_like`` that tests poison)."""

from __future__ import annotations

import math

import torch

from ..runtime import check_inner_contiguous, check_tensor, empty_strided, interpreter_configs


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t)`` (same strides when ``t`` is dense, else contiguous), poisoned in tests."""
    stride = torch.empty_like(t, device="meta").stride()
    return empty_strided(t.shape, stride, t.dtype, t.device)


def check_rows(name: str, t, dtype: torch.dtype, shape) -> torch.Tensor:
    """``t`` is a ``dtype`` tensor of ``shape`` with a unit stride in its last dimension."""
    check_tensor(name, t, dtypes=(dtype,), ndim=len(shape))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    check_inner_contiguous(name, t)
    return t


def check_float(name: str, value) -> float:
    """``value`` as a float: a finite real number >= 0 (eps, clamp_value), as the swiglu ops check theirs."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def bits16(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor seen as int16 (kernels widen the bits themselves: exact for every code, subnormals
    included, which the 3.6 interpreter's bf16 loads get wrong)."""
    return t.view(torch.int16)


def interp() -> bool:
    return interpreter_configs()
