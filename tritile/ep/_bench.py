"""Single-GPU benchmark cases of the ``tritile.ep`` kernels: layout, pack, unpack, reduce (and the row gather of the
fixed-capacity path) at the HT-V3 shapes (T = 4096 and 8192 tokens per rank, H = 7168, E = 256, k = 8, EP2
routing), FP8 (per-128 fp32 scales) and BF16 payloads.  On the CPU: one small shape, checked against
:mod:`tritile.ep.ref`.

Bytes are counted as the other modules count them: every input read once, every output written once (the layout's
per-block scratch tables left out).  The multi-rank benchmark is :mod:`tritile.ep.bench`."""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal

from . import ref
from .bench import Workload, fp8_cast, make_routing
from .layout import dispatch_layout
from .pack import as_words, gather_rows, meta_width, pack_meta, pack_rows, unpack_meta
from .reduce import combine_reduce

_M = "ep"
_RANKS = 2  # EP2: the routing the 2-GPU benchmark sends


def _shapes(device: torch.device, quick: bool) -> Iterator[Tuple[int, int, int, int]]:
    """(T, H, E, k): HT-V3 on the GPU, one small odd shape on the CPU."""
    if device.type == "cuda":
        for t in (4096,) if quick else (4096, 8192):
            yield t, 7168, 256, 8
    else:
        yield 37, 256, 16, 4


