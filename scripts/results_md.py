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
    print("- µs (graph): time per call, the median over CUDA-graph replays (no Python in the loop; the gaps between "
          "consecutive kernels are included).  µs (CUPTI): the summed durations of the call's kernels from the "
          "profiler's CUPTI records, L2 flushed before each call, gaps excluded: how TileKernels' timer counts.  "
          "event µs: single calls timed with CUDA events (includes the host's launch cost when that exceeds the "
          "kernel); host µs: Python + launch cost per call (back-to-back calls).")
    print("- GB/s and % copy use µs (graph), counting bytes as TileKernels does (each input read once, each output "
          "written once).  × TK = TileKernels' µs / our µs (CUPTI) at the same shape (> 1 is faster); × TK (graph) "
          "uses µs (graph) instead; × ref = the `tritile.torch` reference's µs / ours.\n")
    cols = ["module", "op", "params", "us", "cupti_us", "event_us", "host_us", "gbs", "pct_copy", "tk_us", "vs_tk",
            "vs_tk_graph", "speedup_vs_ref", "status"]
    heads = ["module", "op", "shape / flags", "µs (graph)", "µs (CUPTI)", "event µs", "host µs", "GB/s", "% copy",
             "TK µs", "× TK", "× TK (graph)", "× ref", "check"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r.get(c)).replace("|", "/") for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
