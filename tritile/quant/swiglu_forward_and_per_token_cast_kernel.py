"""``swiglu_forward_and_per_token_cast``: SwiGLU (clamp, routing weight) fused with a per-token FP8 cast.

``tile_kernels.quant.swiglu_forward_and_per_token_cast`` (``spec/quant.md`` §3.8).  One pass over x:
each program loads ``[BLOCK_R, CH]`` tiles of the gate half ``l`` and the up half ``r`` of its rows,
computes ``act`` in float32, takes the amax of each ``npc``-wide group, and stores the e4m3 codes and
the scales (any §2.3 layout).  With ``clamped_count`` the grid is persistent
(``get_num_sms() * programs_per_sm`` programs) so each program adds its three counts with one integer atomic each; integer atomics make
the counts independent of the grid.

Exactness on GPUs: every SwiGLU kernel here launches with ``enable_fp_fusion=False``.  libdevice's
``expf`` ends with a multiply (``ex2.approx(..) * scale``), and with fusion on the following
``1 + exp(-l)`` is contracted into one FMA (checked in the sm_90a PTX), which rounds differently from
torch's separate exp and add.  With fusion off the PTX keeps only the explicit FMAs (inside expf, and
the ``tl.fma`` of the backward), so the kernels compute exactly what the references compute.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import config
from ..language import EMULATE, sf_to_ue8m0
from ..language.cast import f32_to_e4m3_bits_satfinite
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_choice, check_contiguous, check_inner_contiguous, check_no_overlap, check_same_device,
                       check_shape, check_tensor, custom_op, empty, interpreter_configs, tuned)
from ..utils import ceil_div, next_power_of_two
from ..runtime.plan import planned
from ._swiglu_jit import (
    _act_of,
    _amax3,
    _amax3_pair,
    _bf16x2_clamp,
    _bf16x2_clamp_xorsign,
    _bf16x2_count,
    _encode_e4m3,
    _encode_pair,
    _load_half,
    _packed_count_inc,
    _raw_to_f32,
    _scale,
    _silu_act_words,
    _u32_clamp_counts,
    _u32_count_decode,
    _words_count_sum,
)
from .common import FMT_CLAMP, alloc_sf, check_sf_flags, pack_ue8m0_words
from .types import QuantTensor

__all__ = ["swiglu_forward_and_per_token_cast"]


@triton.jit
def _swiglu_forward_and_per_token_cast_kernel(
        x_ptr, out_ptr, sf_ptr, ptt_ptr, w_ptr, p2e_ptr, cnt_ptr,
        num_rows, num_weights, num_groups, num_words,
        stride_xm, stride_om, stride_sm, stride_sk,
        clamp_value, sf_clamp_min, clamp_bf16,
        H: tl.constexpr, X_BF16: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_P2E: tl.constexpr,
        HAS_CLAMP: tl.constexpr, COUNT: tl.constexpr, ROUND_SF: tl.constexpr, PACKED: tl.constexpr,
        BLOCK_R: tl.constexpr, CH: tl.constexpr, GB: tl.constexpr,
        FAST_MAX: tl.constexpr, FAST_ENC: tl.constexpr, PREFETCH: tl.constexpr, PACKED_COUNT: tl.constexpr,
        MINMAX_CLAMP: tl.constexpr, X_WORDS: tl.constexpr, BF16X2_COUNT: tl.constexpr,
        BF16X2_CLAMP: tl.constexpr, FAST_DIV: tl.constexpr, PREFETCH_RB: tl.constexpr,
        PREFETCH2: tl.constexpr, FUSED_SILU: tl.constexpr = 0, INT_COUNT: tl.constexpr = False,
        XORSIGN_CLAMP: tl.constexpr = False, INT_SCALE: tl.constexpr = False, CNT_FLUSH: tl.constexpr = 1,
        PDL: tl.constexpr = False):
    """FAST_MAX: NaN-propagating group max (NaN -> +inf fixed once per group).  FAST_ENC: the plain
    e4m3 encode (a NaN code's sign is free: NaN inputs are unspecified and the tests compare NaN
    codes sign-free) instead of the per-element ``0x7F | sign(x)`` fix-up.  PREFETCH: the
    next chunk's loads are issued before the current chunk is computed.  PACKED_COUNT: the three
    clamp counts of each element slot are kept in one int32 lane (10-bit fields, flushed once per row
    block) instead of three row reductions per chunk.  X_WORDS (bf16 x): x read as int32 words of two
    bf16 (``stride_xm`` in words), widened by a shift and a mask instead of byte permutes.
    BF16X2_COUNT (with X_WORDS): the clamp counts taken on the bf16 pairs as loaded
    (``_bf16x2_count``; for a bf16 ``l``, ``l > c`` is ``l > clamp_bf16``, c rounded down to bf16),
    kept as bf16 counts per word slot and flushed once per row block.  BF16X2_CLAMP (with X_WORDS; the
    host sets it only for a clamp c > 0 that is a bf16 value): the clamp on the bf16 pairs.  FAST_DIV
    (with FAST_ENC): ``l / t`` by ``_div_fast`` (one range check per 4 elements).  PREFETCH_RB (with
    PREFETCH): the prefetch crosses row blocks (the last chunk of a row block loads the first chunk of the
    program's next one), and ``pos_to_expert`` / ``pos_to_token_topk`` are read one row block ahead, so
    no row block starts with an exposed load round trip.  PREFETCH2 (with PREFETCH and PREFETCH_RB; the host
    sets it only for >= 2 chunks per row): the loads run two chunks ahead (two chunks in flight per program
    while one is computed; 16 more registers at [1, 512] x 1 warp).

    Same-bits instruction cuts (on in the GPU default of npc < H since commit 2615106): FUSED_SILU=4 (X_WORDS, FAST_DIV,
    words clamped on bf16 pairs or no clamp; GPU) ``_silu_act_words``, one PTX block per four words to float32 act;
    INT_COUNT (with BF16X2_COUNT) the counts as 16-bit mask sums, two words per add (``_u32_count2``), decoded every
    CNT_FLUSH row blocks and at the end (``_u32_count_decode``); XORSIGN_CLAMP (with BF16X2_CLAMP)
    ``_bf16x2_clamp_xorsign``; INT_SCALE (ROUND_SF; the host sets it only for sf_clamp_min >= 2^-118)
    ``_pow2_scale_f32_bits``."""
    pdl_enter(PDL)
    G: tl.constexpr = CH // GB  # groups per chunk
    NCH: tl.constexpr = (H + CH - 1) // CH  # chunks per row
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_rb = (num_rows + BLOCK_R - 1) // BLOCK_R
    acc_l = tl.zeros([BLOCK_R], tl.int64)
    acc_rp = tl.zeros([BLOCK_R], tl.int64)
    acc_rn = tl.zeros([BLOCK_R], tl.int64)
    if PACKED_COUNT:
        tl.static_assert(NCH < 1024)
    BF16_CNT: tl.constexpr = BF16X2_COUNT and X_WORDS and HAS_CLAMP and COUNT
    BF16_CLAMP: tl.constexpr = BF16X2_CLAMP and X_WORDS and HAS_CLAMP
    if BF16_CNT or BF16_CLAMP:
        cb_pos = tl.full([BLOCK_R, CH // 2], clamp_bf16, tl.int32)
        cb_pos = cb_pos | (cb_pos << 16)  # the rounded-down clamp in both halves
        cb_neg = cb_pos ^ -2147450880  # -clamp_bf16 in both halves: the sign bits 0x80008000 flipped
    if BF16_CNT:
        tl.static_assert(NCH <= 256)  # bf16 counts are exact integers up to 256
    PF_RB: tl.constexpr = PREFETCH and PREFETCH_RB
    # INT_COUNT: the counts as sums of 16-bit compare masks, two words per add, flushed every CNT_FLUSH row blocks
    I_CNT: tl.constexpr = INT_COUNT and BF16_CNT
    if I_CNT:
        tl.static_assert(X_WORDS and CH % 4 == 0)
        i_l = tl.zeros([BLOCK_R, CH // 4], tl.int32)
        i_rp = tl.zeros([BLOCK_R, CH // 4], tl.int32)
        i_rn = tl.zeros([BLOCK_R, CH // 4], tl.int32)
        cb_pos2 = tl.full([BLOCK_R, CH // 4], clamp_bf16, tl.int32)
        cb_pos2 = cb_pos2 | (cb_pos2 << 16)
        cb_neg2 = cb_pos2 ^ -2147450880
        n_unflushed = 0
    rb = pid
    if PF_RB:
        # the first row block's activity, routing index and first chunk, ahead of the loop
        rows_c = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        active_c = rows_c < num_rows
        if HAS_P2E:
            p2e_c = tl.load(p2e_ptr + rows_c, mask=active_c, other=-1)
            active_c = active_c & (p2e_c >= 0)
        if HAS_WEIGHTS:
            idx_c = tl.load(ptt_ptr + rows_c, mask=rows_c < num_rows, other=-1)
        l_n = _load_half(x_ptr + rows_c[:, None] * stride_xm, 0, 0, active_c, H, CH, X_BF16, X_WORDS)
        r_n = _load_half(x_ptr + rows_c[:, None] * stride_xm, 0, H, active_c, H, CH, X_BF16, X_WORDS)
        if PREFETCH2:
            tl.static_assert(NCH >= 2)  # two chunks ahead stays within the next row block
            l_nn = _load_half(x_ptr + rows_c[:, None] * stride_xm, CH, 0, active_c, H, CH, X_BF16, X_WORDS)
            r_nn = _load_half(x_ptr + rows_c[:, None] * stride_xm, CH, H, active_c, H, CH, X_BF16, X_WORDS)
    while rb < num_rb:  # a while loop: range() over program ids breaks the interpreter (numpy 2.4)
        rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        active = row_ok
        if PF_RB:
            active = row_ok
            if HAS_P2E:
                active = row_ok & (p2e_c >= 0)
            # the next row block's maps, one row block ahead (used at this block's last chunk / next block)
            rows_nx = rows + nprog * BLOCK_R
            ok_nx = rows_nx < num_rows
            if HAS_P2E:
                p2e_nx = tl.load(p2e_ptr + rows_nx, mask=ok_nx, other=-1)
            if HAS_WEIGHTS:
                idx_nx = tl.load(ptt_ptr + rows_nx, mask=ok_nx, other=-1)
        elif HAS_P2E:
            p2e = tl.load(p2e_ptr + rows, mask=row_ok, other=-1)
            active = row_ok & (p2e >= 0)
        if HAS_WEIGHTS:
            if PF_RB:
                idx = idx_c.to(tl.int64)
            else:
                idx = tl.load(ptt_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
            w_ok = row_ok & (idx >= 0) & (idx < num_weights)
            w = tl.load(w_ptr + idx, mask=w_ok, other=0.0)
            w = tl.where(w_ok, w, 0.0)
        if not HAS_WEIGHTS:
            w = tl.zeros([BLOCK_R], tl.float32)  # unused
        x_row = x_ptr + rows[:, None] * stride_xm
        PW: tl.constexpr = CH // 2 if X_WORDS else CH  # element slots (words or columns) per chunk
        if BF16_CNT and not I_CNT:
            c_l = tl.zeros([BLOCK_R, PW], tl.int32)
            c_rp = tl.zeros([BLOCK_R, PW], tl.int32)
            c_rn = tl.zeros([BLOCK_R, PW], tl.int32)
        elif PACKED_COUNT:
            pc = tl.zeros([BLOCK_R, PW], tl.int32)
        if PF_RB:
            step_nx = (nprog * BLOCK_R).to(tl.int64) * stride_xm  # x_row of the next row block - x_row
        elif PREFETCH:
            l_n = _load_half(x_row, 0, 0, active, H, CH, X_BF16, X_WORDS)
            r_n = _load_half(x_row, 0, H, active, H, CH, X_BF16, X_WORDS)
        for c0 in range(0, H, CH):
            if PF_RB and PREFETCH2:
                l_raw = l_n
                r_raw = r_n
                l_n = l_nn
                r_n = r_nn
                # the chunk two ahead: in this row block, or past its end the next row block's chunk
                # c0 + 2 CH - NCH CH (NCH >= 2: never further than the next row block)
                cross = c0 + 2 * CH >= NCH * CH
                n_row = x_row + tl.where(cross, step_nx, 0)
                n_act = (rows + tl.where(cross, nprog * BLOCK_R, 0)) < num_rows
                if HAS_P2E:
                    n_act = n_act & (tl.where(cross, p2e_nx, p2e_c) >= 0)
                n_c0 = tl.where(cross, c0 + 2 * CH - NCH * CH, c0 + 2 * CH)
                l_nn = _load_half(n_row, n_c0, 0, n_act, H, CH, X_BF16, X_WORDS)
                r_nn = _load_half(n_row, n_c0, H, n_act, H, CH, X_BF16, X_WORDS)
            elif PF_RB:
                l_raw = l_n
                r_raw = r_n
                # the next chunk of this row block, or after the last one the next row block's first
                # (scalar selects: the row step is a scalar offset, no per-row pointer select)
                last = c0 + CH >= H
                n_row = x_row + tl.where(last, step_nx, 0)
                n_act = (rows + tl.where(last, nprog * BLOCK_R, 0)) < num_rows
                if HAS_P2E:
                    n_act = n_act & (tl.where(last, p2e_nx, p2e_c) >= 0)
                n_c0 = tl.where(last, 0, c0 + CH)
                l_n = _load_half(n_row, n_c0, 0, n_act, H, CH, X_BF16, X_WORDS)
                r_n = _load_half(n_row, n_c0, H, n_act, H, CH, X_BF16, X_WORDS)
            elif PREFETCH:
                l_raw = l_n
                r_raw = r_n
                # the next chunk (all masked after the last one)
                l_n = _load_half(x_row, c0 + CH, 0, active, H, CH, X_BF16, X_WORDS)
                r_n = _load_half(x_row, c0 + CH, H, active, H, CH, X_BF16, X_WORDS)
            else:
                l_raw = _load_half(x_row, c0, 0, active, H, CH, X_BF16, X_WORDS)
                r_raw = _load_half(x_row, c0, H, active, H, CH, X_BF16, X_WORDS)
            if BF16_CLAMP:
                # counts first (they read the unclamped words), then the clamp on the words
                if COUNT:
                    if I_CNT:
                        i_l, i_rp, i_rn = _u32_clamp_counts(i_l, i_rp, i_rn, l_raw, r_raw, cb_pos2, cb_neg2)
                    elif BF16_CNT:
                        c_l = _bf16x2_count(c_l, l_raw, cb_pos, True)
                        c_rp = _bf16x2_count(c_rp, r_raw, cb_pos, True)
                        c_rn = _bf16x2_count(c_rn, r_raw, cb_neg, False)
                    else:
                        l = (l_raw << 16).to(tl.float32, bitcast=True)
                        r = (r_raw << 16).to(tl.float32, bitcast=True)
                        l_hi = (l_raw & -65536).to(tl.float32, bitcast=True)
                        r_hi = (r_raw & -65536).to(tl.float32, bitcast=True)
                        if PACKED_COUNT:
                            pc += _packed_count_inc(l, r, clamp_value) + _packed_count_inc(l_hi, r_hi, clamp_value)
                        else:
                            acc_l += tl.sum((l > clamp_value).to(tl.int32) + (l_hi > clamp_value).to(tl.int32),
                                            axis=1).to(tl.int64)
                            acc_rp += tl.sum((r > clamp_value).to(tl.int32) + (r_hi > clamp_value).to(tl.int32),
                                             axis=1).to(tl.int64)
                            acc_rn += tl.sum((r < -clamp_value).to(tl.int32) + (r_hi < -clamp_value).to(tl.int32),
                                             axis=1).to(tl.int64)
                if XORSIGN_CLAMP:
                    l_raw, r_raw = _bf16x2_clamp_xorsign(l_raw, r_raw, cb_pos, cb_neg)
                else:
                    l_raw, r_raw = _bf16x2_clamp(l_raw, r_raw, cb_pos, cb_neg)
            if X_WORDS:
                # even columns (the low halves) and odd columns (the high halves) as two [R, CH/2] tiles
                l = (l_raw << 16).to(tl.float32, bitcast=True)
                r = (r_raw << 16).to(tl.float32, bitcast=True)
                l_hi = (l_raw & -65536).to(tl.float32, bitcast=True)
                r_hi = (r_raw & -65536).to(tl.float32, bitcast=True)
            else:
                l = _raw_to_f32(l_raw, X_BF16)
                r = _raw_to_f32(r_raw, X_BF16)
            if HAS_CLAMP and COUNT and not BF16_CLAMP:
                # masked elements load as 0 and c >= 0, so they never count: no mask needed
                if I_CNT:
                    i_l, i_rp, i_rn = _u32_clamp_counts(i_l, i_rp, i_rn, l_raw, r_raw, cb_pos2, cb_neg2)
                elif BF16_CNT:
                    c_l = _bf16x2_count(c_l, l_raw, cb_pos, True)
                    c_rp = _bf16x2_count(c_rp, r_raw, cb_pos, True)
                    c_rn = _bf16x2_count(c_rn, r_raw, cb_neg, False)
                elif PACKED_COUNT:
                    pc += _packed_count_inc(l, r, clamp_value)
                    if X_WORDS:
                        pc += _packed_count_inc(l_hi, r_hi, clamp_value)
                else:
                    acc_l += tl.sum((l > clamp_value).to(tl.int32), axis=1).to(tl.int64)
                    acc_rp += tl.sum((r > clamp_value).to(tl.int32), axis=1).to(tl.int64)
                    acc_rn += tl.sum((r < -clamp_value).to(tl.int32), axis=1).to(tl.int64)
                    if X_WORDS:
                        acc_l += tl.sum((l_hi > clamp_value).to(tl.int32), axis=1).to(tl.int64)
                        acc_rp += tl.sum((r_hi > clamp_value).to(tl.int32), axis=1).to(tl.int64)
                        acc_rn += tl.sum((r_hi < -clamp_value).to(tl.int32), axis=1).to(tl.int64)
            CLAMP_F32: tl.constexpr = HAS_CLAMP and not BF16_CLAMP
            FDIV: tl.constexpr = FAST_DIV and FAST_ENC
            # words already clamped (or no clamp) and FAST_DIV: -l from the words, one sign flip per pair
            NL_W: tl.constexpr = X_WORDS and FDIV and not CLAMP_F32
            if NL_W:
                nlw = l_raw ^ -2147450880  # both sign bits flipped
                nl = (nlw << 16).to(tl.float32, bitcast=True)
                nl_hi = (nlw & -65536).to(tl.float32, bitcast=True)
            else:
                nl = l
                nl_hi = l
            # FUSED_SILU (GPU): the words (clamped, or no clamp) to float32 act in one PTX block per four words
            FUSED: tl.constexpr = FUSED_SILU == 4 and NL_W and not EMULATE
            if FUSED:
                act, act_hi = _silu_act_words(l_raw, r_raw)
                if HAS_WEIGHTS:
                    act = act * w[:, None]
                    act_hi = act_hi * w[:, None]
                if HAS_P2E:
                    act = tl.where(active[:, None], act, 0.0)
                    act_hi = tl.where(active[:, None], act_hi, 0.0)
            else:
                act = _act_of(l, nl, r, w, active, clamp_value, CLAMP_F32, MINMAX_CLAMP, FAST_ENC, HAS_WEIGHTS,
                              HAS_P2E, FDIV, HAS_CLAMP, NL_W)
                if X_WORDS:
                    act_hi = _act_of(l_hi, nl_hi, r_hi, w, active, clamp_value, CLAMP_F32, MINMAX_CLAMP, FAST_ENC,
                                     HAS_WEIGHTS, HAS_P2E, FDIV, HAS_CLAMP, NL_W)
            if X_WORDS:
                act3 = tl.reshape(act, (BLOCK_R, G, GB // 2))
                act3_hi = tl.reshape(act_hi, (BLOCK_R, G, GB // 2))
                amax = _amax3_pair(act3, act3_hi, FAST_MAX)
                sf, sf_inv = _scale(amax, sf_clamp_min, ROUND_SF, INT_SCALE)
                q = tl.reshape(_encode_pair(act3, act3_hi, sf_inv[:, :, None], FAST_ENC), (BLOCK_R, CH // 2))
                cw = c0 // 2 + tl.arange(0, CH // 2)
                tl.store(out_ptr + rows[:, None] * stride_om + cw[None, :], q,
                         mask=row_ok[:, None] & (cw < H // 2)[None, :])
            else:
                act3 = tl.reshape(act, (BLOCK_R, G, GB))
                amax = _amax3(act3, FAST_MAX)
                sf, sf_inv = _scale(amax, sf_clamp_min, ROUND_SF, INT_SCALE)
                if FAST_ENC:
                    q = tl.reshape(f32_to_e4m3_bits_satfinite(act3 * sf_inv[:, :, None]), (BLOCK_R, CH))
                else:
                    q = tl.reshape(_encode_e4m3(act3, sf_inv[:, :, None]), (BLOCK_R, CH))
                cols = c0 + tl.arange(0, CH)
                tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], q,
                         mask=row_ok[:, None] & (cols < H)[None, :])
            g0 = c0 // GB
            if PACKED:
                gidx = g0 + tl.arange(0, G)
                e = tl.where(gidx[None, :] < num_groups, sf_to_ue8m0(sf), 0)
                words = pack_ue8m0_words(e)
                widx = g0 // 4 + tl.arange(0, G // 4)
                tl.store(sf_ptr + rows[:, None] * stride_sm + widx[None, :] * stride_sk, words,
                         mask=row_ok[:, None] & (widx[None, :] < num_words))
            else:
                gidx = g0 + tl.arange(0, G)
                tl.store(sf_ptr + rows[:, None] * stride_sm + gidx[None, :] * stride_sk, sf,
                         mask=row_ok[:, None] & (gidx[None, :] < num_groups))
        if I_CNT:
            n_unflushed += 1
            if n_unflushed >= CNT_FLUSH:
                acc_l += _u32_count_decode(i_l)
                acc_rp += _u32_count_decode(i_rp)
                acc_rn += _u32_count_decode(i_rn)
                i_l = tl.zeros([BLOCK_R, CH // 4], tl.int32)
                i_rp = tl.zeros([BLOCK_R, CH // 4], tl.int32)
                i_rn = tl.zeros([BLOCK_R, CH // 4], tl.int32)
                n_unflushed = 0
        elif BF16_CNT:
            acc_l += _words_count_sum(c_l).to(tl.int64)
            acc_rp += _words_count_sum(c_rp).to(tl.int64)
            acc_rn += _words_count_sum(c_rn).to(tl.int64)
        elif PACKED_COUNT and COUNT:
            acc_l += tl.sum(pc & 0x3FF, axis=1).to(tl.int64)
            acc_rp += tl.sum((pc >> 10) & 0x3FF, axis=1).to(tl.int64)
            acc_rn += tl.sum(pc >> 20, axis=1).to(tl.int64)
        if PF_RB:
            if HAS_P2E:
                p2e_c = p2e_nx
            if HAS_WEIGHTS:
                idx_c = idx_nx
        rb += nprog
    if I_CNT:
        acc_l += _u32_count_decode(i_l)
        acc_rp += _u32_count_decode(i_rp)
        acc_rn += _u32_count_decode(i_rn)
    if COUNT:
        tl.atomic_add(cnt_ptr + 0, tl.sum(acc_l))
        tl.atomic_add(cnt_ptr + 1, tl.sum(acc_rp))
        tl.atomic_add(cnt_ptr + 2, tl.sum(acc_rn))


# ------------------------------------------------------------------------------------------------
# Host
# ------------------------------------------------------------------------------------------------
def _check_finite_or_none(name: str, value, positive: bool) -> Optional[float]:
    """None, or a finite real number > 0 (``positive``) or >= 0, as a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, got {value!r}")
    return v


def _check_clamp_value(name: str, value) -> Optional[float]:
    """None, or a finite real number >= 0."""
    return _check_finite_or_none(name, value, positive=False)


def _check_positive(name: str, value) -> Optional[float]:
    """None, or a finite real number > 0."""
    return _check_finite_or_none(name, value, positive=True)


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _chunk_width(H: int, packed: bool) -> int:
    """Largest of 1024/512/256/128 dividing H (packed sf needs >= 512: 4 groups per int32 word)."""
    for ch in (1024, 512) if packed else (1024, 512, 256, 128):
        if H % ch == 0:
            return ch
    return 512 if packed else 128


def _config(H: int, npc: int, packed: bool) -> dict:
    """Default launch config of one row block (passed through ``tuned("swiglu_forward_and_per_token_cast")``).

    The kernel is instruction-bound (two IEEE divisions, exp, e4m3 encode per element): 16 elements
    per thread amortize the per-step work best.  GPU: ``[BLOCK_R, CH]`` = 1024 elements of each half
    per step with 2 warps; npc = H keeps the whole row (CH = next_pow2(H)) in registers, with CH / 512
    warps.  Interpreter: 64 (32) rows per program.  sm_90a SASS at the anchor (H = 3584, clamp 0.5 with
    counts, packed sf), executed instructions per element on the fast path: 42.8 (96 registers) with
    WORDS, BF16X2_COUNT, BF16X2_CLAMP and FAST_DIV off (the defaults before 2026-11-30), 37.1 with
    WORDS + BF16X2_COUNT, 35.1 adding BF16X2_CLAMP, 33.6 with all the defaults below (92 registers, no
    spills; 128-bit loads and stores).  ``programs_per_sm``: the persistent grid of the clamp-counting
    launch (and of PREFETCH_RB).

    H200 sweep (2026-11-30, commit 694bd6c, the anchor, CUDA graph): the kernel was latency-bound, not
    issue-bound (issue time ~137 us of 242.9 us): one row of CH per step, 1 warp, 20 programs per SM on a persistent grid whose
    prefetch crosses row blocks (PREFETCH + PREFETCH_RB: the next chunk, or the next row block's first chunk,
    is in flight while a chunk is computed) took 206.0 us, against 242.9 us for [1024 // CH, CH] x 2 warps
    without prefetch (16 programs per SM: 210.2 us; 8 programs of 2 warps: 221.8 us)."""
    cfg = dict(programs_per_sm=8, FAST_MAX=True, FAST_ENC=True, PREFETCH=False, PREFETCH_RB=False,
               PACKED_COUNT=True, MINMAX_CLAMP=True, WORDS=True, BF16X2_COUNT=True, BF16X2_CLAMP=True,
               FAST_DIV=True, PREFETCH2=False, maxnreg=None, FUSED_SILU=0, INT_COUNT=False, XORSIGN_CLAMP=False,
               INT_SCALE=False, CNT_FLUSH=None)
    if npc == H and not packed:  # packed sf needs npc = 128: H = 128 takes the 128-group chunks (4 groups a word)
        ch = next_power_of_two(H)
        block_r = 32 if interpreter_configs() else 1
        cfg.update(BLOCK_R=block_r, CH=ch, num_warps=max(2, min(16, ch // 512)))
    elif interpreter_configs():
        cfg.update(BLOCK_R=64, CH=_chunk_width(H, packed), num_warps=2)
    else:
        # H200, 2026-11-30, commit 2615106 (the anchor, CUPTI with L2 flushed): the four same-bits instruction cuts
        # together (37.5 -> 30.9 sm_90a instructions per element) took 203.99 us to 171.91 (FUSED_SILU alone 191.50,
        # INT_COUNT alone 194.12); each is dropped by the launcher where it does not apply
        cfg.update(BLOCK_R=1, CH=_chunk_width(H, packed), num_warps=1, programs_per_sm=20, PREFETCH=True,
                   PREFETCH_RB=True, FUSED_SILU=4, INT_COUNT=True, XORSIGN_CLAMP=True, INT_SCALE=True)
    return cfg


def _check_config(cfg: dict, H: int, npc: int, packed: bool) -> None:
    """Reject a (tuning) config the kernel cannot run, with a ValueError."""
    ch, br = cfg["CH"], cfg["BLOCK_R"]
    pow2 = lambda v: isinstance(v, int) and v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(ch) and pow2(br) and pow2(cfg["num_warps"])):
        raise ValueError(f"CH, BLOCK_R and num_warps must be powers of two, got {cfg}")
    if npc == H and not packed:
        if ch < H:
            raise ValueError(f"npc = H = {H} needs CH >= H, got CH={ch}")
    elif ch < 128 or (packed and ch < 512):
        raise ValueError(f"CH must be >= 128 (>= 512 with packed sf), got CH={ch}")
    if cfg["programs_per_sm"] < 1:
        raise ValueError(f"programs_per_sm must be >= 1, got {cfg['programs_per_sm']}")


def _bf16_round_down_bits(c: float) -> int:
    """bf16 bit pattern (0..0xFFFF) of the float32 clamp c rounded toward zero, i.e. down for c >= +-0:
    for a bf16 ``v``, ``v > c`` iff ``v > that`` and ``v < -c`` iff ``v < -that``."""
    return struct.unpack("<I", struct.pack("<f", c))[0] >> 16


def _minmax_clamp_ok(clamp: Optional[float]) -> bool:
    """Whether the min/max clamp (``_swiglu_clamp_minmax``) gives the comparisons' bits for ``clamp``.  It does for
    every c except -0.0: min/max order -0 below +0 where the comparisons see a tie (l = +0 gives -0 instead of
    +0; measured on the H200), so c = -0.0 takes the comparison path."""
    return clamp is None or clamp != 0.0 or math.copysign(1.0, clamp) > 0


def _launch(x, npc, ptt, weights, p2e, col_major, round_sf, packed, clamp, clamped_count, sf_clamp_min):
    num_rows, two_h = x.shape
    H = two_h // 2
    dev = x.device
    out = empty((num_rows, H), torch.float8_e4m3fn, dev)
    sf = alloc_sf(num_rows, H, (1, npc), col_major, packed, dev)
    if num_rows == 0:
        return out, sf
    cfg = tuned("swiglu_forward_and_per_token_cast", _config(H, npc, packed))
    _check_config(cfg, H, npc, packed)
    block_r, ch = cfg["BLOCK_R"], cfg["CH"]
    gb = ch if npc == H and not packed else 128
    num_rb = ceil_div(num_rows, block_r)
    count = clamped_count is not None
    # counting: a persistent grid (programs_per_sm per SM) so the counts take 3 atomics per program
    # (and with PREFETCH_RB, whose prefetch crosses a program's row blocks)
    persistent = count or (cfg["PREFETCH"] and cfg["PREFETCH_RB"])
    grid = (min(num_rb, config.get_num_sms() * cfg["programs_per_sm"]),) if persistent else (num_rb,)
    num_groups = ceil_div(H, npc)
    # bf16 x as int32 words of two elements: needs an even row stride and a 4-byte aligned start
    words = (bool(cfg["WORDS"]) and x.dtype == torch.bfloat16 and x.stride(0) % 2 == 0
             and x.data_ptr() % 4 == 0)
    if words:
        x_arg, stride_x = x.view(torch.int32), x.stride(0) // 2
    else:
        x_arg, stride_x = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x), x.stride(0)
    dummy = out  # never read when its flag is off
    sf_min = sf_clamp_min if sf_clamp_min is not None else FMT_CLAMP["e4m3"]
    bf16_clamp = (clamp is not None and clamp > 0
                  and _bf16_round_down_bits(clamp) << 16 == struct.unpack("<I", struct.pack("<f", clamp))[0])
    # FUSED_SILU: one PTX block per four words of a thread (needs a multiple of four words per thread)
    fused = int(cfg.get("FUSED_SILU", 0) or 0)
    if fused not in (0, 4) or (block_r * ch // 2) % (4 * 32 * cfg["num_warps"]):
        fused = 0
    nch = ceil_div(H, ch)
    # INT_COUNT: a mask sum holds < 2^16 counts per word; a row block adds at most 4 per chunk and word
    cnt_flush = cfg.get("CNT_FLUSH") or max(1, 65535 // (4 * nch))
    extra = {} if cfg.get("maxnreg") is None else dict(maxnreg=cfg["maxnreg"])
    _swiglu_forward_and_per_token_cast_kernel[grid](
        x_arg, out.view(torch.int16) if words else out.view(torch.uint8), sf,
        ptt if ptt is not None else dummy, weights if weights is not None else dummy,
        p2e if p2e is not None else dummy, clamped_count if count else dummy,
        num_rows, weights.numel() if weights is not None else 0, num_groups, ceil_div(num_groups, 4),
        stride_x, out.stride(0) // 2 if words else out.stride(0), sf.stride(0), sf.stride(1),
        clamp if clamp is not None else 0.0,
        sf_clamp_min if sf_clamp_min is not None else FMT_CLAMP["e4m3"],
        _bf16_round_down_bits(clamp) if clamp is not None else 0,
        H=H, X_BF16=x.dtype == torch.bfloat16, HAS_WEIGHTS=ptt is not None, HAS_P2E=p2e is not None,
        HAS_CLAMP=clamp is not None, COUNT=count, ROUND_SF=round_sf, PACKED=packed,
        BLOCK_R=block_r, CH=ch, GB=gb, FAST_MAX=bool(cfg["FAST_MAX"]), FAST_ENC=bool(cfg["FAST_ENC"]),
        PREFETCH=bool(cfg["PREFETCH"]), PREFETCH_RB=bool(cfg["PREFETCH_RB"]), PACKED_COUNT=bool(cfg["PACKED_COUNT"]),
        MINMAX_CLAMP=bool(cfg["MINMAX_CLAMP"]) and _minmax_clamp_ok(clamp), X_WORDS=words,
        BF16X2_COUNT=bool(cfg["BF16X2_COUNT"]) and H <= 256 * ch,
        # the bf16 clamp needs c > 0 to be a bf16 value (c = 0 would make signed-zero ties)
        BF16X2_CLAMP=bool(cfg["BF16X2_CLAMP"]) and clamp is not None and clamp > 0
        and _bf16_round_down_bits(clamp) << 16 == struct.unpack("<I", struct.pack("<f", clamp))[0],
        FAST_DIV=bool(cfg["FAST_DIV"]),
        PREFETCH2=bool(cfg["PREFETCH2"]) and bool(cfg["PREFETCH"]) and bool(cfg["PREFETCH_RB"]) and ceil_div(H, ch) >= 2,
        # same-bits instruction cuts (see the kernel): on in the GPU default of npc < H
        FUSED_SILU=fused if words and (clamp is None or (bool(cfg["BF16X2_CLAMP"]) and bf16_clamp)) else 0,
        INT_COUNT=bool(cfg.get("INT_COUNT", False)) and ch % 4 == 0, CNT_FLUSH=int(cnt_flush),
        XORSIGN_CLAMP=bool(cfg.get("XORSIGN_CLAMP", False)),
        INT_SCALE=bool(cfg.get("INT_SCALE", False)) and round_sf and sf_min >= 2.0 ** -118,
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False, **extra, **pdl_args(out.device))  # see the module docstring
    return out, sf


def _launch_fake(x, npc, ptt, weights, p2e, col_major, round_sf, packed, clamp, clamped_count, sf_clamp_min):
    num_rows, H = x.shape[0], x.shape[1] // 2
    return (x.new_empty((num_rows, H), dtype=torch.float8_e4m3fn),
            alloc_sf(num_rows, H, (1, npc), col_major, packed, x.device))


@custom_op("swiglu_forward_and_per_token_cast", mutates_args=("clamped_count",), fake=_launch_fake)
def _launch_op(x: torch.Tensor, npc: int, ptt: Optional[torch.Tensor], weights: Optional[torch.Tensor],
               p2e: Optional[torch.Tensor], col_major: bool, round_sf: bool, packed: bool, clamp: Optional[float],
               clamped_count: Optional[torch.Tensor],
               sf_clamp_min: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.library`` op ``tritile::swiglu_forward_and_per_token_cast`` (validated arguments)."""
    return _launch(x, npc, ptt, weights, p2e, col_major, round_sf, packed, clamp, clamped_count, sf_clamp_min)


@planned("swiglu_forward_and_per_token_cast")
def swiglu_forward_and_per_token_cast(
        x: torch.Tensor, fmt: str, num_per_channels: int, pos_to_token_topk: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None, pos_to_expert: Optional[torch.Tensor] = None,
        use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False, use_packed_ue8m0: bool = False,
        swiglu_clamp_value: Optional[float] = None, clamped_count: Optional[torch.Tensor] = None,
        sf_clamp_min: Optional[float] = None) -> QuantTensor:
    """SwiGLU of the fused MoE rows, then a per-token FP8 e4m3 cast with ``npc``-wide scale groups.

    Per row e and column j < H: ``l = x[e, j]``, ``r = x[e, j + H]`` (float32); with a clamp c,
    ``l = min(l, c)`` and ``r`` clamped to ``[-c, c]``; ``act = (l / (1 + exp(-l))) * r``, then
    ``act * w_e`` with routing weights.  The float32 act is quantized per (row, group of npc columns)
    as ``spec/quant.md`` §2.2 says (amax clamped below by ``sf_clamp_min`` or 1e-4; sf = a/448).

    Args:
        x: bf16 or float32 ``(E, 2H)``, H % 128 == 0, unit column stride (rows may be strided).
        fmt: ``'e4m3'`` (the only format).
        num_per_channels: npc, 128 or H.
        pos_to_token_topk: optional int32 ``(E,)`` flat index ``t*K + k`` into ``topk_weights``; a negative
            index (or one past ``topk_weights``) gives weight 0.  Requires ``topk_weights``.
        topk_weights: float32 ``(T, K)`` contiguous, read as ``topk_weights.flat[index]``.
        pos_to_expert: optional int32 ``(E,)``; rows with a negative entry are padding: they are treated
            as all-zero activations (codes +0, sf = the clamp-minimum scale) and are not counted.
        use_tma_aligned_col_major_sf / round_sf / use_packed_ue8m0: the sf layout and rounding of §2.3
            (column-major needs npc == 128; packed needs column-major and round_sf).
        swiglu_clamp_value: optional clamp c >= 0.
        clamped_count: optional int64 ``(3,)``, requires a clamp; updated in place with ``+=`` of
            ``#(l > c)``, ``#(r > c)``, ``#(r < -c)`` over the non-padding rows, before clamping.
        sf_clamp_min: optional lower clamp of the amax (> 0) instead of 1e-4.

    Returns:
        ``(out, sf)``: out float8_e4m3fn ``(E, H)``; sf float32 ``(E, ceil(H/npc))`` (row-major or
        column-major ``(1, A4(E))`` strides), or int32 ``(E, ceil(H/npc/4))`` packed UE8M0.

    Non-finite values: a group holding inf or NaN in act gets sf = +inf (UE8M0 0xFF) and its codes are
    ``e4m3(act * 0)``: +-0 for finite elements, NaN for non-finite ones, so it dequantizes to NaN.
    """
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float32), ndim=2)
    check_choice("fmt", fmt, ("e4m3",))
    if x.shape[1] % 256 != 0 or x.shape[1] == 0:
        raise ValueError(f"x must have 2*H columns with H a positive multiple of 128, got shape {tuple(x.shape)}")
    num_rows, H = x.shape[0], x.shape[1] // 2
    check_inner_contiguous("x", x)
    npc = _check_int("num_per_channels", num_per_channels)
    if npc not in (128, H):
        raise ValueError(f"num_per_channels must be 128 or H={H}, got {npc}")
    check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if use_tma_aligned_col_major_sf and npc != 128:
        raise ValueError(f"use_tma_aligned_col_major_sf=True requires num_per_channels=128, got {npc}")
    if (pos_to_token_topk is None) != (topk_weights is None):
        raise ValueError("pos_to_token_topk and topk_weights must be given together, got "
                         f"pos_to_token_topk={'a tensor' if pos_to_token_topk is not None else 'None'} and "
                         f"topk_weights={'a tensor' if topk_weights is not None else 'None'}")
    if pos_to_token_topk is not None:
        check_tensor("pos_to_token_topk", pos_to_token_topk, dtypes=(torch.int32,), ndim=1)
        check_shape("pos_to_token_topk", pos_to_token_topk, (num_rows,))
        check_contiguous("pos_to_token_topk", pos_to_token_topk)
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2)
        check_contiguous("topk_weights", topk_weights)
    if pos_to_expert is not None:
        check_tensor("pos_to_expert", pos_to_expert, dtypes=(torch.int32,), ndim=1)
        check_shape("pos_to_expert", pos_to_expert, (num_rows,))
        check_contiguous("pos_to_expert", pos_to_expert)
    clamp = _check_clamp_value("swiglu_clamp_value", swiglu_clamp_value)
    if clamped_count is not None:
        if clamp is None:
            raise ValueError("clamped_count requires swiglu_clamp_value, got swiglu_clamp_value=None")
        check_tensor("clamped_count", clamped_count, dtypes=(torch.int64,), ndim=1)
        check_shape("clamped_count", clamped_count, (3,))
        check_contiguous("clamped_count", clamped_count)
        check_no_overlap(dict(clamped_count=clamped_count),
                         dict(x=x, pos_to_token_topk=pos_to_token_topk, topk_weights=topk_weights,
                              pos_to_expert=pos_to_expert))
    sf_clamp_min = _check_positive("sf_clamp_min", sf_clamp_min)
    check_same_device(x=x, pos_to_token_topk=pos_to_token_topk, topk_weights=topk_weights,
                      pos_to_expert=pos_to_expert, clamped_count=clamped_count)
    return _launch_op(x, npc, pos_to_token_topk, topk_weights, pos_to_expert, use_tma_aligned_col_major_sf,
                   round_sf, use_packed_ue8m0, clamp, clamped_count, sf_clamp_min)

