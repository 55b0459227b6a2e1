"""Lossless FP4 (e2m1) -> FP8 (e4m3) re-quantization (``tile_kernels.quant.per_block_cast_lossless_kernel``).

Exponent arithmetic only; no value is rounded when the input satisfies the precondition below.

* ``e_in(b)``: the biased exponent of input block ``b``'s scale (``bits(sf) >> 23`` for float32 scales, whose
  sign and mantissa are ignored, or the UE8M0 byte of a packed sf).
* Per output block ``B``: ``E = max e_in(b)`` over the input blocks of ``B`` inside the tensor, then
  ``E = E - 6`` saturating at 0 (out sf = max in sf / 64).
* Each FP4 value becomes ``e4m3(q * 2**(e_in(b) - E))``: at most ``6 * 2**6 = 384``, at least
  ``0.5 * 2**-5 = 2**-6`` (the smallest e4m3 normal) when ``e_in(b) >= E - 5``.
* Out sf: ``2**(E - 127)`` as float32 (E = 0 gives 0.0, as UE8M0 decodes), or byte E of packed UE8M0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..language import f32_to_e4m3_bits, unpack_e2m1
from ..runtime import (check_choice, check_device, check_inner_contiguous, check_same_device, check_tensor,
                       checks_enabled, empty, interpreter_configs)
from ..utils import align, ceil_div, is_power_of_two
from .common import alloc_sf, check_sf_flags, sf_info
from .types import QuantTensor

__all__ = ["per_block_cast_lossless"]


@triton.jit
def _per_block_cast_lossless_kernel(
    x_ptr, sf_in_ptr, out_ptr, sf_out_ptr,
    M, K, MS_IN, KS_IN, MS_OUT, KS_OUT_PAD,
    stride_xm, stride_sim, stride_sik, stride_om, stride_som, stride_sok,
    IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr,
    BMI: tl.constexpr, BKI: tl.constexpr, BMO: tl.constexpr, BKO: tl.constexpr,
    TM: tl.constexpr, TK: tl.constexpr,
):
    """One program: a ``TM x TK`` tile of whole output blocks (TM % BMO == 0, TK % BKO == 0)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    NIM: tl.constexpr = TM // BMI  # input blocks per tile, rows
    NIK: tl.constexpr = TK // BKI  # input blocks per tile, cols
    NOM: tl.constexpr = TM // BMO
    NOK: tl.constexpr = TK // BKO
    RM: tl.constexpr = BMO // BMI  # input blocks per output block, rows
    RK: tl.constexpr = BKO // BKI

    # ---- input scale exponents of the tile's input blocks (0 outside the tensor: neutral for max)
    ib_m = pid_m * NIM + tl.arange(0, NIM).to(tl.int64)
    ib_k = pid_k * NIK + tl.arange(0, NIK).to(tl.int64)
    ib_ok = (ib_m < MS_IN)[:, None] & (ib_k < KS_IN)[None, :]
    if IN_PACKED:
        w = tl.load(sf_in_ptr + ib_m[:, None] * stride_sim + (ib_k // 4)[None, :] * stride_sik, mask=ib_ok, other=0)
        e_in = (w >> (8 * (ib_k % 4)).to(tl.int32)[None, :]) & 0xFF
    else:
        s = tl.load(sf_in_ptr + ib_m[:, None] * stride_sim + ib_k[None, :] * stride_sik, mask=ib_ok, other=0.0)
        e_in = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF

    # ---- output exponent per output block: max over its input blocks, minus 6 (saturating);
    #      255 (an input block whose scale is inf/NaN) propagates, so the block dequantizes to NaN
    e4 = tl.reshape(e_in, (NOM, RM, NOK, RK))
    emax = tl.max(tl.max(e4, axis=3), axis=1)
    e_out = tl.where(emax >= 255, 255, tl.where(emax >= 6, emax - 6, 0))

    # ---- per-input-block multiplier 2^(e_in - E) (0 for non-finite output blocks)
    eb = tl.reshape(tl.broadcast_to(tl.reshape(e_out, (NOM, 1, NOK, 1)), (NOM, RM, NOK, RK)), (NIM, NIK))
    d = tl.where(eb >= 255, 0, tl.minimum(tl.maximum(e_in - eb + 127, 0), 254))
    mult = (d << 23).to(tl.float32, bitcast=True)

    # ---- data: FP4 bytes [TM, TK/2] -> values [TM, TK] -> scaled -> e4m3 bytes
    rows = pid_m * TM + tl.arange(0, TM).to(tl.int64)
    bcols = pid_k * (TK // 2) + tl.arange(0, TK // 2).to(tl.int64)
    row_ok = rows < M
    bmask = row_ok[:, None] & (bcols[None, :] < K // 2)
    q = tl.load(x_ptr + rows[:, None] * stride_xm + bcols[None, :], mask=bmask, other=0)
    v = unpack_e2m1(q)
    v = tl.reshape(tl.reshape(v, (NIM, BMI, NIK, BKI)) * tl.reshape(mult, (NIM, 1, NIK, 1)), (TM, TK))
    cols = pid_k * TK + tl.arange(0, TK).to(tl.int64)
    mask = row_ok[:, None] & (cols[None, :] < K)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], f32_to_e4m3_bits(v), mask=mask)

    # ---- output scales
    ob_m = pid_m * NOM + tl.arange(0, NOM).to(tl.int64)
    ob_k = pid_k * NOK + tl.arange(0, NOK).to(tl.int64)
    ob_ok = (ob_m < MS_OUT)[:, None] & (ob_k < KS_OUT_PAD)[None, :]
    if OUT_PACKED:
        # one UE8M0 byte per block, written through a byte view of the int32 words; blocks past Ks (up to
        # the word boundary) lie outside the tensor, so their E is 0: unused bytes are written as zeros
        bp = sf_out_ptr.to(tl.pointer_type(tl.uint8))
        off = 4 * (ob_m[:, None] * stride_som + (ob_k // 4)[None, :] * stride_sok) + (ob_k % 4)[None, :]
        tl.store(bp + off, e_out.to(tl.uint8), mask=ob_ok)
    else:
        sf = (e_out << 23).to(tl.float32, bitcast=True)
        tl.store(sf_out_ptr + ob_m[:, None] * stride_som + ob_k[None, :] * stride_sok, sf, mask=ob_ok)


def _tile(bmo: int, bko: int):
    """(TM, TK, num_warps): whole output blocks, ~8K elements per program on GPU, bigger in the interpreter."""
    if interpreter_configs():
        tm = max(bmo, 64)
        tk = max(bko, 65536 // tm)
        return tm, tk, 4
    tm = max(bmo, 32)
    tk = max(bko, 8192 // tm)
    return tm, tk, 8 if tm * tk >= 16384 else 4


def _lossless_exponents(sfi, ms_in: int, ks_in: int) -> torch.Tensor:
    """Input scale exponents ``(Ms_in, Ks_in)`` int64 (host side, for the TRITILE_CHECKS precondition)."""
    sf = sfi.tensor
    if sfi.packed:
        w = sf.to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(0, 32, 8, device=sf.device, dtype=torch.int64)
        return ((w.unsqueeze(-1) >> shifts) & 0xFF).reshape(ms_in, -1)[:, :ks_in]
    bits = sf.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if bool(((bits & 0x807FFFFF) != 0).any()):
        raise ValueError("x[1] (sf) must hold non-negative powers of two (or +inf) for a lossless cast; "
                         "found scales with a mantissa, a sign or NaN")
    return (bits >> 23) & 0xFF


def _check_lossless(sfi, ms_in, ks_in, bmi, bki, bmo, bko):
    """TRITILE_CHECKS=1: every input block's scale is >= (max in its output block) / 2**11."""
    e_in = _lossless_exponents(sfi, ms_in, ks_in)
    rm, rk = bmo // bmi, bko // bki
    ms_o, ks_o = ceil_div(ms_in, rm), ceil_div(ks_in, rk)
    pad = torch.zeros((ms_o * rm, ks_o * rk), dtype=torch.int64, device=e_in.device)
    pad[:ms_in, :ks_in] = e_in
    emax = pad.reshape(ms_o, rm, ks_o, rk).amax(dim=(1, 3))
    e_out = torch.where(emax >= 6, emax - 6, torch.zeros_like(emax))
    eb = e_out.repeat_interleave(rm, 0).repeat_interleave(rk, 1)[:ms_in, :ks_in]
    nonfinite = (emax == 255).repeat_interleave(rm, 0).repeat_interleave(rk, 1)[:ms_in, :ks_in]
    bad = (e_in != 0) & ~nonfinite & (e_in + 5 < eb)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"x is not losslessly representable in e4m3 with out_block_size {(bmo, bko)}: input scale block "
            f"({i}, {j}) has exponent {int(e_in[i, j]) - 127}, more than 11 below the largest scale of its output "
            f"block (2^{int(eb[i, j]) + 6 - 127}); every input scale must be >= max / 2^11")


def _block(name, block):
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise ValueError(f"{name} must be a (rows, cols) pair, got {block!r}")
    for v in block:
        if isinstance(v, bool) or not isinstance(v, int) or not is_power_of_two(v):
            raise ValueError(f"{name} must hold two positive powers of two, got {tuple(block)!r}")
    return int(block[0]), int(block[1])


def per_block_cast_lossless(x: QuantTensor, fmt: str, x_block_size, out_block_size,
                            use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                            use_packed_ue8m0: bool = False) -> QuantTensor:
    """Losslessly re-quantize FP4 (e2m1) data with power-of-two scales to FP8 (e4m3) with larger blocks.

    Exponent arithmetic only.  Per output block ``B`` (``out_block_size``): ``E = max e_in(b) - 6`` over the
    input blocks ``b`` of ``B`` inside the tensor (saturating at 0), where ``e_in`` is the biased exponent
    of the input scale; out sf = ``2**(E-127)``; each value becomes ``e4m3(q * 2**(e_in(b) - E))``.

    Precondition (exactness): every input scale within an output block is at least ``max / 2**11`` (input
    blocks whose scale is 0 are exempt).  Otherwise the small values are rounded (RNE) or flushed to zero;
    TileKernels checks this with a device assert.  tritile checks it on the host when ``TRITILE_CHECKS=1``
    (raising ``ValueError``; this syncs) and also rejects float32 scales that are not powers of two there.

    Non-finite input: an input block whose scale is +inf/NaN (UE8M0 byte 0xFF), as tritile's casts write for
    blocks holding inf/NaN, makes its whole output block's sf +inf (byte 0xFF) with +-0 codes, so that block
    dequantizes to NaN instead of silently to finite values.

    Args:
        x: ``(data, sf)``.  ``data`` int8 ``(M, K/2)``: packed FP4 (element ``2j`` in the low nibble of byte
            ``j``), logical ``K % 32 == 0``, unit column stride.  ``sf``: float32 ``(ceil(M/bm), ceil(K/bk))``
            powers of two (sign and mantissa ignored), or packed UE8M0 int32 ``(ceil(M/bm), ceil(ceil(K/bk)/4))``;
            any strides.
        fmt: must be ``'e4m3'``.
        x_block_size: ``(bm, bk)`` of the input scales, powers of two.
        out_block_size: ``(bm_out, bk_out)`` powers of two, multiples of ``x_block_size``.
        use_tma_aligned_col_major_sf / use_packed_ue8m0: layout of the output sf (§2.3); packed requires
            column-major.
        round_sf: ignored (the output scales are always powers of two); kept for API compatibility.

    Returns:
        ``(out, sf)``: ``out`` float8_e4m3fn ``(M, K)``; ``sf`` float32 ``(ceil(M/bm_out), ceil(K/bk_out))``
        (row-major or strides ``(1, A4(Ms))``), or int32 packed UE8M0 ``(Ms, ceil(Ks/4))`` with strides
        ``(1, A4(Ms))`` and zero unused bytes.
    """
    check_choice("fmt", fmt, ("e4m3",))
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"x must be a (data, sf) QuantTensor pair, got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0] (data)", data, dtypes=(torch.int8,), ndim=2)
    check_tensor("x[1] (sf)", sf, dtypes=(torch.float32, torch.int32), ndim=2)
    check_device("x[0] (data)", data)
    check_same_device(data=data, sf=sf)
    # round_sf is ignored: the output is a power of two anyway; packed only needs column-major here
    check_sf_flags(use_tma_aligned_col_major_sf, True if use_packed_ue8m0 else bool(round_sf), use_packed_ue8m0)
    bmi, bki = _block("x_block_size", x_block_size)
    bmo, bko = _block("out_block_size", out_block_size)
    if bmo % bmi != 0 or bko % bki != 0:
        raise ValueError(f"out_block_size {(bmo, bko)} must be a multiple of x_block_size {(bmi, bki)} in each dim")
    check_inner_contiguous("x[0] (data)", data)
    num_tokens = data.shape[0]
    hidden = data.shape[1] * 2
    if hidden % 32 != 0:
        raise ValueError(f"x[0] (data) must have a logical hidden size (2 * columns) divisible by 32, got {hidden}")
    ms_in, ks_in = ceil_div(num_tokens, bmi), ceil_div(hidden, bki)
    sfi = sf_info("x[1] (sf)", sf, ms_in, ks_in)

    out = empty((num_tokens, hidden), torch.float8_e4m3fn, data.device)
    out_sf = alloc_sf(num_tokens, hidden, (bmo, bko), use_tma_aligned_col_major_sf, use_packed_ue8m0, data.device)
    if num_tokens == 0 or hidden == 0:
        return out, out_sf
    if checks_enabled():
        _check_lossless(sfi, ms_in, ks_in, bmi, bki, bmo, bko)

    ms_out, ks_out = ceil_div(num_tokens, bmo), ceil_div(hidden, bko)
    ks_out_pad = align(ks_out, 4) if use_packed_ue8m0 else ks_out
    tm, tk, num_warps = _tile(bmo, bko)
    grid = (triton.cdiv(num_tokens, tm), triton.cdiv(ks_out_pad * bko, tk))
    _per_block_cast_lossless_kernel[grid](
        data, sfi.tensor, out.view(torch.uint8), out_sf,
        num_tokens, hidden, ms_in, ks_in, ms_out, ks_out_pad,
        data.stride(0), sfi.stride_m, sfi.stride_k, out.stride(0), out_sf.stride(0), out_sf.stride(1),
        IN_PACKED=sfi.packed, OUT_PACKED=use_packed_ue8m0,
        BMI=bmi, BKI=bki, BMO=bmo, BKO=bko, TM=tm, TK=tk,
        num_warps=num_warps,
    )
    return out, out_sf
