"""sm_90 SASS figures of the transpose kernels: the TMA candidates beside the pointer kernels (no GPU needed).

    python scripts/transpose_tma_sass.py                       # the default table (fp8, bf16, fp32 variants)
    python scripts/transpose_tma_sass.py u8 '{"TMA": true, "word_path": false, "BLOCK_M": 128, "BLOCK_N": 128}'
    python scripts/transpose_tma_sass.py u8 '{"TMA": true, "PERSIST": 2}' --dump /tmp/t.sass

Compiles each variant as ``_launch`` would (int views of the data: u8 for fp8, i16 for bf16, i32 for fp32;
16-byte aligned pointers and strides) and prints registers, spills (STACK), static shared memory, and the
counts of TMA (UTMALDG/UTMASTG), shared-memory (LDS/STS, by width), global (LDG/STG, by width), barrier and
byte-permute (PRMT) instructions, per thread and per 16 bytes of the tile a thread moves.
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

import tritile.transpose.batched_transpose_kernel as T  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
ESZ = {"u8": 1, "i16": 2, "i32": 4}


def compile_variant(dt: str, cfg: dict):
    """Compile the kernel ``_launch`` would pick for dtype ``dt`` and config ``cfg``; returns (kernel, bytes per
    program step, warps)."""
    esz = ESZ[dt]
    warps = cfg.get("num_warps", 4)
    words = dt == "u8" and cfg.get("word_path", True)
    pairs = dt == "u8" and not words and cfg.get("PAIRS", False)
    if cfg.get("TMA"):
        fn = T._batched_transpose_tma_kernel
        if words:
            bm, bn = cfg.get("BLOCK_M4", 16), cfg.get("BLOCK_N4", 16)
            xs, os_ = f"tensordesc<i32[1,{bm},4,{bn}]>", f"tensordesc<i32[1,{bn},1,{bm}]>"
            nbytes = 16 * bm * bn
        elif pairs:
            bm, bn = cfg.get("BLOCK_M", 128) // 2, cfg.get("BLOCK_N", 128)
            xs, os_ = f"tensordesc<u8[1,{bm},2,{bn}]>", f"tensordesc<i16[1,{bn},{bm}]>"
            nbytes = 2 * bm * bn
        else:
            bm, bn = cfg.get("BLOCK_M", 128 // esz), cfg.get("BLOCK_N", 128 // esz)
            xs, os_ = f"tensordesc<{dt}[1,{bm},{bn}]>", f"tensordesc<{dt}[1,{bn},{bm}]>"
            nbytes = esz * bm * bn
        sig = {"x_desc": xs, "o_desc": os_, "tiles_n": "i32", "tiles_mn": "i32", "iters": "i32"}
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, MODE=1 if words else 2 if pairs else 0, PERSIST=bool(cfg.get("PERSIST", 0)),
                      STAGES=int(cfg.get("STAGES", 3)), ITERS=0)
        attrs = {}
    elif words:
        fn = T._batched_transpose_u8x4_kernel
        bm, bn = cfg.get("BLOCK_M4", 64), cfg.get("BLOCK_N4", 32)
        sig = {n: "i32" for n in fn.arg_names}
        sig.update(x_ptr="*i32", out_ptr="*i32")
        consts = dict(BLOCK_M4=bm, BLOCK_N4=bn, EVEN=True)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n in ("x_ptr", "out_ptr", "stride_xb", "stride_xm", "stride_ob", "stride_on")}
        nbytes = 16 * bm * bn
    else:
        fn = T._batched_transpose_kernel
        bm, bn, w0 = T._config(esz, 8064, 7168)
        bm, bn, warps = cfg.get("BLOCK_M", bm), cfg.get("BLOCK_N", bn), cfg.get("num_warps", w0)
        sig = {n: "i32" for n in fn.arg_names}
        sig.update(x_ptr=f"*{dt}", out_ptr=f"*{dt}", stride_xn="constexpr")
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, EVEN=True, STREAM=bool(cfg.get("STREAM", False)), stride_xn=1)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n in ("x_ptr", "out_ptr", "stride_xb", "stride_xm", "stride_ob", "stride_on")}
        nbytes = esz * bm * bn
    full = {n: ("constexpr" if n in consts else sig[n]) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=TARGET,
                       options=dict(num_warps=warps))
    return k, nbytes, warps


def sass_of(k) -> tuple[str, str]:
    """(SASS, resource usage: registers, stack (spills), shared memory)."""
    path = f"/tmp/transpose_tma_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    run = lambda *a: subprocess.run([os.path.join(BIN, "cuobjdump"), *a, path], capture_output=True,  # noqa: E731
                                    text=True).stdout
    res = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+)", run("-res-usage")))
    sass = run("-sass")
    os.unlink(path)
    return sass, res


def figures(dt: str, cfg: dict, dump: str | None = None) -> str:
    k, nbytes, warps = compile_variant(dt, cfg)
    sass, res = sass_of(k)
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    ops = [o for o in ops if o != "NOP"]
    c = Counter(ops)

    def n(prefix):
        return sum(v for o, v in c.items() if o.startswith(prefix))

    def widths(prefix):
        w = Counter()
        for o, v in c.items():
            if o.startswith(prefix):
                m = re.search(r"\.(8|U8|16|U16|64|128)\b", o)
                w[m.group(1) if m else "32"] += v
        return "/".join(f"{k}:{v}" for k, v in sorted(w.items())) or "0"

    per16 = nbytes / (32 * warps) / 16  # 16-byte units of the tile per thread and step
    res = res.replace("SHARED:1024", f"SHARED:{k.metadata.shared}")  # dynamic: TMA buffers, barriers
    return (f"{dt} {json.dumps(cfg)}: {res} warps={warps} tile={nbytes} B | instr {len(ops)} "
            f"({len(ops) / per16:.1f} per 16 B/thread) TMA ld {n('UTMALDG')} st {n('UTMASTG')} | "
            f"LDS {widths('LDS')} STS {widths('STS')} LDG {widths('LDG')} STG {widths('STG')} | "
            f"PRMT {n('PRMT')} BAR {n('BAR')} SYNCS {n('SYNCS')}")


def default_variants():
    """The current defaults, then every TMA candidate of the bench's tune lists."""
    from tritile.transpose._bench import _tma_tune

    out = [("u8", {"BLOCK_M4": 64, "BLOCK_N4": 32, "num_warps": 4}),  # the current fp8 default (word path)
           ("i16", {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}),  # the current bf16 default
           ("i32", {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8})]  # the current fp32 default
    for name, dt in (("fp8", "u8"), ("bf16", "i16"), ("fp32", "i32")):
        out += [(dt, c) for c in _tma_tune(name)]
    return out


def main():
    args = [a for a in sys.argv[1:]]
    dump = None
    if "--dump" in args:
        dump = args[args.index("--dump") + 1]
        del args[args.index("--dump"):args.index("--dump") + 2]
    todo = [(args[0], json.loads(args[1]) if len(args) > 1 else {})] if args else default_variants()
    for dt, cfg in todo:
        print(figures(dt, cfg, dump), flush=True)


if __name__ == "__main__":
    main()
