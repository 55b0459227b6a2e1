"""sm_90a SASS figures of the SwiGLU per-token kernels at the benchmark anchors (no GPU needed).

    python scripts/swiglu_sass.py fwd '{"PREFETCH": true}'      # config overrides as JSON
    python scripts/swiglu_sass.py bwd '{"CH": 1024, "num_warps": 4}' [--dump /tmp/bwd.sass]

Compiles the kernel as the launcher would at the anchor (forward: H = 3584, bf16 words, clamp 0.5 with
counts, packed UE8M0 sf; backward: H = 7168, npc = 128, float32 sf, clamp 0.5, round_sf), then prints
registers, spills, and per backward branch (each loop) its static instruction count, the loads/stores
and barriers in it, and the count per element of one thread (per column for the backward); then the loop's
fast path ("fast"): the instructions one iteration executes when every conditional forward branch falls through
and every unconditional one is taken (the fused blocks' rcp / division slow paths and the calls skipped), with its
MUFU / SHFL counts.  The static counts include those slow paths (e.g. the backward's 64 MUFU per 16 columns are 32
on the fast path: one ex2 and one rcp per column).
"""

from __future__ import annotations

import inspect
import json
import re
import sys

from sass_tools import compile_kernel, instructions, loops, opcode, res_str, sass_of

import tritile.quant.swiglu_backward_and_per_token_cast_kernel as B  # noqa: E402
import tritile.quant.swiglu_forward_and_per_token_cast_kernel as F  # noqa: E402

FSIG = {"x_ptr": "*i32", "out_ptr": "*i16", "sf_ptr": "*i32", "ptt_ptr": "*i32", "w_ptr": "*fp32", "p2e_ptr": "*i32",
        "cnt_ptr": "*i64", "num_rows": "i32", "num_weights": "i32", "num_groups": "i32", "num_words": "i32",
        "stride_xm": "i32", "stride_om": "i32", "stride_sm": "i32", "stride_sk": "i32", "clamp_value": "fp32",
        "sf_clamp_min": "fp32", "clamp_bf16": "i32"}
BSIG = {"q_ptr": "*u8", "sfx_ptr": "*fp32", "g_ptr": "*i16", "ptt_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*i16",
        "dq_ptr": "*u8", "dsf_ptr": "*fp32", "xg_ptr": "*i16", "rowsum_ptr": "*fp32", "num_rows": "i32",
        "num_weights": "i32", "stride_qm": "i32", "stride_sfm": "i32", "stride_sfk": "i32", "stride_gm": "i32",
        "stride_om": "i32", "stride_dqm": "i32", "stride_dsm": "i32", "stride_xgm": "i32", "clamp_value": "fp32"}
DIV16 = {"x_ptr", "out_ptr", "sf_ptr", "ptt_ptr", "w_ptr", "p2e_ptr", "cnt_ptr", "q_ptr", "sfx_ptr", "g_ptr", "dq_ptr",
         "dsf_ptr", "xg_ptr", "rowsum_ptr", "stride_xm", "stride_om", "stride_qm", "stride_gm", "stride_dqm",
         "stride_xgm", "stride_sfm", "stride_dsm"}
LAUNCH_ONLY = {"num_warps", "maxnreg", "programs_per_sm"}


