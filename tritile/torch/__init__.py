"""Pure-PyTorch references for every tritile op (the names of ``tile_kernels.torch``).

Written from the math in the specs; the tests compare the kernels against them bit for bit where
TileKernels does.  One file per family; each file's ``__all__`` is re-exported here.
"""

import importlib as _importlib

_FAMILIES = ("transpose", "cast", "cast_e5m6", "swiglu", "per_channel_cast_fused", "topk", "moe",
             "expand_to_fused", "reduce_fused", "engram", "mhc")

for _f in _FAMILIES:
    try:
        _mod = _importlib.import_module(f"{__name__}.{_f}")
    except ModuleNotFoundError as _e:  # a family not built yet
        if _e.name != f"{__name__}.{_f}":
            raise
        continue
    for _name in getattr(_mod, "__all__", ()):
        globals()[_name] = getattr(_mod, _name)

del _importlib, _f
