"""Shared ``@triton.jit`` helpers of the mHC kernels.

Every kernel that must agree bit for bit with another (``pre_big_fuse`` with the unfused chain
``pre_split_mixes`` -> ``sinkhorn`` -> ``pre_apply_mix``; ``multilayer_recompute`` with chained
``pre_apply_mix`` / ``post``) computes through these helpers, so that the same fp32 operations run in
the same order.  Results are then independent of block sizes, warps and tiling: every helper works per
token (and per hidden index), every sum runs in an explicit order (a chain or a butterfly), and the only other
``tl.sum`` is :func:`extract`'s, which adds one value to zeros (exact in any order), and the halving sums of the
butterflies, each of which adds two values (exact in either order).

Layouts (``BT`` tokens of a block, ``BN`` = ``next_pow2(N)`` padded streams, ``BH`` hidden columns):

* one token's mixes row (length ``n3 = N * (N + 2)``): ``[0, N)`` pre logits, ``[N, 2N)`` post logits,
  ``[2N, 2N + N*N)`` comb logits row-major ``i * N + o`` (``i`` input stream, ``o`` output stream).
* per-stream weights (pre, post): ``[BT, BN]`` fp32; padded streams are ignored.
* comb matrices: ``[BT, BN, BN]`` fp32, axis 1 = input stream ``i``, axis 2 = output stream ``o``.
* residual tiles: ``[BT, BN, BH]`` fp32 (bf16 values upcast), axis 1 = stream.
* hidden tiles (layer input / output): ``[BT, BH]`` fp32.

Index tensors are passed in by the caller (``tl.arange(0, BN)`` reshaped to the axis they index), so the
helpers do not need to know the block shapes.

Signatures used by other kernels (keep them stable): ``load_split_mixes``, ``sinkhorn_fwd``, ``apply_mix``,
``post_mix``, ``extract``, ``ordered_sum``, ``tree_last``, ``tree_mid``, ``mix_affine``, ``sigmoid_f32``,
``pre_from_logit``, ``post_from_logit``.  ``sinkhorn_bwd`` is used by the Sinkhorn backward kernel only.  The program prologues
(``token_block``, ``token_prologue``, ``tile_prologue``) and the addresses of the layouts
(``stream_block``, ``comb_block`` / ``comb_offsets``, ``hidden_tile``, ``residual_offsets``) are shared by the
per-token kernels; the host side has the launch rules (``hidden_block``, ``residual_tile_config``,
``token_config``) and the launch option :data:`NO_FUSION`.

Order of operations: TileKernels' (read from the CUDA that TileLang generates for its kernels and checked bit for bit
against them on an H200).  nvcc contracts a product added to something into one fused multiply-add (where both
operands of the addition are products, the left one); TileLang's sums across threads are butterflies.  tritile's mHC
kernels launch with ``enable_fp_fusion=False`` (:data:`NO_FUSION`) and write each of those fused multiply-adds as
``tl.fma`` and each butterfly as :func:`tree_last` / :func:`tree_mid`, so they compute the same way on every backend
(the interpreter's ``tl.fma`` rounds twice: the references in ``tritile.torch.mhc`` do the same on the CPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritile.language import exp_f32
from tritile.runtime import interpreter_configs
from tritile.utils import next_power_of_two


# Threads of TileKernels' per-token programs: their sums over a token's hidden values are per-thread chains, then a
# butterfly over the threads (``LANES`` in kernels, ``LANE_COUNT`` on the host).
LANE_COUNT = 128
LANES = tl.constexpr(LANE_COUNT)


# ------------------------------------------------------------------------------------------------
# Program prologues: token blocks, stream indices, hidden chunks and the addresses of each layout
# ------------------------------------------------------------------------------------------------
# ``stream_block``, ``comb_block`` and ``hidden_tile`` return pointers (``ptr + a + b``) and then the mask;
# ``comb_offsets`` and ``residual_offsets`` the mask and then offsets to add to a pointer (``ptr + (a + b)``).  The
# addresses are the same, but the two forms, and the order of the operations, compile to different sm_90 code, so
# each kernel uses the form and order it was tuned with.
@triton.jit
def token_block(T, BT: tl.constexpr):
    """This program's ``BT`` tokens along grid axis 0: int64 indices ``tok [BT]`` and their mask ``tok < T``."""
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    return tok, tok < T


