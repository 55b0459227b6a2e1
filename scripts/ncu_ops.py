"""Profile one call of each op's anchor case (the benchmark cases with a TileKernels anchor) under Nsight Compute.

Run as ``ncu --profile-from-start off [sections] python scripts/ncu_ops.py OP [OP ...]``: each case is warmed up,
then one call runs between ``cudaProfilerStart`` and ``cudaProfilerStop``, preceded by an element-wise kernel that
reads and writes the same number of bytes (``torch.bitwise_not`` on int32: a copy that Nsight Compute sees as a kernel,
unlike ``copy_``'s cudaMemcpy), so that each op's DRAM throughput can be read beside a plain copy's at its own size.  ``--quick`` takes the benchmark's quick cases; ``--all-cases`` every case, not only
anchored ones.  ``--config NAME '{"KEY": value}'`` (repeatable) profiles under ``override_config(NAME, ...)``: a
tune candidate (NAME is the op's config name, e.g. ``per_block_cast_lossless`` or ``cast_back``).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from tritile.bench import load_all
from tritile.runtime import override_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="+")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--all-cases", action="store_true")
    ap.add_argument("--config", nargs=2, action="append", default=[], metavar=("NAME", "JSON"))
    args = ap.parse_args()
    # every case runs once per config: the default first, then each --config candidate
    configs = [None] + [(name, json.loads(js)) for name, js in args.config]
    dev = torch.device("cuda")
    for bop in load_all():
        if bop.op not in args.ops:
            continue
        for case, cfg in ((c, g) for c in bop.make_cases(dev, args.quick) for g in configs):
            if case.anchor is None and not args.all_cases:
                continue
            with (override_config(cfg[0], **cfg[1]) if cfg else contextlib.nullcontext()):
                _profile(bop, case, cfg, dev)


def _profile(bop, case, cfg, dev) -> None:
    n = max(case.nbytes // 8, 1 << 18)
    src = torch.zeros(n, dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        case.fn()
        torch.bitwise_not(src, out=dst)
    torch.cuda.synchronize()
    print(f"== {bop.op} {case.label} {case.params} nbytes={case.nbytes} config={cfg}", flush=True)
    torch.cuda.profiler.start()
    torch.bitwise_not(src, out=dst)
    case.fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
