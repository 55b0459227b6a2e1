"""Transposes (``tile_kernels.transpose``)."""

from .batched_transpose_kernel import batched_transpose, transpose  # noqa: F401

__all__ = ["transpose", "batched_transpose"]
