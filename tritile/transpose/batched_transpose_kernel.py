"""``transpose`` and ``batched_transpose``: exact copies of any dtype into a transposed, contiguous tensor.

Unlike TileKernels (M % 64 == 0, N % 64 == 0, unit inner stride, row stride % 4 == 0), any shape and any
strides are accepted: tails are masked and strides are read from the tensor.  Elements are moved as
unsigned integers of the same width, so every dtype (fp8, bf16, fp32, ints, ...) is copied bit for bit,
under the interpreter too.

1-byte tensors whose rows are 4-byte aligned take a word path: four input rows are transposed 4x4
bytes at a time inside 32-bit words, so both loads and stores move 4-byte (and wider) vectors.

A tune candidate (config ``TMA=True``, off by default) moves whole tiles with tensor descriptors (TMA on
Hopper): see ``_tma_launch`` for what it requires and when it falls back to the pointer kernels.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import get_num_sms
from ..runtime import check_device, check_tensor, custom_op, empty, interpreter_configs, is_interpreter, tuned
from ..utils import ceil_div

_MAX_GRID_Z = 65535
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _batched_transpose_kernel(x_ptr, out_ptr, M, N, stride_xb, stride_xm, stride_xn, stride_ob, stride_on,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                              STREAM: tl.constexpr = False):
    """out[b, n, m] = x[b, m, n] for one [BLOCK_M, BLOCK_N] tile; out is contiguous along m."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    # output pointers are built directly in the transposed orientation: only the data goes through tl.trans
    o_ptrs = out_ptr + b * stride_ob + offs_n[:, None] * stride_on + offs_m[None, :]
    if EVEN:
        if STREAM:  # every byte is touched once: keep it out of L2's way
            tl.store(o_ptrs, tl.trans(tl.load(x_ptrs, eviction_policy="evict_first")), cache_modifier=".cs")
        else:
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
                                   BLOCK_M4: tl.constexpr, BLOCK_N4: tl.constexpr, EVEN: tl.constexpr):
    """1-byte transpose on 32-bit words.  x and out are int32 views: x[b, m, w] holds bytes n = 4w..4w+3 of
    row m; out[b, n, r] holds bytes m = 4r..4r+3 of row n.  A tile covers 4*BLOCK_M4 rows and
    4*BLOCK_N4 columns; M4 = M/4 and N4 = N/4 are word counts."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
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


@triton.jit
def _u8x4_tile_words(x_ptr, t, M4, N4, tiles_n, tiles_mn, stride_xb, stride_xm,
                     BLOCK_M4: tl.constexpr, BLOCK_N4: tl.constexpr, EVEN: tl.constexpr):
    """The [BLOCK_M4, 4, BLOCK_N4] input words of tile ``t`` (tiles ordered batch, then m, then n)."""
    b = (t // tiles_mn).to(tl.int64)
    rem = t % tiles_mn
    r = (rem // tiles_n).to(tl.int64) * BLOCK_M4 + tl.arange(0, BLOCK_M4)
    w = (rem % tiles_n).to(tl.int64) * BLOCK_N4 + tl.arange(0, BLOCK_N4)
    i = tl.arange(0, 4)
    x_ptrs = x_ptr + b * stride_xb + (4 * r[:, None, None] + i[None, :, None]) * stride_xm + w[None, None, :]
    if EVEN:
        return tl.load(x_ptrs)
    else:
        return tl.load(x_ptrs, mask=(r[:, None, None] < M4) & (w[None, None, :] < N4), other=0)


@triton.jit
def _batched_transpose_u8x4_persist_kernel(x_ptr, out_ptr, M4, N4, stride_xb, stride_xm, stride_ob, stride_on,
                                           tiles_n, tiles_mn, num_tiles,
                                           BLOCK_M4: tl.constexpr, BLOCK_N4: tl.constexpr, EVEN: tl.constexpr):
    """The word transpose of ``_batched_transpose_u8x4_kernel`` on a persistent grid: program ``p`` handles
    tiles ``p, p + P, p + 2P, ...`` and loads its next tile before it shuffles and stores the current one
    (two tiles of loads in flight per program, no tail wave)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    words = _u8x4_tile_words(x_ptr, pid, M4, N4, tiles_n, tiles_mn, stride_xb, stride_xm, BLOCK_M4, BLOCK_N4, EVEN)
    t = pid
    while t < num_tiles:  # a while loop: range() over program ids breaks the interpreter (numpy 2.4)
        # prefetch the next tile (the last program re-reads its own tile instead of running past the end)
        nxt = tl.minimum(t + nprog, num_tiles - 1)
        words_next = _u8x4_tile_words(x_ptr, nxt, M4, N4, tiles_n, tiles_mn, stride_xb, stride_xm,
                                      BLOCK_M4, BLOCK_N4, EVEN)
        b = (t // tiles_mn).to(tl.int64)
        rem = t % tiles_mn
        r = (rem // tiles_n).to(tl.int64) * BLOCK_M4 + tl.arange(0, BLOCK_M4)
        w = (rem % tiles_n).to(tl.int64) * BLOCK_N4 + tl.arange(0, BLOCK_N4)
        _u8x4_store_tile(out_ptr, words, b, r, w, M4, N4, stride_ob, stride_on, EVEN)
        words = words_next
        t += nprog


@triton.jit
def _tma_tile_coords(t, tiles_n, tiles_mn):
    """(batch, m-tile, n-tile) of tile ``t``, tiles ordered batch, then m, then n (n fastest: neighbouring
    programs read neighbouring columns of the same input rows).  A ``t`` past the last tile gives a batch
    index past the end, so its TMA load reads zeros and its TMA store writes nothing."""
    return t // tiles_mn, (t % tiles_mn) // tiles_n, t % tiles_n


@triton.jit
def _tma_transpose_tile(x_desc, o_desc, t, tiles_n, tiles_mn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile: TMA load into shared memory, transpose on the way to registers and back,
    TMA store of the [BLOCK_N, BLOCK_M] tile.  Tails need no masks: TMA clips the box at the tensor's edges."""
    b, pm, pn = _tma_tile_coords(t, tiles_n, tiles_mn)
    tile = x_desc.load([b, pm * BLOCK_M, pn * BLOCK_N])  # [1, BLOCK_M, BLOCK_N]
    o_desc.store([b, pn * BLOCK_N, pm * BLOCK_M], tl.permute(tile, (0, 2, 1)))


@triton.jit
def _byte_quad(w0, w1, w2, w3, j: tl.constexpr):
    """The word whose byte i is byte j of ``w_i`` (elementwise on int32 tensors of one layout)."""
    return (((w0 >> (8 * j)) & 0xFF) | (((w1 >> (8 * j)) & 0xFF) << 8) | (((w2 >> (8 * j)) & 0xFF) << 16)
            | (((w3 >> (8 * j)) & 0xFF) << 24))


@triton.jit
def _tma_transpose_words_tile(x_desc, o_desc, t, tiles_n, tiles_mn,
                              BLOCK_M4: tl.constexpr, BLOCK_N4: tl.constexpr):
    """The word transpose of ``_u8x4_store_tile`` with TMA: x_desc views the input as int32 words
    [B, M/4, 4, N/4] (row 4r + i, word w), o_desc views the output as [B, N/4, 4, M/4] (row 4w + j, word r).
    The 4x4 byte transposes are elementwise on the four [BLOCK_M4, BLOCK_N4] word tiles of rows 4r + i (no
    cross-lane reduction); output row 4w + j takes byte j of every word: four TMA stores of whole words (a
    byte tile goes to shared memory one byte per store instruction)."""
    b, pm, pn = _tma_tile_coords(t, tiles_n, tiles_mn)
    r0 = pm * BLOCK_M4
    w0 = pn * BLOCK_N4
    # one TMA load of the [BLOCK_M4, 4, BLOCK_N4] words; i moved last and split off, so that each thread holds
    # the four words of its 4x4 byte blocks (Triton then reads shared memory straight into that layout)
    words = tl.permute(tl.reshape(x_desc.load([b, r0, 0, w0]), [BLOCK_M4, 2, 2, BLOCK_N4]), (0, 3, 1, 2))
    x02, x13 = tl.split(words)  # [BLOCK_M4, BLOCK_N4, 2] (the last axis is i // 2): i = 0, 2 and i = 1, 3
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    for j in tl.static_range(4):
        oj = tl.trans(_byte_quad(x0, x1, x2, x3, j))  # [BLOCK_N4, BLOCK_M4]: output rows 4w + j
        o_desc.store([b, w0, j, r0], tl.reshape(oj, [1, BLOCK_N4, 1, BLOCK_M4]))


@triton.jit
def _tma_transpose_pairs_tile(x_desc, o_desc, t, tiles_n, tiles_mn,
                              BLOCK_M2: tl.constexpr, BLOCK_N: tl.constexpr):
    """1-byte transpose as a 16-bit one: x_desc views the input as bytes [B, M/2, 2, N] (row 2q + i), o_desc
    views the output as int16 [B, N, M/2].  y[q, n] = x[2q, n] | x[2q + 1, n] << 8 is a 16-bit matrix whose
    transpose is the output (bytes 2q, 2q + 1 of output row n); the pairing is elementwise, and the 16-bit
    transpose can go to shared memory through stmatrix (as bf16 tiles do) instead of one byte per store."""
    b, pq, pn = _tma_tile_coords(t, tiles_n, tiles_mn)
    q0 = pq * BLOCK_M2
    n0 = pn * BLOCK_N
    rows = tl.permute(tl.reshape(x_desc.load([b, q0, 0, n0]), [BLOCK_M2, 2, BLOCK_N]), (0, 2, 1))
    lo, hi = tl.split(rows)  # [BLOCK_M2, BLOCK_N] uint8: rows 2q and 2q + 1
    y = lo.to(tl.int16) | (hi.to(tl.int16) << 8)  # zero-extended: bit-exact
    o_desc.store([b, n0, q0], tl.reshape(tl.trans(y), [1, BLOCK_N, BLOCK_M2]))


@triton.jit
def _tma_tile(x_desc, o_desc, t, tiles_n, tiles_mn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              MODE: tl.constexpr):
    if MODE == 1:  # 1-byte words: BLOCK_M, BLOCK_N count words (BLOCK_M4, BLOCK_N4)
        _tma_transpose_words_tile(x_desc, o_desc, t, tiles_n, tiles_mn, BLOCK_M, BLOCK_N)
    elif MODE == 2:  # 1-byte pairs: BLOCK_M counts row pairs
        _tma_transpose_pairs_tile(x_desc, o_desc, t, tiles_n, tiles_mn, BLOCK_M, BLOCK_N)
    else:
        _tma_transpose_tile(x_desc, o_desc, t, tiles_n, tiles_mn, BLOCK_M, BLOCK_N)


@triton.jit
def _batched_transpose_tma_kernel(x_desc, o_desc, tiles_n, tiles_mn, iters,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
                                  PERSIST: tl.constexpr, STAGES: tl.constexpr, ITERS: tl.constexpr):
    """TMA transpose (MODE 0: elements, 1: 1-byte words, 2: 1-byte row pairs).  Without PERSIST, program ``p`` handles tile ``p``.  With PERSIST, program ``p`` handles
    tiles ``p, p + P, ...`` (``iters`` of them; the last ones may lie past the end, which TMA turns into
    no-ops) in a ``tl.range`` loop that Triton's pipeliner turns into a ring of STAGES shared-memory
    buffers: the TMA loads of the next STAGES - 1 tiles are in flight while the current tile is stored.
    ITERS > 0 replaces ``iters`` by a constant trip count: the interpreter cannot loop to a run-time bound
    (numpy >= 2.4), so it gets the same loop with a constexpr bound."""
    pid = tl.program_id(0)
    if PERSIST:
        nprog = tl.num_programs(0)
        if ITERS > 0:  # the interpreter (every assignment there makes a run-time value: use ITERS directly)
            for i in tl.range(0, ITERS, num_stages=STAGES):
                _tma_tile(x_desc, o_desc, pid + i * nprog, tiles_n, tiles_mn, BLOCK_M, BLOCK_N, MODE)
        else:
            for i in tl.range(0, iters, num_stages=STAGES):
                _tma_tile(x_desc, o_desc, pid + i * nprog, tiles_n, tiles_mn, BLOCK_M, BLOCK_N, MODE)
    else:
        _tma_tile(x_desc, o_desc, pid, tiles_n, tiles_mn, BLOCK_M, BLOCK_N, MODE)


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


@functools.lru_cache(maxsize=None)
def _device_has_tma(device: torch.device) -> bool:
    """TMA needs an NVIDIA GPU of compute capability 9.0 or newer; the interpreter emulates it."""
    if device.type != "cuda":
        return device.type == "cpu" and is_interpreter()
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_aligned(t: torch.Tensor, strides) -> bool:
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in strides)


def _tma_launch(x: torch.Tensor, out: torch.Tensor, config: dict) -> bool:
    """Launch the TMA candidate (config ``TMA=True``) and return True, or return False when ``x`` does not
    qualify, so that the caller falls back to the pointer kernels.

    TMA (sm_90+, or the interpreter) needs 16-byte aligned base addresses and 16-byte multiples for every
    stride but the last, which must be 1; its boxes are at most 256 elements per dimension, with an inner
    dimension of at least 16 bytes.  So the path takes an input with ``stride(-1) == 1`` whose row (and,
    for B > 1, batch) stride is a multiple of 16 bytes and whose data pointer is 16-byte aligned, and
    ``M * element_size % 16 == 0`` (the output's row stride).  The 1-byte word variant (``word_path``,
    default on) also needs M % 4 == 0 and N % 4 == 0 (as the pointer word path), the pair variant (``PAIRS``
    with ``word_path=False``) M % 2 == 0 (else the byte variant runs).  8-byte elements, strided
    rows, odd sizes and misaligned views fall back.  Ragged M and N need no masks: TMA clips at the edges.

    Keys: ``BLOCK_M``, ``BLOCK_N`` (elements; ``BLOCK_M4``, ``BLOCK_N4`` in words on the 1-byte word variant),
    ``word_path`` and ``PAIRS`` (1-byte variants: 4x4 byte blocks in words, or row pairs as 16-bit elements),
    ``num_warps``, ``PERSIST`` (programs per SM of a persistent grid, 0 = one program per tile) and
    ``STAGES`` (the persistent loop's pipeline depth: TMA loads in flight per program)."""
    b, m, n = x.shape
    esz = x.element_size()
    if esz > 4 or x.stride(-1) != 1 or not _device_has_tma(x.device):
        return False
    sb = x.stride(0) if b > 1 else m * x.stride(1)  # a single batch's stride is never used
    if not (_tma_aligned(x, (sb, x.stride(1))) and _tma_aligned(out, out.stride()[:2])):
        return False
    words = esz == 1 and config.get("word_path", True) and _u8x4_ok(x)
    pairs = esz == 1 and not words and config.get("PAIRS", False) and m % 2 == 0
    persist = int(config.get("PERSIST", 0))
    if words:
        bm, bn = config.get("BLOCK_M4", 16), config.get("BLOCK_N4", 16)
        tm, tn, esz_in, esz_out = ceil_div(m // 4, bm), ceil_div(n // 4, bn), 4, 4
    elif pairs:  # BLOCK_M rows of x = BLOCK_M // 2 row pairs (16-bit output elements)
        bm, bn = config.get("BLOCK_M", 128) // 2, config.get("BLOCK_N", 128)
        tm, tn, esz_in, esz_out = ceil_div(m // 2, bm), ceil_div(n, bn), 1, 2
    else:
        bm, bn = config.get("BLOCK_M", 128 // esz), config.get("BLOCK_N", 128 // esz)
        tm, tn, esz_in, esz_out = ceil_div(m, bm), ceil_div(n, bn), esz, esz
    if not (bm * esz_out >= 16 and bn * esz_in >= 16 and bm <= 256 and bn <= 256):
        return False  # not a TMA box: a config error of a candidate list, served by the pointer kernels
    if words:
        xw = x.view(torch.uint8).view(torch.int32)  # [B, M, N/4]
        ow = out.view(torch.uint8).view(torch.int32)  # [B, N, M/4]
        sbw, smw = sb // 4, xw.stride(1)
        x_desc = TensorDescriptor(xw, [b, m // 4, 4, n // 4], [sbw, 4 * smw, smw, 1], [1, bm, 4, bn])
        sob, son = ow.stride(0), ow.stride(1)
        o_desc = TensorDescriptor(ow, [b, n // 4, 4, m // 4], [sob, 4 * son, son, 1], [1, bn, 1, bm])
    elif pairs:
        xb = x.view(torch.uint8)
        oh = out.view(torch.uint8).view(torch.int16)  # [B, N, M/2]
        x_desc = TensorDescriptor(xb, [b, m // 2, 2, n], [sb, 2 * xb.stride(1), xb.stride(1), 1], [1, bm, 2, bn])
        o_desc = TensorDescriptor(oh, [b, n, m // 2], [oh.stride(0), oh.stride(1), 1], [1, bn, bm])
    else:
        iv = _INT_VIEW[esz]
        xi, oi = x.view(iv), out.view(iv)
        x_desc = TensorDescriptor(xi, [b, m, n], [sb, xi.stride(1), 1], [1, bm, bn])
        o_desc = TensorDescriptor(oi, [b, n, m], [oi.stride(0), oi.stride(1), 1], [1, bn, bm])
    num_tiles = b * tm * tn
    grid = min(num_tiles, persist * get_num_sms()) if persist else num_tiles
    iters = ceil_div(num_tiles, grid)
    warps = config.get("num_warps", 4)
    _batched_transpose_tma_kernel[(grid,)](
        x_desc, o_desc, tn, tm * tn, iters, BLOCK_M=bm, BLOCK_N=bn, MODE=1 if words else 2 if pairs else 0, PERSIST=bool(persist),
        STAGES=int(config.get("STAGES", 3)), ITERS=iters if (persist and is_interpreter()) else 0, num_warps=warps)
    return True



def _launch(x: torch.Tensor, out: torch.Tensor, config: Optional[dict] = None) -> None:
    b, m, n = x.shape
    if config and config.get("TMA") and _tma_launch(x, out, config):
        return
    if _u8x4_ok(x) and (config is None or config.get("word_path", True)):
        bm4, bn4, warps = (16, 16, 4) if interpreter_configs() else (64, 32, 4)  # H200 sweep: 256x128-byte tiles
        if config:
            bm4, bn4, warps = config.get("BLOCK_M4", bm4), config.get("BLOCK_N4", bn4), config.get("num_warps", warps)
        xw = x.view(torch.uint8).view(torch.int32)
        ow = out.view(torch.uint8).view(torch.int32)
        even = m % (4 * bm4) == 0 and n % (4 * bn4) == 0
        if config and config.get("PERSIST"):  # persistent grid: PERSIST programs per SM
            tiles_n, tiles_m = ceil_div(n // 4, bn4), ceil_div(m // 4, bm4)
            num_tiles = b * tiles_m * tiles_n
            grid = (min(num_tiles, int(config["PERSIST"]) * get_num_sms()),)
            _batched_transpose_u8x4_persist_kernel[grid](
                xw, ow, m // 4, n // 4, xw.stride(0), xw.stride(1), ow.stride(0), ow.stride(1), tiles_n,
                tiles_m * tiles_n, num_tiles, BLOCK_M4=bm4, BLOCK_N4=bn4, EVEN=even, num_warps=warps)
            return
        for b0 in range(0, b, _MAX_GRID_Z):  # the grid's z extent is limited to 65535
            xs, os_ = xw[b0:b0 + _MAX_GRID_Z], ow[b0:b0 + _MAX_GRID_Z]
            grid = (ceil_div(n // 4, bn4), ceil_div(m // 4, bm4), xs.shape[0])
            _batched_transpose_u8x4_kernel[grid](xs, os_, m // 4, n // 4, xs.stride(0), xs.stride(1), os_.stride(0),
                                                 os_.stride(1), BLOCK_M4=bm4, BLOCK_N4=bn4,
                                                 EVEN=even, num_warps=warps)
        return
    bm, bn, warps = _config(x.element_size(), m, n)
    if config:
        bm, bn, warps = config.get("BLOCK_M", bm), config.get("BLOCK_N", bn), config.get("num_warps", warps)
    stream = bool(config.get("STREAM", False)) if config else False
    iv = _INT_VIEW[x.element_size()]
    xi, oi = x.view(iv), out.view(iv)
    for b0 in range(0, b, _MAX_GRID_Z):  # the grid's z extent is limited to 65535
        xs, os_ = xi[b0:b0 + _MAX_GRID_Z], oi[b0:b0 + _MAX_GRID_Z]
        grid = (ceil_div(n, bn), ceil_div(m, bm), xs.shape[0])
        _batched_transpose_kernel[grid](xs, os_, m, n, xs.stride(0), xs.stride(1), xs.stride(2), os_.stride(0),
                                        os_.stride(1), BLOCK_M=bm, BLOCK_N=bn, EVEN=(m % bm == 0 and n % bn == 0),
                                        STREAM=stream, num_warps=warps)


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
    ``BLOCK_M4``, ``BLOCK_N4``, ``num_warps``, ``PERSIST`` (word path on a persistent grid of PERSIST programs
    per SM)."""
    _check(x, 3)
    return _batched_transpose_impl(x, config)
