"""``fused_weight``: ``weight_hidden * weight_embed`` in float32 (the gate's fused RMSNorm weight)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32
from .. import runtime as _rt
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import check_same_device, check_tensor, custom_op, empty, override_key, tuned
from ..utils import ceil_div, next_power_of_two
from ._utils import bits16, check_rows, interp
from tritile.runtime.plan import planned

__all__ = ["fused_weight"]


@triton.jit
def _fused_weight_kernel(wh_ptr, we_ptr, out_ptr, H, s_wh, s_we, s_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    h = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = d < H
    wh = bf16_bits_to_f32(tl.load(wh_ptr + h * s_wh + d, mask=mask, other=0))
    we = bf16_bits_to_f32(tl.load(we_ptr + h * s_we + d, mask=mask, other=0))
    # bf16 x bf16 fits in float32's 24-bit significand: the product is exact (bar overflow/underflow)
    tl.store(out_ptr + h * s_out + d, wh * we, mask=mask)


def _config(H: int):
    """BLOCK: one [BLOCK] slice of a row per program (the op is launch-latency bound: few programs)."""
    # 1024 x 2 warps: 16 elements (two 16-byte loads of each input) per thread, 28 programs at H = 7168
    return min(4096 if interp() else 1024, next_power_of_two(H))


@functools.lru_cache(maxsize=64)
def _plan(hc: int, H: int, override) -> tuple:
    """(grid, BLOCK, num_warps), cached (the host path is latency-bound); ``override``:
    ``override_key("fused_weight")``, so tuning sweeps see their candidates."""
    # H200 sweep (2026-11-30, hc=4, H=7168, CUDA-graph us): 512 x 4 warps 1.71, 1024 x 4 1.73, 1024 x 2 1.82
    cfg = tuned("fused_weight", dict(BLOCK=min(_config(H), 4096 if interp() else 512), WARPS=4))
    block = cfg["BLOCK"]
    return (hc, ceil_div(H, block)), block, cfg["WARPS"]


def _launch(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    hc, H = weight_hidden.shape
    out = empty((hc, H), torch.float32, weight_hidden.device)
    if hc == 0 or H == 0:
        return out
    grid, block, warps = _plan(hc, H, override_key("fused_weight"))
    # ``.run`` is what ``kernel[grid](...)`` calls (no lambda, no keyword dicts); out is contiguous: stride(0) = H
    _fused_weight_kernel.run(bits16(weight_hidden), bits16(weight_embed), out, H, weight_hidden.stride(0),
                             weight_embed.stride(0), H, block, grid=grid, warmup=False, num_warps=warps, **pdl_args(out.device))
    return out


@custom_op("engram_fused_weight", fake=lambda wh, we: wh.new_empty(wh.shape, dtype=torch.float32))
def _fused_weight_op(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    return _launch(weight_hidden, weight_embed)


@planned("fused_weight")
def fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """Fuse the two RMSNorm weights of the Engram gate: ``weight_hidden.float() * weight_embed.float()``.

    Args:
        weight_hidden: RMSNorm weight of the hidden states, shape (hc_mult, hidden_size), bfloat16;
            any row stride, unit stride along hidden_size.
        weight_embed: RMSNorm weight of the keys, shape (hc_mult, hidden_size), bfloat16; same layout rules.

    Returns:
        weight_fused: shape (hc_mult, hidden_size), float32, contiguous.  The product of two bf16 values is
        exact in float32, so this equals the PyTorch expression bit for bit.  Any hidden_size works
        (TileKernels needs a multiple of 256).
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(weight_hidden, torch.Tensor) and weight_hidden.dtype is torch.bfloat16
            and weight_hidden.dim() == 2 and isinstance(weight_embed, torch.Tensor)
            and weight_embed.dtype is torch.bfloat16 and weight_embed.shape == weight_hidden.shape
            and (weight_hidden.shape[1] <= 1 or (weight_hidden.stride(1) == 1 and weight_embed.stride(1) == 1))
            and weight_embed.device == weight_hidden.device
            and (weight_hidden.device.type == "cuda" or _rt.kernel_device_ok(weight_hidden.device))):
        check_tensor("weight_hidden", weight_hidden, dtypes=(torch.bfloat16,), ndim=2)
        check_tensor("weight_embed", weight_embed, dtypes=(torch.bfloat16,), ndim=2)
        if weight_embed.shape != weight_hidden.shape:
            raise ValueError("weight_hidden and weight_embed must have the same shape (hc_mult, hidden_size), got "
                             f"{tuple(weight_hidden.shape)} and {tuple(weight_embed.shape)}")
        check_rows("weight_embed", weight_embed, torch.bfloat16, weight_hidden.shape)
        check_rows("weight_hidden", weight_hidden, torch.bfloat16, weight_hidden.shape)
        check_same_device(weight_hidden=weight_hidden, weight_embed=weight_embed)
    if torch.compiler.is_compiling():  # traced as the opaque custom op ``torch.ops.tritile.engram_fused_weight``
        return _fused_weight_op(weight_hidden, weight_embed)
    return _launch(weight_hidden, weight_embed)
