"""``reduce_fused``: sum each token's expert outputs back from the fused layout (weighted, in slot order).

One launch; one program per ``[BT tokens, BH columns]`` tile.  For ``k = 0..K-1`` (unrolled) the program
gathers the ``BT`` rows ``x[token_topk_to_pos[t, k]]`` and accumulates ``acc = fma(x, s, acc)`` in float32
with ``s = w[t, k] (* x_sf[pos])`` rounded first; slots with ``-1`` leave ``acc`` untouched.  Then
``acc *= sf`` (fp8 output) and one exact conversion (bf16 RNE / e4m3 clamp + RNE) on store.

``tl.fma`` is one rounding on GPUs and two under the CPU interpreter; ``tritile.torch.reduce_fused``
computes the same way on each backend, so results are bit-exact on both.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ..language import bf16_bits_to_f32, f32_to_bf16_bits, f32_to_e4m3_bits
from ..runtime import check_inner_contiguous, check_same_device, check_shape, check_tensor, checks_enabled, empty, \
    interpreter_configs
from ..utils import ceil_div, next_power_of_two

__all__ = ["reduce_fused"]

_OUT_F32, _OUT_BF16, _OUT_E4M3 = 0, 1, 2


@triton.jit
def _reduce_fused_kernel(x_ptr, xsf_ptr, w_ptr, pos_ptr, sf_ptr, out_ptr,
                         num_tokens, num_expanded, hidden,
                         stride_x, stride_xsf, stride_w0, stride_w1, stride_p0, stride_p1, stride_out,
                         num_col_blocks,
                         K: tl.constexpr, IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr, WITH_W: tl.constexpr,
                         WITH_XSF: tl.constexpr, WITH_SF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    pid = tl.program_id(0)
    tb = pid // num_col_blocks
    cb = pid % num_col_blocks
    rows = tb.to(tl.int64) * BT + tl.arange(0, BT)
    cols = cb * BH + tl.arange(0, BH)
    rm = rows < num_tokens
    cm = cols < hidden
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for k in tl.static_range(K):
        p = tl.load(pos_ptr + rows * stride_p0 + k * stride_p1, mask=rm, other=-1)
        ok = rm & (p >= 0) & (p < num_expanded)
        p64 = tl.where(ok, p, 0).to(tl.int64)
        if WITH_W:
            s = tl.load(w_ptr + rows * stride_w0 + k * stride_w1, mask=ok, other=0.0)
        else:
            s = tl.full([BT], 1.0, dtype=tl.float32)
        if WITH_XSF:
            s = s * tl.load(xsf_ptr + p64 * stride_xsf, mask=ok, other=0.0)
        m2 = ok[:, None] & cm[None, :]
        if IN_BF16:
            bits = tl.load(x_ptr + p64[:, None] * stride_x + cols[None, :], mask=m2, other=0)
            xv = bf16_bits_to_f32(bits)
        else:
            xv = tl.load(x_ptr + p64[:, None] * stride_x + cols[None, :], mask=m2, other=0.0)
        acc = tl.where(ok[:, None], tl.fma(xv, s[:, None], acc), acc)
    if WITH_SF:
        acc = acc * tl.load(sf_ptr)
    om = rm[:, None] & cm[None, :]
    optr = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if OUT_KIND == 0:
        tl.store(optr, acc, mask=om)
    elif OUT_KIND == 1:
        tl.store(optr, f32_to_bf16_bits(acc), mask=om)
    else:
        tl.store(optr, f32_to_e4m3_bits(acc), mask=om)


def reduce_fused(
    x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    topk_weights: Optional[torch.Tensor],
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = "",
    sf: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce the fused (expert-major) rows back to tokens: ``out[t] = sf * sum_k s[t, k] * x[pos[t, k]]``.

    Args:
        x: ``(N, H)`` float32 or bfloat16 with unit stride along ``H``, or a tuple ``(x, x_sf)`` with
            ``x_sf`` float32 ``(N,)``, a per-row multiplier.  Any ``H`` (TileKernels needs ``H % 256 == 0``).
        topk_weights: float32 ``(T, K)`` or None (weight 1).
        token_topk_to_pos: int32 ``(T, K)``; ``-1`` = skip.  Positions ``>= N`` are skipped too (with
            ``TRITILE_CHECKS=1`` they raise ``ValueError``).
        fp8_format: ``''`` (output dtype = ``x.dtype``) or ``'e4m3'`` (float8_e4m3fn output: clamp to
            +-448, then round to nearest even; torch's bare CUDA cast would give NaN on overflow).
        sf: float32 ``(1,)``, multiplies the sum once at the end (even for tokens without a slot, so a
            negative ``sf`` gives ``-0.0``); only with ``fp8_format='e4m3'``.
        out: optional ``(T, H)`` output of the output dtype (unit stride along ``H``), written in place.

    Returns:
        ``(T, H)`` tensor (``out`` when given).  Accumulation: float32, slots ``k = 0..K-1`` in order,
        ``acc = fma(x, s, acc)`` with ``s = w * x_sf`` rounded first.
    """
    x_sf = None
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"x must be a tensor or an (x, x_sf) tuple, got a {type(x).__name__} of length {len(x)}")
        x, x_sf = x
    check_tensor("x", x, dtypes=(torch.float32, torch.bfloat16), ndim=2)
    check_inner_contiguous("x", x)
    num_expanded, hidden = x.shape
    check_tensor("token_topk_to_pos", token_topk_to_pos, dtypes=(torch.int32,), ndim=2)
    num_tokens, num_topk = token_topk_to_pos.shape
    if x_sf is not None:
        check_tensor("x_sf", x_sf, dtypes=(torch.float32,), ndim=1)
        check_shape("x_sf", x_sf, (num_expanded,))
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
        check_shape("topk_weights", topk_weights, (num_tokens, num_topk))
    if not isinstance(fp8_format, str) or fp8_format not in ("", "e4m3"):
        raise ValueError(f"fp8_format must be '' or 'e4m3', got {fp8_format!r}")
    out_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
    if sf is not None:
        if fp8_format == "":
            raise ValueError("sf is only supported with an FP8 output (fp8_format='e4m3'), got fp8_format=''")
        check_tensor("sf", sf, dtypes=(torch.float32,))
        if sf.numel() != 1:
            raise ValueError(f"sf must hold one float32 value (shape (1,)), got shape {tuple(sf.shape)}")
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), ndim=2)
        check_shape("out", out, (num_tokens, hidden))
        check_inner_contiguous("out", out)
    device = check_same_device(x=x, x_sf=x_sf, topk_weights=topk_weights, token_topk_to_pos=token_topk_to_pos,
                               sf=sf, out=out)
    if checks_enabled() and token_topk_to_pos.numel() > 0:
        lo, hi = int(token_topk_to_pos.min()), int(token_topk_to_pos.max())
        if lo < -1 or hi >= num_expanded:
            raise ValueError(f"token_topk_to_pos values must be in [-1, {num_expanded}) (the rows of x), "
                             f"got values in [{lo}, {hi}]")
    if out is None:
        out = empty((num_tokens, hidden), out_dtype, device)
    if num_tokens == 0 or hidden == 0:
        return out

    interp = interpreter_configs()
    bh = max(16, min(next_power_of_two(hidden), 4096 if interp else 1024))
    bt = max(1, min((131072 if interp else 2048) // bh, next_power_of_two(num_tokens)))
    num_col_blocks = ceil_div(hidden, bh)
    out_kind = _OUT_E4M3 if fp8_format == "e4m3" else (_OUT_BF16 if x.dtype == torch.bfloat16 else _OUT_F32)
    xk = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    if out_kind == _OUT_E4M3:
        ok_ = out.view(torch.uint8)
    elif out_kind == _OUT_BF16:
        ok_ = out.view(torch.int16)
    else:
        ok_ = out
    w = topk_weights if topk_weights is not None else token_topk_to_pos
    _reduce_fused_kernel[(ceil_div(num_tokens, bt) * num_col_blocks,)](
        xk, x_sf if x_sf is not None else x, w, token_topk_to_pos, sf if sf is not None else x, ok_,
        num_tokens, num_expanded, hidden,
        xk.stride(0), x_sf.stride(0) if x_sf is not None else 0,
        w.stride(0), w.stride(1), token_topk_to_pos.stride(0), token_topk_to_pos.stride(1), ok_.stride(0),
        num_col_blocks,
        K=num_topk, IN_BF16=x.dtype == torch.bfloat16, OUT_KIND=out_kind, WITH_W=topk_weights is not None,
        WITH_XSF=x_sf is not None, WITH_SF=sf is not None, BT=bt, BH=bh, num_warps=4)
    return out
