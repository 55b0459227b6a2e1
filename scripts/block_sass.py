"""sm_90a SASS figures of ``_block_cast_kernel`` at the 128x128 bf16 -> e4m3 benchmark anchor (no GPU needed).

    python scripts/block_sass.py                         # the default config
    python scripts/block_sass.py '{"WORDS": true}'       # config overrides as JSON (keys of the "per_block_cast" cfg)
    python scripts/block_sass.py '{"WORDS": true}' --dump /tmp/words.sass

Compiles the kernel as the launcher would for ``per_block_cast(x bf16 (8001, 7168), 'e4m3', (128, 128), False,
round_sf, packed)`` (``--packed``: column-major packed UE8M0, else row-major float32 sf with round_sf; PDL on), or
with ``--token`` ``per_token_cast(x bf16 (8001, 7168), 'e4m3', 128, None, True, True, True)``, and
prints registers, spills (stack / local), the load/store widths, and the straight-line path of a program whose
blocks are all finite (forward branches followed when unconditional or when they skip a ``CALL``, i.e. the
div_rn slow path): its instruction count per element of one thread, and the most frequent opcodes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tritile.quant.per_token_cast_kernel as K  # noqa: E402
from tritile.quant.common import FMT_CLAMP, FMT_MAX  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
M, N = 8001, 7168
DIV16 = {"x_ptr", "xsf_ptr", "out_ptr", "sf_ptr", "psf_ptr", "K", "num_xsf_k", "stride_xm", "stride_om", "stride_pm",
         "stride_xsf_m", "stride_xsf_k"}


def compile_variant(over: dict, packed: bool, token: bool = False):
    if token:  # per_token_cast(x bf16, 'e4m3', 128, packed UE8M0): the default [4, 1024] tile, 4 warps
        cfg = dict(BLOCK_M=4, BLOCK_K=1024, CHUNKS_PER_PROG=1, num_warps=4, FAST=True, PREFETCH=False, PAIRS=False,
                   FINITE=False, WIDE=False, WIDE_VEC=16, INT_SF=False, WORDS=False, PDL=True)
        packed = True
    else:
        cfg = dict(BLOCK_M=128, BLOCK_K=128, CHUNKS_PER_PROG=4 if packed else 2, num_warps=8, FAST=True,
                   PREFETCH=False, PAIRS=True, FINITE=True, WIDE=False, WIDE_VEC=16, INT_SF=False, WORDS=False,
                   PDL=True)
    cfg.update(over)
    nw = cfg.pop("num_warps")
    opts = dict(num_warps=nw)
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    cfg.pop("maxnreg", None)
    consts = dict(IN_KIND=0, XBM=1, XBK=1, XSF_PACKED=False, BM=1 if token else 128, BK=128, ROW_GROUP=False,
                  OUT_E2M1=False, SF_MODE=0, ROUND_SF=True, PACKED=packed, CLAMP=FMT_CLAMP["e4m3"],
                  MAX=FMT_MAX["e4m3"], NUM_CHUNKS=(N + cfg["BLOCK_K"] - 1) // cfg["BLOCK_K"],
                  stride_sk=1 if not packed else 64, **cfg)
    if packed:
        consts["stride_sm"] = 1
    fn = K._block_cast_kernel
    params = list(fn.arg_names)
    consts = {k: v for k, v in consts.items() if k in params}
    sig = {"x_ptr": "*i16", "out_ptr": "*u8",
           "sf_ptr": "*i32" if packed else "*fp32"}
    sig["xsf_ptr"] = sig["psf_ptr"] = sig["x_ptr"]
    full = {n: ("constexpr" if n in consts else sig.get(n, "i32")) for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(params) if n in DIV16 and n not in consts}
    k = triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    per = cfg["BLOCK_M"] * cfg["BLOCK_K"] * cfg["CHUNKS_PER_PROG"] / (32 * nw)  # elements per thread per program
    return k, per


def straight_path(ins):
    """The straight-line path of a finite program (see the module docstring)."""
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
            if m.group(1) is None or any(s.startswith("CALL") for _, s in ins[i + 1:j]):
                i = j
                continue
        i += 1
    return path


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    over = json.loads(args[0]) if args and not sys.argv[sys.argv.index(args[0]) - 1] == "--dump" else {}
    packed, token = "--packed" in sys.argv, "--token" in sys.argv
    k, per = compile_variant(over, packed, token)
    path = "/tmp/block_sass_k.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])

    def run(*a):
        return subprocess.run([os.path.join(BIN, "cuobjdump"), *a, path], capture_output=True, text=True).stdout

    res = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", run("-res-usage")))
    sass = run("-sass")
    if "--dump" in sys.argv:
        with open(sys.argv[sys.argv.index("--dump") + 1], "w") as f:
            f.write(sass)
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    p = straight_path(ins)
    ops = Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in p)
    widths = Counter(re.match(r"(?:@!?P\d+ )?((?:LDG|STG)[.A-Z0-9]*)", t).group(1) for t in p
                     if re.match(r"(?:@!?P\d+ )?(LDG|STG)", t))
    print(f"{'per-token ' if token else ''}{over} packed={packed or token}: {res}; total {len(ins)} instr; finite path {len(p)} instr = "
          f"{len(p) / per:.2f}/elem ({per:g} elem/thread); {dict(widths)}")
    print("  ", sorted(ops.items(), key=lambda x: -x[1])[:16])


if __name__ == "__main__":
    main()
