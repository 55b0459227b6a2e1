"""Compile the engram kernels for sm_90 without a GPU (run in a subprocess by test_engram_sm90_compile.py).

The interpreter accepts code the GPU compiler rejects (types of loop-carried values, specialised ints used as
tensors, ...), and cannot show whether loads vectorise.  This compiles every kernel at TileKernels' anchor
configuration (H = 7168, hc = 4) and with every int specialised to 1, and checks that the big gate kernels
issue 16-byte loads.  Prints one line per kernel; exits non-zero on the first failure.
"""

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tritile.engram.engram_fused_weight_kernel as fk  # noqa: E402
import tritile.engram.engram_gate_kernel as gk  # noqa: E402
import tritile.engram.engram_grad_w_reduce_kernel as rk  # noqa: E402
import tritile.engram.engram_hash_kernel as hk  # noqa: E402
from tritile.runtime import regs_per_thread  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _types(spec):
    return {name: ty for names, ty in spec.items() for name in names.split()}


FWD = _types({"x_ptr k_ptr v_ptr out_ptr": "*i16", "w_ptr dot_ptr gate_ptr rstd_x_ptr rstd_k_ptr": "*fp32",
              "num_rows hc H s_x0 s_x1 s_k0 s_k1 s_v0 s_w0 s_o0 s_o1": "i32",
              "hidden_f eps clamp_value scale": "fp32"})
FWDP = dict(FWD, T="i32", chunk="i32")
GAMMA = _types({"go_ptr v_ptr gv_ptr": "*i16", "gate_ptr gamma_ptr": "*fp32", "T hc H s_g0 s_g1 s_v0 s_gv0": "i32"})
BWD = _types({"go_ptr x_ptr k_ptr gx_ptr gk_ptr": "*i16",
              "w_ptr dot_ptr gate_ptr rstd_x_ptr rstd_k_ptr gamma_ptr gw_ptr": "*fp32",
              "T hc H tokens_per_chunk s_g0 s_g1 s_x0 s_x1 s_k0 s_k1 s_w0 s_gx0 s_gx1 s_gk0 s_gk1 s_gw0 s_gw1": "i32",
              "hidden_f clamp_value scale": "fp32"})
COEF = _types({"go_ptr v_ptr gv_ptr": "*i16",
               "dot_ptr gate_ptr rstd_x_ptr rstd_k_ptr delta_ptr ax_ptr ak_ptr": "*fp32",
               "T hc H s_g0 s_g1 s_v0 s_gv0": "i32", "hidden_f clamp_value scale": "fp32"})
SPLIT = _types({"go_ptr x_ptr k_ptr gx_ptr gk_ptr": "*i16", "w_ptr delta_ptr ax_ptr ak_ptr gw_ptr": "*fp32",
                "T hc H tokens_per_chunk s_g0 s_g1 s_x0 s_x1 s_k0 s_k1 s_w0 s_gx0 s_gx1 s_gk0 s_gk1 s_gw0 s_gw1":
                "i32"})
REDUCE = _types({"part_ptr gwh_ptr gwe_ptr": "*fp32", "wh_ptr we_ptr": "*i16",
                 "P H s_p0 s_p1 s_wh0 s_we0 s_gwh0 s_gwe0": "i32"})
FUSED = _types({"wh_ptr we_ptr": "*i16", "out_ptr": "*fp32", "H s_wh s_we s_out": "i32"})
HASH = _types({"ids_ptr off_ptr out_ptr vocab_ptr": "*i32", "mult_ptr": "*i64", "T s_id0 s_out0": "i32"})


def res_usage(k):
    """``{"REG": n, "STACK": n, "LOCAL": n, ...}`` of a compiled kernel (cuobjdump -res-usage on its cubin)."""
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    return {a: int(b) for a, b in re.findall(r"(REG|STACK|LOCAL):(\d+)", res)}


