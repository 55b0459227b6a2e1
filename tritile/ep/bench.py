"""Benchmark of ``tritile.ep``: dispatch / combine across ranks, against three torch.distributed baselines.

``python -m tritile bench --module ep --ranks 2`` (or ``python -m tritile.ep.bench --ranks 2``) starts the ranks
itself with ``torch.multiprocessing``: NCCL when CUDA has at least that many GPUs, otherwise gloo on the CPU with
tiny shapes (a smoke run: its timings say nothing about GPUs).  With ``--ranks 1`` it reports the single-GPU kernel
figures instead (layout, pack, unpack, reduce at the HT-V3 shapes, through the registered benchmark cases of
``tritile/ep/_bench.py``).

What one multi-rank run measures (spec ``ep.md`` §4.7):

* **Step 0**: ``all_to_all_single`` with equal splits from 4 KiB to 256 MiB per rank (latency floor and peak
  cross-GPU GB/s, ``B_peak``) and the local device copy bandwidth.
* For each workload (HT-V3, HT-small, LL-decode; uniform, unbalanced and masked routing) and each operation
  (dispatch, combine; LL dispatch, combine, dispatch + combine): ours and the baselines

  - **B0** "plain all_to_all": one row per (token, expert) selection, sorted by expert; a count exchange, one host
    sync, one ``all_to_all_single`` of rows (and of scales in FP8); combine sends the rows back and does a weighted
    ``index_add_``;
  - **B1** "dedup in torch": one row per (token, destination rank) built with torch ops, one count exchange, one
    host sync and one ``all_to_all_single`` per tensor (x, scales, local expert ids, weights, source index);
    combine sends the rows back and sums them with ``index_add_`` in fp32;
  - **B2** "comm floor": one equal-split ``all_to_all_single`` of the physical bytes ours moves.

* Every timing: warm-up, then per iteration L2 flushed (GPU), device synchronised, host barrier, CUDA events (wall
  clock on the CPU) around the Python call; the per-iteration time is the slowest rank's; median and p99 are
  reported.  Kernel time (GPU) is the sum of the kernel durations in the profiler's CUPTI records (L2 flushed
  first, the flush left out), also split by kernel name (:func:`classify_kernel`).  Ours also gets a phase
  breakdown (layout, notify + host sync, pack, exchange, unpack / reduce) through ``Buffer.phase_hook``.
* Each HT workload checks ours against B1 (same receive order by construction): received rows, ids and weights
  bit for bit, and the largest difference of the combined output.

Bytes (per rank; the busiest rank's figure is reported): a row of x is ``H`` bytes in FP8 plus ``H / 128`` fp32
scales, ``2 H`` in BF16; its metadata is ``k`` int32 expert ids, ``k`` fp32 weights and an int32 source index.

* physical bytes = rows sent to *other* ranks x (x row + metadata) (dispatch); rows returned to other ranks x 2H
  (combine).  This is what crosses NVLink; compare with ``B_peak`` and B2.
* logical bytes (DeepEP v1 style) = rows received, local ones included, x the x row (dispatch) or 2H (combine);
  v2 style adds the ids and weights.  At EP2 half of the rows never leave the GPU, so logical exceeds the link.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import inspect
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["Workload", "workloads", "make_routing", "fp8_cast", "classify_kernel", "PhaseTimer", "run_rank",
           "main", "BASELINES", "PHASES", "HOOK_PHASES"]

BASELINES = ("B0", "B1", "B2")
#: Kernel classes of the kernel-time breakdown (:func:`classify_kernel`).
PHASES = ("layout", "pack", "exchange", "unpack", "reduce", "other", "memcpy")
#: Phases a ``Buffer.phase_hook`` reports (tritile.ep's names), timed with CUDA events / the wall clock.
HOOK_PHASES = ("layout", "notify", "pack", "exchange", "unpack", "expand", "prereduce", "reduce")
_FLUSH_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark shape.  ``id`` names it by its GPU (nominal) shape; the actual sizes are the fields."""

    id: str
    family: str  # "HT-V3" | "HT-small" | "LL-decode"
    num_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    fp8: bool
    routing: str = "uniform"  # "uniform" | "unbalanced" | "masked"
    ratio: float = 1.0  # unbalanced: tokens reaching rank 0 / mean over the other ranks
    masked_ratio: float = 0.0  # fraction of top-k slots set to -1
    masked_slots: int = 0  # this many random top-k slots set to -1 (LL; at most a quarter of the slots)

    @property
    def low_latency(self) -> bool:
        return self.family == "LL-decode"


def workloads(tiny: bool = False, quick: bool = False) -> List[Workload]:
    """The workloads of spec §4.7.  ``tiny``: the same list with CPU-sized shapes (ids keep the nominal shape);
    ``quick``: one uniform HT-V3 shape per dtype, HT-small and LL at 128 tokens."""
    ht_t = {4096: 24, 8192: 40} if tiny else {4096: 4096, 8192: 8192}
    ht_h, ht_e = (256, 16) if tiny else (7168, 256)
    sm_t, sm_h, sm_e = (24, 128, 8) if tiny else (4096, 2048, 64)
    ll_t = {1: 1, 16: 2, 32: 3, 64: 5, 128: 8, 256: 12} if tiny else {t: t for t in (1, 16, 32, 64, 128, 256)}
    ll_h = 256 if tiny else 7168
    ll_e = {256: 16, 288: 24} if tiny else {256: 256, 288: 288}
    out: List[Workload] = []
    dtypes = (("FP8", True), ("BF16", False))
    routings = [("uniform", {}), ("unbalanced1.5", dict(routing="unbalanced", ratio=1.5)),
                ("unbalanced2", dict(routing="unbalanced", ratio=2.0)),
                ("masked10", dict(routing="masked", masked_ratio=0.1))]
    k8 = 4 if tiny else 8
    k6 = 3 if tiny else 6
    for t in (4096, 8192):
        for dname, fp8 in dtypes:
            for rname, kw in routings:
                if quick and (t != 4096 or rname != "uniform"):
                    continue
                out.append(Workload(f"HT-V3/T{t}/k8/{dname}/{rname}", "HT-V3", ht_t[t], ht_h, ht_e, k8, fp8, **kw))
            if not quick:
                out.append(Workload(f"HT-V3/T{t}/k6/{dname}/uniform", "HT-V3", ht_t[t], ht_h, ht_e, k6, fp8))
    for dname, fp8 in dtypes:
        out.append(Workload(f"HT-small/T4096/k6/{dname}/uniform", "HT-small", sm_t, sm_h, sm_e, 3 if tiny else 6, fp8))
    for e in (256, 288):
        for t in (1, 16, 32, 64, 128, 256):
            for dname, fp8 in dtypes:
                if quick and (t != 128 or e != 256):
                    continue
                out.append(Workload(f"LL-decode/T{t}/E{e}/{dname}/masked10slots", "LL-decode", ll_t[t], ll_h,
                                    ll_e[e], k8, fp8, routing="masked", masked_slots=10))
    return out


