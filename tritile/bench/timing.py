"""The eager timer of ``python -m tritile bench --eager``: the time a caller waits for per call."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Tuple


def time_eager(fn: Callable[[], Any], calls: int = 100, rounds: int = 5, round_ms: float = 50.0,
               sync: Optional[Callable[[], None]] = None,
               clock: Callable[[], float] = time.perf_counter) -> Tuple[float, int]:
    """µs per call of ``fn`` called back to back with one ``sync()`` at the end (host work, launches and the
    kernels, as an eager caller sees them), the best of ``rounds`` rounds.  A round is ``calls`` calls, or fewer for a
    long op so that a round stays near ``round_ms`` (at least one).  Returns ``(µs per call, calls per round)``.

    ``sync`` defaults to ``torch.cuda.synchronize``; the device is idle when each round starts."""
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be >= 1, got calls={calls}, rounds={rounds}")
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    fn()  # warm: a first call may compile or allocate
    sync()
    t0 = clock()
    fn()
    sync()
    one = clock() - t0  # one call with its sync: an upper bound of a call's share in a round
    n = max(1, min(calls, int(round_ms * 1e-3 / max(one, 1e-9))))
    best = math.inf
    for _ in range(rounds):
        sync()
        t0 = clock()
        for _ in range(n):
            fn()
        sync()
        best = min(best, clock() - t0)
    return best / n * 1e6, n
