"""Pure-PyTorch references for the FP8 e4m3 / FP4 e2m1 block casts (``tile_kernels.torch.cast``).

Written from the math of ``spec/quant.md`` §2.2-§2.4, device-agnostic (CPU or CUDA tensors).

Scale math per ``(bm, bk)`` block (``x`` in float32)::

    amax   = max |x| over the block's valid elements   (NaN counts as +inf)
    a      = max(amax, CLAMP)                          (1e-4 for e4m3, 6*2**-126 for e2m1)
    sf     = a / MAX                                   (448 or 6; IEEE division)
    sf_inv = MAX / a                                   (round_sf=False: a second division)
    sf     = 2**ceil(log2 sf), sf_inv = 1 / sf         (round_sf=True)
    q      = encode(float32(x * sf_inv))               (RNE, saturating)

Non-finite input (tritile's rule; TileKernels leaves it unspecified): a block holding +-inf or NaN gets
``sf = +inf`` (UE8M0 byte 0xFF) and ``sf_inv = 0``; its finite elements encode as +-0 and its
non-finite ones as NaN (e4m3 ``0x7F | sign``; e2m1 has no NaN: +-0), so the block dequantizes to NaN.
In general, wherever ``x * sf_inv`` is NaN the code is e4m3 ``0x7F | sign(x)`` / e2m1 ``sign(x) * 0``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..utils import align, ceil_div

__all__ = ["cast", "cast_back"]

_MAX = {"e4m3": 448.0, "e2m1": 6.0}
_CLAMP = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0**-126}
_DTYPE_FMT = {torch.float8_e4m3fn: "e4m3", torch.int8: "e2m1"}


def _fmt_name(fmt) -> str:
    if isinstance(fmt, torch.dtype):
        if fmt not in _DTYPE_FMT:
            raise ValueError(f"fmt must be float8_e4m3fn or int8 (FP4), got {fmt}")
        return _DTYPE_FMT[fmt]
    if fmt not in _MAX:
        raise ValueError(f"fmt must be 'e4m3' or 'e2m1', got {fmt!r}")
    return fmt


def get_min_clamp_val(fmt) -> float:
    """Lower clamp of amax for ``fmt`` ('e4m3'/'e2m1' or the torch dtype): 1e-4, or 6*2**-126 for FP4."""
    return _CLAMP[_fmt_name(fmt)]


def get_max_quant_val(fmt) -> float:
    """Largest finite value of ``fmt`` ('e4m3'/'e2m1' or the torch dtype): 448 or 6."""
    return _MAX[_fmt_name(fmt)]


def transform_sf(sf: torch.Tensor, num_col_blocks: Optional[int] = None) -> torch.Tensor:
    """Scale factors as float32 ``(Ms, Ks)``.

    int32 sf is packed UE8M0 (byte ``j`` of word ``[m, c]`` is k-block ``4c+j``; value ``2**(e-127)``,
    e = 0 decodes to 0.0); it becomes ``(Ms, 4*cols)``, trimmed to ``num_col_blocks`` when given.
    float32 sf is returned as float32 (trimmed the same way)."""
    if sf.dtype == torch.int32:
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=sf.device)
        b = ((sf.unsqueeze(-1) >> shifts) & 0xFF).reshape(sf.shape[0], sf.shape[1] * 4)
        out = (b << 23).view(torch.float32)
    elif sf.dtype == torch.float32:
        out = sf
    else:
        raise TypeError(f"sf must be float32 or int32 (packed UE8M0), got {sf.dtype}")
    if num_col_blocks is not None:
        out = out[:, :num_col_blocks]
    return out


def convert_to_e2m1_bits(x: torch.Tensor) -> torch.Tensor:
    """float values ``[..., 2N]`` -> packed FP4 e2m1 bytes ``[..., N]`` (int8), even element in the low nibble.

    RNE with saturation at 6; the sign nibble bit is the float32 sign bit (-0.0 and negatives that round
    to 0 give 0x8); NaN gives a zero magnitude with its own sign bit."""
    x = x.float()
    a = x.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    code = code | ((x.view(torch.int32) < 0).int() << 3)
    code = code.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def _encode(v: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Encode float32 ``v = x * sf_inv``; where v is NaN the code is NaN/0 carrying x's sign."""
    neg = x.view(torch.int32) < 0
    nan = v != v
    if fmt == "e4m3":
        q = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        q = torch.where(nan, torch.where(neg, 0xFF, 0x7F).to(torch.uint8), q)
        return q.view(torch.float8_e4m3fn)
    v = torch.where(nan, torch.where(neg, -0.0, 0.0), v)
    return convert_to_e2m1_bits(v)


def _decode(data: torch.Tensor) -> torch.Tensor:
    if data.dtype == torch.float8_e4m3fn:
        return data.float()
    if data.dtype == torch.int8:
        from ..quant.common import unpack_from_e2m1fn_x2

        return unpack_from_e2m1fn_x2(data, torch.float32)
    raise TypeError(f"quantized data must be float8_e4m3fn or int8 (FP4), got {data.dtype}")


def _expand(blocks: torch.Tensor, bm: int, bk: int, m: int, k: int) -> torch.Tensor:
    """Per-block values ``(Ms, Ks)`` -> per-element ``(m, k)``."""
    return blocks.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)[:m, :k]


def _dequant(x, block_size: Tuple[int, int]) -> torch.Tensor:
    """``f32(decode(q) * sf[block])`` for a QuantTensor ``(data, sf)`` with any §2.3 sf layout."""
    data, sf = x
    q = _decode(data)
    m, k = q.shape
    bm, bk = block_size
    sf_f = transform_sf(sf, ceil_div(k, bk)).float()
    return q * _expand(sf_f, bm, bk, m, k)


