"""Per-block (bm x bk) casts to FP8 e4m3 / FP4 e2m1 (``tile_kernels.quant.per_block_cast_kernel``).

The kernel is the generic block cast of ``per_token_cast_kernel`` (``_block_cast_kernel``) with 2D scale
blocks: each program loads whole ``bm``-row strips in ``[BLOCK_M, BLOCK_K]`` tiles, reduces amax per
``(bm, bk)`` block (rows past M and columns past K do not take part), stores the scales and encodes.
By default (speed-only flags, same bits) a chunk whose block amax is finite skips the NaN/sign patches of the
encode (FINITE), and FP4 output from bf16/fp32 reads x as words of two elements (PAIRS: pair tiles in the
packed bytes' layout, one warp per 32x32 block).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..utils import is_power_of_two
from ..runtime.plan import planned
from .common import check_sf_flags
from ._block_cast_host import SF_ONLY, SF_PRECOMPUTED, SF_QUANT, _check_block, _check_fmt, _parse_input
from .per_token_cast_kernel import _check_precomputed_sf, _launch_cast
from .types import QuantTensor

__all__ = ["per_block_cast", "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf"]


def _per_block(x, fmt, block_size, col_major, round_sf, packed, sf_mode, psf=None):
    _check_fmt(fmt)
    check_sf_flags(col_major, round_sf, packed)
    bm, bk = _check_block("block_size", block_size)
    for name, b in (("rows", bm), ("cols", bk)):
        if not (is_power_of_two(b) and 16 <= b <= 256):
            raise ValueError(f"block_size {name} must be a power of two in [16, 256] (TileKernels: 32 or 128), "
                             f"got block_size={tuple(block_size)}")
    _parse_input("x", x, None, allow_quant=False)
    if sf_mode == SF_PRECOMPUTED:
        _check_precomputed_sf(psf, x.shape[0], x.shape[1], bm, bk, x.device)
    return _launch_cast(x, None, fmt, bm, bk, False, sf_mode, psf, round_sf, col_major, packed)


@planned("per_block_cast")
def per_block_cast(x: torch.Tensor, fmt: str, block_size: Tuple[int, int], use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False) -> QuantTensor:
    """Quantize with one scale per ``block_size = (bm, bk)`` block.

    Args:
        x: ``(M, K)`` bfloat16/float32, ``stride(1) == 1`` (rows may be strided).
        fmt: ``'e4m3'`` or ``'e2m1'`` (K even).
        block_size: ``(bm, bk)``, powers of two in [16, 256] (TileKernels uses 32 and 128).
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: sf layout and rounding (packed UE8M0
            requires column-major and round_sf).

    Returns:
        ``(out, sf)``: out float8_e4m3fn ``(M, K)`` or int8 ``(M, K/2)`` (two FP4 codes per byte, even element
        in the low nibble); sf float32 ``(ceil(M/bm), ceil(K/bk))`` row-major or column-major with strides
        ``(1, A4(Ms))``, or packed UE8M0 int32 ``(Ms, ceil(Ks/4))`` with strides ``(1, A4(Ms))``.

    Partial blocks at the bottom/right edges take amax over their valid elements.  A block holding inf/NaN
    gets sf = +inf and dequantizes to NaN.
    """
    return _per_block(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, SF_QUANT)


@planned("per_block_cast_with_sf_only")
def per_block_cast_with_sf_only(x: torch.Tensor, fmt: str, block_size: Tuple[int, int],
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Only the scale factors of :func:`per_block_cast` (same bits and layout); no codes are written.

    Returns sf: float32 ``(ceil(M/bm), ceil(K/bk))`` or packed UE8M0 int32 ``(Ms, ceil(Ks/4))``."""
    return _per_block(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, SF_ONLY)[1]


@planned("per_block_cast_with_precomputed_sf")
def per_block_cast_with_precomputed_sf(x: torch.Tensor, fmt: str, block_size: Tuple[int, int], sf: torch.Tensor,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Quantize with given block scales: ``out = encode(f32(x * (1 / sf[i/bm, j/bk])))``.

    Args:
        x: ``(M, K)`` bfloat16/float32.  fmt: ``'e4m3'`` or ``'e2m1'``.  block_size: ``(bm, bk)``.
        sf: float32 ``(ceil(M/bm), ceil(K/bk))`` with ``stride(1) == 1``; read only.
        use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False; round_sf is ignored.

    Returns:
        out float8_e4m3fn ``(M, K)`` or int8 ``(M, K/2)``.
    """
    if use_tma_aligned_col_major_sf or use_packed_ue8m0:
        raise ValueError("per_block_cast_with_precomputed_sf takes a row-major float32 sf: "
                         "use_tma_aligned_col_major_sf and use_packed_ue8m0 must be False, got "
                         f"{use_tma_aligned_col_major_sf} and {use_packed_ue8m0}")
    return _per_block(x, fmt, block_size, False, False, False, SF_PRECOMPUTED, psf=sf)[0]
