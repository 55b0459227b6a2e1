"""Runtime facts: interpreter or GPU, device checks, output allocation and op registration.

Nothing here queries a GPU driver at import time.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Tuple

import torch
from torch.types import Device

__all__ = ["is_interpreter", "interpreter_configs", "tuned", "override_config", "checks_enabled", "override_key",
           "regs_per_thread",
           "check_int", "kernel_device_ok", "check_device", "check_same_device", "set_poison_outputs", "poison_outputs", "poison_",
           "empty", "empty_strided", "dtype_name", "check_tensor", "check_shape", "check_inner_contiguous",
           "check_contiguous", "check_choice", "check_no_overlap", "custom_op", "constant"]

_TRUE = ("1", "true", "yes", "on")


# Read once: Triton itself decides interpreter or GPU when the @triton.jit decorators run (at import).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def is_interpreter() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1`` at import time)."""
    return _INTERPRET


# Launch configs: the interpreter costs ~1 ms per program instance, so under it kernels take bigger blocks
# and fewer programs.  ``TRITILE_GPU_CONFIGS=1`` keeps the GPU's launch configs in the interpreter: slower,
# but it runs the GPU's code paths on the CPU and lets `tritile.testing.compile_check` compile exactly the
# variants a GPU would.
_INTERPRETER_CONFIGS = _INTERPRET and os.environ.get("TRITILE_GPU_CONFIGS", "0").lower() not in _TRUE


def interpreter_configs() -> bool:
    """True when launch configs should be sized for the interpreter (see ``TRITILE_GPU_CONFIGS``)."""
    return _INTERPRETER_CONFIGS


# Launch-config overrides for tuning sweeps (``python -m tritile tune``).  A kernel wrapper passes its
# default launch config through ``tuned(name, cfg)``; inside ``override_config(name, **kw)`` the given keys
# replace the defaults.  Outside a sweep this is one dict lookup per call.
_OVERRIDES: dict = {}


def tuned(name: str, cfg: dict) -> dict:
    """``cfg`` with the keys of an active :func:`override_config` for ``name`` replaced (``cfg`` itself if none)."""
    o = _OVERRIDES.get(name)
    return cfg if o is None else {**cfg, **o}


@contextmanager
def override_config(name: str, **overrides: Any) -> Iterator[None]:
    """Within the block, :func:`tuned` calls for ``name`` see ``overrides`` (a tuning sweep's candidate)."""
    from .plan import clear_plans  # plans hold launch configs: a sweep's candidate must not meet a stale one

    old = _OVERRIDES.get(name)
    _OVERRIDES[name] = {**(old or {}), **overrides}
    clear_plans()
    try:
        yield
    finally:
        if old is None:
            _OVERRIDES.pop(name, None)
        else:
            _OVERRIDES[name] = old
        clear_plans()


_ENV_DATA = getattr(os.environ, "_data", None)  # os.environ's own bytes dict on POSIX (kept in step with it)


def records_graph(*tensors: torch.Tensor) -> bool:
    """True when autograd would record a node for an op on ``tensors``: grad mode on and one of them requiring grad.
    An op may skip its ``autograd.Function`` otherwise (entering one costs several µs of host time)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def checks_enabled() -> bool:
    """True when ``TRITILE_CHECKS=1``: data-dependent preconditions are checked (may sync the host).  Read on every
    call (tests set it per test); one dict look-up where the platform allows."""
    if _ENV_DATA is not None and os.name == "posix":
        v = _ENV_DATA.get(b"TRITILE_CHECKS")
        return v is not None and v.decode().lower() in _TRUE
    return os.environ.get("TRITILE_CHECKS", "0").lower() in _TRUE


def override_key(name: str) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """The active :func:`override_config` of ``name`` as a hashable, order-independent tuple (``None`` outside a
    tuning sweep): one dict lookup, so that a wrapper can cache its whole launch plan by
    ``(shape..., override_key(name))`` and still see a sweep's candidates."""
    o = _OVERRIDES.get(name)
    return None if o is None else tuple(sorted(o.items()))


