"""``python -m tritile demo moe``: build the DeepSeek-V3 MoE layer (``tritile.modeling.moe.MoE``) at a size that
fits the machine, check its forward and backward against the plain PyTorch layer with the same weights, then
time both (tokens/s of the forward and of forward + backward) and split our layer's time by stage (gate,
dispatch, GEMMs, activation cast, combine).

On the CPU (Triton's interpreter) the default is a tiny layer; on a GPU DeepSeek-V3's own shapes
(H 7168, 256 experts of width 2048, 1 shared expert, top-8 of 4 of 8 groups) when the memory allows.
``--ranks N`` runs N processes (gloo on the CPU, NCCL with one GPU each), expert-parallel over them; the plain
layer then holds every expert on every rank and needs no communication (the figures are the slowest rank's).
The stage split comes from separate timed calls with a ``StageTimer`` (CUDA events around each stage), so the
tokens/s figures carry no timer overhead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from .moe import STAGES, MoE, PlainMoE, StageTimer

V3 = dict(hidden_size=7168, num_experts=256, moe_intermediate_size=2048, num_shared_experts=1, num_topk=8,
          num_groups=8, num_topk_groups=4, routed_scaling_factor=2.5)
TINY = dict(hidden_size=128, num_experts=16, moe_intermediate_size=128, num_shared_experts=1, num_topk=4,
            num_groups=4, num_topk_groups=2, routed_scaling_factor=2.5)
# calc_diff bounds of the check (see tests/modeling/test_moe_layer.py for the measured values they cover)
TOL = {False: (1e-4, 1e-4), True: (3e-3, 6e-3)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tritile demo moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: 4096 on a GPU, 64 on the CPU)")
    p.add_argument("--hidden", type=int, help="hidden size H (default: DeepSeek-V3's 7168 on a GPU)")
    p.add_argument("--experts", type=int, help="routed experts in total")
    p.add_argument("--inter", type=int, help="each expert's FFN width")
    p.add_argument("--topk", type=int, help="experts per token")
    p.add_argument("--groups", type=int, help="expert groups")
    p.add_argument("--topk-groups", type=int, help="groups a token may use")
    p.add_argument("--shared", type=int, help="shared experts")
    p.add_argument("--fp8", action="store_true", help="FP8 activations (dispatch, SwiGLU cast, backward casts)")
    p.add_argument("--fp8-scale", default="fp32", choices=("fp32", "ue8m0"), help="FP8 dispatch scales")
    p.add_argument("--alignment", type=int, help="rows per expert segment are padded to this multiple "
                   "(default: the layer's; 32 for --fp8 on the CPU, to keep the interpreter's grids small)")
    p.add_argument("--ranks", type=int, default=1, help="expert-parallel processes (default 1)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: 20 on a GPU, 2 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: 3 on a GPU, 1 on the CPU)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the plain layer")
    p.add_argument("--no-plain", action="store_true", help="do not time the plain layer")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--plot", help="draw the stage split (PNG; needs matplotlib)")
    return p


def _config(args, device: torch.device) -> Dict[str, Any]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # DeepSeek-V3's experts: 22.5 GB of bf16 weights, as much again for their gradients, plus activations
        base = dict(V3) if total >= 100e9 else dict(V3, num_experts=64)
    else:
        base = dict(TINY)
    for key, arg in (("hidden_size", "hidden"), ("num_experts", "experts"), ("moe_intermediate_size", "inter"),
                     ("num_topk", "topk"), ("num_groups", "groups"), ("num_topk_groups", "topk_groups"),
                     ("num_shared_experts", "shared")):
        v = getattr(args, arg)
        if v is not None:
            base[key] = v
    return base


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=not enabled)
    except ImportError:  # pragma: no cover
        class _Bar:
            def update(self, n=1):
                pass

            def close(self):
                pass

        return _Bar()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group) -> None:
    if group is not None:
        torch.distributed.barrier(group)


def _time(fn, device, iters, warmup, group, bar) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after ``warmup`` (a barrier before each)."""
    for _ in range(warmup):
        fn()
        bar.update()
    times = []
    for _ in range(iters):
        _barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        bar.update()
    return statistics.median(times)


def _calc_diff_chunked(x: torch.Tensor, y: torch.Tensor, rows: int = 1 << 24) -> float:
    """``tritile.testing.calc_diff`` in float64 over chunks of ``rows`` elements (expert weight gradients at
    DeepSeek-V3's size would need tens of GiB as one float64 tensor)."""
    x, y = x.reshape(-1), y.reshape(-1)
    xy = den = 0.0
    for i in range(0, x.numel(), rows):
        a, b = x[i:i + rows].double(), y[i:i + rows].double()
        xy += float((a * b).sum())
        den += float((a * a + b * b).sum())
    return 0.0 if den == 0.0 else 1 - 2 * xy / den