@triton.jit
def token_prologue(T, BT: tl.constexpr, BN: tl.constexpr):
    """Prologue of the kernels over token blocks (grid axis 0): ``tok [BT]`` (int64), the stream indices ``n2 [1, BN]``
    (per-stream rows), ``n3 [1, BN, 1]`` (axis 1 of residual tiles and comb matrices: stream ``i``) and
    ``o3 [1, 1, BN]`` (axis 2 of comb matrices: stream ``o``), and the token mask ``tok < T``."""
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    n = tl.arange(0, BN)
    return tok, n[None, :], n[None, :, None], n[None, None, :], tok < T


@triton.jit
def tile_prologue(T, BT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    """:func:`token_prologue` for the kernels over ``[BT tokens, BH hidden columns]`` tiles (grid axes 0 and 1):
    ``tok``, the hidden columns ``h [BH]``, ``n2``, ``n3``, ``o3`` and ``tok < T``."""
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    n = tl.arange(0, BN)
    return tok, h, n[None, :], n[None, :, None], n[None, None, :], tok < T


@triton.jit
def stream_block(ptr, tok, tm, n2, N: tl.constexpr):
    """Pointers ``[BT, BN]`` into contiguous ``(T, N)`` per-stream rows (pre / post weights), and their mask."""
    return ptr + tok[:, None] * N + n2, tm[:, None] & (n2 < N)


@triton.jit
def comb_block(ptr, tok, tm, n3, o3, N: tl.constexpr):
    """Pointers ``[BT, BN, BN]`` into contiguous ``(T, N, N)`` comb matrices (``[i, o]``), and their mask."""
    return ptr + tok[:, None, None] * (N * N) + n3 * N + o3, tm[:, None, None] & (n3 < N) & (o3 < N)


@triton.jit
def comb_offsets(tok, tm, n3, o3, N: tl.constexpr):
    """Offsets ``[BT, BN, BN]`` into contiguous ``(T, N, N)`` comb matrices, and their mask."""
    mask = tm[:, None, None] & (n3 < N) & (o3 < N)
    return tok[:, None, None] * (N * N) + n3 * N + o3, mask


@triton.jit
def hidden_tile(ptr, tok, tm, h, hm, H):
    """Pointers ``[BT, BH]`` into a contiguous ``(T, H)`` hidden state at columns ``h``, and their mask."""
    return ptr + tok[:, None] * H + h[None, :], tm[:, None] & hm[None, :]


@triton.jit
def residual_offsets(tok, tm, n3, h, hm, N: tl.constexpr, H):
    """Offsets ``[BT, BN, BH]`` into a contiguous ``(T, N, H)`` residual at hidden columns ``h``, and their mask."""
    mask = tm[:, None, None] & (n3 < N) & hm[None, None, :]
    return tok[:, None, None] * (N * H) + n3 * H + h[None, None, :], mask


# ------------------------------------------------------------------------------------------------
# Generic exact helpers
# ------------------------------------------------------------------------------------------------
@triton.jit
def extract(x, idx, k, axis: tl.constexpr):
    """``x`` restricted to index ``k`` of ``axis``, that axis removed: ``tl.sum(where(idx == k, x, 0), axis)``.

    ``idx`` broadcasts against ``x`` along ``axis`` (e.g. ``tl.arange(0, BN)[None, :, None]`` for axis 1).
    Exact (one value plus zeros; a ``-0.0`` comes out as ``+0.0``)."""
    return tl.sum(tl.where(idx == k, x, 0.0), axis=axis)


@triton.jit
def ordered_sum(x, idx, N: tl.constexpr, axis: tl.constexpr):
    """Sum of ``x`` over the first ``N`` indices of ``axis`` (``idx`` as in :func:`extract`), added left to right:
    ``((x_0 + x_1) + x_2) + ...``.  Padded indices ``>= N`` are ignored.  The axis is removed."""
    s = extract(x, idx, 0, axis)
    for k in tl.static_range(1, N):
        s = s + extract(x, idx, k, axis)
    return s


@triton.jit
def tree_last(x):
    """Butterfly sum over the last axis of a 2D, 3D or 4D tensor (length a power of two), that axis removed: the two
    halves added element by element, then the halves of the result, and so on (TileLang's sum across threads:
    partner ``t ^ offset``, offsets from the largest down, leaves every thread this value)."""
    for _ in tl.static_range(16):
        if _last_dim(x.shape) > 1:
            x = tl.sum(tl.reshape(x, _halved_shape(x.shape)), axis=_last_axis(x.shape))
    return tl.reshape(x, _dropped_shape(x.shape))


@triton.jit
def tree_mid(x):
    """:func:`tree_last` over axis 1 of a 3D tensor ``[A, W, B]`` -> ``[A, B]``."""
    for _ in tl.static_range(16):
        if x.shape[1] > 1:
            x = tl.sum(tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2, x.shape[2]]), axis=1)
    return tl.reshape(x, [x.shape[0], x.shape[2]])