def regs_per_thread(warps_per_sm: int) -> int:
    """The most registers a thread may take (``maxnreg``) for ``warps_per_sm`` warps to fit one SM's 65536 (every
    NVIDIA GPU Triton targets; an SM runs at most 64 warps), in ptxas' allocation steps of 8, at most 255."""
    return min(255, 65536 // (32 * min(64, warps_per_sm)) // 8 * 8)


def kernel_device_ok(device: torch.device) -> bool:
    """Triton kernels can run on tensors of ``device``: CUDA/ROCm tensors, or CPU tensors under the interpreter."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and is_interpreter()


def check_device(name: str, t: torch.Tensor) -> None:
    if not kernel_device_ok(t.device):
        if t.device.type == "cpu":
            raise ValueError(
                f"{name} is on the CPU, but Triton kernels need a GPU tensor; "
                "set TRITON_INTERPRET=1 before importing tritile to run them on the CPU")
        raise ValueError(f"{name} must be on a CUDA device (or the CPU under TRITON_INTERPRET=1), got {t.device}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    """All non-None tensors share one device; returns it."""
    dev = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, name
            check_device(name, t)
        elif t.device != dev:
            raise ValueError(f"{name} must be on the same device as {first} ({dev}), got {t.device}")
    return dev


# ---------------------------------------------------------------------------------------------
# Output allocation.  Every op allocates through ``empty`` so the test-suite can poison outputs
# (NaN for floats, 0x7F/0x7FFF... bytes for integers) and catch elements a kernel never writes.
# ---------------------------------------------------------------------------------------------
_poison = os.environ.get("TRITILE_POISON", "0").lower() in _TRUE


def set_poison_outputs(enabled: bool) -> bool:
    """Turn output poisoning on/off; returns the previous value."""
    global _poison
    old, _poison = _poison, bool(enabled)
    return old


@contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    old = set_poison_outputs(enabled)
    try:
        yield
    finally:
        set_poison_outputs(old)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value a correct kernel never leaves behind by accident."""
    if t.numel() == 0:
        return t
    if t.dtype.is_floating_point and t.element_size() >= 2:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype.is_floating_point and torch.compiler.is_compiling():
        # fp8 while torch.compile traces: inductor folds the byte fill of the uint8 view into an fp8 NaN constant,
        # which Triton 3.6 cannot build (no ``get_fp8e4nv``); such outputs stay unpoisoned there
        pass
    else:
        # fp8 (0x7F is e4m3 NaN), int8 / uint8 / int16 / int32 / int64: a byte pattern of 0x7F..
        t.view(torch.uint8).fill_(0x7F)
    return t


def empty(shape: Sequence[int], dtype: torch.dtype, device: Device) -> torch.Tensor:
    if _rec() is not None:
        return _recorded_alloc(lambda: empty(shape, dtype, device))
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if _poison:
        poison_(out)
    return out


def empty_strided(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: Device) -> torch.Tensor:
    """``torch.empty_strided`` whose whole storage (padding included) is poisoned in tests."""
    if _rec() is not None:
        return _recorded_alloc(lambda: empty_strided(shape, stride, dtype, device))
    out = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)
    if _poison and out.numel() > 0:
        flat = torch.empty(0, dtype=dtype, device=device)
        flat.set_(out.untyped_storage(), 0, (out.untyped_storage().nbytes() // out.element_size(),), (1,))
        poison_(flat)
    return out


# Zeroed workspaces that their kernels leave zeroed, one per (name, device, stream), so that a kernel accumulating
# into one needs no fill launch before it (about 0.8 us of kernel time on the H200 for a few words).
_ZEROED: dict = {}
#: Tensors registered with :func:`constant`, by the address of their storage.
_CONSTANTS: dict = {}


def constant(t: torch.Tensor) -> torch.Tensor:
    """Register ``t`` as a constant a kernel reads (a lookup table made once per device and never written or
    freed) and return it.  A planned op may pass it to a launch: the plan holds it and passes its address."""
    _CONSTANTS[t.untyped_storage().data_ptr()] = t
    return t


def zeroed_workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of at least ``numel`` zeros of ``dtype`` on ``device`` for one launch on the current stream.

    Contract: the kernel given it must leave every element it touched zero again before it ends (e.g. the program
    that completes an accumulation reads the total, then stores 0).  The buffer is cached per (``name``, device,
    current stream): launches on one stream run in order, so each finds it zeroed; launches on two streams get two
    buffers.  While the stream captures a CUDA graph a fresh ``torch.zeros`` is returned instead (a graph must not
    hold a buffer that eager calls share; the fill is then a node of the graph)."""
    rec = _rec()
    if rec is not None:
        from torch.utils._python_dispatch import _disable_current_modes

        _plan_mod._REC.r = None
        try:
            with _disable_current_modes():
                ws = zeroed_workspace(name, numel, dtype, device)
        finally:
            _plan_mod._REC.r = rec
        rec.add_workspace(ws, name, numel, dtype, device)
        return ws
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(numel, dtype=dtype, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        stream = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
        key = (name, dtype, "cuda", index, stream)
    else:
        key = (name, dtype, str(device), 0, 0)
    ws = _ZEROED.get(key)
    if ws is None or ws.numel() < numel:
        # A replaced buffer is freed to the caching allocator, which reuses it in this stream's order only.
        ws = torch.zeros(max(numel, 256), dtype=dtype, device=device)
        _ZEROED[key] = ws
    return ws


# ---------------------------------------------------------------------------------------------
# Argument checks with uniform messages.
# ---------------------------------------------------------------------------------------------
_DTYPE_NAMES = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.int8: "int8", torch.uint8: "uint8",
    torch.int32: "int32", torch.int64: "int64",
}


def dtype_name(d: torch.dtype) -> str:
    return _DTYPE_NAMES.get(d, str(d).replace("torch.", ""))


def check_tensor(name: str, t: Any, *, dtypes: Optional[Iterable[torch.dtype]] = None,
                 ndim: Optional[int | Sequence[int]] = None) -> torch.Tensor:
    """TypeError/ValueError with the argument's name, what was expected and what came."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(dtype_name(d) for d in dtypes)
            raise TypeError(f"{name} must be {want}, got {t.dtype}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in dims:
            want = " or ".join(f"{d}D" for d in dims)
            raise ValueError(f"{name} must be {want}, got a {t.dim()}D tensor of shape {tuple(t.shape)}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """A unit stride in the last dimension (any layout when ``t`` has no element, e.g. an expanded empty tensor)."""
    if t.dim() >= 1 and t.size(-1) > 1 and t.stride(-1) != 1 and t.numel() > 0:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {tuple(t.stride())}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides {tuple(t.stride())}")


def check_int(name: str, value: Any, minimum: Optional[int] = None) -> int:
    """``value`` as an int (a ``bool`` is not one): TypeError naming ``name`` otherwise, ValueError below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _byte_range(t: torch.Tensor):
    """``[first, last)`` byte addresses ``t`` spans (None when it has no element)."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (extent + 1) * t.element_size()


def _runs(t: torch.Tensor):
    """``t``'s memory as runs of equal length: (sorted start addresses, int64 CPU tensor; run length in bytes).

    A run is a row of the last dimension when its stride is 1, else one element.  Computed from the metadata
    (no device access)."""
    shape, stride, esz = list(t.shape), list(t.stride()), t.element_size()
    if shape and (shape[-1] == 1 or stride[-1] == 1):
        length, shape, stride = shape[-1] * esz, shape[:-1], stride[:-1]
    else:
        length = esz
    starts = torch.zeros((), dtype=torch.int64)
    for n, s in zip(shape, stride):
        starts = (starts[..., None] + torch.arange(n, dtype=torch.int64) * (s * esz)).flatten()
    return (starts.reshape(-1) + t.data_ptr()).sort().values, length


def _overlaps(t: torch.Tensor, u: torch.Tensor, r, q) -> bool:
    """Whether ``t`` and ``u`` (spanning the byte ranges ``r`` and ``q``) share a byte."""
    if q is None or u.device != t.device or not (r[0] < q[1] and q[0] < r[1]):
        return False
    if max(t.numel(), u.numel()) > (1 << 24):  # too many runs to list: the spans overlap, call it overlapping
        return True
    (a, la), (b, lb) = _runs(t), _runs(u)
    # the run of u starting last before a run of t ends reaches furthest: they overlap iff it ends past t's start
    i = torch.searchsorted(b, a + la, right=False) - 1
    ok = i >= 0
    return bool((ok & (b[i.clamp(min=0)] + lb > a)).any())


def check_no_overlap(outputs: dict, inputs: Optional[dict] = None) -> None:
    """Output buffers written in place share no memory with each other nor with the inputs.

    ``outputs`` / ``inputs``: ``{argument name: tensor or None}``.  Disjoint address ranges (the common case) cost a
    few attribute reads; interleaved views of one buffer (e.g. the two column halves of a matrix) are compared run
    by run.  ValueError naming both arguments.
    """
    rec = _rec()
    if rec is not None:
        from torch.utils._python_dispatch import _disable_current_modes

        rec.add_overlap_check(outputs, inputs)
        with _disable_current_modes():
            _plan_mod._REC.r = None
            try:
                return check_no_overlap(outputs, inputs)
            finally:
                _plan_mod._REC.r = rec
    outs = [(n, t, _byte_range(t)) for n, t in outputs.items() if t is not None]
    ins = [(n, t, _byte_range(t)) for n, t in (inputs or {}).items() if t is not None]
    for i, (name, t, r) in enumerate(outs):
        if r is None:
            continue
        for other, u, q in outs[i + 1:] + ins:
            if _overlaps(t, u, r, q):
                kind = "" if any(other == n for n, _, _ in outs) else "the input "
                raise ValueError(f"{name} must not overlap {kind}{other} in memory: {name} is written in place")


# ---------------------------------------------------------------------------------------------
# torch.library registration helper.
# ---------------------------------------------------------------------------------------------
def custom_op(name: str, *, mutates_args: Sequence[str] = (),
              fake: Optional[Callable[..., Any]] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as ``torch.library.custom_op('tritile::<name>')`` with an optional fake kernel.

    Returns a callable that runs ``fn`` directly in eager mode (the dispatcher round trip costs tens of
    µs per call, which latency-bound ops cannot afford) and the registered op while ``torch.compile``
    traces, so graphs see an opaque op with a fake kernel.  The op itself is ``.op`` /
    ``torch.ops.tritile.<name>``.  Use it for the tensor-only core of an op; the public Python wrapper
    keeps TileKernels' signature (tuples, strings, None).
    """

    def deco(fn):
        op = torch.library.custom_op(f"tritile::{name}", mutates_args=mutates_args)(fn)
        if fake is not None:
            op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        return call

    return deco


# ---------------------------------------------------------------------------------------------
# Plan recording (tritile.runtime.plan): allocations and checks report to the active recorder.
# ---------------------------------------------------------------------------------------------
from . import plan as _plan_mod  # noqa: E402  (plan imports names defined above)


def _rec():
    return getattr(_plan_mod._REC, "r", None)


def _recorded_alloc(alloc: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run ``alloc`` with the recorder paused (its poison fill is no op of the plan) and report the tensor."""
    from torch.utils._python_dispatch import _disable_current_modes

    rec = _plan_mod._REC.r
    _plan_mod._REC.r = None
    try:
        with _disable_current_modes():
            t = alloc()
    finally:
        _plan_mod._REC.r = rec
    rec.add_alloc(t, "empty")
    return t