@functools.lru_cache(maxsize=None)
def _unbalance_factor(num_experts: int, num_ranks: int, num_topk: int, ratio: float) -> float:
    """Scale of rank 0's expert scores (uniform in [0, f) against [0, 1) elsewhere) that makes the number of tokens
    reaching rank 0 ``ratio`` times the mean over the other ranks (bisection on a fixed 4096-token sample)."""
    if ratio == 1.0 or num_ranks < 2:
        return 1.0
    per = num_experts // num_ranks
    g = torch.Generator().manual_seed(12345)
    base = torch.rand(4096, num_experts, generator=g)
    lo, hi = 1.0, 100.0
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        s = base.clone()
        s[:, :per] *= mid
        ranks = s.topk(num_topk, dim=1, sorted=False).indices // per
        hit = torch.zeros(s.shape[0], num_ranks, dtype=torch.bool).scatter_(1, ranks, True).float().sum(0)
        if hit[0] > hit[1:].mean() * ratio:
            hi = mid
        else:
            lo = mid
    return lo


def _randn(shape: Tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    """bfloat16 normal values drawn on ``device`` (benchmark data)."""
    return torch.randn(shape, generator=g, device=device).to(torch.bfloat16)


def make_routing(w: Workload, rank: int, num_ranks: int, device: torch.device,
                 seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routing of one rank: ``topk_idx`` int64 ``[T, k]`` (distinct experts, ``-1`` = masked slot) and
    ``topk_weights`` float32 ``[T, k]`` (positive, 0 at masked slots).  Drawn on the CPU from ``seed`` and
    ``rank``, so every device sees the same routing."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * rank + 1)
    t, e, k = w.num_tokens, w.num_experts, w.num_topk
    scores = torch.rand(t, e, generator=g)
    if w.ratio != 1.0:
        scores[:, : e // num_ranks] *= _unbalance_factor(e, num_ranks, k, w.ratio)
    idx = scores.topk(k, dim=1, sorted=False).indices.to(torch.int64)
    if w.masked_ratio > 0:
        idx[torch.rand(t, k, generator=g) < w.masked_ratio] = -1
    if w.masked_slots > 0 and t * k > 0:
        # DeepEP's LL test masks 10 slots of its 128 tokens; tiny batches keep at least 3/4 of their slots
        pos = torch.randperm(t * k, generator=g)[: min(w.masked_slots, max(1, t * k // 4))]
        idx.view(-1)[pos] = -1
    weights = torch.rand(t, k, generator=g) + 0.05
    weights[idx < 0] = 0
    return idx.to(device), weights.to(device)


def fp8_cast(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel e4m3 cast (scale = amax / 448): ``x`` bf16 ``[T, H]`` (``H % 128 == 0``) ->
    (float8_e4m3fn ``[T, H]``, float32 scales ``[T, H / 128]``).  Benchmark data only; not bit-matched."""
    t, h = x.shape
    xf = x.float().view(t, h // 128, 128)
    sf = xf.abs().amax(-1).clamp_min(1e-4) / 448.0
    q = (xf / sf.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(t, h), sf


# ---------------------------------------------------------------------------------------------
# Byte accounting (plain torch, independent of the module under test)
# ---------------------------------------------------------------------------------------------
def _rank_mask(topk_idx: torch.Tensor, num_ranks: int, per_rank: int) -> torch.Tensor:
    """``[T, R]`` bool: token t has at least one valid expert on rank r."""
    t = topk_idx.shape[0]
    dest = torch.where(topk_idx >= 0, topk_idx // per_rank, num_ranks)
    mask = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    mask.scatter_(1, dest, True)
    return mask[:, :num_ranks]


@dataclasses.dataclass
class _Counts:
    """Rows each rank sends to each rank, deduplicated per (token, rank) and per (token, expert) selection."""

    dedup: List[List[int]]  # [src][dst] rows (one per token and destination rank)
    sel: List[List[int]]  # [src][dst] (token, expert) selections


def _all_counts(topk_idx: torch.Tensor, num_ranks: int, per_rank: int, group) -> _Counts:
    """Every rank's send counts (an all-gather over the CPU group)."""
    mask = _rank_mask(topk_idx, num_ranks, per_rank)
    dedup = mask.sum(0)
    valid = topk_idx[topk_idx >= 0]
    sel = torch.bincount(valid // per_rank, minlength=num_ranks)
    mine = torch.cat([dedup, sel]).to(torch.int64).cpu()
    gathered = [torch.zeros_like(mine) for _ in range(num_ranks)]
    dist.all_gather(gathered, mine, group=group)
    return _Counts([g[:num_ranks].tolist() for g in gathered], [g[num_ranks:].tolist() for g in gathered])


def _expert_counts(topk_idx: torch.Tensor, num_experts: int, ctx: "_Ctx") -> List[int]:
    """(token, slot) pairs selecting each of this rank's experts, over all ranks' tokens (LL ``recv_count``)."""
    mine = torch.bincount(topk_idx[topk_idx >= 0].cpu(), minlength=num_experts).to(torch.int64)
    dist.all_reduce(mine, group=ctx.cpu_group)
    per = num_experts // ctx.num_ranks
    return mine[ctx.rank * per:(ctx.rank + 1) * per].tolist()


def _row_bytes(w: Workload) -> Tuple[int, int]:
    """(x row bytes incl. scales, metadata bytes per row)."""
    x = w.hidden + (w.hidden // 128) * 4 if w.fp8 else 2 * w.hidden
    return x, w.num_topk * (4 + 4) + 4


def _bytes(w: Workload, c: _Counts) -> Dict[str, Dict[str, int]]:
    """Per operation and implementation: physical (busiest sender) and logical (busiest receiver) bytes."""
    r = len(c.dedup)
    xrow, meta = _row_bytes(w)
    h2 = 2 * w.hidden
    sent_remote = [sum(c.dedup[s][d] for d in range(r) if d != s) for s in range(r)]
    back_remote = [sum(c.dedup[s][d] for s in range(r) if s != d) for d in range(r)]
    recv_all = [sum(c.dedup[s][d] for s in range(r)) for d in range(r)]
    sel_remote = [sum(c.sel[s][d] for d in range(r) if d != s) for s in range(r)]
    sel_back = [sum(c.sel[s][d] for s in range(r) if s != d) for d in range(r)]
    return {
        "dispatch": dict(physical=max(sent_remote) * (xrow + meta), logical=max(recv_all) * xrow,
                         logical_v2=max(recv_all) * (xrow + meta - 4), B0_physical=max(sel_remote) * xrow,
                         rows_received=max(recv_all), rows_remote=max(sent_remote)),
        "combine": dict(physical=max(back_remote) * h2, logical=max(recv_all) * h2,
                        logical_v2=max(recv_all) * h2, B0_physical=max(sel_back) * h2,
                        rows_received=max(recv_all), rows_remote=max(back_remote)),
    }


# ---------------------------------------------------------------------------------------------
# Baselines (plain torch.distributed + torch ops)
# ---------------------------------------------------------------------------------------------
def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]], in_splits: Optional[List[int]],
         group) -> torch.Tensor:
    """``all_to_all_single`` of rows, 2D tensors as byte rows (gloo has no FP8; NCCL moves bytes either way)."""
    o = out.view(torch.uint8) if out.dtype != torch.uint8 and out.dim() == 2 else out
    i = inp.view(torch.uint8) if inp.dtype != torch.uint8 and inp.dim() == 2 else inp
    dist.all_to_all_single(o, i, out_splits, in_splits, group=group)
    return out


class _B0:
    """Plain per-selection all-to-all (Megatron-style alltoall dispatcher): no deduplication."""

    def __init__(self, group, num_ranks: int, num_experts: int):
        self.group, self.r, self.e = group, num_ranks, num_experts
        self.l = num_experts // num_ranks

    def dispatch(self, x: torch.Tensor, sf: Optional[torch.Tensor], topk_idx: torch.Tensor):
        k = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)
        sel = (flat >= 0).nonzero().squeeze(1)
        experts, order = torch.sort(flat[sel], stable=True)
        sel = sel[order]
        tok = sel // k
        per_expert = torch.bincount(experts, minlength=self.e)
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=self.group)
        splits = torch.cat([per_expert.view(self.r, self.l).sum(1), recv_per_expert.view(self.r, self.l).sum(1)])
        splits = splits.tolist()
        send, recv = splits[: self.r], splits[self.r:]
        n = sum(recv)
        rx = _a2a(x.new_empty(n, x.shape[1]), x.index_select(0, tok), recv, send, self.group)
        rsf = None
        if sf is not None:
            rsf = _a2a(sf.new_empty(n, sf.shape[1]), sf.index_select(0, tok), recv, send, self.group)
        return rx, rsf, (tok, sel, send, recv)

    def combine(self, y: torch.Tensor, state, topk_weights: torch.Tensor) -> torch.Tensor:
        tok, sel, send, recv = state
        back = _a2a(y.new_empty(sum(send), y.shape[1]), y, send, recv, self.group)
        w = topk_weights.reshape(-1).index_select(0, sel)
        out = torch.zeros(topk_weights.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, tok, back.float() * w.unsqueeze(1))
        return out.to(torch.bfloat16)


class _B1:
    """Per-rank deduplication in torch ops; one count exchange, one ``all_to_all_single`` per tensor."""

    def __init__(self, group, num_ranks: int, num_experts: int):
        self.group, self.r = group, num_ranks
        self.l = num_experts // num_ranks

    def dispatch(self, x: torch.Tensor, sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor):
        mask = _rank_mask(topk_idx, self.r, self.l)
        send_counts = mask.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        splits = torch.cat([send_counts, recv_counts]).tolist()
        send, recv = splits[: self.r], splits[self.r:]
        dst, tok = mask.t().nonzero(as_tuple=True)  # ascending (destination rank, token)
        ids = topk_idx.index_select(0, tok)
        base = (dst * self.l).unsqueeze(1)
        own = (ids >= base) & (ids < base + self.l)
        send_ids = torch.where(own, ids - base, -1)
        send_w = torch.where(own, topk_weights.index_select(0, tok), 0.0)
        n, k = sum(recv), topk_idx.shape[1]
        rx = _a2a(x.new_empty(n, x.shape[1]), x.index_select(0, tok), recv, send, self.group)
        rsf = None
        if sf is not None:
            rsf = _a2a(sf.new_empty(n, sf.shape[1]), sf.index_select(0, tok), recv, send, self.group)
        rids = _a2a(send_ids.new_empty(n, k), send_ids, recv, send, self.group)
        rw = _a2a(send_w.new_empty(n, k), send_w, recv, send, self.group)
        src = tok.to(torch.int32)
        rsrc = _a2a(src.new_empty(n), src, recv, send, self.group)
        return (rx, rsf, rids, rw, rsrc), (tok, send, recv, topk_idx.shape[0])

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        tok, send, recv, t = state
        back = _a2a(y.new_empty(sum(send), y.shape[1]), y, send, recv, self.group)
        out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, tok, back.float())
        return out.to(torch.bfloat16)


class _B2:
    """One equal-split ``all_to_all_single`` that sends ``nbytes`` to the other ranks (the communication floor)."""

    def __init__(self, group, num_ranks: int, nbytes: int, device: torch.device):
        self.group = group
        chunk = -(-max(nbytes, 1) // max(num_ranks - 1, 1))
        chunk = (chunk + 15) // 16 * 16
        self.inp = torch.empty(chunk * num_ranks, dtype=torch.uint8, device=device).fill_(1)
        self.out = torch.empty_like(self.inp)

    def __call__(self) -> torch.Tensor:
        dist.all_to_all_single(self.out, self.inp, group=self.group)
        return self.out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Ctx:
    """One rank's measurement context: groups (the measured one, and gloo for host barriers), device, counts."""

    group: Any
    cpu_group: Any
    rank: int
    num_ranks: int
    device: torch.device
    warmup: int
    iters: int
    prof_iters: int
    flush: Optional[torch.Tensor] = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def prepare(self) -> None:
        """L2 flush, device sync and a host barrier: every rank starts the next call at once, on an idle GPU."""
        if self.flush is not None:
            self.flush.bitwise_not_()
        self.sync()
        dist.barrier(group=self.cpu_group)

    def rank_max(self, vals: Sequence[float]) -> List[float]:
        t = torch.tensor(list(vals), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return t.tolist()


def _stats(times: Sequence[float]) -> Dict[str, float]:
    """Median, p99 and min (µs) of per-iteration times."""
    s = sorted(times)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return dict(median_us=round(statistics.median(s), 2), p99_us=round(p99, 2), min_us=round(s[0], 2),
                iters=len(s))


def time_call(ctx: _Ctx, fn: Callable[[], Any]) -> Dict[str, float]:
    """Median / p99 / min µs of ``fn`` over ``ctx.iters`` iterations after ``ctx.warmup``; per iteration the
    slowest rank's time.  Every rank must call this with the same ``fn`` (collectives inside)."""
    for _ in range(ctx.warmup):
        fn()
    ctx.sync()
    times: List[float] = []
    if ctx.cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ctx.iters)]
        for s, e in evs:
            ctx.prepare()
            s.record()
            fn()
            e.record()
        ctx.sync()
        times = [s.elapsed_time(e) * 1e3 for s, e in evs]
    else:
        for _ in range(ctx.iters):
            ctx.prepare()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return _stats(ctx.rank_max(times))


def classify_kernel(name: str) -> str:
    """Phase of a GPU kernel, from its name: ``exchange`` (NCCL), ``layout``, ``unpack`` (also the row gathers and
    the low-latency slab placement), ``pack``, ``reduce``, ``memcpy`` or ``other`` (torch's own kernels)."""
    n = name.lower()
    if "nccl" in n:
        return "exchange"
    if n.startswith(("memcpy", "memset")):
        return "memcpy"
    if "layout" in n:
        return "layout"
    if "unpack" in n or "expand" in n or "gather" in n or "positions" in n:
        return "unpack"
    if "pack" in n:
        return "pack"
    if "reduce" in n or "combine" in n:
        return "reduce"
    return "other"


def kernel_time(ctx: _Ctx, fn: Callable[[], Any]) -> Optional[Dict[str, Any]]:
    """GPU only: µs per call of kernel execution (CUPTI records, L2 flushed before each call and left out of the
    sum), total and per phase (:func:`classify_kernel`), the slowest rank's figure for each.  None on the CPU."""
    if not ctx.cuda or ctx.prof_iters <= 0:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    ctx.sync()
    sums = dict.fromkeys(PHASES, 0.0)
    names: Dict[str, float] = {}
    ok = 1.0
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(ctx.prof_iters):
                ctx.prepare()
                fn()
            ctx.sync()
        for ev in prof.events():
            if ev.device_type != DeviceType.CUDA or "bitwise_not" in ev.name:
                continue
            us = ev.time_range.elapsed_us()
            sums[classify_kernel(ev.name)] += us
            names[ev.name] = names.get(ev.name, 0.0) + us
    except Exception:  # no CUPTI: every rank must still take part in the reduction below
        ok = 0.0
    vals = ctx.rank_max([sums[p] / ctx.prof_iters for p in PHASES] + [-ok])
    if vals[-1] != -1.0:
        return None
    phases = {p: round(v, 2) for p, v in zip(PHASES, vals[:-1])}
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return dict(kernel_us=round(sum(v for p, v in phases.items() if p != "memcpy"), 2), kernel_phases=phases,
                kernels={k[:80]: round(v / ctx.prof_iters, 2) for k, v in top})


class PhaseTimer:
    """A ``Buffer.phase_hook``: times each phase of a call with CUDA events on the stream the phase runs on (GPU)
    or the wall clock (CPU).  A phase that waits for the host (the count exchange's sync) includes the wait."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._records: List[Tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        self._records.append((name, a, b))

    def take(self) -> Dict[str, float]:
        """µs per phase name since the last call (summed when a phase runs more than once); synchronises."""
        if self.cuda:
            torch.cuda.synchronize()
        out: Dict[str, float] = {}
        for name, a, b in self._records:
            us = a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
            out[name] = out.get(name, 0.0) + us
        self._records.clear()
        return out


def phase_times(ctx: _Ctx, buf, fn: Callable[[], Any]) -> Optional[Dict[str, float]]:
    """Median µs per phase of ``fn`` (a call on ``buf``) through ``buf.phase_hook``, the slowest rank's; None when
    the buffer has no hook.  Per iteration: L2 flush, sync and host barrier, as :func:`time_call`."""
    if not hasattr(buf, "phase_hook"):
        return None
    timer = PhaseTimer(ctx.cuda)
    per: Dict[str, List[float]] = {k: [] for k in HOOK_PHASES}
    try:
        for _ in range(max(1, min(ctx.iters, 20))):
            ctx.prepare()
            buf.phase_hook = timer
            try:
                fn()
            finally:
                buf.phase_hook = None
            got = timer.take()
            for k in HOOK_PHASES:
                per[k].append(got.get(k, 0.0))
    except Exception as e:  # same on every rank
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    vals = ctx.rank_max([statistics.median(per[k]) for k in HOOK_PHASES])
    return {k: round(v, 2) for k, v in zip(HOOK_PHASES, vals) if v > 0}


def overlap(ctx: _Ctx, fn: Callable[[], Any], fn_us: float, iters: int = 10) -> Dict[str, Any]:
    """GPU only: slowdown of a bf16 GEMM stream (4096 x 7168 x 7168 products on a second stream) while ``fn`` runs
    on the current one (NCCL and our kernels take SMs from it), and of ``fn`` itself.  The GEMMs are sized to
    cover ``fn_us``; each ratio is a median over ``iters`` iterations, the slowest rank's."""
    a = torch.randn(4096, 7168, device=ctx.device).to(torch.bfloat16)
    b = torch.randn(7168, 7168, device=ctx.device).to(torch.bfloat16)
    side = torch.cuda.Stream(device=ctx.device)
    cur = torch.cuda.current_stream(ctx.device)

    def gemms(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    def timed(n: int, with_fn: bool) -> Tuple[float, float]:
        ctx.prepare()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        side.wait_stream(cur)
        ev[0].record(cur)
        with torch.cuda.stream(side):
            ev[2].record(side)
            gemms(n)
            ev[3].record(side)
        if with_fn:
            fn()
        ev[1].record(cur)
        ctx.sync()
        return ev[0].elapsed_time(ev[1]) * 1e3, ev[2].elapsed_time(ev[3]) * 1e3

    gemms(3)
    ctx.sync()
    one = statistics.median(timed(1, False)[1] for _ in range(5))
    n = max(1, round(fn_us / max(one, 1e-3)))
    alone = [timed(n, False)[1] for _ in range(iters)]
    both = [timed(n, True) for _ in range(iters)]
    vals = ctx.rank_max([statistics.median(t for _, t in both) / statistics.median(alone),
                         statistics.median(f for f, _ in both) / max(fn_us, 1e-3)])
    return dict(gemms=n, gemm_us=round(one, 1), gemm_slowdown=round(vals[0], 3), call_slowdown=round(vals[1], 3))


def _measure(ctx: _Ctx, fn: Callable[[], Any], profile_kernels: bool = True) -> Dict[str, Any]:
    """End-to-end stats plus kernel time; an exception becomes ``{"error": ...}`` (raised on every rank alike,
    since all ranks run the same code on the same kind of data)."""
    try:
        res: Dict[str, Any] = time_call(ctx, fn)
        if profile_kernels:
            kt = kernel_time(ctx, fn)
            if kt is not None:
                res.update(kt)
        return res
    except Exception as e:  # reported in the table and the JSON
        if os.environ.get("TRITILE_EP_BENCH_TRACE"):
            traceback.print_exc()
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")


def _gbs(res: Dict[str, Any], nbytes: int, key: str) -> None:
    if "median_us" in res and res["median_us"] > 0:
        res[key] = float(f"{nbytes / res['median_us'] / 1e3:.4g}")


# ---------------------------------------------------------------------------------------------
# The module under test
# ---------------------------------------------------------------------------------------------
def load_buffer_class(spec: str):
    """``"package.module:Attr"`` -> the class (default ``tritile.ep:Buffer``; ``deep_ep:Buffer`` works too)."""
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr or "Buffer")


def _make_buffer(cls, group, w: Workload, num_ranks: int):
    """A buffer for workload ``w``: tritile's MoE sizing keywords where the class takes them, DeepEP's size hints
    where it has them, else the defaults."""
    params = inspect.signature(cls).parameters
    kw: Dict[str, Any] = {}
    local_e = w.num_experts // num_ranks
    # peer_checks=False: the timed calls are the production configuration (no cross-rank argument check)
    for name, val in (("num_max_tokens_per_rank", w.num_tokens), ("hidden", w.hidden), ("num_topk", w.num_topk),
                      ("use_fp8_dispatch", w.fp8), ("peer_checks", False)):
        if name in params:
            kw[name] = val
    if w.low_latency:
        kw["low_latency_mode"] = True
        if "num_qps_per_rank" in params:
            kw["num_qps_per_rank"] = local_e
        hint = getattr(cls, "get_low_latency_rdma_size_hint", None)
        if hint is not None:
            with contextlib.suppress(Exception):
                kw["num_rdma_bytes"] = int(hint(w.num_tokens, w.hidden, num_ranks, w.num_experts))
    else:
        with contextlib.suppress(Exception):
            cfg = cls.get_dispatch_config(num_ranks)
            kw["num_nvl_bytes"] = int(cfg.get_nvl_buffer_size_hint(w.hidden * 2, num_ranks))
    return cls(group, **kw)


def _destroy(buf) -> None:
    with contextlib.suppress(Exception):
        buf.destroy()


# ---------------------------------------------------------------------------------------------
# One workload
# ---------------------------------------------------------------------------------------------
def _try(fn: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # raised alike on every rank
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")


def _ht_workload(ctx: _Ctx, cls, w: Workload, seed: int) -> Dict[str, Any]:
    """High-throughput workload: ours (layout, dispatch, cached dispatch, combine, phases, overlap), B0, B1, B2,
    the check against B1, bytes and GB/s."""
    r, dev = ctx.num_ranks, ctx.device
    # GEMM overlap (GPU): on the uniform k = 8 shapes only, to keep the run short
    with_overlap = ctx.cuda and w.routing == "uniform" and w.num_topk == 8
    per = w.num_experts // r
    topk_idx, topk_w = make_routing(w, ctx.rank, r, dev, seed)
    g = torch.Generator(device=dev).manual_seed(seed + 17 * ctx.rank)
    x = _randn((w.num_tokens, w.hidden), g, dev)
    xq, sf = fp8_cast(x) if w.fp8 else (x, None)
    xin = (xq, sf) if w.fp8 else x
    counts = _all_counts(topk_idx, r, per, ctx.cpu_group)
    nbytes = _bytes(w, counts)
    n_recv = sum(counts.dedup[s][ctx.rank] for s in range(r))
    y = _randn((n_recv, w.hidden), g, dev)
    out: Dict[str, Any] = dict(bytes=nbytes, dispatch={}, combine={})

    # ours
    ours_out = None
    buf = _make_buffer(cls, ctx.group, w, r)
    try:
        d, c = out["dispatch"], out["combine"]
        d["ours_layout"] = _measure(ctx, lambda: buf.get_dispatch_layout(topk_idx, w.num_experts))

        def full():
            a, b, e_, f, _ = buf.get_dispatch_layout(topk_idx, w.num_experts)
            return buf.dispatch(xin, num_tokens_per_rank=a, num_tokens_per_rdma_rank=b, is_token_in_rank=f,
                                num_tokens_per_expert=e_, topk_idx=topk_idx, topk_weights=topk_w)

        d["ours"] = _measure(ctx, full)
        recv = full()
        handle = recv[4]
        rows = (recv[0][0] if isinstance(recv[0], tuple) else recv[0]).shape[0]
        if ctx.rank_max([float(rows != n_recv)])[0]:  # raised on every rank alike
            raise RuntimeError(f"dispatch returned the wrong number of rows (rank {ctx.rank}: {rows}, expected "
                               f"{n_recv})")
        d["ours_cached"] = _measure(ctx, lambda: buf.dispatch(xin, handle=handle))
        c["ours"] = _measure(ctx, lambda: buf.combine(y, handle))
        ours_out = (recv[0], recv[1], recv[2], buf.combine(y, handle)[0])
        for res, fn in ((d["ours"], full), (d["ours_cached"], lambda: buf.dispatch(xin, handle=handle)),
                        (c["ours"], lambda: buf.combine(y, handle))):
            ph = phase_times(ctx, buf, fn)
            if ph is not None:
                res["phases"] = ph
        if with_overlap:
            for res, fn in ((d["ours"], full), (c["ours"], lambda: buf.combine(y, handle))):
                if "median_us" in res:
                    res["overlap"] = _try(lambda: overlap(ctx, fn, res["median_us"]))
        del recv, handle
    except Exception as e:
        if os.environ.get("TRITILE_EP_BENCH_TRACE"):
            traceback.print_exc()
        out["dispatch"].setdefault("ours", dict(error=f"{type(e).__name__}: {str(e)[:200]}"))
        out["combine"].setdefault("ours", dict(error=f"{type(e).__name__}: {str(e)[:200]}"))
    finally:
        _destroy(buf)

    # baselines
    b0, b1 = _B0(ctx.group, r, w.num_experts), _B1(ctx.group, r, w.num_experts)
    xb = xq.view(torch.uint8) if w.fp8 else x
    out["dispatch"]["B0"] = _measure(ctx, lambda: b0.dispatch(xb, sf, topk_idx), profile_kernels=False)
    b0_rx, _, b0_state = b0.dispatch(xb, sf, topk_idx)
    y0 = _randn((b0_rx.shape[0], w.hidden), g, dev)
    out["combine"]["B0"] = _measure(ctx, lambda: b0.combine(y0, b0_state, topk_w), profile_kernels=False)
    del b0_rx, b0_state, y0
    out["dispatch"]["B1"] = _measure(ctx, lambda: b1.dispatch(xb, sf, topk_idx, topk_w), profile_kernels=False)
    b1_out, b1_state = b1.dispatch(xb, sf, topk_idx, topk_w)
    out["combine"]["B1"] = _measure(ctx, lambda: b1.combine(y, b1_state), profile_kernels=False)
    if ctx.rank_max([1.0 if ours_out is None else 0.0])[0] == 0.0:
        out["check"] = _check_against_b1(ctx, ours_out, b1_out, b1.combine(y, b1_state))
    del b1_state, b1_out, ours_out
    for op in ("dispatch", "combine"):
        b2 = _B2(ctx.group, r, nbytes[op]["physical"], dev)
        out[op]["B2"] = _measure(ctx, b2)
        if with_overlap and "median_us" in out[op]["B2"]:
            out[op]["B2"]["overlap"] = _try(lambda: overlap(ctx, b2, out[op]["B2"]["median_us"]))
        del b2
    _finish_gbs(out, nbytes)
    return out


def _same_bytes(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(a.shape[0], -1).view(torch.uint8),
                       b.contiguous().reshape(b.shape[0], -1).view(torch.uint8))


def _check_against_b1(ctx: _Ctx, ours, b1_out, b1_combined: torch.Tensor) -> Dict[str, Any]:
    """Ours against the torch baseline B1, which builds the contract's receive order (ascending source rank, then
    source token): received x (and scales), local expert ids, weights bit for bit; combine's largest difference
    (0 at 2 ranks, where both sum two fp32 terms)."""
    recv_x, recv_idx, recv_w, combined = ours
    rx, rsf, rids, rw, _ = b1_out
    if isinstance(recv_x, tuple):
        same_x = _same_bytes(recv_x[0], rx) and _same_bytes(recv_x[1].float(), rsf)
    else:
        same_x = _same_bytes(recv_x, rx)
    flags = [same_x, recv_idx is not None and _same_bytes(recv_idx.long(), rids),
             recv_w is not None and _same_bytes(recv_w.float(), rw)]
    diff = (combined.float() - b1_combined.float()).abs().max().item() if combined.numel() else 0.0
    vals = ctx.rank_max([0.0 if f else 1.0 for f in flags] + [diff])
    return dict(recv_x_equal=vals[0] == 0, recv_topk_idx_equal=vals[1] == 0, recv_topk_weights_equal=vals[2] == 0,
                combine_max_abs_diff=vals[3])


def _finish_gbs(out: Dict[str, Any], nbytes: Dict[str, Dict[str, int]]) -> None:
    """Add GB/s, % of B2 and each baseline's time over ours to the results of one workload."""
    for op in ("dispatch", "combine"):
        nb = nbytes[op]
        res = out[op]
        for impl in ("ours", "ours_cached", "B1", "B2"):
            if impl in res:
                _gbs(res[impl], nb["physical"], "physical_gbs")
        for impl in ("ours", "ours_cached"):
            if impl in res:
                _gbs(res[impl], nb["logical"], "logical_gbs")
                _gbs(res[impl], nb["logical_v2"], "logical_v2_gbs")
        if "B0" in res:
            _gbs(res["B0"], nb["B0_physical"], "physical_gbs")
        ours, b2 = res.get("ours", {}), res.get("B2", {})
        if "median_us" in ours:
            for impl in BASELINES:
                if "median_us" in res.get(impl, {}):
                    res[impl]["ours_speedup"] = round(res[impl]["median_us"] / ours["median_us"], 2)
            if b2.get("physical_gbs") and "physical_gbs" in ours:
                ours["pct_of_B2"] = round(100 * ours["physical_gbs"] / b2["physical_gbs"], 1)


def _ll_workload(ctx: _Ctx, cls, w: Workload, seed: int, graph: bool) -> Dict[str, Any]:
    """Low-latency workload: ours (dispatch, combine, both, phases, the recv_count check), B0, B1, B2, and both
    paths replayed from CUDA graphs (GPU)."""
    r, dev = ctx.num_ranks, ctx.device
    per = w.num_experts // r
    m = w.num_tokens
    topk_idx, topk_w = make_routing(w, ctx.rank, r, dev, seed)
    g = torch.Generator(device=dev).manual_seed(seed + 17 * ctx.rank)
    x = _randn((w.num_tokens, w.hidden), g, dev)
    counts = _all_counts(topk_idx, r, per, ctx.cpu_group)
    nbytes = _bytes(w, counts)
    xrow, meta = _row_bytes(w)
    # a fixed-capacity exchange moves M rows per peer whatever the routing: the bytes on the wire
    nbytes["dispatch"]["capacity_physical"] = m * (xrow + meta) * (r - 1)
    nbytes["combine"]["capacity_physical"] = m * 2 * w.hidden * (r - 1)
    n_recv = sum(counts.dedup[s][ctx.rank] for s in range(r))
    out: Dict[str, Any] = dict(bytes=nbytes, dispatch={}, combine={}, dispatch_combine={})

    buf = _make_buffer(cls, ctx.group, w, r)
    try:
        def lld():
            return buf.low_latency_dispatch(x, topk_idx, m, w.num_experts, use_fp8=w.fp8)

        out["dispatch"]["ours"] = _measure(ctx, lld)
        res0 = lld()
        handle = res0[2]
        got = res0[1].to(torch.int64).cpu().tolist() if isinstance(res0[1], torch.Tensor) else None
        want = _expert_counts(topk_idx, w.num_experts, ctx)
        out["check"] = dict(recv_count_equal=ctx.rank_max([0.0 if got == want else 1.0])[0] == 0.0)
        del res0
        ybuf = _randn((per, r * m, w.hidden), g, dev)

        def llc(h=handle):
            return buf.low_latency_combine(ybuf, topk_idx, topk_w, h)

        out["combine"]["ours"] = _measure(ctx, llc)

        def both():
            return buf.low_latency_combine(ybuf, topk_idx, topk_w, lld()[2])

        out["dispatch_combine"]["ours"] = _measure(ctx, both)
        for res, fn in ((out["dispatch"]["ours"], lld), (out["combine"]["ours"], llc)):
            ph = phase_times(ctx, buf, fn)
            if ph is not None:
                res["phases"] = ph
    except Exception as e:
        if os.environ.get("TRITILE_EP_BENCH_TRACE"):
            traceback.print_exc()
        for op in ("dispatch", "combine", "dispatch_combine"):
            out[op].setdefault("ours", dict(error=f"{type(e).__name__}: {str(e)[:200]}"))

    xq, sf = fp8_cast(x) if w.fp8 else (x, None)
    xb = xq.view(torch.uint8) if w.fp8 else x
    y = _randn((n_recv, w.hidden), g, dev)
    b0, b1 = _B0(ctx.group, r, w.num_experts), _B1(ctx.group, r, w.num_experts)
    out["dispatch"]["B0"] = _measure(ctx, lambda: b0.dispatch(xb, sf, topk_idx), profile_kernels=False)
    b0_rx, _, b0_state = b0.dispatch(xb, sf, topk_idx)
    y0 = _randn((b0_rx.shape[0], w.hidden), g, dev)
    out["combine"]["B0"] = _measure(ctx, lambda: b0.combine(y0, b0_state, topk_w), profile_kernels=False)
    out["dispatch"]["B1"] = _measure(ctx, lambda: b1.dispatch(xb, sf, topk_idx, topk_w), profile_kernels=False)
    _, b1_state = b1.dispatch(xb, sf, topk_idx, topk_w)
    out["combine"]["B1"] = _measure(ctx, lambda: b1.combine(y, b1_state), profile_kernels=False)
    b2d = _B2(ctx.group, r, nbytes["dispatch"]["physical"], dev)
    b2c = _B2(ctx.group, r, nbytes["combine"]["physical"], dev)
    out["dispatch"]["B2"] = _measure(ctx, b2d)
    out["combine"]["B2"] = _measure(ctx, b2c)
    out["dispatch_combine"]["B2"] = _measure(ctx, lambda: (b2d(), b2c()), profile_kernels=False)
    # CUDA-graph replays last: a capture that fails must not spoil the eager figures above
    if graph and ctx.cuda:
        out["dispatch_combine"]["B2_graph"] = _graph_time(ctx, lambda: (b2d(), b2c()))
        if ctx.rank_max([0.0 if "median_us" in out["dispatch_combine"]["ours"] else 1.0])[0] == 0.0:
            out["dispatch_combine"]["ours_graph"] = _graph_time(
                ctx, lambda: buf.low_latency_combine(ybuf, topk_idx, topk_w, lld()[2]))
    _destroy(buf)
    _finish_gbs(out, nbytes)
    dc = out["dispatch_combine"]
    for a, b in (("ours", "B2"), ("ours_graph", "B2_graph")):
        if "median_us" in dc.get(a, {}) and "median_us" in dc.get(b, {}):
            dc[a]["x_two_B2"] = round(dc[a]["median_us"] / dc[b]["median_us"], 2)
    return out


def _graph_time(ctx: _Ctx, fn: Callable[[], Any], calls: int = 10) -> Dict[str, Any]:
    """Median / p99 µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (NCCL collectives
    captured).  Replays only if every rank captured; otherwise ``{"error": ...}`` on every rank."""
    ok, err, g = 1.0, "", None
    try:
        s = torch.cuda.Stream(device=ctx.device)
        s.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(ctx.device).wait_stream(s)
        ctx.sync()
        dist.barrier(group=ctx.cpu_group)
        g = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread keeps querying events while this thread captures
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(calls):
                fn()
        ctx.sync()
    except Exception as e:
        ok, err, g = 0.0, f"{type(e).__name__}: {str(e)[:200]}", None
        with contextlib.suppress(Exception):
            ctx.sync()
    if ctx.rank_max([-ok])[0] != -1.0:
        return dict(error=err or "capture failed on another rank")
    times = []
    for _ in range(max(ctx.iters // 2, 5)):
        ctx.prepare()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        ctx.sync()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return _stats(ctx.rank_max(times))


# ---------------------------------------------------------------------------------------------
# Step 0
# ---------------------------------------------------------------------------------------------
def step0(ctx: _Ctx, tiny: bool) -> Dict[str, Any]:
    """Equal-split ``all_to_all_single`` sweep (bytes per rank) and the local copy bandwidth."""
    sizes = [4 << 10 << (2 * i) for i in range(4 if tiny else 9)]  # 4 KiB ... 256 MiB (GPU)
    sweep = []
    for n in sizes:
        n = n // (16 * ctx.num_ranks) * 16 * ctx.num_ranks
        inp = torch.ones(n, dtype=torch.uint8, device=ctx.device)
        out = torch.empty_like(inp)
        res = _measure(ctx, lambda: dist.all_to_all_single(out, inp, group=ctx.group), profile_kernels=False)
        crossing = n * (ctx.num_ranks - 1) // ctx.num_ranks
        res.update(bytes_per_rank=n, bytes_crossing=crossing)
        _gbs(res, crossing, "crossing_gbs")
        sweep.append(res)
        del inp, out
    peak = max((r.get("crossing_gbs", 0.0) for r in sweep), default=0.0)
    floor = min((r.get("median_us", float("inf")) for r in sweep), default=None)
    copy = None
    if ctx.cuda:
        from ..testing.bench import copy_bandwidth_gbs

        copy = round(copy_bandwidth_gbs(), 1)
    return dict(all_to_all=sweep, B_peak_gbs=peak, latency_floor_us=floor, copy_bandwidth_gbs=copy)


# ---------------------------------------------------------------------------------------------
# Rank entry point
# ---------------------------------------------------------------------------------------------
def _env_meta(device: torch.device) -> Dict[str, Any]:
    """Date, versions, ``NCCL_*`` variables, GPU name, NCCL version, ``nvidia-smi topo -m`` and commit."""
    import triton

    meta: Dict[str, Any] = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                                torch=torch.__version__, triton=triton.__version__)
    meta["env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k == "TORCH_NCCL_BLOCKING_WAIT"}
    if device.type == "cuda":
        meta["device"] = torch.cuda.get_device_name(device)
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            meta["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        with contextlib.suppress(Exception):
            meta["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                              timeout=20).stdout
    else:
        meta["device"] = "cpu (gloo; a smoke run: timings need GPUs)"
    with contextlib.suppress(Exception):
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    return meta


def run_rank(rank: int, num_ranks: int, opts: Dict[str, Any],
             partial_path: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """Body of one rank (the process group is already initialised).  Returns the results on rank 0, which also
    writes them to ``partial_path`` after every workload (a run cut short keeps what it measured)."""
    cuda = opts["backend"] == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if cuda else group
    ctx = _Ctx(group, cpu_group, rank, num_ranks, device, opts["warmup"], opts["iters"], opts["prof_iters"])
    if cuda and not opts.get("no_flush"):
        ctx.flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=device)
    cls = load_buffer_class(opts["buffer"])
    tiny = opts["tiny"]
    wls = workloads(tiny=tiny, quick=opts["quick"])
    if opts.get("only"):
        wls = [w for w in wls if any(s in w.id for s in opts["only"])]
    results: Dict[str, Any] = dict(meta=_env_meta(device), workloads=[])
    results["meta"].update(ranks=num_ranks, backend=opts["backend"], buffer=opts["buffer"], tiny=tiny,
                           iters=ctx.iters, warmup=ctx.warmup, l2_flush=ctx.flush is not None,
                           bytes="physical: rows sent to other ranks x (x row + k int32 ids + k fp32 weights + "
                                 "int32 source) for dispatch, x 2H for combine, busiest rank; logical: rows "
                                 "received incl. local x x row (v1), + ids and weights (v2)")
    results["step0"] = step0(ctx, tiny)
    if rank == 0 and partial_path:
        _write_json(partial_path, results)
    progress = rank == 0 and opts.get("progress", True)
    for i, w in enumerate(wls):
        if progress:
            print(f"[{i + 1}/{len(wls)}] {w.id}", file=sys.stderr, flush=True)
        res = (_ll_workload(ctx, cls, w, opts["seed"], not opts.get("no_graph")) if w.low_latency
               else _ht_workload(ctx, cls, w, opts["seed"]))
        results["workloads"].append(dict(id=w.id, params=dataclasses.asdict(w), **res))
        if rank == 0 and partial_path:
            _write_json(partial_path, results)
        if cuda:
            torch.cuda.empty_cache()
    results["targets"] = targets(results) if cuda else None
    return results if rank == 0 else None


def targets(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The issue's performance targets, each with the measured figure and pass / fail."""
    rows: List[Dict[str, Any]] = []
    for wl in results["workloads"]:
        p = wl["params"]
        if p["family"] == "LL-decode":
            dc = wl.get("dispatch_combine", {})
            for a, b in (("ours_graph", "B2_graph"), ("ours", "B2")):
                if "x_two_B2" in dc.get(a, {}):
                    if p["num_tokens"] == 128:
                        rows.append(dict(workload=wl["id"], target=f"LL dispatch+combine <= 2x two B2 ({a})",
                                         value=dc[a]["x_two_B2"], ok=dc[a]["x_two_B2"] <= 2.0))
                    break
            continue
        for op in ("dispatch", "combine"):
            res = wl.get(op, {})
            ours = res.get("ours", {})
            if "median_us" not in ours:
                rows.append(dict(workload=wl["id"], target=f"{op} runs", value=ours.get("error"), ok=False))
                continue
            for b in ("B0", "B1"):
                if "ours_speedup" in res.get(b, {}):
                    rows.append(dict(workload=wl["id"], target=f"{op} faster than {b}",
                                     value=res[b]["ours_speedup"], ok=res[b]["ours_speedup"] > 1.0))
            if p["num_tokens"] >= 4096 and "pct_of_B2" in ours:
                rows.append(dict(workload=wl["id"], target=f"{op} physical GB/s >= 90% of B2",
                                 value=ours["pct_of_B2"], ok=ours["pct_of_B2"] >= 90.0))
    return rows


def _worker(rank: int, num_ranks: int, port: int, opts: Dict[str, Any], result_path: str) -> None:
    """Process entry point (``torch.multiprocessing.spawn``): process group, :func:`run_rank`, results file."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    cuda = opts["backend"] == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))
    kw: Dict[str, Any] = dict(backend=opts["backend"], rank=rank, world_size=num_ranks,
                              timeout=datetime.timedelta(seconds=opts["timeout"]))
    if cuda:
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(**kw)
    try:
        res = run_rank(rank, num_ranks, opts, result_path)
        if rank == 0:
            res["complete"] = True
            _write_json(result_path, res)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write_json(path: str, obj: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _f(v, nd: int = 1) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if 0 < abs(v) < 10 else f"{v:.{nd}f}"
    return str(v)


def print_report(results: Dict[str, Any], out=sys.stdout) -> None:
    """Markdown tables: Step 0, then per workload / op / implementation, then ours' phases and the targets."""
    m = results["meta"]
    print(f"# tritile.ep benchmark: {m['ranks']} ranks ({m['backend']}), {m.get('device')}, torch {m['torch']}, "
          f"triton {m['triton']}, NCCL {m.get('nccl', '-')}, {m['date']}; buffer {m['buffer']}", file=out)
    if m.get("tiny"):
        print("# CPU smoke run on tiny shapes (workload ids keep the GPU shapes): timings need GPUs.", file=out)
    s0 = results["step0"]
    print(f"\n## Step 0: all_to_all_single (equal splits); B_peak {_f(s0['B_peak_gbs'])} GB/s crossing per GPU, "
          f"latency floor {_f(s0['latency_floor_us'])} us, local copy {_f(s0['copy_bandwidth_gbs'])} GB/s", file=out)
    print("| bytes per rank | median us | p99 us | crossing GB/s |\n|---|---|---|---|", file=out)
    for r in s0["all_to_all"]:
        print(f"| {r.get('bytes_per_rank')} | {_f(r.get('median_us'))} | {_f(r.get('p99_us'))} | "
              f"{_f(r.get('crossing_gbs'))} |", file=out)
    print("\n## Workloads (us: end-to-end per call, slowest rank; kernel: summed kernel durations)", file=out)
    heads = ["workload", "op", "impl", "median us", "p99 us", "kernel us", "physical GB/s", "logical GB/s",
             "% of B2", "B time / ours", "note"]
    print("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads), file=out)
    for wl in results["workloads"]:
        for op in ("dispatch", "combine", "dispatch_combine"):
            for impl, res in wl.get(op, {}).items():
                print("| " + " | ".join([
                    wl["id"], op, impl, _f(res.get("median_us")), _f(res.get("p99_us")), _f(res.get("kernel_us")),
                    _f(res.get("physical_gbs")), _f(res.get("logical_gbs")), _f(res.get("pct_of_B2")),
                    _f(res.get("ours_speedup", res.get("x_two_B2"))), res.get("error", "")[:90]]) + " |", file=out)
    print("\n## Phases of ours (us, median per call through Buffer.phase_hook: CUDA events on the comm stream, "
          "wall clock on the CPU; notify includes the count exchange's host sync)", file=out)
    print("| workload | op | " + " | ".join(HOOK_PHASES) + " | kernel us by class |\n|"
          + "---|" * (len(HOOK_PHASES) + 3), file=out)
    for wl in results["workloads"]:
        for op, impl in (("dispatch", "ours"), ("dispatch", "ours_cached"), ("combine", "ours")):
            res = wl.get(op, {}).get(impl, {})
            ph, kp = res.get("phases"), res.get("kernel_phases")
            if ph or kp:
                kcol = ", ".join(f"{k} {v:.1f}" for k, v in (kp or {}).items() if v)
                print(f"| {wl['id']} | {op if impl == 'ours' else op + ' (cached)'} | "
                      + " | ".join(_f((ph or {}).get(k), 2) for k in HOOK_PHASES) + f" | {kcol} |", file=out)
    ov = [(wl["id"], op, impl, res["overlap"]) for wl in results["workloads"] for op in ("dispatch", "combine")
          for impl, res in wl.get(op, {}).items() if "overlap" in res]
    if ov:
        print("\n## Overlap: a bf16 GEMM stream (4096 x 7168 x 7168 each) on a second stream during the call",
              file=out)
        print("| workload | op | impl | GEMMs | GEMM us alone | GEMM slowdown | call slowdown |\n"
              "|---|---|---|---|---|---|---|", file=out)
        for i, op, impl, o in ov:
            print(f"| {i} | {op} | {impl} | {o.get('gemms', '')} | {_f(o.get('gemm_us'))} | "
                  f"{_f(o.get('gemm_slowdown'))} | {_f(o.get('call_slowdown'))} {o.get('error', '')[:60]} |", file=out)
    checks = [(wl["id"], wl["check"]) for wl in results["workloads"] if "recv_x_equal" in wl.get("check", {})]
    bad = [(i, c) for i, c in checks if not (c["recv_x_equal"] and c["recv_topk_idx_equal"]
                                             and c["recv_topk_weights_equal"])]
    print(f"\n## Results against B1 (the contract's receive order): {len(checks) - len(bad)} of {len(checks)} "
          "workloads bit-identical in recv_x, recv_topk_idx, recv_topk_weights", file=out)
    for i, c in bad:
        print(f"- DIFFERS {i}: {c}", file=out)
    ll = [(wl["id"], wl["check"]["recv_count_equal"]) for wl in results["workloads"]
          if "recv_count_equal" in wl.get("check", {})]
    if ll:
        print(f"LL: {sum(ok for _, ok in ll)} of {len(ll)} workloads give recv_count equal to the routing's "
              "per-expert counts", file=out)
        for i, ok in ll:
            if not ok:
                print(f"- DIFFERS {i}: recv_count", file=out)
    tg = results.get("targets")
    if tg:
        bad = [t for t in tg if not t["ok"]]
        print(f"\n## Targets: {len(tg) - len(bad)} of {len(tg)} met", file=out)
        for t in bad:
            print(f"- MISSED {t['workload']}: {t['target']} ({t['value']})", file=out)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tritile.ep.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to start (1: single-GPU kernel figures)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="one uniform HT-V3 shape per dtype, HT-small, LL T=128")
    p.add_argument("--only", action="append", help="only workloads whose id contains this text (repeatable)")
    p.add_argument("--iters", type=int, help="timed iterations (default 50 on GPUs, 3 on the CPU)")
    p.add_argument("--warmup", type=int, help="warm-up calls (default 10 on GPUs, 1 on the CPU)")
    p.add_argument("--prof-iters", type=int, default=10, help="profiled calls for kernel time (GPU; 0: none)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU with tiny shapes even when GPUs exist")
    p.add_argument("--cpu-kernels", choices=("torch", "interpreter"), default="torch",
                   help="CPU runs: the module's pure-torch twins (fast) or its Triton kernels under the interpreter "
                        "(minutes)")
    p.add_argument("--buffer", default="tritile.ep:Buffer",
                   help="the Buffer class under test, module:attr (e.g. deep_ep:Buffer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=300, help="collective timeout, seconds")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay of the LL path")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    p.add_argument("--quiet", action="store_true", help="no per-workload progress lines")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (1 if a workload of ours failed to run)."""
    args = _parser().parse_args(argv)
    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ngpu == 1 and args.ranks > 1 and not args.cpu:
        print(f"# one GPU for {args.ranks} ranks: the single-GPU kernel figures instead (--cpu: the multi-rank "
              "smoke run on gloo)", file=sys.stderr)
        args.ranks = 1
    if args.ranks == 1:
        if ngpu == 0 and os.environ.get("TRITON_INTERPRET") != "1":
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", "tritile.ep.bench",
                                       *(argv if argv is not None else sys.argv[1:])], env)
        from ..bench.runner import run

        rows = run(modules=["ep"], quick=args.quick, json_path=args.json)
        return 1 if any(str(r.get("status", "")).startswith(("FAIL", "ERROR")) for r in rows) else 0
    use_gpu = ngpu >= args.ranks and not args.cpu
    bad = sorted({w.num_experts for w in workloads(tiny=not use_gpu, quick=args.quick)
                  if w.num_experts % args.ranks})
    if bad:
        raise ValueError(f"--ranks must divide every workload's expert count {bad}, got {args.ranks}")
    # The children import tritile afresh and inherit this environment: on the CPU, Triton kernels under the
    # interpreter or the pure-torch twins; on GPUs, no NVLink SHARP / multicast (spec §4.7).
    child_env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    if not use_gpu:
        if ngpu:
            print(f"# {ngpu} GPU(s) for {args.ranks} ranks: running gloo on the CPU instead", file=sys.stderr)
        child_env["TRITON_INTERPRET"] = "1" if args.cpu_kernels == "interpreter" else "0"
    opts = dict(backend="nccl" if use_gpu else "gloo", tiny=not use_gpu, quick=args.quick, only=args.only,
                iters=args.iters or (50 if use_gpu else 3), warmup=args.warmup if args.warmup is not None
                else (10 if use_gpu else 1), prof_iters=args.prof_iters if use_gpu else 0, buffer=args.buffer,
                seed=args.seed, timeout=args.timeout, no_graph=args.no_graph, no_flush=args.no_flush,
                progress=not args.quiet)
    import torch.multiprocessing as mp

    crashed = None
    with tempfile.TemporaryDirectory() as tmp:
        # rank 0 writes the results as it goes: to --json directly, so a run cut short keeps them
        path = os.path.abspath(args.json) if args.json else os.path.join(tmp, "results.json")
        if os.path.exists(path):
            os.remove(path)
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)
        try:
            mp.spawn(_worker, args=(args.ranks, _free_port(), opts, path), nprocs=args.ranks, join=True)
        except Exception as e:  # a rank died: report what was measured before it did
            crashed = f"{type(e).__name__}: {e}"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if not os.path.exists(path):
            raise RuntimeError(f"the benchmark ranks failed before measuring anything: {crashed}")
        with open(path) as f:
            results = json.load(f)
    if crashed:
        results["crashed"] = crashed
        print(f"# A rank failed; the results below stop at the last complete workload.\n# {crashed}",
              file=sys.stderr)
    print_report(results)
    if args.json:
        _write_json(args.json, results)
    failed = [wl["id"] for wl in results["workloads"]
              for op in ("dispatch", "combine") if "error" in wl.get(op, {}).get("ours", {"error": 1})]
    return 1 if failed or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
