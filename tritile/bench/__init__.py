"""Benchmark registry.  Each module registers its ops in ``tritile/bench/cases/<module>.py``:

    from tritile.bench import Case, op, register

    @register("transpose", "batched_transpose")
    def _cases(device, quick):
        x = ...
        out = batched_transpose(x)
        yield Case(params=dict(...), impl=op("transpose.batched_transpose", x), ref=lambda: ref(x),
                   check=assert_equal, nbytes=count_bytes(x, out), anchor=("batched_transpose", {...}))

``device`` is ``cuda`` (full TileKernels shapes) or ``cpu`` (small shapes; the harness then only checks correctness).
``quick`` asks for one representative case per op.

A case names its call by ``impl``, so that ``python -m tritile bench --against tilekernels`` can run TileKernels' op on
the same inputs.  ``op(path, *args, **kwargs)`` calls the public function at ``path``, a dotted path under the
package (``"quant.per_token_cast"``, ``"modeling.mhc.ops.mhc_post"``): tritile mirrors TileKernels' API and module
layout, so the same path and arguments reach ``tile_kernels.<path>``.  A case whose call is more than one op call (an
autograd forward and backward, an in-place op returning its buffer) passes a factory instead: ``impl(get)`` looks its
ops up with ``get(path)`` once and returns the zero-argument call.  A case that TileKernels cannot run (another
library's op, a mode TileKernels lacks) says why in ``no_tk``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

MODULES = ("transpose", "quant", "moe", "engram", "mhc", "ep")

#: ``get(path)``: the function at a dotted path under a package (tritile or tile_kernels).
Resolver = Callable[[str], Any]
#: A case's call as a factory: ``impl(get)`` returns the zero-argument call built from ``get``'s functions.
Impl = Callable[[Resolver], Callable[[], Any]]


@functools.lru_cache(maxsize=None)
def resolve(root: str, path: str) -> Any:
    """The object at ``root.path``: the longest importable module prefix of ``path``, then attributes.
    ``resolve("tritile", "quant.per_token_cast")`` is ``tritile.quant.per_token_cast``.  Raises LookupError when the
    package has no such object (e.g. an op TileKernels lacks)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join([root, *parts[:i]])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                continue  # a module of the path is missing: try a shorter prefix
            raise
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            raise LookupError(f"{root} has no {path}") from None
        return obj
    raise LookupError(f"{root} has no {path}")


def resolver(root: str) -> Resolver:
    """``get(path)`` over package ``root`` (see :func:`resolve`)."""
    return functools.partial(resolve, root)


#: tritile's own ops: what a case's ``fn`` is built from.
TRITILE: Resolver = resolver("tritile")


def op(path: str, *args: Any, **kwargs: Any) -> Impl:
    """The ``impl`` of a case that calls one public op: ``get(path)(*args, **kwargs)``."""
    def impl(get: Resolver) -> Callable[[], Any]:
        return functools.partial(get(path), *args, **kwargs)

    impl.op_path = path  # type: ignore[attr-defined]
    return impl


@dataclass
class Case:
    params: Dict[str, Any]
    #: The call to time; built from ``impl`` with tritile's ops when not given.
    fn: Optional[Callable[[], Any]] = None
    nbytes: int = 0
    ref: Optional[Callable[[], Any]] = None
    check: Optional[Callable[[Any, Any], None]] = None
    anchor: Optional[Tuple[str, Dict[str, Any]]] = None
    latency_bound: bool = False  # judged by µs rather than GB/s
    label: str = ""
    # Tuning sweep (``python -m tritile tune``): the name the kernel wrapper passes to
    # ``tritile.runtime.tuned`` and the candidate overrides to time; each must give bit-identical output.
    tune: Optional[Tuple[str, List[Dict[str, Any]]]] = None
    #: The call as a factory over a package's ops (see the module docstring): ``impl(TRITILE)`` is ``fn``,
    #: ``impl(resolver("tile_kernels"))`` TileKernels' op on the same inputs.
    impl: Optional[Impl] = None
    #: Why TileKernels has no counterpart of this case (then ``impl`` is not run against it).
    no_tk: str = ""

    def __post_init__(self):
        if self.fn is None:
            if self.impl is None:
                raise TypeError(f"Case {self.params} needs fn or impl, got neither")
            self.fn = self.impl(TRITILE)

    def counterpart(self, get: Resolver) -> Optional[Callable[[], Any]]:
        """The case's call built from ``get``'s ops (TileKernels'), or None where it has none (``no_tk``, or no
        ``impl``).  Raises LookupError where the package lacks one of the ops."""
        if self.no_tk or self.impl is None:
            return None
        return self.impl(get)


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
