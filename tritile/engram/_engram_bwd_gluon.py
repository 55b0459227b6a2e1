"""engram_gate_bwd in one pass, in Gluon (Triton's explicit-layout dialect): Hopper (sm_90+) GPUs only.

One persistent program per grad_w_partial row p (8 warps, one per SM) walks its chunk of tokens.  Per token t:

* phase A: the token's grad_out row G[t] ([hc, H] bf16) and v[t] have arrived by TMA in shared memory, where G stays
  for the whole token; gamma_h = sum_d G_hd v_d (dL/dg) and grad_v[t] = sum_h g_h G_h (head order);
* the per-head coefficients delta (dL/dD with r held fixed), a_x and a_k, as in the two-pass kernels;
* phase B: x[t], k[t] and weight_fused stream through a ring of NSLOT shared-memory slots, one [hc, 1024] tile per
  slot; grad_x and grad_k are stored and delta * x * k is added to the program's grad_w accumulator, which stays on
  chip: NR tiles in registers, the others in the shared memory the rows and the ring leave.

Each phase-B tile, once every warp has read it, frees its ring slot for the tile NSLOT items ahead and its G / v
tile for the next token, so the next token's rows are read from DRAM under this token's arithmetic.  DRAM traffic
is the op's own (2.52 GB at T=8001, hc=4, H=7168) instead of the two passes' 2.98 GB; weight_fused is re-read per
token from L2.  Measured on the H200 (2026-11-30): 636-638 us CUPTI (TileKernels 644 us, the two passes 731-737);
in steady state a token takes 10.1 us against 9.85 us for its 315 KB at the copy rate (the kernel's global-timer
marks, ``PROF``).  Read-modify-writing grad_w_partial in L2 instead of keeping it on chip took 1074 us: L2 hits
queue behind the TMA stream's DRAM misses (0.5-1.6 us a tile).

This module imports Gluon lazily: ``available()`` says whether this Triton has the Gluon API the kernel was written
against (Triton 3.6) and the device is a Hopper-class GPU; the launcher in ``engram_gate_kernel`` falls back to the
two-pass Triton kernels otherwise (and always under the interpreter, which does not run Gluon).
"""

from __future__ import annotations

import functools
import os

import torch

CHUNK = 256  # columns per TMA box along H (a box dimension holds at most 256 elements)
NCH = 4  # boxes per tile: a tile is [hc, NCH * CHUNK] = [hc, 1024] columns
MAX_TILES = 8  # H <= MAX_TILES * NCH * CHUNK = 8192 (one register accumulator per tile)
NUM_WARPS = 8


@functools.lru_cache(maxsize=None)
def _gluon():
    """(gluon, gl, tma, mbarrier, fence_async_shared, TensorDescriptor), or None without a usable Gluon."""
    try:
        import triton
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except Exception:  # pragma: no cover - depends on the installed Triton
        return None
    if not triton.__version__.startswith("3.6"):  # the Gluon API is experimental and changes between releases
        return None
    if not all(hasattr(tma, n) for n in ("async_copy_global_to_shared",)):  # pragma: no cover
        return None
    return gluon, gl, tma, mbarrier, fence_async_shared, TensorDescriptor


@functools.lru_cache(maxsize=None)
def kernel():
    """The Gluon kernel, or None without a usable Gluon."""
    if _gluon() is None:
        return None
    from ._engram_bwd_gluon_kernel import _engram_gate_bwd_onepass_kernel

    return _engram_gate_bwd_onepass_kernel


def available(device: torch.device) -> bool:
    """Whether the one-pass Gluon backward can run on ``device`` (a Hopper-class CUDA GPU with Gluon)."""
    if os.environ.get("TRITILE_ENGRAM_GLUON", "1") == "0":
        return False
    if device.type != "cuda" or _gluon() is None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (227 KB)
SMEM_SCRATCH = 2048  # the compiler's own scratch (reductions, layout conversions) and the mbarriers, with margin


