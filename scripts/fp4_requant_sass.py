"""sm_90a SASS figures of ``_fp4_requant_kernel`` (the FP4-input per-token cast) at the anchor (no GPU needed).

    python scripts/fp4_requant_sass.py                       # the GPU default: [8, 512] tiles, 1 warp, maxnreg 80
    python scripts/fp4_requant_sass.py '{"maxnreg": 64}'     # overrides (constexprs, num_warps, maxnreg) as JSON
    python scripts/fp4_requant_sass.py '{}' --dump /tmp/fp4  # also writes /tmp/fp4.sass (the fast path alone)

Compiles the kernel as the launcher does for ``per_token_cast((x, sf) FP4 8001 x 7168 with 32 x 32 packed UE8M0
scales, 'e2m1', 128, (32, 32), True, True, True)`` and prints registers, spills (stack), and the fast path: the
common prologue up to the uniform ``max(scale bytes) <= 252`` branch plus the fast block after it (to its EXIT), with
its length per input word of one thread, its local-memory spills (``STL`` / ``LDL``, which a register cap must not
put there: the general branch may spill), load / store widths and an opcode histogram.
"""

from __future__ import annotations

import json
import sys

from sass_tools import access_widths, compile_kernel, histogram, instructions, opcode, pop_option, res_str, sass_of

import tritile.quant.per_token_cast_kernel as K  # noqa: E402
from tritile.quant.common import FMT_CLAMP, FMT_MAX  # noqa: E402

SIG = {"xw_ptr": "*i32", "xb_ptr": "*i8", "xsf_ptr": "*i32", "outw_ptr": "*i32", "outb_ptr": "*i8", "sf_ptr": "*i32",
       "lut_ptr": "*i64"}
DIV16 = {"xw_ptr", "xb_ptr", "xsf_ptr", "outw_ptr", "outb_ptr", "sf_ptr", "lut_ptr", "K", "KW", "num_xsf_k",
         "stride_xw", "stride_xb", "stride_ow", "stride_ob"}


def fast_path(ins):
    """The fast path's instructions: everything up to the branch after the ``<= 252`` compare, then the fall-through
    block to the first EXIT after the requantization's byte gather (``prmt ... 0x6420``)."""
    cmp_i = next(i for i, (_, t) in enumerate(ins) if "0xfc, PT" in t)
    bra = next(i for i in range(cmp_i, len(ins)) if opcode(ins[i][1]) == "BRA")
    gather = next(i for i in range(bra, len(ins)) if "0x6420" in ins[i][1])
    end = next(i for i in range(gather, len(ins)) if ins[i][1].startswith("EXIT"))
    return [t for _, t in ins[:end + 1] if not t.startswith("NOP")]


def main():
    args = sys.argv[1:]
    dump = pop_option(args, "--dump")
    over = json.loads(args[0]) if args else {}
    nw = over.pop("num_warps", 1)
    maxnreg = over.pop("maxnreg", 80)
    cfg = dict(XBM=32, XBK=32, BK=128, BLOCK_M=8, BLOCK_K=512, PACKED=True, CLAMP=FMT_CLAMP["e2m1"],
               MAX=FMT_MAX["e2m1"], FAST_LIMIT=252, BLOCKS=True, TABLE=True, KFAST=False,
               CLAMP_BITS=K._E2M1_CLAMP_BITS, PDL=True, stride_sm=1)
    cfg.update(over)
    k = compile_kernel(K._fp4_requant_kernel, SIG, cfg, DIV16, num_warps=nw, maxnreg=maxnreg)
    sass, res = sass_of(k)
    fp = fast_path(instructions(sass))
    words = cfg["BLOCK_M"] * cfg["BLOCK_K"] // 8 / (32 * nw)
    print(f"{json.dumps(over)} warps={nw} maxnreg={maxnreg}: {res_str(res)}; fast path {len(fp)} instructions = "
          f"{len(fp) / words:.1f} per word ({words:g} words a thread), spills "
          f"{sum(opcode(t) in ('STL', 'LDL') for t in fp)}; {access_widths(fp)}")
    print("  ", histogram([opcode(t) for t in fp], 16))
    if dump:
        with open(dump + ".sass", "w") as fh:
            fh.write("\n".join(fp) + "\n")


if __name__ == "__main__":
    main()
