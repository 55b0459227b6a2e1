"""``transpose`` and ``batched_transpose``: exact copies of any dtype into a transposed, contiguous tensor.

Unlike TileKernels (M % 64 == 0, N % 64 == 0, unit inner stride, row stride % 4 == 0), any shape and any
strides are accepted: tails are masked and strides are read from the tensor.  Elements are moved as
unsigned integers of the same width, so every dtype (fp8, bf16, fp32, ints, ...) is copied bit for bit,
under the interpreter too.

1-byte tensors whose rows are 4-byte aligned take a word path: four input rows are transposed 4x4
bytes at a time inside 32-bit words, so both loads and stores move 4-byte (and wider) vectors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language.grid import tile_grid, tile_ids
from ..language.pdl import pdl_enter, use_pdl
from ..runtime import check_device, check_tensor, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div
from tritile.runtime.plan import planned

__all__ = ["transpose", "batched_transpose", "batched_transpose_with_config"]

_MAX_GRID_Z = 65535
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: the launch-config keys ``batched_transpose_with_config`` and ``tuned("transpose", ...)`` overrides take
_CONFIG_KEYS = frozenset({"word_path", "BLOCK_M", "BLOCK_N", "BLOCK_M4", "BLOCK_N4", "num_warps", "PDL", "MFAST"})


@triton.jit
def _tile_prologue(PDL: tl.constexpr, MFAST: tl.constexpr):
    """``(n block, m block, batch)`` of this program (int32, int32, int64), after PDL's wait."""
    pdl_enter(PDL)
    pid_n, pid_m = tile_ids(MFAST, False)
    return pid_n, pid_m, tl.program_id(2).to(tl.int64)


@triton.jit
def _batched_transpose_kernel(x_ptr, out_ptr, M, N, stride_xb, stride_xm, stride_xn, stride_ob, stride_on,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                              PDL: tl.constexpr = False, MFAST: tl.constexpr = False):
    """out[b, n, m] = x[b, m, n] for one [BLOCK_M, BLOCK_N] tile; out is contiguous along m.  The grid's first
    dimension walks the n blocks (``MFAST``: the m blocks, see ``tritile.language.grid``)."""
    pid_n, pid_m, b = _tile_prologue(PDL, MFAST)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    # output pointers are built directly in the transposed orientation: only the data goes through tl.trans
    o_ptrs = out_ptr + b * stride_ob + offs_n[:, None] * stride_on + offs_m[None, :]
    if EVEN:
        tl.store(o_ptrs, tl.trans(tl.load(x_ptrs)))
    else:
        tile = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        tl.store(o_ptrs, tl.trans(tile), mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))


@triton.jit
def _u8x4_store_tile(out_ptr, words, b, r, w, M4, N4, stride_ob, stride_on, EVEN: tl.constexpr):
    """Store the transpose of a [BLOCK_M4, 4, BLOCK_N4] tile of input words (rows 4r + i, words w): byte j of
    each word, from row i, lands in byte i of output word (n = 4w + j, r)."""
    shifts = (8 * tl.arange(0, 4))[None, :, None]
    o0 = tl.trans(tl.sum(((words >> 0) & 0xFF) << shifts, axis=1))  # [BN4, BM4]
    o1 = tl.trans(tl.sum(((words >> 8) & 0xFF) << shifts, axis=1))
    o2 = tl.trans(tl.sum(((words >> 16) & 0xFF) << shifts, axis=1))
    o3 = tl.trans(tl.sum(((words >> 24) & 0xFF) << shifts, axis=1))
    o_ptrs = out_ptr + b * stride_ob + (4 * w[:, None]) * stride_on + r[None, :]
    if EVEN:
        tl.store(o_ptrs, o0)
        tl.store(o_ptrs + stride_on, o1)
        tl.store(o_ptrs + 2 * stride_on, o2)
        tl.store(o_ptrs + 3 * stride_on, o3)
    else:
        omask = (w[:, None] < N4) & (r[None, :] < M4)
        tl.store(o_ptrs, o0, mask=omask)
        tl.store(o_ptrs + stride_on, o1, mask=omask)
        tl.store(o_ptrs + 2 * stride_on, o2, mask=omask)
        tl.store(o_ptrs + 3 * stride_on, o3, mask=omask)


