"""Host side of the generic block cast, shared by ``per_token_cast_kernel``, ``per_block_cast_kernel`` and
``cast_back_kernel``: input kinds and sf modes, argument parsing, the launch-config rule and the sf layout."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..runtime import check_choice, check_inner_contiguous, check_same_device, check_tensor, interpreter_configs
from ..utils import ceil_div, next_power_of_two
from .common import sf_info


# input kinds (constexpr IN_KIND)
IN_BF16, IN_FP32, IN_E4M3, IN_E2M1 = 0, 1, 2, 3
# sf modes (constexpr SF_MODE)
SF_QUANT, SF_ONLY, SF_PRECOMPUTED = 0, 1, 2

_IN_KIND = {torch.bfloat16: IN_BF16, torch.float32: IN_FP32, torch.float8_e4m3fn: IN_E4M3, torch.int8: IN_E2M1}


# ------------------------------------------------------------------------------------------------
# Host side (shared with per_block_cast_kernel / cast_back_kernel)
# ------------------------------------------------------------------------------------------------
def _parse_input(name: str, x, x_block_size, allow_quant: bool = True):
    """-> (data, xsf_info or None, in_kind, M, K logical, (xbm, xbk))."""
    if isinstance(x, (tuple, list)):
        if not allow_quant:
            raise TypeError(f"{name} must be a bfloat16/float32 tensor here, got a QuantTensor")
        if len(x) != 2:
            raise ValueError(f"{name} as a QuantTensor must be (data, sf), got a sequence of length {len(x)}")
        data, xsf = x
        check_tensor(f"{name}[0] (data)", data, dtypes=(torch.float8_e4m3fn, torch.int8), ndim=2)
        check_inner_contiguous(f"{name}[0] (data)", data)
        if x_block_size is None:
            raise ValueError(f"x_block_size is required when {name} is a QuantTensor, got None")
        xbs = _check_block("x_block_size", x_block_size)
        m = data.shape[0]
        k = data.shape[1] * 2 if data.dtype == torch.int8 else data.shape[1]
        info = sf_info(f"{name}[1] (sf)", xsf, ceil_div(m, xbs[0]), ceil_div(k, xbs[1]))
        check_same_device(**{f"{name}[0]": data, f"{name}[1]": xsf})
        return data, info, _IN_KIND[data.dtype], m, k, xbs
    check_tensor(name, x, dtypes=(torch.bfloat16, torch.float32), ndim=2)
    check_inner_contiguous(name, x)
    check_same_device(**{name: x})
    if x_block_size is not None:
        raise ValueError(f"x_block_size must be None when {name} is a plain tensor, got {x_block_size!r}")
    return x, None, _IN_KIND[x.dtype], x.shape[0], x.shape[1], (1, 1)


def _check_block(name: str, bs) -> Tuple[int, int]:
    if not isinstance(bs, (tuple, list)) or len(bs) != 2 or not all(isinstance(b, int) and not isinstance(b, bool)
                                                                    for b in bs):
        raise TypeError(f"{name} must be a pair of ints (rows, cols), got {bs!r}")
    if bs[0] < 1 or bs[1] < 1:
        raise ValueError(f"{name} must be positive, got {tuple(bs)}")
    return int(bs[0]), int(bs[1])


def _check_fmt(fmt, allowed=("e4m3", "e2m1")) -> str:
    check_choice("fmt", fmt, allowed)
    return fmt


def _data_view(t: torch.Tensor) -> torch.Tensor:
    """Integer view a kernel loads raw bits through (bf16 -> int16, fp8 -> uint8)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def _warps(tile: int, warps: int) -> int:
    """``warps`` for a ``tile``-element block, halved while a thread would hold exactly two elements: ptxas 12.8 then
    computes the second byte of the e4m3 pair conversion from a stale register (the stack pointer or an earlier
    constant), so every other code is wrong on the H200 and right in the interpreter
    (``tritile.testing.compile_check``'s SASS checks find both forms)."""
    while warps > 1 and tile == 64 * warps:
        warps //= 2
    return warps


