"""Quantization ops (``tile_kernels.quant``): FP8 e4m3 / FP4 e2m1 / E5M6 casts, fused SwiGLU casts."""

from . import common, types
from .cast_back_kernel import cast_back, per_token_cast_back
from .common import unpack_from_e2m1fn_x2
from .per_block_cast_kernel import per_block_cast, per_block_cast_with_precomputed_sf, per_block_cast_with_sf_only
from .per_block_cast_lossless_kernel import per_block_cast_lossless
from .per_channel_cast_and_transpose_kernel import per_channel_cast_and_transpose
from .per_channel_cast_fused_kernel import per_channel_cast_fused
from .per_channel_cast_kernel import per_channel_cast
from .per_token_cast_kernel import per_token_cast, per_token_cast_with_precomputed_sf, per_token_cast_with_sf_only
from .swiglu_backward_and_per_token_cast_kernel import swiglu_backward_and_per_token_cast
from .swiglu_forward_and_per_channel_cast_and_transpose_kernel import swiglu_forward_and_per_channel_cast_and_transpose
from .swiglu_forward_and_per_token_cast_kernel import swiglu_forward_and_per_token_cast
from .types import QuantTensor

__all__ = [
    "common", "types", "QuantTensor", "unpack_from_e2m1fn_x2",
    "per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf",
    "per_block_cast", "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf", "per_block_cast_lossless",
    "per_channel_cast", "per_channel_cast_fused", "per_channel_cast_and_transpose",
    "swiglu_forward_and_per_token_cast", "swiglu_backward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "cast_back", "per_token_cast_back",
]
