"""Benchmark registry.  Each module registers its ops in ``tritile/bench/cases/<module>.py``:

    from tritile.bench import Case, register

    @register("transpose", "batched_transpose")
    def _cases(device, quick):
        x = ...
        out = batched_transpose(x)
        yield Case(params=dict(...), fn=lambda: batched_transpose(x), ref=lambda: ref(x),
                   check=assert_equal, nbytes=count_bytes(x, out),
                   anchor=("batched_transpose", {...}))

``device`` is ``cuda`` (full TileKernels shapes) or ``cpu`` (small shapes; the harness then only
checks correctness).  ``quick`` asks for one representative case per op.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

MODULES = ("transpose", "quant", "moe", "engram", "mhc", "ep")


@dataclass
class Case:
    params: Dict[str, Any]
    fn: Callable[[], Any]
    nbytes: int = 0
    ref: Optional[Callable[[], Any]] = None
    check: Optional[Callable[[Any, Any], None]] = None
    anchor: Optional[Tuple[str, Dict[str, Any]]] = None
    latency_bound: bool = False  # judged by µs rather than GB/s
    label: str = ""
    # Tuning sweep (``python -m tritile tune``): the name the kernel wrapper passes to
    # ``tritile.runtime.tuned`` and the candidate overrides to time; each must give bit-identical output.
    tune: Optional[Tuple[str, List[Dict[str, Any]]]] = None


@dataclass
class BenchOp:
    module: str
    op: str
    make_cases: Callable[[Any, bool], Iterable[Case]]


_REGISTRY: List[BenchOp] = []


def register(module: str, op: str):
    def deco(fn):
        _REGISTRY.append(BenchOp(module, op, fn))
        return fn

    return deco


def load_all(modules: Iterable[str] = MODULES) -> List[BenchOp]:
    """Import every module's cases (``tritile.bench.cases.<module>``, else ``tritile.<module>._bench``; missing ones
    are skipped) and return their registered ops (only those modules', whatever else an earlier import registered)."""
    modules = list(modules)
    for m in modules:
        for name in (f"tritile.bench.cases.{m}", f"tritile.{m}._bench"):
            try:
                importlib.import_module(name)
                break
            except ModuleNotFoundError as e:
                if e.name not in (name, name.rsplit(".", 1)[0]):
                    raise
    return [b for b in _REGISTRY if b.module in modules]
