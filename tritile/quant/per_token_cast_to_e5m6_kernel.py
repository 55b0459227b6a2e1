"""Per-token cast to E5M6 (``tile_kernels.quant.per_token_cast_to_e5m6_kernel``).

E5M6 keeps the top 12 bits of an fp16 pattern (sign, 5-bit exponent, 6-bit mantissa); 8 codes are
packed into 3 little-endian uint32 words (96 bits), returned as ``uint8 (M, K*3/2)``.  One scale per
row (``num_per_channels == K``).

Two kernels: bf16 rows of whole 32-column quads (``K % 32 == 0``, rows readable as int32 words) go through
the quad kernel, in which a thread owns whole quads: 4 x 16-byte loads in, 12 words = 3 x 16-byte stores
out, and on the GPU a whole row of up to 8192 columns stays in registers (one pass).  Other inputs (fp32,
odd strides, other K) take the plain kernel (8 codes -> 3 separate 4-byte stores per thread).  The quad kernel
stores through a layout conversion so that consecutive lanes write consecutive 16-byte pieces (whole 32-byte
sectors per warp store).

Instruction cuts of the quad kernel (same bits; on by default on GPUs, off in the interpreter's configs): ``INT_SF``
(round_sf: the power-of-two scales from the amax bits, no division), ``AMAX16`` (amax by ``max.u16x2`` on the bf16
pair words) and ``PAIR_ENC`` (round_sf: the E5M6 codes of a bf16 pair per ``cvt.rz.f16x2.f32``, rounded on both
halves at once, for tiles whose rows all have ``sf_inv >= 1``); figures in ``_TUNE_E5M6``
(tritile/bench/cases/quant.py).
"""

from __future__ import annotations

import operator
from typing import Tuple

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, f32_to_e5m6_code, quant_scale, sf_to_ue8m0
from ..language.cast import EMULATE
from ..language.cast import round_scale_bits as _round_scale_bits
from ..language.e5m6_fast import e5m6_pair_codes, max_u16x2, pack3_pairs
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_device, check_inner_contiguous, check_tensor, custom_op, empty, interpreter_configs, tuned
from ..utils import ceil_div, next_power_of_two
from .common import FMT_CLAMP, FMT_MAX, alloc_sf, check_sf_flags
from .types import QuantTensor

__all__ = ["per_token_cast_to_e5m6"]

_NAN_CODE = tl.constexpr(0x7E0)  # fp16 0x7E00 (quiet NaN): the code of a NaN ``x * sf_inv``, with x's sign


