"""``python -m tritile bench``: time every registered op (GPU) or check it once (CPU)."""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
from importlib import resources
from typing import Any, Dict, List, Optional

import torch

from . import MODULES, load_all


def _norm(v):
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v


#: TileKernels' figures on the H200: the anchor shapes, then more shapes of its benchmark grid (same harness).
ANCHOR_FILES = ("data/tilekernels-h200.json", "data/tilekernels-h200-moe-grid.json")


def load_anchors() -> Dict[str, Any]:
    """Every record of ``ANCHOR_FILES`` (a file is a dict with ``records`` or a bare list of records)."""
    records: List[Dict[str, Any]] = []
    out: Dict[str, Any] = {}
    for name in ANCHOR_FILES:
        path = resources.files("tritile").joinpath(name)
        if not path.is_file():
            continue
        with path.open() as f:
            data = json.load(f)
        if isinstance(data, dict):
            out = {**data, **out} if out else dict(data)
            records += data.get("records", [])
        else:
            records += data
    out["records"] = records
    return out


def make_cases(bop, device, quick: bool, grid: bool = False):
    """``bop.make_cases(device, quick)``, with ``grid=True`` passed to the generators that take it (TileKernels'
    whole benchmark grid for the op; the others have one set of cases)."""
    if grid and "grid" in inspect.signature(bop.make_cases).parameters:
        return bop.make_cases(device, quick, grid=True)
    return bop.make_cases(device, quick)


def _cases(bop, device, quick: bool, grid: bool, rows: List[Dict[str, Any]]):
    """``make_cases``'s cases one by one; a generator that fails adds an ERROR row and ends the op's cases (a broken
    op must not hide the others)."""
    try:
        yield from make_cases(bop, device, quick, grid)
    except Exception as e:
        rows.append(dict(module=bop.module, op=bop.op, params="", status=f"ERROR: {type(e).__name__}: {e}"))


