"""The order of a 2D grid of tiles (``KFAST``).

CUDA starts a grid's programs in the order of ``program_id(0)`` first.  With the row-block index there, the programs
running together read narrow column strips of many rows; with the column-block index there (``KFAST``), they read
whole rows' runs.  Which is faster is measured per kernel (H200, 2026-11-30, commit fd8764c: -2 to -5 % on four casts
with KFAST,
nothing on the per-channel transpose), so kernels take it as a constexpr and launchers build the grid with
:func:`tile_grid`."""

from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl

__all__ = ["tile_ids", "tile_grid"]

_MAX_GRID_Y = 65535  # a CUDA grid's second dimension


@triton.jit
def tile_ids(KFAST: tl.constexpr, INT64: tl.constexpr = True):
    """``(row block, column block)`` of this program in a grid built by :func:`tile_grid` (int64, or the int32 program
    ids without ``INT64``)."""
    if KFAST:
        pm, pk = tl.program_id(1), tl.program_id(0)
    else:
        pm, pk = tl.program_id(0), tl.program_id(1)
    if INT64:
        return pm.to(tl.int64), pk.to(tl.int64)
    else:
        return pm, pk


def tile_grid(row_blocks: int, col_blocks: int, kfast: bool) -> Tuple[Tuple[int, int], bool]:
    """``(grid, KFAST)`` for ``row_blocks x col_blocks`` tiles: the column blocks first when ``kfast``, the row blocks
    first otherwise, unless the block count that would go second exceeds the grid's second dimension (65535) and the
    other one fits there: then the order is swapped and ``KFAST`` says so (a tall or a wide tensor still launches)."""
    kfast = bool(kfast)
    if kfast and row_blocks > _MAX_GRID_Y:
        kfast = False
    elif not kfast and col_blocks > _MAX_GRID_Y and row_blocks <= _MAX_GRID_Y:
        kfast = True
    return ((col_blocks, row_blocks) if kfast else (row_blocks, col_blocks)), kfast
