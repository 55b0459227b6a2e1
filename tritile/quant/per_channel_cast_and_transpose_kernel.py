"""``per_channel_cast_and_transpose``: e4m3 cast with one scale per (npt rows x 1 column) block whose
codes are written transposed (``tile_kernels.quant.per_channel_cast_and_transpose``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..language.grid import tile_grid, tile_ids
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_choice, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div
from ..runtime.plan import planned
from ._per_channel_common import check_per_channel_x, per_channel_launch_config, per_channel_quant_tile_bf16
from .types import QuantTensor

__all__ = ["per_channel_cast_and_transpose"]


@triton.jit
def _per_channel_cast_and_transpose_kernel(
        x_ptr, out_ptr, sf_ptr, num_rows, hidden, stride_xm, stride_om, stride_sm,
        NPT: tl.constexpr, ROUND_SF: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PACK_WORDS: tl.constexpr,
        FINITE_BRANCH: tl.constexpr, VEC: tl.constexpr = 0, PERM_ROWS: tl.constexpr = 0,
        SIGNED_ENC: tl.constexpr = 0, INT_POW2: tl.constexpr = False, KFAST: tl.constexpr = False,
        PDL: tl.constexpr = False):
    """One ``[BM, BK]`` tile of x per program.  ``PACK_WORDS``: ``out_ptr`` is an int32 view of the
    output (``stride_om`` in words) and four codes of consecutive rows are packed into one
    little-endian word before the transpose, so the tile is transposed as 32-bit elements.

    ``VEC`` (> 0): the column offsets are declared contiguous in runs of ``VEC`` only, so Triton's
    coalescing gives each thread ``VEC`` columns (one 16-byte bf16 load, one 8-byte code store for 8)
    and spreads the threads over more rows: more rows per thread, fewer shuffles in the column max.
    ``PERM_ROWS`` (> 0, with ``BM == NPT`` and ``PACK_WORDS``): logical tile row ``r`` holds token
    ``REPS * (r % PERM_ROWS) + r // PERM_ROWS`` (``REPS = BM // PERM_ROWS``, a multiple of 4).  With
    ``PERM_ROWS`` = the rows one layout repetition covers (threads per warp along rows x warps), each
    thread's REPS row repetitions are REPS consecutive tokens, so the four codes of a word are packed
    inside the thread (no shuffles); the column max does not depend on the row order.
    ``SIGNED_ENC`` (1, or 2 with ``BM == NPT``): the NaN codes' sign merged from the bf16 patterns instead of
    a compare-and-select per element; 2 also unpacks and multiplies inside the same per-four assembly
    (``_per_channel_common.per_channel_encode_signed`` / ``per_channel_encode_bf16``; same bits).
    ``INT_POW2`` (round_sf): power-of-two scales from amax's bits (``per_channel_scale``; same bits).
    ``KFAST``: the grid's first dimension runs over the column blocks (consecutive programs read consecutive column
    blocks of the same rows; without it they write consecutive token blocks of the same output rows)."""
    pdl_enter(PDL)
    pid_m, pid_k = tile_ids(KFAST)
    if PERM_ROWS > 0:
        REPS: tl.constexpr = BM // PERM_ROWS
        tl.static_assert(BM == REPS * PERM_ROWS and REPS % 4 == 0 and BM == NPT and PACK_WORDS)
        r = tl.arange(0, BM)
        rows = pid_m * BM + ((r % PERM_ROWS) * REPS + r // PERM_ROWS)
    else:
        rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    if VEC > 0:
        cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
    row_ok = rows < num_rows
    col_ok = cols < hidden
    bits = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                   other=0)
    codes, sf = per_channel_quant_tile_bf16(bits, NPT, ROUND_SF, FINITE_BRANCH, SIGNED_ENC, INT_POW2)
    # out[k, m] = codes[m, k]: the tile is transposed in registers/shared memory, then stored row-wise
    if PERM_ROWS > 0:
        # logical row (4 * j4 + j) * PERM_ROWS + c = token REPS * c + 4 * j4 + j: byte j of word c * (REPS // 4) + j4
        c4 = tl.reshape(codes.to(tl.int32), (REPS // 4, 4, PERM_ROWS, BK))
        words = tl.sum(c4 << (tl.arange(0, 4) * 8)[None, :, None, None], axis=1)
        if REPS > 4:
            words = tl.reshape(tl.permute(words, (1, 0, 2)), (BM // 4, BK))
        else:
            words = tl.reshape(words, (BM // 4, BK))
        wrows = pid_m * (BM // 4) + tl.arange(0, BM // 4)
        tl.store(out_ptr + cols[:, None] * stride_om + wrows[None, :], tl.trans(words),
                 mask=col_ok[:, None] & (wrows < num_rows // 4)[None, :])
    elif PACK_WORDS:
        # byte j of word w = row 4w + j (num_rows % 4 == 0, so a word is all in or all out)
        c4 = tl.reshape(codes.to(tl.int32), (BM // 4, 4, BK))
        words = tl.sum(c4 << (tl.arange(0, 4) * 8)[None, :, None], axis=1)
        wrows = pid_m * (BM // 4) + tl.arange(0, BM // 4)
        tl.store(out_ptr + cols[:, None] * stride_om + wrows[None, :], tl.trans(words),
                 mask=col_ok[:, None] & (wrows < num_rows // 4)[None, :])
    else:
        tl.store(out_ptr + cols[:, None] * stride_om + rows[None, :], tl.trans(codes),
                 mask=col_ok[:, None] & row_ok[None, :])
    groups = pid_m * (BM // NPT) + tl.arange(0, BM // NPT)
    tl.store(sf_ptr + groups[:, None] * stride_sm + cols[None, :], sf,
             mask=(groups < num_rows // NPT)[:, None] & col_ok[None, :])


def _perm_rows(bm: int, bk: int, warps: int, vec: int, npt: int, words: bool) -> int:
    """``PERM_ROWS`` for a tile: the rows one repetition of the coalesced layout covers (threads per warp
    along rows x warps, each thread ``vec`` columns), when the tile is one scale block made of a
    multiple of four such repetitions; else 0 (rows in order)."""
    if vec <= 0 or not words or bm != npt:
        return 0
    lanes_k = min(32, max(1, bk // vec))
    p = (32 // lanes_k) * warps
    return p if bm % p == 0 and (bm // p) % 4 == 0 else 0


def _launch(x: torch.Tensor, num_per_tokens: int, round_sf: bool, config: Optional[dict] = None):
    """``config`` (tests) and ``tritile.runtime.tuned("per_channel_cast_and_transpose", ...)`` (sweeps):
    ``BLOCK_M`` (a multiple of npt and 4), ``BLOCK_K``, ``num_warps``, ``num_stages``, ``PACK_WORDS``,
    ``FINITE_BRANCH`` (GPU: skip the NaN patch of finite tiles), ``VEC`` (columns per thread, 0 = Triton's
    choice), ``PERM`` (pack the words inside the thread through a row permutation, see the kernel; used
    when the tile is one scale block of 4k layout repetitions), ``maxnreg`` (None: no cap), ``SIGNED_ENC`` (0, 1 or
    2: the encode's NaN patch as a sign merge, see the kernel), ``INT_POW2`` (round_sf scales without a division);
    missing keys come from the default rule."""
    m, k = x.shape
    out = empty((k, m), torch.float8_e4m3fn, x.device)
    sf = empty((m // num_per_tokens, k), torch.float32, x.device)
    if out.numel() == 0:
        return out, sf
    cfg = per_channel_launch_config(m, k, num_per_tokens)
    vec = 0
    if not interpreter_configs():
        # one scale block of rows per tile (a taller tile's grouped reduction compiles to very long code on sm90), 4
        # warps, 8 columns per thread (VEC=8: one 16-byte load per row) and 8 rows per thread, which PERM makes 8
        # consecutive tokens, so the transposed words are packed in registers: [128, 64] for npt 128, [32, 256] for npt
        # 32.  sm90 SASS (npt 128, no loops): 19.6 instructions per element, 95 registers, 20 shuffles, against 31.8, 95
        # and 86 for the former [128, 64] x 8 warps tile without VEC/PERM (121.2 us on the H200, TileKernels 48.6 us). 
        # FINITE_BRANCH would save ~5 more per element but needs 128 registers (tune candidate).  H200 sweep
        # (2026-11-30, 8064 x 7168, CUDA-graph us): 2 warps beat 4 at the same elements per thread, [128, 32] 56.4 us
        # against [128, 64] 60.4 us (npt 128), [32, 128] 57.0 us against [32, 256] x 4 warps 93.4 us (npt 32). Sweep of
        # 2026-11-30 (H200, commit 694bd6c): SIGNED_ENC=2 (the NaN patch as a sign-byte merge) 46.9-47.2 us at npt 32
        # (this tile), and at npt 128 [128, 64] x 4 warps 45.6-46.4 us ([128, 32] x 2 warps: 52.3), against 57.5-59.1 us
        # without (TileKernels 48.6); INT_POW2 0-0.4 us slower here.  KFAST (the grid's first dimension over the column
        # blocks, tritile.language.grid), four sweeps (CUPTI, npt 128): 46.94 / 46.87 / 46.87 / 46.99 us against 47.05 /
        # 47.07 / 47.75 / 47.56, the default there since commit 4d49e57; at npt 32 it lost (49.36 against 48.53).
        if num_per_tokens == 128:
            cfg = cfg._replace(block_m=128, block_k=64, num_warps=4)
        else:
            cfg = cfg._replace(block_m=num_per_tokens, block_k=128, num_warps=2)
        vec = 8
    c = tuned("per_channel_cast_and_transpose",
              {"BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "num_warps": cfg.num_warps, "num_stages": 3,
               "PACK_WORDS": True, "FINITE_BRANCH": False, "VEC": vec, "PERM": True, "maxnreg": None, "SIGNED_ENC": 2,
               "INT_POW2": False, "KFAST": not interpreter_configs() and num_per_tokens == 128,
               **(config or {})})
    bm, bk, warps, words = c["BLOCK_M"], c["BLOCK_K"], c["num_warps"], c["PACK_WORDS"]
    if bm % num_per_tokens != 0:
        raise ValueError(f"config BLOCK_M must be a multiple of num_per_tokens={num_per_tokens}, got {bm}")
    perm = _perm_rows(bm, bk, warps, c["VEC"], num_per_tokens, words) if c["PERM"] else 0
    out_arg = out.view(torch.uint8).view(torch.int32) if words else out.view(torch.uint8)
    grid, kfast = tile_grid(ceil_div(m, bm), ceil_div(k, bk), c["KFAST"])
    extra = {} if c["maxnreg"] is None else {"maxnreg": c["maxnreg"]}
    _per_channel_cast_and_transpose_kernel[grid](
        x.view(torch.int16), out_arg, sf, m, k, x.stride(0), out_arg.stride(0), sf.stride(0),
        NPT=num_per_tokens, ROUND_SF=round_sf, BM=bm, BK=bk, PACK_WORDS=words,
        FINITE_BRANCH=bool(c["FINITE_BRANCH"]), VEC=c["VEC"], PERM_ROWS=perm,
        SIGNED_ENC=int(c["SIGNED_ENC"]) if bm == num_per_tokens else min(int(c["SIGNED_ENC"]), 1),
        INT_POW2=bool(c["INT_POW2"]), KFAST=kfast, num_warps=warps,
        num_stages=c["num_stages"], **extra, **pdl_args(x.device))
    return out, sf


@custom_op("per_channel_cast_and_transpose",
           fake=lambda x, npt, round_sf: (x.new_empty((x.shape[1], x.shape[0]), dtype=torch.float8_e4m3fn),
                                          x.new_empty((x.shape[0] // npt, x.shape[1]), dtype=torch.float32)))
def _per_channel_cast_and_transpose_op(x: torch.Tensor, npt: int, round_sf: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, npt, round_sf)


@planned("per_channel_cast_and_transpose")
def per_channel_cast_and_transpose(x: torch.Tensor, fmt: str, num_per_tokens: int,
                                   round_sf: bool = False) -> QuantTensor:
    """Cast ``x`` to FP8 e4m3 with one scale per (num_per_tokens rows x 1 column) block and return the
    codes transposed.

    Per column ``k`` of each block of ``npt`` rows: ``amax = max |x|``, ``sf = max(amax, 1e-4) / 448``
    (IEEE), ``sf_inv = 448 / max(amax, 1e-4)``, or with ``round_sf`` ``sf = 2^ceil(log2 sf)`` and
    ``sf_inv = 1 / sf``; ``out[k, m] = e4m3(x[m, k] * sf_inv)`` (RNE, saturating).  A block holding
    +-inf or NaN gets ``sf = +inf``, its finite elements ``+-0`` and its non-finite ones NaN
    (``0x7F | sign``), so it dequantizes to NaN.

    Args:
        x: bfloat16 ``(M, K)`` with ``M % 128 == 0`` and ``K % 64 == 0``, unit column stride (rows
            may be strided).
        fmt: must be ``'e4m3'``.
        num_per_tokens: rows per scale block, 32 or 128.
        round_sf: round the scales up to powers of two.

    Returns:
        ``(out, sf)``: float8_e4m3fn ``(K, M)`` contiguous (the transposed codes) and float32
        ``(M / npt, K)`` contiguous (not transposed).  ``M = 0`` gives ``(K, 0)`` and ``(0, K)``
        without a launch.
    """
    check_choice("fmt", fmt, ["e4m3"])
    if isinstance(num_per_tokens, bool) or not isinstance(num_per_tokens, int):
        raise TypeError(f"num_per_tokens must be an int, got {type(num_per_tokens).__name__}")
    check_choice("num_per_tokens", num_per_tokens, [32, 128])
    if not isinstance(round_sf, bool):
        raise TypeError(f"round_sf must be a bool, got {type(round_sf).__name__}")
    m, k = check_per_channel_x(x, (torch.bfloat16,))
    if torch.compiler.is_compiling():  # traced as the opaque op ``torch.ops.tritile.per_channel_cast_and_transpose``
        return _per_channel_cast_and_transpose_op(x, num_per_tokens, round_sf)
    return _launch(x, num_per_tokens, round_sf)
