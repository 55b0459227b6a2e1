"""Fixed cost against steady rate: each op below 90 % of the copy bandwidth timed at its anchor (rows N) and at 2N
rows (H200 evidence for where the gap to the copy sits).

CUPTI kernel time with L2 flushed, as the benchmark's "µs (CUPTI)" column.  From t(N) and t(2N): the steady rate
(B(2N) - B(N)) / (t(2N) - t(N)) as % of the 1 GiB copy bandwidth measured in the same run, and the fixed cost
2 t(N) - t(2N) (the launch's ramp and tail, and anything else that does not grow with the rows).  A copy (torch.neg
on int32 words) moving the same bytes is timed the same way.  Usage: python scripts/steady_probe.py [op substrings]"""
import sys

import torch

from copy_ceiling import neg_copy_us
from tritile.quant import (per_block_cast, per_channel_cast, per_channel_cast_and_transpose, per_token_cast,
                           swiglu_backward_and_per_token_cast)
from tritile.bench.cases.quant import _moe
from tritile.testing import count_bytes
from tritile.testing.bench import copy_bandwidth_gbs, time_kernels
from tritile.torch import cast
from tritile.transpose import transpose


def _fp4(rows):
    x = torch.randn(rows, 7168, device="cuda")
    qx = cast(x, "e2m1", (32, 32), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    return lambda: per_token_cast(qx, "e2m1", 128, (32, 32), True, True, True), (qx,)


def _per_block(rows):
    x = torch.randn(rows, 7168, device="cuda", dtype=torch.bfloat16)
    return lambda: per_block_cast(x, "e4m3", (128, 128), False, True, False), (x,)


def _per_channel(rows):
    x = torch.randn(rows, 7168, device="cuda", dtype=torch.bfloat16)
    return lambda: per_channel_cast(x, "e4m3", 128, False), (x,)


def _pcat(rows):
    x = torch.randn(rows, 7168, device="cuda", dtype=torch.bfloat16)
    return lambda: per_channel_cast_and_transpose(x, "e4m3", 128, False), (x,)


def _transpose_fp8(rows):
    x = torch.randn(rows, 7168, device="cuda").to(torch.float8_e4m3fn)
    return lambda: transpose(x), (x,)


def _swiglu_bwd(tokens):
    x, _, p2tk, tk2p = _moe(torch.device("cuda"), tokens, 9, 4, 64, 7168, 128)
    xq = cast(x, "e4m3", (1, 128))
    del x
    w = torch.rand((tokens, 9), device="cuda")
    g = torch.randn((xq[0].shape[0], 7168), dtype=torch.bfloat16, device="cuda")
    return (lambda: swiglu_backward_and_per_token_cast(xq, g, w, p2tk, tk2p, 128, round_sf=True,
                                                       swiglu_clamp_value=0.5)), (xq, g, w, p2tk, tk2p)


OPS = {"per_token_cast FP4 -> FP4": (_fp4, 8001), "per_block_cast 128x128": (_per_block, 8001),
       "per_channel_cast": (_per_channel, 4096), "per_channel_cast_and_transpose": (_pcat, 8064),
       "transpose fp8": (_transpose_fp8, 8064), "swiglu backward": (_swiglu_bwd, 36207)}


def main():
    want = sys.argv[1:]
    ref = copy_bandwidth_gbs()
    print(f"copy 1 GiB (events): {ref:.0f} GB/s", flush=True)
    for name, (make, n) in OPS.items():
        if want and not any(w in name for w in want):
            continue
        t, b = [], []
        for rows in (n, 2 * n):
            fn, inputs = make(rows)
            out = fn()
            b.append(count_bytes(*inputs, out))
            t.append(time_kernels(fn))
            del fn, inputs, out
            torch.cuda.empty_cache()
        c = [neg_copy_us(v) for v in b]
        steady = (b[1] - b[0]) / (t[1] - t[0]) / 1e3
        csteady = (b[1] - b[0]) / (c[1] - c[0]) / 1e3
        print(f"{name:32s} N: {t[0]:8.2f} us {b[0] / t[0] / 1e3 / ref:6.1%} (copy {c[0]:8.2f} us "
              f"{b[0] / c[0] / 1e3 / ref:6.1%}); 2N: {t[1]:8.2f} us {b[1] / t[1] / 1e3 / ref:6.1%} (copy {c[1]:8.2f} "
              f"us); steady {steady / ref:6.1%} (copy {csteady / ref:6.1%}); fixed {2 * t[0] - t[1]:6.2f} us "
              f"(copy {2 * c[0] - c[1]:6.2f} us)", flush=True)


if __name__ == "__main__":
    main()
