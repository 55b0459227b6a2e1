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
import sys

from sass_tools import compile_kernel, histogram, instructions, pop_option, sass_of

os.environ["TRITILE_GPU_CONFIGS"] = "1"

import tritile.quant.per_channel_cast_fused_kernel as K  # noqa: E402

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
        consts.update(SXM=0, SOM=0, FAST_DIV=False)  # the launcher's defaults (candidates off)
        if c.get("STATIC_STRIDES"):  # the anchor's contiguous x (int32 words) and out (int16 words of two codes)
            consts.update(SXM=H // 2, SOM=H // 2)
        for key in ("FAST_DIV", "KFAST"):
            if c.get(key):
                consts[key] = True
        if has_map:
            sig = dict(sig, stride_pos="i32")
    else:
        fn, sig = K._per_channel_cast_fused_kernel, ESIG
        consts = dict(IN_KIND=1, HAS_SF=False, SF_PACKED=False, NPC=128, HAS_MAP=has_map, ROUND_SF=round_sf, BM=128,
                      BK=c["BLOCK_K"], RB=c["ROWS_PER_STEP"], FINITE_BRANCH=c["FINITE_BRANCH"], VEC=c["VEC"],
                      SIGNED_ENC=c["SIGNED_ENC"], INT_POW2=c["INT_POW2"])
    consts["PDL"] = False
    k = compile_kernel(fn, sig, consts, DIV16, num_warps=c["num_warps"], num_stages=c["num_stages"],
                       maxnreg=c.get("maxnreg") or None)
    per = 128 * c["BLOCK_K"] / (32 * c["num_warps"])
    return k, per, c


def main() -> None:
    args = sys.argv[1:]
    dump = pop_option(args, "--dump")
    round_sf = "--round-sf" in args
    has_map = "--map" in args
    args = [a for a in args if not a.startswith("--")]
    over = json.loads(args[0]) if args else {}
    k, per, c = compile_variant(over, round_sf, has_map)
    sass, res = sass_of(k)
    ins = [t for _, t in instructions(sass) if not t.startswith("NOP")]
    regs = int(res["REG"])
    blocks = 65536 // (regs * 32 * c["num_warps"])
    print(f"{over} round_sf={round_sf} map={has_map}: {regs} registers, stack {res.get('STACK')}, "
          f"local {res.get('LOCAL')}, shared {res.get('SHARED')}; {blocks} blocks/SM by registers; "
          f"{len(ins)} SASS instructions, {len(ins) / per:.2f} per element ({per:g} elements/thread)")
    print("  ", histogram(ins, 24))
    if dump:
        with open(dump, "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
