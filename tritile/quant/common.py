"""Cast configurations, scale-factor layouts and FP4 helpers (``tile_kernels.quant.common``).

Scale-factor (sf) layouts, exactly as DeepGEMM consumes them (``Ms = ceil(M/bm)``, ``Ks = ceil(K/bk)``,
``A4(n) = 4*ceil(n/4)``):

=============================================  =======  ======================  ===============
flags (col_major, packed_ue8m0)                dtype    shape                   strides
=============================================  =======  ======================  ===============
(False, False)  row-major                      float32  ``(Ms, Ks)``            ``(Ks, 1)``
(True, False)   TMA-aligned column-major       float32  ``(Ms, Ks)``            ``(1, A4(Ms))``
(True, True)    packed UE8M0                   int32    ``(Ms, ceil(Ks/4))``    ``(1, A4(Ms))``
(False, True)   rejected (``ValueError``)
=============================================  =======  ======================  ===============

Packed UE8M0: little-endian byte ``j`` of element ``[m, c]`` is the biased exponent of k-block ``4c+j``;
tritile writes whole words, so bytes past ``Ks`` are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
import triton
from torch.types import Device
import triton.language as tl

from ..runtime import empty, empty_strided
from ..utils import align, ceil_div
from .types import QuantTensor

__all__ = [
    "QuantTensor", "BaseCastConfig", "CastInputConfig", "CastOutputConfig", "get_cast_output_config",
    "get_logical_hidden", "get_physical_hidden", "get_sf_shape", "alloc_scaling_factors", "cast_epilogue",
    "unpack_from_e2m1fn_x2", "FMT_MAX", "FMT_CLAMP", "alloc_sf", "SFInfo", "sf_info", "check_sf_flags",
]

#: Largest finite value of each output format.
FMT_MAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
#: Lower clamp of amax before the scale is computed (``6 * 2**-126`` for e2m1 is exact).
FMT_CLAMP = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0**-126, "e5m6": 1e-4}

_FMT_DTYPE = {"e5m6": torch.uint32, "e4m3": torch.float8_e4m3fn, "e2m1": torch.int8}


@dataclass(frozen=True)
class BaseCastConfig:
    torch_dtype: torch.dtype = torch.float8_e4m3fn
    sf_block: Tuple[int, int] = (1, 1)
    use_tma_aligned_col_major_sf: bool = False
    use_packed_ue8m0: bool = False

    @property
    def sf_torch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.use_packed_ue8m0 else torch.float32

    @property
    def max_value(self) -> float:
        if self.torch_dtype == torch.float8_e4m3fn:
            return 448.0
        if self.torch_dtype == torch.int8:
            return 6.0
        if self.torch_dtype == torch.uint32:
            return 65024.0
        raise ValueError(f"unsupported cast dtype {self.torch_dtype}")


@dataclass(frozen=True)
class CastInputConfig(BaseCastConfig):
    with_sf: bool = True


@dataclass(frozen=True)
class CastOutputConfig(BaseCastConfig):
    round_sf: bool = False
    custom_clamp_min_value: Optional[float] = None

    @property
    def clamp_min_value(self) -> float:
        if self.custom_clamp_min_value is not None:
            return self.custom_clamp_min_value
        if self.torch_dtype == torch.float8_e4m3fn:
            return 1e-4
        if self.torch_dtype == torch.int8:
            return 6.0 * 2.0**-126
        raise ValueError(f"Unsupported dtype {self.torch_dtype}")


def get_cast_output_config(fmt: str, sf_block: Tuple[int, int], use_tma_aligned_col_major_sf: bool = False,
                           round_sf: bool = False, use_packed_ue8m0: bool = False,
                           custom_clamp_min_value: Optional[float] = None) -> CastOutputConfig:
    if fmt not in _FMT_DTYPE:
        raise ValueError(f"fmt must be one of {list(_FMT_DTYPE)}, got {fmt!r}")
    return CastOutputConfig(torch_dtype=_FMT_DTYPE[fmt], sf_block=tuple(sf_block),
                            use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
                            use_packed_ue8m0=use_packed_ue8m0, custom_clamp_min_value=custom_clamp_min_value)


def get_logical_hidden(hidden: int, dtype: torch.dtype) -> int:
    """Logical columns of a tensor with ``hidden`` physical columns (int8 packs two FP4 values)."""
    return hidden * 2 if dtype == torch.int8 else hidden


def get_physical_hidden(hidden: int, dtype: torch.dtype) -> int:
    """Physical columns needed for ``hidden`` logical columns (int8 packs two FP4 values)."""
    return hidden // 2 if dtype == torch.int8 else hidden


def get_sf_shape(shape: Tuple[int, int], config: BaseCastConfig) -> Tuple[int, int]:
    """Shape of the sf *storage* (before the column-major transpose), in ``sf_torch_dtype`` elements."""
    bm = ceil_div(shape[0], config.sf_block[0])
    bk = ceil_div(shape[1], config.sf_block[1])
    if config.use_packed_ue8m0:
        bm, bk = bm * 4, ceil_div(bk, 4)
    return (bk, bm) if config.use_tma_aligned_col_major_sf else (bm, bk)


def alloc_scaling_factors(shape: Tuple[int, int], out_config: BaseCastConfig, device: Device = None) -> torch.Tensor:
    """sf storage for a ``shape = (M, K)`` logical tensor, in TileKernels' pre-epilogue form.

    ``device`` defaults to the current CUDA device when one is present, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, cols = get_sf_shape(shape, out_config)
    if out_config.use_tma_aligned_col_major_sf:
        storage = empty((rows, align(cols, 16 if out_config.use_packed_ue8m0 else 4)), out_config.sf_torch_dtype,
                        device)
        return storage[:, :cols]
    return empty((rows, cols), out_config.sf_torch_dtype, device)