def find_anchor(anchors, kernel: str, params: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    want = {k: _norm(v) for k, v in params.items()}
    for rec in anchors["records"]:
        if rec["kernel"] == kernel and {k: _norm(v) for k, v in rec["params"].items()} == want:
            return rec
    return None


def _fmt_params(p: Dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items())


def _progress(iterable, total, desc):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return iterable


def _run_check(case):
    out = case.fn()
    if case.ref is not None and case.check is not None:
        ref = case.ref()
        case.check(out, ref)
    return out


def run(modules=None, ops=None, quick=False, json_path=None, plot_path=None, out=sys.stdout,
        grid: bool = False, cupti_only: bool = False) -> List[Dict]:
    """Time (GPU) or check (CPU) every registered case.  ``grid``: TileKernels' whole benchmark grid of the ops that
    declare one (``make_cases(device, quick, grid=True)``), and a per-op table of it (× TK, worst shape).
    ``cupti_only``: each case timed by the CUPTI timer alone (its µs, GB/s and % of copy come from it)."""
    from ..testing.generator import get_device

    device = get_device()
    on_gpu = device.type == "cuda"
    registry = [b for b in load_all(modules or MODULES)
                if (ops is None or b.op in ops)]
    anchors = load_anchors()
    rows: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)",
    }
    if on_gpu:
        from ..testing.bench import copy_bandwidth_gbs, time_events, time_graph, time_host, time_kernels

        copy_bw = copy_bandwidth_gbs()
        meta["copy_bandwidth_gbs"] = round(copy_bw, 1)
        print(f"# {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
              f"device-to-device copy {copy_bw:.0f} GB/s (read + write)", file=out)
    else:
        print("# CPU run (Triton interpreter): a correctness pass on small shapes; timings need a GPU.", file=out)

    for bop in _progress(registry, len(registry), "bench"):
        # One case at a time: a case's inputs are freed before the next one is built (a whole grid's inputs
        # would not fit in GPU memory at once).
        for case in _cases(bop, device, quick, grid, rows):
            row: Dict[str, Any] = dict(module=bop.module, op=bop.op + (f"[{case.label}]" if case.label else ""),
                                       params=_fmt_params(case.params))
            try:
                _run_check(case)
                row["status"] = "ok" if case.check is not None else "ran"
            except AssertionError as e:
                row["status"] = f"FAIL: {str(e)[:120]}"
            except Exception as e:
                row["status"] = f"ERROR: {type(e).__name__}: {str(e)[:120]}"
            if on_gpu and not row["status"].startswith(("FAIL", "ERROR")):
                if cupti_only:  # the CUPTI timer alone (L2 flushed): the one x TK uses
                    ku = time_kernels(case.fn, rep=20)
                    us = ku if ku is not None else time_events(case.fn)
                else:
                    # Kernel time: CUDA-graph replay (no Python in the loop), as TileKernels' CUPTI timer sees
                    # it.  Event timing of single calls also includes the host's launch cost whenever that is
                    # longer than the kernel; it is reported separately, with the host cost per call.
                    ev = time_events(case.fn)
                    g = time_graph(case.fn, calls_per_graph=20 if ev < 200 else 3, rep=20 if ev < 200 else 5)
                    us = g if g is not None else ev
                    row["event_us"] = round(ev, 2)
                    row["host_us"] = round(time_host(case.fn, n=200 if ev < 200 else 20), 2)
                    # Kernel execution only (CUPTI records, L2 flushed, gaps between kernels left out): the timer
                    # behind TileKernels' figures, so the ratio to TileKernels uses it when it is available.
                    ku = time_kernels(case.fn, rep=30 if ev < 2000 else 5)
                row["us"] = round(us, 2)
                row["cupti_us"] = None if ku is None else round(ku, 2)
                if case.nbytes:
                    row["gbs"] = round(case.nbytes / us / 1e3, 1)
                    row["pct_copy"] = round(100 * row["gbs"] / copy_bw, 1)
                if case.ref is not None and not grid and not cupti_only:  # grids compare with TileKernels only
                    try:
                        ref_us = time_events(case.ref, warmup=3, rep=10, min_ms=5)
                        row["ref_us"] = round(ref_us, 2)
                        row["speedup_vs_ref"] = round(ref_us / us, 2)
                    except Exception:
                        row["ref_us"] = None
                if case.anchor is not None:
                    rec = find_anchor(anchors, *case.anchor)
                    if rec is not None:
                        row["tk_us"] = rec["time_us"]
                        row["vs_tk"] = round(rec["time_us"] / (ku or us), 2)
                        if not cupti_only:
                            row["vs_tk_graph"] = round(rec["time_us"] / us, 2)
                    else:
                        row["vs_tk"] = "no anchor"
            rows.append(row)
            if json_path:  # written as we go, so a run cut short still leaves its rows
                with open(json_path, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
            del case
            torch.cuda.empty_cache() if on_gpu else None

    _print_table(rows, on_gpu, out)
    if grid and on_gpu:
        print_grid_tables(rows, out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if plot_path and on_gpu:
        _plot(rows, meta.get("copy_bandwidth_gbs"), plot_path)
    return rows


def _print_table(rows, on_gpu, out):
    if on_gpu:
        cols = ["module", "op", "params", "us", "cupti_us", "event_us", "host_us", "gbs", "pct_copy",
                "speedup_vs_ref", "tk_us", "vs_tk", "vs_tk_graph", "status"]
        heads = ["module", "op", "shape/flags", "µs (graph)", "µs (CUPTI)", "event µs", "host µs", "GB/s", "% copy",
                 "× ref", "TK µs", "× TK", "× TK (graph)", "check"]
    else:
        cols = ["module", "op", "params", "status"]
        heads = ["module", "op", "shape/flags", "check"]
    print("| " + " | ".join(heads) + " |", file=out)
    print("|" + "---|" * len(heads), file=out)
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |", file=out)
    bad = [r for r in rows if str(r.get("status", "")).startswith(("FAIL", "ERROR"))]
    print(f"\n{len(rows) - len(bad)} passed, {len(bad)} failed", file=out)


def print_grid_tables(rows, out=sys.stdout) -> None:
    """One Markdown table per op (``benchmarks/RESULTS.md``'s grid tables): the shape, TileKernels' µs where an anchor
    has it, ours (CUPTI with L2 flushed when available, else graph), × TK, % of copy, and the single call's event and
    host µs (launch cost; a synchronising op's host sync shows in its event µs against its no-sync case's); then a
    summary line with the op's worst shape and the geometric mean of × TK."""
    ops: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        ops.setdefault(r["op"], []).append(r)
    for op, rs in ops.items():
        print(f"\n#### {op}\n\n| shape | TK µs | tritile µs | × TK | % copy | event µs | host µs |\n"
              "|---|---|---|---|---|---|---|", file=out)
        ratios = []
        for r in rs:
            ours = r.get("cupti_us") or r.get("us")
            ratio = r["vs_tk"] if isinstance(r.get("vs_tk"), (int, float)) else None
            if ratio is not None:
                ratios.append((ratio, r["params"]))
            cells = [r["params"], r.get("tk_us", ""), "" if ours is None else ours,
                     "" if ratio is None else f"{ratio:.2f}", r.get("pct_copy", ""), r.get("event_us", ""),
                     r.get("host_us", "")]
            if str(r.get("status", "")).startswith(("FAIL", "ERROR")):
                cells[2] = r["status"][:60]
            print("| " + " | ".join(str(c) for c in cells) + " |", file=out)
        if ratios:
            worst = min(ratios)
            geo = math.exp(sum(math.log(max(x, 1e-9)) for x, _ in ratios) / len(ratios))
            print(f"\n{op}: {len(rs)} shapes, {len(ratios)} with a TileKernels figure; worst {worst[0]:.2f}× TK at "
                  f"{worst[1]}; geometric mean {geo:.2f}×.", file=out)
        else:
            print(f"\n{op}: {len(rs)} shapes, none with a TileKernels figure.", file=out)


def _plot(rows, copy_bw, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    pts = [r for r in rows if r.get("gbs")]
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(pts)), 5))
    ax.bar(range(len(pts)), [r["gbs"] for r in pts], color="tab:blue")
    tk = [(i, r["tk_us"] and r["gbs"] * r["us"] / r["tk_us"]) for i, r in enumerate(pts) if r.get("tk_us")]
    if tk:
        ax.scatter([i for i, _ in tk], [v for _, v in tk], color="tab:red", marker="_", s=200, label="TileKernels")
    if copy_bw:
        ax.axhline(copy_bw, color="k", ls="--", label=f"copy {copy_bw:.0f} GB/s")
    ax.set_xticks(range(len(pts)))
    ax.set_xticklabels([r["op"] for r in pts], rotation=75, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
