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


def gpu_timers():
    """The GPU timers behind a timed run: CUDA events, CUDA-graph replay, host cost, CUPTI kernel time with L2 flushed
    (TileKernels' timer), eager time per call, and the copy bandwidth.  ``run(timers=...)`` takes any object with
    these attributes (tests pass fakes to drive the timing paths on the CPU)."""
    from types import SimpleNamespace

    from ..testing.bench import copy_bandwidth_gbs, time_events, time_graph, time_host, time_kernels
    from .timing import time_eager

    return SimpleNamespace(copy_bandwidth=copy_bandwidth_gbs, events=time_events, graph=time_graph, host=time_host,
                           kernels=time_kernels, eager=time_eager)


def _round(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 2)


def _against_tk(case, row: Dict[str, Any], tk_get, timers, eager: bool, sync) -> None:
    """TileKernels' op on the case's inputs, timed right after tritile's with the same timers: ``tk_us`` (CUPTI),
    ``vs_tk`` (its µs / ours), and with ``eager`` ``tk_eager_us`` / ``vs_tk_eager``; ``tk_status`` says why a case
    has none (no counterpart, or TileKernels' call failed)."""
    try:
        tk_fn = case.counterpart(tk_get)
    except LookupError as e:
        row["tk_status"] = f"no TileKernels op: {e}"
        return
    except Exception as e:  # a factory that fails on TileKernels' ops
        row["tk_status"] = f"TileKernels ERROR: {type(e).__name__}: {str(e)[:120]}"
        return
    if tk_fn is None:
        row["tk_status"] = f"no TileKernels op: {case.no_tk or 'the case names no op'}"
        return
    try:
        tk_fn()  # untimed: TileLang compiles a kernel on its first call (seconds; cached on disk after)
        sync()
        ku = timers.kernels(tk_fn, rep=20)
        eu = timers.eager(tk_fn)[0] if eager else None
    except Exception as e:
        row["tk_status"] = f"TileKernels ERROR: {type(e).__name__}: {str(e)[:120]}"
        return
    ours = row.get("cupti_us") or row.get("us")
    row["tk_source"] = "live"
    row["tk_us"] = _round(ku)
    if ku is not None and ours:
        row["vs_tk"] = round(ku / ours, 2)
    if eu is not None:
        row["tk_eager_us"] = _round(eu)
        if row.get("eager_us"):
            row["vs_tk_eager"] = round(eu / row["eager_us"], 2)


def _selection_args(modules, ops, quick, grid, against) -> List[str]:
    args = [a for m in (modules or []) for a in ("--module", m)] + [a for o in (ops or []) for a in ("--op", o)]
    return args + (["--quick"] if quick else []) + (["--grid"] if grid else []) + \
        (["--against", against] if against else [])


def warm_in_parallel(procs: int, modules=None, ops=None, quick=False, grid=False, against=None,
                     out=None, command: Optional[List[str]] = None) -> int:
    """Run every selected case once, tritile's call and TileKernels' (with ``against``), in ``procs`` processes
    (``bench --warm-only --shard i/procs``), untimed: TileLang compiles each kernel on its first call (~5 s) and
    Triton each variant, both into caches on disk (``~/.tilelang/cache``, ``~/.triton/cache``) that the timing process
    then finds.  Prints the cases that failed there (the timing run calls them again and reports them); returns their
    number, plus the processes that ended without finishing.  ``command``: the program before ``bench``'s arguments
    (default ``python -m tritile``)."""
    import subprocess
    import tempfile

    out = out or sys.stdout
    t0 = time.time()
    base = [*(command or [sys.executable, "-m", "tritile"]), "bench",
            *_selection_args(modules, ops, quick, grid, against), "--warm-only"]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(procs)]
    children = [subprocess.Popen(base + ["--shard", f"{i}/{procs}"], stdout=log, stderr=subprocess.STDOUT, text=True)
                for i, log in enumerate(logs)]
    failed, cases = 0, 0
    for i, (c, log) in enumerate(zip(children, logs)):
        c.wait()
        log.seek(0)
        text = log.read()
        log.close()
        done = [line for line in text.splitlines() if line.startswith(_WARM_MARK)]
        cases += len(done)
        for line in done:
            if ": ERROR: " in line:
                failed += 1
                print(f"# warm-up: {line[len(_WARM_MARK):][:240]}", file=out)
        if c.returncode not in (0, 1):  # 1: some case failed (listed above); anything else: the process broke
            failed += 1
            print(f"# warm-up process {i}/{procs} ended with {c.returncode}: {text.strip()[-400:]}", file=out)
    print(f"# warm-up: {cases} cases run once in {procs} processes, {time.time() - t0:.0f} s, {failed} failed",
          file=out, flush=True)
    return failed