@triton.jit
def _batched_transpose_u8x4_kernel(x_ptr, out_ptr, M4, N4, stride_xb, stride_xm, stride_ob, stride_on,
                                   BLOCK_M4: tl.constexpr, BLOCK_N4: tl.constexpr, EVEN: tl.constexpr,
                                   PDL: tl.constexpr = False, MFAST: tl.constexpr = False):
    """1-byte transpose on 32-bit words.  x and out are int32 views: x[b, m, w] holds bytes n = 4w..4w+3 of
    row m; out[b, n, r] holds bytes m = 4r..4r+3 of row n.  A tile covers 4*BLOCK_M4 rows and
    4*BLOCK_N4 columns; M4 = M/4 and N4 = N/4 are word counts.  The grid's first dimension walks the n blocks
    (``MFAST``: the m blocks)."""
    pid_n, pid_m, b = _tile_prologue(PDL, MFAST)
    r = pid_m.to(tl.int64) * BLOCK_M4 + tl.arange(0, BLOCK_M4)  # word index along m of the output
    w = pid_n.to(tl.int64) * BLOCK_N4 + tl.arange(0, BLOCK_N4)  # word index along n of the input
    i = tl.arange(0, 4)
    # input rows m = 4r + i : [BLOCK_M4, 4, BLOCK_N4] words
    rows = 4 * r[:, None, None] + i[None, :, None]
    x_ptrs = x_ptr + b * stride_xb + rows * stride_xm + w[None, None, :]
    if EVEN:
        words = tl.load(x_ptrs)
    else:
        words = tl.load(x_ptrs, mask=(r[:, None, None] < M4) & (w[None, None, :] < N4), other=0)
    _u8x4_store_tile(out_ptr, words, b, r, w, M4, N4, stride_ob, stride_on, EVEN)