def cast_epilogue(out_sf: torch.Tensor, num_tokens: int, hidden: int, config: BaseCastConfig) -> torch.Tensor:
    """Turn ``alloc_scaling_factors`` storage into the user-facing sf (int32 view, transpose, row slice)."""
    if config.use_packed_ue8m0:
        if num_tokens == 0:
            out_sf = torch.empty((out_sf.shape[0], out_sf.shape[1] // 4), dtype=torch.int32, device=out_sf.device)
        else:
            out_sf = out_sf.view(torch.int32)
    if config.use_tma_aligned_col_major_sf:
        out_sf = out_sf.T
    return out_sf[: ceil_div(num_tokens, config.sf_block[0]), :]


def check_sf_flags(use_tma_aligned_col_major_sf: bool, round_sf: bool, use_packed_ue8m0: bool) -> None:
    """Reject flag combinations with no meaning (TileKernels asserts or silently misbehaves on them)."""
    for name, v in (("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf), ("round_sf", round_sf),
                    ("use_packed_ue8m0", use_packed_ue8m0)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        raise ValueError("use_packed_ue8m0=True requires use_tma_aligned_col_major_sf=True "
                         "(packed UE8M0 scales exist only in the column-major layout)")
    if use_packed_ue8m0 and not round_sf:
        raise ValueError("use_packed_ue8m0=True requires round_sf=True (UE8M0 holds powers of two only)")


def alloc_sf(num_rows: int, num_cols: int, sf_block: Tuple[int, int], use_tma_aligned_col_major_sf: bool,
             use_packed_ue8m0: bool, device: Device) -> torch.Tensor:
    """User-facing sf tensor for an ``(num_rows, num_cols)`` logical tensor, with the exact §2.3 layout.

    Kernels write it through its own strides (``sf.stride(0)``, ``sf.stride(1)``), in float32 elements,
    or int32 words when packed."""
    ms = ceil_div(num_rows, sf_block[0])
    ks = ceil_div(num_cols, sf_block[1])
    if use_packed_ue8m0:
        kc = ceil_div(ks, 4)
        if ms == 0:
            return empty((0, kc), torch.int32, device)
        return empty_strided((ms, kc), (1, align(ms, 4)), torch.int32, device)
    if use_tma_aligned_col_major_sf:
        if ms == 0:
            return empty((0, ks), torch.float32, device)
        return empty_strided((ms, ks), (1, align(ms, 4)), torch.float32, device)
    return empty((ms, ks), torch.float32, device)


class SFInfo(NamedTuple):
    """How a kernel reads an input sf: element ``[m, k]`` (k = k-block) of a float sf is at
    ``m*stride_m + k*stride_k``; a packed sf holds k-block ``k`` in byte ``k % 4`` of word
    ``m*stride_m + (k//4)*stride_k``."""

    tensor: torch.Tensor
    stride_m: int
    stride_k: int
    packed: bool


def sf_info(name: str, sf: torch.Tensor, num_row_blocks: int, num_col_blocks: int) -> SFInfo:
    """Validate an input sf of any strides; int32 means packed UE8M0, float32 means plain scales."""
    if not isinstance(sf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(sf).__name__}")
    if sf.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"{name} must be float32 (scales) or int32 (packed UE8M0), got {sf.dtype}")
    if sf.dim() != 2:
        raise ValueError(f"{name} must be 2D, got a {sf.dim()}D tensor of shape {tuple(sf.shape)}")
    packed = sf.dtype == torch.int32
    want = (num_row_blocks, ceil_div(num_col_blocks, 4) if packed else num_col_blocks)
    if tuple(sf.shape) != want:
        kind = "packed UE8M0 int32" if packed else "float32"
        raise ValueError(f"{name} ({kind}) must have shape {want}, got {tuple(sf.shape)}")
    return SFInfo(sf, sf.stride(0), sf.stride(1), packed)


@triton.jit
def pack_ue8m0_words(e):
    """UE8M0 bytes ``[R, 4G]`` (int32 values 0..255) -> int32 words ``[R, G]``, byte j of word c = block 4c+j."""
    R: tl.constexpr = e.shape[0]
    G4: tl.constexpr = e.shape[1]
    e4 = tl.reshape(e, (R, G4 // 4, 4))
    shift = tl.arange(0, 4) * 8
    return tl.sum(e4 << shift[None, None, :], axis=2)


#: The 16 e2m1 values by code (bit 3: sign; code 8 is -0.0).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_UNPACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # every e2m1 value is exact in each


def unpack_from_e2m1fn_x2(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed FP4 e2m1 bytes ``[..., N]`` (int8/uint8) into ``[..., 2N]`` values of ``out_dtype``.

    Element ``2j`` comes from the low nibble of byte ``j``, ``2j+1`` from the high nibble; code 8 is -0.0.
    Pure torch (no kernel), any device.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"x must be int8 or uint8 (packed FP4), got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension so the last dim can be doubled")
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _UNPACK_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in _UNPACK_DTYPES]}, got {out_dtype!r}")
    # a table lookup, not arithmetic: code 8 must stay -0.0 under every backend (inductor's Triton code negates
    # as ``0 - x``, which turns -(+0.0) into +0.0)
    table = torch.tensor(_E2M1_VALUES, dtype=out_dtype, device=x.device)
    b = x.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1)
    return table[codes].reshape(*x.shape[:-1], x.shape[-1] * 2)
