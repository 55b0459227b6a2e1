"""Pure-PyTorch references for the E5M6 cast (``tile_kernels.torch.cast_e5m6``).

E5M6 is the top 12 bits of an IEEE fp16 pattern: sign, 5 exponent bits (bias 15), 6 mantissa bits.
Max 65024, min normal 2**-14, subnormal step 2**-20.  Written from the math of ``spec/quant.md`` §3.14,
independently of the kernel helper ``tritile.language.f32_to_e5m6_code``:

* scale per group of ``num_per_channels`` columns (§2.2 with MAX = 65024, CLAMP = 1e-4);
* ``v = f32(x * sf_inv)``; ``h`` = fp16 bits of ``v`` rounded toward zero (fp16 subnormals truncated to
  multiples of 2**-24); ``t = h >> 4``; then ``t += 1`` when ``(t & 1) + (bits32(v) & 0x1FFFF) > 0x10000``
  (round to nearest even on the float32 mantissa: exact RNE in the fp16-normal range, TileKernels' quirk in
  the subnormal range, replicated on purpose); ``code = t & 0xFFF``;
* 8 codes ``c0..c7`` go into 3 little-endian uint32 words::

      w0 = c0 << 20 | c1 << 8 | c2 >> 4
      w1 = (c2 & 0xF) << 28 | c3 << 16 | c4 << 4 | c5 >> 8
      w2 = (c5 & 0xFF) << 24 | c6 << 12 | c7

  returned as ``uint8 (M, K*3/2)``.

Non-finite input (tritile's rule): NaN counts as +inf in amax; a group holding +-inf/NaN gets
``sf = +inf`` (UE8M0 byte 0xFF) and ``sf_inv = 0``, so its finite elements encode as +-0 and its non-finite
ones as the E5M6 NaN ``0x7E0 | sign(x) << 11`` (fp16 ``0x7E00``); the group dequantizes to NaN.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..utils import ceil_div
from .cast import _layout_sf as _cast_layout_sf

__all__ = ["cast_to_e5m6", "cast_back_from_e5m6"]

_MAX = 65024.0
_CLAMP = 1e-4
_NAN_CODE = 0x7E0


def _fp16_rtz_magnitude_bits(a: torch.Tensor) -> torch.Tensor:
    """fp16 bit pattern (int64) of ``|v|`` (finite, float32, >= 0) rounded toward zero."""
    ab = a.view(torch.int32).to(torch.int64)
    # fp16-normal range: drop the 13 low mantissa bits, after which the fp16 conversion is exact
    trunc = (ab & ~0x1FFF).to(torch.int32).view(torch.float32)
    trunc = torch.minimum(trunc, torch.tensor(65504.0, device=a.device))  # RTZ never overflows to inf
    normal = trunc.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    # fp16-subnormal range: a multiple of 2**-24, rounded toward zero (a * 2**24 is exact in float64)
    sub = torch.floor(a.double() * 2.0**24).to(torch.int64)
    return torch.where(a >= 2.0**-14, normal, sub)


def _e5m6_codes(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """12-bit E5M6 codes (int64) of float32 ``v = x * sf_inv``; NaN v gives ``0x7E0 | sign(x)``."""
    bits = v.view(torch.int32).to(torch.int64)
    sign = (bits >> 31) & 1
    nan = v != v
    a = torch.where(nan, torch.zeros_like(v), v.abs())
    t = (_fp16_rtz_magnitude_bits(a) >> 4) | (sign << 11)
    r = bits & 0x1FFFF
    t = torch.where((t & 1) + r > 0x10000, t + 1, t) & 0xFFF
    xsign = (x.view(torch.int32) < 0).to(torch.int64)
    return torch.where(nan, _NAN_CODE | (xsign << 11), t)


def _pack_codes(c: torch.Tensor) -> torch.Tensor:
    """int64 codes ``(M, K)`` -> uint8 ``(M, K*3/2)`` (3 little-endian uint32 words per 8 codes)."""
    m, k = c.shape
    c = c.reshape(m, k // 8, 8)
    c0, c1, c2, c3, c4, c5, c6, c7 = c.unbind(-1)
    w0 = (c0 << 20) | (c1 << 8) | (c2 >> 4)
    w1 = ((c2 & 0xF) << 28) | (c3 << 16) | (c4 << 4) | (c5 >> 8)
    w2 = ((c5 & 0xFF) << 24) | (c6 << 12) | c7
    words = torch.stack([w0, w1, w2], dim=-1).reshape(m, k // 8 * 3)
    shifts = torch.arange(0, 32, 8, device=c.device, dtype=torch.int64)
    b = (words.unsqueeze(-1) >> shifts) & 0xFF  # little-endian bytes, independent of the host's byte order
    return b.to(torch.uint8).reshape(m, k // 8 * 12)


def _unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """uint8 ``(M, K*3/2)`` -> int64 codes ``(M, K)``."""
    m, n = data.shape
    b = data.to(torch.int64).reshape(m, n // 4, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    w0, w1, w2 = words.reshape(m, n // 12, 3).unbind(-1)
    codes = [w0 >> 20, (w0 >> 8) & 0xFFF, ((w0 & 0xFF) << 4) | (w1 >> 28), (w1 >> 16) & 0xFFF,
             (w1 >> 4) & 0xFFF, ((w1 & 0xF) << 8) | (w2 >> 24), (w2 >> 12) & 0xFFF, w2 & 0xFFF]
    return torch.stack(codes, dim=-1).reshape(m, n // 12 * 8)


def _layout_sf(sf: torch.Tensor, col_major: bool, packed: bool) -> torch.Tensor:
    """float32 ``(Ms, Ks)`` -> the §2.3 layout (zero padding, whole int32 words with zero unused bytes)."""
    return _cast_layout_sf(sf, True, col_major, packed)


def _sf_to_float(sf: torch.Tensor, num_col_blocks: int) -> torch.Tensor:
    """Any-layout sf -> float32 ``(Ms, Ks)``; int32 is packed UE8M0 (``2**(e-127)``, e = 0 -> 0.0)."""
    if sf.dtype == torch.int32:
        w = sf.to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(0, 32, 8, device=sf.device, dtype=torch.int64)
        e = ((w.unsqueeze(-1) >> shifts) & 0xFF).reshape(sf.shape[0], sf.shape[1] * 4)[:, :num_col_blocks]
        return (e << 23).to(torch.int32).view(torch.float32)
    if sf.dtype != torch.float32:
        raise TypeError(f"sf must be float32 or int32 (packed UE8M0), got {sf.dtype}")
    return sf[:, :num_col_blocks].float()


def cast_to_e5m6(x: torch.Tensor, num_per_channels: int, use_tma_aligned_col_major_sf: bool = False,
                 round_sf: bool = False, use_packed_ue8m0: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference E5M6 cast with per-token scales over groups of ``num_per_channels`` columns.

    Args:
        x: ``(M, K)`` float tensor (read as float32); ``K % 8 == 0`` and ``K % num_per_channels == 0``.
        num_per_channels: group width (TileKernels' kernel only supports ``K``; the reference allows less).
        use_tma_aligned_col_major_sf / round_sf / use_packed_ue8m0: sf math and layout of §2.2/§2.3.

    Returns:
        ``(out, sf)``: ``out`` uint8 ``(M, K*3/2)``; ``sf`` float32 ``(M, K/npc)`` or packed int32
        ``(M, ceil(K/npc/4))`` in the requested layout.
    """
    xf = x.float()
    m, k = xf.shape
    npc = num_per_channels
    if k % 8 != 0 or k % npc != 0:
        raise ValueError(f"x must have K % 8 == 0 and K % num_per_channels == 0, got K={k}, npc={npc}")
    g = k // npc
    ax = torch.where(xf == xf, xf.abs(), torch.full_like(xf, float("inf")))
    amax = ax.reshape(m, g, npc).amax(dim=-1) if m > 0 else torch.zeros((0, g), device=xf.device)
    a = amax.clamp_min(_CLAMP)
    mx = torch.full_like(a, _MAX)  # tensor / tensor: IEEE on every device (a Python scalar is not, on CUDA)
    sf = torch.div(a, mx)
    if round_sf:
        up = ((sf.view(torch.int32).to(torch.int64) + 0x7FFFFF) & 0x7F800000).to(torch.int32).view(torch.float32)
        sf = torch.where(sf == float("inf"), sf, up)  # non-finite rows keep sf = +inf
        sf_inv = torch.where(sf == float("inf"), 0.0, torch.div(torch.ones_like(sf), sf))
    else:
        sf_inv = torch.div(mx, a)
    v = xf * sf_inv.repeat_interleave(npc, dim=1)
    out = _pack_codes(_e5m6_codes(v, xf))
    return out, _layout_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def cast_back_from_e5m6(x: Tuple[torch.Tensor, torch.Tensor], fmt: str,
                        x_block_size: Tuple[int, int]) -> torch.Tensor:
    """Reference E5M6 dequantization: ``cast_out(f32(fp16(code << 4)) * sf[i/bm, j/bk])``.

    Args:
        x: ``(data, sf)``: data uint8 ``(M, K*3/2)`` with K % 8 == 0; sf float32 ``(Ms, Ks)`` or packed
            UE8M0 int32 ``(Ms, ceil(Ks/4))``, any strides.
        fmt: ``'bf16'`` or ``'fp32'`` (RNE to bf16).
        x_block_size: ``(bm, bk)`` of the scales.

    Returns:
        ``(M, K)`` bfloat16 or float32.
    """
    if fmt not in ("bf16", "fp32"):
        raise ValueError(f"fmt must be 'bf16' or 'fp32', got {fmt!r}")
    data, sf = x
    m, n = data.shape
    k = n * 2 // 3
    bm, bk = x_block_size
    codes = _unpack_codes(data)
    h = codes << 4
    vals = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.float16).float()
    sf_f = _sf_to_float(sf, ceil_div(k, bk))
    sf_e = sf_f.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)[:m, :k]
    out = vals * sf_e
    return out.to(torch.bfloat16) if fmt == "bf16" else out.contiguous()
