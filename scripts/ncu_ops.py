"""Profile one call of each op's anchor case (the benchmark cases with a TileKernels anchor) under Nsight Compute.

Run as ``ncu --profile-from-start off [sections] python scripts/ncu_ops.py OP [OP ...]``: each case is warmed up,
then one call runs between ``cudaProfilerStart`` and ``cudaProfilerStop``, preceded by a device-to-device copy of
the same number of bytes (half read, half written), so that each op's DRAM throughput can be read beside a plain
copy's at its own size.  ``--quick`` takes the benchmark's quick cases; ``--all-cases`` every case, not only
anchored ones.
"""

from __future__ import annotations

import argparse

import torch

from tritile.bench import load_all


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="+")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--all-cases", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for bop in load_all():
        if bop.op not in args.ops:
            continue
        for case in bop.make_cases(dev, args.quick):
            if case.anchor is None and not args.all_cases:
                continue
            n = max(case.nbytes // 2, 1 << 20)
            src = torch.empty(n, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            for _ in range(3):
                case.fn()
                dst.copy_(src)
            torch.cuda.synchronize()
            print(f"== {bop.op} {case.label} {case.params} nbytes={case.nbytes}", flush=True)
            torch.cuda.profiler.start()
            dst.copy_(src)
            case.fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            del src, dst


if __name__ == "__main__":
    main()