def compile_kernel(fn, types, consts, num_warps, aligned=("H", "P", "SW"), maxnreg=None, no_spills=False):
    """Compile ``fn`` as Triton would for 16-byte aligned pointers and strides divisible by 16 (with programmatic
    dependent launch, as on an H200, where the kernel has the ``PDL`` switch); ``no_spills``: assert that ptxas kept
    every value in registers (within ``maxnreg``, the launch's cap)."""
    if "PDL" in fn.arg_names:
        consts = dict(consts, PDL=True)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if n not in consts and (sig[n].startswith("*") or n.startswith("s_") or n in aligned):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=num_warps) if maxnreg is None else dict(num_warps=num_warps, maxnreg=maxnreg)
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=options)
    ops = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", k.asm["ptx"])))
    if re.search(r"cp\.async\.\w+\.shared\.global[^;]*, 0x10", k.asm["ptx"]):
        ops.append("cp.async.16")  # 16-byte asynchronous copies (a tl.range loop pipelined by the compiler)
    use = res_usage(k) if no_spills else {}
    print(f"{fn.__name__} {consts} num_warps={num_warps} maxnreg={maxnreg}: {' '.join(ops)} {use}")
    if no_spills:
        assert use["STACK"] == 0 and use["LOCAL"] == 0, f"{fn.__name__} spills registers: {use}"
    return ops


