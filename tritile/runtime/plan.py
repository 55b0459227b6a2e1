"""Cached host plans and direct kernel launches: the eager host path of every op.

An op's eager call reads top to bottom: public function -> check -> plan -> launch.  The first call of a given
*metadata* runs the op's host code as written (every check, the launch rule, the allocations, the launches) and
records it as a plan; later calls with the same metadata replay the plan: allocate the outputs, launch the compiled
kernels directly, return.  The op opts in with one decorator on its public function::

    @planned("per_token_cast")
    def per_token_cast(x, fmt, num_per_channels, ...):
        ...                                  # checks, launch rule, runtime.empty(...), kernel[grid](...)

**The key.**  A plan is keyed on the call's arguments: each tensor by its dtype, shape, strides, device, whether
its address is a multiple of 16 bytes (what Triton specializes pointers on) and ``requires_grad``, tuples and lists element by element, every other value by its type and
value (floats by their bits), plus the current CUDA device.  A changed stride, storage offset, alignment, dtype,
device or flag is another key, never a stale plan; a call whose key is new runs the host code, so an input that is
rejected is rejected with the same error whether or not a plan of its shape exists (bad calls are never recorded).

**What a plan may hold.**  The host code of a planned op must be a function of the key alone: it reads the
tensors' metadata, never their data.  Recording checks this with a ``TorchDispatchMode``: apart from allocations
(``tritile.runtime.empty`` / ``empty_strided`` / ``zeroed_workspace``, ``torch.empty*``, and a whole-tensor fill of a
fresh allocation), views, and Triton launches, any torch op (a copy, a sum, ``.item()``, ...) makes the call
unplannable, and so does a launch argument that is neither a scalar nor a view of an input, an output, a
workspace or a registered constant (``tritile.runtime.constant``: a table made once and never written; the plan
holds it).  Inputs that are disjoint parts of one buffer are planned (a launch argument is located in the input
whose bytes hold it); overlapping inputs are not.  Host code that reads data where the dispatcher does not see it
(``tolist()`` of a CPU tensor) calls :func:`unplannable`.  Such calls run the host code every time, correct as before.
``check_no_overlap`` calls made while recording are replayed on every call, as data-pointer checks must be: the
checked tensors' address ranges are compared (their byte extents are fixed by the key), and the exact check runs
where two of them meet.

**Replay.**  Outputs are allocated as recorded (``runtime.empty_strided``, so test poisoning applies), workspaces are
taken again (``zeroed_workspace``: a fresh zeroed buffer under CUDA-graph capture), and each launch calls Triton's
compiled launcher with the recorded grid and constexprs and the argument tensors' addresses, without
``JITFunction.run`` binding, specializing and hashing every argument again (10-20 µs a launch on an H200 host).
Under the interpreter the launches go through the interpreter, with each argument view rebuilt, so the CPU suite
runs the same record / replay logic.  ``TRITILE_PLAN_VERIFY=1`` makes every GPU replay rebuild the argument tensors
and check that Triton's own specialization key selects the kernel the plan holds (the GPU test-suite runs with it).

Global settings a plan reads (:func:`tritile.runtime.override_config`, :func:`tritile.language.pdl.set_pdl`,
:func:`tritile.config.set_num_sms`) clear every plan when they change (:func:`clear_plans`); calls while
``TRITILE_CHECKS=1`` (data checks) or inside a ``torch.compile`` trace bypass the cache.  ``TRITILE_PLAN_CACHE=0``
(read at import; :func:`set_plan_cache` at run time) turns it off: results are bit-identical either way.  Direct
launches skip Triton's launch hooks (``triton.knobs.runtime.launch_enter_hook``); turn the cache off where a tool
relies on them.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _byte_range, checks_enabled, is_interpreter

__all__ = ["planned", "PlanCache", "clear_plans", "plan_cache_enabled", "set_plan_cache", "plan_stats",
           "unplannable"]

_FALSE = ("0", "false", "no", "off")
_ENABLED = os.environ.get("TRITILE_PLAN_CACHE", "1").lower() not in _FALSE
_VERIFY = os.environ.get("TRITILE_PLAN_VERIFY", "0").lower() not in _FALSE
_INTERPRET = is_interpreter()

_CACHES: List["PlanCache"] = []

if not _INTERPRET:
    try:
        from torch._C import _cuda_getCurrentRawStream as _raw_stream
        from torch._C import _cuda_getDevice as _current_device
    except ImportError:  # pragma: no cover - builds without the private entry points
        def _raw_stream(index: int) -> int:
            return torch.cuda.current_stream(index).cuda_stream

        def _current_device() -> int:
            return torch.cuda.current_device()
else:
    def _current_device() -> int:
        return -1


def plan_cache_enabled() -> bool:
    """Whether plans are cached and replayed (``TRITILE_PLAN_CACHE``, :func:`set_plan_cache`)."""
    return _ENABLED


def set_plan_cache(enabled: bool) -> bool:
    """Turn plan caching on or off; returns the previous setting (plans recorded before stay valid)."""
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(enabled)
    return old


def clear_plans() -> None:
    """Forget every cached plan (and the compiled kernels their launches hold)."""
    for c in _CACHES:
        c.clear()


def plan_stats() -> Dict[str, Tuple[int, int]]:
    """``{op: (plans, unplannable keys)}`` of every op that has recorded something (for tests and debugging)."""
    return {c.name: (sum(p is not _UNPLANNABLE for p in c.d.values()),
                     sum(p is _UNPLANNABLE for p in c.d.values())) for c in _CACHES if c.d}


class PlanCache:
    """One op's plans by key; at ``maxsize`` entries the oldest is dropped (a workload has few shapes)."""

    __slots__ = ("name", "maxsize", "d", "why")

    def __init__(self, name: str, maxsize: int = 512):
        self.name, self.maxsize, self.d = name, maxsize, {}
        self.why: Dict[Hashable, str] = {}  # key -> why it is unplannable (the last few)
        _CACHES.append(self)

    def put(self, key: Hashable, plan: Any) -> None:
        d = self.d
        if len(d) >= self.maxsize:
            del d[next(iter(d))]
        d[key] = plan

    def clear(self) -> None:
        self.d.clear()
        self.why.clear()


