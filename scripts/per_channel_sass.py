"""sm_90a SASS figures of per_channel_cast(_fused) at the benchmark anchor (bf16 4096 x 7168, no GPU needed).

    python scripts/per_channel_sass.py                                  # the default launch config
    python scripts/per_channel_sass.py '{"WORDS": true}' [--round-sf] [--map] [--dump /tmp/w.sass]

Compiles the kernel the launcher would pick for a config override (JSON, the keys of
``per_channel_cast_fused_kernel._launch``), then prints registers, spills (stack / local), blocks per SM
by registers (65536 per SM, 4-warp granularity ignored), the SASS instruction count (the kernel is
straight-line code) and that count per element of one thread.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITILE_GPU_CONFIGS"] = "1"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tritile.quant.per_channel_cast_fused_kernel as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
M, H = 4096, 7168
DEFAULT = dict(BLOCK_K=128, ROWS_PER_STEP=128, num_warps=4, num_stages=3, FINITE_BRANCH=False, VEC=8, SIGNED_ENC=2,
               INT_POW2=True, WORDS=False, HMUL_ENC=False)
ESIG = {"x_ptr": "*i16", "x_sf_ptr": "*i16", "pos_ptr": "*i32", "out_ptr": "*u8", "sf_ptr": "*fp32",
        "num_rows_in": "i32", "num_rows_out": "i32", "hidden": "i32", "num_groups": "i32", "stride_xm": "i32",
        "stride_xsm": "i32", "stride_xsk": "i32", "stride_pos": "i32", "stride_om": "i32", "stride_sm": "i32"}
WSIG = {"x_ptr": "*i32", "pos_ptr": "*i32", "out_ptr": "*i16", "sf_ptr": "*fp32", "num_rows_in": "i32",
        "num_rows_out": "i32", "num_words": "i32", "stride_xm": "i32", "stride_pos": "i32", "stride_om": "i32",
        "stride_sm": "i32"}
DIV16 = {"x_ptr", "x_sf_ptr", "pos_ptr", "out_ptr", "sf_ptr", "num_rows_in", "num_rows_out", "hidden", "num_words",
         "stride_xm", "stride_om", "stride_sm"}


def compile_variant(over: dict, round_sf: bool, has_map: bool):
    c = dict(DEFAULT, **over)
    if c["WORDS"]:
        fn, sig = K._per_channel_cast_words_kernel, WSIG
        bkw = c["BLOCK_K"] // 2
        consts = dict(HAS_MAP=has_map, ROUND_SF=round_sf, BM=128, BKW=bkw, VECW=c["VEC"] // 2,
                      EVEN=not has_map and (H // 2) % bkw == 0, INT_POW2=c["INT_POW2"], HMUL_ENC=c["HMUL_ENC"])
        if has_map:
            sig = dict(sig, stride_pos="i32")
    else:
        fn, sig = K._per_channel_cast_fused_kernel, ESIG
        consts = dict(IN_KIND=1, HAS_SF=False, SF_PACKED=False, NPC=128, HAS_MAP=has_map, ROUND_SF=round_sf, BM=128,
                      BK=c["BLOCK_K"], RB=c["ROWS_PER_STEP"], FINITE_BRANCH=c["FINITE_BRANCH"], VEC=c["VEC"],
                      SIGNED_ENC=c["SIGNED_ENC"], INT_POW2=c["INT_POW2"])
    params = list(fn.arg_names)
    consts = {k: v for k, v in consts.items() if k in params}
    full = {n: ("constexpr" if n in consts else sig[n]) for n in params if n != "PDL"}
    full["PDL"] = "constexpr"
    consts["PDL"] = False
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(params) if n in DIV16 and n not in consts}
    opts = dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
    if c.get("maxnreg"):
        opts["maxnreg"] = c["maxnreg"]
    k = triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    per = 128 * c["BLOCK_K"] / (32 * c["num_warps"])
    return k, per, c


def main() -> None:
    args = sys.argv[1:]
    dump = None
    if "--dump" in args:
        i = args.index("--dump")
        dump = args[i + 1]
        del args[i:i + 2]
    round_sf = "--round-sf" in args
    has_map = "--map" in args
    args = [a for a in args if not a.startswith("--")]
    over = json.loads(args[0]) if args else {}
    k, per, c = compile_variant(over, round_sf, has_map)
    path = "/tmp/per_channel_sass.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])

    def run(*a):
        return subprocess.run([os.path.join(BIN, "cuobjdump"), *a, path], capture_output=True, text=True).stdout

    res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", run("-res-usage")))
    sass = run("-sass")
    ins = [m.group(1) for m in (re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", ln) for ln in sass.splitlines()) if m]
    ins = [i for i in ins if not i.startswith("NOP")]
    ops = Counter((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in ins)
    regs = int(res["REG"])
    blocks = 65536 // (regs * 32 * c["num_warps"])
    print(f"{over} round_sf={round_sf} map={has_map}: {regs} registers, stack {res.get('STACK')}, "
          f"local {res.get('LOCAL')}, shared {res.get('SHARED')}; {blocks} blocks/SM by registers; "
          f"{len(ins)} SASS instructions, {len(ins) / per:.2f} per element ({per:g} elements/thread)")
    print("  ", sorted(ops.items(), key=lambda x: -x[1])[:24])
    if dump:
        with open(dump, "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
