"""The same-size copy ceiling of each op below 90 % of the copy bandwidth (H200 evidence for the targets).

For each op's byte count (TileKernels' count: inputs read once, outputs written once), a device-to-device copy moving
the same bytes (half read, half written), timed as the benchmark's CUPTI column (kernel time, L2 flushed): torch's
``neg`` on int32 words (a vectorised elementwise kernel; not ``bitwise_not``, which ``time_kernels`` leaves out as
its L2 flush) and a plain Triton copy (16-byte accesses, a few tile sizes, the
best kept).  Prints µs and % of the 1 GiB copy bandwidth measured in the same run, and writes JSON to argv[1]."""
import json
import sys

import torch
import triton
import triton.language as tl

from tritile.testing.bench import copy_bandwidth_gbs, time_kernels

# op: bytes (benchmarks/RESULTS.md's anchors; count_bytes of each op's inputs and outputs)
OPS = {
    "per_token_cast FP4 -> FP4 (8001 x 7168)": 58.4e6,
    "per_channel_cast (4096 x 7168)": 89.0e6,
    "per_block_cast_lossless": 95.0e6,
    "transpose fp8 (8064 x 7168)": 115.6e6,
    "swiglu + per-channel (4096 x 7168)": 150.5e6,
    "per_block_cast 128 x 128": 172.1e6,
    "per_channel_cast_and_transpose": 175.2e6,
    "swiglu backward": 3.33e9,
}


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + off, tl.load(src + off, mask=off < n), mask=off < n)


def neg_copy_us(nbytes: float) -> float:
    """CUPTI µs (L2 flushed) of torch.neg over int32 words moving ``nbytes`` (half read, half written)."""
    s = torch.empty(int(nbytes) // 2 // 16 * 4, dtype=torch.int32, device="cuda").random_(0, 1 << 30)
    d = torch.empty_like(s)
    return time_kernels(lambda: torch.neg(s, out=d))


def main():
    ref = copy_bandwidth_gbs()
    print(f"copy 1 GiB (events): {ref:.0f} GB/s", flush=True)
    rows = []
    for name, nbytes in OPS.items():
        n = int(nbytes) // 2 // 16 * 16  # n bytes read, n written
        bn = neg_copy_us(nbytes)
        s32 = torch.empty(n // 4, dtype=torch.int32, device="cuda").random_(0, 1 << 30)
        d32 = torch.empty_like(s32)
        tri = {}
        for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8)):
            tri[f"{block}x{warps}"] = time_kernels(
                lambda s=s32, d=d32, b=block, w=warps: _copy[(triton.cdiv(s.numel(), b),)](s, d, s.numel(), BLOCK=b,
                                                                                          num_warps=w))
        best = min(tri, key=tri.get)
        row = dict(op=name, bytes=2 * n, neg_us=bn, triton_us=tri[best], triton_cfg=best, all=tri,
                   neg_pct=2 * n / bn / 1e3 / ref * 100, triton_pct=2 * n / tri[best] / 1e3 / ref * 100)
        rows.append(row)
        print(f"{name:45s} {2 * n / 1e6:8.1f} MB: torch neg {bn:8.2f} us {row['neg_pct']:5.1f} %, "
              f"triton copy {tri[best]:8.2f} us {row['triton_pct']:5.1f} % ({best})", flush=True)
        del s32, d32
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(dict(copy_gbs=ref, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