@triton.jit
def _split8(x):
    """``[R, 8G]`` -> eight ``[R, G]`` tensors ``c0..c7`` with ``c_j[:, g] = x[:, 8g + j]``."""
    R: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    x5 = tl.reshape(x, (R, N // 8, 2, 2, 2))
    e, o = tl.split(x5)  # bit 0 of j
    ee, eo = tl.split(e)  # bit 1
    oe, oo = tl.split(o)
    c0, c4 = tl.split(ee)  # bit 2
    c2, c6 = tl.split(eo)
    c1, c5 = tl.split(oe)
    c3, c7 = tl.split(oo)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    if IS_BF16:
        return bf16_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _e5m6_code_bounded(v):
    """``f32_to_e5m6_code(v)`` for ``|v| < 65536`` or NaN (the NaN codes are replaced by the caller).

    GPUs: the fp16 round-toward-zero step by the hardware conversion (``F2FP.F16.F32.PACK_AB.RZ``, two values per
    instruction) instead of ~15 integer ops; the interpreter (EMULATE) runs the integer ``f32_to_e5m6_code``.  The
    two agree on every float32 below 65536 in magnitude (fp16 subnormals and signed zeros included; they differ
    only at |v| >= 65536, where the software path gives inf and the hardware saturates to 65504).  Here
    ``|v| = |x * sf_inv| <= 65024 * (1 + 2^-24)^2`` (sf_inv = div_rn(65024, a), |x| <= a) or, with
    round_sf, ``<= a / (a/65024 * (1 - 2^-24))``; both are < 65536, and a row holding inf/NaN has
    ``sf_inv = 0`` (products 0 or NaN)."""
    if EMULATE:
        return f32_to_e5m6_code(v)
    else:
        # t = fp16 RTZ bits >> 4; t + 1 where (t & 1) + r > 0x10000, as a carry: (r + 0xFFFF + (t & 1)) >> 17
        # (r <= 0x1FFFF); no overflow past 12 bits for |v| < 65536 (t <= 0xFBF)
        # zero-extended fp16 bits: t = h >> 4 < 0x1000 needs no mask
        t = v.to(tl.float16, fp_downcast_rounding="rtz").to(tl.uint16, bitcast=True).to(tl.int32) >> 4
        r = v.to(tl.int32, bitcast=True) & 0x1FFFF
        return t + ((r + 0xFFFF + (t & 1)) >> 17)


@triton.jit
def _e5m6_codes(x, sf_inv):
    """E5M6 codes (int32) of ``x * sf_inv``; a NaN product gives ``0x7E0 | sign(x) << 11``.

    On GPUs a tile whose rows all have ``sf_inv > 0`` (no inf/NaN in them, so no NaN product) skips the NaN
    patch (a uniform branch)."""
    v = x * sf_inv
    code = _e5m6_code_bounded(v)
    if not EMULATE:
        if tl.min(sf_inv) > 0.0:
            res = code
        else:
            res = tl.where(v != v, _NAN_CODE | ((x.to(tl.int32, bitcast=True) >> 20) & 0x800), code)
    else:
        xsign = (x.to(tl.int32, bitcast=True) >> 20) & 0x800
        res = tl.where(v != v, _NAN_CODE | xsign, code)
    return res


@triton.jit
def _encode_store(x, sf_inv, o_row, row_ok, c, K, BLOCK_K: tl.constexpr):
    """Encode chunk ``c`` (``[BLOCK_M, BLOCK_K]`` float32) and store its 3 words per 8 columns."""
    codes = _e5m6_codes(x, sf_inv[:, None])
    c0, c1, c2, c3, c4, c5, c6, c7 = _split8(codes)
    w0 = (c0 << 20) | (c1 << 8) | (c2 >> 4)
    w1 = ((c2 & 0xF) << 28) | (c3 << 16) | (c4 << 4) | (c5 >> 8)
    w2 = ((c5 & 0xFF) << 24) | (c6 << 12) | c7
    g = c * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    wmask = row_ok[:, None] & (g[None, :] < K // 8)
    wp = o_row + 3 * g[None, :]
    tl.store(wp, w0, mask=wmask)
    tl.store(wp + 1, w1, mask=wmask)
    tl.store(wp + 2, w2, mask=wmask)


@triton.jit
def _per_token_cast_to_e5m6_kernel(
    x_ptr, out_ptr, sf_ptr,
    M, K,
    stride_xm, stride_om, stride_sfm,
    IS_BF16: tl.constexpr, ROUND_SF: tl.constexpr, PACKED: tl.constexpr,
    CLAMP: tl.constexpr, MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K_CHUNKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Rows ``[pid*BLOCK_M, +BLOCK_M)``; the row is covered by NUM_K_CHUNKS chunks of BLOCK_K columns.

    NUM_K_CHUNKS == 1: one pass (the whole row stays in registers).  Otherwise two passes: amax over
    the chunks, then quantize, re-reading x (from L2).  out is addressed as int32 words (3 per 8 columns).
    """
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + rows[:, None] * stride_xm
    o_row = out_ptr + rows[:, None] * stride_om

    if NUM_K_CHUNKS == 1:
        x = _load_f32(x_row + cols[None, :], row_ok[:, None] & (cols[None, :] < K), IS_BF16)
        amax = tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1)
    else:
        amax = tl.zeros((BLOCK_M,), tl.float32)
        for c in range(NUM_K_CHUNKS):
            kk = c * BLOCK_K + cols
            xc = _load_f32(x_row + kk[None, :], row_ok[:, None] & (kk[None, :] < K), IS_BF16)
            amax = tl.maximum(amax, tl.max(tl.where(xc == xc, tl.abs(xc), float("inf")), axis=1))

    sf, sf_inv = quant_scale(amax, CLAMP, MAX, ROUND_SF)
    if PACKED:
        # Ks = 1: one int32 word per row, byte 0 = UE8M0, bytes 1..3 = 0
        tl.store(sf_ptr + rows * stride_sfm, sf_to_ue8m0(sf), mask=row_ok)
    else:
        tl.store(sf_ptr + rows * stride_sfm, sf, mask=row_ok)

    if NUM_K_CHUNKS == 1:
        _encode_store(x, sf_inv, o_row, row_ok, 0, K, BLOCK_K)
    else:
        for c in range(NUM_K_CHUNKS):
            kk = c * BLOCK_K + cols
            xc = _load_f32(x_row + kk[None, :], row_ok[:, None] & (kk[None, :] < K), IS_BF16)
            _encode_store(xc, sf_inv, o_row, row_ok, c, K, BLOCK_K)


@triton.jit
def _pack3(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight 12-bit codes -> the 3 words of their group."""
    w0 = (c0 << 20) | (c1 << 8) | (c2 >> 4)
    w1 = ((c2 & 0xF) << 28) | (c3 << 16) | (c4 << 4) | (c5 >> 8)
    w2 = ((c5 & 0xFF) << 24) | (c6 << 12) | c7
    return w0, w1, w2


@triton.jit
def _stack4(a, b, c, d):
    """Four ``[R, Q]`` tensors -> ``[R, Q, 4]`` (``a, b, c, d`` along the last axis, in-thread)."""
    R: tl.constexpr = a.shape[0]
    Q: tl.constexpr = a.shape[1]
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (R, Q, 4))


@triton.jit
def _split4(w):
    """``[R, Q, 4]`` -> its four ``[R, Q]`` slices along the last axis."""
    R: tl.constexpr = w.shape[0]
    Q: tl.constexpr = w.shape[1]
    e, o = tl.split(tl.reshape(w, (R, Q, 2, 2)))  # e = words 0, 2; o = words 1, 3
    w0, w2 = tl.split(e)
    w1, w3 = tl.split(o)
    return w0, w1, w2, w3


@triton.jit
def _load_group(xw_row, q, qm, gi: tl.constexpr):
    """Group ``gi`` (8 bf16 = 4 int32 words, one 16-byte load) of every quad ``q``: ``[R, Q, 4]`` words."""
    wd = tl.arange(0, 4)
    return tl.load(xw_row + (16 * q + 4 * gi)[None, :, None] + wd[None, None, :], mask=qm[:, :, None], other=0)


@triton.jit
def _load_quads(xw_row, q, qm, AMAX16: tl.constexpr):
    """The four groups (``[R, Q, 4]`` words each) of every quad ``q`` and the tile's ``max |x|`` per row."""
    g0 = _load_group(xw_row, q, qm, 0)
    g1 = _load_group(xw_row, q, qm, 1)
    g2 = _load_group(xw_row, q, qm, 2)
    g3 = _load_group(xw_row, q, qm, 3)
    if AMAX16:
        return g0, g1, g2, g3, _absmax_quads16(g0, g1, g2, g3)
    else:
        return g0, g1, g2, g3, _absmax_quads(g0, g1, g2, g3)


@triton.jit
def _absmax_quads16(g0, g1, g2, g3):
    """:func:`_absmax_quads` (same bits) with both bf16 halves of a word in one unsigned 16x2 max (``AMAX16``):
    a mask and a ``VIMNMX.U16x2`` per word instead of two of each, then one 32-bit max of the two halves."""
    c = 0x7FFF7FFF
    m = max_u16x2(max_u16x2(g0 & c, g1 & c), max_u16x2(g2 & c, g3 & c))
    m = tl.reduce(m, 2, _max_u16x2_combine)
    m = tl.reduce(m, 1, _max_u16x2_combine)
    return tl.minimum(tl.maximum(m << 16, m & 0x7FFF0000), 0x7F800000)


@triton.jit
def _max_u16x2_combine(a, b):
    return max_u16x2(a, b)


@triton.jit
def _absmax_quads(g0, g1, g2, g3):
    """Per row ``max |x|`` over the bf16 pairs of four ``[R, Q, 4]`` int32 word tiles, as float32 bits with
    NaN as +inf (an integer max of the 15-bit magnitudes, which order like the values, NaN above inf);
    elementwise first, then one reduction."""
    lo = tl.maximum(tl.maximum(g0 & 0x7FFF, g1 & 0x7FFF), tl.maximum(g2 & 0x7FFF, g3 & 0x7FFF))
    hi = tl.maximum(tl.maximum(g0 & 0x7FFF0000, g1 & 0x7FFF0000), tl.maximum(g2 & 0x7FFF0000, g3 & 0x7FFF0000))
    m = tl.max(tl.max(tl.maximum(lo << 16, hi), axis=2), axis=1)
    return tl.minimum(m, 0x7F800000)


@triton.jit
def _encode_group(w, sf_inv, FINITE: tl.constexpr):
    """The 3 output words (each ``[R, Q]``) of group ``w`` (``[R, Q, 4]`` words of bf16 pairs).  FINITE: every
    row has ``sf_inv > 0`` (no NaN product, no NaN patch needed)."""
    a0, a1, a2, a3 = _split4(w)
    s = sf_inv[:, None]
    c0 = _quad_code((a0 << 16).to(tl.float32, bitcast=True), s, FINITE)
    c1 = _quad_code((a0 & -65536).to(tl.float32, bitcast=True), s, FINITE)
    c2 = _quad_code((a1 << 16).to(tl.float32, bitcast=True), s, FINITE)
    c3 = _quad_code((a1 & -65536).to(tl.float32, bitcast=True), s, FINITE)
    c4 = _quad_code((a2 << 16).to(tl.float32, bitcast=True), s, FINITE)
    c5 = _quad_code((a2 & -65536).to(tl.float32, bitcast=True), s, FINITE)
    c6 = _quad_code((a3 << 16).to(tl.float32, bitcast=True), s, FINITE)
    c7 = _quad_code((a3 & -65536).to(tl.float32, bitcast=True), s, FINITE)
    return _pack3(c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def _encode_group_pairs(w, sf_inv):
    """:func:`_encode_group` for a row whose ``sf_inv`` is ``2^k``, ``k >= 0`` (round_sf, finite amax <= 65024):
    a word of bf16 pairs at a time (``PAIR_ENC``, see tritile/language/e5m6_fast.py)."""
    a0, a1, a2, a3 = _split4(w)
    s = sf_inv[:, None]
    return pack3_pairs(e5m6_pair_codes(a0, s), e5m6_pair_codes(a1, s), e5m6_pair_codes(a2, s),
                       e5m6_pair_codes(a3, s))


@triton.jit
def _quad_code(x, sf_inv, FINITE: tl.constexpr):
    v = x * sf_inv
    code = _e5m6_code_bounded(v)
    if not FINITE:
        code = tl.where(v != v, _NAN_CODE | ((x.to(tl.int32, bitcast=True) >> 20) & 0x800), code)
    return code


@triton.jit
def _encode_store_quads(g0, g1, g2, g3, sf_inv, o_row, q, qm, FINITE: tl.constexpr, PAIRS: tl.constexpr = False):
    """Encode quads (4 groups = 32 values -> 12 words = 48 bytes) and store them as lane-contiguous 16-byte pieces.
    PAIRS: :func:`_encode_group_pairs` (rows with power-of-two ``sf_inv >= 1`` only)."""
    if PAIRS:
        u0, u1, u2 = _encode_group_pairs(g0, sf_inv)
        u3, u4, u5 = _encode_group_pairs(g1, sf_inv)
        u6, u7, u8 = _encode_group_pairs(g2, sf_inv)
        u9, u10, u11 = _encode_group_pairs(g3, sf_inv)
    else:
        u0, u1, u2 = _encode_group(g0, sf_inv, FINITE)
        u3, u4, u5 = _encode_group(g1, sf_inv, FINITE)
        u6, u7, u8 = _encode_group(g2, sf_inv, FINITE)
        u9, u10, u11 = _encode_group(g3, sf_inv, FINITE)
    s0 = _stack4(u0, u1, u2, u3)
    s1 = _stack4(u4, u5, u6, u7)
    s2 = _stack4(u8, u9, u10, u11)
    # One [R, Q, 16] store: a quad's 12 words plus 4 padding words (masked off), so that the pointers are
    # contiguous over 16 words and the store layout puts 4 consecutive lanes on a quad's 16-byte pieces
    # (3 of 4 lanes active): each warp store writes 12 whole 32-byte sectors, where quad-per-lane stores write
    # half of each of 32 sectors (two partial writes per sector: 58.4 us against 55.6 at 8001 x 7168, H200).  The
    # compiler reaches that layout through shared memory (a layout conversion, in rounds of the 2 KB scratch buffer).
    R: tl.constexpr = s0.shape[0]
    Q: tl.constexpr = s0.shape[1]
    t = tl.join(tl.join(s0, s2), tl.join(s1, s0))  # [R, Q, 4 words, 2, 2]: piece 2 * i + j (3 = padding)
    t = tl.reshape(tl.permute(t, (0, 1, 3, 4, 2)), (R, Q, 16))
    j = tl.arange(0, 16)
    tl.store(o_row + (12 * q)[None, :, None] + j[None, None, :], t, mask=qm[:, :, None] & (j < 12)[None, None, :])


@triton.jit
def _encode_store_chunk(g0, g1, g2, g3, sf_inv, o_row, q, qm, PAIR_ENC: tl.constexpr):
    """Tiles whose rows are all finite (``sf_inv > 0``, the common case) skip the NaN patch: one uniform
    branch around the whole chunk (so the compiler keeps it a branch, not per-element selects).  PAIR_ENC
    (round_sf only): tiles whose rows all have ``sf_inv >= 1`` (finite amax <= 65024) take the pair encoder,
    the others the general (NaN-patched) one."""
    if PAIR_ENC:
        if tl.min(sf_inv) >= 1.0:
            _encode_store_quads(g0, g1, g2, g3, sf_inv, o_row, q, qm, True, True)
        else:
            _encode_store_quads(g0, g1, g2, g3, sf_inv, o_row, q, qm, False)
    elif tl.min(sf_inv) > 0.0:
        _encode_store_quads(g0, g1, g2, g3, sf_inv, o_row, q, qm, True)
    else:
        _encode_store_quads(g0, g1, g2, g3, sf_inv, o_row, q, qm, False)


@triton.jit
def _per_token_cast_to_e5m6_quad_kernel(
    xw_ptr, out_ptr, sf_ptr,
    M, K,
    stride_xw, stride_oq, stride_sfm,
    ROUND_SF: tl.constexpr, PACKED: tl.constexpr, CLAMP: tl.constexpr, MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_K_CHUNKS: tl.constexpr,
    INT_SF: tl.constexpr = False, PAIR_ENC: tl.constexpr = False,
    AMAX16: tl.constexpr = False, PDL: tl.constexpr = False
):
    """bf16 input read as int32 words (bf16 pairs), ``K % 32 == 0``.  Each thread owns whole quads of 32
    columns: 4 x 16-byte loads in (one per group of 8), 12 words = 3 x 16-byte stores out, so every global
    access is a full 16-byte vector.  Tile ``[BLOCK_M rows, BLOCK_Q quads]``; NUM_K_CHUNKS == 1: one pass
    (the row stays in registers), else two passes (amax, then encode re-reading x from L2)."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < M
    qs = tl.arange(0, BLOCK_Q)
    xw_row = (xw_ptr + rows * stride_xw)[:, None, None]
    # the output row stride is passed in quads (12 words): rows start 16-byte aligned for any K, so the
    # compiler can prove the 16-byte stores (an int32 stride argument is only known divisible by 16 or not)
    o_row = (out_ptr + rows * stride_oq * 12)[:, None, None]
    nq = K // 32

    if NUM_K_CHUNKS == 1:
        qm = row_ok[:, None] & (qs < nq)[None, :]
        g0, g1, g2, g3, ab = _load_quads(xw_row, qs, qm, AMAX16)
    else:
        ab = tl.zeros((BLOCK_M,), tl.int32)
        for c in range(NUM_K_CHUNKS):
            q = c * BLOCK_Q + qs
            qm = row_ok[:, None] & (q < nq)[None, :]
            ab = tl.maximum(ab, _load_quads(xw_row, q, qm, AMAX16)[4])

    if ROUND_SF and INT_SF:
        sf, sf_inv = _round_scale_bits(ab, CLAMP, MAX)
    else:
        sf, sf_inv = quant_scale(ab.to(tl.float32, bitcast=True), CLAMP, MAX, ROUND_SF)
    if PACKED:
        tl.store(sf_ptr + rows * stride_sfm, sf_to_ue8m0(sf), mask=row_ok)
    else:
        tl.store(sf_ptr + rows * stride_sfm, sf, mask=row_ok)

    if NUM_K_CHUNKS == 1:
        _encode_store_chunk(g0, g1, g2, g3, sf_inv, o_row, qs, qm, ROUND_SF and PAIR_ENC)
    else:
        for c in range(NUM_K_CHUNKS):
            q = c * BLOCK_Q + qs
            qm = row_ok[:, None] & (q < nq)[None, :]
            g0, g1, g2, g3, _ = _load_quads(xw_row, q, qm, False)
            _encode_store_chunk(g0, g1, g2, g3, sf_inv, o_row, q, qm, ROUND_SF and PAIR_ENC)


def _launch_config(num_tokens: int, hidden: int, block_k=None):
    """(BLOCK_M, BLOCK_K, NUM_K_CHUNKS, num_warps): a whole row per pass up to 8192 columns."""
    interp = interpreter_configs()
    if block_k is None:
        kp = max(next_power_of_two(hidden), 8)
        # H200 sweep (8001 x 7168): 2048-wide chunks (two passes over a row), 2 warps: 77.8 us; the whole row
        # in one 8192-wide tile with 8 warps: 114 us
        block_k = (kp if kp <= 16384 else 4096) if interp else min(kp, 2048)
    chunks = -(-hidden // block_k)
    if interp:
        block_m = max(1, min(128, 65536 // block_k))
        return block_m, block_k, chunks, 4
    block_m = max(1, 2048 // block_k)  # at least 2048 columns of work per program
    num_warps = 2 if block_m * block_k <= 2048 else 4
    return block_m, block_k, chunks, num_warps


def _quad_launch_config(num_tokens: int, hidden: int):
    """(BLOCK_M, BLOCK_Q, num_warps) of the quad kernel: a whole row (up to 256 quads = 8192 columns) per
    pass, one quad (32 columns) per thread, at most 8 warps."""
    nq = hidden // 32
    if interpreter_configs():
        bq = min(next_power_of_two(nq), 512)
        return max(1, min(128, 2048 // bq)), bq, 4
    # H200 sweep (2026-11-30, 8001 x 7168): 256 quads x 4 warps (two quads per thread) 58.4-59.2 us, against
    # 61.4-62.1 us with 8 warps (one per thread) and 78 us for the plain kernel
    bq = min(next_power_of_two(nq), 256)
    block_m = max(1, 256 // bq)
    return block_m, bq, max(1, min(4, block_m * bq // 32))


#: the launch-config keys of ``tuned("per_token_cast_to_e5m6", ...)`` (both kernels' together)
_CONFIG_KEYS = frozenset({"QUAD", "BLOCK_M", "BLOCK_Q", "BLOCK_K", "num_warps", "INT_SF", "PAIR_ENC",
                          "AMAX16"})


def _per_token_cast_to_e5m6_launch(x, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, block_k=None,
                                   block_q=None):
    """``block_k`` forces the plain kernel with that block, ``block_q`` the quad kernel's (tests)."""
    num_tokens, hidden = x.shape
    out = empty((num_tokens, hidden // 8 * 3), torch.int32, x.device)
    sf = alloc_sf(num_tokens, hidden, (1, hidden), use_tma_aligned_col_major_sf, use_packed_ue8m0, x.device)
    if num_tokens == 0:
        return out.view(torch.uint8), sf
    # tritile.runtime.tuned("per_token_cast_to_e5m6", ...): QUAD (the quad kernel; bf16 rows of whole quads
    # only, elsewhere ignored), BLOCK_M rows, num_warps; QUAD: BLOCK_Q quads
    # of 32 columns per pass (a wider row takes two passes), INT_SF / AMAX16 / PAIR_ENC (instruction cuts, same bits; INT_SF and PAIR_ENC act with
    # round_sf only: _round_scale_bits, _absmax_quads16, _encode_group_pairs); plain: BLOCK_K columns (a power of
    # two >= 8).
    # Only the overridden keys are taken; the rest come from the chosen kernel's own rule.
    over = tuned("per_token_cast_to_e5m6", {})
    unknown = sorted(set(over) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"per_token_cast_to_e5m6 launch config: unknown keys {unknown}, expected some of "
                         f"{sorted(_CONFIG_KEYS)}")
    quad_ok = (x.dtype == torch.bfloat16 and hidden % 32 == 0 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
               and block_k is None)
    if quad_ok and bool(over.get("QUAD", True)):
        block_m, bq, num_warps = _quad_launch_config(num_tokens, hidden)
        if block_q is not None:
            bq = block_q
        # The lane-contiguous stores: sweep of 2026-11-30 (H200, commit 694bd6c; 8001 x 7168, CUPTI, L2 flushed)
        # 55.6-56.0 us against 58.4-58.5 us for quad-per-lane stores.  The three instruction cuts (GPU default since commit 65d4724; the interpreter keeps the plain
        # path, which the forced-config tests compare them with): 49.8-49.9 us against 55.9 in the sweep of 2026-11-30
        # (commit 65d4724), both sf layouts
        fast = not interpreter_configs()
        c = {"BLOCK_M": block_m, "BLOCK_Q": bq, "num_warps": num_warps,
             "INT_SF": fast, "PAIR_ENC": fast, "AMAX16": fast, **over}
        block_m, bq, num_warps = c["BLOCK_M"], c["BLOCK_Q"], c["num_warps"]
        if bq < 1 or bq & (bq - 1) or block_m < 1 or block_m & (block_m - 1):
            raise ValueError(f"bad per_token_cast_to_e5m6 launch config {c}: BLOCK_M and BLOCK_Q powers of two")
        xw = torch.as_strided(x.view(torch.int16), (num_tokens, hidden), (x.stride(0), 1)).view(torch.int32)
        _per_token_cast_to_e5m6_quad_kernel[(ceil_div(num_tokens, block_m),)](
            xw, out, sf,
            num_tokens, hidden,
            xw.stride(0), out.stride(0) // 12, sf.stride(0),
            ROUND_SF=round_sf, PACKED=use_packed_ue8m0, CLAMP=FMT_CLAMP["e5m6"], MAX=FMT_MAX["e5m6"],
            BLOCK_M=block_m, BLOCK_Q=bq, NUM_K_CHUNKS=-(-(hidden // 32) // bq),
            INT_SF=bool(c["INT_SF"]), PAIR_ENC=bool(c["PAIR_ENC"]),
            AMAX16=bool(c["AMAX16"]), num_warps=num_warps, **pdl_args(out.device),
        )
        return out.view(torch.uint8), sf
    block_m, block_k, _, num_warps = _launch_config(num_tokens, hidden, block_k)
    c = {"BLOCK_M": block_m, "BLOCK_K": block_k, "num_warps": num_warps, **over}
    block_m, block_k, num_warps = c["BLOCK_M"], c["BLOCK_K"], c["num_warps"]
    if block_k < 8 or block_k & (block_k - 1) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"bad per_token_cast_to_e5m6 launch config {c}: powers of two, BLOCK_K >= 8")
    chunks = -(-hidden // block_k)
    grid = (ceil_div(num_tokens, block_m),)
    is_bf16 = x.dtype == torch.bfloat16
    _per_token_cast_to_e5m6_kernel[grid](
        x.view(torch.int16) if is_bf16 else x, out, sf,
        num_tokens, hidden,
        x.stride(0), out.stride(0), sf.stride(0),
        IS_BF16=is_bf16, ROUND_SF=round_sf, PACKED=use_packed_ue8m0,
        CLAMP=FMT_CLAMP["e5m6"], MAX=FMT_MAX["e5m6"],
        BLOCK_M=block_m, BLOCK_K=block_k, NUM_K_CHUNKS=chunks,
        num_warps=num_warps, **pdl_args(out.device),
    )
    return out.view(torch.uint8), sf


def _e5m6_fake(x, col_major, round_sf, packed):
    num_tokens, hidden = x.shape
    return (x.new_empty((num_tokens, hidden // 8 * 12), dtype=torch.uint8),
            alloc_sf(num_tokens, hidden, (1, hidden), col_major, packed, x.device))


@custom_op("per_token_cast_to_e5m6", fake=_e5m6_fake)
def _per_token_cast_to_e5m6_op(x: torch.Tensor, col_major: bool, round_sf: bool,
                               packed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::per_token_cast_to_e5m6`` (validated arguments)."""
    return _per_token_cast_to_e5m6_launch(x, col_major, round_sf, packed)


def per_token_cast_to_e5m6(x: torch.Tensor, num_per_channels: int, use_tma_aligned_col_major_sf: bool = False,
                           round_sf: bool = False, use_packed_ue8m0: bool = False) -> QuantTensor:
    """Cast ``x`` to E5M6 (12-bit truncated fp16) with one scale per token.

    Per row: ``amax = max |x|``, ``a = max(amax, 1e-4)``, ``sf = a / 65024`` (IEEE division; with
    ``round_sf`` rounded up to a power of two, ``sf_inv = 1/sf``; else ``sf_inv = 65024 / a``), then each
    ``v = f32(x * sf_inv)`` is encoded as TileKernels does: fp16 bits rounded toward zero, shifted right by
    4, then rounded to nearest even on the float32 mantissa.  8 codes ``c0..c7`` are packed into 3
    little-endian uint32 words: ``w0 = c0<<20 | c1<<8 | c2>>4``, ``w1 = (c2&0xF)<<28 | c3<<16 | c4<<4 |
    c5>>8``, ``w2 = (c5&0xFF)<<24 | c6<<12 | c7``.

    Non-finite input: NaN counts as +inf in amax; a row holding +-inf/NaN gets ``sf = +inf`` (UE8M0 byte
    0xFF) and ``sf_inv = 0``: its finite elements encode as +-0, its non-finite ones as the E5M6 NaN
    ``0x7E0 | sign << 11``, so the row dequantizes to NaN.

    Args:
        x: ``(M, K)`` bfloat16 or float32; rows may be strided (``x.stride(1) == 1``); ``K % 8 == 0``.
        num_per_channels: must equal ``K`` (one scale per row).
        use_tma_aligned_col_major_sf: sf in the TMA-aligned column-major layout (strides ``(1, A4(M))``).
        round_sf: round scales up to powers of two.
        use_packed_ue8m0: packed UE8M0 sf (requires the two flags above).

    Returns:
        ``(out, sf)``: ``out`` uint8 ``(M, K*3/2)``; ``sf`` float32 ``(M, 1)`` (row-major, or strides
        ``(1, A4(M))`` when column-major), or int32 ``(M, 1)`` with strides ``(1, A4(M))`` when packed (byte 0
        of each word is the UE8M0 exponent, bytes 1..3 are zero).
    """
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float32), ndim=2)
    check_device("x", x)
    check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    num_tokens, hidden = x.shape
    if isinstance(num_per_channels, bool):
        raise TypeError("num_per_channels must be an int, got bool")
    try:
        num_per_channels = operator.index(num_per_channels)
    except TypeError:
        raise TypeError(f"num_per_channels must be an int, got {type(num_per_channels).__name__}") from None
    if num_per_channels != hidden:
        raise ValueError(f"num_per_channels must equal the hidden size K={hidden} for E5M6, got {num_per_channels}")
    if hidden % 8 != 0 or hidden == 0:
        raise ValueError(f"x must have a positive number of columns divisible by 8 for E5M6, got K={hidden}")
    check_inner_contiguous("x", x)
    return _per_token_cast_to_e5m6_op(x, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
