"""Dequantize E5M6 back to bf16/fp32 (``tile_kernels.quant.cast_back_e5m6_kernel``)."""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..language import f32_to_bf16, ue8m0_to_f32
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_choice, check_same_device, check_tensor, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div, next_power_of_two
from .common import SFInfo, sf_info
from .types import QuantTensor

__all__ = ["cast_back_e5m6"]


@triton.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight ``[R, G]`` tensors -> ``[R, 8G]`` with ``out[:, 8g + j] = c_j[:, g]`` (inverse of ``_split8``)."""
    R: tl.constexpr = c0.shape[0]
    G: tl.constexpr = c0.shape[1]
    ee = tl.join(c0, c4)
    eo = tl.join(c2, c6)
    oe = tl.join(c1, c5)
    oo = tl.join(c3, c7)
    e = tl.join(ee, eo)
    o = tl.join(oe, oo)
    return tl.reshape(tl.join(e, o), (R, G * 8))


@triton.jit
def _e5m6_to_f32(code):
    """12-bit E5M6 code (int32) -> float32, exact: the code is the top of an fp16 pattern."""
    return (code << 4).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _cast_back_e5m6_kernel(
    data_ptr, sf_ptr, out_ptr,
    M, K, BM, BK,
    stride_dm, stride_sfm, stride_sfk, stride_om,
    SF_PACKED: tl.constexpr, SF_PER_ROW: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False
):
    """Tile of BLOCK_M rows x BLOCK_G groups of 8 columns; data read as int32 words (3 per group)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G).to(tl.int64)
    row_ok = rows < M
    gmask = row_ok[:, None] & (g[None, :] < K // 8)
    wp = data_ptr + rows[:, None] * stride_dm + 3 * g[None, :]
    w0 = tl.load(wp, mask=gmask, other=0)
    w1 = tl.load(wp + 1, mask=gmask, other=0)
    w2 = tl.load(wp + 2, mask=gmask, other=0)
    c0 = (w0 >> 20) & 0xFFF
    c1 = (w0 >> 8) & 0xFFF
    c2 = ((w0 & 0xFF) << 4) | ((w1 >> 28) & 0xF)
    c3 = (w1 >> 16) & 0xFFF
    c4 = (w1 >> 4) & 0xFFF
    c5 = ((w1 & 0xF) << 8) | ((w2 >> 24) & 0xFF)
    c6 = (w2 >> 12) & 0xFFF
    c7 = w2 & 0xFFF
    v = _join8(_e5m6_to_f32(c0), _e5m6_to_f32(c1), _e5m6_to_f32(c2), _e5m6_to_f32(c3),
               _e5m6_to_f32(c4), _e5m6_to_f32(c5), _e5m6_to_f32(c6), _e5m6_to_f32(c7))

    cols = pid_g * (BLOCK_G * 8) + tl.arange(0, BLOCK_G * 8).to(tl.int64)
    mask = row_ok[:, None] & (cols[None, :] < K)
    if SF_PER_ROW:
        # one k-block covers the whole row: one scale per row
        sfo = (rows // BM) * stride_sfm
        if SF_PACKED:
            sf = ue8m0_to_f32(tl.load(sf_ptr + sfo, mask=row_ok, other=0))
        else:
            sf = tl.load(sf_ptr + sfo, mask=row_ok, other=0.0)
        y = v * sf[:, None]
    else:
        kb = cols // BK
        if SF_PACKED:
            sfo = (rows // BM)[:, None] * stride_sfm + (kb // 4)[None, :] * stride_sfk
            word = tl.load(sf_ptr + sfo, mask=mask, other=0)
            sf = ue8m0_to_f32(word >> (8 * (kb % 4)).to(tl.int32)[None, :])
        else:
            sfo = (rows // BM)[:, None] * stride_sfm + kb[None, :] * stride_sfk
            sf = tl.load(sf_ptr + sfo, mask=mask, other=0.0)
        y = v * sf
    op = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if OUT_BF16:
        tl.store(op, f32_to_bf16(y), mask=mask)
    else:
        tl.store(op, y, mask=mask)


def _launch_config(num_tokens: int, hidden: int):
    """(BLOCK_M, BLOCK_G, num_warps): ~8192 elements per program on GPU, bigger tiles in the interpreter."""
    groups = hidden // 8
    if not interpreter_configs():
        # H200 sweep (8001 x 7168): one row, 1024 groups, 16 warps: 50.1 us (bf16 out), 80.0 (fp32);
        # 2 x 512 groups, 8 warps: 52.7 / 83.2
        block_g = min(next_power_of_two(groups), 1024)
        return 1, block_g, max(1, min(16, block_g // 64))
    target = 65536
    block_g = min(next_power_of_two(groups), target // 8, 512)
    block_m = max(1, min(target // (block_g * 8), next_power_of_two(num_tokens)))
    num_warps = 4 if block_m * block_g * 8 <= 4096 else 8
    return block_m, block_g, num_warps


def _cast_back_e5m6_launch(data, sfi, bm, bk, out_dtype):
    num_tokens, cols = data.shape
    hidden = cols * 2 // 3
    out = empty((num_tokens, hidden), out_dtype, data.device)
    if num_tokens == 0:
        return out
    block_m, block_g, num_warps = _launch_config(num_tokens, hidden)
    # tritile.runtime.tuned("cast_back_e5m6", ...): BLOCK_M, BLOCK_G (groups of 8 columns), powers of two
    c = tuned("cast_back_e5m6", {"BLOCK_M": block_m, "BLOCK_G": block_g, "num_warps": num_warps})
    block_m, block_g, num_warps = c["BLOCK_M"], c["BLOCK_G"], c["num_warps"]
    if block_m < 1 or block_m & (block_m - 1) or block_g < 1 or block_g & (block_g - 1):
        raise ValueError(f"bad cast_back_e5m6 launch config {c}: BLOCK_M and BLOCK_G powers of two")
    grid = (ceil_div(num_tokens, block_m), ceil_div(hidden // 8, block_g))
    words = data.view(torch.int32)
    _cast_back_e5m6_kernel[grid](
        words, sfi.tensor, out,
        num_tokens, hidden, bm, bk,
        words.stride(0), sfi.stride_m, sfi.stride_k, out.stride(0),
        SF_PACKED=sfi.packed, SF_PER_ROW=bk >= hidden, OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_G=block_g, num_warps=num_warps, **pdl_args(out.device),
    )
    return out


def _check_block(name, block):
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise ValueError(f"{name} must be a (rows, cols) pair, got {block!r}")
    for v in block:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must hold two positive ints, got {tuple(block)!r}")
    return int(block[0]), int(block[1])


def _check_words(data: torch.Tensor) -> None:
    """The kernel reads 4-byte words: unit column stride, rows and start 4-byte aligned."""
    if data.shape[0] > 0 and data.shape[1] > 0:
        if data.stride(1) != 1 or data.stride(0) % 4 != 0 or data.storage_offset() % 4 != 0 or \
                data.data_ptr() % 4 != 0:
            raise ValueError("x[0] (data) must have unit column stride, a row stride that is a multiple of 4 "
                             f"bytes and 4-byte alignment, got strides {tuple(data.stride())}")


def _cast_back_e5m6_fake(data, sf, bm, bk, bf16):
    return data.new_empty((data.shape[0], data.shape[1] * 2 // 3), dtype=torch.bfloat16 if bf16 else torch.float32)


@custom_op("cast_back_e5m6", fake=_cast_back_e5m6_fake)
def _cast_back_e5m6_op(data: torch.Tensor, sf: torch.Tensor, bm: int, bk: int, bf16: bool) -> torch.Tensor:
    """``torch.library`` op ``tritile::cast_back_e5m6`` (validated arguments)."""
    _check_words(data)
    sfi = SFInfo(sf, sf.stride(0), sf.stride(1), sf.dtype == torch.int32)
    return _cast_back_e5m6_launch(data, sfi, bm, bk, torch.bfloat16 if bf16 else torch.float32)


def cast_back_e5m6(x: QuantTensor, fmt: str, x_block_size: Tuple[int, int]) -> torch.Tensor:
    """Dequantize E5M6 data: ``out[i, j] = cast_out(f32(fp16(code << 4)) * sf[i // bm, j // bk])``.

    Args:
        x: ``(data, sf)``.  ``data`` uint8 ``(M, K*3/2)`` as written by ``per_token_cast_to_e5m6`` (3
            little-endian uint32 words per 8 codes), ``K % 8 == 0``; rows may be strided if the row stride is
            a multiple of 4 bytes and the data is 4-byte aligned.  ``sf``: float32 ``(ceil(M/bm), ceil(K/bk))``
            or packed UE8M0 int32 ``(ceil(M/bm), ceil(ceil(K/bk)/4))``, any strides (UE8M0 byte 0 decodes to 0.0).
        fmt: ``'bf16'`` (round to nearest even) or ``'fp32'``: the output dtype.
        x_block_size: ``(bm, bk)`` of the scales, e.g. ``(1, K)`` for per-token scales.

    Returns:
        ``(M, K)`` bfloat16 or float32, contiguous.
    """
    check_choice("fmt", fmt, ("bf16", "fp32"))
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"x must be a (data, sf) pair, got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0] (data)", data, dtypes=(torch.uint8,), ndim=2)
    check_tensor("x[1] (sf)", sf, dtypes=(torch.float32, torch.int32), ndim=2)
    check_same_device(data=data, sf=sf)
    bm, bk = _check_block("x_block_size", x_block_size)
    num_tokens, cols = data.shape
    if cols % 12 != 0:
        raise ValueError(f"x[0] (data) must have K*3/2 columns with K % 8 == 0 (a multiple of 12), got {cols}")
    hidden = cols * 2 // 3
    if not torch.compiler.is_compiling():  # traced: the op checks the real tensor
        _check_words(data)
    sfi = sf_info("x[1] (sf)", sf, ceil_div(num_tokens, bm), ceil_div(hidden, bk))
    out_dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    if hidden == 0:
        return empty((num_tokens, 0), out_dtype, data.device)
    return _cast_back_e5m6_op(data, sfi.tensor, bm, bk, fmt == "bf16")
