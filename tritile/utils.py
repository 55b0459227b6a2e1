"""Small host-side helpers (same names as ``tile_kernels.utils``)."""

from __future__ import annotations

__all__ = ["ceil_div", "align", "is_power_of_two", "next_power_of_two"]


def ceil_div(x: int, y: int) -> int:
    """``ceil(x / y)`` for non-negative integers."""
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """Round ``x`` up to a multiple of ``y``."""
    return ceil_div(x, y) * y


def is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def next_power_of_two(x: int) -> int:
    """Smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
