"""Shared ``@triton.jit`` helpers of the mHC kernels.

Every kernel that must agree bit for bit with another (``pre_big_fuse`` with the unfused chain
``pre_split_mixes`` -> ``sinkhorn`` -> ``pre_apply_mix``; ``multilayer_recompute`` with chained
``pre_apply_mix`` / ``post``) computes through these helpers, so that the same fp32 operations run in
the same order.  Results are then independent of block sizes, warps and tiling: every helper works per
token (and per hidden index), sums over streams run in an explicit order, and no ``tl.sum`` reduces over
a stream axis except :func:`extract`, whose sum adds one value to zeros (exact in any order).

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
``post_mix``, ``extract``, ``ordered_sum``, ``mix_affine``, ``sigmoid_f32``, ``pre_from_logit``,
``post_from_logit``.  ``sinkhorn_bwd`` is used by the Sinkhorn backward kernel only.  The program prologues
(``token_block``, ``token_prologue``, ``tile_prologue``, ``hidden_range``) and the addresses of the layouts
(``stream_block``, ``comb_block`` / ``comb_offsets``, ``hidden_tile``, ``residual_offsets``) are shared by the
per-token kernels; the host side has the launch rules (``hidden_block``, ``residual_tile_config``,
``token_config``, ``partial_programs``).

Fused multiply-add: every stream accumulation is written ``acc = tl.fma(w, x, acc)`` explicitly (one
rounding on the GPU, a product and a sum under the interpreter: the same on each backend for every
kernel that uses these helpers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritile.config import get_num_sms
from tritile.language import exp_f32
from tritile.runtime import interpreter_configs
from tritile.utils import ceil_div, next_power_of_two


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
def hidden_range(c, H, BH: tl.constexpr):
    """Hidden chunk ``c``: columns ``h = c * BH + [0, BH)`` and their mask ``h < H``."""
    h = c * BH + tl.arange(0, BH)
    return h, h < H


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


# ------------------------------------------------------------------------------------------------
# Sigmoid-affine split of the mixes (pre / post / comb logits)
# ------------------------------------------------------------------------------------------------
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
def _sk_softmax_rows(c, i3, o3, N: tl.constexpr):
    """Row softmax over ``o`` (axis 2): ``e = exp(c - rowmax)``, ``e / rowsum(e)`` (ordered sum, ``div_rn``).
    Padded entries come out 0."""
    valid = (i3 < N) & (o3 < N)
    mx = extract(c, o3, 0, 2)
    for k in tl.static_range(1, N):
        mx = tl.maximum(mx, extract(c, o3, k, 2))
    e = tl.where(valid, exp_f32(c - mx[:, :, None]), 0.0)
    s = ordered_sum(e, o3, N, 2)
    s = tl.where(s > 0.0, s, 1.0)  # padded rows only (a real row's sum is >= 1)
    return tl.math.div_rn(e, s[:, :, None])


@triton.jit
def _sk_norm(a, i3, o3, eps, COLS, N: tl.constexpr):
    """One normalisation: ``COLS`` (run-time or constexpr bool): ``a / (colsum(a) + eps)`` with the sum over ``i``
    (axis 1); else ``a / (rowsum(a) + eps)`` over ``o`` (axis 2).  Ordered sums, ``div_rn``."""
    if COLS:
        r = tl.math.div_rn(a, ordered_sum(a, i3, N, 1)[:, None, :] + eps)
    else:
        r = tl.math.div_rn(a, ordered_sum(a, o3, N, 2)[:, :, None] + eps)
    return r


@triton.jit
def sinkhorn_fwd(c, i3, o3, eps, N: tl.constexpr, REPEAT: tl.constexpr):
    """Sinkhorn-Knopp of spec §1.3 on a ``[BT, BN, BN]`` fp32 block of logits ``c``.

    ``i3 = tl.arange(0, BN)[None, :, None]``, ``o3 = tl.arange(0, BN)[None, None, :]``; ``REPEAT >= 1``.
    Order: row softmax; ``+ eps``; column normalisation; then ``REPEAT - 1`` times (row, column).  Every sum runs
    over ``k = 0..N-1`` left to right; every division is ``div_rn(a, sum + eps)``.  Padded entries are 0."""
    valid = (i3 < N) & (o3 < N)
    a = tl.where(valid, _sk_softmax_rows(c, i3, o3, N) + eps, 0.0)
    a = _sk_norm(a, i3, o3, eps, True, N)
    for _ in tl.static_range(REPEAT - 1):
        a = _sk_norm(a, i3, o3, eps, False, N)
        a = _sk_norm(a, i3, o3, eps, True, N)
    return tl.where(valid, a, 0.0)


@triton.jit
def sinkhorn_bwd(c, g, i3, o3, eps, tape_ptrs, tape_mask, slot_stride, N: tl.constexpr, REPEAT: tl.constexpr):
    """Gradient of :func:`sinkhorn_fwd` w.r.t. the logits ``c`` given the output gradient ``g`` (both
    ``[BT, BN, BN]`` fp32), by unrolled reverse mode, recomputing the forward from ``c``.

    ``tape_ptrs`` (fp32 pointers ``[BT, BN, BN]``, masked by ``tape_mask``) addresses this block's slot 0 of a
    scratch tape of ``2 * REPEAT - 1`` slots, slot ``k`` at ``tape_ptrs + k * slot_stride``: the forward pass
    stores the matrix entering each normalisation there, and the reverse pass reads it back (same program, same
    layout).  For a normalisation ``Y = X / (s + eps)`` along an axis:
    ``gX = (gY - sum_axis(gY * X) / (s + eps)) / (s + eps)``; the ``+ eps`` after the softmax passes ``g``
    through; the softmax: ``gC = (gS - rowsum(gS * S)) * S``."""
    valid = (i3 < N) & (o3 < N)
    g = tl.where(valid, g, 0.0)
    NSTEP: tl.constexpr = 2 * REPEAT - 1  # normalisations after the softmax: odd steps columns, even rows
    s = _sk_softmax_rows(c, i3, o3, N)
    x = tl.where(valid, s + eps, 0.0)
    for j in range(1, NSTEP + 1):
        tl.store(tape_ptrs + (j - 1) * slot_stride, x, mask=tape_mask)
        x = _sk_norm(x, i3, o3, eps, (j % 2) == 1, N)
    for jj in range(NSTEP):
        j = NSTEP - jj
        x = tl.load(tape_ptrs + (j - 1) * slot_stride, mask=tape_mask, other=0.0)
        # (each branch names its own [BT, 1, BN] / [BT, BN, 1] values: a run-time `if` needs equal types)
        if (j % 2) == 1:
            dcol = ordered_sum(x, i3, N, 1)[:, None, :] + eps
            tcol = ordered_sum(g * x, i3, N, 1)[:, None, :]
            g = tl.math.div_rn(g - tl.math.div_rn(tcol, dcol), dcol)
        else:
            drow = ordered_sum(x, o3, N, 2)[:, :, None] + eps
            trow = ordered_sum(g * x, o3, N, 2)[:, :, None]
            g = tl.math.div_rn(g - tl.math.div_rn(trow, drow), drow)
    r = ordered_sum(g * s, o3, N, 2)[:, :, None]
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
    Order: ``acc = post_o * y``; then ``acc = fma(comb[i, o], x_i, acc)`` for ``i = 0..N-1``.
    Returns ``[BT, BN, BH]`` fp32 (padded streams hold garbage-free zeros times inputs; mask at the store)."""
    acc = post[:, :, None] * y[:, None, :]
    for i in tl.static_range(N):
        acc = tl.fma(extract(comb, n3, i, 1)[:, :, None], extract(x, n3, i, 1)[:, None, :], acc)
    return acc


