"""Benchmark registrations of tritile.moe (each part registers in its own file)."""

import importlib as _importlib

for _part in ("_bench_gating", "_bench_fused"):
    try:
        _importlib.import_module(f"{__package__}.{_part}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__package__}.{_part}":
            raise
