"""Pure-PyTorch references for ``tritile.engram`` (``tile_kernels.torch.engram``), written from the math.

Not re-exported by ``tritile.torch`` (TileKernels does not either): use ``tritile.torch.engram.X``.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

__all__: list = []


def make_offsets(vocab_sizes: torch.Tensor) -> torch.Tensor:
    """Per-layer exclusive prefix sums of the table sizes.

    Args:
        vocab_sizes: shape (num_layers, max_ngram_size - 1, num_heads), int32.

    Returns:
        shape (num_layers, (max_ngram_size - 1) * num_heads), int32: ``offsets[l, c]`` is the sum of the
        first ``c`` entries of ``vocab_sizes[l].flatten()`` (int32 arithmetic, wrapping).
    """
    flat = vocab_sizes.reshape(vocab_sizes.shape[0], -1).to(torch.int32)
    inclusive = torch.cumsum(flat, dim=1, dtype=torch.int32)
    return torch.cat([torch.zeros_like(flat[:, :1]), inclusive[:, :-1]], dim=1)


def engram_hash_ref(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """Reference of ``tritile.engram.engram_hash``.

    Args:
        ngram_token_ids: (num_tokens, N) int32; multipliers: (L, N) int64;
        vocab_sizes: (L, N - 1, E) int32; offsets: (L, (N - 1) * E) int32.

    Returns:
        (L, num_tokens, (N - 1) * E) int32.
    """
    L = multipliers.shape[0]
    T, N = ngram_token_ids.shape
    products = ngram_token_ids.to(torch.int64)[None, :, :] * multipliers[:, None, :]  # (L, T, N), wraps
    h = products[:, :, 0].clone()
    cols = []
    for n in range(1, N):
        h.bitwise_xor_(products[:, :, n])
        mod = vocab_sizes[:, n - 1, :].to(torch.int64)  # (L, E)
        cols.append(torch.remainder(h[:, :, None], mod[:, None, :]).to(torch.int32))  # floor-mod
    if cols:
        idx = torch.cat(cols, dim=2)
    else:
        idx = torch.empty((L, T, 0), dtype=torch.int32, device=ngram_token_ids.device)
    return idx + offsets[:, None, :].to(torch.int32)


def engram_gate_ref(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    clamp_value: float,
    eps: float,
    save_for_backward: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Reference of the Engram gate (differentiable), computed in float32.

    Args:
        hidden_states, k: (..., hc_mult, hidden_size); v: (..., hidden_size);
        weight_hidden, weight_embed: (hc_mult, hidden_size) (bf16 or float32 leaves);
        clamp_value: floor on |s|; eps: RMSNorm epsilon.

    Returns:
        ``out`` (bf16, shape of hidden_states), or with ``save_for_backward`` the tuple
        ``(out, dot, gate_score, rstd_x, rstd_k)``, the last four float32 of shape (..., hc_mult) with
        ``dot`` the raw (unnormalised, unscaled) ``sum_d (x*wh)*(k*we)``.
        The sign of s uses ``torch.sign`` (s == 0 gives a gate of exactly 0.5; the kernel uses copysign).
    """
    H = hidden_states.shape[-1]
    x = hidden_states.float()
    kf = k.float()
    rstd_x = torch.rsqrt(x.square().mean(-1) + eps)
    rstd_k = torch.rsqrt(kf.square().mean(-1) + eps)
    dot = ((x * weight_hidden.float()) * (kf * weight_embed.float())).sum(-1)
    s = dot * rstd_x * rstd_k * (H ** -0.5)
    u = torch.sqrt(s.abs().clamp_min(clamp_value)) * torch.sign(s)
    gate = torch.sigmoid(u)
    out = (x + gate.unsqueeze(-1) * v.float().unsqueeze(-2)).to(torch.bfloat16)
    if save_for_backward:
        return out, dot, gate, rstd_x, rstd_k
    return out
