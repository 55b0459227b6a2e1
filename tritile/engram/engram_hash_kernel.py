"""``engram_hash``: multiplicative-XOR n-gram hashes, reduced modulo each head's table size, plus offsets."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime as _rt
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_contiguous, check_same_device, check_tensor, checks_enabled, custom_op, empty,
                       override_key, tuned)
from ..utils import ceil_div, next_power_of_two
from ._utils import interp
from tritile.runtime.plan import planned

__all__ = ["engram_hash"]


@triton.jit
def _floor_mod_f64(h, m):
    """Exact ``h floor-mod m`` for int64 ``h`` [BLOCK_T] and int64 ``1 <= m < 2^31`` [E_P2], without the
    software int64 division (about 70 dependent instructions per element on the GPU).

    Two rounds of ``r -= m * floor(r * (1/m))`` in fp64, then one correction each way.  Round 1: fp64(h) and
    1/m are within 2^-52 relative, so ``|q1 - h/m| <= 2^63/m * 2^-50 + 1 <= 2^14`` and ``|r1| < 2^45``: exact in
    fp64 (r1 itself is computed in wrapping int64, exact whatever q1 is, also when the fp64->int64 conversion
    saturates, which only happens for m = 1).  Round 2: ``|r1/m| <= 2^14 + 1`` so ``q2`` is floor(r1/m) or
    off by one, and ``r2`` lies in [-m, 2m): one conditional add and one subtract give the result in [0, m)."""
    inv = 1.0 / m.to(tl.float64)
    mm = m[None, :]
    q = tl.floor(h.to(tl.float64)[:, None] * inv[None, :]).to(tl.int64)
    r = h[:, None] - q * mm
    q = tl.floor(r.to(tl.float64) * inv[None, :]).to(tl.int64)
    r = r - q * mm
    r = tl.where(r < 0, r + mm, r)
    r = tl.where(r >= mm, r - mm, r)
    return r


@triton.jit
def _engram_hash_kernel(
    ids_ptr, mult_ptr, vocab_ptr, off_ptr, out_ptr,
    T,
    s_id0, s_out0,
    N: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    FAST_MOD: tl.constexpr, PDL: tl.constexpr = False
):
    """FAST_MOD: the floor-mod through an fp64 reciprocal (``_floor_mod_f64``), else the int64 ``%``."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # grid axis 0: no 65535 limit
    layer = tl.program_id(1).to(tl.int64)
    tmask = t < T
    j = tl.arange(0, E_P2)
    jmask = j < E
    mask = tmask[:, None] & jmask[None, :]
    C: tl.constexpr = (N - 1) * E
    h = tl.zeros((BLOCK_T,), tl.int64)
    for n in tl.static_range(N):
        tok = tl.load(ids_ptr + t * s_id0 + n, mask=tmask, other=0).to(tl.int64)
        mult = tl.load(mult_ptr + layer * N + n)
        h = h ^ (tok * mult)  # int64 product wraps mod 2^64, as in torch
        if n >= 1:
            col = (n - 1) * E + j
            m = tl.load(vocab_ptr + layer * C + col, mask=jmask, other=1).to(tl.int64)
            bad = m <= 0
            m_safe = tl.where(bad, 1, m)
            if FAST_MOD:
                r = _floor_mod_f64(h, m_safe)
            else:
                r = h[:, None] % m_safe[None, :]  # C-style (truncated) remainder ...
                r = tl.where(r < 0, r + m_safe[None, :], r)  # ... made a floor-mod: r in [0, m)
            off = tl.load(off_ptr + layer * C + col, mask=jmask, other=0)
            res = r.to(tl.int32) + off[None, :]  # int32 add, wraps
            res = tl.where(bad[None, :], -1, res)
            tl.store(out_ptr + layer * s_out0 + t[:, None] * C + col[None, :], res, mask=mask)



def _config(T: int) -> int:
    """BLOCK_T tokens per program (x all heads of one layer)."""
    return min(1024 if interp() else 64, next_power_of_two(T))