#: The start of each case's line in a ``--warm-only`` process's output.
_WARM_MARK = "warm: "


def run(modules=None, ops=None, quick=False, json_path=None, plot_path=None, out=None,
        grid: bool = False, cupti_only: bool = False, eager: bool = False, against: Optional[str] = None,
        warm_procs: int = 0, warm_only: bool = False, shard=(0, 1), timers=None,
        tk_commit: Optional[str] = None) -> List[Dict]:
    """Time (GPU) or check (CPU) every registered case.  ``grid``: TileKernels' whole benchmark grid of the ops that
    declare one (``make_cases(device, quick, grid=True)``), and a per-op table of it (× TK, worst shape).
    ``cupti_only``: each case timed by the CUPTI timer alone (its µs, GB/s and % of copy come from it).
    ``eager``: also the eager time per call (back-to-back calls, one synchronize at the end, best of 5 rounds:
    :func:`tritile.bench.timing.time_eager`) and the host cost, eager µs - kernel µs (CUPTI).
    ``against="tilekernels"``: with the real ``tile_kernels`` importable, each case also runs TileKernels' op on the
    same inputs with the same timers (× TK kernel and eager, per shape, per op's worst and per module's geometric
    mean); without it, TileKernels' recorded figures as before, and the output says which.
    ``warm_procs``: first run every case once in that many processes (:func:`warm_in_parallel`).
    ``warm_only``: only run the cases of ``shard=(i, n)`` (every n-th from the i-th) once, untimed and unchecked.
    ``timers``: the timer set (default :func:`gpu_timers` on a GPU; on the CPU the run is a correctness pass unless
    timers are given)."""
    from ..testing.generator import get_device
    from .tk import find_tilekernels, tritile_commit

    out = out or sys.stdout

    if against not in (None, "tilekernels"):
        raise ValueError(f"against must be None or 'tilekernels', got {against!r}")
    device = get_device()
    on_gpu = device.type == "cuda"
    if timers is None and on_gpu:
        timers = gpu_timers()
    timed = timers is not None and not warm_only
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    registry = [b for b in load_all(modules or MODULES)
                if (ops is None or b.op in ops)]
    anchors = load_anchors()
    if against:
        tk_get, tk_info = find_tilekernels(tk_commit)
    else:
        tk_get, tk_info = None, dict(source="recorded", reason="TileKernels not run (--against tilekernels runs it)")
    rows: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)",
        "commit": tritile_commit(),
        "eager": eager,
    }
    meta["tilekernels"] = tk_info
    if warm_only:
        return _warm_only(registry, device, quick, grid, shard, tk_get, sync, out)
    if warm_procs and timed:
        warm_in_parallel(warm_procs, modules, ops, quick, grid, against, out)
    if timed:
        copy_bw = timers.copy_bandwidth()
        meta["copy_bandwidth_gbs"] = round(copy_bw, 1)
        print(f"# {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
              f"device-to-device copy {copy_bw:.0f} GB/s (read + write)", file=out)
        print("# " + tk_source_line(tk_info), file=out, flush=True)
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
            if timed and not row["status"].startswith(("FAIL", "ERROR")):
                _time_case(case, row, timers, grid, cupti_only, eager, copy_bw)
                if tk_get is not None:
                    _against_tk(case, row, tk_get, timers, eager, sync)
                elif case.anchor is not None:
                    rec = find_anchor(anchors, *case.anchor)
                    if rec is not None:
                        ours = row.get("cupti_us") or row["us"]
                        row["tk_source"] = "recorded"
                        row["tk_us"] = rec["time_us"]
                        row["vs_tk"] = round(rec["time_us"] / ours, 2)
                        if not cupti_only:
                            row["vs_tk_graph"] = round(rec["time_us"] / row["us"], 2)
                    else:
                        row["vs_tk"] = "no anchor"
            rows.append(row)
            if json_path:  # written as we go, so a run cut short still leaves its rows
                with open(json_path, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
            del case
            torch.cuda.empty_cache() if on_gpu else None

    _print_table(rows, timed, out)
    if timed and any(isinstance(r.get("vs_tk"), (int, float)) for r in rows):
        print_tk_summary(rows, out)
    if grid and timed:
        print_grid_tables(rows, out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if plot_path and timed:
        _plot(rows, meta.get("copy_bandwidth_gbs"), plot_path)
    return rows


def _time_case(case, row: Dict[str, Any], timers, grid: bool, cupti_only: bool, eager: bool, copy_bw: float) -> None:
    """tritile's timings of one case into ``row``."""
    if cupti_only:  # the CUPTI timer alone (L2 flushed): the one x TK uses
        ku = timers.kernels(case.fn, rep=20)
        us = ku if ku is not None else timers.events(case.fn)
    else:
        # Kernel time: CUDA-graph replay (no Python in the loop), as TileKernels' CUPTI timer sees it.  Event timing
        # of single calls also includes the host's launch cost whenever that is longer than the kernel; it is
        # reported separately, with the host cost per call.
        ev = timers.events(case.fn)
        g = timers.graph(case.fn, calls_per_graph=20 if ev < 200 else 3, rep=20 if ev < 200 else 5)
        us = g if g is not None else ev
        row["event_us"] = round(ev, 2)
        row["host_us"] = round(timers.host(case.fn, n=200 if ev < 200 else 20), 2)
        # Kernel execution only (CUPTI records, L2 flushed, gaps between kernels left out): the timer behind
        # TileKernels' figures, so the ratio to TileKernels uses it when it is available.
        ku = timers.kernels(case.fn, rep=30 if ev < 2000 else 5)
    row["us"] = round(us, 2)
    row["cupti_us"] = _round(ku)
    if eager:
        eu, calls = timers.eager(case.fn)
        row["eager_us"] = round(eu, 2)
        row["eager_calls"] = calls
        row["host_cost_us"] = round(eu - (ku if ku is not None else us), 2)
    if case.nbytes:
        row["gbs"] = round(case.nbytes / us / 1e3, 1)
        row["pct_copy"] = round(100 * row["gbs"] / copy_bw, 1)
    if case.ref is not None and not grid and not cupti_only:  # grids compare with TileKernels only
        try:
            ref_us = timers.events(case.ref, warmup=3, rep=10, min_ms=5)
            row["ref_us"] = round(ref_us, 2)
            row["speedup_vs_ref"] = round(ref_us / us, 2)
        except Exception:
            row["ref_us"] = None


def _warm_only(registry, device, quick: bool, grid: bool, shard, tk_get, sync, out) -> List[Dict[str, Any]]:
    """Each case of ``shard`` run once (tritile's call, then TileKernels' where it has one), unchecked and untimed."""
    i, n = shard
    if not 0 <= i < n:
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    rows: List[Dict[str, Any]] = []
    index = -1
    for bop in registry:
        for case in _cases(bop, device, quick, grid, rows):
            index += 1
            if index % n != i:
                continue
            row = dict(module=bop.module, op=bop.op, params=_fmt_params(case.params), status="warmed")
            try:
                case.fn()
                tk_fn = case.counterpart(tk_get) if tk_get is not None else None
                if tk_fn is not None:
                    tk_fn()
                sync()
            except Exception as e:  # the timing run reports it
                row["status"] = f"ERROR: {type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(f"{_WARM_MARK}{row['op']} {row['params']}: {row['status']}", file=out, flush=True)
    return rows


def tk_source_line(info: Dict[str, Any]) -> str:
    """Where the × TK figures come from, in one line."""
    if info.get("source") == "live":
        return (f"× TK: TileKernels run live on the same inputs, same timers (tile_kernels at {info.get('path')}, "
                f"commit {info.get('commit') or 'unknown'})")
    return (f"× TK: TileKernels' recorded H200 figures ({', '.join('tritile/' + f for f in ANCHOR_FILES)}); "
            f"{info.get('reason', 'TileKernels not run')}")


#: The main table's columns, in order: (row key, heading); a column shows when some row has a value for it.
_COLUMNS = [("module", "module"), ("op", "op"), ("params", "shape/flags"), ("us", "µs (graph)"),
            ("cupti_us", "µs (CUPTI)"), ("event_us", "event µs"), ("host_us", "host µs"), ("eager_us", "eager µs"),
            ("host_cost_us", "host cost µs"), ("gbs", "GB/s"), ("pct_copy", "% copy"), ("speedup_vs_ref", "× ref"),
            ("tk_us", "TK µs"), ("vs_tk", "× TK"), ("tk_eager_us", "TK eager µs"), ("vs_tk_eager", "× TK eager"),
            ("vs_tk_graph", "× TK (graph)"), ("tk_status", "TK"), ("status", "check")]


def _print_table(rows, timed, out):
    keys = [k for k, _ in _COLUMNS]
    if timed:
        cols = [k for k in keys if k in ("module", "op", "params", "status") or any(r.get(k) is not None for r in rows)]
    else:
        cols = ["module", "op", "params", "status"]
    heads = [dict(_COLUMNS)[k] for k in cols]
    print("| " + " | ".join(heads) + " |", file=out)
    print("|" + "---|" * len(heads), file=out)
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |", file=out)
    bad = [r for r in rows if str(r.get("status", "")).startswith(("FAIL", "ERROR"))]
    print(f"\n{len(rows) - len(bad)} passed, {len(bad)} failed", file=out)


def _ratio(r: Dict[str, Any], key: str) -> Optional[float]:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _geomean(xs: List[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def tk_summary(rows) -> Dict[str, Any]:
    """× TK per op (its shapes with a figure, the worst shape and the geometric mean, kernel and eager) and per module
    (geometric mean and the count below 1.0, kernel and eager)."""
    ops: Dict[str, Dict[str, Any]] = {}
    mods: Dict[str, Dict[str, List[float]]] = {}
    for r in rows:
        o = ops.setdefault(r["op"], dict(module=r.get("module", ""), shapes=0, kernel=[], eager=[]))
        o["shapes"] += 1
        m = mods.setdefault(r.get("module", ""), dict(kernel=[], eager=[]))
        for kind, key in (("kernel", "vs_tk"), ("eager", "vs_tk_eager")):
            x = _ratio(r, key)
            if x is not None:
                o[kind].append((x, r["params"]))
                m[kind].append(x)
    summary: Dict[str, Any] = dict(ops={}, modules={})
    for name, o in ops.items():
        s = dict(module=o["module"], shapes=o["shapes"])
        for kind in ("kernel", "eager"):
            if o[kind]:
                worst = min(o[kind])
                s[kind] = dict(n=len(o[kind]), worst=worst[0], worst_at=worst[1],
                               geomean=_geomean([x for x, _ in o[kind]]))
        summary["ops"][name] = s
    for name, m in mods.items():
        s = {}
        for kind in ("kernel", "eager"):
            if m[kind]:
                s[kind] = dict(n=len(m[kind]), geomean=_geomean(m[kind]), below_1=sum(x < 1.0 for x in m[kind]),
                               worst=min(m[kind]))
        summary["modules"][name] = s
    return summary


def print_tk_summary(rows, out=sys.stdout) -> None:
    """Two Markdown tables: per op, the worst shape and the geometric mean of × TK (kernel: CUPTI with L2 flushed;
    eager: back-to-back calls); per module, the geometric mean and the shapes below 1.0."""
    s = tk_summary(rows)
    eager = any("eager" in o for o in s["ops"].values())
    head = "| module | op | shapes | × TK kernel: worst | at | geomean |"
    if eager:
        head += " × TK eager: worst | at | geomean |"
    print("\n" + head + "\n|" + "---|" * (head.count("|") - 1), file=out)
    for name, o in s["ops"].items():
        if "kernel" not in o and "eager" not in o:
            continue
        cells = [o["module"], name, str(o["shapes"])]
        for kind in ("kernel", "eager") if eager else ("kernel",):
            k = o.get(kind)
            cells += [f"{k['worst']:.2f}", k["worst_at"], f"{k['geomean']:.2f}"] if k else ["", "", ""]
        print("| " + " | ".join(cells) + " |", file=out)
    head = "| module | shapes | × TK kernel: geomean | below 1.0 |" + (" × TK eager: geomean | below 1.0 |" if eager else "")
    print("\n" + head + "\n|" + "---|" * (head.count("|") - 1), file=out)
    for name, m in s["modules"].items():
        if not m:
            continue
        n = max(v["n"] for v in m.values())
        cells = [name, str(n)]
        for kind in ("kernel", "eager") if eager else ("kernel",):
            k = m.get(kind)
            cells += [f"{k['geomean']:.2f}", str(k["below_1"])] if k else ["", ""]
        print("| " + " | ".join(cells) + " |", file=out)


def print_grid_tables(rows, out=sys.stdout) -> None:
    """One Markdown table per op (``benchmarks/RESULTS.md``'s grid tables): the shape, TileKernels' µs where there is
    a figure (run live, or recorded), ours (CUPTI with L2 flushed when available, else graph), × TK, with eager
    timings TileKernels' and ours per call, × TK eager and the host cost, % of copy, and the single call's event and
    host µs (launch cost; a synchronising op's host sync shows in its event µs against its no-sync case's; these three
    where the run has them); then a summary line with the op's worst shape and the geometric mean of × TK (and of
    × TK eager)."""
    ops: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        ops.setdefault(r["op"], []).append(r)
    eager = any(r.get("eager_us") is not None for r in rows)
    for op, rs in ops.items():
        heads = ["shape", "TK µs", "tritile µs", "× TK"]
        if eager:
            heads += ["TK eager µs", "eager µs", "× TK eager", "host cost µs"]
        # the single-call columns where the run has them (a --cupti-only run has none)
        extra = [(k, h) for k, h in (("pct_copy", "% copy"), ("event_us", "event µs"), ("host_us", "host µs"))
                 if any(r.get(k) is not None for r in rows)]
        heads += [h for _, h in extra]
        print(f"\n#### {op}\n\n| " + " | ".join(heads) + " |\n|" + "---|" * len(heads), file=out)
        ratios, eratios = [], []
        for r in rs:
            ours = r.get("cupti_us") or r.get("us")
            ratio, eratio = _ratio(r, "vs_tk"), _ratio(r, "vs_tk_eager")
            if ratio is not None:
                ratios.append((ratio, r["params"]))
            if eratio is not None:
                eratios.append((eratio, r["params"]))
            cells = [r["params"], r.get("tk_us", ""), "" if ours is None else ours,
                     "" if ratio is None else f"{ratio:.2f}"]
            if eager:
                cells += [r.get("tk_eager_us", ""), r.get("eager_us", ""), "" if eratio is None else f"{eratio:.2f}",
                          r.get("host_cost_us", "")]
            cells += [r.get(k, "") for k, _ in extra]
            if str(r.get("status", "")).startswith(("FAIL", "ERROR")):
                cells[2] = r["status"][:60]
            print("| " + " | ".join("" if c is None else str(c) for c in cells) + " |", file=out)
        if ratios:
            worst = min(ratios)
            line = (f"\n{op}: {len(rs)} shapes, {len(ratios)} with a TileKernels figure; worst {worst[0]:.2f}× TK at "
                    f"{worst[1]}; geometric mean {_geomean([x for x, _ in ratios]):.2f}×.")
            if eratios:
                ew = min(eratios)
                line += (f"  Eager: worst {ew[0]:.2f}× TK at {ew[1]}; geometric mean "
                         f"{_geomean([x for x, _ in eratios]):.2f}×.")
            print(line, file=out)
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
