"""``per_channel_cast``: e4m3 cast with one scale per (128 rows x 1 column) block
(``tile_kernels.quant.per_channel_cast``; a thin wrapper over ``per_channel_cast_fused``)."""

from __future__ import annotations

import torch

from ..runtime import check_choice
from ..runtime.plan import planned
from ._per_channel_common import check_per_channel_x
from .per_channel_cast_fused_kernel import _launch, per_channel_cast_fused
from .types import QuantTensor

__all__ = ["per_channel_cast"]


@planned("per_channel_cast")
def per_channel_cast(x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False) -> QuantTensor:
    """Cast ``x`` to FP8 e4m3 with one scale per (128 rows x 1 column) block (not transposed).

    Per column ``k`` of each 128-row block: ``amax = max |x|``, ``sf = max(amax, 1e-4) / 448`` (IEEE),
    ``sf_inv = 448 / max(amax, 1e-4)`` (a second division), or with ``round_sf`` ``sf = 2^ceil(log2 sf)``
    and ``sf_inv = 1 / sf``; ``out = e4m3(x * sf_inv)`` (RNE, saturating at +-448).  A block holding
    +-inf or NaN gets ``sf = +inf``, its finite elements ``+-0`` and its non-finite ones NaN
    (``0x7F | sign``), so it dequantizes to NaN.

    Args:
        x: bfloat16 or float32 ``(M, K)`` with ``M % 128 == 0`` and ``K % 64 == 0``, unit column
            stride (rows may be strided).
        fmt: must be ``'e4m3'``.
        num_per_tokens: rows per scale block; must be 128.
        round_sf: round the scales up to powers of two.

    Returns:
        ``(out, sf)``: float8_e4m3fn ``(M, K)`` contiguous and float32 ``(M / 128, K)`` contiguous.
        ``M = 0`` gives ``(0, K)`` and ``(0, K)`` without a launch.
    """
    check_choice("fmt", fmt, ["e4m3"])
    if isinstance(num_per_tokens, bool) or not isinstance(num_per_tokens, int):
        raise TypeError(f"num_per_tokens must be an int, got {type(num_per_tokens).__name__}")
    check_choice("num_per_tokens", num_per_tokens, [128])
    m, k = check_per_channel_x(x, (torch.bfloat16, torch.float32))
    if not isinstance(round_sf, bool):
        raise TypeError(f"round_sf must be a bool, got {type(round_sf).__name__}")
    if torch.compiler.is_compiling():  # the opaque custom op of per_channel_cast_fused
        return per_channel_cast_fused(x, fmt, num_per_tokens, round_sf)
    # launch config: tritile.runtime.tuned("per_channel_cast", ...) (same keys as per_channel_cast_fused)
    return _launch(x, None, False, None, m, round_sf, name="per_channel_cast")
