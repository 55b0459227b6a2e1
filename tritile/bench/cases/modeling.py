"""Benchmark of the MoE layer (``tritile.modeling.moe.MoE``) against the plain PyTorch layer at DeepSeek-V3's
shapes: tokens/s of the forward and of forward + backward at 4096 and 16384 tokens per rank, the stage split
and the share of time outside the GEMMs.

``python -m tritile.bench.cases.modeling [--tokens 4096 16384] [--ranks N] [--fp8] [--json FILE]`` (GPU), or
``run_benchmark(...)`` from Python.  Each token count is one ``python -m tritile demo moe`` run (the demo does the
timing); the table at the end adds the pass/fail of the targets: at 16384 tokens the layer beats the plain one
and its non-GEMM stages take under 25 % of its time.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

from tritile.modeling._demo_moe import _parser as _demo_parser
from tritile.modeling._demo_moe import print_report
from tritile.modeling._demo_moe import run as _demo_run

__all__ = ["run_benchmark", "targets"]


def targets(res: Dict[str, Any]) -> Dict[str, Any]:
    """The layer's targets at one token count: faster than the plain layer (forward and forward + backward), and
    the non-GEMM stages under 25 % of the layer's forward + backward time."""
    ours, plain = res["tritile"], res.get("plain")
    out = dict(tokens=res["tokens_per_rank"], non_gemm_share=ours["non_gemm_share"]["fwd_bwd"],
               non_gemm_ok=ours["non_gemm_share"]["fwd_bwd"] < 0.25)
    if plain is not None:
        out.update(fwd_speedup=plain["fwd_ms"] / ours["fwd_ms"],
                   fwd_bwd_speedup=plain["fwd_bwd_ms"] / ours["fwd_bwd_ms"])
        out["beats_plain"] = out["fwd_speedup"] > 1 and out["fwd_bwd_speedup"] > 1
    out["check_ok"] = res.get("check", {}).get("ok", True)
    return out


def run_benchmark(tokens: Sequence[int] = (4096, 16384), ranks: int = 1, fp8: bool = False,
                  fp8_scale: str = "fp32", iters: Optional[int] = None, json_path: Optional[str] = None,
                  check: bool = True, out=sys.stdout) -> List[Dict[str, Any]]:
    """Run the demo at each token count and print the reports plus a targets table; returns the results."""
    results = []
    for t in tokens:
        argv = ["--tokens", str(t), "--ranks", str(ranks)] + (["--fp8", "--fp8-scale", fp8_scale] if fp8 else [])
        argv += [] if iters is None else ["--iters", str(iters)]
        argv += [] if check else ["--no-check"]
        res = _demo_run(vars(_demo_parser().parse_args(argv)))
        res["targets"] = targets(res)
        print_report(res, out)
        results.append(res)
        if json_path:  # written as we go, so a run cut short keeps its rows
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1)
    print("\n| tokens/rank | fwd x plain | fwd+bwd x plain | non-GEMM share | beats plain | < 25 % | check |", file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    for r in results:
        tg = r["targets"]
        print(f"| {tg['tokens']} | {tg.get('fwd_speedup', float('nan')):.2f} | "
              f"{tg.get('fwd_bwd_speedup', float('nan')):.2f} | {100 * tg['non_gemm_share']:.1f}% | "
              f"{tg.get('beats_plain')} | {tg['non_gemm_ok']} | {tg['check_ok']} |", file=out)
    return results


def main(argv=None) -> int:
    import os

    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # no GPU: Triton's interpreter must be chosen before tritile's kernels are defined, so start again
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "tritile.bench.cases.modeling",
                                   *(argv if argv is not None else sys.argv[1:])], env)
    p = argparse.ArgumentParser(prog="python -m tritile.bench.cases.modeling", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per rank")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--fp8-scale", default="fp32", choices=("fp32", "ue8m0"))
    p.add_argument("--iters", type=int)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = run_benchmark(a.tokens, a.ranks, a.fp8, a.fp8_scale, a.iters, a.json, not a.no_check)
    return 0 if all(r["targets"]["check_ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
