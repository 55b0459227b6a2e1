"""Single-rank figures of tritile.ep's calls: ``python -m tritile.ep.bench_elastic [--out DIR] [--iters N]``.

One process, a one-rank group (NCCL on a GPU, gloo on the CPU, where the run only checks that every case works: its
times mean nothing).  Each case is timed with CUDA events around the call (the median of ``--iters`` calls after
warm-up, the GPU synchronised before each), with the phase breakdown of ``Buffer.phase_hook``:

* ``ht_*``: ``ElasticBuffer.dispatch`` / ``combine`` / cached dispatch at 4096 tokens x 7168, top-8 of 256 experts,
  BF16 and FP8, with and without peer checks, and ``a2a``: one ``all_to_all_single`` of the same bytes (the floor
  the issue's "3x" target refers to);
* ``ll_*``: ``Buffer.low_latency_dispatch`` + ``low_latency_combine`` at DeepEP's LL shapes (128 tokens x 7168,
  top-8 of 288 experts, FP8), eager with and without peer checks (one call after a synchronize, and calls back to
  back with one synchronize at the end: what a decode loop waits for a pair), and replayed from a CUDA graph;
* ``engram_fetch`` (512 tokens x 24 entries of a 524288 x 128 bf16 table), ``all_gather`` (4 x 16 MiB in one
  session), ``barrier``.

Writes ``elastic_bench.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist


def _timer(cuda: bool):
    def run(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times: List[float] = []
        for _ in range(iters):
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    return run


def _phases(buf, fn, cuda: bool, iters: int) -> Dict[str, float]:
    from .bench import PhaseTimer

    timer = PhaseTimer(cuda)
    per: Dict[str, List[float]] = {}
    for _ in range(iters):
        buf.phase_hook = timer
        try:
            fn()
        finally:
            buf.phase_hook = None
        for k, v in timer.take().items():
            per.setdefault(k, []).append(v)
    return {k: round(statistics.median(v), 1) for k, v in per.items()}


def main(argv=None) -> None:
    from . import Buffer, ElasticBuffer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for elastic_bench.json")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            rows = _run(args, cuda, dev, Buffer, ElasticBuffer)
        finally:
            dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    env = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
               nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
               date=time.strftime("%Y-%m-%d"))
    with open(os.path.join(args.out, "elastic_bench.json"), "w") as f:
        json.dump(dict(env=env, cases=rows), f, indent=1)
    print(f"\n{env}\n\n| case | µs (median) | phases (µs) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['us']:.1f} | {r.get('phases', '')} |")


def _run(args, cuda: bool, dev, Buffer, ElasticBuffer) -> List[dict]:
    run = _timer(cuda)
    small = not cuda  # the CPU run only checks the cases
    gen = torch.Generator().manual_seed(0)
    rows: List[dict] = []

    def add(case: str, fn, buf=None) -> None:
        us = run(fn, args.iters)
        row = dict(case=case, us=round(us, 2))
        if buf is not None:
            row["phases"] = _phases(buf, fn, cuda, min(args.iters, 20))
        rows.append(row)
        print(f"{case}: {us:.1f} us", flush=True)

    # high-throughput dispatch / combine
    T, H, E, k = (64, 256, 16, 4) if small else (4096, 7168, 256, 8)
    idx = torch.rand((T, E), generator=gen).topk(k, dim=1).indices.to(dev)
    w = torch.rand((T, k), generator=gen).to(dev)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16).to(dev)
    from ..quant import per_token_cast
    from ..runtime import kernel_device_ok
    if kernel_device_ok(dev):
        x8 = tuple(per_token_cast(x, "e4m3", 128))
    else:
        from ..torch.cast import cast
        x8 = tuple(cast(x, "e4m3", (1, 128)))
    for checks in (False, True):
        eb = ElasticBuffer(None, num_max_tokens_per_rank=T, hidden=H, peer_checks=checks)
        tag = "checks" if checks else "no checks"
        for fmt, payload in (("bf16", x), ("fp8", x8)):
            out = eb.dispatch(payload, topk_idx=idx, topk_weights=w, num_experts=E)
            h = out[3]
            add(f"ht_dispatch {fmt} ({tag})", lambda p=payload: eb.dispatch(p, topk_idx=idx, topk_weights=w,
                                                                             num_experts=E), eb._engine)
            add(f"ht_cached_dispatch {fmt} ({tag})", lambda p=payload, h=h: eb.dispatch(p, handle=h), eb._engine)
            recv = out[0][0] if isinstance(out[0], tuple) else out[0]
            nbytes = recv.numel() * recv.element_size() + (out[0][1].numel() * 4 if isinstance(out[0], tuple) else 0)
            if not checks:
                src = torch.empty((nbytes,), dtype=torch.uint8, device=dev)
                dst = torch.empty_like(src)
                add(f"a2a {fmt} dispatch bytes ({nbytes})", lambda s=src, d=dst: dist.all_to_all_single(d, s))
        y = torch.randn((h.num_recv_tokens, H), generator=gen).to(torch.bfloat16).to(dev)
        add(f"ht_combine bf16 ({tag})", lambda: eb.combine(y, h), eb._engine)
        if not checks:
            src = torch.empty((y.numel() * 2,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            add(f"a2a combine bytes ({y.numel() * 2})", lambda: dist.all_to_all_single(dst, src))
        eb.destroy()

    # low latency (DeepEP's default LL shapes)
    T, H, E, k = (16, 256, 24, 4) if small else (128, 7168, 288, 8)
    idx = torch.rand((T, E), generator=gen).topk(k, dim=1).indices.to(dev)
    w = torch.rand((T, k), generator=gen).to(dev)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16).to(dev)
    for checks in (False, True):
        b = Buffer(None, peer_checks=checks)
        got = b.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        yl = got[0][0].to(torch.bfloat16)

        def pair(b=b, yl=yl):
            h = b.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
            return b.low_latency_combine(yl, idx, w, h)[0]

        add(f"ll_dispatch+combine fp8 eager ({'checks' if checks else 'no checks'})", pair, b)
        if cuda:
            from ..bench.timing import time_eager

            us, n = time_eager(pair)
            rows.append(dict(case=f"ll_dispatch+combine fp8 back to back ({'checks' if checks else 'no checks'})",
                             us=round(us, 2), calls=n))
            print(f"{rows[-1]['case']}: {us:.1f} us", flush=True)
        if cuda and not checks:
            pair()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                pair()
            add("ll_dispatch+combine fp8 graph replay", g.replay)
        b.destroy()

    # Engram, all-gather, barrier
    eb = ElasticBuffer(None)
    entries, hidden, T, n = (1024, 128, 32, 4) if small else (524288, 128, 512, 24)
    eb.engram_write(torch.randn((entries, hidden), generator=gen).to(torch.bfloat16).to(dev))
    ind = torch.randint(0, entries, (T, n), generator=gen, dtype=torch.int32).to(dev)
    add(f"engram_fetch {T}x{n} of {entries}x{hidden} bf16 (fetch + hook)", lambda: eb.engram_fetch(ind)())
    nb = (1 << 16) if small else (16 << 20)
    eb.agrs_set_config(4 * nb, 4)
    ts = [torch.randn((nb // 2,), generator=gen).to(torch.bfloat16).to(dev) for _ in range(4)]

    def ag():
        with eb.agrs_new_session():
            eb.all_gather(ts)[-1]()

    add(f"all_gather 4 x {nb >> 10} KiB (session)", ag)
    add("barrier", eb.barrier)
    eb.destroy()
    return rows


if __name__ == "__main__":
    main()
