"""Manifold HyperConnection layers (``tile_kernels.modeling.mhc``): the functional API and its autograd ops."""

from . import ops  # noqa: F401
from .functional import expand_from_embedding, mhc_head, mhc_pre

__all__ = ["expand_from_embedding", "mhc_head", "mhc_pre"]
