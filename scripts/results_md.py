"""Render bench JSON files (from `python -m tritile bench --json`) into benchmarks/RESULTS.md.

    python scripts/results_md.py out/bench_*.json > benchmarks/RESULTS.md
"""

import json
import sys


def main(paths):
    rows, meta = [], None
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        meta = meta or d["meta"]
        rows += d["rows"]
    print("# tritile on the H200: latest benchmark results\n")
    print(f"- Date: {meta['date']}; GPU: {meta['device']}; torch {meta['torch']}; Triton {meta['triton']}.")
    print(f"- Device-to-device copy bandwidth measured in the same run: **{meta.get('copy_bandwidth_gbs')} GB/s** "
          "(bytes read + written).")
    print("- µs: kernel time per call, the median over CUDA-graph replays (no Python in the loop, as TileKernels' "
          "CUPTI timer sees it); event µs: single calls timed with CUDA events, which include the host's launch "
          "cost when that exceeds the kernel; host µs: Python + launch cost per call (back-to-back calls).")
    print("- GB/s counts bytes as TileKernels does (each input read once, each output written once); "
          "× TK = TileKernels' µs / ours at the same shape (> 1 is faster); × ref = the `tritile.torch` reference's µs / ours.\n")
    cols = ["module", "op", "params", "us", "event_us", "host_us", "gbs", "pct_copy", "tk_us", "vs_tk",
            "speedup_vs_ref", "status"]
    heads = ["module", "op", "shape / flags", "µs", "event µs", "host µs", "GB/s", "% copy", "TK µs", "× TK",
             "× ref", "check"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r.get(c)).replace("|", "/") for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