def _config(m: int, k: int, bm: int, bk: int, row_group: bool, packed: bool, block_m: Optional[int],
            block_k: Optional[int], quant_input: bool = False):
    """(BLOCK_M, BLOCK_K, BK for the reshape, num_chunks, chunks_per_prog, num_warps): deterministic by shape.

    * per-token (bm == 1): ``[BLOCK_M, BLOCK_K]`` tiles (GPU: 2 rows x 1024 columns, 2 warps), up to 8
      chunks of a row pair per program (a static loop);
    * one group per row (npc == K): a whole row per tile when it fits (GPU: up to 8192 columns), else a
      two-pass loop over chunks;
    * 2D blocks: one ``(bm, bk)`` block per tile, ``chunks_per_prog`` blocks along K per program (a multiple
      of 4 when packed, so a program writes whole UE8M0 words).
    Under the interpreter: bigger tiles and fewer programs."""
    interp = interpreter_configs()
    if row_group:
        BLOCK_K = block_k or min(next_power_of_two(k), 2048 if interp else 8192)
        BK = BLOCK_K
        BLOCK_M = block_m or (min(next_power_of_two(m), 32) if interp else 1)
        tile = BLOCK_K * BLOCK_M
        warps = _warps(tile, 4 if tile <= 4096 else 8)
        num_chunks = ceil_div(k, BLOCK_K)
        return BLOCK_M, BLOCK_K, BK, num_chunks, num_chunks, warps
    if bm == 1:
        # H200 sweep (8001 x 7168, npc 128): one [4, 1024] chunk per program, 4 warps: 43.4 us against 46.3 us
        # for [2, 1024] x 7 chunks, 2 warps; QuantTensor (FP4) input: one row per program, 134.7 against 241 us
        BLOCK_M = block_m or (min(next_power_of_two(m), 64) if interp else (1 if quant_input else 4))
        BLOCK_K = block_k or max(min(next_power_of_two(k), 2048 if interp else 1024), bk)
        if packed:
            BLOCK_K = max(BLOCK_K, 4 * bk)
        warps = _warps(BLOCK_M * BLOCK_K, 2 if BLOCK_M * BLOCK_K <= 2048 else 4)
        num_chunks = ceil_div(k, BLOCK_K)
        cpp = num_chunks if interp else 1
        return BLOCK_M, BLOCK_K, bk, num_chunks, cpp, warps
    num_chunks = ceil_div(k, bk)
    if interp:
        cpp = num_chunks
    elif bm * bk >= 16384:
        cpp = min(num_chunks, 2)  # H200 sweep, 128x128 bf16: 2 blocks per program 49.2 us, 1: 52.6 us
    else:
        # H200 sweep, 32x32 fp32 -> e2m1 packed: 4 blocks per program (with prefetch, see _launch_cast) 93.9 us,
        # 16 blocks: 158.7 us
        cpp = max(1, min(num_chunks, 4))
    if packed:
        cpp = ceil_div(cpp, 4) * 4
    warps = _warps(bm * bk, 8 if bm * bk >= 16384 else (4 if bm * bk >= 4096 else 2))
    return bm, bk, bk, num_chunks, cpp, warps


def _check_cast_config(cfg, m, k, bm, bk, row_group, packed, BLOCK_M, BLOCK_K, BK, num_chunks, cpp):
    """Apply a (possibly overridden) launch config; ValueError for one the kernel cannot run.

    -> (BLOCK_M, BLOCK_K, BK, num_chunks, chunks_per_prog)."""
    bmx, bkx, cppx = int(cfg["BLOCK_M"]), int(cfg["BLOCK_K"]), int(cfg["CHUNKS_PER_PROG"])
    if (bmx, bkx, cppx) == (BLOCK_M, BLOCK_K, cpp):
        return BLOCK_M, BLOCK_K, BK, num_chunks, cpp
    for name, v in (("BLOCK_M", bmx), ("BLOCK_K", bkx)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if cppx < 1:
        raise ValueError(f"CHUNKS_PER_PROG must be positive, got {cppx}")
    if row_group:  # one group per row: BLOCK_K-wide chunks, every chunk in one program
        nc = ceil_div(k, bkx)
        return bmx, bkx, bkx, nc, nc
    if bm == 1:
        if bkx % bk:
            raise ValueError(f"BLOCK_K={bkx} must be a multiple of num_per_channels={bk}")
        if packed and (bkx // bk) % 4:
            raise ValueError(f"packed UE8M0 needs BLOCK_K={bkx} to hold a multiple of 4 groups of {bk}")
        nc = ceil_div(k, bkx)
        return bmx, bkx, bk, nc, min(cppx, nc)
    if (bmx, bkx) != (bm, bk):
        raise ValueError(f"2D blocks take one ({bm}, {bk}) block per tile, got BLOCK_M={bmx}, BLOCK_K={bkx}")
    if packed and cppx % 4:
        raise ValueError(f"packed UE8M0 with 2D blocks needs CHUNKS_PER_PROG % 4 == 0, got {cppx}")
    return bm, bk, bk, num_chunks, cppx


def _sf_layout(m: int, k: int, bm: int, bk: int, col_major: bool, packed: bool):
    """(shape, strides, dtype) of the §2.3 sf that ``alloc_sf`` returns (for the fake kernel)."""
    ms, ks = ceil_div(m, bm), ceil_div(k, bk)
    if packed:
        kc = ceil_div(ks, 4)
        return (ms, kc), ((kc, 1) if ms == 0 else (1, ceil_div(ms, 4) * 4)), torch.int32
    if col_major and ms > 0:
        return (ms, ks), (1, ceil_div(ms, 4) * 4), torch.float32
    return (ms, ks), (ks, 1), torch.float32
