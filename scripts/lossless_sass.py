"""sm_90a SASS figures of ``_per_block_cast_lossless_words_kernel`` at the benchmark anchor (no GPU needed).

    python scripts/lossless_sass.py                          # default config, out block (1, 128)
    python scripts/lossless_sass.py '{"PRMT": true}'         # config overrides as JSON ("per_block_cast_lossless" keys)
    python scripts/lossless_sass.py '{"PRMT": true}' --ob 32,32 --in-packed --out-packed --dump /tmp/l.sass

Compiles the word kernel as the launcher would for ``per_block_cast_lossless(x (8001, 7168) FP4 with (1, 32) scales,
'e4m3', (1, 32), ob)`` (float32 row-major input / output sf, or with ``--in-packed`` / ``--out-packed`` TMA-aligned
packed UE8M0; PDL on), then prints registers, spills (stack / local), the load/store widths, and the instruction
count of the fast path (every conditional forward branch not taken, unconditional ones followed: the uniform
``bad == 0`` test jumps to the rolled slow path, and the fast block falls through and skips it) per output value of
one thread, with an opcode histogram.
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

import tritile.quant.per_block_cast_lossless_kernel as L  # noqa: E402
from tritile.utils import align, ceil_div  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
M, K = 8001, 7168
BMI, BKI = 1, 32


def compile_variant(over: dict, ob, in_packed: bool, out_packed: bool):
    bmo, bko = ob
    tm, tw, nw = L._word_tile(bmo, bko, K)
    cfg = {"TM": tm, "TW": tw, "num_warps": nw, "PRMT": False, "PAIR64": False, **over}
    ms_in, ks_in = ceil_div(M, BMI), ceil_div(K, BKI)
    ms_out, ks_out = ceil_div(M, bmo), ceil_div(K, bko)
    ks_out_pad = align(ks_out, 4) if out_packed else ks_out
    # (stride_m, stride_k) of the sf tensors: packed UE8M0 TMA-aligned column-major or float32 row-major
    s_in = (1, align(ms_in, 4)) if in_packed else (ks_in, 1)
    s_out = (1, align(ms_out, 4)) if out_packed else (ks_out, 1)
    ints = dict(M=M, K=K, MS_IN=ms_in, KS_IN=ks_in, MS_OUT=ms_out, KS_OUT_PAD=ks_out_pad, stride_xm=K // 8,
                stride_sim=s_in[0], stride_sik=s_in[1], stride_om=K // 4, stride_som=s_out[0], stride_sok=s_out[1])
    ptrs = dict(x_ptr="*i8", sf_in_ptr="*i32" if in_packed else "*fp32", out_ptr="*i32",
                sf_out_ptr="*i32" if out_packed else "*fp32")
    fn = L._per_block_cast_lossless_words_kernel
    params = list(fn.arg_names)
    consts = dict(IN_PACKED=in_packed, OUT_PACKED=out_packed, BMI=BMI, BKI=BKI, BMO=bmo, BKO=bko, TM=cfg["TM"],
                  TW=cfg["TW"], PRMT=cfg["PRMT"], PAIR64=cfg["PAIR64"], PDL=True)
    consts.update({n: 1 for n, v in ints.items() if v == 1})  # Triton specializes integer arguments equal to 1
    consts = {k: v for k, v in consts.items() if k in params}
    full = {n: ("constexpr" if n in consts else ptrs.get(n, "i32")) for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(params)
             if n not in consts and (n in ptrs or ints.get(n, 1) % 16 == 0)}
    opts = dict(num_warps=cfg["num_warps"])
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    k = triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    per = cfg["TM"] * cfg["TW"] * 8 / (32 * cfg["num_warps"])  # output values per thread
    return k, per, cfg


def fast_path(ins):
    """The straight-line path: conditional branches not taken, unconditional forward ones taken."""
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
        m = re.match(r"BRA (0x[0-9a-f]+)", t)  # unconditional
        if m and int(m.group(1), 16) > a:
            i = idx[int(m.group(1), 16)]
            continue
        i += 1
    return path


def main():
    argv = sys.argv[1:]
    over = json.loads(argv[0]) if argv and not argv[0].startswith("--") else {}
    ob = tuple(int(v) for v in argv[argv.index("--ob") + 1].split(",")) if "--ob" in argv else (1, 128)
    in_packed, out_packed = "--in-packed" in argv, "--out-packed" in argv
    k, per, cfg = compile_variant(over, ob, in_packed, out_packed)
    path = "/tmp/lossless_sass_k.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])

    def run(*a):
        return subprocess.run([os.path.join(BIN, "cuobjdump"), *a, path], capture_output=True, text=True).stdout

    res = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", run("-res-usage")))
    sass = run("-sass")
    if "--dump" in argv:
        with open(argv[argv.index("--dump") + 1], "w") as f:
            f.write(sass)
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", ln) for ln in sass.splitlines()) if m]
    p = fast_path(ins)
    ops = Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in p)
    widths = Counter(re.match(r"(?:@!?P\d+ )?((?:LDG|STG)[.A-Z0-9]*)", t).group(1) for t in p
                     if re.match(r"(?:@!?P\d+ )?(LDG|STG)", t))
    total = sum(1 for _, t in ins if not t.startswith("NOP"))
    print(f"{over} ob={ob} in_packed={in_packed} out_packed={out_packed} [{cfg['TM']} x {cfg['TW']} words, "
          f"{cfg['num_warps']} warps]: {res}; total {total} instr; fast path {len(p)} = {len(p) / per:.2f}/value "
          f"({per:g} values/thread); {dict(widths)}; fast-path spills {ops['STL']} STL / {ops['LDL']} LDL")
    print("  ", sorted(ops.items(), key=lambda x: -x[1])[:16])


if __name__ == "__main__":
    main()
