"""A persistent TMA transpose in Gluon (Hopper): see ``_transpose_gluon`` (imported lazily from there)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _tile_coords(t, tiles_m, tiles_n, BM: gl.constexpr, BN: gl.constexpr, K: gl.constexpr):
    """Tile t of the (batch, M-tiles, N-tiles) walk (N fastest): its batch, first row and first column."""
    per_b = tiles_m * tiles_n
    b = t // per_b
    r = t - b * per_b
    mt = r // tiles_n
    return b, mt * (BM * K), (r - mt * tiles_n) * BN


@gluon.jit
def _issue_load(x_desc, x_s, bars, slot, t, tiles_m, tiles_n, BM: gl.constexpr, BN: gl.constexpr, K: gl.constexpr):
    b, m0, n0 = _tile_coords(t, tiles_m, tiles_n, BM, BN, K)
    bar = bars.index(slot)
    mbarrier.expect(bar, K * x_desc.block_type.nbytes)
    for k in gl.static_range(K):
        tma.async_copy_global_to_shared(x_desc, [b, m0 + k * BM, n0], bar, x_s.index(slot).slice(k, 1, 0))


@gluon.jit
def _transpose_tma_kernel(x_desc, y_desc, num_tiles, tiles_m, tiles_n,
                          BM: gl.constexpr, BN: gl.constexpr, K: gl.constexpr, S: gl.constexpr,
                          VR: gl.constexpr, VC: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr,
                          WK: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr):
    """A stage is K boxes [BM, BN] of x stacked along M (one mbarrier); S stages in flight.  Each box goes through
    registers (a [VR, VC] block a thread: VC-element reads along x's rows, VR-element writes along y's rows) into
    one of two output buffers, which TMA stores as K boxes [BN, BM] of y."""
    L: gl.constexpr = gl.BlockedLayout([1, VR, VC], [1, TR, TC], [WK, WR, WC], [2, 1, 0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [S, K, BM, BN], x_desc.layout)
    y_s = gl.allocate_shared_memory(y_desc.dtype, [2, K, BN, BM], y_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    n_mine = (num_tiles - pid + nprog - 1) // nprog  # tiles pid, pid + nprog, ...
    for s in gl.static_range(S - 1):  # prologue: the first S - 1 tiles in flight
        if s < n_mine:
            _issue_load(x_desc, x_s, bars, s, pid + s * nprog, tiles_m, tiles_n, BM, BN, K)
    for j in range(0, n_mine):
        slot = j % S
        # the tile S - 1 ahead goes into the slot tile j - 1 used: every warp finished reading it (barrier) and the
        # async proxy's write must follow those generic reads (fence)
        gl.thread_barrier()
        fence_async_shared()
        if j + S - 1 < n_mine:
            _issue_load(x_desc, x_s, bars, (j + S - 1) % S, pid + (j + S - 1) * nprog, tiles_m, tiles_n, BM, BN, K)
        mbarrier.wait(bars.index(slot), (j // S) & 1)
        xt = x_s.index(slot).load(L)
        buf = j % 2
        tma.store_wait(pendings=K)  # the stores of tile j - 2 (this buffer's last use) are done
        gl.thread_barrier()
        y_s.index(buf).store(gl.permute(xt, [0, 2, 1]))
        fence_async_shared()
        gl.thread_barrier()
        b, m0, n0 = _tile_coords(pid + j * nprog, tiles_m, tiles_n, BM, BN, K)
        for k in gl.static_range(K):
            tma.async_copy_shared_to_global(y_desc, [b, n0, m0 + k * BM], y_s.index(buf).slice(k, 1, 0))
    tma.store_wait(pendings=0)
    for s in gl.static_range(S):
        mbarrier.invalidate(bars.index(s))