@triton.constexpr_function
def _last_dim(shape):
    return [int(tl.core._unwrap_if_constexpr(d)) for d in tl.core._unwrap_if_constexpr(shape)][-1]


@triton.constexpr_function
def _last_axis(shape):
    return len([int(tl.core._unwrap_if_constexpr(d)) for d in tl.core._unwrap_if_constexpr(shape)]) - 1


@triton.constexpr_function
def _halved_shape(shape):
    shape = [int(tl.core._unwrap_if_constexpr(d)) for d in tl.core._unwrap_if_constexpr(shape)]
    return shape[:-1] + [2, shape[-1] // 2]


@triton.constexpr_function
def _dropped_shape(shape):
    return [int(tl.core._unwrap_if_constexpr(d)) for d in tl.core._unwrap_if_constexpr(shape)][:-1]


@triton.jit
def _halve(x):
    """4D ``x [A, B, C, W]`` -> ``(x[..., :W/2], x[..., W/2:])`` (register moves only where ``W`` lies in one
    thread)."""
    y = tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2], 2, x.shape[3] // 2])
    return tl.split(tl.permute(y, (0, 1, 2, 4, 3)))


@triton.jit
def _fma2(a, b, acc):
    """``fma(a[..., 0], b[..., 0], acc)``, then with ``[..., 1]`` (last axis of length 2)."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return tl.fma(a1, b1, tl.fma(a0, b0, acc))


@triton.jit
def fma_chain_last(a, b, acc):
    """``acc = fma(a[..., k], b[..., k], acc)`` for ``k`` along the last axis (length 1, 2, 4 or 8) in order; ``a`` and
    ``b`` are 4D and broadcast against each other, ``acc`` has their shape without the last axis."""
    W: tl.constexpr = _last_dim(a.shape)
    tl.static_assert(W == _last_dim(b.shape))
    if W == 1:
        acc = tl.fma(tl.reshape(a, _dropped_shape(a.shape)), tl.reshape(b, _dropped_shape(b.shape)), acc)
    elif W == 2:
        acc = _fma2(a, b, acc)
    elif W == 4:
        a0, a1 = _halve(a)
        b0, b1 = _halve(b)
        acc = _fma2(a1, b1, _fma2(a0, b0, acc))
    else:
        tl.static_assert(W == 8)
        a0, a1 = _halve(a)
        b0, b1 = _halve(b)
        a00, a01 = _halve(a0)
        b00, b01 = _halve(b0)
        a10, a11 = _halve(a1)
        b10, b11 = _halve(b1)
        acc = _fma2(a11, b11, _fma2(a10, b10, _fma2(a01, b01, _fma2(a00, b00, acc))))
    return acc


# ------------------------------------------------------------------------------------------------
# Sigmoid-affine split of the mixes (pre / post / comb logits)
# ------------------------------------------------------------------------------------------------
@triton.constexpr_function
def mix_group(j, n):
    """The scale group of mixes column ``j``: ``min(2, j // n)`` (pre, post, comb)."""
    return min(2, int(j) // int(n))


@triton.jit
def mix_affine(m, scale, base):
    """``z = m * scale + base`` as one ``tl.fma`` (fp32, any broadcastable shapes)."""
    return tl.fma(m, scale, base)


@triton.jit
def sigmoid_f32(z):
    """``1 / (1 + exp(-z))``: ``exp_f32`` (libdevice ``expf`` on GPU, numpy under the interpreter), then an IEEE
    division (``div_rn``)."""
    return tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + exp_f32(-z))


@triton.jit
def pre_from_logit(z, pre_eps):
    """pre weight: ``sigmoid(z) + pre_eps``."""
    return sigmoid_f32(z) + pre_eps


@triton.jit
def post_from_logit(z, post_mult):
    """post weight: ``post_mult * sigmoid(z)`` (no eps)."""
    return post_mult * sigmoid_f32(z)


@triton.jit
def load_split_mixes(mixes_ptr, row_stride, scale_ptr, base_ptr, tok, tok_mask, n_i, n_o,
                     pre_eps, post_mult, N: tl.constexpr):
    """Load and split the mixes of a block of tokens.

    Args:
        mixes_ptr: fp32 rows of ``n3 = N*(N+2)`` values, row ``t`` at ``mixes_ptr + t * row_stride``.
        scale_ptr / base_ptr: fp32 ``(3,)`` / ``(n3,)``.
        tok: int64 ``[BT]`` token indices; ``tok_mask``: ``[BT]`` valid tokens.
        n_i: ``tl.arange(0, BN)`` (any int type), n_o: the same (used as ``[BT, BN]`` and ``[BT, BN, BN]``).
        pre_eps, post_mult: fp32 scalars.

    Returns ``(pre [BT, BN], post [BT, BN], comb_logits [BT, BN, BN])`` fp32, padded entries 0:
    ``pre = sigmoid(fma(m_j, scale0, base_j)) + pre_eps``, ``post = post_mult * sigmoid(fma(m_{N+j}, scale1,
    base_{N+j}))``, ``comb[i, o] = fma(m_{2N+iN+o}, scale2, base_{2N+iN+o})``.
    """
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m2 = tok_mask[:, None] & (n_i[None, :] < N)
    row = mixes_ptr + tok[:, None] * row_stride
    zp = mix_affine(tl.load(row + n_i[None, :], mask=m2, other=0.0), s0,
                    tl.load(base_ptr + n_i, mask=n_i < N, other=0.0)[None, :])
    zq = mix_affine(tl.load(row + N + n_i[None, :], mask=m2, other=0.0), s1,
                    tl.load(base_ptr + N + n_i, mask=n_i < N, other=0.0)[None, :])
    pre = tl.where(m2, pre_from_logit(zp, pre_eps), 0.0)
    post = tl.where(m2, post_from_logit(zq, post_mult), 0.0)
    cij = n_i[:, None] * N + n_o[None, :]
    cm = (n_i[:, None] < N) & (n_o[None, :] < N)
    m3 = tok_mask[:, None, None] & cm[None, :, :]
    mc = tl.load(mixes_ptr + tok[:, None, None] * row_stride + 2 * N + cij[None, :, :], mask=m3, other=0.0)
    bc = tl.load(base_ptr + 2 * N + cij, mask=cm, other=0.0)
    comb = tl.where(m3, mix_affine(mc, s2, bc[None, :, :]), 0.0)
    return pre, post, comb


# ------------------------------------------------------------------------------------------------
# Sinkhorn-Knopp on [BT, BN, BN] blocks (axis 1 = i, axis 2 = o)
# ------------------------------------------------------------------------------------------------
@triton.jit
def _sk_softmax_rows(c, i3, o3, TREE: tl.constexpr, N: tl.constexpr):
    """Row softmax over ``o`` (axis 2): ``e = exp(c - rowmax)``, ``e / rowsum(e)`` (``div_rn``), the row sum a
    butterfly (``TREE``) or added in order.  Padded entries come out 0."""
    valid = (i3 < N) & (o3 < N)
    mx = extract(c, o3, 0, 2)
    for k in tl.static_range(1, N):
        mx = tl.maximum(mx, extract(c, o3, k, 2))
    e = tl.where(valid, exp_f32(c - mx[:, :, None]), 0.0)
    if TREE:
        s = tree_last(e)
    else:
        s = ordered_sum(e, o3, N, 2)
    s = tl.where(s > 0.0, s, 1.0)  # padded rows only (a real row's sum is >= 1)
    return tl.math.div_rn(e, s[:, :, None])


@triton.jit
def _sk_norm(a, i3, o3, eps, COLS, TREE_ROWS: tl.constexpr, N: tl.constexpr):
    """One normalisation: ``COLS`` (run-time or constexpr bool): ``a / (colsum(a) + eps)`` with the sum over ``i``
    (axis 1, a butterfly); else ``a / (rowsum(a) + eps)`` over ``o`` (axis 2; a butterfly with ``TREE_ROWS``, else
    added in order).  ``div_rn``."""
    if COLS:
        r = tl.math.div_rn(a, tree_mid(a)[:, None, :] + eps)
    else:
        if TREE_ROWS:
            r = tl.math.div_rn(a, tree_last(a)[:, :, None] + eps)
        else:
            r = tl.math.div_rn(a, ordered_sum(a, o3, N, 2)[:, :, None] + eps)
    return r


@triton.jit
def sinkhorn_fwd(c, i3, o3, eps, N: tl.constexpr, REPEAT: tl.constexpr):
    """Sinkhorn-Knopp of spec §1.3 on a ``[BT, BN, BN]`` fp32 block of logits ``c``, in the order of TileKernels'
    forward kernels (``sinkhorn_normalize``'s and ``pre_big_fuse``'s).

    ``i3 = tl.arange(0, BN)[None, :, None]``, ``o3 = tl.arange(0, BN)[None, None, :]``; ``REPEAT >= 1``.
    Order: row softmax; ``+ eps``; column normalisation; then ``REPEAT - 1`` times (row, column).  Every row and
    column sum is a butterfly over the ``BN`` (zero-padded) entries; every division is ``div_rn(a, sum + eps)``.
    Padded entries are 0."""
    valid = (i3 < N) & (o3 < N)
    a = tl.where(valid, _sk_softmax_rows(c, i3, o3, True, N) + eps, 0.0)
    a = _sk_norm(a, i3, o3, eps, True, True, N)
    for _ in tl.static_range(REPEAT - 1):
        a = _sk_norm(a, i3, o3, eps, False, True, N)
        a = _sk_norm(a, i3, o3, eps, True, True, N)
    return tl.where(valid, a, 0.0)


@triton.jit
def _row_fma_sum(g, x, o3, N: tl.constexpr):
    """``acc = fma(g_o, x_o, acc)`` over ``o = 0..N-1`` (axis 2) from 0: ``[BT, BN, BN]`` -> ``[BT, BN]``."""
    acc = tl.zeros([g.shape[0], g.shape[1]], tl.float32)
    for o in tl.static_range(N):
        acc = tl.fma(extract(g, o3, o, 2), extract(x, o3, o, 2), acc)
    return acc


@triton.jit
def sinkhorn_bwd(c, g, i3, o3, eps, tape_ptrs, tape_mask, slot_stride, N: tl.constexpr, REPEAT: tl.constexpr):
    """Gradient of the Sinkhorn-Knopp w.r.t. the logits ``c`` given the output gradient ``g`` (both
    ``[BT, BN, BN]`` fp32), by unrolled reverse mode, recomputing the forward from ``c``, in the order of
    TileKernels' backward kernel: its recomputation sums rows in order and columns as butterflies (so its forward
    values may differ from :func:`sinkhorn_fwd`'s in the last bit).

    ``tape_ptrs`` (fp32 pointers ``[BT, BN, BN]``, masked by ``tape_mask``) addresses this block's slot 0 of a
    scratch tape of ``2 * REPEAT - 1`` slots, slot ``k`` at ``tape_ptrs + k * slot_stride``: the forward pass
    stores the matrix entering each normalisation there, and the reverse pass reads it back (same program, same
    layout).  For a normalisation ``Y = X / (s + eps)`` along an axis:
    ``gX = (gY - sum_axis(gY * X) / (s + eps)) / (s + eps)``, the sum over columns a butterfly of the rounded
    products, over rows a chain of fused multiply-adds from 0; the ``+ eps`` after the softmax passes ``g``
    through; the softmax: ``gC = (gS - rowsum(gS * S)) * S`` (the row sum again a chain)."""
    valid = (i3 < N) & (o3 < N)
    g = tl.where(valid, g, 0.0)
    NSTEP: tl.constexpr = 2 * REPEAT - 1  # normalisations after the softmax: odd steps columns, even rows
    s = _sk_softmax_rows(c, i3, o3, False, N)
    x = tl.where(valid, s + eps, 0.0)
    for j in range(1, NSTEP + 1):
        tl.store(tape_ptrs + (j - 1) * slot_stride, x, mask=tape_mask)
        x = _sk_norm(x, i3, o3, eps, (j % 2) == 1, False, N)
    for jj in range(NSTEP):
        j = NSTEP - jj
        x = tl.load(tape_ptrs + (j - 1) * slot_stride, mask=tape_mask, other=0.0)
        # (each branch names its own [BT, 1, BN] / [BT, BN, 1] values: a run-time `if` needs equal types)
        if (j % 2) == 1:
            dcol = tree_mid(x)[:, None, :] + eps
            tcol = tree_mid(g * x)[:, None, :]
            g = tl.math.div_rn(g - tl.math.div_rn(tcol, dcol), dcol)
        else:
            drow = ordered_sum(x, o3, N, 2)[:, :, None] + eps
            trow = _row_fma_sum(g, x, o3, N)[:, :, None]
            g = tl.math.div_rn(g - tl.math.div_rn(trow, drow), drow)
        # padded entries (n below the tile's power of two) would grow by 1 / eps a step, to inf and then NaN
        # through the zero padding of the next sum: keep them 0 (the valid entries' values are unchanged)
        g = tl.where(valid, g, 0.0)
    r = _row_fma_sum(g, s, o3, N)[:, :, None]
    return tl.where(valid, (g - r) * s, 0.0)


# ------------------------------------------------------------------------------------------------
# Apply-mix and post on residual tiles
# ------------------------------------------------------------------------------------------------
@triton.jit
def apply_mix(x, w, n2, n3, N: tl.constexpr):
    """Pre-mix of a residual tile: ``u[t, h] = sum_m w[t, m] * x[t, m, h]``.

    ``x``: ``[BT, BN, BH]`` fp32; ``w``: ``[BT, BN]`` fp32; ``n2 = tl.arange(0, BN)[None, :]``,
    ``n3 = tl.arange(0, BN)[None, :, None]``.  Order: ``acc = 0``; ``acc = fma(w_m, x_m, acc)`` for
    ``m = 0..N-1``.  Returns ``[BT, BH]`` fp32 (the caller rounds once to bf16 at the store)."""
    acc = tl.zeros([x.shape[0], x.shape[2]], tl.float32)
    for m in tl.static_range(N):
        acc = tl.fma(extract(w, n2, m, 1)[:, None], extract(x, n3, m, 1), acc)
    return acc


@triton.jit
def post_mix(y, x, post, comb, n2, n3, N: tl.constexpr):
    """Post combination of a residual tile: ``out[t, o, h] = post[t, o] * y[t, h] + sum_i comb[t, i, o] * x[t, i, h]``.

    ``y``: ``[BT, BH]`` fp32 (layer output); ``x``: ``[BT, BN, BH]`` fp32 residual; ``post``: ``[BT, BN]``;
    ``comb``: ``[BT, BN, BN]`` (axis 1 = ``i``, axis 2 = ``o``); ``n2``/``n3`` as in :func:`apply_mix`.
    Order (TileKernels'): ``acc = fma(post_o, y, comb[0, o] * x_0)``, then ``acc = fma(comb[i, o], x_i, acc)`` for
    ``i = 1..N-1``.  Returns ``[BT, BN, BH]`` fp32 (padded streams: mask at the store)."""
    first = extract(comb, n3, 0, 1)[:, :, None] * extract(x, n3, 0, 1)[:, None, :]
    acc = tl.fma(post[:, :, None], y[:, None, :], first)
    for i in tl.static_range(1, N):
        acc = tl.fma(extract(comb, n3, i, 1)[:, :, None], extract(x, n3, i, 1)[:, None, :], acc)
    return acc


# ------------------------------------------------------------------------------------------------
# Host-side launch rules (shared by the mHC kernel wrappers)
# ------------------------------------------------------------------------------------------------
# Launch option of every mHC kernel: no contraction of products into fused multiply-adds by the compiler, so that
# the ones TileKernels' code has are the explicit ``tl.fma`` calls and no others (the interpreter never fuses).
NO_FUSION = dict(enable_fp_fusion=False)


def hidden_block(hidden: int, cap: int = 1024) -> int:
    """Hidden-chunk width: the largest power of two ``<= cap`` dividing ``hidden`` when that is at least 256
    (no masked lanes: 7168 -> 1024, 2560 -> 512, 7680 -> 512), else ``min(cap, next_pow2(hidden))`` (at least 16)."""
    b = cap
    while b >= 256:
        if hidden % b == 0:
            return b
        b //= 2
    return max(16, min(cap, next_power_of_two(hidden)))


def residual_tile_config(hidden: int, bn: int, one_token: bool = False, interp_elems: int = 8192) -> dict:
    """Launch config ``BT`` / ``BH`` / ``num_warps`` of the kernels over ``[BT, BN, BH]`` residual tiles.

    GPU: ``BH = hidden_block(hidden)`` and tiles of about 4096 elements (8 KiB of bf16 per program and operand), or
    one token per program (``one_token``: the backward kernels, which walk a token's hidden chunks in turn, so that
    per-token sums need no atomics).  Interpreter: chunks up to 2048 wide and tiles of about ``interp_elems``
    elements (fewer, larger programs)."""
    if interpreter_configs():
        bh = hidden_block(hidden, cap=2048)
        return dict(BT=max(1, interp_elems // (bh * bn)), BH=bh, num_warps=4)
    bh = hidden_block(hidden)
    return dict(BT=1 if one_token else max(1, 4096 // (bh * bn)), BH=bh, num_warps=4)


def token_config(gpu_bt: int, interp_bt: int) -> dict:
    """Launch config of the small per-token kernels: ``BT`` tokens per program (``interp_bt`` under the interpreter,
    ``gpu_bt`` elsewhere) at 4 warps."""
    return dict(BT=interp_bt if interpreter_configs() else gpu_bt, num_warps=4)


# ------------------------------------------------------------------------------------------------
# Residual-gradient protocol (``residual.untyped_storage().grad_from_mhc_post``)
# ------------------------------------------------------------------------------------------------
def check_positive(name: str, value) -> float:
    """A positive, finite real number (an epsilon): TypeError / ValueError naming ``name`` otherwise."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return v


def check_nonzero(name: str, value) -> float:
    """A non-zero, finite real number (a multiplier that the backward divides by)."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v == 0.0:
        raise ValueError(f"{name} must be non-zero and finite (the backward divides by it), got {value!r}")
    return v


GRAD_ATTR = "grad_from_mhc_post"
# Per-view buffers: several residuals can be views of one storage (``R[0:1]``, ``R[1:2]``), so the storage keeps a
# dict from each view's geometry to its buffer beside TileKernels' single attribute.
_VIEWS_ATTR = "grad_from_mhc_post_views"


def _view_key(t):
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def get_post_grad_buffer(residual, take: bool = False):
    """The bf16 gradient buffer ``mhc_post``'s backward attached to ``residual``, or None (also when the storage
    cannot carry Python attributes, e.g. while tracing).  ``mhc_post`` stores it with the residual's shape
    ``(B, S, n, H)``; consumers view it as they need (it is contiguous).

    The buffer is looked up by the residual's storage and its view (offset, shape, strides), so residuals that are
    views of one tensor each find their own.  A buffer set directly as ``residual.untyped_storage().
    grad_from_mhc_post`` (TileKernels' protocol, one residual a storage; its tests set it by hand) is found too,
    unless ``mhc_post`` registered it for another view of the storage.  ``take`` (``mhc_pre_norm_fn``, the last
    consumer) removes the buffer: the view's entry, and the attribute if it holds this buffer.

    Under ``torch.compile`` the protocol is off (a storage attribute cannot be traced): ``mhc_post`` then returns
    its residual gradient only through autograd, the other consumers return theirs, and autograd adds them."""
    import torch

    if torch.compiler.is_compiling():
        return None
    try:
        st = residual.untyped_storage()
        views = getattr(st, _VIEWS_ATTR, None) or {}
        key = _view_key(residual)
        buf = views.get(key)
        attr = getattr(st, GRAD_ATTR, None)
        if buf is None and attr is not None and not any(attr is b for b in views.values()):
            buf = attr
        if take and buf is not None:
            views.pop(key, None)
            if attr is buf:
                delattr(st, GRAD_ATTR)
            if not views and hasattr(st, _VIEWS_ATTR):
                delattr(st, _VIEWS_ATTR)
        return buf
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def set_post_grad_buffer(residual, buf) -> bool:
    """Attach ``buf`` to ``residual``'s view of its storage (the protocol's step 1), and as the storage's
    ``grad_from_mhc_post`` (as TileKernels); False where the storage cannot carry it (and under ``torch.compile``,
    see :func:`get_post_grad_buffer`)."""
    import torch

    if torch.compiler.is_compiling():
        return False
    try:
        st = residual.untyped_storage()
        views = getattr(st, _VIEWS_ATTR, None)
        if views is None:
            views = {}
            setattr(st, _VIEWS_ATTR, views)
        views[_view_key(residual)] = buf
        setattr(st, GRAD_ATTR, buf)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
