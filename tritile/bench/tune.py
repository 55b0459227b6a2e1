"""``python -m tritile tune``: time the launch-config candidates that benchmark cases declare (GPU only).

A case opts in with ``Case(tune=(name, [overrides, ...]))``: ``name`` is what the kernel wrapper passes to
:func:`tritile.runtime.tuned`.  Each candidate runs under :func:`tritile.runtime.override_config`, its output
is compared bit for bit with the default config's, and it is timed by CUDA-graph replay.  A candidate that
fails to compile or changes a single bit is reported, never ranked.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List

import torch

from . import MODULES, load_all


def _snapshot(out):
    if isinstance(out, torch.Tensor):
        # keep the strides: ``clone()`` of a padded view (a TMA-aligned column-major sf) returns a dense tensor,
        # whose strides then differ from every later call's (every candidate "differed" and the default "failed"
        # its check before)
        snap = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)
        return snap.copy_(out.detach())
    if isinstance(out, (list, tuple)):
        return type(out)(_snapshot(o) for o in out) if isinstance(out, tuple) else [_snapshot(o) for o in out]
    return out


def _same(a, b) -> bool:
    from ..testing.numeric import assert_equal

    try:
        if isinstance(a, torch.Tensor):
            assert_equal(a, b)
        elif isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
        else:
            return a == b
    except AssertionError:
        return False
    return True


def _differs(r) -> str:
    if r.get("passes_check") is True:
        return "output differs from the default's, but passes the op's check against the reference"
    if r.get("passes_check") is False:
        return "output differs and FAILS the op's check: " + r.get("check_error", "")
    return "output differs"


def run(modules=None, ops=None, top: int = 6, json_path=None, out=sys.stdout, compile_only: bool = False,
        shard=(0, 1), cupti: bool = False, quick: bool = False, cases=None, keys=None,
        grid: bool = False) -> List[Dict[str, Any]]:
    """``compile_only``: run each candidate once and check its bits, without timing (several such processes can
    fill Triton's on-disk cache in parallel before a timing run).  ``shard=(i, n)``: only every n-th case from i.
    ``cupti``: rank by the summed kernel time with L2 flushed before each call (``time_kernels``: how TileKernels'
    timer counts) instead of CUDA-graph replay; ops whose inputs would partly stay in L2 between graph replays
    can rank differently.  ``quick``: only the benchmark's quick cases (``bench --quick``: one shape per op).
    ``cases``: only the cases whose ``str(params)`` contains one of these strings.  ``keys``: only the candidates
    that set one of these config keys (and the default, which every sweep times).  ``grid``: the cases of
    TileKernels' whole benchmark grid (``bench --grid``)."""
    from ..runtime import override_config, poison_outputs
    from .runner import make_cases
    from ..testing.bench import copy_bandwidth_gbs, time_graph, time_kernels

    def _time(fn):
        return time_kernels(fn, rep=20) if cupti else time_graph(fn, calls_per_graph=10, rep=10)

    if not torch.cuda.is_available():
        raise SystemExit("python -m tritile tune needs a GPU")
    copy_bw = 0.0 if compile_only else copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name()}; copy {copy_bw:.0f} GB/s", file=out, flush=True)
    results: List[Dict[str, Any]] = []
    index = -1
    for bop in load_all(modules or MODULES):
        if ops is not None and bop.op not in ops:
            continue
        for case in make_cases(bop, torch.device("cuda"), quick, grid):
            if case.tune is None or (cases and not any(c in str(case.params) for c in cases)):
                continue
            index += 1
            if index % shard[1] != shard[0]:
                continue
            name, candidates = case.tune
            # Outputs are compared with poisoning on, so that padding a kernel never writes (e.g. the unused
            # rows of a TMA-aligned sf) reads the same in every call; timing runs without it.
            with poison_outputs(True):
                base = _snapshot(case.fn())
            default_error = None
            if case.ref is not None and case.check is not None:  # the default itself against the reference
                try:
                    case.check(base, case.ref())
                except AssertionError as e:
                    default_error = str(e)[:200]
                    print(f"## {bop.op} {case.params}: the DEFAULT FAILS the op's check: {default_error}",
                          file=out, flush=True)
            if not compile_only:
                time_graph(case.fn, calls_per_graph=10, rep=5)  # warm-up: the first timing of a process runs slow
            rows = []
            for cand in [{}] + [c for c in candidates if not keys or any(k in c for k in keys)]:
                row = dict(op=bop.op + (f"[{case.label}]" if case.label else ""), config=name, overrides=cand,
                           params=case.params)
                if not cand and default_error:
                    row["default_error"] = default_error
                try:
                    with override_config(name, **cand):
                        with poison_outputs(True):
                            got = case.fn()
                        row["same_bits"] = _same(got, base)
                        if not row["same_bits"] and case.ref is not None and case.check is not None:
                            # bits differ from the default's: does the candidate still pass the op's own check
                            # against the reference (bitwise for exact ops, a tolerance for reductions)?
                            try:
                                case.check(got, case.ref())
                                row["passes_check"] = True
                            except AssertionError as e:
                                row["passes_check"] = False
                                row["check_error"] = str(e)[:160]
                        del got
                        us = None if compile_only else _time(case.fn)
                    row["us"] = None if us is None else round(us, 2)
                    if us and case.nbytes:
                        row["gbs"] = round(case.nbytes / us / 1e3, 1)
                        row["pct_copy"] = round(100 * row["gbs"] / copy_bw, 1)
                except Exception as e:  # a candidate that does not compile or launch
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
            if compile_only:
                bad = [r for r in rows if r.get("error") or r.get("same_bits") is False]
                print(f"## {rows[0]['op']}: {len(rows)} candidates run, {len(bad)} bad", file=out)
                for r in bad:
                    print(f"   BAD {r['overrides']}: {r.get('error') or _differs(r)}", file=out)
                results += rows
                continue
            # Candidates whose bits differ are still timed and listed (marked): for ops whose reductions may
            # legitimately change order (within the op's tolerance) the choice is then made by hand.
            ok = [r for r in rows if r.get("us")]
            ok.sort(key=lambda r: r["us"])
            default = rows[0]
            print(f"\n## {rows[0]['op']} {case.params}{' (CUPTI, L2 flushed)' if cupti else ''}\n"
                  f"   default: {default.get('us')} us "
                  f"{default.get('pct_copy', '')}% copy", file=out)
            for r in ok[:top]:
                tag = "" if r.get("same_bits") else ("  [bits differ, passes check]" if r.get("passes_check")
                                                     else "  [bits differ, FAILS check]"
                                                     if r.get("passes_check") is False else "  [bits differ]")
                print(f"   {r['us']:9.2f} us {r.get('pct_copy', ''):>6}%  {r['overrides']}{tag}", file=out)
            for r in rows:
                if r.get("error"):
                    print(f"   BAD {r['overrides']}: {r['error']}", file=out)
            nd = sum(1 for r in rows if r.get("same_bits") is False)
            if nd:
                print(f"   ({nd} of {len(rows)} candidates give different bits)", file=out)
            out.flush()
            results += rows
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(dict(copy_bandwidth_gbs=copy_bw, rows=results), f, indent=1, default=str)
            del base
            torch.cuda.empty_cache()
    return results