def config(H: int, hc: int, nslot: int = 3):
    """The constexprs of the one-pass kernel for hidden size H and hc heads, or None when it does not cover the shape
    (hc not in {1, 2, 4}, H not a multiple of 256, H > 8192, or no room on chip for the grad_w accumulator).

    NT tiles of [hc, 1024] columns; NSLOT slots in the ring of x / k / w tiles; the warp grids A1 x A2 and
    hc x B1 x B2 of the two phases' layouts, VB columns a thread in phase B; NR accumulator tiles in registers (the
    other NT - NR in shared memory, which holds grad_out's and v's rows and the ring first)."""
    if hc not in (1, 2, 4) or H <= 0 or H % CHUNK or H > MAX_TILES * NCH * CHUNK:
        return None
    nt = -(-H // (NCH * CHUNK))
    tile = hc * NCH * CHUNK  # elements of a tile
    for nslot in range(max(nslot, 2), 1, -1):  # a shallower ring where the accumulator needs the room
        fixed = nt * (tile + NCH * CHUNK) * 2 + nslot * tile * (2 + 2 + 4)  # grad_out / v rows, the ring
        nr = nt - min(nt, max(0, (SMEM_LIMIT - SMEM_SCRATCH - fixed) // (tile * 4)))
        if nr <= 4:
            break
    else:
        return None
    b1 = min(NCH, NUM_WARPS // hc)
    b2 = NUM_WARPS // (hc * b1)
    return dict(NT=nt, NSLOT=nslot, A1=NCH, A2=NUM_WARPS // NCH, B1=b1, B2=b2, VB=CHUNK // (32 * b2), NR=nr)


def _aligned(t: torch.Tensor, strides) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in strides)


def supports(grad_out, hidden_states, k, v, weight_fused, nslot: int = 3) -> bool:
    """TMA's rules: 16-byte aligned bases and strides (and the shapes ``config`` covers)."""
    T, hc, H = hidden_states.shape
    if config(H, hc, nslot) is None:
        return False
    return (_aligned(grad_out, grad_out.stride()[:2]) and _aligned(hidden_states, hidden_states.stride()[:2])
            and _aligned(k, k.stride()[:2]) and _aligned(v, v.stride()[:1])
            and _aligned(weight_fused, weight_fused.stride()[:1]))


@functools.lru_cache(maxsize=None)
def layouts():
    """(bf16 4-d, bf16 3-d, fp32 3-d) shared layouts of the TMA boxes: row-major, no swizzle."""
    gl = _gluon()[1]
    return (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=4),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))


def launch(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value, scale,
           grad_x, grad_k, grad_v, grad_w_partial, tokens_per_chunk: int, nslot: int = 3, prof=None):
    """Run the one-pass kernel (``supports`` must hold): one program per grad_w_partial row."""
    TensorDescriptor = _gluon()[5]
    T, hc, H = hidden_states.shape
    cfg = config(H, hc, nslot)
    l4, l3, l3f = layouts()
    nc = H // CHUNK

    def rows(t):  # (T, hc, H) with unit inner stride -> (T, hc, H / 256, 256)
        s0, s1, _ = t.stride()
        return TensorDescriptor(t, [T, hc, nc, CHUNK], [s0, s1, CHUNK, 1], [1, hc, NCH, CHUNK], l4)

    v_desc = TensorDescriptor(v, [T, nc, CHUNK], [v.stride(0), CHUNK, 1], [1, NCH, CHUNK], l3)
    w_desc = TensorDescriptor(weight_fused, [hc, nc, CHUNK], [weight_fused.stride(0), CHUNK, 1], [hc, NCH, CHUNK],
                              l3f)
    kernel()[(grad_w_partial.shape[0],)](
        rows(grad_out), rows(hidden_states), rows(k), v_desc, w_desc,
        dot, gate_score, rstd_x, rstd_k,
        grad_x, grad_k, grad_v, grad_w_partial,
        T, tokens_per_chunk, float(H), clamp_value, scale,
        grad_x.stride(0), grad_x.stride(1), grad_k.stride(0), grad_k.stride(1), grad_v.stride(0),
        grad_w_partial.stride(0), grad_w_partial.stride(1),
        H=H, HC=hc, NCH_=NCH, CH=CHUNK, **cfg,
        prof_ptr=prof if prof is not None else grad_w_partial, PROF=prof is not None,
        num_warps=NUM_WARPS,
    )


def compile_offline(H: int, hc: int, nslot: int = 3, arch: int = 90):
    """Compile the kernel for ``sm_<arch>`` without a GPU, specialised as a launch with 16-byte aligned pointers and
    strides would be (for the compile tests and the SASS tools).  Returns Triton's CompiledKernel."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource

    k = kernel()
    cfg = config(H, hc, nslot)
    l4, l3, l3f = layouts()

    def desc(dt, blk, lay):
        return f"tensordesc<{dt}[{', '.join(map(str, blk))}],{lay!r}>"

    consts = dict(H=H, HC=hc, NCH_=NCH, CH=CHUNK, **cfg)
    names = list(inspect.signature(k.fn).parameters)
    sig = {n: "constexpr" for n in consts}
    sig.update({n: desc("bf16", [1, hc, NCH, CHUNK], l4) for n in ("g_desc", "x_desc", "k_desc")})
    sig["v_desc"] = desc("bf16", [1, NCH, CHUNK], l3)
    sig["w_desc"] = desc("fp32", [hc, NCH, CHUNK], l3f)
    sig.update({n: "*fp32" for n in ("dot_ptr", "gate_ptr", "rx_ptr", "rk_ptr", "gw_ptr", "prof_ptr")})
    sig.update({n: "*bf16" for n in ("gx_ptr", "gk_ptr", "gv_ptr")})
    sig.update({n: "fp32" for n in ("hidden_f", "clamp_value", "scale")})
    sig = {n: sig.get(n, "i32") for n in names}
    aligned = {i for i, n in enumerate(names) if sig[n].startswith("*") or n.startswith("s_")}
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = GluonASTSource(k, sig, constexprs=consts, attrs=attrs)
    return tcompile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})
