"""Shared data and oracles of the engram tests."""

import torch

from tritile.testing import generate_hidden_sizes, pick

EPS = 1e-20
CLAMP = 1e-6


def gate_shapes(min_hidden=1):
    """(num_tokens, hc, hidden): TileKernels' matrix on the GPU; a tiny grid with every edge on the CPU.

    The backward asks for ``min_hidden=2``: at H == 1 RMSNorm(x) is +-1, the gate's gradient wrt x and k is
    exactly zero and both kernel and autograd return pure rounding noise, which calc_diff cannot compare."""
    from tritile.testing import generate_num_tokens

    gpu = [(t, 4, h) for t in generate_num_tokens() for h in generate_hidden_sizes(128)]
    # CPU: 0 tokens, 1 token, a T that is no multiple of any block; H a power of two, H = 2560 (not one),
    # tiny odd H below TileKernels' minimum (7, 33); hc = 4 (TileKernels) and odd hc (1, 3).
    # Also T = 130 with H = 576 (several programs per launch) and H = 7168 (TileKernels' largest).
    cpu = [(0, 4, 256), (1, 4, 2560), (33, 4, 256), (13, 4, 2560), (9, 3, 33), (5, 1, 7), (7, 4, 1), (7, 4, 2),
           (130, 4, 576), (5, 4, 7168)]
    return [s for s in pick(cpu=cpu, gpu=gpu) if s[2] >= min_hidden]


def make_gate_data(T, hc, H, device):
    x = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    k = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    v = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    return x, k, v, wh, we


def strided_gate_data(T, hc, H, kpad, gpad, device):
    """(x, k, v, wh, we, grad_out) with k and v slices of one projection ``(T, hc + 1, H + kpad)`` (k starts kpad
    elements in) and grad_out a slice of a row ``gpad`` elements wider."""
    proj = torch.randn(T, hc + 1, H + kpad, dtype=torch.bfloat16, device=device)
    k, v = proj[:, :hc, kpad:], proj[:, hc, :H]
    x, _, _, wh, we = make_gate_data(T, hc, H, device)
    grad_out = torch.randn(T, hc, H + gpad, dtype=torch.bfloat16, device=device)[:, :, gpad:]
    return x, k, v, wh, we, grad_out


def gate_oracle(x, k, v, wf, eps, clamp_value):
    """The gate in float64 (exact sums, for all practical purposes), with the kernel's copysign at s == 0.

    Returns (out bf16, dot, gate, rstd_x, rstd_k) as float64 (out rounded to bf16)."""
    H = x.shape[-1]
    x64, k64, v64, w64 = x.double(), k.double(), v.double(), wf.double()
    rx = torch.rsqrt(x64.square().mean(-1) + eps)
    rk = torch.rsqrt(k64.square().mean(-1) + eps)
    dot = (x64 * w64 * k64).sum(-1)
    s = dot * rx * rk / H ** 0.5
    u = torch.copysign(torch.sqrt(s.abs().clamp_min(clamp_value)), s)
    g = torch.sigmoid(u)
    out = (x64 + g[..., None] * v64[..., None, :]).float().to(torch.bfloat16)
    return out, dot, g, rx, rk
