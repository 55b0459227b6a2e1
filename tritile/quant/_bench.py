"""Benchmark registrations of tritile.quant (each part registers in its own file)."""

import importlib as _importlib

for _part in ("_bench_cast", "_bench_e5m6", "_bench_channel", "_bench_swiglu"):
    try:
        _importlib.import_module(f"{__package__}.{_part}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__package__}.{_part}":
            raise
