"""Compile, for a GPU target, every kernel variant that an interpreter run launched (no GPU needed).

The CPU test-suite runs kernels in Triton's interpreter, which accepts code the GPU compiler rejects
(Python lists, some reshapes, ...).  This closes the gap:

1. Under ``TRITON_INTERPRET=1`` with ``TRITILE_RECORD_LAUNCHES=<file>``, ``tests/conftest.py`` calls
   :func:`install_recorder`, which notes each launch: the kernel, its argument types, its constexpr
   values and ``num_warps``/``num_stages`` (one line of JSON per distinct variant).
2. ``python -m tritile.testing.compile_check <file>`` (without the interpreter) compiles every recorded
   variant for sm_90 with Triton's bundled ptxas and reports those that fail.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import time
from typing import Any

__all__ = ["install_recorder", "compile_all", "have_ptxas", "stack_pointer_reads", "stale_pair_merges"]

_DTYPE_SIG = {
    "torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float64": "fp64",
    "torch.float8_e4m3fn": "fp8e4nv", "torch.float8_e5m2": "fp8e5", "torch.int8": "i8", "torch.uint8": "u8",
    "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1", "torch.uint32": "u32",
}


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and ("constexpr" in str(ann))


def _arg_type(v: Any) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + _DTYPE_SIG[str(v.dtype)]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "constexpr"
    raise TypeError(f"cannot type {type(v).__name__}")


def have_ptxas() -> bool:
    """Whether this Triton ships its NVIDIA backend with ptxas (offline sm_90 compiles work without a GPU)."""
    try:
        import triton
    except ImportError:  # pragma: no cover
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def _divisible_by_16(v: Any) -> bool:
    """Triton's launch specialization: a pointer whose address, or an integer whose value, is a multiple of 16
    compiles with ``tt.divisibility = 16`` (wider vectors, other layouts: the GPU's real variant)."""
    import torch

    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


#: SASS that reads the stack pointer R1 as data (these kernels keep no stack frame; R1 is only a base for local
#: memory): ptxas 12.8 (Triton 3.6's) merged ``(R1 & 0xffff) >> 8`` into the high half of a
#: ``cvt.rn.satfinite.e4m3x2.f32`` result that the PTX then split into two bytes (a 16-bit store of two e4m3 codes),
#: so every other code came out wrong.
_R1_SOURCE = re.compile(r"^[-|!~]*R1(\.reuse)?\|?$")
#: Integer instructions that compute with their operands' bits.  Float instructions and the packing ones (F2FP,
#: PRMT) name R1 for an undefined operand whose value does not matter (a lone element's partner in a pair
#: conversion, masked lanes of a max, the dead half of a 16-bit merge): kernels with such code pass their GPU tests.
_INT_OPS = ("LOP3", "SHF", "IADD3", "IMAD", "LEA", "SGXT", "BMSK", "ISETP", "SEL", "IABS", "IMNMX", "POPC", "FLO")


def _sass_body(line: str) -> str:
    body = line.split("\t", 1)[-1].strip().rstrip(";").rstrip()
    if body.startswith("@"):
        body = body.split(None, 1)[-1]
    return body


def stale_pair_merges(sass: str) -> list:
    """``F2FP...MERGE_C Rd, Ra, Rb, Rc`` whose ``Rc`` was last written by ``SHF.R.U32.HI Rc, RZ, 0x8, ...``: the high
    byte of an e4m3 pair (``pair >> 8``) computed *before* the pair conversion, from whatever the register held then.
    ptxas 12.8 emits this for a thread holding exactly two elements of an e4m3 cast (the stack-pointer case of
    :func:`stack_pointer_reads` is one form; another reads a stale constant): every other code is wrong on the GPU."""
    lines = [_sass_body(line) for line in sass.splitlines()]
    out = []
    for i, body in enumerate(lines):
        parts = body.split(None, 1)
        if len(parts) < 2 or not (parts[0].startswith("F2FP") and "MERGE_C" in parts[0]):
            continue
        rc = parts[1].split(",")[-1].strip().split(".")[0]
        for prev in reversed(lines[max(0, i - 24):i]):
            p = prev.split(None, 1)
            if len(p) < 2:
                continue
            ops = [o.strip() for o in p[1].split(",")]
            if ops[0].split(".")[0] != rc:
                continue
            if p[0].startswith("SHF.R.U32.HI") and ops[1:3] == ["RZ", "0x8"]:
                out.append(f"{prev}  ->  {body}")
            break
    return out


def stack_pointer_reads(sass: str) -> list:
    """Instructions of ``sass`` (``get_sass`` text) that take R1, the stack pointer, as a source operand outside
    an address (``[R1 + ...]``, local memory), in the integer instructions of ``_INT_OPS``: the fault this looks
    for is bit arithmetic on R1 (``LOP3.LUT R14, R1, 0xffff, ...``) whose result reaches memory."""
    out = []
    for line in sass.splitlines():
        body = _sass_body(line)
        parts = body.split(None, 1)
        if len(parts) < 2 or not parts[0].startswith(_INT_OPS):
            continue
        sources = [o.strip() for o in parts[1].split(",")][1:]
        hits = [i for i, o in enumerate(sources) if _R1_SOURCE.match(o)]
        if hits:
            out.append(body)
    return out


def install_recorder(path: str):
    """Record every interpreter launch's variant to ``path`` (JSON lines, deduplicated per process); returns a
    function that removes the recorder again."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = set()
    orig_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            fn = self.fn
            params = inspect.signature(fn).parameters
            bound = dict(zip(params, args))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            sig, consts, div16 = {}, {}, []
            for name, p in params.items():
                if name not in bound:
                    if _is_constexpr(p) and p.default is not inspect.Parameter.empty:
                        consts[name] = p.default
                        sig[name] = "constexpr"
                    continue
                v = bound[name]
                if _is_constexpr(p) or v is None:
                    consts[name] = v
                    sig[name] = "constexpr"
                else:
                    sig[name] = _arg_type(v)
                    if _divisible_by_16(v):
                        div16.append(name)
            rec = {"module": fn.__module__, "name": fn.__name__, "signature": sig,
                   "constexprs": {k: _jsonable(v) for k, v in consts.items()}, "div16": div16,
                   "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3)}
            key = json.dumps(rec, sort_keys=True)
            if key not in seen:
                seen.add(key)
                with open(path, "a") as f:
                    f.write(key + "\n")
        except Exception:  # recording must never break a test
            pass
        return orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run

    def uninstall():
        InterpretedFunction.run = orig_run

    return uninstall


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return str(v)


def compile_all(path: str, arch: int = 90, limit_s: float = 1800.0, sass: bool = True) -> int:
    """Compile each recorded variant for ``sm_<arch>`` (with the divisibility the launch had); print failures and
    variants whose SASS shows the e4m3 pair fault (:func:`stack_pointer_reads`, :func:`stale_pair_merges`); return
    their number."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run the compile check without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as tcompile
    from triton.tools.disasm import get_sass

    recs = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                recs[line] = json.loads(line)
    target = GPUTarget("cuda", arch, 32)
    failures, skipped, t0 = 0, 0, time.time()
    for i, rec in enumerate(recs.values()):
        if time.time() - t0 > limit_s:
            print(f"compile check stopped after {limit_s:.0f} s: {i} of {len(recs)} variants compiled")
            break
        try:
            fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        except (ImportError, AttributeError):  # e.g. a kernel defined inside a test module
            skipped += 1
            continue
        consts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in rec["constexprs"].items()}
        t1 = time.time()
        names = list(getattr(fn, "arg_names", None) or inspect.signature(fn.fn).parameters)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in rec.get("div16", []) if n in names}
        try:
            src = ASTSource(fn, rec["signature"], constexprs=consts, attrs=attrs)
            ck = tcompile(src, target=target, options={"num_warps": rec["num_warps"], "num_stages": rec["num_stages"]})
            if sass:
                text = get_sass(ck.asm["cubin"])
                for what, bad in (("reads the stack pointer as data", stack_pointer_reads(text)),
                                  ("merges a stale high byte into an e4m3 pair", stale_pair_merges(text))):
                    if bad:
                        failures += 1
                        print(f"SASS {rec['module']}.{rec['name']} constexprs={rec['constexprs']} num_warps="
                              f"{rec['num_warps']}: {what}\n    " + "\n    ".join(bad[:4]), flush=True)
                        break
            if time.time() - t1 > 20:
                print(f"slow ({time.time() - t1:.0f} s): {rec['module']}.{rec['name']} constexprs={rec['constexprs']}",
                      flush=True)
        except Exception as e:  # report every failing variant, not just the first
            failures += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL {rec['module']}.{rec['name']} constexprs={rec['constexprs']}\n    " + "\n    ".join(msg[-12:]),
                  flush=True)
        if (i + 1) % 100 == 0:
            print(f"[{i + 1}/{len(recs)}] {time.time() - t0:.0f} s", flush=True)
    print(f"{len(recs) - failures - skipped} passed, {failures} failed ({skipped} variants of kernels outside "
          "importable modules skipped)")
    return failures


if __name__ == "__main__":
    sys.exit(1 if compile_all(sys.argv[1]) else 0)
