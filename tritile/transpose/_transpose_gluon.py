"""A persistent transpose through TMA (Gluon, Hopper GPUs with Triton 3.6): one program per SM walks its tiles;
each tile arrives by TMA into a ring of shared-memory stages, is transposed through registers into one of two
output buffers, and leaves by TMA stores.  The host side here; the kernel in ``_transpose_gluon_kernel``.

``available(device)`` and ``supports(x)`` decide; ``batched_transpose_kernel`` falls back to the Triton kernels
otherwise (other GPUs, other Tritons, the interpreter, strides TMA cannot describe)."""

from __future__ import annotations

import functools
import os

import torch

from ..config import get_num_sms
from ..engram._engram_bwd_gluon import _capability, _gluon

NUM_WARPS = 8
_GL_DTYPE = {1: "int8", 2: "int16", 4: "int32"}


@functools.lru_cache(maxsize=None)
def config(elem_size: int, stages: int = 4) -> dict:
    """The tile of an element size: K boxes [BM, BN] a stage (the boxes' rows are at most 128 bytes: the 128-byte
    swizzle), S stages, and the register block [VR, VC] a thread with its thread / warp grids."""
    if elem_size == 4:
        return dict(BM=32, BN=32, K=4, S=stages, VR=4, VC=4, TR=4, TC=8, WK=4, WR=2, WC=1)
    if elem_size == 2:
        return dict(BM=64, BN=64, K=2, S=stages, VR=4, VC=8, TR=4, TC=8, WK=2, WR=4, WC=1)
    if elem_size == 1:
        return dict(BM=128, BN=128, K=1, S=stages, VR=8, VC=8, TR=2, TC=16, WK=1, WR=8, WC=1)
    raise ValueError(f"no TMA transpose for {elem_size}-byte elements")


def available(device: torch.device) -> bool:
    if os.environ.get("TRITILE_TRANSPOSE_GLUON", "1") == "0":
        return False
    if device.type != "cuda" or _gluon() is None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def supports(x: torch.Tensor) -> bool:
    """1/2/4-byte elements, a unit inner stride, 16-byte aligned base and strides, and M, N at least a tile."""
    if x.element_size() not in (1, 2, 4) or x.stride(-1) != 1 or x.data_ptr() % 16:
        return False
    es = x.element_size()
    b, m, n = x.shape
    if (x.stride(0) * es) % 16 or (x.stride(1) * es) % 16 or (m * es) % 16:  # m * es: the output's row stride
        return False
    cfg = config(es)
    return m >= cfg["BM"] and n >= cfg["BN"]


@functools.lru_cache(maxsize=None)
def _layout(bits: int):
    gl = _gluon()[1]
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=3)


def launch(x: torch.Tensor, out: torch.Tensor, stages: int = 4, per_sm: int = 1) -> None:
    """out[b] = x[b].T for x (B, M, N) and a contiguous out (B, N, M) (``supports(x)`` must hold)."""
    from ._transpose_gluon_kernel import _transpose_tma_kernel

    TensorDescriptor = _gluon()[5]
    es = x.element_size()
    cfg = config(es, stages)
    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[es]
    xi, oi = x.view(iv), out.view(iv)
    b, m, n = x.shape
    lay = _layout(8 * es)
    x_desc = TensorDescriptor(xi, [b, m, n], [xi.stride(0), xi.stride(1), 1], [1, cfg["BM"], cfg["BN"]], lay)
    y_desc = TensorDescriptor(oi, [b, n, m], [oi.stride(0), oi.stride(1), 1], [1, cfg["BN"], cfg["BM"]], lay)
    tiles_m = -(-m // (cfg["BM"] * cfg["K"]))
    tiles_n = -(-n // cfg["BN"])
    num_tiles = b * tiles_m * tiles_n
    grid = (min(num_tiles, per_sm * get_num_sms()),)
    _transpose_tma_kernel[grid](x_desc, y_desc, num_tiles, tiles_m, tiles_n, **cfg, num_warps=NUM_WARPS)


def compile_offline(elem_size: int, stages: int = 4, arch: int = 90):
    """Compile for ``sm_<arch>`` without a GPU (compile tests, SASS tools)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource

    from ._transpose_gluon_kernel import _transpose_tma_kernel as k

    cfg = config(elem_size, stages)
    dt = {1: "u8", 2: "i16", 4: "i32"}[elem_size]
    lay = _layout(8 * elem_size)
    names = list(inspect.signature(k.fn).parameters)
    sig = {n: "constexpr" for n in cfg}
    sig["x_desc"] = f"tensordesc<{dt}[1, {cfg['BM']}, {cfg['BN']}],{lay!r}>"
    sig["y_desc"] = f"tensordesc<{dt}[1, {cfg['BN']}, {cfg['BM']}],{lay!r}>"
    sig = {n: sig.get(n, "i32") for n in names}
    src = GluonASTSource(k, sig, constexprs=dict(cfg))
    return tcompile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})
