"""Dequantize e4m3 / FP4 QuantTensors to bf16 / fp32 (``tile_kernels.quant.cast_back_kernel``).

``out[i, j] = cast_out(f32(decode(q[i, j]) * sf[i // bm, j // bk]))`` with bf16 rounded to nearest even.
The sf may be in any layout: float32 of any strides, or packed UE8M0 int32 (the dtype decides; byte
``k % 4`` of word ``k // 4``, ``2^(e-127)``, e = 0 decodes to 0.0).  The tile loader is the one the block
casts use (``_block_cast_tiles._load_tile``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language import f32_to_bf16_bits
from ..language.cast import e4m3_bits_to_f32_fast
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_choice, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div, next_power_of_two
from ..runtime.plan import planned
from ._block_cast_host import _IN_KIND, _data_view, _parse_input
from ._block_cast_tiles import _apply_block_sf, _load_block_sf, _load_tile
from .types import QuantTensor

__all__ = ["cast_back", "per_token_cast_back"]


@triton.jit
def _cast_back_kernel(
    x_ptr, xsf_ptr, out_ptr,
    M, K, num_xsf_k, stride_xm, stride_xsf_m, stride_xsf_k, stride_om,
    IN_KIND: tl.constexpr, XBM: tl.constexpr, XBK: tl.constexpr, XSF_PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BF16: tl.constexpr, CHUNKS_PER_PROG: tl.constexpr,
    HW_DECODE: tl.constexpr = False, UNROLL: tl.constexpr = False, VEC: tl.constexpr = 0,
    PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False
):
    """Program ``(pm, pk)``: rows ``pm*BLOCK_M ..``, chunks ``pk*CHUNKS_PER_PROG ..`` of BLOCK_K columns.

    Speed-only flags (same bits): HW_DECODE decodes e4m3 with the hardware conversion when EMULATE is off
    (``e4m3_bits_to_f32_fast``; NaN codes stay NaN, and the scale multiply canonicalises NaN anyway);
    UNROLL makes the chunk loop a static, unrolled one; VEC > 0 caps the contiguity the compiler sees at VEC
    columns, so the byte loads take the bf16/fp32 stores' layout (VEC bytes per thread) instead of 16 bytes
    per thread and a shared-memory relayout (and its barriers) between every chunk's load and store;
    PREFETCH (e4m3 data with HW_DECODE, whole sf blocks per chunk) makes the loop static and issues the byte
    and scale loads of chunk ``i + 1`` before chunk ``i`` is decoded and stored (the compiler cannot move
    loads above the stores: out may alias x)."""
    pdl_enter(PDL)
    pm = tl.program_id(0).to(tl.int64)
    pk = tl.program_id(1).to(tl.int64)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < M
    if PREFETCH and IN_KIND == 2 and HW_DECODE and BLOCK_K % XBK == 0:
        c0 = pk * CHUNKS_PER_PROG * BLOCK_K
        raw_n, s_n = _cb_load(x_ptr, xsf_ptr, rows, row_ok, c0, K, num_xsf_k, stride_xm, stride_xsf_m,
                              stride_xsf_k, XBM, XBK, XSF_PACKED, BLOCK_M, BLOCK_K, VEC)
        for i in tl.static_range(CHUNKS_PER_PROG):
            raw = raw_n
            s = s_n
            if i + 1 < CHUNKS_PER_PROG:
                raw_n, s_n = _cb_load(x_ptr, xsf_ptr, rows, row_ok, c0 + (i + 1) * BLOCK_K, K, num_xsf_k,
                                      stride_xm, stride_xsf_m, stride_xsf_k, XBM, XBK, XSF_PACKED, BLOCK_M,
                                      BLOCK_K, VEC)
            cols = _cb_cols(c0 + i * BLOCK_K, BLOCK_K, VEC)
            q = e4m3_bits_to_f32_fast(raw)
            v = tl.reshape(tl.reshape(q, (BLOCK_M, BLOCK_K // XBK, XBK)) * s[:, :, None], (BLOCK_M, BLOCK_K))
            ptr = out_ptr + rows[:, None] * stride_om + cols[None, :]
            m = row_ok[:, None] & (cols < K)[None, :]
            _cb_store(ptr, v, m, OUT_BF16)
    elif UNROLL:
        for i in tl.static_range(CHUNKS_PER_PROG):
            _cast_back_chunk(x_ptr, xsf_ptr, out_ptr, rows, row_ok, (pk * CHUNKS_PER_PROG + i) * BLOCK_K, K,
                             num_xsf_k, stride_xm, stride_xsf_m, stride_xsf_k, stride_om, IN_KIND, XBM, XBK,
                             XSF_PACKED, BLOCK_M, BLOCK_K, OUT_BF16, HW_DECODE, VEC)
    else:
        for i in range(0, CHUNKS_PER_PROG):
            _cast_back_chunk(x_ptr, xsf_ptr, out_ptr, rows, row_ok, (pk * CHUNKS_PER_PROG + i) * BLOCK_K, K,
                             num_xsf_k, stride_xm, stride_xsf_m, stride_xsf_k, stride_om, IN_KIND, XBM, XBK,
                             XSF_PACKED, BLOCK_M, BLOCK_K, OUT_BF16, HW_DECODE, VEC)


@triton.jit
def _cb_store(ptr, v, m, OUT_BF16: tl.constexpr):
    """Store a decoded tile: bf16 bits (rounded to nearest even) or float32."""
    if OUT_BF16:
        tl.store(ptr, f32_to_bf16_bits(v), mask=m)
    else:
        tl.store(ptr, v, mask=m)


@triton.jit
def _cb_cols(col0, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    if VEC > 0:
        return col0 + tl.max_contiguous(tl.arange(0, BLOCK_K), VEC).to(tl.int64)
    else:
        return col0 + tl.arange(0, BLOCK_K).to(tl.int64)


@triton.jit
def _cb_load(x_ptr, xsf_ptr, rows, row_ok, col0, K, num_xsf_k, stride_xm, stride_xsf_m, stride_xsf_k,
             XBM: tl.constexpr, XBK: tl.constexpr, XSF_PACKED: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """Raw e4m3 bytes ``[BLOCK_M, BLOCK_K]`` and their float32 scales ``[BLOCK_M, BLOCK_K // XBK]``."""
    cols = _cb_cols(col0, BLOCK_K, VEC)
    m = row_ok[:, None] & (cols < K)[None, :]
    raw = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0)
    NB: tl.constexpr = BLOCK_K // XBK
    kb = col0 // XBK + tl.arange(0, NB).to(tl.int64)
    sm = row_ok[:, None] & (kb < num_xsf_k)[None, :]
    s = _load_block_sf(xsf_ptr, (rows // XBM)[:, None], kb[None, :], sm, stride_xsf_m, stride_xsf_k, XSF_PACKED)
    return raw, s


@triton.jit
def _cast_back_chunk(x_ptr, xsf_ptr, out_ptr, rows, row_ok, col0, K, num_xsf_k, stride_xm, stride_xsf_m,
                     stride_xsf_k, stride_om, IN_KIND: tl.constexpr, XBM: tl.constexpr, XBK: tl.constexpr,
                     XSF_PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BF16: tl.constexpr,
                     HW_DECODE: tl.constexpr, VEC: tl.constexpr):
    cols = _cb_cols(col0, BLOCK_K, VEC)
    m = row_ok[:, None] & (cols < K)[None, :]
    if IN_KIND == 2 and HW_DECODE:
        q = e4m3_bits_to_f32_fast(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0))
        v = _apply_block_sf(q, xsf_ptr, rows, row_ok, col0, cols, K, num_xsf_k, stride_xsf_m, stride_xsf_k,
                            BLOCK_M, BLOCK_K, XBM, XBK, XSF_PACKED)
    else:
        v = _load_tile(x_ptr, xsf_ptr, rows, row_ok, col0, K, stride_xm, stride_xsf_m, stride_xsf_k, num_xsf_k,
                       BLOCK_M, BLOCK_K, IN_KIND, XBM, XBK, XSF_PACKED)
    _cb_store(out_ptr + rows[:, None] * stride_om + cols[None, :], v, m, OUT_BF16)


def _config(m: int, k: int):
    """(BLOCK_M, BLOCK_K, chunks per program, num_warps).  GPU: one row a program, the whole row (up to 8192
    columns) as one chunk at 16 columns per thread, wider rows in 8192-column chunks; interpreter: big tiles, few
    programs."""
    if interpreter_configs():
        bm, bk = min(next_power_of_two(m), 64), min(next_power_of_two(k), 2048)
        return bm, bk, ceil_div(k, bk), 4
    # H200 sweeps (8001 x 7168 e4m3 -> bf16): one row x 2048 per chunk, 4 warps: 47.4 us; 4 x 1024: 51.0; H200,
    # 2026-11-30, commit 694bd6c (CUDA graph): 8 warps 45.40 us, 4 warps 46.04.  H200, 2026-11-30, commit bc6f44a
    # (CUPTI, L2 flushed): the whole row as one 8192-column chunk at 16 warps 43.19 us against 44.07 for 4 chunks of
    # 2048 at 8 warps (the default before; TileKernels 44.07) and 44.38 for 8192 at 8 warps; same bits
    bm, bk = 1, min(next_power_of_two(k), 8192)
    return bm, bk, ceil_div(k, bk), max(4, min(16, bk // 512))


@planned("cast_back")
def cast_back(x: QuantTensor, fmt: str, x_block_size: Tuple[int, int],
              x_special_fmt: Optional[str] = None) -> torch.Tensor:
    """Dequantize ``x = (data, sf)`` to ``fmt``.

    Args:
        x: data float8_e4m3fn ``(M, K)`` or int8 FP4 ``(M, K/2)`` (two codes per byte, even element in the
            low nibble; rows may be strided), and sf float32 ``(ceil(M/bm), ceil(K/bk))`` in any strides or
            packed UE8M0 int32 ``(ceil(M/bm), ceil(ceil(K/bk)/4))``.  With ``x_special_fmt='e5m6'``: data
            uint8 ``(M, K*3/2)`` (dispatches to ``cast_back_e5m6``).
        fmt: ``'bf16'`` or ``'fp32'``: the output dtype.
        x_block_size: ``(bm, bk)``, the scale block of sf.
        x_special_fmt: None or ``'e5m6'``.

    Returns:
        ``(M, K)`` bfloat16 (RNE) or float32, contiguous.
    """
    check_choice("fmt", fmt, ("bf16", "fp32"))
    check_choice("x_special_fmt", x_special_fmt, (None, "e5m6"))
    if x_special_fmt == "e5m6":
        from .cast_back_e5m6_kernel import cast_back_e5m6

        return cast_back_e5m6(x, fmt, x_block_size)
    if not isinstance(x, (tuple, list)):
        raise TypeError(f"x must be a QuantTensor (data, sf), got {type(x).__name__}")
    data, info, in_kind, m, k, xbs = _parse_input("x", x, x_block_size)
    return _cast_back_op(data, info.tensor, fmt, xbs[0], xbs[1])


def _cast_back_impl(data: torch.Tensor, sf: torch.Tensor, fmt: str, xbm: int, xbk: int) -> torch.Tensor:
    m = data.shape[0]
    k = data.shape[1] * 2 if data.dtype == torch.int8 else data.shape[1]
    out = empty((m, k), torch.bfloat16 if fmt == "bf16" else torch.float32, data.device)
    if m == 0 or k == 0:
        return out
    BLOCK_M, BLOCK_K, cpp, warps = _config(m, k)
    # VEC: the stores' vector width (8 bf16 / 4 fp32 per 16 bytes), so loads and stores share one layout (no
    # shared-memory relayout); PREFETCH: the next chunk's loads before this chunk's stores (2026-11-30 default
    # without either: 46.4 us at 8001 x 7168 e4m3 -> bf16, a relayout and 2 barriers per chunk, one 16-byte
    # load in flight per thread; with both: no shared memory or barrier, 2 chunks' loads in flight)
    cfg = tuned("cast_back", dict(BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, CHUNKS_PER_PROG=cpp, num_warps=warps,
                                  HW_DECODE=True, UNROLL=False, VEC=8 if fmt == "bf16" else 4, PREFETCH=True,
                                  ROW_BLOCK=True))
    if (cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["CHUNKS_PER_PROG"]) != (BLOCK_M, BLOCK_K, cpp):
        BLOCK_M, BLOCK_K = int(cfg["BLOCK_M"]), int(cfg["BLOCK_K"])
        for name, v in (("BLOCK_M", BLOCK_M), ("BLOCK_K", BLOCK_K)):
            if v < (2 if name == "BLOCK_K" else 1) or v & (v - 1):  # FP4 tiles unpack BLOCK_K // 2 bytes
                raise ValueError(f"{name} must be a power of two >= 2, got {v}")
        cpp = max(1, min(int(cfg["CHUNKS_PER_PROG"]), ceil_div(k, BLOCK_K)))
    xv = _data_view(data)
    outv = out.view(torch.int16) if fmt == "bf16" else out
    grid = (ceil_div(m, BLOCK_M), ceil_div(ceil_div(k, BLOCK_K), cpp))
    # ROW_BLOCK: with one scale block a row (npc = K, as per_token_cast_back(x, fmt, K) gives) and one chunk a row, a
    # block as wide as the chunk names the same scale for every column, so the kernel takes its whole-block path (one
    # scale a row, broadcast; the e4m3 prefetch loop) instead of a scale load per element.  Same values, same bits.
    # sm_90 SASS of the 8001 x 7168 program: e4m3 -> bf16 392 instructions and 18 loads -> 120 and 3 (npc = 128's:
    # 136 and 4); e2m1 -> bf16 528 and 17 -> 384 and 2.  H200, 2026-12-02, commit be9d783 (CUPTI with L2 flushed,
    # 8001 x 7168): e4m3 -> bf16 63.63 -> 43.47 us (64 -> 94 % of copy), -> fp32 81.94 -> 72.79; e2m1 -> bf16 90.25
    # -> 74.38, -> fp32 93.35 -> 90.69 (16 of 16 shapes faster, 2.9-34 %).
    row_block = cfg["ROW_BLOCK"] and ceil_div(k, xbk) == 1 and k <= BLOCK_K
    xbk_kernel = BLOCK_K if row_block else xbk
    _cast_back_kernel[grid](
        xv, sf, outv, m, k, ceil_div(k, xbk), xv.stride(0), sf.stride(0), sf.stride(1), outv.stride(0),
        IN_KIND=_IN_KIND[data.dtype], XBM=xbm, XBK=xbk_kernel, XSF_PACKED=sf.dtype == torch.int32, BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K, OUT_BF16=fmt == "bf16", CHUNKS_PER_PROG=cpp, HW_DECODE=bool(cfg["HW_DECODE"]),
        UNROLL=bool(cfg["UNROLL"]), VEC=int(cfg["VEC"]), PREFETCH=bool(cfg["PREFETCH"]),
        num_warps=int(cfg["num_warps"]), **pdl_args(outv.device),
    )
    return out


def _cast_back_fake(data, sf, fmt, xbm, xbk):
    k = data.shape[1] * 2 if data.dtype == torch.int8 else data.shape[1]
    return torch.empty((data.shape[0], k), dtype=torch.bfloat16 if fmt == "bf16" else torch.float32,
                       device=data.device)


@custom_op("cast_back", fake=_cast_back_fake)
def _cast_back_op(data: torch.Tensor, sf: torch.Tensor, fmt: str, xbm: int, xbk: int) -> torch.Tensor:
    """``torch.library`` op ``tritile::cast_back`` (works under torch.compile)."""
    return _cast_back_impl(data, sf, fmt, xbm, xbk)


@planned("per_token_cast_back")
def per_token_cast_back(x: QuantTensor, fmt: str, num_per_channels: int,
                        x_special_fmt: Optional[str] = None) -> torch.Tensor:
    """``cast_back(x, fmt, (1, num_per_channels), x_special_fmt)``: dequantize per-token scaled data.

    Args:
        x: ``(data, sf)`` as in :func:`cast_back` with sf of ``(1, num_per_channels)`` blocks.
        fmt: ``'bf16'`` or ``'fp32'``.  num_per_channels: group width (any positive int, e.g. 32, 128 or K).
        x_special_fmt: None or ``'e5m6'``.

    Returns:
        ``(M, K)`` bfloat16 or float32.
    """
    if not isinstance(num_per_channels, int) or isinstance(num_per_channels, bool):
        raise TypeError(f"num_per_channels must be an int, got {type(num_per_channels).__name__}")
    if num_per_channels < 1:
        raise ValueError(f"num_per_channels must be positive, got {num_per_channels}")
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt)