_UNPLANNABLE = object()
_Tensor = torch.Tensor


class _NoKey(Exception):
    pass


class _Const:
    """A launch argument's base while recording: the ``j``-th constant (``runtime.constant``)."""

    __slots__ = ("j",)

    def __init__(self, j: int):
        self.j = j


def _walk(v: Any, key: list, tensors: list) -> None:
    """Append ``v``'s key parts to ``key`` and its tensors (depth first) to ``tensors``."""
    c = v.__class__
    if c is torch.Tensor or isinstance(v, torch.Tensor):
        if c is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
            raise _NoKey  # tensor subclasses (FakeTensor, DTensor, ...) take the unplanned route
        key.append((v.dtype, v.shape, v.stride(), v.get_device(), v.data_ptr() & 15, v.requires_grad))
        tensors.append(v)
    elif c is int or c is bool or c is str or v is None or c is torch.dtype:
        key.append(c)
        key.append(v)
    elif c is float:
        key.append(c)
        key.append(struct.pack("<d", v))
    elif c is tuple or c is list:
        key.append(c)
        key.append(len(v))
        for e in v:
            _walk(e, key, tensors)
    else:
        raise _NoKey  # anything else (a module, a numpy scalar, ...): not keyable, run unplanned


def _keys(values, key: list, tensors: list) -> None:
    """``_walk`` over ``values``, with the keys of the common arguments (a tensor, an int, a bool, a str, None) inline:
    the replay's hot loop."""
    for a in values:
        c = a.__class__
        if c is _Tensor:
            key.append((a.dtype, a.shape, a.stride(), a.get_device(), a.data_ptr() & 15, a.requires_grad))
            tensors.append(a)
        elif c is int or c is bool or c is str or a is None:
            key.append(c)
            key.append(a)
        else:
            _walk(a, key, tensors)


#: Where the keyword arguments' part of a key starts (their names and values then alternate).
_KWARGS = object()


# ---------------------------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------------------------
_REC = threading.local()


def recording():
    """The active recorder of this thread, or None (``runtime.empty`` and friends report to it)."""
    return getattr(_REC, "r", None)


class _Unplannable(Exception):
    pass


def unplannable(reason: str) -> None:
    """Mark the call being recorded (if any) as unplannable: for host code that reads data where the recorder cannot
    see it (``tolist()`` of a CPU tensor does not pass the dispatcher)."""
    rec = recording()
    if rec is not None and rec.bad is None:
        rec.bad = reason


_ALLOC_OPS = None


