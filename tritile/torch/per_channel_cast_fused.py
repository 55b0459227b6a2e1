"""Pure-PyTorch reference of the fused per-channel e4m3 cast (``tile_kernels.torch.per_channel_cast_fused``).

Written from ``spec/quant.md`` §2.2, §2.4 and §3.6; device-agnostic.  The scale math is spelled out
here (tensor / tensor divisions only: torch computes ``python_scalar / tensor`` as a reciprocal times
the scalar, and on CUDA ``tensor / python_scalar`` as a multiply by the reciprocal; neither is the
IEEE division the kernels do).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = ["per_channel_cast_fused"]

_MAX = 448.0
_CLAMP = 1e-4


def _gather_rows(t: torch.Tensor, pos_to_token: torch.Tensor) -> torch.Tensor:
    """``t[max(pos, 0)]`` with rows where ``pos < 0`` set to zero bytes (+0.0, fp8 0x00, UE8M0 0)."""
    idx = pos_to_token.to(torch.int64)
    pad = idx < 0
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    g = raw[idx.clamp(min=0)].clone()
    g[pad] = 0
    return g.view(t.dtype) if t.element_size() == 1 else g


def _sf_to_f32(sf: torch.Tensor, num_groups: int) -> torch.Tensor:
    """float32 sf, or packed UE8M0 int32 (byte j of word c = group 4c+j, value 2^(e-127), 0 -> 0.0)."""
    if sf.dtype == torch.int32:
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=sf.device)
        e = ((sf.unsqueeze(-1) >> shifts) & 0xFF).reshape(sf.shape[0], -1)
        return (e << 23).view(torch.float32)[:, :num_groups]
    return sf.float()[:, :num_groups]


def per_channel_scale(amax: torch.Tensor, round_sf: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sf, sf_inv)`` of e4m3 blocks from their float32 ``amax`` (spec §2.2; +inf amax gives
    ``sf = +inf``, ``sf_inv = 0``)."""
    a = amax.float().clamp_min(_CLAMP)
    mx = torch.full_like(a, _MAX)
    sf = a / mx
    if round_sf:
        pow2 = ((sf.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
        sf = torch.where(sf == float("inf"), sf, pow2)
        sf_inv = torch.where(sf == float("inf"), torch.zeros_like(sf), torch.ones_like(sf) / sf)
    else:
        sf_inv = mx / a
    return sf, sf_inv


def encode_e4m3(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32 ``v = x * sf_inv`` -> e4m3 (RNE, saturating); where v is NaN the code is ``0x7F | sign(x)``."""
    q = v.clamp(-_MAX, _MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    neg = x.view(torch.int32) < 0
    nan_code = torch.where(neg, 0xFF, 0x7F).to(torch.uint8)
    return torch.where(v != v, nan_code, q).view(torch.float8_e4m3fn)


def per_channel_cast_values(xf: torch.Tensor, num_per_tokens: int, round_sf: bool):
    """e4m3 cast of float32 ``(M, K)`` with (num_per_tokens x 1) scale blocks -> ``(out, sf)``; a partial
    last block takes only the existing rows; NaN counts as +inf in amax."""
    m, k = xf.shape
    ms = -(-m // num_per_tokens)
    ax = torch.where(xf == xf, xf.abs(), torch.full_like(xf, float("inf")))
    pad = torch.zeros((ms * num_per_tokens, k), dtype=torch.float32, device=xf.device)
    pad[:m] = ax
    amax = pad.reshape(ms, num_per_tokens, k).amax(dim=1)
    sf, sf_inv = per_channel_scale(amax, round_sf)
    v = xf * sf_inv.repeat_interleave(num_per_tokens, dim=0)[:m]
    return encode_e4m3(v, xf), sf.contiguous()


def per_channel_cast_fused(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], num_per_tokens: int,
                           num_per_channels: Optional[int] = None, round_sf: bool = False,
                           pos_to_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference e4m3 cast with per-channel scales over blocks of ``num_per_tokens`` rows x 1 column.

    Args:
        x: float tensor ``(N, K)`` (read as float32), or a QuantTensor ``(data e4m3 (N, K), sf)`` whose sf
            (float32 ``(N, K/npc)`` or packed UE8M0 int32, any strides) has blocks of
            ``(1, num_per_channels)``; it is dequantized first, ``f32(q * sf)``.
        num_per_tokens: rows per scale block (128 in TileKernels).
        num_per_channels: columns per input-scale block (QuantTensor input only).
        round_sf: round the scales up to powers of two.
        pos_to_token: optional int ``(Mo,)`` gather map: logical row ``i`` is ``x[pos_to_token[i]]``;
            ``-1`` is a padding row of zeros (its input sf is zero too).

    Returns:
        ``(out, sf)``: float8_e4m3fn ``(Mo, K)`` and float32 ``(ceil(Mo / num_per_tokens), K)``.
        Non-finite rule: a column block holding +-inf or NaN gets ``sf = +inf``; its finite elements
        encode as +-0 and its non-finite ones as ``0x7F | sign``.
    """
    if isinstance(x, (tuple, list)):
        data, sf = x
        if pos_to_token is not None:
            data = _gather_rows(data, pos_to_token)
            sf = _gather_rows(sf, pos_to_token)
        k = data.shape[1]
        npc = num_per_channels
        s = _sf_to_f32(sf, -(-k // npc)).repeat_interleave(npc, dim=1)[:, :k]
        xf = data.float() * s
    else:
        if pos_to_token is not None:
            x = _gather_rows(x, pos_to_token)
        xf = x.float()
    return per_channel_cast_values(xf, num_per_tokens, round_sf)