def _config(elem_size: int, m: int, n: int) -> Tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the generic kernel, by element size (measured on an H200)."""
    if interpreter_configs():
        return 64, 64, 4
    if elem_size >= 4:
        return 64, 64, 8
    if elem_size == 2:
        return 128, 128, 8
    return 64, 128, 4


def _u8x4_ok(x: torch.Tensor) -> bool:
    m, n = x.shape[-2], x.shape[-1]
    return (x.element_size() == 1 and m % 4 == 0 and n % 4 == 0 and x.stride(-1) == 1
            and x.stride(-2) % 4 == 0 and x.stride(0) % 4 == 0 and x.data_ptr() % 4 == 0)


def _launch(x: torch.Tensor, out: torch.Tensor, config: Optional[dict] = None) -> None:
    b, m, n = x.shape
    unknown = sorted(set(config or {}) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"transpose launch config: unknown keys {unknown}, expected some of {sorted(_CONFIG_KEYS)}")
    pdl = use_pdl(x.device) and bool((config or {}).get("PDL", True))  # PDL: on where supported (sm_90+)
    pdl_kw = dict(launch_pdl=True) if pdl else {}
    # Grid order (tritile.language.grid): MFAST, the m blocks first (the default of the word path and of 2- and 4-byte
    # elements since commit 4d49e57: the programs running together write whole output rows' runs).  Two H200 sweeps (CUPTI, 32 x 8064 x 7168 batches): fp32 3542.7 / 3537.0 us
    # against 3647.1 / 3628.8, bf16 1766.6 against 1804.3, fp8 (with 128 x 256-byte tiles) 901.3 against 941.9; one 8064
    # x 7168 matrix: bf16 64.51 / 57.84 against 65.41 / 58.57, fp8 30.81 / 30.62 against 30.90 / 30.77.
    word = _u8x4_ok(x) and (config is None or config.get("word_path", True))
    mfast = bool((config or {}).get("MFAST", word or x.element_size() in (2, 4)))
    if word:
        # H200 sweeps: 128 x 256-byte tiles (H200, 2026-12-01, commit 4d49e57, with MFAST; before, 256 x 128 for batches
        # and 128 x 128 for one matrix)
        bm4, bn4, warps = (16, 16, 4) if interpreter_configs() else (32, 64, 4)
        if config:
            bm4, bn4, warps = config.get("BLOCK_M4", bm4), config.get("BLOCK_N4", bn4), config.get("num_warps", warps)
        xw = x.view(torch.uint8).view(torch.int32)
        ow = out.view(torch.uint8).view(torch.int32)
        even = m % (4 * bm4) == 0 and n % (4 * bn4) == 0
        for b0 in range(0, b, _MAX_GRID_Z):  # the grid's z extent is limited to 65535
            xs, os_ = xw[b0:b0 + _MAX_GRID_Z], ow[b0:b0 + _MAX_GRID_Z]
            grid, mfast = tile_grid(ceil_div(n // 4, bn4), ceil_div(m // 4, bm4), mfast)
            _batched_transpose_u8x4_kernel[grid + (xs.shape[0],)](
                xs, os_, m // 4, n // 4, xs.stride(0), xs.stride(1), os_.stride(0), os_.stride(1), BLOCK_M4=bm4,
                BLOCK_N4=bn4, EVEN=even, PDL=pdl, MFAST=mfast, num_warps=warps,
                **pdl_kw)
        return
    bm, bn, warps = _config(x.element_size(), m, n)
    if config:
        bm, bn, warps = config.get("BLOCK_M", bm), config.get("BLOCK_N", bn), config.get("num_warps", warps)
    iv = _INT_VIEW[x.element_size()]
    xi, oi = x.view(iv), out.view(iv)
    for b0 in range(0, b, _MAX_GRID_Z):  # the grid's z extent is limited to 65535
        xs, os_ = xi[b0:b0 + _MAX_GRID_Z], oi[b0:b0 + _MAX_GRID_Z]
        grid, mfast = tile_grid(ceil_div(n, bn), ceil_div(m, bm), mfast)
        _batched_transpose_kernel[grid + (xs.shape[0],)](
            xs, os_, m, n, xs.stride(0), xs.stride(1), xs.stride(2), os_.stride(0), os_.stride(1), BLOCK_M=bm,
            BLOCK_N=bn, EVEN=(m % bm == 0 and n % bn == 0), PDL=pdl, MFAST=mfast,
            num_warps=warps, **pdl_kw)


def _check(x, ndim: int) -> None:
    check_tensor("x", x, ndim=ndim)
    if x.element_size() not in _INT_VIEW:
        raise TypeError(f"x must have 1-, 2-, 4- or 8-byte elements, got {x.dtype}")
    check_device("x", x)


def _batched_transpose_impl(x: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    b, m, n = x.shape
    out = empty((b, n, m), x.dtype, x.device)
    if out.numel() > 0:
        _launch(x, out, tuned("transpose", config or {}))
    return out


@custom_op("batched_transpose", fake=lambda x: x.new_empty((x.shape[0], x.shape[2], x.shape[1])))
def _batched_transpose_op(x: torch.Tensor) -> torch.Tensor:
    return _batched_transpose_impl(x)


@planned("batched_transpose")
def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose each matrix of a batch: ``out[b] = x[b].T``, as a new contiguous tensor.

    Args:
        x: ``(B, M, N)`` tensor of any dtype with 1/2/4/8-byte elements (fp8, bf16, fp32, ints, ...) and
            any strides (TileKernels requires M, N multiples of 64 and a unit inner stride; tritile does not).

    Returns:
        ``(B, N, M)`` contiguous tensor of ``x.dtype``, a bit-exact copy.  Empty when B, M or N is 0.
    """
    _check(x, 3)
    if torch.compiler.is_compiling():  # traced as the opaque custom op ``torch.ops.tritile.batched_transpose``
        return _batched_transpose_op(x)
    return _batched_transpose_impl(x)


@planned("transpose")
def transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose a matrix: ``x.T.contiguous()``.

    Args:
        x: ``(M, N)`` tensor of any dtype with 1/2/4/8-byte elements and any strides (e.g. a row-strided view).

    Returns:
        ``(N, M)`` contiguous tensor of ``x.dtype``, a bit-exact copy.  Empty when M or N is 0.
    """
    _check(x, 2)
    return batched_transpose(x.unsqueeze(0)).squeeze(0)


def batched_transpose_with_config(x: torch.Tensor, config: dict) -> torch.Tensor:
    """``batched_transpose`` with launch overrides (tests and tuning): ``word_path``, ``BLOCK_M``, ``BLOCK_N``,
    ``BLOCK_M4``, ``BLOCK_N4``, ``num_warps``, ``PDL``, ``MFAST`` (the grid's first dimension over the m blocks);
    another key raises a ValueError."""
    _check(x, 3)
    return _batched_transpose_impl(x, config)
