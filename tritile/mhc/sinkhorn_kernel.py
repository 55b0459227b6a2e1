"""``sinkhorn_normalize`` kernels: Sinkhorn-Knopp on ``n x n`` fp32 matrices and its unrolled backward.

The autograd op is ``tritile.modeling.mhc.ops.sinkhorn_normalize``.  Both kernels compute through
``tritile.mhc._common.sinkhorn_fwd`` / ``sinkhorn_bwd`` (shared with ``pre_big_fuse``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritile.language.pdl import pdl_args, pdl_enter
from tritile.mhc._common import NO_FUSION, comb_offsets, sinkhorn_bwd, sinkhorn_fwd, token_config, token_prologue
from tritile.runtime import custom_op, empty, interpreter_configs, tuned
from tritile.runtime.plan import planned
from tritile.utils import ceil_div, next_power_of_two


@triton.jit
def _sinkhorn_fwd_kernel(x_ptr, out_ptr, T, eps, N: tl.constexpr, BN: tl.constexpr, REPEAT: tl.constexpr,
                         BT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tok, _, i3, o3, tm = token_prologue(T, BT, BN)
    offs, m3 = comb_offsets(tok, tm, i3, o3, N)
    c = tl.load(x_ptr + offs, mask=m3, other=0.0)
    tl.store(out_ptr + offs, sinkhorn_fwd(c, i3, o3, eps, N, REPEAT), mask=m3)


@triton.jit
def _sinkhorn_bwd_kernel(x_ptr, g_ptr, dx_ptr, tape_ptr, T, eps, N: tl.constexpr, BN: tl.constexpr,
                         REPEAT: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tok, _, i3, o3, tm = token_prologue(T, BT, BN)
    offs, m3 = comb_offsets(tok, tm, i3, o3, N)
    c = tl.load(x_ptr + offs, mask=m3, other=0.0)
    g = tl.load(g_ptr + offs, mask=m3, other=0.0)
    # the tape: (2 REPEAT - 1) matrices per token, token-major (a program's slots are contiguous)
    tape = tape_ptr + tok[:, None, None] * ((2 * REPEAT - 1) * N * N) + i3 * N + o3
    dc = sinkhorn_bwd(c, g, i3, o3, eps, tape, m3, N * N, N, REPEAT)
    tl.store(dx_ptr + offs, dc, mask=m3)


def _config(n: int) -> dict:
    """One warp per block of about 128 matrix entries (8 tokens at n = 4: four entries a thread, so a token's row and
    column sums stay within a few lanes and the backward's tape round trips overlap across many small programs);
    the interpreter takes 8192-entry blocks."""
    bn = next_power_of_two(n)
    cfg = token_config(max(1, 128 // (bn * bn)), max(1, 8192 // (bn * bn)))
    return cfg if interpreter_configs() else dict(cfg, num_warps=1)


@planned("mhc_sinkhorn_fwd")
@custom_op("mhc_sinkhorn_fwd", fake=lambda x, repeat, eps: x.new_empty(x.shape))
def sinkhorn_fwd_launch(x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """fp32 ``x (T, n, n)`` contiguous (checked by the caller) -> fp32 ``(T, n, n)``."""
    t, n, _ = x.shape
    out = empty(x.shape, torch.float32, x.device)
    if t == 0 or n == 0:
        return out
    cfg = tuned("mhc_sinkhorn_fwd", _config(n))
    _sinkhorn_fwd_kernel[(ceil_div(t, cfg["BT"]),)](x, out, t, float(eps), N=n, BN=next_power_of_two(n),
                                                    REPEAT=repeat, BT=cfg["BT"], num_warps=cfg["num_warps"],
                                                    **NO_FUSION, **pdl_args(x.device))
    return out


@planned("mhc_sinkhorn_bwd")
@custom_op("mhc_sinkhorn_bwd", fake=lambda x, g, repeat, eps: x.new_empty(x.shape))
def sinkhorn_bwd_launch(x: torch.Tensor, grad: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """Gradient w.r.t. the logits ``x (T, n, n)`` of the output gradient ``grad (T, n, n)`` (fp32, contiguous)."""
    t, n, _ = x.shape
    dx = empty(x.shape, torch.float32, x.device)
    if t == 0 or n == 0:
        return dx
    cfg = tuned("mhc_sinkhorn_bwd", _config(n))
    tape = torch.empty((t, 2 * repeat - 1, n, n), dtype=torch.float32, device=x.device)  # private scratch
    _sinkhorn_bwd_kernel[(ceil_div(t, cfg["BT"]),)](x, grad, dx, tape, t, float(eps), N=n, BN=next_power_of_two(n),
                                                    REPEAT=repeat, BT=cfg["BT"], num_warps=cfg["num_warps"],
                                                    num_stages=1, **NO_FUSION, **pdl_args(x.device))
    return dx