# ------------------------------------------------------------------------------------------------
# Host-side launch rules (shared by the mHC kernel wrappers)
# ------------------------------------------------------------------------------------------------
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


def partial_programs(num_tokens: int, bt: int) -> int:
    """Program count of the backward kernels that write one row of partial sums each (deterministic, no atomics):
    one program per ``bt``-token block, at most one per SM (each then strides over the blocks)."""
    return max(1, min(get_num_sms(), ceil_div(num_tokens, bt)))


# ------------------------------------------------------------------------------------------------
# Residual-gradient protocol (``residual.untyped_storage().grad_from_mhc_post``)
# ------------------------------------------------------------------------------------------------
GRAD_ATTR = "grad_from_mhc_post"


def get_post_grad_buffer(residual):
    """The bf16 gradient buffer ``mhc_post``'s backward attached to ``residual``'s storage, or None (also when the
    storage cannot carry Python attributes, e.g. while tracing).  ``mhc_post`` stores it with the residual's
    shape ``(B, S, n, H)``; consumers view it as they need (it is contiguous).

    Under ``torch.compile`` the protocol is off (a storage attribute cannot be traced): ``mhc_post`` then returns
    its residual gradient only through autograd, the other consumers return theirs, and autograd adds them."""
    import torch

    if torch.compiler.is_compiling():
        return None
    try:
        return getattr(residual.untyped_storage(), GRAD_ATTR, None)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def set_post_grad_buffer(residual, buf) -> bool:
    """Attach ``buf`` to ``residual``'s storage (the protocol's step 1); False where the storage cannot carry it
    (and under ``torch.compile``, see :func:`get_post_grad_buffer`)."""
    import torch

    if torch.compiler.is_compiling():
        return False
    try:
        setattr(residual.untyped_storage(), GRAD_ATTR, buf)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
