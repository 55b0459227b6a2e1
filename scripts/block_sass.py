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
import sys

from sass_tools import access_widths, compile_kernel, forward_path, histogram, instructions, res_str, sass_of

import tritile.quant.per_token_cast_kernel as K  # noqa: E402
from tritile.quant.common import FMT_CLAMP, FMT_MAX  # noqa: E402

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
    maxnreg = cfg.pop("maxnreg", None) or None
    consts = dict(IN_KIND=0, XBM=1, XBK=1, XSF_PACKED=False, BM=1 if token else 128, BK=128, ROW_GROUP=False,
                  OUT_E2M1=False, SF_MODE=0, ROUND_SF=True, PACKED=packed, CLAMP=FMT_CLAMP["e4m3"],
                  MAX=FMT_MAX["e4m3"], NUM_CHUNKS=(N + cfg["BLOCK_K"] - 1) // cfg["BLOCK_K"],
                  stride_sk=1 if not packed else 64, **cfg)
    if packed:
        consts["stride_sm"] = 1
    sig = {"x_ptr": "*i16", "out_ptr": "*u8", "sf_ptr": "*i32" if packed else "*fp32"}
    sig["xsf_ptr"] = sig["psf_ptr"] = sig["x_ptr"]
    k = compile_kernel(K._block_cast_kernel, sig, consts, DIV16, num_warps=nw, maxnreg=maxnreg)
    per = cfg["BLOCK_M"] * cfg["BLOCK_K"] * cfg["CHUNKS_PER_PROG"] / (32 * nw)  # elements per thread per program
    return k, per


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    over = json.loads(args[0]) if args and not sys.argv[sys.argv.index(args[0]) - 1] == "--dump" else {}
    packed, token = "--packed" in sys.argv, "--token" in sys.argv
    k, per = compile_variant(over, packed, token)
    sass, res = sass_of(k)
    if "--dump" in sys.argv:
        with open(sys.argv[sys.argv.index("--dump") + 1], "w") as f:
            f.write(sass)
    ins = instructions(sass)
    p = forward_path(ins, skip_calls=True)
    widths = access_widths(p)
    print(f"{'per-token ' if token else ''}{over} packed={packed or token}: {res_str(res)}; total {len(ins)} instr; finite path {len(p)} instr = "
          f"{len(p) / per:.2f}/elem ({per:g} elem/thread); {widths}")
    print("  ", histogram(p, 16))


if __name__ == "__main__":
    main()
