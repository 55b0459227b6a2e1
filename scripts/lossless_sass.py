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
import re
import sys
from collections import Counter

from sass_tools import access_widths, compile_kernel, forward_path, instructions, loops, opcode, res_str, sass_of

import tritile.quant.per_block_cast_lossless_kernel as L  # noqa: E402
from tritile.utils import align, ceil_div  # noqa: E402

M, K = 8001, 7168
BMI, BKI = 1, 32


def compile_variant(over: dict, ob, in_packed: bool, out_packed: bool):
    bmo, bko = ob
    tm, tw, nw = L._word_tile(bmo, bko, K)
    cfg = {"TM": tm, "TW": tw, "num_warps": nw, "PRMT": False, "PAIR64": False, "TILES": 0, "PERSIST": 0,
           **over}
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
    if cfg["TILES"] or cfg["PERSIST"]:  # the looping kernel (tile counts: the anchor's, a 132-SM grid)
        fn = L._per_block_cast_lossless_loop_kernel
        nmt, nkt = ceil_div(M, cfg["TM"]), ceil_div(ks_out_pad * bko, 8 * cfg["TW"])
        g = min(nmt * nkt, 132 * cfg["PERSIST"]) if cfg["PERSIST"] else ceil_div(nmt * nkt, cfg["TILES"])
        ints.update(NUM_TILES=nmt * nkt, NKT=nkt, NMT=nmt, T_FIRST=1 if cfg["PERSIST"] else cfg["TILES"],
                    T_STEP=g if cfg["PERSIST"] else 1, T_SPAN=nmt * nkt if cfg["PERSIST"] else cfg["TILES"])
    consts = dict(IN_PACKED=in_packed, OUT_PACKED=out_packed, BMI=BMI, BKI=BKI, BMO=bmo, BKO=bko, TM=cfg["TM"],
                  TW=cfg["TW"], PRMT=cfg["PRMT"], PAIR64=cfg["PAIR64"], PDL=True)
    consts.update({n: 1 for n, v in ints.items() if v == 1})  # Triton specializes integer arguments equal to 1
    div16 = {n for n in fn.arg_names if n in ptrs or ints.get(n, 1) % 16 == 0}
    k = compile_kernel(fn, ptrs, consts, div16, num_warps=cfg["num_warps"], maxnreg=cfg.get("maxnreg") or None)
    per = cfg["TM"] * cfg["TW"] * 8 / (32 * cfg["num_warps"])  # output values per thread
    return k, per, cfg


def main():
    argv = sys.argv[1:]
    over = json.loads(argv[0]) if argv and not argv[0].startswith("--") else {}
    ob = tuple(int(v) for v in argv[argv.index("--ob") + 1].split(",")) if "--ob" in argv else (1, 128)
    in_packed, out_packed = "--in-packed" in argv, "--out-packed" in argv
    k, per, cfg = compile_variant(over, ob, in_packed, out_packed)
    sass, res = sass_of(k)
    if "--dump" in argv:
        with open(argv[argv.index("--dump") + 1], "w") as f:
            f.write(sass)
    ins = instructions(sass)
    p = forward_path(ins)  # the uniform "bad == 0" test jumps to the slow path; the fast block falls through
    ops = Counter(map(opcode, p))
    widths = access_widths(p)
    total = sum(1 for _, t in ins if not t.startswith("NOP"))
    print(f"{over} ob={ob} in_packed={in_packed} out_packed={out_packed} [{cfg['TM']} x {cfg['TW']} words, "
          f"{cfg['num_warps']} warps]: {res_str(res)}; total {total} instr; fast path {len(p)} = {len(p) / per:.2f}/value "
          f"({per:g} values/thread); {widths}; fast-path spills {ops['STL']} STL / {ops['LDL']} LDL")
    print("  ", ops.most_common(16))
    if cfg["TILES"] or cfg["PERSIST"]:  # the looping kernel: the fast path's instructions inside the tile loop
        lp = max(loops(ins), key=lambda r: r[1] - r[0], default=None)
        if lp is not None:
            body = [t for a, t in _forward_addrs(ins) if lp[0] <= a <= lp[1]]
            bops = Counter(map(opcode, body))
            print(f"   tile loop, fast path: {len(body)} = {len(body) / per:.2f}/value; {access_widths(body)}; "
                  f"spills {bops['STL']} STL / {bops['LDL']} LDL")


def _forward_addrs(ins):
    """``forward_path``'s walk with addresses; the tile loop's backward branch is not taken (one iteration)."""
    idx = {a: i for i, (a, _) in enumerate(ins)}
    i, path = 0, []
    while i < len(ins):
        a, t = ins[i]
        if t.startswith("EXIT"):
            path.append((a, t))
            break
        if not t.startswith("NOP"):
            path.append((a, t))
            m = re.match(r"(@!?U?P\d+ )?BRA (0x[0-9a-f]+)", t)
            if m and int(m.group(2), 16) > a and m.group(1) is None:
                i = idx[int(m.group(2), 16)]
                continue
        i += 1
    return path


if __name__ == "__main__":
    main()
