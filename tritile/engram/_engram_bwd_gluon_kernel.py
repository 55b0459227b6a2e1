"""The one-pass engram_gate_bwd kernel in Gluon (see ``_engram_bwd_gluon`` for the design).  Importing this module
needs Triton's Gluon (``triton.experimental.gluon``, the 3.6 API); ``_engram_bwd_gluon.kernel()`` imports it lazily."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _tile_coords(HC: gl.constexpr, NCH_: gl.constexpr, CH: gl.constexpr, L3: gl.constexpr):
    """([HC, 1, 1] heads, [1, NCH, CH] in-tile columns) in the tile layout L3, and the in-tile columns
    [NCH, CH] in grad_v's layout (L3 without its head dimension)."""
    LV: gl.constexpr = gl.SliceLayout(0, L3)
    h = gl.arange(0, HC, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    c = gl.arange(0, NCH_, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    j = gl.arange(0, CH, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    h3 = gl.expand_dims(gl.expand_dims(h, 1), 2)
    col = gl.expand_dims(gl.expand_dims(c, 0), 2) * CH + gl.expand_dims(gl.expand_dims(j, 0), 1)
    cv = (gl.expand_dims(gl.arange(0, NCH_, layout=gl.SliceLayout(1, LV)), 1) * CH
          + gl.expand_dims(gl.arange(0, CH, layout=gl.SliceLayout(0, LV)), 0))
    return h3, col, cv


@gluon.jit
def _issue_xkw(x_desc, k_desc, w_desc, x_s, k_s, w_s, bars, slot, t, tile, NCH_: gl.constexpr):
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + k_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [t, 0, tile * NCH_, 0], bar, x_s.index(slot))
    tma.async_copy_global_to_shared(k_desc, [t, 0, tile * NCH_, 0], bar, k_s.index(slot))
    tma.async_copy_global_to_shared(w_desc, [0, tile * NCH_, 0], bar, w_s.index(slot))


@gluon.jit
def _issue_gv(g_desc, v_desc, g_s, v_s, bars, t, tile, NCH_: gl.constexpr):
    bar = bars.index(tile)
    mbarrier.expect(bar, g_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(g_desc, [t, 0, tile * NCH_, 0], bar, g_s.index(tile))
    tma.async_copy_global_to_shared(v_desc, [t, tile * NCH_, 0], bar, v_s.index(tile))


@gluon.jit
def _token_scalars(dot_ptr, gate_ptr, rx_ptr, rk_ptr, t, T, HC: gl.constexpr, L3: gl.constexpr):
    """The saved (dot, gate, rstd_x, rstd_k) of token t ([HC] each; dot 1 and the rest 0 past T)."""
    h = gl.arange(0, HC, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    m = (h * 0 + t) < T
    sc = t.to(gl.int64) * HC + h
    dot = gl.load(dot_ptr + sc, mask=m, other=1.0)
    g = gl.load(gate_ptr + sc, mask=m, other=0.0)
    rx = gl.load(rx_ptr + sc, mask=m, other=0.0)
    rk = gl.load(rk_ptr + sc, mask=m, other=0.0)
    return dot, g, rx, rk


@gluon.jit
def _pin(x):
    """x through an opaque, side-effecting register move: the compiler cannot sink x's computation past this point
    (without it, a loop-carried accumulator's update sinks to the end of the loop body and keeps its operands,
    ~70 registers a tile, alive through the whole token)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _add_reg_tile(acc0, acc1, acc2, acc3, dw, i: gl.constexpr):
    """acc_i += dw for the constexpr register tile i < 4 (pinned where it is computed)."""
    if i == 0:
        acc0 = _pin(acc0 + dw)
    if i == 1:
        acc1 = _pin(acc1 + dw)
    if i == 2:
        acc2 = _pin(acc2 + dw)
    if i == 3:
        acc3 = _pin(acc3 + dw)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _pick_reg_tile(acc0, acc1, acc2, acc3, i: gl.constexpr):
    r = acc0
    if i == 1:
        r = acc1
    if i == 2:
        r = acc2
    if i == 3:
        r = acc3
    return r


@gluon.jit
def _prof_mark(prof_ptr, p, j, slot: gl.constexpr, KP: gl.constexpr):
    """PROF: the global timer (ns) at this point of program p < 4, local token j < 64, into prof[p, j, slot]."""
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    z = gl.zeros([1], gl.int32, L1)
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(prof_ptr + (p * 64 + j) * KP + slot + z, now, mask=(z + p < 4) & (z + j < 64))


@gluon.jit
def _engram_gate_bwd_onepass_kernel(g_desc, x_desc, k_desc, v_desc, w_desc,
                                    dot_ptr, gate_ptr, rx_ptr, rk_ptr,
                                    gx_ptr, gk_ptr, gv_ptr, gw_ptr,
                                    T, tokens_per_chunk, hidden_f, clamp_value, scale,
                                    s_gx0, s_gx1, s_gk0, s_gk1, s_gv0, s_gw0, s_gw1,
                                    H: gl.constexpr, HC: gl.constexpr, NCH_: gl.constexpr, CH: gl.constexpr,
                                    NT: gl.constexpr, NSLOT: gl.constexpr,
                                    A1: gl.constexpr, A2: gl.constexpr, B1: gl.constexpr, B2: gl.constexpr,
                                    VB: gl.constexpr, NR: gl.constexpr, prof_ptr=None,
                                    PROF: gl.constexpr = False):
    # Phase A's layout: a thread holds all HC heads of 4 adjacent columns, so grad_v's head sum stays in the thread.
    # Phase B's layout: a warp owns one head's row (VB adjacent columns a thread, 16-byte reads and stores): the
    # per-head coefficients cost a register each, not HC, which leaves the registers to the grad_w accumulators.
    LA: gl.constexpr = gl.BlockedLayout([HC, 1, 4], [1, 1, 32], [1, A1, A2], [2, 1, 0])
    LB: gl.constexpr = gl.BlockedLayout([1, 1, VB], [1, 1, 32], [HC, B1, B2], [2, 1, 0])
    LV: gl.constexpr = gl.SliceLayout(0, LA)
    LHB: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LB))
    BD: gl.constexpr = NCH_ * CH
    p = gl.program_id(0)
    t_begin = p * tokens_per_chunk
    t_end = gl.minimum(t_begin + tokens_per_chunk, T)
    n_tok = gl.maximum(t_end - t_begin, 0)

    g_s = gl.allocate_shared_memory(g_desc.dtype, [NT] + g_desc.block_type.shape, g_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [NT] + v_desc.block_type.shape, v_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [NSLOT] + x_desc.block_type.shape, x_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [NSLOT] + k_desc.block_type.shape, k_desc.layout)
    w_s = gl.allocate_shared_memory(w_desc.dtype, [NSLOT] + w_desc.block_type.shape, w_desc.layout)
    bar_gv = gl.allocate_shared_memory(gl.int64, [NT, 1], mbarrier.MBarrierLayout())
    bar_xkw = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NT):
        mbarrier.init(bar_gv.index(i), count=1)
    for s in gl.static_range(NSLOT):
        mbarrier.init(bar_xkw.index(s), count=1)
    fence_async_shared()

    # prologue: the first token's G / v row and the first NSLOT phase-B items
    if n_tok > 0:
        for i in gl.static_range(NT):
            _issue_gv(g_desc, v_desc, g_s, v_s, bar_gv, t_begin, i, NCH_)
    for s in gl.static_range(NSLOT):
        if s // NT < n_tok:
            _issue_xkw(x_desc, k_desc, w_desc, x_s, k_s, w_s, bar_xkw, s, t_begin + s // NT, s % NT, NCH_)

    _, _, cv0 = _tile_coords(HC, NCH_, CH, LA)
    h3, col, _ = _tile_coords(HC, NCH_, CH, LB)
    zero_a = gl.zeros([HC, NCH_, CH], gl.float32, LA)
    # the grad_w accumulator stays on chip: tiles 0 .. NR-1 in registers, the others in shared memory (each element
    # read-modified-written by the thread that owns it).  (Read-modify-writing grad_w_partial in L2 instead cost
    # ~0.5-1.6 us a tile on the H200: L2 hits queue behind the TMA stream's DRAM misses.)
    zero = gl.zeros([HC, NCH_, CH], gl.float32, LB)
    gw_row = gw_ptr + p.to(gl.int64) * s_gw0 + h3 * s_gw1 + col
    acc_s = gl.allocate_shared_memory(gl.float32, [NT - NR, HC, NCH_, CH],
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    for i in gl.static_range(NT - NR):
        acc_s.index(i).store(zero)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    n_b = t_begin * 0  # phase-B items consumed so far (a run-time int32)
    dot, gate, rx, rk = _token_scalars(dot_ptr, gate_ptr, rx_ptr, rk_ptr, t_begin, t_end, HC, LA)
    KP: gl.constexpr = 2 + 2 * NT
    for t in range(t_begin, t_end):
        if PROF:
            _prof_mark(prof_ptr, p, t - t_begin, 0, KP)
        tphase = (t - t_begin) & 1
        t64 = t.to(gl.int64)
        gate3 = gl.expand_dims(gl.expand_dims(gate, 1), 2)
        # ---- phase A: gamma = G . v and grad_v = sum_h g_h G_h
        gam = zero_a
        for i in gl.static_range(NT):
            mbarrier.wait(bar_gv.index(i), tphase)
            g = g_s.index(i).reshape([HC, NCH_, CH]).load(LA).to(gl.float32)
            v = v_s.index(i).reshape([NCH_, CH]).load(LV).to(gl.float32)
            gam += g * gl.expand_dims(v, 0)
            gv = gl.sum(gate3 * g, axis=0)
            cv = i * BD + cv0
            gl.store(gv_ptr + t64 * s_gv0 + cv, gv.to(gl.bfloat16), mask=cv < H)
        gamma = gl.sum(gl.sum(gam, axis=2), axis=1)
        # ---- delta = dL/dD with r held fixed (0 where |s| < clamp_value), a_x = D r_x^2 / H, a_k = D r_k^2 / H
        s_val = dot * rx * rk * scale
        dsqrt = gl.sqrt_rn(gl.div_rn(scale * rx * rk, gl.abs(dot)))
        delta = gamma * (gate * (1.0 - gate)) * 0.5 * dsqrt
        delta = gl.where(gl.abs(s_val) < clamp_value, 0.0, delta)
        a_x = gl.div_rn(dot * rx * rx, hidden_f)
        a_k = gl.div_rn(dot * rk * rk, hidden_f)
        d3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(delta, LHB), 1), 2)
        ax3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(a_x, LHB), 1), 2)
        ak3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(a_k, LHB), 1), 2)
        if PROF:
            _prof_mark(prof_ptr, p, t - t_begin, 1, KP)
        # the next token's saved scalars, in flight during phase B
        dot, gate, rx, rk = _token_scalars(dot_ptr, gate_ptr, rx_ptr, rk_ptr, t + 1, t_end, HC, LA)
        gx_row = gx_ptr + t64 * s_gx0 + h3 * s_gx1 + col
        gk_row = gk_ptr + t64 * s_gk0 + h3 * s_gk1 + col
        # ---- phase B: grad_x, grad_k, grad_w
        for i in gl.static_range(NT):
            slot = n_b % NSLOT
            mbarrier.wait(bar_xkw.index(slot), (n_b // NSLOT) & 1)
            if PROF:
                _prof_mark(prof_ptr, p, t - t_begin, 2 + i, KP)
            g = g_s.index(i).reshape([HC, NCH_, CH]).load(LB).to(gl.float32)
            x = x_s.index(slot).reshape([HC, NCH_, CH]).load(LB).to(gl.float32)
            k = k_s.index(slot).reshape([HC, NCH_, CH]).load(LB).to(gl.float32)
            w = w_s.index(slot).load(LB)
            gx = g + d3 * (w * k - x * ax3)
            gk = d3 * (w * x - k * ak3)
            m = ((i * BD + col) < H) & (h3 < HC)
            gl.store(gx_row + i * BD, gx.to(gl.bfloat16), mask=m)
            gl.store(gk_row + i * BD, gk.to(gl.bfloat16), mask=m)
            dw = d3 * (x * k)
            if i < NR:
                acc0, acc1, acc2, acc3 = _add_reg_tile(acc0, acc1, acc2, acc3, dw, i)
                acc = _pick_reg_tile(acc0, acc1, acc2, acc3, i)
            else:
                a_s = acc_s.index(i - NR)
                acc = a_s.load(LB) + dw
                a_s.store(acc)
            if t + 1 == t_end:  # the chunk's last token: this tile of grad_w_partial[p] is final, stored now
                gl.store(gw_row + i * BD, acc, mask=m)
            # every warp is done with this slot and with G tile i: refill them (async proxy after generic reads)
            gl.thread_barrier()
            fence_async_shared()
            nn = n_b + NSLOT
            tn = t_begin + nn // NT
            if tn < t_end:
                _issue_xkw(x_desc, k_desc, w_desc, x_s, k_s, w_s, bar_xkw, slot, tn, nn % NT, NCH_)
            if t + 1 < t_end:
                _issue_gv(g_desc, v_desc, g_s, v_s, bar_gv, t + 1, i, NCH_)
            n_b += 1
            if PROF:
                _prof_mark(prof_ptr, p, t - t_begin, 2 + NT + i, KP)

    for i in gl.static_range(NT):
        mbarrier.invalidate(bar_gv.index(i))
    for s in gl.static_range(NSLOT):
        mbarrier.invalidate(bar_xkw.index(s))
    if n_tok == 0:  # a row without tokens is zero
        for i in gl.static_range(NT):
            gl.store(gw_row + i * BD, zero, mask=(((i * BD) + col) < H) & (h3 < HC))
