"""The engram gate forward in Gluon (see ``_engram_fwd_gluon`` for the design); imported lazily from there."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ._engram_bwd_gluon_kernel import _tile_coords
from .engram_gate_kernel import _gate_scalars


@gluon.jit
def _issue_xv(x_desc, v_desc, x_s, v_s, bars, buf, t, NT: gl.constexpr, NCH_: gl.constexpr):
    """Token t's x and v rows (NT tiles) into row buffer ``buf``."""
    for i in gl.static_range(NT):
        bar = bars.index(buf * NT + i)
        mbarrier.expect(bar, x_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [t, 0, i * NCH_, 0], bar, x_s.index(buf * NT + i))
        tma.async_copy_global_to_shared(v_desc, [t, i * NCH_, 0], bar, v_s.index(buf * NT + i))


@gluon.jit
def _issue_kw(k_desc, w_desc, k_s, w_s, bars, slot, t, tile, NCH_: gl.constexpr):
    bar = bars.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [t, 0, tile * NCH_, 0], bar, k_s.index(slot))
    tma.async_copy_global_to_shared(w_desc, [0, tile * NCH_, 0], bar, w_s.index(slot))


@gluon.jit
def _engram_gate_fwd_onepass_kernel(x_desc, k_desc, v_desc, w_desc,
                                    out_ptr, dot_ptr, gate_ptr, rx_ptr, rk_ptr,
                                    T, tokens_per_chunk, hidden_f, eps, clamp_value, scale, s_o0, s_o1,
                                    H: gl.constexpr, HC: gl.constexpr, NCH_: gl.constexpr, CH: gl.constexpr,
                                    NT: gl.constexpr, NSLOT: gl.constexpr, B1: gl.constexpr, B2: gl.constexpr,
                                    VB: gl.constexpr, SAVE: gl.constexpr):
    """One program per token chunk.  Token j's x and v rows sit in row buffer j % 2 (loaded while token j - 1 is
    computed); k and weight_fused stream through a ring of NSLOT [HC, NCH * CH] tiles.  Phase 1 sums x^2, k^2 and
    (x w) k per head, phase 2 stores out = x + g v from the row buffer."""
    LB: gl.constexpr = gl.BlockedLayout([1, 1, VB], [1, 1, 32], [HC, B1, B2], [2, 1, 0])
    LV: gl.constexpr = gl.SliceLayout(0, LB)
    LH: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LB))
    BD: gl.constexpr = NCH_ * CH
    p = gl.program_id(0)
    t_begin = p * tokens_per_chunk
    t_end = gl.minimum(t_begin + tokens_per_chunk, T)
    n_tok = gl.maximum(t_end - t_begin, 0)

    x_s = gl.allocate_shared_memory(x_desc.dtype, [2 * NT] + x_desc.block_type.shape, x_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [2 * NT] + v_desc.block_type.shape, v_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [NSLOT] + k_desc.block_type.shape, k_desc.layout)
    w_s = gl.allocate_shared_memory(w_desc.dtype, [NSLOT] + w_desc.block_type.shape, w_desc.layout)
    bar_xv = gl.allocate_shared_memory(gl.int64, [2 * NT, 1], mbarrier.MBarrierLayout())
    bar_kw = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * NT):
        mbarrier.init(bar_xv.index(i), count=1)
    for s in gl.static_range(NSLOT):
        mbarrier.init(bar_kw.index(s), count=1)
    fence_async_shared()
    if n_tok > 0:
        _issue_xv(x_desc, v_desc, x_s, v_s, bar_xv, 0, t_begin, NT, NCH_)
    for s in gl.static_range(NSLOT):
        if s // NT < n_tok:
            _issue_kw(k_desc, w_desc, k_s, w_s, bar_kw, s, t_begin + s // NT, s % NT, NCH_)

    h3, col, _ = _tile_coords(HC, NCH_, CH, LB)
    hh = gl.arange(0, HC, layout=LH)
    zero = gl.zeros([HC, NCH_, CH], gl.float32, LB)
    n = t_begin * 0  # ring items consumed so far
    for t in range(t_begin, t_end):
        j = t - t_begin
        buf = j % 2
        xphase = (j // 2) & 1
        # the next token's rows into the other buffer: token j - 1, its last reader, is done (barrier, then the
        # async proxy's writes after those generic reads)
        gl.thread_barrier()
        fence_async_shared()
        if t + 1 < t_end:
            _issue_xv(x_desc, v_desc, x_s, v_s, bar_xv, 1 - buf, t + 1, NT, NCH_)
        # ---- phase 1: sum x^2, k^2 and (x w) k per head
        sxx = zero
        skk = zero
        sxk = zero
        for i in gl.static_range(NT):
            slot = n % NSLOT
            mbarrier.wait(bar_xv.index(buf * NT + i), xphase)
            mbarrier.wait(bar_kw.index(slot), (n // NSLOT) & 1)
            x = x_s.index(buf * NT + i).reshape([HC, NCH_, CH]).load(LB).to(gl.float32)
            k = k_s.index(slot).reshape([HC, NCH_, CH]).load(LB).to(gl.float32)
            w = w_s.index(slot).load(LB)
            sxx += x * x
            skk += k * k
            sxk += (x * w) * k
            gl.thread_barrier()
            fence_async_shared()
            nn = n + NSLOT
            tn = t_begin + nn // NT
            if tn < t_end:
                _issue_kw(k_desc, w_desc, k_s, w_s, bar_kw, slot, tn, nn % NT, NCH_)
            n += 1
        dot, g, rstd_x, rstd_k = _gate_scalars(gl.sum(gl.sum(sxx, axis=2), axis=1), gl.sum(gl.sum(skk, axis=2), axis=1),
                                               gl.sum(gl.sum(sxk, axis=2), axis=1), hidden_f, eps, clamp_value, scale)
        if SAVE:
            sc = t.to(gl.int64) * HC + hh
            gl.store(dot_ptr + sc, dot)
            gl.store(gate_ptr + sc, g)
            gl.store(rx_ptr + sc, rstd_x)
            gl.store(rk_ptr + sc, rstd_k)
        g3 = gl.expand_dims(gl.expand_dims(g, 1), 2)
        # ---- phase 2: out = x + g v from the row buffer
        o_row = out_ptr + t.to(gl.int64) * s_o0 + h3 * s_o1 + col
        for i in gl.static_range(NT):
            x = x_s.index(buf * NT + i).reshape([HC, NCH_, CH]).load(LB).to(gl.float32)
            v = v_s.index(buf * NT + i).reshape([NCH_, CH]).load(LV).to(gl.float32)
            o = x + g3 * gl.expand_dims(v, 0)
            gl.store(o_row + i * BD, o.to(gl.bfloat16), mask=((i * BD + col) < H) & (h3 < HC))
    for i in gl.static_range(2 * NT):
        mbarrier.invalidate(bar_xv.index(i))
    for s in gl.static_range(NSLOT):
        mbarrier.invalidate(bar_kw.index(s))
