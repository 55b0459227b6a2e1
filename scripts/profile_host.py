"""Where does host time go per call?  cProfile over back-to-back calls of a few ops (GPU)."""

import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl

from tritile.engram import fused_weight
from tritile.transpose import transpose


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def per_call(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / n


x = torch.randn(64, 64, device="cuda")
wh = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
we = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
xt = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
cases = {
    "raw triton launch": lambda: _noop[(1,)](x, 64, BLOCK=64),
    "torch.empty": lambda: torch.empty(64, device="cuda"),
    "fused_weight": lambda: fused_weight(wh, we),
    "transpose": lambda: transpose(xt),
}
for name, fn in cases.items():
    print(f"{name:20s} {per_call(fn):8.2f} us/call")
for name in ("fused_weight", "transpose"):
    pr = cProfile.Profile()
    fn = cases[name]
    pr.enable()
    for _ in range(500):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"==== {name}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
