"""engram_gate_fwd in Gluon (Hopper GPUs with Triton 3.6), the host side; the kernel in ``_engram_fwd_gluon_kernel``.

One persistent program per token chunk (8 warps, one per SM).  Token t's x and v rows ([hc, H] and [H] bf16) arrive
by TMA into one of two row buffers while token t - 1 is computed; k and weight_fused stream through a ring of NSLOT
[hc, 1024] tiles.  Phase 1 sums x^2, k^2 and (x w) k per head (then dot, rstd_x, rstd_k and the gate, by the same
element-wise code as the Triton kernels, ``_gate_scalars``); phase 2 stores out = x + g v from the row buffer.  The
reductions sum in another order than the Triton kernels (so dot / rstd / out may differ in the last bits; the
tests' calc_diff bounds hold), and save_for_backward only adds stores (same output bits either way).

``available`` / ``supports`` decide; ``engram_gate_kernel`` falls back to the Triton kernels otherwise.
"""

from __future__ import annotations

import functools

from ._engram_bwd_gluon import (CHUNK, MAX_TILES, NCH, NUM_WARPS, SMEM_LIMIT, SMEM_SCRATCH, _aligned, _gluon,
                                available, layouts)

__all__ = ["available", "config", "supports", "launch", "compile_offline"]


@functools.lru_cache(maxsize=None)
def config(H: int, hc: int, nslot: int = 3):
    """The kernel's constexprs for hidden size H and hc heads (NT tiles of [hc, 1024]; NSLOT ring slots, fewer where
    the two row buffers need the room; the warp grid hc x B1 x B2 with VB columns a thread), or None when it does not
    cover the shape (hc not in {1, 2, 4}, H not a multiple of 256, H > 8192)."""
    if hc not in (1, 2, 4) or H <= 0 or H % CHUNK or H > MAX_TILES * NCH * CHUNK:
        return None
    nt = -(-H // (NCH * CHUNK))
    tile = hc * NCH * CHUNK
    rows = 2 * nt * (tile + NCH * CHUNK) * 2  # x and v, two buffers
    for ns in range(max(nslot, 2), 1, -1):
        if rows + ns * tile * (2 + 4) + SMEM_SCRATCH <= SMEM_LIMIT:
            break
    else:
        return None
    b1 = min(NCH, NUM_WARPS // hc)
    b2 = NUM_WARPS // (hc * b1)
    return dict(NT=nt, NSLOT=ns, B1=b1, B2=b2, VB=CHUNK // (32 * b2))


def supports(hidden_states, k, v, weight_fused, nslot: int = 3) -> bool:
    """TMA's rules (16-byte aligned bases and strides) and the shapes ``config`` covers."""
    T, hc, H = hidden_states.shape
    if config(H, hc, nslot) is None:
        return False
    return (_aligned(hidden_states, hidden_states.stride()[:2]) and _aligned(k, k.stride()[:2])
            and _aligned(v, v.stride()[:1]) and _aligned(weight_fused, weight_fused.stride()[:1]))


def kernel():
    if _gluon() is None:
        return None
    from ._engram_fwd_gluon_kernel import _engram_gate_fwd_onepass_kernel

    return _engram_gate_fwd_onepass_kernel


def launch(hidden_states, k, v, weight_fused, eps, clamp_value, scale, out, saved, num_parts: int,
           nslot: int = 3) -> None:
    """Run the kernel (``supports`` must hold): ``num_parts`` programs, contiguous token chunks; ``saved`` the four
    (T, hc) float32 outputs, or None."""
    TensorDescriptor = _gluon()[5]
    T, hc, H = hidden_states.shape
    cfg = config(H, hc, nslot)
    l4, l3, l3f = layouts()
    nc = H // CHUNK

    def rows(t):
        s0, s1, _ = t.stride()
        return TensorDescriptor(t, [T, hc, nc, CHUNK], [s0, s1, CHUNK, 1], [1, hc, NCH, CHUNK], l4)

    v_desc = TensorDescriptor(v, [T, nc, CHUNK], [v.stride(0), CHUNK, 1], [1, NCH, CHUNK], l3)
    w_desc = TensorDescriptor(weight_fused, [hc, nc, CHUNK], [weight_fused.stride(0), CHUNK, 1], [hc, NCH, CHUNK],
                              l3f)
    chunk = -(-T // num_parts)
    grid = (-(-T // chunk),)
    sv = saved if saved is not None else [out] * 4
    kernel()[grid](
        rows(hidden_states), rows(k), v_desc, w_desc, out, *sv,
        T, chunk, float(H), eps, clamp_value, scale, out.stride(0), out.stride(1),
        H=H, HC=hc, NCH_=NCH, CH=CHUNK, **cfg, SAVE=saved is not None, num_warps=NUM_WARPS,
    )


def compile_offline(H: int, hc: int, nslot: int = 3, save: bool = True, arch: int = 90):
    """Compile for ``sm_<arch>`` without a GPU (compile tests, SASS tools)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource

    k = kernel()
    cfg = config(H, hc, nslot)
    l4, l3, l3f = layouts()

    def desc(dt, blk, lay):
        return f"tensordesc<{dt}[{', '.join(map(str, blk))}],{lay!r}>"

    consts = dict(H=H, HC=hc, NCH_=NCH, CH=CHUNK, **cfg, SAVE=save)
    names = list(inspect.signature(k.fn).parameters)
    sig = {n: "constexpr" for n in consts}
    sig.update({n: desc("bf16", [1, hc, NCH, CHUNK], l4) for n in ("x_desc", "k_desc")})
    sig["v_desc"] = desc("bf16", [1, NCH, CHUNK], l3)
    sig["w_desc"] = desc("fp32", [hc, NCH, CHUNK], l3f)
    sig.update({n: "*fp32" for n in ("dot_ptr", "gate_ptr", "rx_ptr", "rk_ptr")})
    sig["out_ptr"] = "*bf16"
    sig.update({n: "fp32" for n in ("hidden_f", "eps", "clamp_value", "scale")})
    sig = {n: sig.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n.startswith("s_")}
    src = GluonASTSource(k, sig, constexprs=consts, attrs=attrs)
    return tcompile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})
