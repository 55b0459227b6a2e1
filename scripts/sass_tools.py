"""Offline sm_90a compilation and SASS reading, shared by the ``scripts/*_sass.py`` tools (no GPU needed).

A kernel is compiled as Triton would for the H200 (``GPUTarget("cuda", 90, 32)``) from its signature and constexprs;
Triton's bundled ``cuobjdump`` gives the resource usage and the SASS, which the tools walk to count instructions.
Import this module before ``triton`` is used: it drops ``TRITON_INTERPRET`` (the interpreter cannot compile).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from typing import Dict, Iterable, List, Optional, Tuple

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

Instr = Tuple[int, str]  # (address, instruction text without the trailing ';')


def compile_kernel(fn, sig: Dict[str, str], consts: Dict[str, object], div16: Iterable[str] = (),
                   **options):
    """Compile the ``@triton.jit`` function ``fn`` for sm_90a.  ``sig`` maps run-time argument names to Triton types
    (missing ones are ``i32``); ``consts`` the constexprs (names ``fn`` does not take are dropped; those left out take
    their defaults); ``div16`` the arguments to mark divisible by 16 (as the launcher's specialization does);
    ``options`` the compile options
    (``num_warps``, ``maxnreg``, ``enable_fp_fusion``, ...; None values are dropped)."""
    params = list(fn.arg_names)
    # constexprs left out take their defaults (else they would compile as run-time i32 arguments)
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts = dict(defaults, **{k: v for k, v in consts.items() if k in params})
    full = {n: ("constexpr" if n in consts else sig.get(n, "i32")) for n in params}
    div16 = set(div16)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(params) if n in div16 and n not in consts}
    opts = {k: v for k, v in options.items() if v is not None}
    return triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=TARGET, options=opts)


def sass_of(kernel, path: str = "/tmp/sass_tools_k.cubin") -> Tuple[str, Dict[str, int]]:
    """(SASS text, resource usage: ``REG``, ``STACK``, ``SHARED``, ``LOCAL``) of a compiled kernel."""
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])

    def run(*args):
        return subprocess.run([os.path.join(BIN, "cuobjdump"), *args, path], capture_output=True, text=True).stdout

    res = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", run("-res-usage"))}
    return run("-sass"), res


def res_str(res: Dict[str, int]) -> str:
    """``REG:n STACK:n SHARED:n LOCAL:n`` (cuobjdump's order) for the figures the tools print."""
    return " ".join(f"{k}:{res[k]}" for k in ("REG", "STACK", "SHARED", "LOCAL") if k in res)


def instructions(sass: str) -> List[Instr]:
    """Every SASS instruction as ``(address, text)``."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text: str) -> str:
    """The opcode without modifiers or predicate (``@P0 LDG.E.128 ...`` -> ``LDG``)."""
    return (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]


def histogram(texts: Iterable[str], most: Optional[int] = None) -> List[Tuple[str, int]]:
    """Opcode counts, most frequent first."""
    return Counter(opcode(t) for t in texts).most_common(most)


def access_widths(texts: Iterable[str]) -> Dict[str, int]:
    """Counts of the global load / store forms (``LDG.E.128``, ``STG.E``, ...) among ``texts``."""
    pat = re.compile(r"(?:@!?P\d+ )?((?:LDG|STG)[.A-Z0-9]*)")
    return dict(Counter(m.group(1) for m in map(pat.match, texts) if m))


def forward_path(ins: List[Instr], skip_calls: bool = False) -> List[str]:
    """The straight-line path from the entry to the first ``EXIT``: unconditional forward branches taken, conditional
    ones not taken (the uniform "finite tile" branches of the cast kernels fall through to their fast block), except,
    with ``skip_calls``, a conditional forward branch over code holding a ``CALL`` (a division's slow path), which is
    taken.  ``NOP`` padding is left out; backward branches are not followed."""
    idx = {a: i for i, (a, _) in enumerate(ins)}
    i, path = 0, []
    while i < len(ins):
        a, t = ins[i]
        if t.startswith("EXIT"):
            path.append(t)
            break
        if t.startswith("NOP"):
            i += 1
            continue
        path.append(t)
        m = re.match(r"(@!?U?P\d+ )?BRA (0x[0-9a-f]+)", t)
        if m and int(m.group(2), 16) > a:
            j = idx[int(m.group(2), 16)]
            if m.group(1) is None or (skip_calls and any(s.startswith("CALL") for _, s in ins[i + 1:j])):
                i = j
                continue
        i += 1
    return path


def loops(ins: List[Instr]) -> List[Tuple[int, int, List[str]]]:
    """Every backward branch's loop: ``(first address, branch address, instructions)``."""
    out = []
    for a, txt in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            out.append((lo, a, [t for b, t in ins if lo <= b <= a]))
    return out


def pop_option(args: List[str], name: str) -> Optional[str]:
    """Remove ``name VALUE`` from the argument list ``args`` and return VALUE (None when ``name`` is absent)."""
    if name not in args:
        return None
    i = args.index(name)
    value = args[i + 1]
    del args[i:i + 2]
    return value