def _setup(device: torch.device, t: int, h: int, e: int, k: int, fp8: bool, seed: int = 0):
    w = Workload("ep-kernel", "HT-V3", t, h, e, k, fp8)
    topk_idx, topk_w = make_routing(w, 0, _RANKS, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    per_rank, _, _, slot, _ = dispatch_layout(topk_idx, e, _RANKS)
    counts = per_rank.to(torch.int64)
    base = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    num_rows = int(counts.sum())
    if fp8:
        q, sf = fp8_cast(x)
        return topk_idx, topk_w, as_words(q), sf.view(torch.int32), slot, base, num_rows
    return topk_idx, topk_w, as_words(x), None, slot, base, num_rows


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _check_tuple(out, expect) -> None:
    for o, r in zip(out, expect):
        if o is None or r is None:
            assert o is None and r is None, (o, r)
        else:
            assert_equal(o, r, check_stride=False)


@register(_M, "dispatch_layout")
def _layout_cases(device, quick):
    for t, h, e, k in _shapes(device, quick):
        w = Workload("ep-kernel", "HT-V3", t, h, e, k, False)
        topk_idx, _ = make_routing(w, 0, _RANKS, device)
        out = dispatch_layout(topk_idx, e, _RANKS)
        yield Case(params=dict(num_tokens=t, num_experts=e, num_topk=k, num_ranks=_RANKS),
                   fn=lambda topk_idx=topk_idx, e=e: dispatch_layout(topk_idx, e, _RANKS),
                   ref=lambda topk_idx=topk_idx, e=e: ref.dispatch_layout_ref(topk_idx, e, _RANKS),
                   check=_check_tuple,
                   nbytes=_nbytes(topk_idx, *out[:4]), latency_bound=True)


@register(_M, "pack_rows")
def _pack_rows_cases(device, quick):
    for t, h, e, k in _shapes(device, quick):
        for fp8 in (True, False):
            _, _, xw, _, slot, base, n = _setup(device, t, h, e, k, fp8)
            out = pack_rows(xw, slot, base, n)
            yield Case(params=dict(num_tokens=t, hidden=h, num_topk=k, num_ranks=_RANKS, fp8=fp8, rows=n),
                       fn=lambda xw=xw, slot=slot, base=base, n=n: pack_rows(xw, slot, base, n),
                       ref=lambda xw=xw, slot=slot, base=base, n=n: ref.pack_rows_ref(xw, slot, base, n),
                       check=assert_equal, nbytes=_nbytes(xw, slot, out), label="fp8" if fp8 else "bf16")


@register(_M, "pack_meta")
def _pack_meta_cases(device, quick):
    for t, h, e, k in _shapes(device, quick):
        for fp8 in (True, False):
            idx, w, _, sf, slot, base, n = _setup(device, t, h, e, k, fp8)
            per = e // _RANKS
            out = pack_meta(idx, w, sf, slot, base, n, per, k)
            yield Case(params=dict(num_tokens=t, num_topk=k, num_ranks=_RANKS, fp8=fp8, rows=n),
                       fn=lambda a=(idx, w, sf, slot, base, n, per, k): pack_meta(*a),
                       ref=lambda a=(idx, w, sf, slot, base, n, per, k): ref.pack_meta_ref(*a),
                       check=assert_equal, nbytes=_nbytes(idx, w, sf, slot, out), label="fp8" if fp8 else "bf16",
                       latency_bound=True)


@register(_M, "unpack_meta")
def _unpack_meta_cases(device, quick):
    for t, h, e, k in _shapes(device, quick):
        for fp8 in (True, False):
            idx, w, _, sf, slot, base, n = _setup(device, t, h, e, k, fp8)
            sw = 0 if sf is None else sf.shape[1]
            meta = pack_meta(idx, w, sf, slot, base, n, e // _RANKS, k)
            assert meta.shape[1] == meta_width(k, True, True, sw)
            out = unpack_meta(meta, None, k, True, True, sw)
            yield Case(params=dict(rows=n, num_topk=k, fp8=fp8),
                       fn=lambda meta=meta, sw=sw: unpack_meta(meta, None, k, True, True, sw),
                       ref=lambda meta=meta, sw=sw: ref.unpack_meta_ref(meta, None, k, True, True, sw),
                       check=_check_tuple, nbytes=_nbytes(meta, *out), label="fp8" if fp8 else "bf16",
                       latency_bound=True)


@register(_M, "gather_rows")
def _gather_rows_cases(device, quick):
    for t, h, e, k in _shapes(device, quick):
        _, _, xw, _, slot, base, n = _setup(device, t, h, e, k, False)
        src = pack_rows(xw, slot, base, n)
        g = torch.Generator().manual_seed(3)
        row_map = torch.randperm(n, generator=g).to(torch.int32).to(device)
        out = gather_rows(src, row_map)
        yield Case(params=dict(rows=n, hidden=h), fn=lambda src=src, row_map=row_map: gather_rows(src, row_map),
                   ref=lambda src=src, row_map=row_map: ref.gather_rows_ref(src, row_map), check=assert_equal,
                   nbytes=_nbytes(row_map, out) + out.numel() * out.element_size())


@register(_M, "combine_reduce")
def _combine_reduce_cases(device, quick):
    for t, h, e, k in _shapes(device, quick):
        idx, w, _, _, slot, base, n = _setup(device, t, h, e, k, False)
        g = torch.Generator().manual_seed(5)
        buf = torch.randn(n, h, generator=g).to(torch.bfloat16).to(device)
        wbuf = torch.rand(n, k, generator=g).to(device)
        out = combine_reduce(buf, slot, base)
        yield Case(params=dict(num_tokens=t, hidden=h, num_ranks=_RANKS, rows=n),
                   fn=lambda buf=buf, slot=slot, base=base: combine_reduce(buf, slot, base),
                   ref=lambda buf=buf, slot=slot, base=base: ref.combine_reduce_ref(buf, slot, base),
                   check=lambda o, r: assert_equal(o[0], r[0], check_stride=False),
                   nbytes=_nbytes(buf, slot, out[0]))
        outw = combine_reduce(buf, slot, base, wbuf=wbuf)
        yield Case(params=dict(num_tokens=t, hidden=h, num_ranks=_RANKS, rows=n, weights=True),
                   fn=lambda buf=buf, slot=slot, base=base, wbuf=wbuf: combine_reduce(buf, slot, base, wbuf=wbuf),
                   ref=lambda buf=buf, slot=slot, base=base, wbuf=wbuf: ref.combine_reduce_ref(buf, slot, base,
                                                                                   wbuf=wbuf),
                   check=_check_tuple,
                   nbytes=_nbytes(buf, slot, wbuf, *outw), label="weights")
