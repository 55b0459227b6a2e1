"""Quantization ops (``tile_kernels.quant``): FP8 e4m3 / FP4 e2m1 / E5M6 casts, fused SwiGLU casts."""

import importlib as _importlib

from . import common, types  # noqa: F401
from .common import unpack_from_e2m1fn_x2  # noqa: F401
from .types import QuantTensor  # noqa: F401

# op file (named as in TileKernels) -> public names it exports
_EXPORTS = {
    "per_token_cast_kernel": ("per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf"),
    "per_block_cast_kernel": ("per_block_cast", "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf"),
    "per_channel_cast_kernel": ("per_channel_cast",),
    "per_channel_cast_fused_kernel": ("per_channel_cast_fused",),
    "per_channel_cast_and_transpose_kernel": ("per_channel_cast_and_transpose",),
    "swiglu_forward_and_per_token_cast_kernel": ("swiglu_forward_and_per_token_cast",),
    "swiglu_backward_and_per_token_cast_kernel": ("swiglu_backward_and_per_token_cast",),
    "swiglu_forward_and_per_channel_cast_and_transpose_kernel": ("swiglu_forward_and_per_channel_cast_and_transpose",),
    "cast_back_kernel": ("cast_back", "per_token_cast_back"),
    "per_block_cast_lossless_kernel": ("per_block_cast_lossless",),
}

# TODO(integration): switch to plain imports once every file exists.
for _file, _names in _EXPORTS.items():
    try:
        _mod = _importlib.import_module(f"{__name__}.{_file}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_file}":
            raise
        continue
    for _n in _names:
        globals()[_n] = getattr(_mod, _n)
del _importlib
