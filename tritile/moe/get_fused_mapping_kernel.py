"""``get_fused_mapping``: token-major top-k slots -> expert-major fused layout (a stable counting sort).

Canonical order (tritile): inside each expert's aligned segment the valid slots sit at the front in
ascending flat index ``t*K + k`` (what a stable ``argsort(topk_idx.flatten())`` gives), padding at the
back.  The result depends neither on the SM count nor on the launch configuration.

Launch scheme (no grid barrier, no spin-wait; the CPU interpreter runs programs one after another).  The flat
slot range is cut into ``P`` chunks of ``CHUNK`` slots:

1. ``_fused_mapping_count_kernel`` (``P`` programs): per-chunk expert histograms ``counts[P, E]`` (with
   ``PACKED``, E <= 4: one int64 sum of ``1 << 16*e``, four 16-bit counters, instead of ``tl.histogram``);
2. only when the table is large (``next_pow2(P) * BLOCK_E > fuse_scan``): ``_fused_mapping_scan_kernel`` (one
   program per ``EB`` experts) turns each column of ``counts`` into its exclusive prefix over chunks and appends
   the totals as row ``P``.  Otherwise (``TABLE_ROWS > 0``) every scatter program loads the whole small table
   and sums it itself: the totals, and its prefix over the earlier chunks;
3. ``_fused_mapping_scatter_kernel`` (``P`` programs): forms the aligned segments from the totals, then places
   its chunk.  ``PACKED``: the whole chunk at once; the exclusive cumsum of the int64 ``1 << 16*e`` gives in
   field ``e`` each slot's rank among the earlier slots of its expert, and the expert's base is picked by
   ``BLOCK_E`` selects.  Otherwise ``SB`` slots at a time: a slot's position is its expert's running base (a
   gather from a ``[BLOCK_E]`` vector) plus its rank among the earlier slots of the same expert in the
   sub-block (an ``[SB, SB]`` comparison, independent of the number of experts).  It also writes the padding
   of the segments it owns (experts ``pid, pid + P, ...``) and, with a caller-given length, its share of the
   positions past the last segment.

Small inputs (``T*K <= single_max``) take one launch of one program that counts, scans and scatters.
All outputs (and the small scratch table) live in one int32 allocation, so a call costs one allocation, one
to three launches and, in the synchronising mode, one device-to-host copy.  The kernels take that buffer as one
pointer and compute the pieces' offsets themselves (6 scatter arguments instead of 14: Triton's launch path costs
per argument), and the host cuts the views once, after the sync in the synchronising mode.

Checks: argument types, ranks, dtypes, contiguity, value ranges of the ints and the int32 position bound are host
checks without device work.  What only the data reveals (ids outside ``[-1, E)``, a too small
``num_expanded_tokens``) is checked with ``TRITILE_CHECKS=1`` only (host syncs); otherwise such slots are dropped,
never written out of bounds.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import torch
import triton
import triton.language as tl

from .. import runtime as _rt
from ..language.pdl import pdl_args, pdl_enter
from ..runtime import (check_contiguous, check_device, check_tensor, checks_enabled, custom_op, empty,
                       interpreter_configs, override_key, tuned)
from ..config import get_num_sms
from ..utils import align, ceil_div, next_power_of_two
from ..runtime.plan import planned, unplannable

__all__ = ["get_fused_mapping"]

#: Largest ``num_experts`` (TileKernels' limit; the one-hot tiles grow with it).
MAX_EXPERTS = 1024


@triton.jit
def _fused_mapping_count_kernel(topk_ptr, counts_ptr, numel, num_experts,
                                CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                                PACKED: tl.constexpr, PDL: tl.constexpr = False):
    """counts[pid, e] = #slots of expert e in the flat range [pid*CHUNK, (pid+1)*CHUNK).  ``PACKED``
    (``BLOCK_E <= 4``, ``CHUNK < 2**16``): one int64 sum of ``1 << 16*e`` (four 16-bit counters) instead of a
    histogram (shared-memory atomics)."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    e_ar = tl.arange(0, BLOCK_E)
    if PACKED:
        s = tl.zeros([BLOCK], dtype=tl.int64)
    else:
        acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    # Trip counts are compile-time constants: the CPU interpreter (numpy >= 2.4) cannot loop to a run-time bound.
    for it in range(CHUNK // BLOCK):
        offs = pid * CHUNK + it * BLOCK + tl.arange(0, BLOCK)
        m = offs < numel
        e = tl.load(topk_ptr + offs, mask=m, other=-1)
        valid = m & (e >= 0) & (e < num_experts)
        if PACKED:
            s += tl.where(valid, tl.full([BLOCK], 1, tl.int64) << (tl.where(valid, e, 0) * 16), 0)
        else:
            acc += tl.histogram(tl.where(valid, e, 0).to(tl.int32), BLOCK_E, mask=valid)
    if PACKED:
        acc = ((tl.sum(s, axis=0) >> (e_ar.to(tl.int64) * 16)) & 0xFFFF).to(tl.int32)
    tl.store(counts_ptr + pid * BLOCK_E + e_ar, acc)


@triton.jit
def _fused_mapping_scan_kernel(counts_ptr, num_chunks, TP: tl.constexpr, EB: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """Columns ``pid*EB ..`` of ``counts[P, BLOCK_E]``: each entry becomes the sum over the earlier chunks;
    row ``P`` receives the totals."""
    pdl_enter(PDL)
    cols = tl.program_id(0) * EB + tl.arange(0, EB)
    carry = tl.zeros([EB], dtype=tl.int32)
    r0 = 0
    while r0 < num_chunks:  # a while loop: run-time bound that the interpreter accepts
        rows = r0 + tl.arange(0, TP)
        m = (rows < num_chunks)[:, None]
        ptrs = counts_ptr + rows[:, None].to(tl.int64) * BLOCK_E + cols[None, :]
        t = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(t, axis=0) - t + carry[None, :], mask=m)
        carry += tl.sum(t, axis=0)
        r0 += TP
    tl.store(counts_ptr + num_chunks * BLOCK_E + cols, carry)  # < 2**31: (T*K / CHUNK) * BLOCK_E


@triton.jit
def _store_slots(token_topk_to_pos_ptr, pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr, offs, m, valid,
                 pos, e32, num_expanded, NUM_TOPK: tl.constexpr):
    """Write a block of flat slots ``offs`` (``m``: in range) placed at ``pos``: token_topk_to_pos (-1 for an
    invalid slot or one past ``num_expanded``) and, for the placed ones, the three inverse maps."""
    ok = valid & (pos < num_expanded)
    tl.store(token_topk_to_pos_ptr + offs, tl.where(ok, pos, -1), mask=m)
    pos64 = pos.to(tl.int64)
    tl.store(pos_to_expert_ptr + pos64, e32, mask=ok)
    tl.store(pos_to_token_ptr + pos64, (offs // NUM_TOPK).to(tl.int32), mask=ok)
    tl.store(pos_to_token_topk_ptr + pos64, offs.to(tl.int32), mask=ok)


@triton.jit
def _lane_ranks(eg, valid, N: tl.constexpr, LANES: tl.constexpr, FIELD: tl.constexpr):
    """int32 ``[N]``: each valid slot's rank among the earlier valid slots of its expert ``eg`` (int32 ``[N]``), from
    an exclusive cumsum of int64 one-hots in ``LANES`` lanes of ``64 // FIELD`` FIELD-bit counters (experts
    ``FPL*l .. FPL*l + FPL-1`` in lane ``l``).  An exclusive count must fit its field (N <= 2**FIELD); an inclusive
    one may carry into the next field, which the subtraction of ``one`` undoes exactly (mod 2**64)."""
    FPL: tl.constexpr = 64 // FIELD
    sh = (eg % FPL).to(tl.int64) * FIELD
    l_ar = tl.arange(0, LANES)
    in_lane = valid[:, None] & ((eg // FPL)[:, None] == l_ar[None, :])
    one = tl.where(in_lane, tl.full([N, LANES], 1, tl.int64) << sh[:, None], 0)
    excl = tl.sum(tl.where(in_lane, tl.cumsum(one, axis=0) - one, 0), axis=1)
    return ((excl >> sh) & ((1 << FIELD) - 1)).to(tl.int32)


@triton.jit
def _fused_mapping_scatter_kernel(topk_ptr, buf_ptr, numel, num_experts, num_expanded, alignment,
                                  NUM_TOPK: tl.constexpr, SINGLE: tl.constexpr, TABLE_ROWS: tl.constexpr,
                                  PACKED: tl.constexpr, FILL_TAIL: tl.constexpr, CHUNK: tl.constexpr,
                                  SB: tl.constexpr, HIST_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                                  PAD_ITERS: tl.constexpr, PAD_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                                  LANES: tl.constexpr = 1, FIELD: tl.constexpr = 16, SUB: tl.constexpr = 0,
                                  PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_chunks = nprog
    # Every output is a piece of one int32 buffer (``_pieces``): the count table (absent with SINGLE), then
    # pos_to_expert / pos_to_token / pos_to_token_topk (num_expanded each), expert_start / expert_end /
    # num_per_expert (num_experts each), token_topk_to_pos (numel), each piece padded to 32 words (128 bytes).
    # One pointer instead of nine: fewer launch arguments (host cost); `// 32 * 32` keeps the alignment known.
    counts_ptr = buf_ptr
    if SINGLE:
        tab_words = tl.cast(0, tl.int64)
    else:
        tab_words = (tl.cast(nprog + 1, tl.int64) * BLOCK_E + 31) // 32 * 32
    n_words = (tl.cast(num_expanded, tl.int64) + 31) // 32 * 32
    e_words = (tl.cast(num_experts, tl.int64) + 31) // 32 * 32
    pos_to_expert_ptr = buf_ptr + tab_words
    pos_to_token_ptr = pos_to_expert_ptr + n_words
    pos_to_token_topk_ptr = pos_to_token_ptr + n_words
    expert_start_ptr = pos_to_token_topk_ptr + n_words
    expert_end_ptr = expert_start_ptr + e_words
    num_per_expert_ptr = expert_end_ptr + e_words
    token_topk_to_pos_ptr = num_per_expert_ptr + e_words
    e_ar = tl.arange(0, BLOCK_E)
    c_start = pid.to(tl.int64) * CHUNK
    if PACKED and (SUB == 0 or LANES == 1):  # the chunk's ids first, so that their load overlaps the count table's
        offs = c_start + tl.arange(0, CHUNK)
        m = offs < numel
        e = tl.load(topk_ptr + offs, mask=m, other=-1)

    # ---- expert totals and this chunk's prefix over earlier chunks ----
    if SINGLE:
        total = tl.zeros([BLOCK_E], dtype=tl.int32)
        prefix = tl.zeros([BLOCK_E], dtype=tl.int32)
        for it in range(CHUNK // HIST_BLOCK):  # own names: the packed path keeps the chunk's offs / e loaded above
            h_offs = it * HIST_BLOCK + tl.arange(0, HIST_BLOCK).to(tl.int64)
            h_m = h_offs < numel
            h_e = tl.load(topk_ptr + h_offs, mask=h_m, other=-1)
            h_valid = h_m & (h_e >= 0) & (h_e < num_experts)
            total += tl.histogram(tl.where(h_valid, h_e, 0).to(tl.int32), BLOCK_E, mask=h_valid)
    elif TABLE_ROWS > 0:
        # The per-chunk counts (not scanned): every program sums the whole small table itself (one [rows, E]
        # load from L2), so no scan launch is needed.
        r = tl.arange(0, TABLE_ROWS)
        tab = tl.load(counts_ptr + r[:, None] * BLOCK_E + e_ar[None, :], mask=(r < num_chunks)[:, None], other=0)
        total = tl.sum(tab, axis=0)
        prefix = tl.sum(tl.where((r < pid)[:, None], tab, 0), axis=0)
    else:
        total = tl.load(counts_ptr + num_chunks * BLOCK_E + e_ar)
        prefix = tl.load(counts_ptr + pid.to(tl.int64) * BLOCK_E + e_ar)

    # ---- aligned segments: a_e = ceil(c_e / A) * A, start_e = sum_{e' < e} a_e' ----
    aligned = (total + alignment - 1) // alignment * alignment
    seg_end = tl.cumsum(aligned, axis=0)
    seg_start = seg_end - aligned
    if pid == 0:
        em = e_ar < num_experts
        tl.store(expert_start_ptr + e_ar, seg_start, mask=em)
        tl.store(expert_end_ptr + e_ar, seg_end, mask=em)
        tl.store(num_per_expert_ptr + e_ar, aligned, mask=em)

    # ---- scatter this program's chunk in ascending flat order ----
    base = seg_start + prefix
    if PACKED and LANES == 1:
        # BLOCK_E <= 4: the whole chunk at once.  Each valid slot contributes 1 << 16*e to an int64 whose four
        # 16-bit fields count the experts; the exclusive cumsum's field e is the slot's rank among the
        # earlier slots of its expert (CHUNK < 2**16).  The base is picked by BLOCK_E selects (no gather).
        valid = m & (e >= 0) & (e < num_experts)
        sh = tl.where(valid, e, 0) * 16
        one = tl.where(valid, tl.full([CHUNK], 1, tl.int64) << sh, 0)
        excl = tl.cumsum(one, axis=0) - one
        e32 = tl.where(valid, e, -1).to(tl.int32)
        pos = ((excl >> sh) & 0xFFFF).to(tl.int32)
        for ej in tl.static_range(BLOCK_E):
            pos += tl.where(e32 == ej, tl.sum(tl.where(e_ar == ej, base, 0), axis=0), 0)
        _store_slots(token_topk_to_pos_ptr, pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr, offs, m,
                     valid, pos, e32, num_expanded, NUM_TOPK)
    elif PACKED and SUB == 0:
        # BLOCK_E = (64 / FIELD) * LANES: the same in LANES int64 lanes of FIELD-bit counters (experts
        # FPL*l .. FPL*l + FPL-1 in lane l), one [CHUNK, LANES] cumsum along the chunk instead of CHUNK / SB
        # dependent steps; the base is gathered.  8-bit fields (CHUNK <= 256: an exclusive count is at most 255;
        # an inclusive one may carry into the next field, which the subtraction of ``one`` undoes exactly, mod
        # 2**64) halve the lanes of 16-bit ones.
        valid = m & (e >= 0) & (e < num_experts)
        eg = tl.where(valid, e, 0).to(tl.int32)
        pos = _lane_ranks(eg, valid, CHUNK, LANES, FIELD) + tl.gather(base, eg, axis=0)
        _store_slots(token_topk_to_pos_ptr, pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr, offs, m,
                     valid, pos, tl.where(valid, eg, -1), num_expanded, NUM_TOPK)
    elif PACKED:
        # The chunk in CHUNK / SUB sub-blocks, one after another: the lane ranks inside a sub-block (SUB <= 256
        # with 8-bit fields) plus the expert's running base, which the sub-block's histogram then advances.  Large
        # chunks (few count-table rows for each program to sum) with narrow counters: [SUB, LANES] cumsums of
        # 8-bit fields instead of one [CHUNK, 2 * LANES] cumsum of 16-bit ones.
        for it in range(CHUNK // SUB):
            s_offs = c_start + it * SUB + tl.arange(0, SUB)
            s_m = s_offs < numel
            s_e = tl.load(topk_ptr + s_offs, mask=s_m, other=-1)
            valid = s_m & (s_e >= 0) & (s_e < num_experts)
            eg = tl.where(valid, s_e, 0).to(tl.int32)
            pos = _lane_ranks(eg, valid, SUB, LANES, FIELD) + tl.gather(base, eg, axis=0)
            base += tl.histogram(eg, BLOCK_E, mask=valid)
            _store_slots(token_topk_to_pos_ptr, pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr, s_offs,
                         s_m, valid, pos, tl.where(valid, eg, -1), num_expanded, NUM_TOPK)
    else:
        # ---- this program's chunk in ascending flat order, SB slots at a time ----
        i_ar = tl.arange(0, SB)
        earlier = i_ar[None, :] < i_ar[:, None]  # [i, j]: j comes before i
        for it in range(CHUNK // SB):
            offs = c_start + it * SB + i_ar
            m = offs < numel
            e = tl.load(topk_ptr + offs, mask=m, other=-1)
            valid = m & (e >= 0) & (e < num_experts)
            e32 = tl.where(valid, e, -1).to(tl.int32)
            rank = tl.sum(((e32[:, None] == e32[None, :]) & earlier).to(tl.int32), axis=1)
            eg = tl.where(valid, e32, 0)
            pos = tl.gather(base, eg, axis=0) + rank
            base += tl.histogram(eg, BLOCK_E, mask=valid)
            _store_slots(token_topk_to_pos_ptr, pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr, offs, m,
                         valid, pos, e32, num_expanded, NUM_TOPK)

    # ---- padding at the back of the segments this program owns (experts pid, pid + P, ...) ----
    p_ar = tl.arange(0, PAD_BLOCK)
    neg = tl.full([PAD_BLOCK], -1, dtype=tl.int32)
    if PAD_ITERS > 0:
        pad_start = seg_start + total
        pad_len = aligned - total
        ex = pid
        while ex < num_experts:
            sel = e_ar == ex
            s = tl.sum(tl.where(sel, pad_start, 0))
            n = tl.sum(tl.where(sel, pad_len, 0))
            for j in range(PAD_ITERS):
                q = j * PAD_BLOCK + p_ar
                p = (s + q).to(tl.int64)
                mk = (q < n) & (p < num_expanded)
                tl.store(pos_to_expert_ptr + p, neg, mask=mk)
                tl.store(pos_to_token_ptr + p, neg, mask=mk)
                tl.store(pos_to_token_topk_ptr + p, neg, mask=mk)
            ex += nprog

    # ---- caller-sized buffer: positions past the last segment are padding too ----
    if FILL_TAIL:
        t_ar = tl.arange(0, TAIL_BLOCK)
        negt = tl.full([TAIL_BLOCK], -1, dtype=tl.int32)
        t0 = tl.max(seg_end, axis=0).to(tl.int64) + pid.to(tl.int64) * TAIL_BLOCK
        while t0 < num_expanded:
            p = t0 + t_ar
            mk = p < num_expanded
            tl.store(pos_to_expert_ptr + p, negt, mask=mk)
            tl.store(pos_to_token_ptr + p, negt, mask=mk)
            tl.store(pos_to_token_topk_ptr + p, negt, mask=mk)
            t0 += nprog.to(tl.int64) * TAIL_BLOCK


def _check_int(name: str, v, lo: int, hi: int = None) -> int:
    if type(v) is int and v >= lo and (hi is None or v <= hi):  # the common case, first
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}, got {v}")
    return v


@functools.lru_cache(maxsize=64)
def _default_config(num_experts: int, numel: int, num_sms: int, interp: bool) -> dict:
    """Launch config (a dict, so that ``python -m tritile tune`` can override it).  ``chunk``: slots per program;
    ``sb``: slots placed per step (the rank is an ``[sb, sb]`` comparison); ``single_max``: largest ``T*K``
    that takes the one-program path."""
    if interp:
        return dict(chunk=4096, sb=64, single_max=512, num_warps=4, scan_tp=64, scan_eb=64, packed=True,
                    fuse_scan=8192, lanes_max=8, single_warps=4)
    if num_experts <= 4:
        # Packed ranks, two launches.  SASS (sm_90, T*K = 324612): 984 instructions per 1024-slot program
        # (8 slots per thread, no loop, 25 barriers) against 8 x 733 per 512 slots (96 barriers) before.
        return dict(chunk=1024, sb=64, single_max=1024, num_warps=4, scan_tp=32, scan_eb=32, packed=True,
                    fuse_scan=8192, lanes_max=8, single_warps=4)
    block_e = next_power_of_two(num_experts)
    if 8 < num_experts <= 32 and numel > 1024:
        # 8-bit counters (eight experts a lane: 2 or 4 lanes) on small chunks, while the count table of every
        # chunk that each program sums stays within 8192 words (32 KB of L2 reads a program).  H200 (2026-12-02,
        # CUPTI, sync mode, results bit-identical): E = 9, T*K = 15804: 3.71 us at 128 slots against 6.66 (16-bit
        # counters on 512); T*K = 110934: 6.35 at 256 against 8.04 (at 128 slots, 867 chunks: 10.73); E = 32,
        # T*K = 17934: 4.83 at 128 against 6.15.  Past the table bound, the sub-block rule below.
        for chunk in (128, 256):
            if next_power_of_two(ceil_div(numel, chunk)) * block_e <= 8192:
                return dict(chunk=chunk, sb=64, single_max=1024, num_warps=4, scan_tp=32, scan_eb=32, packed=True,
                            fuse_scan=8192, lanes_max=8, single_warps=8, field_bits=8)
    if 8 < num_experts <= 32:
        # Past that bound: 512- or 1024-slot chunks (few table rows), ranked in 256-slot sub-blocks of 8-bit counters
        # (SUB: [256, BLOCK_E / 8] cumsums, the running base advanced by each sub-block's histogram; T*K <= 1024 takes
        # the one-program path, with 16-bit counters).  H200
        # (2026-12-02, commit f3eaa87, CUPTI, no-sync mode, results bit-identical), against the 16-bit rules before
        # ([CHUNK, 8] one-hots at E = 32, [CHUNK, 4] at E = 9): E = 32, T*K = 112266 (TileKernels 8.73 us) 11.56 ->
        # 9.19 us; 174280 19.92 -> 14.39 (1024-slot chunks; 512: 14.94); 207846 19.90 -> 14.65; E = 9, T*K =
        # 175480 9.57 -> 8.20 (512; 1024: 10.99), 210429 10.75 -> 9.38.  Chunks of 2048 slots 14.3-23.8 us.  At E = 32
        # the chunk keeps about two programs an SM; at E <= 16 512 slots won everywhere.
        chunk = 512
        if num_experts > 16:
            chunk = max(512, min(1024, next_power_of_two(ceil_div(numel, 2 * max(num_sms, 1)))))
        big = numel > 1024
        return dict(chunk=chunk, sb=64, single_max=1024, num_warps=4, scan_tp=32, scan_eb=32, packed=True,
                    fuse_scan=16384, lanes_max=8, single_warps=8, field_bits=8 if big else 16, sub=256 if big else 0)
    if num_experts <= 16:
        # 5-8 experts: the packed ranks in BLOCK_E / 4 lanes, the whole chunk in one step (before: [SB, SB]
        # rank steps, 16.9 us at T*K = 15804, E = 9 against TileKernels' 6.68).  [CHUNK, LANES] int64 one-hots of
        # 2048 entries on 4 warps (ptxas, sm_90: 124 registers at [512, 4], 209 at [512, 8], no spills); the
        # one-program path on 8 warps (128 registers at [1024, 4]; 236 on 4 warps).
        lanes = max(1, next_power_of_two(num_experts) // 4)
        return dict(chunk=max(256, 2048 // lanes), sb=64, single_max=1024, num_warps=4, scan_tp=32, scan_eb=32,
                    packed=True, fuse_scan=8192, lanes_max=8, single_warps=8)
    # More experts: the [SB, SB] rank steps.
    return dict(chunk=512, sb=64, single_max=1024, num_warps=2, scan_tp=32, scan_eb=32, packed=True, fuse_scan=8192,
                lanes_max=8, single_warps=2)  # H200 sweep (unpacked, 3 launches): 30 vs 60 us


@functools.lru_cache(maxsize=256)
def _plan(numel: int, num_topk: int, num_experts: int, alignment: int, chunk: int, sb: int, single_max: int,
          num_warps: int, scan_tp: int, scan_eb: int, packed: bool, fuse_scan: int, lanes_max: int = 8,
          single_warps: int = 4, field_bits: int = 16, sub: int = 0) -> dict:
    """Block sizes and chunking.  Constexprs are rounded to powers of two so that a GPU compiles few variants
    while T varies.  Cached: the host path is latency-critical."""
    block_e = max(2, next_power_of_two(num_experts))
    sb = next_power_of_two(sb)
    single = numel <= single_max
    if single:
        num_chunks = 1
        chunk = max(sb, next_power_of_two(max(numel, 1)))
    else:
        chunk = max(sb, next_power_of_two(chunk))
        num_chunks = ceil_div(numel, chunk)
    pad_block = min(1024, max(16, next_power_of_two(alignment - 1)))
    scan_eb = min(next_power_of_two(scan_eb), block_e)
    # packed: int64s of four 16-bit counters per slot (LANES of them: E <= 4 * lanes_max) instead of the [SB, SB]
    # rank comparison; the count kernel packs only at E <= 4 (else tl.histogram).
    # field_bits = 8: eight 8-bit counters a lane, for BLOCK_E >= 16 (lanes of several experts) and CHUNK <= 256
    # sub > 0: the scatter ranks its chunk in sub-blocks of ``sub`` slots (a power of two below the chunk; 8-bit
    # fields need sub <= 256), each advancing the experts' running base by its histogram
    sub = next_power_of_two(sub) if 0 < sub < chunk else 0
    field = 8 if field_bits == 8 and block_e >= 16 and (sub or chunk) <= 256 else 16
    lanes = max(1, block_e // (64 // field))
    packed_scatter = bool(packed) and lanes <= max(1, lanes_max) and chunk < 2**16
    if lanes == 1:
        sub = 0  # E <= 4: the whole chunk in one int64 lane
    packed = bool(packed) and block_e <= 4 and chunk < 2**16
    if packed_scatter:
        sb = 64  # unused: keep one variant
    # table_rows > 0: the scatter sums the per-chunk count table itself (no scan launch).
    table_rows = 0 if single else next_power_of_two(num_chunks)
    if table_rows * block_e > fuse_scan:
        table_rows = 0
    return dict(single=single, num_chunks=num_chunks, block_e=block_e,
                num_warps=single_warps if single else num_warps, table_rows=table_rows,
                count=dict(CHUNK=chunk, BLOCK=min(chunk, 2048), BLOCK_E=block_e, PACKED=packed),
                scan=dict(TP=next_power_of_two(scan_tp), EB=scan_eb, BLOCK_E=block_e),
                scan_grid=block_e // scan_eb,
                scatter=dict(NUM_TOPK=num_topk, SINGLE=single, TABLE_ROWS=table_rows, PACKED=packed_scatter,
                             CHUNK=chunk, SB=sb, HIST_BLOCK=min(chunk, 2048), BLOCK_E=block_e,
                             PAD_ITERS=ceil_div(alignment - 1, pad_block) if alignment > 1 else 0,
                             PAD_BLOCK=pad_block, TAIL_BLOCK=1024, LANES=lanes if packed_scatter else 1,
                             FIELD=field if packed_scatter else 16, SUB=sub if packed_scatter else 0))


@functools.lru_cache(maxsize=256)
def _host_plan(num_tokens: int, num_topk: int, num_experts: int, alignment: int, num_expanded: int, sync_mode: bool,
               override) -> tuple:
    """Everything a call of this shape needs besides the data, cached (the host path is latency-bound):

    ``(total, launches, t2p_off, pos_off, e_off, sync_start, fixed_views)``: the buffer's length in int32 words; the
    kernel launches as ``(kernel, grid, scalars, constexprs, num_warps)`` (scalars and constexprs in signature order
    after the tensors: launched positionally, no keyword dicts); the word offsets of token_topk_to_pos, of the three
    position maps (``pos_off + i * na``) and of the three expert vectors (``e_off + i * ea``); the offset of
    num_tokens_per_expert (what the synchronising mode reads back); and, when the views' length is known before the
    launch, ``(num_view, na, ea)`` (else None).  ``override``: ``override_key("get_fused_mapping")``, so tuning
    sweeps see their candidates."""
    numel = num_tokens * num_topk
    c = tuned("get_fused_mapping", _default_config(num_experts, numel, get_num_sms(), interpreter_configs()))
    cfg = _plan(numel, num_topk, num_experts, alignment, c["chunk"], c["sb"], c["single_max"], c["num_warps"],
                c["scan_tp"], c["scan_eb"], c["packed"], c["fuse_scan"], c.get("lanes_max", 8),
                c.get("single_warps", c["num_warps"]), c.get("field_bits", 16), c.get("sub", 0))
    num_chunks = cfg["num_chunks"]
    table = 0 if cfg["single"] or numel == 0 else (num_chunks + 1) * cfg["block_e"]
    num_view = 0 if sync_mode else num_expanded  # the synchronising mode's length comes from the data
    total = _pieces(num_expanded, num_expanded, num_experts, numel, table)[1]
    na, ea = align(num_expanded, 32), align(num_experts, 32)
    pos_off = align(table, 32)
    e_off = pos_off + 3 * na
    t2p_off = e_off + 3 * ea
    launches = []
    if numel > 0:
        if not cfg["single"]:
            # the count table is the buffer's first piece: the count and scan kernels take the buffer itself
            k = cfg["count"]
            launches.append((_fused_mapping_count_kernel, (num_chunks,), (numel, num_experts),
                             (k["CHUNK"], k["BLOCK"], k["BLOCK_E"], k["PACKED"]), 4))
            if not cfg["table_rows"]:
                k = cfg["scan"]
                launches.append((_fused_mapping_scan_kernel, (cfg["scan_grid"],), (num_chunks,),
                                 (k["TP"], k["EB"], k["BLOCK_E"]), 4))
        # The synchronising mode cuts the outputs at the segments' end, so it needs no tail fill.
        k = dict(cfg["scatter"], FILL_TAIL=not sync_mode)
        names = ("NUM_TOPK", "SINGLE", "TABLE_ROWS", "PACKED", "FILL_TAIL", "CHUNK", "SB", "HIST_BLOCK", "BLOCK_E",
                 "PAD_ITERS", "PAD_BLOCK", "TAIL_BLOCK", "LANES", "FIELD", "SUB")
        launches.append((_fused_mapping_scatter_kernel, (num_chunks,), (numel, num_experts, num_expanded, alignment),
                         tuple(k[n] for n in names), cfg["num_warps"]))
    fixed_views = None if sync_mode and numel > 0 else (num_view, na, ea)
    return total, tuple(launches), t2p_off, pos_off, e_off, e_off + 2 * ea, fixed_views


@functools.lru_cache(maxsize=256)
def _pieces(num_view: int, num_expanded: int, num_experts: int, numel: int, table: int):
    """The buffer's layout: the scratch count table (a row per chunk plus one for the totals; 0 words on the
    one-program path), then pos_to_expert / pos_to_token / pos_to_token_topk (``num_view`` of ``num_expanded`` words
    each), expert_start / expert_end / num_tokens_per_expert, token_topk_to_pos; every piece starts on a 128-byte
    boundary (the scatter kernel computes the same offsets).  Returns (sizes, total words): the odd pieces are the
    outputs, the even ones padding."""
    pieces = [align(table, 32)]
    na, ea = align(num_expanded, 32), align(num_experts, 32)
    for n, a in ((num_view, na), (num_view, na), (num_view, na), (num_experts, ea), (num_experts, ea),
                 (num_experts, ea)):
        pieces += [n, a - n]
    pieces.append(numel)
    return pieces, sum(pieces)


@planned("get_fused_mapping_launch")
def _launch(topk_idx: torch.Tensor, num_experts: int, alignment: int, num_expanded: int, sync_mode: bool) -> tuple:
    """Allocate the one int32 buffer and launch the kernels of a checked call: ``(buf, t2p_off, pos_off, e_off,
    sync_start, fixed_views)`` (see :func:`_host_plan`).  Planned on its own, so that the synchronising mode, whose
    public call cannot be a plan (it reads the counts back), still replays its launches."""
    num_tokens, num_topk = topk_idx.shape
    total, launches, t2p_off, pos_off, e_off, sync_start, fixed = _host_plan(
        num_tokens, num_topk, num_experts, alignment, num_expanded, sync_mode, override_key("get_fused_mapping"))
    buf = empty((total,), torch.int32, topk_idx.device)
    for i, (kernel, grid, scalars, consts, warps) in enumerate(launches):
        # ``.run`` is what ``kernel[grid](...)`` calls; the scan kernel takes the buffer only.  PDL: only the first
        # kernel may start before the previous op's kernel has finished (the later ones signal only)
        pdl = pdl_args(buf.device, launch=i == 0)
        if kernel is _fused_mapping_scan_kernel:
            kernel.run(buf, *scalars, *consts, grid=grid, warmup=False, num_warps=warps, **pdl)
        else:
            kernel.run(topk_idx, buf, *scalars, *consts, grid=grid, warmup=False, num_warps=warps, **pdl)
    return buf, t2p_off, pos_off, e_off, sync_start, fixed


@planned("get_fused_mapping")
def get_fused_mapping(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_expanded_tokens: int,
    alignment: int,
    force_no_sync: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           List[int]]:
    """Map token-major top-k slots to an expert-major ("fused") layout whose expert segments are aligned.

    Args:
        topk_idx: int64 ``(T, K)``, contiguous; expert ids in ``[0, num_experts)``, ``-1`` = no expert.
            Other values are treated as ``-1`` by the kernel (never written out of bounds); with
            ``TRITILE_CHECKS=1`` they raise ``ValueError`` instead (a host sync).
        num_experts: ``E``, 1 to 1024.
        num_expanded_tokens: ``N``.  ``0``: size the buffers from the data (with a host sync, unless
            ``force_no_sync``).  ``> 0``: the exact buffer length, at least the sum of the aligned counts;
            positions past the last segment are padding.  Slots that do not fit (``N`` too small, or
            ``N == 0`` with ``force_no_sync=True``) are dropped: nothing is written for them and their
            ``token_topk_to_pos`` is ``-1`` (with ``TRITILE_CHECKS=1`` a too-small ``N > 0`` raises).
        alignment: ``A >= 1``; every expert's segment length is its slot count rounded up to ``A``.
        force_no_sync: with ``num_expanded_tokens == 0``, skip the host sync (``N = 0``).

    Returns:
        ``(pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end,
        num_tokens_per_expert, num_tokens_per_expert_list)``:

        * ``pos_to_expert``, ``pos_to_token``, ``pos_to_token_topk``: int32 ``(N,)``; position ``p`` of a
          valid slot ``(t, k)`` holds its expert, ``t`` and ``t*K + k``; padding holds ``-1`` in all three.
          In the synchronising mode they are views sliced to ``N = sum(num_tokens_per_expert_list)``.
        * ``token_topk_to_pos``: int32 ``(T, K)``, the position of each slot, ``-1`` where ``topk_idx`` is ``-1``.
        * ``expert_start``, ``expert_end``, ``num_tokens_per_expert``: int32 ``(E,)``; the **aligned**
          segment of expert ``e`` is ``[expert_start[e], expert_end[e])`` of length ``num_tokens_per_expert[e]``.
        * ``num_tokens_per_expert_list``: ``num_tokens_per_expert.tolist()`` in the synchronising mode, else ``[]``.

    Order: inside a segment the valid slots come first, in ascending ``t*K + k`` (a stable sort by expert),
    independent of ``set_num_sms`` (TileKernels' order depends on the SM count).  All outputs are views of
    one int32 allocation.
    """
    # The common case in a few attribute reads; anything else takes the full checks (same errors, same order).
    if not (isinstance(topk_idx, torch.Tensor) and topk_idx.dtype is torch.int64 and topk_idx.dim() == 2
            and topk_idx.is_contiguous() and (topk_idx.device.type == "cuda" or _rt.kernel_device_ok(topk_idx.device))
            and type(num_experts) is int and 1 <= num_experts <= MAX_EXPERTS and type(num_expanded_tokens) is int
            and num_expanded_tokens >= 0 and type(alignment) is int and alignment >= 1
            and type(force_no_sync) is bool):
        _check_args(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync)
    num_tokens, num_topk = topk_idx.shape
    if num_tokens * num_topk + (alignment - 1) * num_experts >= 2**31 or num_expanded_tokens >= 2**31:
        raise ValueError("positions must fit in int32: T*K + (alignment-1)*num_experts and num_expanded_tokens "
                         f"must be < 2**31, got topk_idx of shape {(num_tokens, num_topk)}, alignment={alignment}, "
                         f"num_experts={num_experts}, num_expanded_tokens={num_expanded_tokens}")
    if torch.compiler.is_compiling():
        # the registered op (outputs of their own; the pos_to_* length an unbacked size in the synchronising mode),
        # then the list from its counts (``torch._dynamo.config.capture_scalar_outputs`` keeps it in the graph)
        res = _get_fused_mapping_op(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync)
        sync = num_expanded_tokens == 0 and not force_no_sync
        return (*res, res[6].tolist() if sync else [])
    checks = checks_enabled()
    if checks and topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_idx values must be in [-1, num_experts={num_experts}), got values in [{lo}, {hi}]")

    should_sync = num_expanded_tokens == 0 and not force_no_sync
    if should_sync:
        num_expanded = (num_tokens * num_topk + (alignment - 1) * num_experts) // alignment * alignment
    else:
        num_expanded = num_expanded_tokens
    numel = num_tokens * num_topk
    buf, t2p_off, pos_off, e_off, sync_start, fixed = _launch(topk_idx, num_experts, alignment, num_expanded,
                                                              should_sync)
    per_expert_list: List[int] = []
    if fixed is None:
        # the one host sync: num_tokens_per_expert is the buffer's words [sync_start, sync_start + E)
        unplannable("reads the expert counts back")
        per_expert_list = buf[sync_start:sync_start + num_experts].tolist()
        num_view, na, ea = sum(per_expert_list), align(num_expanded, 32), align(num_experts, 32)
    else:
        num_view, na, ea = fixed
    # Seven views of the one buffer: the three position maps and the three expert vectors as the rows of two strided
    # [3, n] views (an as_strided and an unbind each: cheaper than a 15-piece split).
    pos_to_expert, pos_to_token, pos_to_token_topk = buf.as_strided((3, num_view), (na, 1), pos_off).unbind(0)
    expert_start, expert_end, per_expert = buf.as_strided((3, num_experts), (ea, 1), e_off).unbind(0)
    token_topk_to_pos = buf.as_strided((num_tokens, num_topk), (num_topk, 1), t2p_off)
    if numel == 0:  # nothing launched: every position is padding, every count zero
        for t in (pos_to_expert, pos_to_token, pos_to_token_topk):
            t.fill_(-1)
        for t in (expert_start, expert_end, per_expert):
            t.zero_()
        if should_sync:
            per_expert_list = [0] * num_experts
    elif checks and num_expanded_tokens > 0:
        need = int(per_expert.sum())
        if need > num_expanded_tokens:
            raise ValueError(f"num_expanded_tokens must be at least the sum of the aligned expert counts ({need}), "
                             f"got {num_expanded_tokens}")
    return (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end, per_expert,
            per_expert_list)


def _get_fused_mapping_fake(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync):
    num_tokens, num_topk = topk_idx.shape
    if num_expanded_tokens == 0 and not force_no_sync:
        n = torch.library.get_ctx().new_dynamic_size()  # sum of the aligned counts: known after the kernels
    else:
        n = num_expanded_tokens
    i32 = dict(dtype=torch.int32)
    return (*(topk_idx.new_empty((n,), **i32) for _ in range(3)), topk_idx.new_empty((num_tokens, num_topk), **i32),
            *(topk_idx.new_empty((num_experts,), **i32) for _ in range(3)))


@custom_op("moe_get_fused_mapping", fake=_get_fused_mapping_fake)
def _get_fused_mapping_op(topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int,
                          force_no_sync: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor, torch.Tensor]:
    """``get_fused_mapping``'s seven tensors as the registered op returns them (each its own allocation: an op's
    outputs may not share memory)."""
    res = get_fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync)
    return tuple(t.clone() for t in res[:7])


def _check_args(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync) -> None:
    """The argument checks, in order, with their messages."""
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    check_contiguous("topk_idx", topk_idx)
    check_device("topk_idx", topk_idx)
    _check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    _check_int("num_expanded_tokens", num_expanded_tokens, 0)
    _check_int("alignment", alignment, 1)
    if not isinstance(force_no_sync, bool):
        raise TypeError(f"force_no_sync must be a bool, got {type(force_no_sync).__name__}")