def _alloc_ops():
    global _ALLOC_OPS
    if _ALLOC_OPS is None:
        a = torch.ops.aten
        _ALLOC_OPS = {a.empty.memory_format, a.empty_strided.default, a.new_empty.default,
                      a.new_empty_strided.default, a.empty_like.default}
    return _ALLOC_OPS


class _Mode(TorchDispatchMode):
    """Sees every torch op the host code runs while recording; anything but allocations, views and a whole-tensor
    fill of a fresh allocation marks the call unplannable."""

    def __init__(self, rec: "_Recorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        if rec.bad is not None:
            return out
        if func in _alloc_ops():
            rec.add_alloc(out, "torch")
            return out
        schema = func._schema
        rets = schema.returns
        if (rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write
                and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)):
            return out  # a view: metadata only
        name = func.__name__
        if name in ("fill_.Scalar", "zero_.default") and not rec.launches:
            t = args[0]
            for s in rec.allocs:
                if s[0] is t:
                    s[3] = 0 if name == "zero_.default" else args[1]
                    return out
        rec.bad = f"runs torch op {func}"
        return out


class _Recorder:
    def __init__(self, inputs: List[torch.Tensor]):
        self.inputs = inputs
        self.allocs: List[list] = []      # [tensor, kind ('empty' | 'torch'), (shape, stride, dtype, device), fill]
        self.workspaces: List[tuple] = []  # (tensor, name, numel, dtype, device)
        self.launches: List[tuple] = []
        self.overlap_checks: List[tuple] = []
        self.consts: List[torch.Tensor] = []  # runtime.constant tensors the launches read
        self.bad: Optional[str] = None
        self.thread = threading.get_ident()

    # -- reports from the runtime ------------------------------------------------------------------------------
    def add_alloc(self, t: torch.Tensor, kind: str) -> None:
        self.allocs.append([t, kind, (tuple(t.shape), tuple(t.stride()), t.dtype, t.device), None])

    def add_workspace(self, t: torch.Tensor, name, numel, dtype, device) -> None:
        self.workspaces.append((t, name, numel, dtype, device))

    def add_overlap_check(self, outputs: dict, inputs: Optional[dict]) -> None:
        self.overlap_checks.append((dict(outputs), dict(inputs or {})))

    # -- bases: the tensors a launch argument may be a view of ----------------------------------------------------
    def bases(self) -> List[torch.Tensor]:
        return list(self.inputs) + [a[0] for a in self.allocs] + [w[0] for w in self.workspaces]

    def locate(self, t: torch.Tensor) -> tuple:
        """(base index, byte offset, dtype, shape, stride) of ``t`` as a view of one base; unplannable if none or
        ambiguous."""
        bases = self.bases()
        for i, b in enumerate(bases):
            if b is t:
                return (i, 0, t.dtype, tuple(t.shape), tuple(t.stride()), True)
        if t.numel() == 0:
            # an empty placeholder (a dummy pointer): any base of its device at offset 0 serves; pass it as is
            raise _Unplannable("an empty launch argument that is no base")
        st = t.untyped_storage().data_ptr()
        hits = [i for i, b in enumerate(bases)
                if b.numel() > 0 and b.device == t.device and b.untyped_storage().data_ptr() == st]
        if not hits:
            c = _runtime()._CONSTANTS.get(st)
            if c is not None and c.device == t.device:
                j = next((j for j, k in enumerate(self.consts) if k is c), len(self.consts))
                if j == len(self.consts):
                    self.consts.append(c)
                # its base index is known once every allocation is: _Const(j) until plan()
                return (_Const(j), t.data_ptr() - c.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), c is t)
        if len(hits) > 1:
            # bases carved from one buffer (e.g. get_fused_mapping's outputs): the one whose bytes hold t's
            r = _byte_range(t)
            hits = [i for i in hits if _holds(_byte_range(bases[i]), r)]
        if len(hits) != 1:
            raise _Unplannable("a launch argument that is no view of one input, output or workspace")
        i = hits[0]
        return (i, t.data_ptr() - bases[i].data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), False)

    def add_launch(self, fn, args: tuple, grid, kwargs: dict, ck) -> None:
        if self.bad is not None:
            return
        try:
            names = fn.arg_names
            if len(args) > len(names):
                raise _Unplannable("too many launch arguments")
            values = list(args)
            kwargs = dict(kwargs)
            params = getattr(fn, "params", None)
            if params is not None:  # compiled: every parameter in order, as Triton's launcher takes them
                for i in range(len(args), len(names)):
                    n = names[i]
                    values.append(kwargs[n] if n in kwargs else params[i].default)
            slots = []   # (position or keyword, base index, byte offset, dtype, shape, stride, identical)
            for pos, v in list(enumerate(values)) + [(k, kwargs[k]) for k in kwargs if params is None]:
                if isinstance(v, torch.Tensor):
                    slots.append((pos,) + self.locate(v))
                    if params is not None or isinstance(pos, int):
                        values[pos] = None
                    else:
                        kwargs[pos] = None
                elif not (v is None or isinstance(v, (int, float, bool, str, torch.dtype))
                          or v.__class__.__name__ == "constexpr"):
                    raise _Unplannable(f"a launch argument of type {type(v).__name__}")
            if callable(grid):
                raise _Unplannable("a callable grid")
            g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
            self.launches.append((fn, g, values, slots, len(args), dict(kwargs), ck))
        except _Unplannable as e:
            self.bad = str(e)

    def plan(self, result: Any) -> "Plan":
        if self.bad is not None:
            raise _Unplannable(self.bad)
        for i, a in enumerate(self.inputs):
            for b in self.inputs[i + 1:]:
                if a.numel() and b.numel() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                    # disjoint parts of one buffer are separate tensors to every op; overlapping ones are not (an op
                    # may take another route for them): plan the separate case only
                    ra, rb = _byte_range(a), _byte_range(b)
                    if ra[0] < rb[1] and rb[0] < ra[1]:
                        raise _Unplannable("inputs that overlap")
        bases = self.bases()
        n_in = len(self.inputs)

        def ret_spec(v):
            if isinstance(v, torch.Tensor):
                for i, b in enumerate(bases):
                    if b is v:
                        if i >= n_in + len(self.allocs):
                            raise _Unplannable("returns a workspace")
                        return ("t", i)
                if v.numel() == 0:  # no data: a new empty tensor of the same metadata serves
                    return ("e", tuple(v.shape), tuple(v.stride()), v.dtype, v.device)
                i, off, dtype, shape, stride, _ = self.locate(v)  # a view of one input or output
                if i >= n_in + len(self.allocs):
                    raise _Unplannable("returns a view of a workspace")
                return ("v", i, off, dtype, shape, stride)
            if isinstance(v, (tuple, list)):
                if type(v) not in (tuple, list):
                    raise _Unplannable("returns a structured tuple")
                return ("s", type(v), tuple(ret_spec(e) for e in v))
            if v is None or isinstance(v, (int, float, bool, str)):
                return ("c", v)
            raise _Unplannable(f"returns a {type(v).__name__}")

        ret = ret_spec(result)
        overlap = []
        for outs, ins in self.overlap_checks:
            def names(d):
                m = {}
                for k, v in d.items():
                    if v is None:
                        m[k] = None
                        continue
                    idx = [i for i, b in enumerate(bases) if b is v]
                    if not idx:
                        raise _Unplannable("an overlap check of a derived tensor")
                    m[k] = idx[0]
                return m
            o, i = names(outs), names(ins)
            # the byte extent of each checked tensor is fixed by the key (shape, strides, dtype): a replay compares
            # address ranges and runs the exact check only when two of them meet
            def extents(m):
                ext = []
                for k in m.values():
                    r = None if k is None else _byte_range(bases[k])
                    if r is not None:  # an empty tensor overlaps nothing
                        ext.append((k, r[1] - r[0]))
                return ext
            outs_ext = extents(o)
            overlap.append((o, i, tuple(outs_ext + extents(i)), len(outs_ext)))
        allocs = [(kind, meta, fill) for _, kind, meta, fill in self.allocs]
        ws = [(name, numel, dtype, device) for _, name, numel, dtype, device in self.workspaces]
        # constants are the last bases: after the inputs, the allocations and the workspaces
        first = len(bases)
        launches = [(fn, g, values, [(s[0], first + s[1].j) + s[2:] if isinstance(s[1], _Const) else s
                                     for s in slots], n_pos, kwargs, ck)
                    for fn, g, values, slots, n_pos, kwargs, ck in self.launches]
        return Plan(n_in, allocs, ws, launches, ret, overlap, tuple(self.consts))


