"""Shared pieces of the per-channel e4m3 casts (scale blocks of ``NPT`` rows x 1 column).

Used by ``per_channel_cast_fused_kernel`` (and its wrapper ``per_channel_cast_kernel``),
``per_channel_cast_and_transpose_kernel`` and the SwiGLU per-channel cast.  A kernel loads a
float32 tile ``x [BM, BK]`` (``BM`` rows, a multiple of ``NPT``; ``BK`` columns), with every element
outside the tensor (rows past M, columns past K, padding rows) loaded as ``0``, then calls
:func:`per_channel_quant_tile`, which returns the e4m3 codes of the tile and the scales of its
``BM // NPT`` row groups::

    codes, sf = per_channel_quant_tile(x, NPT, ROUND_SF)    # uint8 [BM, BK], float32 [BM // NPT, BK]
    tl.store(out_u8 + ..., codes, mask=...)                 # or tl.trans(codes) for a transposed output
    tl.store(sf_ptr + ..., sf, mask=...)

Semantics (``spec/quant.md`` §2.2, e4m3, CLAMP 1e-4, MAX 448), per column ``k`` of each group::

    amax   = max |x[:, k]|              (NaN counts as +inf; zero padding never raises it)
    sf, sf_inv = quant_scale(amax, 1e-4, 448, ROUND_SF)
    code   = e4m3(f32(x * sf_inv))       (RNE, saturating; one multiply, no FMA)

A column group holding +-inf or NaN gets ``sf = +inf`` and ``sf_inv = 0``: finite elements encode
as +-0, non-finite ones as NaN (``0x7F | sign(x)``; the sign is taken from ``x``, not from the NaN
product, whose sign differs between backends), so the group dequantizes to NaN, loudly.

GPU note (measured with ptxas for sm90): a tile with several row groups (``BM > NPT``) compiles its
grouped reduction into very long code that spills; on GPUs use ``BM == NPT`` tiles (or stream one
group in row chunks with :func:`column_amax` / :func:`per_channel_scale` / :func:`per_channel_encode`).
A ``[NPT, BK]`` tile with about 64 elements per thread needs ~95 registers and no spills.

The host helper :func:`per_channel_launch_config` is the deterministic launch rule shared by the
per-channel kernels (bigger tiles under the interpreter).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, exp2_int, f32_to_e4m3_bits, quant_scale
from ..language.cast import EMULATE, f32_to_e4m3_bits_sw

try:  # the same bits as f32_to_e4m3_bits for every non-NaN input, without the clamp on the GPU
    from ..language.cast import f32_to_e4m3_bits_satfinite as _e4m3_no_nan
except ImportError:  # pragma: no cover - older tritile.language
    _e4m3_no_nan = f32_to_e4m3_bits
from ..runtime import check_device, check_inner_contiguous, check_tensor, interpreter_configs
from ..utils import next_power_of_two

__all__ = ["E4M3_MAX", "E4M3_CLAMP", "column_amax", "column_amax_bf16", "per_channel_scale", "per_channel_encode",
           "per_channel_encode_signed", "per_channel_encode_bf16", "all_finite", "per_channel_quant_tile", "per_channel_quant_tile_bf16", "TileConfig", "per_channel_launch_config"]

#: e4m3 largest finite value and amax clamp (spec §2.2).
E4M3_MAX = tl.constexpr(448.0)
E4M3_CLAMP = tl.constexpr(1e-4)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def column_amax(x, NPT: tl.constexpr):
    """Max |x| per column over each group of ``NPT`` rows: ``[BM, BK] -> [BM // NPT, BK]`` (float32).

    NaN counts as +inf (``tl.maximum`` would otherwise drop or keep it depending on the backend).
    GPU: a NaN-propagating max (``max.NaN.f32``, one ``FMNMX.NAN |a|, |b|`` per element) whose NaN
    result is mapped to +inf per column; interpreter (whose custom-combine reduce is a Python loop):
    NaN mapped to +inf per element, then ``tl.max``.  Same value on both."""
    BM: tl.constexpr = x.shape[0]
    BK: tl.constexpr = x.shape[1]
    if EMULATE:
        ax = tl.where(x == x, tl.abs(x), float("inf"))
        if NPT == BM:
            m = tl.reshape(tl.max(ax, axis=0), (1, BK))
        else:
            m = tl.max(tl.reshape(ax, (BM // NPT, NPT, BK)), axis=1)
    else:
        ax = tl.abs(x)
        if NPT == BM:
            m = tl.reshape(tl.reduce(ax, 0, _max_keep_nan), (1, BK))
        else:
            m = tl.reduce(tl.reshape(ax, (BM // NPT, NPT, BK)), 1, _max_keep_nan)
        m = tl.where(m == m, m, float("inf"))
    return m


@triton.jit
def column_amax_bf16(bits, NPT: tl.constexpr):
    """:func:`column_amax` of ``bf16_bits_to_f32(bits)``, computed on the int16 bf16 patterns ``bits``
    ``[BM, BK]``: ``max(bits & 0x7FFF)`` (non-negative patterns order like their values; NaN patterns
    sort above inf and are clamped to it), then widened to float32.  On the GPU the mask and the max
    work on two packed halves per instruction (``LOP3`` + ``VIMNMX.U16x2``), against an unpack, an
    ``abs`` and an ``FMNMX`` per element in float32."""
    BM: tl.constexpr = bits.shape[0]
    BK: tl.constexpr = bits.shape[1]
    a = bits & 0x7FFF
    if NPT == BM:  # (keep_dims: a reshape of the int16 row here made Triton hold the whole tile per thread)
        m = tl.max(a, axis=0, keep_dims=True)
    else:
        m = tl.max(tl.reshape(a, (BM // NPT, NPT, BK)), axis=1)
    return (tl.minimum(m.to(tl.int32), 0x7F80) << 16).to(tl.float32, bitcast=True)


@triton.jit
def per_channel_scale(amax, ROUND_SF: tl.constexpr, INT_POW2: tl.constexpr = False):
    """``(sf, sf_inv)`` of e4m3 blocks from their float32 ``amax`` (any shape, never NaN; spec §2.2).

    ``INT_POW2`` (with ROUND_SF): the power-of-two scale from ``a = max(amax, 1e-4)``'s bits, without the
    division: ``2^ceil(log2(div_rn(a, 448)))`` = ``2^(E - 8 + (mantissa(a) > 0.75))`` for ``a = m 2^E``.
    Why exact: rounding is monotone and powers of two are floats, so the two differ only if ``a / 448``
    lay within half an ulp above a power of two ``2^k``, i.e. ``a`` within ``2^-24`` (relative) above
    ``1.75 2^(k+8)``, where the next float is ``2^-23 / 1.75`` away.  Checked on every float32 mantissa at
    three exponents, every bf16 value and 20M random floats (tests/quant/test_per_channel_cast_signed_enc.py
    checks it under the interpreter).  ``a = inf`` gives ``sf = inf``, ``sf_inv = 0`` as before."""
    if ROUND_SF and INT_POW2:
        b = tl.maximum(amax, E4M3_CLAMP).to(tl.int32, bitcast=True)
        e = (b >> 23) - 135 + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(b >= 0x7F800000, 128, e)
        return exp2_int(e), tl.where(e >= 128, 0.0, exp2_int(-e))
    else:
        return quant_scale(amax, E4M3_CLAMP, E4M3_MAX, ROUND_SF)


@triton.jit
def per_channel_encode(x, sf_inv, NPT: tl.constexpr, ALL_FINITE: tl.constexpr = False):
    """e4m3 codes (uint8 ``[BM, BK]``) of ``x [BM, BK]`` scaled by ``sf_inv [BM // NPT, BK]`` (row group
    ``g`` scales rows ``g*NPT .. g*NPT+NPT-1``); a NaN product takes x's sign.

    ``ALL_FINITE``: the caller has checked that every ``sf_inv > 0`` (no group holds inf/NaN, so no
    product is NaN) and the NaN patch (~4 instructions per element) is left out."""
    BM: tl.constexpr = x.shape[0]
    BK: tl.constexpr = x.shape[1]
    if NPT >= BM:
        v = x * sf_inv  # [1, BK] broadcasts over the rows
    else:
        v = tl.reshape(tl.reshape(x, (BM // NPT, NPT, BK)) * tl.reshape(sf_inv, (BM // NPT, 1, BK)), (BM, BK))
    # NaN products are patched below (or cannot occur), so the conversion need not handle NaN: on the GPU
    # a bare cvt.rn.satfinite (no clamp), bit-identical to f32_to_e4m3_bits for every other input
    if ALL_FINITE:
        codes = _e4m3_no_nan(v)
    else:
        # a NaN product takes x's sign (backends disagree on the sign of inf*0 and of NaN*y)
        nan_code = (((x.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
        codes = tl.where(v != v, nan_code, _e4m3_no_nan(v))
    return codes


# Four e4m3 codes per 32-bit word: two ``cvt.rn.satfinite.e4m3x2.f32`` (the first source lands in the high
# byte), then the sign bytes of the four x (byte 3 of each float32) gathered by three ``prmt`` and merged
# over the codes' low 7 bits by one ``lop3`` (0xE4: ``(a & c) | (b & ~c)`` with c = 0x7F7F7F7F).
# $0: the codes (byte i = element i); $1..$4: v = x * sf_inv; $5..$8: x.
_ENC4_SIGNED = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 c, s0, s1; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 c, {lo, hi}; "
    "prmt.b32 s0, $5, $6, 0x0073; prmt.b32 s1, $7, $8, 0x7300; prmt.b32 s0, s0, s1, 0x7610; "
    "lop3.b32 $0, c, s0, 0x7F7F7F7F, 0xE4; }")
# The same with the signs taken from x's bf16 patterns ($5: elements 0-1, $6: elements 2-3, element 0 in the
# low half): one prmt gathers their high bytes, and the patterns are the loaded words themselves (no
# float32 copy of x is kept alive for the sign).
_ENC4_SIGNED_BF16 = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 c, s0; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 c, {lo, hi}; "
    "prmt.b32 s0, $5, $6, 0x7531; lop3.b32 $0, c, s0, 0x7F7F7F7F, 0xE4; }")
# The whole encode of four bf16 elements: unpack ($5/$6: the loaded words), multiply by sf_inv ($1..$4),
# convert, merge the signs.  The float32 x never exists outside (ptxas otherwise hoists the unpacks and
# holds a float32 copy of the tile: ~140 registers instead of ~80).
_ENC4_BF16 = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 x0, x1, x2, x3, c, s0; "
    "shl.b32 x0, $5, 16; and.b32 x1, $5, 0xFFFF0000; shl.b32 x2, $6, 16; and.b32 x3, $6, 0xFFFF0000; "
    "mul.rn.f32 x0, x0, $1; mul.rn.f32 x1, x1, $2; mul.rn.f32 x2, x2, $3; mul.rn.f32 x3, x3, $4; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, x1, x0; cvt.rn.satfinite.e4m3x2.f32 hi, x3, x2; mov.b32 c, {lo, hi}; "
    "prmt.b32 s0, $5, $6, 0x7531; lop3.b32 $0, c, s0, 0x7F7F7F7F, 0xE4; }")


@triton.jit
def per_channel_encode_signed(x, sf_inv, NPT: tl.constexpr, sign_src):
    """:func:`per_channel_encode` (``ALL_FINITE=False``) with the NaN patch folded into the sign: the same
    bits for every ``x`` when every ``sf_inv >= +0`` (never NaN), as :func:`per_channel_scale` gives.

    Why it is exact: with ``sf_inv >= +0`` the product ``v = x * sf_inv`` is NaN only where the reference
    wants ``0x7F | sign(x)``, and otherwise has x's sign (IEEE: a zero product too), which the e4m3
    conversion keeps; so ``code = (e4m3(v) & 0x7F) | sign(x)`` everywhere, NaN ``v`` included (its
    conversion gives 0x7F or 0xFF).  GPU: per four elements two paired conversions, three byte
    permutes and one ``lop3`` (~1.5 instructions per element besides the multiply, against ~5 for the
    compare-and-select patch and the byte unpacking it forces).

    ``sign_src``: ``x`` itself (float32), or for a bf16 ``x`` its int16 patterns (one permute per four
    codes, and the raw loaded words serve)."""
    BM: tl.constexpr = x.shape[0]
    BK: tl.constexpr = x.shape[1]
    if NPT >= BM:
        v = x * sf_inv
    else:
        v = tl.reshape(tl.reshape(x, (BM // NPT, NPT, BK)) * tl.reshape(sf_inv, (BM // NPT, 1, BK)), (BM, BK))
    BF16_SIGN: tl.constexpr = sign_src.dtype.primitive_bitwidth == 16
    if EMULATE:
        if BF16_SIGN:
            sign = (sign_src.to(tl.int32) >> 8) & 0x80
        else:
            sign = (sign_src.to(tl.int32, bitcast=True) >> 24) & 0x80
        return ((f32_to_e4m3_bits_sw(v).to(tl.int32) & 0x7F) | sign).to(tl.uint8)
    else:
        if BF16_SIGN:
            return tl.inline_asm_elementwise(_ENC4_SIGNED_BF16, "=r,f,f,f,f,r,r", [v, sign_src], dtype=tl.uint8,
                                             is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_ENC4_SIGNED, "=r,f,f,f,f,f,f,f,f", [v, sign_src], dtype=tl.uint8,
                                             is_pure=True, pack=4)


@triton.jit
def per_channel_encode_bf16(bits, sf_inv, NPT: tl.constexpr):
    """:func:`per_channel_encode_signed` of ``x = bf16_bits_to_f32(bits)`` (int16 patterns ``[BM, BK]``,
    ``NPT >= BM``: ``sf_inv [1, BK]``), with the unpack and the multiply inside the per-four assembly
    (``v = f32(x * sf_inv)``, one IEEE multiply, as before).  Same bits, ~3 instructions per element."""
    BM: tl.constexpr = bits.shape[0]
    BK: tl.constexpr = bits.shape[1]
    tl.static_assert(NPT >= BM)
    if EMULATE:
        return per_channel_encode_signed(bf16_bits_to_f32(bits), sf_inv, NPT, bits)
    else:
        return tl.inline_asm_elementwise(_ENC4_BF16, "=r,f,f,f,f,r,r", [tl.broadcast_to(sf_inv, (BM, BK)), bits],
                                         dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def all_finite(sf_inv):
    """Scalar: every scale of the tile is finite (``sf_inv > 0``), so ``per_channel_encode(...,
    ALL_FINITE=True)`` is exact.  Always False under the interpreter / software casts (one code path)."""
    if EMULATE:
        return tl.min(sf_inv) < 0.0  # never: sf_inv >= 0
    else:
        return tl.min(sf_inv) > 0.0


@triton.jit
def per_channel_quant_tile(x, NPT: tl.constexpr, ROUND_SF: tl.constexpr, FINITE_BRANCH: tl.constexpr = False,
                           SIGNED_ENC: tl.constexpr = False, INT_POW2: tl.constexpr = False):
    """e4m3 per-channel cast of a float32 tile ``x [BM, BK]`` with scale blocks of ``NPT x 1``.

    ``BM`` must be a multiple of ``NPT``; elements outside the tensor must be 0 in ``x``.
    Returns ``(codes, sf)``: uint8 e4m3 codes ``[BM, BK]`` and float32 dequant scales
    ``[BM // NPT, BK]`` (row ``g`` = rows ``g*NPT .. g*NPT+NPT-1`` of the tile).
    ``FINITE_BRANCH``: a uniform branch drops the NaN patch when the whole tile is finite (GPU only;
    fewer instructions, more registers).  ``SIGNED_ENC``: :func:`per_channel_encode_signed` (same bits,
    fewer instructions; FINITE_BRANCH is then moot and ignored).

    A tile taller than a few dozen rows holds many registers; kernels may instead stream a block in
    row chunks: ``amax = max(column_amax(chunk, CHUNK))`` over the chunks, then
    ``per_channel_scale(amax)``, then ``per_channel_encode(chunk, sf_inv, CHUNK)`` per chunk (a second
    read of the block, from L2)."""
    return _quant_with_amax(x, column_amax(x, NPT), NPT, ROUND_SF, FINITE_BRANCH, SIGNED_ENC, x, INT_POW2)


@triton.jit
def per_channel_quant_tile_bf16(bits, NPT: tl.constexpr, ROUND_SF: tl.constexpr,
                                FINITE_BRANCH: tl.constexpr = False, SIGNED_ENC: tl.constexpr = 0,
                                INT_POW2: tl.constexpr = False):
    """:func:`per_channel_quant_tile` of ``bf16_bits_to_f32(bits)`` for int16 bf16 patterns ``bits``
    (0 outside the tensor), with the column max taken on the patterns (:func:`column_amax_bf16`).
    ``SIGNED_ENC``: 1 = :func:`per_channel_encode_signed` (signs from ``bits``), 2 (``NPT >= BM``) =
    :func:`per_channel_encode_bf16`; same bits as 0.  ``INT_POW2``: see :func:`per_channel_scale`."""
    if SIGNED_ENC == 2:
        sf, sf_inv = per_channel_scale(column_amax_bf16(bits, NPT), ROUND_SF, INT_POW2)
        return per_channel_encode_bf16(bits, sf_inv, NPT), sf
    return _quant_with_amax(bf16_bits_to_f32(bits), column_amax_bf16(bits, NPT), NPT, ROUND_SF, FINITE_BRANCH,
                            SIGNED_ENC, bits, INT_POW2)


@triton.jit
def _quant_with_amax(x, amax, NPT: tl.constexpr, ROUND_SF: tl.constexpr, FINITE_BRANCH: tl.constexpr,
                     SIGNED_ENC: tl.constexpr = False, sign_src=None, INT_POW2: tl.constexpr = False):
    sf, sf_inv = per_channel_scale(amax, ROUND_SF, INT_POW2)
    if SIGNED_ENC:
        codes = per_channel_encode_signed(x, sf_inv, NPT, sign_src)
    elif FINITE_BRANCH:
        if all_finite(sf_inv):
            codes = per_channel_encode(x, sf_inv, NPT, True)
        else:
            codes = per_channel_encode(x, sf_inv, NPT, False)
    else:
        codes = per_channel_encode(x, sf_inv, NPT, False)
    return codes, sf


class TileConfig(NamedTuple):
    block_m: int
    block_k: int
    num_warps: int
    rows_per_step: int


def per_channel_launch_config(num_rows: int, hidden: int, npt: int, *, k_multiple: int = 1) -> TileConfig:
    """Tile ``[block_m, block_k]``, warps and rows per step for a per-channel cast of ``(num_rows, hidden)``.

    ``block_m`` is a multiple of ``npt``; ``block_k`` a power of two and a multiple of ``k_multiple``
    (128 when a tile must hold whole 128-column input-scale groups).  ``rows_per_step`` < ``block_m``
    asks a kernel that supports it to stream the block in row chunks (two passes, few registers).
    GPU (see the kernels' ``config`` hooks): ``[128, 128]`` blocks streamed in 16-row steps by 4 warps
    (sm90 SASS analysis in ``per_channel_cast_fused_kernel._launch``).  Interpreter: one block as wide
    as the row (up to 1024 columns), one pass, so a grid has few programs.
    """
    bm = max(128, npt)
    if interpreter_configs():
        bk = min(max(next_power_of_two(hidden), 16), 1024)
        return TileConfig(bm, max(bk, k_multiple), 4, bm)
    bk = max(128, k_multiple)
    return TileConfig(bm, bk, 4, 16)


def check_per_channel_x(x, dtypes) -> tuple:
    """The per-channel casts' checks of ``x``: a 2-D tensor of ``dtypes`` on a supported device, unit column stride,
    rows a multiple of 128 and columns a multiple of 64 (ValueError / TypeError naming ``x``).  Returns ``(M, K)``."""
    check_tensor("x", x, dtypes=dtypes, ndim=2)
    check_inner_contiguous("x", x)
    check_device("x", x)
    m, k = x.shape
    if m % 128 != 0:
        raise ValueError(f"x must have a multiple of 128 rows, got {m}")
    if k % 64 != 0:
        raise ValueError(f"x must have a multiple of 64 columns, got {k}")
    return m, k
