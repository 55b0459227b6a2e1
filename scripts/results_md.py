"""Render bench JSON files (from `python -m tritile bench --json`) into benchmarks/RESULTS.md.

    python scripts/results_md.py [--commit HASH] out/bench_*.json > benchmarks/RESULTS.md
    python scripts/results_md.py --grid [--commit HASH] out/*_grid.json > benchmarks/GRID.md

``--grid`` renders `python -m tritile bench --grid` runs as one table per op (TileKernels' µs where an anchor has it,
ours, × TK, % copy) with each op's worst shape and geometric mean.

The provenance line names the date and GPU from the JSON and the commit the run measured: ``--commit``, else the
JSON's ``meta["commit"]``, else the checkout's HEAD (`scripts/gpu_check.sh` writes it to ``env.txt``).  Design notes
and the alternatives each op's default beat are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import List, Optional

COLS = ["module", "op", "params", "us", "cupti_us", "event_us", "host_us", "gbs", "pct_copy", "tk_us", "vs_tk",
        "vs_tk_graph", "speedup_vs_ref", "status"]
HEADS = ["module", "op", "shape / flags", "µs (graph)", "µs (CUPTI)", "event µs", "host µs", "GB/s", "% copy",
         "TK µs", "× TK", "× TK (graph)", "× ref", "check"]


def _head_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def render(paths: List[str], commit: Optional[str] = None) -> str:
    rows, meta = [], None
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        meta = meta or d["meta"]
        rows += d["rows"]
    commit = commit or meta.get("commit") or _head_commit() or "unknown"
    out = ["# tritile on the H200: latest benchmark results\n"]
    out.append(f"- Date: {meta['date']}; GPU: {meta['device']}; commit {commit}; torch {meta['torch']}; "
               f"Triton {meta['triton']}.")
    out.append(f"- Device-to-device copy bandwidth measured in the same run: **{meta.get('copy_bandwidth_gbs')} GB/s** "
               "(bytes read + written).")
    out.append("- µs (graph): time per call, the median over CUDA-graph replays (no Python in the loop; the gaps "
               "between consecutive kernels are included).  µs (CUPTI): the summed durations of the call's kernels "
               "from the profiler's CUPTI records, L2 flushed before each call, gaps excluded: how TileKernels' timer "
               "counts.  event µs: single calls timed with CUDA events (includes the host's launch cost when that "
               "exceeds the kernel); host µs: Python + launch cost per call (back-to-back calls).")
    out.append("- GB/s and % copy use µs (graph), counting bytes as TileKernels does (each input read once, each "
               "output written once).  × TK = TileKernels' µs / our µs (CUPTI) at the same shape (> 1 is faster); "
               "× TK (graph) uses µs (graph) instead; × ref = the `tritile.torch` reference's µs / ours.")
    out.append("- Graph figures of ops under ~200 MB are flattered by L2 (no flush between replays); judge them on "
               "the CUPTI column.  Design, bound and the alternatives that lost, per op: docs/PERFORMANCE.md.\n")
    out.append("| " + " | ".join(HEADS) + " |")
    out.append("|" + "---|" * len(HEADS))
    for r in rows:
        out.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)).replace("|", "/") for c in COLS) + " |")
    return "\n".join(out) + "\n"


def render_grid(paths: List[str], commit: Optional[str] = None) -> str:
    """The grid runs of ``paths`` as per-op tables (``tritile.bench.runner.print_grid_tables``) under a provenance
    header; a later file's rows of an op replace an earlier file's (a re-run of some ops after a change)."""
    import io

    from tritile.bench.runner import print_grid_tables

    by_op, metas = {}, []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        metas.append(d["meta"])
        ops = {}
        for r in d["rows"]:
            ops.setdefault(r["op"].split("[")[0], []).append(r)
        by_op.update(ops)
    meta = metas[0]
    commit = commit or meta.get("commit") or _head_commit() or "unknown"
    buf = io.StringIO()
    print_grid_tables([r for rs in by_op.values() for r in rs], buf)
    bws = sorted({m.get("copy_bandwidth_gbs") for m in metas if m.get("copy_bandwidth_gbs")})
    head = [f"- Date: {meta['date']}; GPU: {meta['device']}; commit {commit}; torch {meta['torch']}; "
            f"Triton {meta['triton']}; copy bandwidth in the same runs: {', '.join(str(b) for b in bws)} GB/s.",
            "- tritile µs: CUPTI kernel time with L2 flushed (TileKernels' timer), else graph time.  × TK = "
            "TileKernels' µs / ours.  Token counts: TileKernels' own where it has a figure, else one seeded draw of "
            "its routing.  event µs / host µs: a single call with CUDA events / the host's cost per call (a "
            "synchronising op's host sync shows in its event µs).\n"]
    return "\n".join(head) + buf.getvalue()


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", help="the commit the run measured (default: the JSON's, else HEAD)")
    ap.add_argument("paths", nargs="+", help="bench JSON files")
    ap.add_argument("--grid", action="store_true", help="render `bench --grid` runs as per-op grid tables")
    args = ap.parse_args(argv)
    print((render_grid if args.grid else render)(args.paths, args.commit), end="")


if __name__ == "__main__":
    main()
