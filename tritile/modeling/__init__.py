"""Autograd layers built from tritile's kernels (``tile_kernels.modeling``)."""

import importlib as _importlib

from . import engram  # noqa: F401

try:  # the mHC layers live in another work item
    mhc = _importlib.import_module(f"{__name__}.mhc")
except ModuleNotFoundError as _e:
    if _e.name != f"{__name__}.mhc":
        raise
del _importlib
