"""Benchmark registrations of tritile.moe."""

from . import _bench_fused, _bench_gating  # noqa: F401