def _compare(ours, plain, x, g, local, fp8) -> Dict[str, Any]:
    calc_diff = _calc_diff_chunked

    def run(layer):
        xx = x.detach().clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = layer(xx)
        y.backward(g)
        return y.detach(), xx.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}

    y, gx, grads = run(ours)
    ry, rgx, rgrads = run(plain)
    if local is not None:
        for name in ("w13", "w2"):
            torch.distributed.all_reduce(rgrads[name], group=ours.group)
    tol, wtol = TOL[fp8]
    diffs = {"y": calc_diff(y, ry), "x.grad": calc_diff(gx, rgx)}
    for name, gr in grads.items():
        want = rgrads[name] if local is None or name not in ("w13", "w2") else rgrads[name][local]
        diffs[f"{name}.grad"] = calc_diff(gr, want)
    ok = all(d < (wtol if k in ("w13.grad", "w2.grad", "gate_weight.grad") else tol) for k, d in diffs.items())
    ours.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    return dict(ok=ok, calc_diff=diffs, tol=tol, wgrad_tol=wtol)


def run_rank(rank: int, world: int, opts: Dict[str, Any], group=None) -> Optional[Dict[str, Any]]:
    """Build, check and time the layer on this rank; returns the results (rank 0) or None."""
    args = argparse.Namespace(**opts)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank if world > 1 else torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    cfg = _config(args, device)
    on_gpu = device.type == "cuda"
    tokens = args.tokens if args.tokens is not None else (4096 if on_gpu else 64)
    iters = args.iters if args.iters is not None else (20 if on_gpu else 2)
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    show = rank == 0

    align = args.alignment if args.alignment is not None else (32 if args.fp8 and not on_gpu else None)
    torch.manual_seed(0)
    if world == 1:
        ours = MoE(**cfg, fp8=args.fp8, fp8_scale=args.fp8_scale, alignment=align, device=device)
        plain = ours.plain()
        local = None
    else:
        ours = MoE(**cfg, group=group, fp8=args.fp8, fp8_scale=args.fp8_scale, alignment=align, device=device)
        need_plain = not (args.no_check and args.no_plain)
        plain = PlainMoE(**cfg, device=device) if need_plain else None
        if plain is not None:
            ours.load_plain(plain)
        lo = rank * ours.num_local_experts
        local = slice(lo, lo + ours.num_local_experts)
    torch.manual_seed(1 + rank)
    x = torch.randn(tokens, cfg["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)

    result: Dict[str, Any] = dict(config=cfg, tokens_per_rank=tokens, ranks=world, fp8=args.fp8,
                                  fp8_scale=args.fp8_scale if args.fp8 else None, device=str(device))
    if show:
        print(f"MoE layer: {cfg}, {tokens} tokens per rank, {world} rank(s), "
              f"{'FP8' if args.fp8 else 'bf16'}, on {_device_name(device)}", file=sys.stderr)
    if not args.no_check:
        chk = _compare(ours, plain, x, g, local, args.fp8)
        result["check"] = chk
        if show:
            worst = max(chk["calc_diff"].items(), key=lambda kv: kv[1])
            print(f"check against the plain layer: {'ok' if chk['ok'] else 'FAILED'} "
                  f"(worst calc_diff {worst[1]:.2e} on {worst[0]})", file=sys.stderr)

    layers = [("tritile", ours)] + ([] if args.no_plain or plain is None else [("plain", plain)])
    per_layer = 2 * (iters + warmup) + (iters + 1)
    bar = _progress(len(layers) * per_layer, "timing", show)
    xg = x.detach().clone().requires_grad_()

    def fwd(layer):
        with torch.no_grad():
            layer(x)

    def fwd_bwd(layer, timer=None):
        layer.zero_grad(set_to_none=True)
        xg.grad = None
        layer(xg, timer).backward(g)

    for name, layer in layers:
        t_f = _time(lambda: fwd(layer), device, iters, warmup, group, bar)
        t_fb = _time(lambda: fwd_bwd(layer), device, iters, warmup, group, bar)
        timer = StageTimer(device)
        fwd_bwd(layer, timer)  # one untimed call
        timer.reset()
        for _ in range(iters):
            _barrier(group)
            fwd_bwd(layer, timer)
            bar.update()
        split = {ph: {k: v / iters for k, v in d.items()} for ph, d in timer.summary().items()}
        result[name] = dict(fwd_ms=t_f, fwd_bwd_ms=t_fb, fwd_tokens_per_s=tokens / t_f * 1e3,
                            fwd_bwd_tokens_per_s=tokens / t_fb * 1e3, split_ms=split)
        layer.zero_grad(set_to_none=True)
    bar.close()
    for name, _ in layers:
        r = result[name]
        for ph in ("fwd", "bwd"):
            d = r["split_ms"].get(ph, {})
            tot = sum(d.values())
            r.setdefault("non_gemm_share", {})[ph] = (tot - d.get("gemm", 0.0)) / tot if tot else 0.0
        tot = sum(sum(d.values()) for d in r["split_ms"].values())
        gemm = sum(d.get("gemm", 0.0) for d in r["split_ms"].values())
        r["non_gemm_share"]["fwd_bwd"] = (tot - gemm) / tot if tot else 0.0
    if world > 1:  # the slowest rank's figures
        gathered: List[Dict[str, Any]] = [None] * world  # type: ignore[list-item]
        torch.distributed.all_gather_object(gathered, result, group=group)
        if rank != 0:
            return None
        for name, _ in layers:
            for key in ("fwd_ms", "fwd_bwd_ms"):
                result[name][key] = max(r[name][key] for r in gathered)
            result[name]["fwd_tokens_per_s"] = tokens * world / result[name]["fwd_ms"] * 1e3
            result[name]["fwd_bwd_tokens_per_s"] = tokens * world / result[name]["fwd_bwd_ms"] * 1e3
        if "check" in result:
            result["check"]["ok"] = all(r["check"]["ok"] for r in gathered)
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"


def print_report(res: Dict[str, Any], out=sys.stdout) -> None:
    """Tokens/s table and the stage split (Markdown)."""
    world = res["ranks"]
    print(f"\n### MoE layer, {res['tokens_per_rank']} tokens per rank x {world} rank(s), "
          f"{'FP8 ' + res['fp8_scale'] if res['fp8'] else 'bf16'}", file=out)
    print("\n| layer | fwd ms | fwd tokens/s | fwd+bwd ms | fwd+bwd tokens/s |", file=out)
    print("|---|---|---|---|---|", file=out)
    names = [n for n in ("tritile", "plain") if n in res]
    for n in names:
        r = res[n]
        print(f"| {n} | {r['fwd_ms']:.3f} | {r['fwd_tokens_per_s']:,.0f} | {r['fwd_bwd_ms']:.3f} | "
              f"{r['fwd_bwd_tokens_per_s']:,.0f} |", file=out)
    if len(names) == 2:
        a, b = res["tritile"], res["plain"]
        print(f"\nspeed-up over the plain layer: fwd {b['fwd_ms'] / a['fwd_ms']:.2f}x, "
              f"fwd+bwd {b['fwd_bwd_ms'] / a['fwd_bwd_ms']:.2f}x", file=out)
    print("\n| layer | phase | " + " | ".join(STAGES) + " | non-GEMM share |", file=out)
    print("|---|---|" + "---|" * (len(STAGES) + 1), file=out)
    for n in names:
        r = res[n]
        for ph in ("fwd", "bwd"):
            d = r["split_ms"].get(ph)
            if not d:
                continue
            tot = sum(d.values())
            cells = [f"{d.get(s, 0.0):.3f} ({100 * d.get(s, 0.0) / tot:.0f}%)" if tot else "-" for s in STAGES]
            print(f"| {n} | {ph} | " + " | ".join(cells) + f" | {100 * r['non_gemm_share'][ph]:.1f}% |", file=out)
        print(f"| {n} | fwd+bwd | " + " | ".join("" for _ in STAGES) +
              f" | {100 * r['non_gemm_share']['fwd_bwd']:.1f}% |", file=out)
    if "check" in res:
        c = res["check"]
        print(f"\ncheck: {'ok' if c['ok'] else 'FAILED'}; calc_diff "
              + ", ".join(f"{k} {v:.1e}" for k, v in c["calc_diff"].items())
              + f" (bounds {c['tol']:.0e}, weight gradients {c['wgrad_tol']:.0e})", file=out)


def plot(res: Dict[str, Any], path: str) -> None:
    """Stacked bars of the stage split (ms) per layer and phase."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: {e}") from None
    bars = [(f"{n} {ph}", res[n]["split_ms"][ph]) for n in ("tritile", "plain") if n in res
            for ph in ("fwd", "bwd") if res[n]["split_ms"].get(ph)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(bars)
    for s in STAGES:
        vals = [d.get(s, 0.0) for _, d in bars]
        ax.bar([b for b, _ in bars], vals, bottom=bottoms, label=s)
        bottoms = [a + v for a, v in zip(bottoms, vals)]
    ax.set_ylabel("ms per call")
    ax.set_title(f"MoE layer, {res['tokens_per_rank']} tokens/rank x {res['ranks']} rank(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _meta(res: Dict[str, Any]) -> Dict[str, Any]:
    import triton

    dev = torch.device(res["device"])
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, interpreter=os.environ.get("TRITON_INTERPRET") == "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, opts: Dict[str, Any], path: str) -> None:
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    try:
        res = run_rank(rank, world, opts, torch.distributed.group.WORLD)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(res, f)
    finally:
        torch.distributed.destroy_process_group()


def run(opts: Dict[str, Any]) -> Dict[str, Any]:
    """Run the demo with the parsed options (a dict of ``_parser()``'s dests); returns the results."""
    world = opts.get("ranks", 1)
    if world < 1:
        raise SystemExit(f"--ranks must be >= 1, got {world}")
    if world == 1:
        res = run_rank(0, 1, opts)
    else:
        if torch.cuda.is_available() and torch.cuda.device_count() < world:
            raise SystemExit(f"--ranks {world} needs {world} GPUs, found {torch.cuda.device_count()}")
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rank0.json")
            mp.spawn(_worker, args=(world, _free_port(), opts, path), nprocs=world, join=True)
            with open(path) as f:
                res = json.load(f)
    res["meta"] = _meta(res)
    return res


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    res = run(vars(args))
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        plot(res, args.plot)
    return 0 if res.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