def _record_launch(orig):
    def run(self, *args, grid, warmup, **kwargs):
        rec = recording()
        if rec is None or warmup or threading.get_ident() != rec.thread:
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        with _disable_current_modes():
            ck = orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        rec.add_launch(self, args, grid, kwargs, ck)
        return ck
    run._tritile_recording = True
    return run


_PATCH_LOCK = threading.Lock()
_PATCHED = False


def _patch_launchers() -> None:
    """Route ``JITFunction.run`` (and the interpreter's) through the recorder (once; a plain call when no recorder
    is active on the calling thread)."""
    global _PATCHED
    with _PATCH_LOCK:
        if _PATCHED:
            return
        from triton.runtime.jit import JITFunction

        classes = [JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            classes.append(InterpretedFunction)
        except ImportError:  # pragma: no cover
            pass
        for cls in classes:
            if not getattr(cls.run, "_tritile_recording", False):
                cls.run = _record_launch(cls.run)
        _PATCHED = True


# ---------------------------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------------------------
def _view(base: torch.Tensor, off: int, dtype, shape, stride) -> torch.Tensor:
    """The view of ``base``'s storage at byte offset ``off`` from ``base``'s first element."""
    if dtype is base.dtype:  # one op
        return base.as_strided(shape, stride, base.storage_offset() + off // base.itemsize)
    esz = torch.empty((), dtype=dtype).element_size() if dtype.itemsize is None else dtype.itemsize
    start = base.data_ptr() - base.untyped_storage().data_ptr() + off
    t = torch.empty(0, dtype=dtype, device=base.device)
    t.set_(base.untyped_storage(), start // esz, shape, stride)
    return t


class Plan:
    """A recorded call: the allocations, the workspaces, the launches and how to build the return value."""

    __slots__ = ("n_in", "allocs", "ws", "launches", "ret", "overlap", "fast", "consts")

    def __init__(self, n_in, allocs, ws, launches, ret, overlap, consts=()):
        self.n_in, self.allocs, self.ws, self.ret, self.overlap = n_in, allocs, ws, ret, overlap
        self.consts = consts
        self.launches = launches
        self.fast = None
        if not _INTERPRET and launches and all(l[6] is not None for l in launches):
            fast = []
            for fn, g, values, slots, n_pos, kwargs, ck in launches:
                ptrs = tuple((pos, i, off) for pos, i, off, *_ in slots)
                fast.append((ck.run, ck.function, ck.packed_metadata, g[0], g[1], g[2], tuple(values), ptrs))
            self.fast = fast

    def __call__(self, inputs: List[torch.Tensor], dev: int) -> Any:
        rt = _runtime()
        bases = inputs
        poison = rt._poison
        for kind, (shape, stride, dtype, device), fill in self.allocs:
            if poison and kind == "empty":
                t = rt.empty_strided(shape, stride, dtype, device)
            else:
                t = _empty_strided(shape, stride, dtype=dtype, device=device)
            if fill is not None:
                t.fill_(fill)
            bases.append(t)
        for name, numel, dtype, device in self.ws:
            bases.append(rt.zeroed_workspace(name, numel, dtype, device))
        if self.consts:
            bases.extend(self.consts)
        if self.overlap:
            for outs, ins, spans, n_out in self.overlap:
                if _ranges_meet([(bases[i].data_ptr(), n) for i, n in spans], n_out):
                    rt.check_no_overlap({k: None if i is None else bases[i] for k, i in outs.items()},
                                        {k: None if i is None else bases[i] for k, i in ins.items()})
        fast = self.fast
        if fast is not None:
            if _VERIFY:
                self._verify(bases, dev)
            stream = _raw_stream(dev)
            for run, function, meta, g0, g1, g2, values, ptrs in fast:
                vals = list(values)
                for pos, i, off in ptrs:
                    vals[pos] = bases[i].data_ptr() + off
                run(g0, g1, g2, stream, function, meta, None, None, None, *vals)
        else:
            for fn, g, values, slots, n_pos, kwargs, ck in self.launches:
                vals, kw = self._args(values, slots, kwargs, bases)
                fn.run(*vals[:n_pos], grid=g, warmup=False, **kw)
        return _build(self.ret, bases)

    @staticmethod
    def _args(values, slots, kwargs, bases):
        """A launch's arguments with the argument tensors rebuilt as views of this call's bases."""
        vals = list(values)
        kw = dict(kwargs)
        for pos, i, off, dtype, shape, stride, same in slots:
            b = bases[i]
            t = b if same else _view(b, off, dtype, shape, stride)
            if isinstance(pos, int):
                vals[pos] = t
            else:
                kw[pos] = t
        return vals, kw

    def _verify(self, bases, dev) -> None:
        """Triton's own specialization of each launch's rebuilt arguments must select the kernel the plan holds."""
        from triton import knobs
        from triton.runtime.jit import compute_cache_key

        for fn, g, values, slots, n_pos, kwargs, ck in self.launches:
            vals, _ = self._args(values, slots, kwargs, bases)
            kw = {k: v for k, v in kwargs.items() if k not in fn.arg_names}  # options; vals has every parameter
            kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
            kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            kernel_cache, key_cache, _, _, binder = fn.device_caches[dev]
            _, specialization, options = binder(*vals, **kw)
            if kernel_cache.get(compute_cache_key(key_cache, specialization, options)) is not ck:
                raise RuntimeError(f"tritile plan cache: a replayed launch of {fn.__name__} has arguments Triton "
                                   "specializes differently from the recorded ones (the plan key misses a dtype, "
                                   "an alignment or an integer)")


def _holds(outer, inner) -> bool:
    """Whether byte range ``outer`` holds ``inner`` (``[first, last)`` pairs; None: no bytes)."""
    return outer is not None and inner is not None and outer[0] <= inner[0] and inner[1] <= outer[1]


def _ranges_meet(ranges: List[Tuple[int, int]], n_out: int) -> bool:
    """Whether one of the first ``n_out`` ``(address, bytes)`` ranges meets a later one (outputs against the other
    outputs and the inputs, as ``check_no_overlap`` pairs them)."""
    for j in range(n_out):
        a, n = ranges[j]
        for b, m in ranges[j + 1:]:
            if a < b + m and b < a + n:
                return True
    return False


_empty_strided = torch.empty_strided
_RT = None


def _runtime():
    """``tritile.runtime`` (imported once: it imports this module)."""
    global _RT
    if _RT is None:
        from tritile import runtime
        _RT = runtime
    return _RT


def _build(spec, bases):
    kind = spec[0]
    if kind == "t":
        return bases[spec[1]]
    if kind == "c":
        return spec[1]
    if kind == "v":
        return _view(bases[spec[1]], *spec[2:])
    if kind == "e":
        return _empty_strided(spec[1], spec[2], dtype=spec[3], device=spec[4])
    return spec[1](_build(s, bases) for s in spec[2])


# ---------------------------------------------------------------------------------------------------------------
# The decorator
# ---------------------------------------------------------------------------------------------------------------
def planned(name: str, maxsize: int = 512, recheck: Optional[Callable[..., None]] = None
            ) -> Callable[[Callable], Callable]:
    """Cache the host path of the public function it decorates (see the module docstring).

    ``recheck``: a check that reads data pointers other than through ``check_no_overlap`` (e.g. "two in-place
    outputs must be different tensors"); it is called with the call's arguments before every replay."""

    def deco(fn: Callable) -> Callable:
        cache = PlanCache(name, maxsize)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not _ENABLED or getattr(_REC, "r", None) is not None or torch.compiler.is_compiling() \
                    or checks_enabled():
                return fn(*args, **kwargs)
            try:
                key: list = [_current_device()]
            except (AssertionError, RuntimeError):  # no CUDA in this build or process: only host code can run
                return fn(*args, **kwargs)
            tensors: list = []
            try:
                _keys(args, key, tensors)
                if kwargs:
                    kv = []
                    for k in sorted(kwargs):
                        kv.append(k)
                        kv.append(kwargs[k])
                    key.append(_KWARGS)
                    _keys(kv, key, tensors)
            except _NoKey:
                return fn(*args, **kwargs)
            key = tuple(key)
            plan = cache.d.get(key)
            if plan is not None:
                if plan is _UNPLANNABLE:
                    return fn(*args, **kwargs)
                if recheck is not None:
                    recheck(*args, **kwargs)
                return plan(tensors, key[0])
            return _record(cache, key, fn, args, kwargs, tensors)

        call.plan_cache = cache
        return call

    return deco


def _record(cache: PlanCache, key: tuple, fn: Callable, args, kwargs, tensors: list) -> Any:
    _patch_launchers()
    rec = _Recorder(tensors)
    _REC.r = rec
    try:
        with _Mode(rec):
            result = fn(*args, **kwargs)
    finally:
        _REC.r = None
    try:
        plan = rec.plan(result)
    except _Unplannable as e:
        cache.put(key, _UNPLANNABLE)
        if len(cache.why) > 16:
            cache.why.pop(next(iter(cache.why)))
        cache.why[key] = str(e)
        return result
    cache.put(key, plan)
    return result