def main():
    H, hc = 7168, 4
    bh, rows, nw = gk._fwd_config(H)
    for save in (True, False):
        ops = compile_kernel(gk._engram_gate_fwd_kernel, FWD, dict(SAVE=save, ROWS=rows, BLOCK_H=bh), nw)
        assert "ld.global.v4.b32" in ops, "the fwd kernel's row loads do not vectorise"
    for hidden in (H, 2048, 4096):  # within the launch's register cap (CAP_REGS), without spills
        fcfg = gk._fwd_launch_config(hidden)
        for save in (True, False):
            for pf in (True, False):
                ops = compile_kernel(gk._engram_gate_fwd_persist_kernel, FWDP,
                                     dict(SAVE=save, BLOCK_H=fcfg["BLOCK_H"], PREFETCH=pf), fcfg["WARPS"],
                                     maxnreg=regs_per_thread(fcfg["WAVES"] * fcfg["WARPS"]), no_spills=True)
                assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, "the persistent fwd does not vectorise"
    hc_p2, tok, bd1, bd2, nw = gk._bwd_config(H, hc)
    ops = compile_kernel(gk._engram_gate_bwd_gamma_kernel, GAMMA, dict(HC_P2=hc_p2, TOK=tok, BLOCK_D=bd1), nw)
    assert "ld.global.v4.b32" in ops, "the bwd gamma kernel's loads do not vectorise"
    ops = compile_kernel(gk._engram_gate_bwd_kernel, BWD, dict(HC_P2=hc_p2, BLOCK_D=bd2), nw)
    assert "ld.global.v4.b32" in ops, "the bwd kernel's loads do not vectorise"
    cfg = gk._bwd_launch_config(H, hc)
    ops = compile_kernel(gk._engram_gate_bwd_coef_kernel, COEF,
                         dict(HC_P2=hc_p2, TOK=cfg["TOK"], BLOCK_D=cfg["BLOCK_D1"]), cfg["WARPS1"])
    assert "ld.global.v4.b32" in ops, "the bwd coef kernel's loads do not vectorise"
    for pipe in sorted({0, cfg["PIPE"]}):  # the GPU default (PIPE: the loads as 16-byte cp.async) and plain loads
        ops = compile_kernel(gk._engram_gate_bwd_split_kernel, SPLIT,
                             dict(HC_P2=hc_p2, BLOCK_D=cfg["BLOCK_D2"], SPLIT=cfg["SPLIT"], PREFETCH=cfg["PREFETCH"],
                                  PIPE=pipe), cfg["WARPS2"])
        want = "ld.global.v4.b32" if pipe == 0 else "cp.async.16"
        assert any(o.startswith(want) for o in ops), f"the bwd split kernel's loads do not vectorise (PIPE={pipe})"
    rows, bd, nw, early, swap, tail = rk._config(132, H)
    compile_kernel(rk._grad_w_reduce_kernel, REDUCE, dict(ROWS=rows, BLOCK_D=bd, EARLY=early, SWAP=swap, TAIL=tail),
                   nw)
    compile_kernel(rk._grad_w_reduce_kernel, REDUCE, dict(ROWS=128, BLOCK_D=bd, EARLY=True, SWAP=True, TAIL=4), nw)
    compile_kernel(fk._fused_weight_kernel, FUSED, dict(BLOCK=fk._config(H)), 4)
    for fast, hash_warps in ((False, 4), (True, 2)):
        compile_kernel(hk._engram_hash_kernel, HASH, dict(N=3, E=8, E_P2=8, BLOCK_T=hk._config(8001), FAST_MOD=fast),
                       hash_warps)
    # every int argument specialised to 1 (Triton turns ints equal to 1 into constants)
    compile_kernel(gk._engram_gate_fwd_kernel, FWD,
                   dict(SAVE=True, ROWS=1, BLOCK_H=1, H=1, hc=1, num_rows=1, s_x1=1, s_o1=1), 4)
    compile_kernel(gk._engram_gate_bwd_gamma_kernel, GAMMA, dict(HC_P2=1, TOK=1, BLOCK_D=1, T=1, hc=1, H=1), 4)
    compile_kernel(gk._engram_gate_bwd_kernel, BWD, dict(HC_P2=1, BLOCK_D=1, hc=1, H=1, s_gw1=1), 4)
    compile_kernel(rk._grad_w_reduce_kernel, REDUCE, dict(ROWS=1, BLOCK_D=1, EARLY=False, SWAP=False, TAIL=0, P=1,
                                                          H=1), 4)
    compile_kernel(fk._fused_weight_kernel, FUSED, dict(BLOCK=1, H=1, s_wh=1), 4)
    for fast in (False, True):
        compile_kernel(hk._engram_hash_kernel, HASH, dict(N=2, E=1, E_P2=1, BLOCK_T=1, T=1, s_id0=1, FAST_MOD=fast),
                       4)
    compile_kernel(gk._engram_gate_bwd_coef_kernel, COEF, dict(HC_P2=1, TOK=1, BLOCK_D=1, T=1, hc=1, H=1), 4)
    for pipe in (0, 3):
        compile_kernel(gk._engram_gate_bwd_split_kernel, SPLIT, dict(HC_P2=1, BLOCK_D=1, SPLIT=1, PREFETCH=pipe == 0,
                                                                     PIPE=pipe, hc=1, H=1, s_gw1=1), 4)
    compile_kernel(gk._engram_gate_fwd_persist_kernel, FWDP,
                   dict(SAVE=True, BLOCK_H=1, PREFETCH=True, H=1, hc=1, s_x1=1, s_o1=1), 4)
    compile_onepass()
    print("ok")


def compile_onepass():
    """The one-pass Gluon backward (when this Triton has the Gluon API it targets): TMA loads, no register spills,
    shared memory within the H200's 227 KB a block."""
    from tritile.engram import _engram_bwd_gluon as onepass

    if onepass._gluon() is None:
        print("one-pass Gluon kernel: skipped (no Gluon 3.6 API)")
        return
    for hc, H in ((4, 7168), (4, 8192), (4, 2560), (2, 4096), (1, 1024), (4, 256)):
        k = onepass.compile_offline(H, hc)
        assert "cp.async.bulk.tensor" in k.asm["ptx"], "the one-pass kernel issues no TMA loads"
        use = res_usage(k)
        smem = k.metadata.shared
        print(f"one-pass hc={hc} H={H}: {use} shared={smem}")
        assert use["STACK"] == 0 and use["LOCAL"] == 0, "the one-pass kernel spills registers"
        assert smem <= 227 * 1024, "the one-pass kernel needs more shared memory than a block may have"


if __name__ == "__main__":
    sys.exit(main())