def _launch_config(T: int) -> dict:
    """``tuned("engram_hash", ...)``: BLOCK_T, num_warps, FAST_MOD (fp64-reciprocal floor-mod instead of the
    int64 ``%``; exact, see ``_floor_mod_f64``)."""
    # H200 sweep (2026-11-30, T=8001, 2 layers x 3-grams x 8 tables): 32 tokens x 4 warps 2.80 us, 64 x 4 3.17,
    # 64 x 2 (the first default) 3.78 us (CUDA-graph replay)
    block_t = min(_config(T), 1024 if interp() else 32)
    return tuned("engram_hash", dict(BLOCK_T=block_t, WARPS=4, FAST_MOD=True))


@planned("engram_hash")
def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Engram n-gram hash indices into the per-layer concatenated embedding tables.

    For layer l, token t: ``h_n = XOR_{i<=n} int64(ids[t, i]) * multipliers[l, i]`` (int64, wrapping), and
    for n >= 1 and head j: ``out[l, t, (n-1)*E + j] = int32(h_n floor-mod vocab_sizes[l, n-1, j])
    + offsets[l, (n-1)*E + j]`` (int32 add, wrapping).

    Args:
        ngram_token_ids: shape (num_tokens, max_ngram_size), int32; column 0 is the current token,
            column n the token n positions back.  Unit stride along the n-gram axis, any row stride.
        multipliers: shape (num_layers, max_ngram_size), int64, contiguous.
        vocab_sizes: shape (num_layers, max_ngram_size - 1, num_heads), int32, contiguous; every entry must be
            > 0.  On CPU tensors (or with ``TRITILE_CHECKS=1``) a non-positive entry raises ValueError; on a GPU
            without checks (and under torch.compile) it is not inspected (no host sync) and its column comes out
            as -1, an index that embedding lookups reject.
        offsets: shape (num_layers, (max_ngram_size - 1) * num_heads), int32, contiguous, normally
            ``tritile.torch.engram.make_offsets(vocab_sizes)``.

    Returns:
        shape (num_layers, num_tokens, (max_ngram_size - 1) * num_heads), int32, contiguous.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not _fast_ok(ngram_token_ids, multipliers, vocab_sizes, offsets):
        _check(ngram_token_ids, multipliers, vocab_sizes, offsets)
    dev = ngram_token_ids.device
    compiling = torch.compiler.is_compiling()
    if vocab_sizes.numel() and not compiling and (dev.type == "cpu" or checks_enabled()):
        bad = vocab_sizes <= 0
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"vocab_sizes must be > 0 everywhere, got {int(vocab_sizes[idx])} at {idx}")
    if compiling:  # traced as the opaque custom op ``torch.ops.tritile.engram_hash``
        return _engram_hash_op(ngram_token_ids, multipliers, vocab_sizes, offsets)
    return _launch(ngram_token_ids, multipliers, vocab_sizes, offsets)


def _fast_ok(ids, multipliers, vocab_sizes, offsets) -> bool:
    """The checks of ``engram_hash`` hold: types, dtypes, shapes, strides, one kernel device."""
    if not (isinstance(ids, torch.Tensor) and ids.dtype is torch.int32 and ids.dim() == 2
            and isinstance(multipliers, torch.Tensor) and multipliers.dtype is torch.int64 and multipliers.dim() == 2
            and isinstance(vocab_sizes, torch.Tensor) and vocab_sizes.dtype is torch.int32 and vocab_sizes.dim() == 3
            and isinstance(offsets, torch.Tensor) and offsets.dtype is torch.int32 and offsets.dim() == 2):
        return False
    T, N = ids.shape
    L, n_minus_1, E = vocab_sizes.shape
    if not (N >= 1 and n_minus_1 == N - 1 and multipliers.shape[0] == L and multipliers.shape[1] == N
            and offsets.shape[0] == L and offsets.shape[1] == n_minus_1 * E and (N == 1 or ids.stride(1) == 1)
            and multipliers.is_contiguous() and vocab_sizes.is_contiguous() and offsets.is_contiguous()):
        return False
    dev = ids.device
    return (multipliers.device == dev and vocab_sizes.device == dev and offsets.device == dev
            and (dev.type == "cuda" or _rt.kernel_device_ok(dev)))


