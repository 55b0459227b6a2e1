"""sm_90a SASS figures of ``_per_token_cast_to_e5m6_quad_kernel`` at the anchor (8001 x 7168 bf16; no GPU needed).

    python scripts/e5m6_sass.py '{"INT_ENC": true}' [--round 0|1] [--packed 0|1] [--dump /tmp/e5.sass]

Compiles the quad kernel as the launcher would (default config plus the JSON overrides; round_sf and packed
UE8M0 by default, as the anchor's (T, T, T) case), then prints registers, spills and the instruction count of the
finite path (every uniform branch on ``sf_inv > 0`` taken the finite way: the path of all-finite rows), per element
of one thread, with an opcode histogram.  Backward branches (the two-pass loops of a tile narrower than the row)
are not followed, so the per-element figure holds for one-pass tiles only.
"""

from __future__ import annotations

import json
import os
import sys

from sass_tools import compile_kernel, forward_path, histogram, instructions, res_str, sass_of

import tritile.quant.per_token_cast_to_e5m6_kernel as E  # noqa: E402
from tritile.quant.common import FMT_CLAMP, FMT_MAX  # noqa: E402

SIG = {"xw_ptr": "*i32", "out_ptr": "*i32", "sf_ptr": "*i32", "M": "i32", "K": "i32", "stride_xw": "i32",
       "stride_oq": "i32", "stride_sfm": "i32"}
DIV16 = {"xw_ptr", "out_ptr", "sf_ptr", "K", "stride_xw"}
LAUNCH_ONLY = {"num_warps", "QUAD"}
M, K = 8001, 7168


def compile_variant(over: dict, round_sf: bool, packed: bool):
    os.environ["TRITILE_GPU_CONFIGS"] = "1"
    block_m, bq, nw = E._quad_launch_config(M, K)
    cfg = {"BLOCK_M": block_m, "BLOCK_Q": bq, "num_warps": nw, "HW_RTZ": True, "COAL_ST": True, "INT_SF": False,
           "PAIR_ENC": False, "AMAX16": False, **over}
    consts = dict(ROUND_SF=round_sf, PACKED=packed, CLAMP=FMT_CLAMP["e5m6"], MAX=FMT_MAX["e5m6"],
                  NUM_K_CHUNKS=-(-(K // 32) // cfg["BLOCK_Q"]), PDL=True)
    consts.update({k: v for k, v in cfg.items() if k not in LAUNCH_ONLY})
    k = compile_kernel(E._per_token_cast_to_e5m6_quad_kernel, SIG, consts, DIV16, num_warps=cfg["num_warps"])
    per = cfg["BLOCK_M"] * cfg["BLOCK_Q"] * 32 / (32 * cfg["num_warps"])  # elements per thread per pass
    return k, per * consts["NUM_K_CHUNKS"], cfg


def main():
    args = sys.argv[1:]
    over = json.loads(args[0]) if args and not args[0].startswith("--") else {}
    opt = {args[j]: args[j + 1] for j in range(len(args)) if args[j].startswith("--")}
    k, per, cfg = compile_variant(over, opt.get("--round", "1") == "1", opt.get("--packed", "1") == "1")
    sass, res = sass_of(k)
    ins = instructions(sass)
    # the finite rows' path: the uniform "sf_inv > 0" (PAIR_ENC: "sf_inv >= 1") branch jumps to the general copy,
    # the then-block falls through and an unconditional branch skips the else-block
    p = forward_path(ins)
    total = sum(1 for _, t in ins if not t.startswith("NOP"))
    print(f"{over} round_sf={opt.get('--round', '1')} packed={opt.get('--packed', '1')}: {res_str(res)} total {total} "
          f"finite path {len(p)} ({len(p) / per:.2f}/elem, {per:g} elem/thread)")
    print("  ", histogram(p))
    if "--dump" in opt:
        with open(opt["--dump"], "w") as f:
            f.write(sass)
        with open(opt["--dump"] + ".ptx", "w") as f:
            f.write(k.asm["ptx"])


if __name__ == "__main__":
    main()
