"""Quantization test helpers (``tile_kernels.testing.quant``)."""

from __future__ import annotations

import torch

from ..utils import align, ceil_div

__all__ = ["clear_unused_sf"]


def clear_unused_sf(sf: torch.Tensor, hidden: int, num_per_channels: int) -> torch.Tensor:
    """Packed UE8M0 sf -> a ``(rows, align(ceil(hidden/npc), 4))`` uint8 copy whose bytes past the
    real group count are zero.  Unlike TileKernels' helper this never mutates ``sf``."""
    num_groups = ceil_div(hidden, num_per_channels)
    rows = sf.shape[0]
    out = sf.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8).reshape(rows, -1)
    assert out.shape[1] == align(num_groups, 4), (out.shape, num_groups)
    out[:, num_groups:] = 0
    return out