def _layout_sf(sf: torch.Tensor, round_sf: bool, col_major: bool, packed: bool) -> torch.Tensor:
    """float32 ``(Ms, Ks)`` sf -> the user-facing layout of §2.3 (zeros in padding and unused bytes)."""
    ms, ks = sf.shape
    dev = sf.device
    if packed:
        kc = ceil_div(ks, 4)
        if ms == 0:
            return torch.empty((0, kc), dtype=torch.int32, device=dev)
        e = torch.zeros((ms, kc * 4), dtype=torch.int32, device=dev)
        e[:, :ks] = (sf.view(torch.int32) >> 23) & 0xFF
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=dev)
        words = (e.reshape(ms, kc, 4) << shifts).sum(dim=-1, dtype=torch.int32)  # little-endian bytes
        storage = torch.zeros((kc, align(ms, 4)), dtype=torch.int32, device=dev)
        storage[:, :ms] = words.T
        return storage[:, :ms].T
    if col_major:
        if ms == 0:
            return torch.empty((0, ks), dtype=torch.float32, device=dev)
        storage = torch.zeros((ks, align(ms, 4)), dtype=torch.float32, device=dev)
        storage[:, :ms] = sf.T
        return storage[:, :ms].T
    return sf.contiguous()


def cast(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], fmt: str,
         block_size: Tuple[int, int] = (32, 32), sf: Optional[torch.Tensor] = None,
         x_block_size: Optional[Tuple[int, int]] = None, round_sf: bool = False,
         use_tma_aligned_col_major_sf: bool = False,
         use_packed_ue8m0: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Reference block cast to e4m3 / e2m1 with per-``block_size`` scales.

    Args:
        x: float tensor ``(M, K)`` (any float dtype, read as float32), or a QuantTensor ``(data, sf_in)``
            with data e4m3 ``(M, K)`` or int8 FP4 ``(M, K/2)`` and sf_in float32 or packed int32 of
            ``x_block_size`` blocks; it is dequantized first (``f32(q * sf_in)``).
        fmt: ``'e4m3'`` (out float8_e4m3fn ``(M, K)``) or ``'e2m1'`` (out int8 ``(M, K/2)``).
        block_size: ``(bm, bk)`` scale block.
        sf: optional precomputed float32 ``(ceil(M/bm), ceil(K/bk))`` dequant scales; then the codes are
            ``encode(x * (1 / sf))`` and only ``out`` is returned.
        round_sf / use_tma_aligned_col_major_sf / use_packed_ue8m0: as in §2.2/§2.3.  Packed UE8M0 with
            column-major returns int32 ``(Ms, ceil(Ks/4))`` with strides ``(1, A4(Ms))``.

    Returns:
        ``(out, sf)``, or ``out`` when ``sf`` is given.
    """
    fmt = _fmt_name(fmt)
    if isinstance(x, (tuple, list)):
        if x_block_size is None:
            raise ValueError("x_block_size is required when x is a QuantTensor")
        xf = _dequant(x, x_block_size)
    else:
        xf = x.float()
    m, k = xf.shape
    bm, bk = block_size
    ms, ks = ceil_div(m, bm), ceil_div(k, bk)
    mx = _MAX[fmt]
    if sf is not None:
        sf_inv = torch.div(torch.ones((), dtype=torch.float32, device=sf.device), sf.float())
        out = _encode(xf * _expand(sf_inv, bm, bk, m, k), xf, fmt)
        return out
    ax = torch.where(xf == xf, xf.abs(), torch.full_like(xf, float("inf")))
    pad = torch.zeros((ms * bm, ks * bk), dtype=torch.float32, device=xf.device)
    pad[:m, :k] = ax
    amax = pad.reshape(ms, bm, ks, bk).amax(dim=(1, 3))
    a = amax.clamp_min(_CLAMP[fmt])
    sf_out = torch.div(a, torch.full_like(a, mx))  # IEEE (torch CUDA turns ``t / 448.0`` into ``t * (1/448)``)
    if round_sf:
        up = ((sf_out.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
        sf_out = torch.where(sf_out == float("inf"), sf_out, up)  # non-finite blocks keep sf = +inf
        sf_inv = torch.where(sf_out == float("inf"), 0.0, torch.div(torch.ones_like(sf_out), sf_out))
    else:
        # tensor / tensor: IEEE division (``scalar / tensor`` would be ``reciprocal(t) * scalar`` in torch)
        sf_inv = torch.div(torch.full_like(a, mx), a)
    out = _encode(xf * _expand(sf_inv, bm, bk, m, k), xf, fmt)
    return out, _layout_sf(sf_out, round_sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def cast_back(x: Tuple[torch.Tensor, torch.Tensor], fmt: str, block_size: Tuple[int, int] = (32, 32)) -> torch.Tensor:
    """Reference dequantization: ``out = cast_out(f32(decode(q) * sf[i/bm, j/bk]))``.

    Args:
        x: ``(data, sf)``: data e4m3 ``(M, K)`` or int8 FP4 ``(M, K/2)``; sf float32 ``(Ms, Ks)`` or packed
            UE8M0 int32 ``(Ms, ceil(Ks/4))``, any strides.
        fmt: ``'bf16'`` or ``'fp32'``: the output dtype (RNE to bf16).
        block_size: ``(bm, bk)`` of the scales.

    Returns:
        ``(M, K)`` bfloat16 or float32.
    """
    if fmt not in ("bf16", "fp32"):
        raise ValueError(f"fmt must be 'bf16' or 'fp32', got {fmt!r}")
    out = _dequant(x, block_size)
    return out.to(torch.bfloat16) if fmt == "bf16" else out.contiguous()
