"""Render bench JSON files (from `python -m tritile bench --json`) into benchmarks/RESULTS.md.

    python scripts/results_md.py [--commit HASH] out/bench_*.json > benchmarks/RESULTS.md
    python scripts/results_md.py --grid [--commit HASH] out/*_grid.json > benchmarks/GRID.md
    python scripts/results_md.py --side [--commit HASH] [--tk-commit HASH] out/bench_tk.json >> benchmarks/RESULTS.md

``--grid`` renders `python -m tritile bench --grid` runs as one table per op (TileKernels' µs, ours, × TK, % copy) with
each op's worst shape and geometric mean.  ``--side`` renders runs with TileKernels side by side (`bench --against
tilekernels`, with or without `--grid` and `--eager`) as RESULTS.md sections: per module, a table per op with both
times and × TK, kernel and eager, its worst shape and geometric mean, then the geometric mean per module.

The provenance line names the date and GPU from the JSON and the commit the run measured: ``--commit``, else the
JSON's ``meta["commit"]``, else the checkout's HEAD (`scripts/gpu_check.sh` writes it to ``env.txt``); TileKernels'
commit likewise from ``--tk-commit`` or ``meta["tilekernels"]["commit"]``.  Design notes and the alternatives each
op's default beat are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
from typing import Any, Dict, List, Optional, Tuple

COLS = ["module", "op", "params", "us", "cupti_us", "event_us", "host_us", "eager_us", "host_cost_us", "gbs",
        "pct_copy", "tk_us", "vs_tk", "tk_eager_us", "vs_tk_eager", "vs_tk_graph", "speedup_vs_ref", "tk_status",
        "status"]
HEADS = ["module", "op", "shape / flags", "µs (graph)", "µs (CUPTI)", "event µs", "host µs", "eager µs",
         "host cost µs", "GB/s", "% copy", "TK µs", "× TK", "TK eager µs", "× TK eager", "× TK (graph)", "× ref", "TK",
         "check"]
#: Columns shown even when no row has them (the main table's fixed frame).
_ALWAYS = {"module", "op", "params", "status"}


def _head_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _load(paths: List[str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    metas, rows = [], []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        metas.append(d["meta"])
        rows += d["rows"]
    return metas, rows


def _tk_line(meta: Dict[str, Any], tk_commit: Optional[str] = None) -> str:
    """Where the × TK figures come from (a run without the key used the recorded figures)."""
    tk = meta.get("tilekernels") or dict(source="recorded")
    if tk.get("source") == "live":
        return (f"- TileKernels run natively in the same process, on the same inputs, with the same timers; its commit "
                f"{tk_commit or tk.get('commit') or 'unknown'}.")
    return ("- × TK uses TileKernels' recorded H200 figures (tritile/data/tilekernels-h200*.json) where one exists"
            + (f": {tk['reason']}." if tk.get("reason") else "."))


def render(paths: List[str], commit: Optional[str] = None) -> str:
    metas, rows = _load(paths)
    meta = metas[0]
    commit = commit or meta.get("commit") or _head_commit() or "unknown"
    out = [f"# tritile on the {meta.get('device', 'GPU')}: latest benchmark results\n"]
    out.append(f"- Date: {meta['date']}; GPU: {meta['device']}; commit {commit}; torch {meta['torch']}; "
               f"Triton {meta['triton']}.")
    out.append(f"- Device-to-device copy bandwidth measured in the same run: **{meta.get('copy_bandwidth_gbs')} GB/s** "
               "(bytes read + written).")
    out.append("- µs (graph): time per call, the median over CUDA-graph replays (no Python in the loop; the gaps "
               "between consecutive kernels are included).  µs (CUPTI): the summed durations of the call's kernels "
               "from the profiler's CUPTI records, L2 flushed before each call, gaps excluded: how TileKernels' timer "
               "counts.  event µs: single calls timed with CUDA events (includes the host's launch cost when that "
               "exceeds the kernel); host µs: Python + launch cost per call (back-to-back calls).  eager µs: what a "
               "caller waits for per call (100 back-to-back calls, fewer for long ops, one synchronize at the end, "
               "best of 5); host cost µs = eager µs - µs (CUPTI).")
    out.append("- GB/s and % copy use µs (graph), counting bytes as TileKernels does (each input read once, each "
               "output written once).  × TK = TileKernels' µs / our µs (CUPTI) at the same shape (> 1 is faster); "
               "× TK eager the same with eager µs; × TK (graph) uses µs (graph) instead; × ref = the `tritile.torch` "
               "reference's µs / ours.")
    out.append(_tk_line(meta))
    out.append("- Graph figures of ops under ~200 MB are flattered by L2 (no flush between replays); judge them on "
               "the CUPTI column.  Design, bound and the alternatives that lost, per op: docs/PERFORMANCE.md.\n")
    cols = [(c, h) for c, h in zip(COLS, HEADS) if c in _ALWAYS or any(r.get(c) is not None for r in rows)]
    out.append("| " + " | ".join(h for _, h in cols) + " |")
    out.append("|" + "---|" * len(cols))
    for r in rows:
        out.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)).replace("|", "/") for c, _ in cols)
                   + " |")
    return "\n".join(out) + "\n"


def _by_op(paths: List[str]) -> Tuple[List[Dict[str, Any]], Dict[str, List[Dict[str, Any]]]]:
    """The runs' metas and their rows by op; a later file's rows of an op replace an earlier file's (a re-run of some
    ops after a change)."""
    by_op: Dict[str, List[Dict[str, Any]]] = {}
    metas = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        metas.append(d["meta"])
        ops: Dict[str, List[Dict[str, Any]]] = {}
        for r in d["rows"]:
            ops.setdefault(r["op"].split("[")[0], []).append(r)
        by_op.update(ops)
    return metas, by_op


def render_grid(paths: List[str], commit: Optional[str] = None) -> str:
    """The grid runs of ``paths`` as per-op tables (``tritile.bench.runner.print_grid_tables``) under a provenance
    header; a later file's rows of an op replace an earlier file's (a re-run of some ops after a change)."""
    from tritile.bench.runner import print_grid_tables

    metas, by_op = _by_op(paths)
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
            "synchronising op's host sync shows in its event µs).",
            _tk_line(meta) + "\n"]
    return "\n".join(head) + buf.getvalue()


def render_side(paths: List[str], commit: Optional[str] = None, tk_commit: Optional[str] = None) -> str:
    """``bench --against tilekernels`` runs as RESULTS.md sections: a provenance header (date, GPU, both commits),
    then per module a table per op (both times, × TK kernel and eager, the worst shape and geometric mean) and last
    the geometric means per op and per module."""
    from tritile.bench.runner import print_grid_tables, print_tk_summary

    metas, by_op = _by_op(paths)
    meta = metas[0]
    commit = commit or meta.get("commit") or _head_commit() or "unknown"
    rows = [r for rs in by_op.values() for r in rs]
    tk = meta.get("tilekernels") or {}
    live = tk.get("source") == "live"
    eager = any(r.get("eager_us") is not None for r in rows)
    out = io.StringIO()
    print(f"## tritile and TileKernels side by side ({'TileKernels run natively' if live else 'recorded figures'})\n",
          file=out)
    print(f"- Date: {meta['date']}; GPU: {meta['device']}; tritile commit {commit}; TileKernels commit "
          f"{(tk_commit or tk.get('commit') or 'unknown') if live else 'n/a'}; torch {meta['torch']}; "
          f"Triton {meta['triton']}.", file=out)
    print(_tk_line(meta, tk_commit), file=out)
    print("- TK µs / tritile µs: kernel time per call (CUPTI records, L2 flushed before each call: TileKernels' timer); "
          "× TK = TK µs / tritile µs (> 1: tritile faster)."
          + ("  TK eager µs / eager µs: what a caller waits for per call (100 back-to-back calls, fewer for long "
             "ops, one synchronize at the end, best of 5); × TK eager likewise; host cost = eager µs - tritile µs."
             if eager else ""), file=out)
    modules: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        modules.setdefault(r.get("module", ""), []).append(r)
    for name, rs in modules.items():
        print(f"\n### {name}", file=out)
        print_grid_tables(rs, out)
    print("\n### Worst shape and geometric mean, per op and per module", file=out)
    print_tk_summary(rows, out)
    return out.getvalue()


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", help="the commit the run measured (default: the JSON's, else HEAD)")
    ap.add_argument("--tk-commit", help="with --side: TileKernels' commit (default: the JSON's)")
    ap.add_argument("paths", nargs="+", help="bench JSON files")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--grid", action="store_true", help="render `bench --grid` runs as per-op grid tables")
    mode.add_argument("--side", action="store_true",
                      help="render `bench --against tilekernels` runs as side-by-side sections per module")
    args = ap.parse_args(argv)
    if args.side:
        text = render_side(args.paths, args.commit, args.tk_commit)
    else:
        text = (render_grid if args.grid else render)(args.paths, args.commit)
    print(text, end="")


if __name__ == "__main__":
    main()
