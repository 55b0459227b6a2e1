"""Autograd layers built from tritile's kernels (``tile_kernels.modeling``)."""

from . import engram  # noqa: F401
from . import mhc  # noqa: F401
from . import moe  # noqa: F401
