"""``top2_sum_gate``: the DeepSeek-V3 MoE gate (``tile_kernels.moe.top2_sum_gate``): scores, group-limited
stable top-k, normalised weights, shared experts, physical-expert map and EP/TP masking in one kernel."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from tritile.language import exp_f32
from tritile import runtime as _rt
from tritile.language.pdl import pdl_args, pdl_enter
from tritile.runtime import (check_contiguous, check_no_overlap, check_same_device, check_tensor, checks_enabled,
                             custom_op, empty, interpreter_configs)
from tritile.utils import ceil_div, next_power_of_two

from tritile.language.sort_keys import KEY_TAKEN, f32_order_key, key_index, pack_key

from .common import group_scores_key, sigmoid_f32, softplus_f32, topk_group_rank
from .scoring import ScoringFunc
from tritile.runtime.plan import planned

# Triton needs TRITON_INTERPRET before its @jit decorators run, so it cannot change later.
_INTERPRET = interpreter_configs()

__all__ = ["top2_sum_gate"]

@triton.jit
def _top2_sum_gate_kernel(logits_ptr, bias_ptr, mask_ptr, fix_ptr, map_ptr, count_ptr,
                          idx_ptr, w_ptr, unm_ptr,
                          num_tokens, stride_l, stride_u, map_width, rsf,
                          ep_rank, per_rank, tp_rank, num_tp_ranks,
                          SCORING: tl.constexpr, NUM_EXPERTS: tl.constexpr, NUM_TOPK: tl.constexpr,
                          NUM_SHARED: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_TOPK_GROUPS: tl.constexpr,
                          GROUPED: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FIX: tl.constexpr,
                          HAS_MAP: tl.constexpr, HAS_UNMAPPED: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
                          BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    PER_GROUP: tl.constexpr = NUM_EXPERTS // NUM_GROUPS
    NUM_SLOTS: tl.constexpr = NUM_TOPK + NUM_SHARED
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    e_ok2 = (g[:, None] < NUM_GROUPS) & (j[None, :] < PER_GROUP)
    e2 = tl.where(e_ok2, g[:, None] * PER_GROUP + j[None, :], -1)            # [G, EG] expert id, -1 = padding
    e = e2[None, :, :]
    e_ok = e_ok2[None, :, :]

    # ---- scores (s: the weights' source) and ranking values (b) ----
    logit = tl.load(logits_ptr + rows[:, None, None] * stride_l + e, mask=row_ok[:, None, None] & e_ok, other=0.0)
    bias = tl.load(bias_ptr + e2, mask=e_ok2, other=0.0)[None, :, :]
    if SCORING == 2:  # softmax; ranking uses the raw logit
        lm = tl.where(e_ok, logit, float("-inf"))
        mx = tl.max(tl.max(lm, axis=2), axis=1)
        ex = exp_f32(lm - mx[:, None, None])
        s = tl.math.div_rn(ex, tl.sum(tl.sum(ex, axis=2), axis=1)[:, None, None])
        b = logit + bias
    else:
        if SCORING == 0:
            s = sigmoid_f32(logit)
        else:
            s = tl.sqrt_rn(softplus_f32(logit))
        b = s + bias

    # ---- group limiting: keep the NUM_TOPK_GROUPS groups with the best top-2 sums ----
    if GROUPED:
        key = tl.where(e_ok, pack_key(f32_order_key(b), j[None, None, :]), KEY_TAKEN)
        gkey = group_scores_key(key, (g < NUM_GROUPS)[None, :], 2)
        keep = topk_group_rank(gkey) < NUM_TOPK_GROUPS             # [T, G]
        b = tl.where(keep[:, :, None], b, float("-inf"))
    key = tl.where(e_ok, pack_key(f32_order_key(b), e), KEY_TAKEN)
    # Flatten [T, G, EG] -> [T, G * EG] once, so every top-k step below is a single reduction.
    key = tl.reshape(key, (BLOCK_T, BLOCK_G * BLOCK_EG))
    s = tl.reshape(s, (BLOCK_T, BLOCK_G * BLOCK_EG))
    e = tl.reshape(tl.broadcast_to(e, (1, BLOCK_G, BLOCK_EG)), (1, BLOCK_G * BLOCK_EG))

    # ---- stable top-k (or the fixed routing), weights and their sequential sum ----
    p = tl.arange(0, BLOCK_P)[None, :]                                        # slot
    if HAS_FIX:
        fixed = tl.load(fix_ptr + rows, mask=row_ok, other=0) != 0
        fix_sel = tl.load(unm_ptr + rows[:, None] * stride_u + p, mask=row_ok[:, None] & (p < NUM_TOPK), other=0)
    sel_t = tl.zeros([BLOCK_T, BLOCK_P], tl.int64)
    w_t = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
    denom = tl.full([BLOCK_T], 1e-20, tl.float32)
    for k in tl.static_range(NUM_TOPK):
        best = tl.max(key, axis=1)
        key = tl.where(key == best[:, None], KEY_TAKEN, key)
        sel = key_index(best).to(tl.int64)
        if HAS_FIX:
            sel = tl.where(fixed, tl.sum(tl.where(p == k, fix_sel, 0), axis=1), sel)
        wk = tl.max(tl.where(e == sel[:, None], s, float("-inf")), axis=1)
        denom = denom + wk
        sel_t = tl.where(p == k, sel[:, None], sel_t)
        w_t = tl.where(p == k, wk[:, None], w_t)
    weight = tl.where(p < NUM_TOPK, tl.math.div_rn(w_t, denom[:, None]) * rsf, 1.0)
    logical = tl.where(p < NUM_TOPK, sel_t, NUM_EXPERTS - NUM_TOPK + p)     # shared slot K+j -> E+j

    # ---- physical replica, then the EP/TP mask ----
    slot_ok = row_ok[:, None] & (p < NUM_SLOTS)
    if HAS_MAP:
        l_ok = slot_ok & (logical >= 0) & (logical < NUM_EXPERTS + NUM_SHARED)
        cnt = tl.maximum(tl.load(count_ptr + logical, mask=l_ok, other=1), 1).to(tl.int64)
        dup = (ep_rank + rows[:, None] * 23333) % cnt  # TileKernels' replica hash, in int64
        idx = tl.load(map_ptr + logical * map_width + dup, mask=l_ok & (dup < map_width), other=-1).to(tl.int64)
    else:
        idx = logical
    valid = idx >= 0
    safe = tl.where(valid, idx, 0)
    q = safe // per_rank
    idx = tl.where(valid & (q % num_tp_ranks == tp_rank), (q // num_tp_ranks) * per_rank + safe % per_rank, -1)

    if HAS_MASK:
        routed = (tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0)[:, None]
        idx = tl.where(routed, idx, -1)
        weight = tl.where(routed, weight, 0.0)
        sel_t = tl.where(routed, sel_t, -1)
    out_offs = rows[:, None] * NUM_SLOTS + p
    tl.store(idx_ptr + out_offs, idx, mask=slot_ok)
    tl.store(w_ptr + out_offs, weight, mask=slot_ok)
    if HAS_UNMAPPED:
        tl.store(unm_ptr + rows[:, None] * stride_u + p, sel_t, mask=row_ok[:, None] & (p < NUM_TOPK))


@functools.lru_cache(maxsize=None)
def _config(groups: int, per_group: int, slots: int, interpret: bool):
    bg, beg, bp = next_power_of_two(groups), next_power_of_two(per_group), next_power_of_two(slots)
    if interpret:
        return max(1, 16384 // (bg * beg)), bg, beg, bp, 1
    # One token per program, one warp per 256 experts (TileKernels: a warp per token).
    # A grouped [1, 8, 8] tile (64 experts in 8 groups, 2 elements per thread) selected wrong experts on the
    # H200 (Triton 3.6; about a quarter of the slots; the interpreter and every tile of >= 128 elements,
    # [1, 8, 16] and [1, 16, 8] included, were right): pad the per-group width so a tile holds >= 128 slots
    # (the padding is masked, as for groups of 5 experts).
    if groups > 1:
        beg = max(beg, 128 // bg)
    return 1, bg, beg, bp, max(1, min(4, bg * beg // 256))


def _int(name, v, lo=None):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def _scoring(scoring_func) -> ScoringFunc:
    try:
        func = ScoringFunc.from_str(scoring_func)
    except ValueError:
        func = None
    if func is None or func == ScoringFunc.IDENTITY:
        raise ValueError(f"scoring_func must be one of 'sigmoid', 'sqrtsoftplus', 'softmax', got {scoring_func!r}")
    return func


@planned("top2_sum_gate")
def top2_sum_gate(logits: torch.Tensor, bias: torch.Tensor, num_topk: int, num_topk_groups: int, num_groups: int,
                  use_shared_as_routed: bool, num_shared_experts: int, routed_scaling_factor: float,
                  ep_rank: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int, scoring_func: str,
                  mask: Optional[torch.Tensor] = None, fix_routing_mask: Optional[torch.Tensor] = None,
                  to_physical_map: Optional[torch.Tensor] = None, logical_count: Optional[torch.Tensor] = None,
                  unmapped_topk_idx: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: top-k experts per token with group limiting by top-2 sums (DeepSeek-V3's gate).

    Notation: T tokens, E = ``logits.size(1)`` routed experts, K = ``num_topk``, S = ``num_shared_experts``
    when ``use_shared_as_routed`` (else 0), P = K + S, G = ``num_groups``, X = ``to_physical_map.size(1) - 1``.

    Per token t (a row with ``mask[t] == False`` gets idx -1, weight 0.0 and unmapped -1, nothing else):

    1. scores s = sigmoid(l), sqrt(softplus(l)) or softmax(l) (``scoring_func``); ranking values
       b = s + bias, but l + bias for softmax;
    2. if G != ``num_topk_groups``: keep the ``num_topk_groups`` groups with the largest top-2 sum of b
       (ties -> smaller group), the other experts rank as -inf;
    3. the K experts with the largest b, largest first, ties -> smaller index (a stable sort); rows with
       ``fix_routing_mask[t]`` take ``unmapped_topk_idx[t]`` instead (ids in ``[0, E)``);
    4. weights w_k = s[sel_k] / (1e-20 + w_0 + ... + w_{K-1}) * ``routed_scaling_factor`` (sequential sum,
       IEEE division); shared slot K+j gets expert E+j and weight 1.0;
    5. with a map, expert L becomes ``to_physical_map[L, (ep_rank + t*23333) % logical_count[L]]``
       (int64 arithmetic; TileKernels overflows int32 for t >= 92037);
    6. EP/TP mask with n = (E + X) // ``num_ep_ranks`` experts per rank and R = ``num_tp_ranks``: an id on
       rank r is kept when ``r % R == tp_rank`` and renumbered ``(r // R) * n + id % n``, else -1
       (the slot keeps its weight).

    Args:
        logits: float32 ``(T, E)``, contiguous (finite; checked when ``TRITILE_CHECKS=1``).
        bias: float32 ``(E,)``, contiguous.
        num_topk, num_topk_groups, num_groups: K <= E; ``num_groups`` and ``num_topk_groups`` both 0 or both
            positive, ``num_topk_groups <= num_groups``, E % G == 0, and G <= 32 when the groups limit the
            routing (G != ``num_topk_groups``).  TileKernels' other kernel limits (E % 4 == 0, K + S <= 32,
            E / G <= 32) do not apply.
        use_shared_as_routed, num_shared_experts: S in {1, 2}, K % S == 0, E % (K // S) == 0, S <= X.
        routed_scaling_factor: float.
        ep_rank, num_ep_ranks, tp_rank, num_tp_ranks: ``0 <= ep_rank``, ``0 <= tp_rank < num_tp_ranks``,
            ``(E + X) // num_ep_ranks >= 1``.
        scoring_func: ``'sigmoid'``, ``'sqrtsoftplus'`` or ``'softmax'`` (or a ``ScoringFunc``).
        mask: optional bool with T elements, contiguous (True = route the token).
        fix_routing_mask: optional bool ``(T,)``, contiguous; needs ``unmapped_topk_idx``.
        to_physical_map: optional int32 ``(E + S, X + 1)``, contiguous, physical ids in ``[0, E + X)`` in the
            first ``logical_count[L]`` columns of row L; with ``logical_count`` int32 ``(E + S,)`` in
            ``[1, X + 1]``, contiguous.
        unmapped_topk_idx: optional int64 ``(T, K)`` with unit column stride (any row stride), sharing no
            memory with an input: input of the fixed rows (ids in ``[0, E)``), and output of the logical ids
            (before map and mask) of every row.

    The value ranges of ``unmapped_topk_idx`` (fixed rows), ``to_physical_map`` and ``logical_count`` are data:
    they are checked only with ``TRITILE_CHECKS=1`` (``ValueError``; a host sync).  Unchecked, the kernel still
    never reads or writes out of bounds (a ``logical_count`` below 1 counts as 1, a fixed id outside ``[0, E)``
    gets weight NaN or -inf and no map entry, a map entry is passed through as it is), but the routing is then
    meaningless.

    Returns:
        ``(topk_idx, topk_weights)``: int64 ``(T, P)`` and float32 ``(T, P)``, columns in selection order,
        then the shared slots.  No result depends on the launch configuration.
    """
    if torch.compiler.is_compiling():  # the registered op: its schema takes the scoring function as a string
        if isinstance(scoring_func, ScoringFunc):
            scoring_func = str(scoring_func)
        routed_scaling_factor = float(routed_scaling_factor)
    return _top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                          num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                          scoring_func, mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)


