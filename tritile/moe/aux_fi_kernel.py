"""``aux_fi``: per-expert load fraction for the auxiliary balance loss (``tile_kernels.moe.aux_fi``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritile.config import get_num_sms
from tritile.runtime import check_contiguous, check_device, check_tensor, empty, interpreter_configs

from .group_count_kernel import check_index_range, count_chunks, grid_config

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["aux_fi"]


@triton.jit
def _aux_fi_kernel(idx_ptr, ws_ptr, out_ptr, numel, num_experts, scale_num, denom, nprog,
                   BLOCK: tl.constexpr, BINS: tl.constexpr):
    """``ws`` = int32 ``[num_experts + 1]`` zeros: counts, then a ticket.  The program that draws the
    last ticket divides once per expert: f = float(count * E) / float(T * aux), IEEE."""
    pid = tl.program_id(0)
    hist = count_chunks(idx_ptr, numel, num_experts, pid, nprog, BLOCK, BINS)
    bins = tl.arange(0, BINS)
    in_range = bins < num_experts
    tl.atomic_add(ws_ptr + bins, hist, mask=in_range & (hist != 0), sem="relaxed")
    # Barrier + acq_rel ticket: every thread's counts are performed before the ticket is drawn, and
    # the program that draws the last ticket sees everyone's (no inter-program waiting).
    tl.debug_barrier()
    ticket = tl.atomic_add(ws_ptr + num_experts, 1, sem="acq_rel")
    if ticket == nprog - 1:
        counts = tl.atomic_add(ws_ptr + bins, tl.zeros([BINS], tl.int32), mask=in_range, sem="relaxed")
        f = tl.math.div_rn((counts * scale_num).to(tl.float32), tl.full([BINS], denom, tl.float32))
        tl.store(out_ptr + bins, f, mask=in_range)


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """Fraction of routed slots per expert, scaled for the auxiliary loss.

    ``f[e] = count_e * num_experts / (num_tokens * num_aux_topk)`` where ``count_e`` counts the
    entries equal to e and ``num_tokens`` counts every row (also rows whose slots are all -1).

    Args:
        topk_idx: int64 ``(num_tokens, num_topk)``, contiguous; entries in ``[-1, num_experts)``, -1 is
            skipped (entries outside are ignored; ``TRITILE_CHECKS=1`` raises on them instead).
        num_experts: ``E >= 1``.
        num_aux_topk: ``>= 1``.

    Returns:
        float32 ``(num_experts,)``; zeros for 0 tokens.  Counted exactly in int32 and divided once
        (IEEE), so the result is deterministic and independent of ``set_num_sms`` (TileKernels adds
        per-block fractions with float atomics).  Exact while ``count * E`` and
        ``num_tokens * num_aux_topk`` stay below 2**24.
    """
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    check_contiguous("topk_idx", topk_idx)
    check_device("topk_idx", topk_idx)
    for name, v in (("num_experts", num_experts), ("num_aux_topk", num_aux_topk)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    dev = topk_idx.device
    num_tokens = topk_idx.size(0)
    numel = topk_idx.numel()
    if num_tokens == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=dev)
    check_index_range("topk_idx", topk_idx, num_experts, "num_experts")
    out = empty((num_experts,), torch.float32, dev)
    ws = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    block, bins, programs = grid_config(max(numel, 1), num_experts, get_num_sms(), _INTERPRET)
    _aux_fi_kernel[(programs,)](topk_idx, ws, out, numel, num_experts, num_experts,
                                float(num_tokens * num_aux_topk), programs, BLOCK=block, BINS=bins, num_warps=4)
    return out
