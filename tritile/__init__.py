"""tritile: DeepSeek TileKernels' kernels in Triton, with the same public API.

``import tritile.quant as quant`` etc.  Importing tritile queries no GPU.
"""

__version__ = "0.1.0"

from . import config, utils  # noqa: F401,E402

import importlib as _importlib

for _m in ("transpose", "quant", "moe", "engram", "mhc", "modeling", "ep", "torch", "testing"):
    try:
        globals()[_m] = _importlib.import_module(f"{__name__}.{_m}")
    except ModuleNotFoundError as _e:  # a module not built yet
        if _e.name != f"{__name__}.{_m}":
            raise
del _importlib

# the submodules that imported (config and utils always; the others as they are built)
__all__ = [_n for _n, _v in list(globals().items())
           if not _n.startswith("_") and getattr(_v, "__name__", "") == f"{__name__}.{_n}"]
