"""Time transpose launch configs on the GPU (one call of the device tool); prints a table."""

import itertools
import sys

import torch

from tritile.testing.bench import copy_bandwidth_gbs, time_graph
from tritile.transpose.batched_transpose_kernel import batched_transpose_with_config

copy = copy_bandwidth_gbs()
print(f"copy {copy:.0f} GB/s")
which = sys.argv[1:] or ["bf16", "fp8"]
cases = [(d, s) for d, s in [("bf16", (1, 8064, 7168)), ("fp8", (1, 8064, 7168)), ("bf16", (32, 8064, 7168)),
                             ("fp8", (8, 8064, 7168)), ("fp32", (32, 8064, 7168))] if d in which]
dts = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
for name, shape in cases:
    x = torch.randn(shape, device="cuda").to(dts[name])
    nbytes = 2 * x.numel() * x.element_size()
    configs = []
    if name == "fp8":
        for bm4, bn4, w in itertools.product([16, 32, 64], [8, 16, 32], [2, 4, 8]):
            configs.append(dict(word_path=True, BLOCK_M4=bm4, BLOCK_N4=bn4, num_warps=w))
        for bm, bn, w in [(64, 128, 4), (128, 128, 8), (128, 256, 8)]:
            configs.append(dict(word_path=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=w))
    else:
        for bm, bn, w, st in itertools.product([64, 128, 256], [32, 64, 128], [4, 8], [False, True]):
            configs.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, STREAM=st))
    res = []
    for rep in range(1):
        for c in configs:
            try:
                us = time_graph(lambda: batched_transpose_with_config(x, c), calls_per_graph=5, rep=10)
            except Exception as e:  # pragma: no cover
                print("fail", c, type(e).__name__, str(e)[:200], file=sys.stderr)
                continue
            res.append((nbytes / us / 1e3, us, rep, c))
    res.sort(key=lambda r: -r[0])
    for gbs, us, rep, c in res[:8]:
        print(f"{name} {shape} rep{rep} {us:9.1f} us {gbs:7.0f} GB/s {100 * gbs / copy:5.1f}% {c}")
    worst = res[-1]
    print(f"   worst: {worst[1]:.1f} us {worst[0]:.0f} GB/s {worst[3]}")
    del x