def compile_variant(op: str, over: dict):
    if op == "fwd":
        H = 3584
        cfg = F._config(H, 128, True)
        cfg.update(over)
        fn, sig = F._swiglu_forward_and_per_token_cast_kernel, FSIG
        consts = dict(H=H, X_BF16=True, HAS_WEIGHTS=False, HAS_P2E=False, HAS_CLAMP=True, COUNT=True, ROUND_SF=True,
                      PACKED=True, GB=128, X_WORDS=bool(cfg["WORDS"]))
        if not consts["X_WORDS"]:
            sig = dict(sig, x_ptr="*i16", out_ptr="*u8")
        # the launcher's flush period of the INT_COUNT mask sums (a row block adds at most 4 per chunk and word)
        cfg["CNT_FLUSH"] = cfg.get("CNT_FLUSH") or max(1, 65535 // (4 * -(-H // cfg["CH"])))
        per = cfg["BLOCK_R"] * cfg["CH"] / (32 * cfg["num_warps"])  # elements per thread per chunk
    else:
        H = 7168
        cfg = B._config(H, 128)
        cfg.update(over)
        fn, sig = B._swiglu_backward_and_per_token_cast_kernel, BSIG
        consts = dict(H=H, NPC=128, SF_PACKED=False, HAS_CLAMP=True, ROUND_SF=True)
        stream = int(cfg.pop("STREAM", 0) or 0)  # the launcher's mapping of the STREAM key
        consts.update(LD_EVICT="evict_first" if stream & 1 else "", ST_CACHE=".cs" if stream & 2 else "")
        # columns per thread per chunk-loop step (UNROLL=2: two chunks a step)
        per = cfg["BLOCK_R"] * cfg["CH"] * int(cfg.get("UNROLL", 1) or 1) / (32 * cfg["num_warps"])
    for k, v in cfg.items():
        if k not in LAUNCH_ONLY and k != "WORDS":
            consts[k] = v
    consts["PDL"] = True  # as launched on sm_90+ (tritile.language.pdl)
    # constexpr parameters left out take their defaults (compile_kernel would make them run-time i32 arguments)
    for name, par in inspect.signature(fn.fn).parameters.items():
        if name not in consts and par.default is not inspect.Parameter.empty:
            consts[name] = par.default
    k = compile_kernel(fn, sig, consts, DIV16, num_warps=cfg["num_warps"], enable_fp_fusion=False,
                       maxnreg=cfg.get("maxnreg") or None)
    return k, per, cfg


def loop_fast_path(ins, lo: int, hi: int):
    """The instructions of loop ``[lo, hi]`` on its fast path: conditional forward branches not taken, unconditional
    forward branches taken, up to the loop's backward branch (``NOP`` left out)."""
    body = [(a, t) for a, t in ins if lo <= a <= hi]
    idx = {a: i for i, (a, _) in enumerate(body)}
    i, path = 0, []
    while i < len(body):
        a, t = body[i]
        if not t.startswith("NOP"):
            path.append(t)
        m = re.match(r"(@!?U?P\d+ )?BRA (0x[0-9a-f]+)", t)
        if m and m.group(1) is None and int(m.group(2), 16) > a and int(m.group(2), 16) in idx:
            i = idx[int(m.group(2), 16)]
            continue
        i += 1
    return path


def main():
    op = sys.argv[1]
    over = json.loads(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else {}
    k, per, cfg = compile_variant(op, over)
    sass, res = sass_of(k)
    res = res_str(res)
    if "--dump" in sys.argv:
        with open(sys.argv[sys.argv.index("--dump") + 1], "w") as f:
            f.write(sass)
    print(f"{op} {over}: {res} "
          f"warps {cfg['num_warps']} per-thread elements/step {per:g}")
    ins = instructions(sass)
    for lo, hi, body in loops(ins):
        def cnt(p):
            return sum(1 for t in body if re.search(p, t))
        print(f"  loop {lo:#x}-{hi:#x}: {len(body)} instr ({len(body) / per:.1f}/elem), "
              f"LDG {cnt(r'LDG')} (128b {cnt(r'LDG.*128')}) STG {cnt(r'STG')} (128b {cnt(r'STG.*128')}) "
              f"LDS {cnt(r'LDS')} STS {cnt(r'STS')} BAR {cnt(r'BAR')} MUFU {cnt(r'MUFU')}")
        fast = loop_fast_path(ins, lo, hi)
        ops = [opcode(t) for t in fast]
        print(f"    fast: {len(fast)} instr ({len(fast) / per:.1f}/elem), MUFU {ops.count('MUFU')} "
              f"SHFL {ops.count('SHFL')} LDG {ops.count('LDG')} LDGSTS {ops.count('LDGSTS')} LDS {ops.count('LDS')} "
              f"STG {ops.count('STG')} BAR {ops.count('BAR')} CALL {ops.count('CALL')}")


if __name__ == "__main__":
    main()
