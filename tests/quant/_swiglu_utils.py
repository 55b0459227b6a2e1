"""Helpers shared by the SwiGLU cast tests: MoE test data and reference casts."""

from __future__ import annotations

from typing import Optional

import torch

from tritile.testing import assert_equal, is_gpu_run
from tritile.torch.cast import _encode, _layout_sf, cast
from tritile.utils import ceil_div

try:  # tests/quant as a package or as a plain directory on sys.path (pytest's default import mode)
    from ._moe_maps import MOE_CONFIGS, expand, generate_topk_idx, get_fused_mapping
except ImportError:
    from _moe_maps import MOE_CONFIGS, expand, generate_topk_idx, get_fused_mapping

__all__ = ["MOE_CONFIGS", "moe_data", "ref_per_token_cast", "assert_codes_equal_nan_sign_free", "num_sms_values"]


def moe_data(moe, hidden: int, alignment: int, device, num_send_tokens: Optional[int] = None):
    """Fused-MoE test data as TileKernels' tests build it (``spec/quant.md`` §3.8/§3.9).

    ``moe = (num_topk, num_experts_total, num_ep_ranks)``.  Returns a dict with ``topk_idx``, the four
    maps, ``x`` (bf16 ``(N, 2*hidden)`` expanded from a randn ``(T', 2*hidden)``, zero padding rows).
    GPU: 4001 tokens sent per rank (TileKernels); CPU: a handful (small, odd)."""
    k, e_total, ep = moe
    e_local = e_total // ep
    if num_send_tokens is None:
        num_send_tokens = 4001 if is_gpu_run() else 5
    topk_idx = generate_topk_idx(num_send_tokens, k, e_local, ep, device=device)
    p2e, p2t, p2tk, tk2p = get_fused_mapping(topk_idx, e_local, alignment)
    x_tok = torch.randn((topk_idx.shape[0], hidden * 2), dtype=torch.bfloat16, device=device)
    x = expand(x_tok, tk2p, p2e.numel())
    return dict(topk_idx=topk_idx, pos_to_expert=p2e, pos_to_token=p2t, pos_to_token_topk=p2tk,
                token_topk_to_pos=tk2p, x=x, x_tok=x_tok, num_tokens=topk_idx.shape[0], num_topk=k)


def ref_per_token_cast(act: torch.Tensor, npc: int, round_sf: bool, col_major: bool, packed: bool,
                       clamp_min: Optional[float] = None):
    """``tritile.torch.cast(act, 'e4m3', (1, npc), ...)``, with an optional custom amax clamp
    (``sf_clamp_min``; the reference ``cast`` has no such argument, so the scale math is repeated here)."""
    if clamp_min is None:
        return cast(act, "e4m3", (1, npc), round_sf=round_sf, use_tma_aligned_col_major_sf=col_major,
                    use_packed_ue8m0=packed)
    m, k = act.shape
    ks = ceil_div(k, npc)
    ax = torch.where(act == act, act.abs(), torch.full_like(act, float("inf")))
    pad = torch.zeros((m, ks * npc), dtype=torch.float32, device=act.device)
    pad[:, :k] = ax
    amax = pad.reshape(m, ks, npc).amax(dim=2)
    a = torch.maximum(amax, torch.tensor(clamp_min, dtype=torch.float32, device=act.device))
    # Divisions by and of tensors: torch on CUDA computes ``t / 448.0`` as ``t * (1 / 448)`` and ``448.0 / t``
    # as ``reciprocal(t) * 448``, neither IEEE (docs/DEVELOPING.md); found by the H200 run of 2026-11-30
    mx = torch.full_like(a, 448.0)
    sf = torch.div(a, mx)
    if round_sf:
        sf = ((sf.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
        sf_inv = torch.where(sf == float("inf"), 0.0, torch.div(torch.ones_like(sf), sf))
    else:
        sf_inv = torch.div(mx, a)
    out = _encode(act * sf_inv.repeat_interleave(npc, dim=1)[:, :k], act, "e4m3")
    return out, _layout_sf(sf, round_sf, col_major, packed)


def assert_codes_equal_nan_sign_free(q: torch.Tensor, ref: torch.Tensor) -> None:
    """e4m3 codes bitwise equal, except that a NaN code may carry either sign (the sign of a NaN made
    by arithmetic differs between backends and between numpy and torch)."""
    a = q.view(torch.uint8).clone()
    b = ref.view(torch.uint8).clone()
    nan = (b & 0x7F) == 0x7F
    assert bool(((a & 0x7F) == 0x7F)[nan].all()), "NaN codes expected where the reference has them"
    a[nan] = 0x7F
    b[nan] = 0x7F
    assert_equal(a, b)


def num_sms_values():
    """Two persistent-grid sizes (TileKernels: device SMs - 20 and device SMs)."""
    from tritile.config import get_device_num_sms

    dev = get_device_num_sms()
    return [max(1, dev - 20), dev] if is_gpu_run() else [1, 3]