def _check(ngram_token_ids, multipliers, vocab_sizes, offsets) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("ngram_token_ids", ngram_token_ids, dtypes=(torch.int32,), ndim=2)
    check_tensor("multipliers", multipliers, dtypes=(torch.int64,), ndim=2)
    check_tensor("vocab_sizes", vocab_sizes, dtypes=(torch.int32,), ndim=3)
    check_tensor("offsets", offsets, dtypes=(torch.int32,), ndim=2)
    T, N = ngram_token_ids.shape
    L, n_minus_1, E = vocab_sizes.shape
    if N < 1:
        raise ValueError(f"ngram_token_ids must have at least one column, got shape {tuple(ngram_token_ids.shape)}")
    if tuple(multipliers.shape) != (L, N):
        raise ValueError(f"multipliers must have shape (num_layers, max_ngram_size) = {(L, N)} "
                         f"(from vocab_sizes and ngram_token_ids), got {tuple(multipliers.shape)}")
    if n_minus_1 != N - 1:
        raise ValueError(f"vocab_sizes must have shape (num_layers, max_ngram_size - 1, num_heads) with "
                         f"max_ngram_size - 1 = {N - 1}, got {tuple(vocab_sizes.shape)}")
    C = (N - 1) * E
    if tuple(offsets.shape) != (L, C):
        raise ValueError(f"offsets must have shape {(L, C)}, got {tuple(offsets.shape)}")
    if N > 1 and ngram_token_ids.stride(1) != 1:
        raise ValueError(f"ngram_token_ids must have a unit stride in its last dimension, "
                         f"got strides {tuple(ngram_token_ids.stride())}")
    check_contiguous("multipliers", multipliers)
    check_contiguous("vocab_sizes", vocab_sizes)
    check_contiguous("offsets", offsets)
    check_same_device(ngram_token_ids=ngram_token_ids, multipliers=multipliers, vocab_sizes=vocab_sizes,
                      offsets=offsets)


def _launch(ngram_token_ids, multipliers, vocab_sizes, offsets):
    T, N = ngram_token_ids.shape
    L, _, E = vocab_sizes.shape
    C = (N - 1) * E
    out = empty((L, T, C), torch.int32, ngram_token_ids.device)
    if T == 0 or L == 0 or C == 0:
        return out
    kernel, grid, consts, warps = _plan(T, N, L, E, override_key("engram_hash"))
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally (no keyword dicts); out is contiguous:
    # stride(0) = T * C
    kernel.run(ngram_token_ids, multipliers, vocab_sizes, offsets, out, T, ngram_token_ids.stride(0), T * C, *consts,
               grid=grid, warmup=False, num_warps=warps, **pdl_args(out.device))
    return out


@functools.lru_cache(maxsize=256)
def _plan(T: int, N: int, L: int, E: int, override) -> tuple:
    """(kernel, grid, (N, E, E_P2, BLOCK_T, FAST_MOD), num_warps), cached (the host path is latency-bound);
    ``override``: ``override_key("engram_hash")``, so tuning sweeps see their candidates."""
    cfg = _launch_config(T)
    consts = (N, E, next_power_of_two(E), cfg["BLOCK_T"], bool(cfg["FAST_MOD"]))
    return _engram_hash_kernel, (ceil_div(T, cfg["BLOCK_T"]), L), consts, cfg["WARPS"]


def _hash_fake(ids, multipliers, vocab_sizes, offsets):
    L, n_minus_1, E = vocab_sizes.shape
    return ids.new_empty((L, ids.shape[0], n_minus_1 * E), dtype=torch.int32)


@custom_op("engram_hash", fake=_hash_fake)
def _engram_hash_op(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    return _launch(ngram_token_ids, multipliers, vocab_sizes, offsets)
