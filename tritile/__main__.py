"""Command-line entry point: ``python -m tritile bench [--module M] [--op NAME] [--quick | --grid] [--eager]
[--against tilekernels] [--json F] [--plot F.png]``
and ``python -m tritile tune [--module M] [--op NAME]`` (GPU launch-config sweeps);
``python -m tritile bench --module ep --ranks 2`` starts the ranks of the expert-parallel benchmark (tritile.ep.bench);
``python -m tritile demo moe [--tokens N] [--ranks N] [--fp8] [--json F] [--plot F.png]`` runs the MoE layer demo;
``python -m tritile demo hf [--model deepseek_v3|qwen3_moe] [--layers N] [--fp8] [--json F]`` a transformers model
trained with and without ``tritile.hf.patch``."""

from __future__ import annotations

import argparse
import os
import sys


def _shard(p, text: str):
    """``--shard I/N`` as ``(I, N)``, with 0 <= I < N."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        p.error(f"--shard must be I/N (two integers), got {text!r}")
    if not 0 <= i < n:
        p.error(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritile")
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("bench", help="benchmark every registered op (GPU) or check each once (CPU)")
    b.add_argument("--module", action="append", help="only these modules (repeatable)")
    b.add_argument("--op", action="append", help="only these ops (repeatable)")
    b.add_argument("--quick", action="store_true", help="one representative shape per op")
    b.add_argument("--grid", action="store_true",
                   help="TileKernels' whole benchmark grid of each op (long), with a per-op table against TileKernels")
    b.add_argument("--cupti-only", action="store_true",
                   help="time each case with the CUPTI timer alone (L2 flushed; the timer behind × TK), for the large "
                        "grids (no graph, event or host µs)")
    b.add_argument("--eager", action="store_true",
                   help="also the eager time per call (100 back-to-back calls, fewer for long ops, one synchronize at "
                        "the end, best of 5) and the host cost (eager µs - kernel µs)")
    b.add_argument("--against", choices=["tilekernels"],
                   help="run TileKernels' op on each case's inputs with the same timers (× TK kernel and eager), "
                        "when tile_kernels is importable (not the shim); else its recorded figures")
    b.add_argument("--warm-procs", type=int, default=0, metavar="N",
                   help="first run every selected case once in N parallel processes (TileLang's and Triton's "
                        "compile caches on disk), untimed")
    b.add_argument("--tk-commit", help="TileKernels' commit, for the results (default: $TILEKERNELS_COMMIT, else the "
                                       "git HEAD of its checkout)")
    b.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    b.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    b.add_argument("--json", help="write the results as JSON here")
    b.add_argument("--plot", help="draw GB/s per op against the copy bandwidth (PNG)")
    b.add_argument("--ranks", type=int,
                   help="with --module ep: start this many ranks and run the multi-rank dispatch/combine benchmark "
                        "(tritile.ep.bench; 1 = the single-GPU kernel cases)")
    t = sub.add_parser("tune", help="time the launch-config candidates the benchmark cases declare (GPU)")
    t.add_argument("--module", action="append", help="only these modules (repeatable)")
    t.add_argument("--op", action="append", help="only these ops (repeatable)")
    t.add_argument("--top", type=int, default=6, help="how many of the fastest candidates to print")
    t.add_argument("--json", help="write every candidate's result as JSON here")
    t.add_argument("--compile-only", action="store_true", help="run and check each candidate once, no timing")
    t.add_argument("--shard", default="0/1", help="I/N: only every N-th tunable case, from the I-th")
    t.add_argument("--quick", action="store_true", help="only the benchmark's quick cases (one shape per op)")
    t.add_argument("--grid", action="store_true", help="the cases of TileKernels' whole benchmark grid (bench --grid)")
    t.add_argument("--case", action="append",
                   help="only cases whose parameters (as printed) contain this text, e.g. \"'block': (32, 32)\" "
                        "(repeatable: any)")
    t.add_argument("--key", action="append",
                   help="only the candidates that set this config key, e.g. PIPE (repeatable: any), and the default")
    t.add_argument("--cupti", action="store_true",
                   help="rank by CUPTI kernel time with L2 flushed (TileKernels' timer), not CUDA-graph replay")
    d = sub.add_parser("demo", help="run a showcase: `demo moe` (the DeepSeek-V3 MoE layer; `demo moe -h`), `demo hf` "
                                    "(a transformers model with and without tritile.hf.patch; `demo hf -h`)")
    d.add_argument("name", choices=["moe", "hf"])
    d.add_argument("demo_args", nargs=argparse.REMAINDER, help="the demo's own options")
    args = p.parse_args(argv)
    if args.cmd == "tune":
        from .bench.tune import run as tune

        i, n = _shard(p, args.shard)
        tune(modules=args.module, ops=args.op, top=args.top, json_path=args.json, compile_only=args.compile_only,
             shard=(i, n), cupti=args.cupti, quick=args.quick, cases=args.case, keys=args.key, grid=args.grid)
        return 0
    if args.cmd not in ("bench", "demo"):
        p.print_help()
        return 2
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_gpu = False
    if not has_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be chosen before any @triton.jit decorator runs, and `python -m tritile`
        # has already imported the package: start again with it set.
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "tritile", *(argv if argv is not None else sys.argv[1:])], env)
    if args.cmd == "demo" and args.name == "hf":
        from .hf._demo import main as demo_hf

        return demo_hf(args.demo_args)
    if args.cmd == "demo":
        from .modeling._demo_moe import main as demo_moe

        return demo_moe(args.demo_args)
    if args.ranks is not None and args.ranks > 1:
        if args.module != ["ep"] or args.op or args.grid or args.plot or args.eager or args.against:
            p.error("--ranks > 1 goes with --module ep alone (plus --quick / --json)")
        from .ep.bench import main as ep_bench

        return ep_bench(["--ranks", str(args.ranks)] + (["--quick"] if args.quick else [])
                        + (["--json", args.json] if args.json else []))
    from .bench.runner import run

    i, n = _shard(p, args.shard)
    rows = run(modules=args.module, ops=args.op, quick=args.quick, json_path=args.json, plot_path=args.plot,
               grid=args.grid, cupti_only=args.cupti_only, eager=args.eager, against=args.against,
               warm_procs=args.warm_procs, warm_only=args.warm_only, shard=(i, n), tk_commit=args.tk_commit)
    bad = [r for r in rows if str(r.get("status", "")).startswith(("FAIL", "ERROR"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
