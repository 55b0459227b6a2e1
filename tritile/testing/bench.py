"""GPU timers for the benchmark harness: CUDA events, medians after warm-up, CUDA-graph replay."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

__all__ = ["time_events", "time_graph", "time_kernels", "time_host", "copy_bandwidth_gbs"]


def _sync():
    torch.cuda.synchronize()


def time_events(fn: Callable[[], object], warmup: int = 10, rep: int = 100, min_ms: float = 20.0) -> float:
    """Median µs of ``fn`` timed one call at a time with CUDA events, after warm-up.

    ``rep`` grows until the timed calls cover ``min_ms`` (capped at 2000 calls)."""
    for _ in range(warmup):
        fn()
    _sync()
    # estimate
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        fn()
    e.record()
    _sync()
    est_ms = max(s.elapsed_time(e) / 5, 1e-4)
    rep = int(min(max(rep, min_ms / est_ms), 2000))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(rep):
        starts[i].record()
        fn()
        ends[i].record()
    _sync()
    return statistics.median(st.elapsed_time(en) for st, en in zip(starts, ends)) * 1e3


def time_graph(fn: Callable[[], object], calls_per_graph: int = 20, rep: int = 50) -> Optional[float]:
    """Median µs per call under CUDA-graph replay (``calls_per_graph`` calls captured in one graph).

    Returns None when ``fn`` cannot be captured (e.g. it synchronises with the host)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        _sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls_per_graph):
                fn()
        _sync()
    except Exception:
        _sync()
        return None
    for _ in range(3):
        g.replay()
    _sync()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        _sync()
        times.append(s.elapsed_time(e) * 1e3 / calls_per_graph)
    del g
    return statistics.median(times)


def time_kernels(fn: Callable[[], object], rep: int = 30, warmup: int = 5, flush_l2: bool = True) -> Optional[float]:
    """µs per call of GPU kernel execution, from the CUPTI activity records of ``torch.profiler``: the sum of
    the durations of the kernels ``fn`` launches, without the gaps between them, with L2 flushed before each
    call (a 256 MiB in-place ``bitwise_not``, left out of the sum).  This is how TileKernels' CUPTI-based timer
    sees a call.  Memcpy/memset records (e.g. a host sync's copy) are not counted.  None if the profiler fails."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    _sync()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(rep):
                if flush is not None:
                    torch.bitwise_not(flush, out=flush)
                fn()
            _sync()
        total = 0.0
        for e in prof.events():
            if e.device_type != DeviceType.CUDA or "bitwise_not" in e.name or e.name.startswith(("Memcpy", "Memset")):
                continue
            total += e.time_range.elapsed_us()
    except Exception:  # pragma: no cover - no CUPTI on this machine
        return None
    finally:
        del flush
    return total / rep if total > 0 else None


def time_host(fn: Callable[[], object], n: int = 200) -> float:
    """Host-side µs per call (Python + launch overhead): ``n`` back-to-back calls, one sync at the end."""
    for _ in range(5):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    _sync()
    return (t1 - t0) * 1e6 / n


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written) measured now, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    us = time_events(lambda: dst.copy_(src), warmup=5, rep=30)
    del src, dst
    return 2 * nbytes / us / 1e3