def _top2_sum_gate_fake(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                        routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                        fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
    p = num_topk + (num_shared_experts if use_shared_as_routed else 0)
    t = logits.shape[0]
    return logits.new_empty((t, p), dtype=torch.int64), logits.new_empty((t, p))


@custom_op("moe_top2_sum_gate", mutates_args=("unmapped_topk_idx",), fake=_top2_sum_gate_fake)
def _top2_sum_gate(logits: torch.Tensor, bias: torch.Tensor, num_topk: int, num_topk_groups: int, num_groups: int,
                   use_shared_as_routed: bool, num_shared_experts: int, routed_scaling_factor: float,
                   ep_rank: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int, scoring_func: str,
                   mask: Optional[torch.Tensor] = None, fix_routing_mask: Optional[torch.Tensor] = None,
                   to_physical_map: Optional[torch.Tensor] = None, logical_count: Optional[torch.Tensor] = None,
                   unmapped_topk_idx: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The body of ``top2_sum_gate`` (the registered op)."""
    # Every check below runs in the original order with its message; the common, valid case takes the inline
    # guards (a few attribute reads) and one cached call for the scalar arguments instead of the helpers.
    if not (isinstance(logits, torch.Tensor) and logits.dtype is torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and isinstance(bias, torch.Tensor) and bias.dtype is torch.float32
            and bias.dim() == 1 and bias.is_contiguous()):
        check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
        check_contiguous("logits", logits)
        check_tensor("bias", bias, dtypes=(torch.float32,), ndim=1)
        check_contiguous("bias", bias)
    dev = logits.device
    if (bias.device != dev or not (dev.type == "cuda" or _rt.kernel_device_ok(dev))
            or (mask is not None and mask.device != dev)
            or (fix_routing_mask is not None and fix_routing_mask.device != dev)
            or (to_physical_map is not None and to_physical_map.device != dev)
            or (logical_count is not None and logical_count.device != dev)
            or (unmapped_topk_idx is not None and unmapped_topk_idx.device != dev)):
        dev = check_same_device(logits=logits, bias=bias, mask=mask, fix_routing_mask=fix_routing_mask,
                                to_physical_map=to_physical_map, logical_count=logical_count,
                                unmapped_topk_idx=unmapped_topk_idx)
    num_tokens, num_experts = logits.shape
    if bias.shape[0] != num_experts:
        raise ValueError(f"bias must have shape ({num_experts},) to match logits, got {tuple(bias.shape)}")
    key = (num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts, ep_rank, num_ep_ranks,
           tp_rank, num_tp_ranks, type(routed_scaling_factor), scoring_func, num_experts)
    try:
        plan = _scalar_plan(*key)
    except TypeError:  # an unhashable argument (or a TypeError of the checks, raised again here)
        plan = _scalar_plan.__wrapped__(*key)
    num_topk, num_shared_experts, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, head, tail = plan
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dtype is torch.bool
                                 and mask.is_contiguous() and mask.numel() == num_tokens):
        check_tensor("mask", mask, dtypes=(torch.bool,))
        check_contiguous("mask", mask)
        if mask.numel() != num_tokens:
            raise ValueError(f"mask must have {num_tokens} elements (one per token), got shape {tuple(mask.shape)}")
    if (to_physical_map is None) != (logical_count is None):
        raise ValueError("to_physical_map and logical_count must be given together, got only "
                         + ("to_physical_map" if logical_count is None else "logical_count"))
    num_logical = num_experts + num_shared_experts
    num_extra = 0
    if to_physical_map is not None:
        if not (isinstance(to_physical_map, torch.Tensor) and to_physical_map.dtype is torch.int32
                and to_physical_map.dim() == 2 and to_physical_map.is_contiguous()
                and to_physical_map.shape[0] == num_logical and to_physical_map.shape[1] >= 1
                and isinstance(logical_count, torch.Tensor) and logical_count.dtype is torch.int32
                and logical_count.dim() == 1 and logical_count.is_contiguous()
                and logical_count.shape[0] == num_logical):
            _check_map(to_physical_map, logical_count, num_logical)
        num_extra = to_physical_map.shape[1] - 1
    if num_shared_experts > num_extra:
        raise ValueError(f"num_shared_experts={num_shared_experts} needs a to_physical_map with at least "
                         f"{num_shared_experts} extra columns, got {num_extra}")
    per_rank = (num_experts + num_extra) // num_ep_ranks
    if per_rank < 1:
        raise ValueError(f"num_ep_ranks must be <= the number of physical experts {num_experts + num_extra}, "
                         f"got {num_ep_ranks}")
    if unmapped_topk_idx is not None:
        if not (isinstance(unmapped_topk_idx, torch.Tensor) and unmapped_topk_idx.dtype is torch.int64
                and unmapped_topk_idx.dim() == 2 and unmapped_topk_idx.shape[0] == num_tokens
                and unmapped_topk_idx.shape[1] == num_topk
                and (num_topk <= 1 or unmapped_topk_idx.stride(1) == 1)
                and (num_tokens <= 1 or unmapped_topk_idx.stride(0) >= num_topk)):
            _check_unmapped(unmapped_topk_idx, num_tokens, num_topk)
        if not torch.compiler.is_compiling():  # written in place: it must not share memory with an input
            check_no_overlap({"unmapped_topk_idx": unmapped_topk_idx},
                             {"logits": logits, "bias": bias, "mask": mask, "fix_routing_mask": fix_routing_mask,
                              "to_physical_map": to_physical_map, "logical_count": logical_count})
    if fix_routing_mask is not None:
        if unmapped_topk_idx is None:
            raise ValueError("fix_routing_mask needs unmapped_topk_idx (the fixed expert ids), got None")
        check_tensor("fix_routing_mask", fix_routing_mask, dtypes=(torch.bool,), ndim=1)
        check_contiguous("fix_routing_mask", fix_routing_mask)
        if fix_routing_mask.size(0) != num_tokens:
            raise ValueError(f"fix_routing_mask must have shape ({num_tokens},), got {tuple(fix_routing_mask.shape)}")

    num_slots = num_topk + num_shared_experts
    topk_idx = empty((num_tokens, num_slots), torch.int64, dev)
    topk_weights = empty((num_tokens, num_slots), torch.float32, dev)
    if num_tokens == 0:
        return topk_idx, topk_weights
    if checks_enabled():
        _data_checks(logits, mask, fix_routing_mask, unmapped_topk_idx, logical_count, num_experts, num_extra,
                     to_physical_map)

    dummy = logits
    # ``.run`` is what ``kernel[grid](...)`` calls; constexprs positionally from the cached plan (head: SCORING ..
    # GROUPED, tail: BLOCK_T .. BLOCK_P, the last one num_warps), so the launch builds no keyword dicts.
    _top2_sum_gate_kernel.run(
        logits, bias,
        mask if mask is not None else dummy,
        fix_routing_mask if fix_routing_mask is not None else dummy,
        to_physical_map if to_physical_map is not None else dummy,
        logical_count if logical_count is not None else dummy,
        topk_idx, topk_weights, unmapped_topk_idx if unmapped_topk_idx is not None else topk_idx,
        num_tokens, logits.stride(0), unmapped_topk_idx.stride(0) if unmapped_topk_idx is not None else 0,
        num_extra + 1, float(routed_scaling_factor), ep_rank, per_rank, tp_rank, num_tp_ranks,
        *head, mask is not None, fix_routing_mask is not None, to_physical_map is not None,
        unmapped_topk_idx is not None, *tail[:4],
        grid=(ceil_div(num_tokens, tail[0]),), warmup=False, num_warps=tail[4], **pdl_args(logits.device))
    return topk_idx, topk_weights


@functools.lru_cache(maxsize=256, typed=True)
def _scalar_plan(num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts, ep_rank,
                 num_ep_ranks, tp_rank, num_tp_ranks, rsf_type, scoring_func, num_experts):
    """The checks of the scalar arguments, in order (``rsf_type``: ``type(routed_scaling_factor)``), and the launch
    constants they fix: ``(num_topk, num_shared_experts, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, head, tail)``
    with head = (SCORING, NUM_EXPERTS, NUM_TOPK, NUM_SHARED, NUM_GROUPS, NUM_TOPK_GROUPS, GROUPED) and tail =
    (BLOCK_T, BLOCK_G, BLOCK_EG, BLOCK_P, num_warps).  Cached with ``typed=True`` (``True`` is not ``1`` here);
    an invalid call raises and caches nothing."""
    num_topk = _int("num_topk", num_topk, 1)
    num_topk_groups = _int("num_topk_groups", num_topk_groups, 0)
    num_groups = _int("num_groups", num_groups, 0)
    num_shared_experts = _int("num_shared_experts", num_shared_experts, 0)
    ep_rank = _int("ep_rank", ep_rank, 0)
    num_ep_ranks = _int("num_ep_ranks", num_ep_ranks, 1)
    tp_rank = _int("tp_rank", tp_rank, 0)
    num_tp_ranks = _int("num_tp_ranks", num_tp_ranks, 1)
    if not issubclass(rsf_type, (int, float)) or issubclass(rsf_type, bool):
        raise TypeError(f"routed_scaling_factor must be a float, got {rsf_type.__name__}")
    func = _scoring(scoring_func)
    if (num_groups == 0) != (num_topk_groups == 0):
        raise ValueError(f"num_groups and num_topk_groups must be both zero or both non-zero, "
                         f"got {num_groups} and {num_topk_groups}")
    if num_topk > num_experts:
        raise ValueError(f"num_topk must be <= the number of experts {num_experts}, got {num_topk}")
    if num_topk_groups > num_groups:
        raise ValueError(f"num_topk_groups must be <= num_groups={num_groups}, got {num_topk_groups}")
    if num_groups != 0 and num_experts % num_groups != 0:
        raise ValueError(f"num_groups must divide the number of experts {num_experts}, got {num_groups}")
    grouped = num_groups != num_topk_groups
    if grouped and num_groups > 32:
        raise ValueError(f"num_groups must be <= 32 when groups limit the routing, got {num_groups}")
    if not tp_rank < num_tp_ranks:
        raise ValueError(f"tp_rank must be in [0, num_tp_ranks={num_tp_ranks}), got {tp_rank}")
    if use_shared_as_routed:
        if num_shared_experts not in (1, 2):
            raise ValueError(f"num_shared_experts must be 1 or 2 with use_shared_as_routed, got {num_shared_experts}")
        if num_topk % num_shared_experts != 0 or num_experts % (num_topk // num_shared_experts) != 0:
            raise ValueError(f"num_shared_experts={num_shared_experts} must divide num_topk={num_topk}, and "
                             f"num_topk // num_shared_experts must divide the number of experts {num_experts}")
    else:
        num_shared_experts = 0
    groups = num_groups if grouped else 1
    block_t, bg, beg, bp, warps = _config(groups, num_experts // groups, num_topk + num_shared_experts, _INTERPRET)
    head = (int(func), num_experts, num_topk, num_shared_experts, groups, num_topk_groups if grouped else 1, grouped)
    return num_topk, num_shared_experts, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, head, (block_t, bg, beg, bp,
                                                                                               warps)


def _check_map(to_physical_map, logical_count, num_logical) -> None:
    check_tensor("to_physical_map", to_physical_map, dtypes=(torch.int32,), ndim=2)
    check_contiguous("to_physical_map", to_physical_map)
    if to_physical_map.size(0) != num_logical or to_physical_map.size(1) < 1:
        raise ValueError(f"to_physical_map must have shape ({num_logical}, X + 1), "
                         f"got {tuple(to_physical_map.shape)}")
    check_tensor("logical_count", logical_count, dtypes=(torch.int32,), ndim=1)
    check_contiguous("logical_count", logical_count)
    if logical_count.size(0) != num_logical:
        raise ValueError(f"logical_count must have shape ({num_logical},), got {tuple(logical_count.shape)}")


def _check_unmapped(unmapped_topk_idx, num_tokens, num_topk) -> None:
    check_tensor("unmapped_topk_idx", unmapped_topk_idx, dtypes=(torch.int64,), ndim=2)
    if tuple(unmapped_topk_idx.shape) != (num_tokens, num_topk):
        raise ValueError(f"unmapped_topk_idx must have shape ({num_tokens}, {num_topk}), "
                         f"got {tuple(unmapped_topk_idx.shape)}")
    if (num_topk > 1 and unmapped_topk_idx.stride(1) != 1) or (
            num_tokens > 1 and unmapped_topk_idx.stride(0) < num_topk):
        raise ValueError(f"unmapped_topk_idx must have a unit column stride and non-overlapping rows, got "
                         f"strides {tuple(unmapped_topk_idx.stride())}")


def _data_checks(logits, mask, fix, unmapped, logical_count, num_experts, num_extra, to_physical_map=None):
    """``TRITILE_CHECKS=1``: the preconditions only device data reveals (syncs the host)."""
    routed = mask.reshape(-1) if mask is not None else torch.ones(logits.size(0), dtype=torch.bool,
                                                                  device=logits.device)
    if not bool(torch.isfinite(logits[routed]).all()):
        raise ValueError("logits must be finite in every routed row, got NaN or inf")
    if fix is not None:
        rows = unmapped[fix & routed]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_experts):
            raise ValueError(f"unmapped_topk_idx must hold expert ids in [0, {num_experts}) in fixed rows, "
                             f"got values in [{int(rows.min())}, {int(rows.max())}]")
    if logical_count is not None and logical_count.numel():
        lo, hi = int(logical_count.min()), int(logical_count.max())
        if lo < 1 or hi > num_extra + 1:
            raise ValueError(f"logical_count must lie in [1, {num_extra + 1}], got values in [{lo}, {hi}]")
        # the entries a token can read: columns below logical_count of their row
        cols = torch.arange(num_extra + 1, device=logits.device)
        used = to_physical_map[cols[None, :] < logical_count[:, None].long()]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_experts + num_extra):
            raise ValueError(f"to_physical_map must hold physical expert ids in [0, {num_experts + num_extra}) in its "
                             f"first logical_count columns, got values in [{int(used.min())}, {int(used.max())}]")
