"""Pure-PyTorch references of the mHC (Manifold HyperConnection) ops (``tile_kernels.torch.mhc``).

Written from the math of the mHC spec (residual ``R`` of ``n`` streams, ``mixes`` rows of ``n3 = n (n + 2)``
values: pre logits, post logits, comb logits ``[i * n + o]``).  All functions are plain differentiable torch;
the tests get the reference gradients through autograd.  Sums over the stream axis of Sinkhorn run left to
right, as the kernels add them; ``exp`` computes as the kernels do on each backend (``_numerics.exp_f32``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._numerics import exp_f32

__all__ = [
    "expand_to_mhc_ref",
    "mhc_head_compute_mix_ref",
    "mhc_post_ref",
    "mhc_pre_apply_mix_ref",
    "mhc_pre_norm_fn_ref",
    "mhc_pre_split_mixes_ref",
    "sinkhorn_normalize_ref",
]


class _Exp(torch.autograd.Function):
    """``exp_f32`` with its derivative (``g * exp(x)``)."""

    @staticmethod
    def forward(ctx, x):
        y = exp_f32(x).to(x.device)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` added left to right, the dimension kept (size 1)."""
    s = x.narrow(dim, 0, 1)
    for k in range(1, x.size(dim)):
        s = s + x.narrow(dim, k, 1)
    return s


def expand_to_mhc_ref(hidden: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    """``hidden (..., H)`` copied to every stream: ``(..., mhc_mult, H)``, same dtype, contiguous."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], mhc_mult, hidden.shape[-1]).contiguous()


def sinkhorn_normalize_ref(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-Knopp on the last two dims of fp32 ``x (..., n, n)``: row softmax, ``+ eps``, a column
    normalisation, then ``repeat - 1`` (row, column) pairs; every normalisation divides by ``sum + eps``.
    ``repeat = 0`` behaves like 1.  Returns fp32 of ``x``'s shape."""
    x = x.float()
    e = _Exp.apply(x - x.amax(dim=-1, keepdim=True).detach())
    a = e / _ordered_sum(e, -1)
    a = a + eps
    a = a / (_ordered_sum(a, -2) + eps)
    for _ in range(max(repeat, 1) - 1):
        a = a / (_ordered_sum(a, -1) + eps)
        a = a / (_ordered_sum(a, -2) + eps)
    return a


def mhc_pre_split_mixes_ref(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                            mhc_mult: int, mhc_post_mult_value: float,
                            mhc_pre_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fp32 ``input_mixes (B, S, n3)`` with ``z = mixes * scale[min(2, j // n)] + base``.

    Returns fp32 ``pre = sigmoid(z[:n]) + pre_eps`` ``(B, S, n, 1)``, ``post = post_mult * sigmoid(z[n:2n])``
    ``(B, S, n, 1)`` and the raw comb logits ``z[2n:]`` as ``(B, S, n, n)`` (``[i, o]``)."""
    n = mhc_mult
    b, s, _ = input_mixes.shape
    scale = torch.cat([mhc_scale[0:1].expand(n), mhc_scale[1:2].expand(n), mhc_scale[2:3].expand(n * n)])
    z = input_mixes * scale + mhc_base
    pre = torch.sigmoid(z[..., :n]) + mhc_pre_eps
    post = torch.sigmoid(z[..., n:2 * n]) * mhc_post_mult_value
    comb = z[..., 2 * n:]
    return pre.view(b, s, n, 1), post.view(b, s, n, 1), comb.reshape(b, s, n, n)


def mhc_pre_apply_mix_ref(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``sum_m mix[..., m, 0] * x[..., m, :]`` in fp32, then bf16: bf16 ``x (..., n, H)``, fp32 ``mix (..., n, 1)``
    -> bf16 ``(..., H)``."""
    return (x.float() * mix).sum(-2).bfloat16()


def mhc_post_ref(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                 comb_res_mix: torch.Tensor) -> torch.Tensor:
    """``out[..., o, :] = post[..., o, 0] * x + sum_i comb[..., i, o] * residual[..., i, :]`` in fp32, then bf16.

    bf16 ``x (B, S, H)``, bf16 ``residual (B, S, n, H)``, fp32 ``post_layer_mix (B, S, n, 1)``, fp32
    ``comb_res_mix (B, S, n, n)`` -> bf16 ``(B, S, n, H)``."""
    term = post_layer_mix * x.float().unsqueeze(-2)
    mix = torch.einsum("bsio,bsih->bsoh", comb_res_mix, residual.float())
    return (term + mix).bfloat16()


def mhc_head_compute_mix_ref(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                             mhc_pre_eps: float) -> torch.Tensor:
    """fp32 ``sigmoid(input_mix * scale + base) + pre_eps`` for ``input_mix (B, S, n)``, ``scale (1,)``,
    ``base (n,)``."""
    return torch.sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps


def mhc_pre_norm_fn_ref(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: Optional[torch.Tensor],
                        mhc_norm_eps: float) -> torch.Tensor:
    """RMS-normalised projection: bf16 ``residual (a, b, n, H)`` flattened to ``x (a, b, D)``, fp32
    ``mhc_fn (n3, D)`` (times ``mhc_norm_weight (D,)`` per column when given) -> fp32
    ``(x @ fn.T) * rsqrt(mean(x^2) + eps)`` of shape ``(a, b, n3)``."""
    a, b, n, h = residual.shape
    x = residual.float().reshape(a, b, n * h)
    fn = mhc_fn if mhc_norm_weight is None else mhc_fn * mhc_norm_weight
    p = torch.einsum("abd,jd->abj", x, fn)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + mhc_norm_eps)
    return p * r


# ------------------------------------------------------------------------------------------------
# TileKernels' orders of operations, step by step (private: the bitwise tests' references)
# ------------------------------------------------------------------------------------------------
# TileKernels' kernels are compiled by nvcc with contraction on: a product added to something becomes one fused
# multiply-add, and where both operands of an addition are products, the left one is fused.  A TileLang reduction
# across threads is a butterfly over the threads (partner ``t ^ offset``, offsets from the largest down), which gives
# every thread the same tree sum: the two halves added element by element, then the halves of the result, and so on
# (:func:`_lane_tree`).  A reduction inside a thread, or a loop over a fragment, adds in order.  These functions
# compute exactly that way; ``fma_f32`` fuses on CUDA and rounds twice on the CPU, as ``tl.fma`` does on each
# backend, so each is bitwise what tritile's kernels give on either backend.

from ._numerics import fma_f32  # noqa: E402


def _lane_tree(p: torch.Tensor) -> torch.Tensor:
    """Butterfly sum over the last dim (a power of two): halves added element by element until one is left."""
    while p.shape[-1] > 1:
        h = p.shape[-1] // 2
        p = p[..., :h] + p[..., h:]
    return p[..., 0]


def _pad_pow2(p: torch.Tensor, dim: int) -> torch.Tensor:
    n = p.shape[dim]
    m = 1 << max(0, (n - 1).bit_length())
    if m == n:
        return p
    shape = list(p.shape)
    shape[dim] = m - n
    return torch.cat([p, p.new_zeros(shape)], dim)


def _tree_sum(p: torch.Tensor, dim: int) -> torch.Tensor:
    """Butterfly sum over ``dim`` (padded with zeros to a power of two), the dim kept (size 1)."""
    return _lane_tree(_pad_pow2(p, dim).movedim(dim, -1)).unsqueeze(dim)


def _seq_sum(p: torch.Tensor, dim: int) -> torch.Tensor:
    """``((0 + p_0) + p_1) + ...`` over ``dim``, the dim kept."""
    s = torch.zeros_like(p.narrow(dim, 0, 1))
    for k in range(p.shape[dim]):
        s = s + p.narrow(dim, k, 1)
    return s


def _fma_chain(a: torch.Tensor, b: torch.Tensor, dim: int, acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``acc = fma(a_k, b_k, acc)`` for k along ``dim`` in order, from ``acc`` (zeros by default); the dim kept."""
    a, b = torch.broadcast_tensors(a.float(), b.float())
    if acc is None:
        acc = torch.zeros_like(a.narrow(dim, 0, 1))
    for k in range(a.shape[dim]):
        acc = fma_f32(a.narrow(dim, k, 1), b.narrow(dim, k, 1), acc)
    return acc


def _sigmoid_tk(z: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(0 - z))`` with an IEEE division."""
    one = torch.ones_like(z)
    return torch.div(one, one + exp_f32(torch.zeros_like(z) - z).to(z.device))


def _post_fwd_tk(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``mhc_post`` forward: ``fma(post_o, y, comb[0, o] r_0)``, then ``fma(comb[i, o], r_i, acc)`` for
    ``i = 1..n-1``; bf16.  (..., n, H) layout as the op."""
    y = x.float().unsqueeze(-2)
    r = residual.float()
    n = r.shape[-2]
    acc = fma_f32(post.float(), y, comb[..., 0, :, None] * r[..., 0:1, :])
    for i in range(1, n):
        acc = fma_f32(comb[..., i, :, None], r[..., i:i + 1, :], acc)
    return acc.bfloat16()


def _lanes_strided(t: torch.Tensor, lanes: int = 128) -> torch.Tensor:
    """``(..., H)`` -> ``(..., H / lanes, lanes)``: lane ``l`` holds ``h = j lanes + l``, j in order (zero-padded)."""
    h = t.shape[-1]
    hp = -(-h // lanes) * lanes
    if hp != h:
        t = torch.cat([t, t.new_zeros(*t.shape[:-1], hp - h)], -1)
    return t.reshape(*t.shape[:-1], hp // lanes, lanes)


def _lanes_blocked(t: torch.Tensor, vec: int, lanes: int = 128) -> torch.Tensor:
    """``(..., H)`` -> ``(..., H / (lanes vec) * vec, lanes)``: chunks of ``lanes * vec``, lane ``l`` holding the
    ``vec`` contiguous ``h = c lanes vec + l vec + k``; axis -2 runs over (c, k) in order."""
    h = t.shape[-1]
    w = lanes * vec
    hp = -(-h // w) * w
    if hp != h:
        t = torch.cat([t, t.new_zeros(*t.shape[:-1], hp - h)], -1)
    t = t.reshape(*t.shape[:-1], hp // w, lanes, vec).transpose(-1, -2)
    return t.reshape(*t.shape[:-3], (hp // w) * vec, lanes)


def _post_bwd_tk(x, residual, post, comb, grad):
    """``mhc_post`` backward: ``(d_x, d_residual, d_post, d_comb)``.  The stream sums are fma chains in ``o`` order
    from 0; the sums over ``h`` are per-lane fma chains (lane ``l`` holds ``h = j 128 + l``) then a 128-lane
    butterfly."""
    g = grad.float()
    r = residual.float()
    y = x.float()
    n = r.shape[-2]
    d_x = _fma_chain(post.float(), g, -2).squeeze(-2).bfloat16()
    d_res = torch.stack([_fma_chain(comb[..., i, :, None], g, -2).squeeze(-2) for i in range(n)], -2).bfloat16()
    gl = _lanes_strided(g)                      # (..., n, J, 128)
    rl = _lanes_strided(r)
    yl = _lanes_strided(y).unsqueeze(-3)        # (..., 1, J, 128)
    d_post = _lane_tree(_fma_chain(yl, gl, -2).squeeze(-2)).unsqueeze(-1)
    d_comb = _lane_tree(_fma_chain(rl.unsqueeze(-3), gl.unsqueeze(-4), -2).squeeze(-2))
    return d_x, d_res, d_post, d_comb


def _apply_mix_vec(hidden: int) -> int:
    """Elements a lane holds per chunk in ``mhc_pre_apply_mix``'s backward: ``gcd(1024, H) / 128`` (1 when ``H`` is
    not a multiple of 128)."""
    import math

    g = math.gcd(1024, hidden)
    return g // 128 if g >= 128 else 1


def _apply_mix_bwd_tk(x, mix, grad, acc=None):
    """``mhc_pre_apply_mix`` backward: ``(d_x, d_mix)``.  ``d_x = bf16(fma(mix_m, g, acc))`` (``acc``: the bf16
    buffer's values or 0); ``d_mix`` per-lane fma chains (chunks of ``128 vec``, lane ``l`` holding
    ``vec = gcd(1024, H) / 128`` contiguous values) then a 128-lane butterfly."""
    g = grad.float().unsqueeze(-2)
    a = torch.zeros_like(x, dtype=torch.float32) if acc is None else acc.float()
    d_x = fma_f32(mix.float(), g, a).bfloat16()
    v = _apply_mix_vec(x.shape[-1])
    d_mix = _lane_tree(_fma_chain(_lanes_blocked(g, v), _lanes_blocked(x.float(), v), -2).squeeze(-2))
    return d_x, d_mix.unsqueeze(-1)


def _sinkhorn_fwd_tk(x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """Sinkhorn forward of TileKernels' forward kernels (``sinkhorn_normalize``, ``pre_big_fuse``): row and column
    sums are butterflies."""
    x = x.float()
    e = exp_f32(x - x.amax(-1, keepdim=True)).to(x.device)
    a = e / _tree_sum(e, -1) + eps
    a = a / (_tree_sum(a, -2) + eps)
    for _ in range(max(repeat, 1) - 1):
        a = a / (_tree_sum(a, -1) + eps)
        a = a / (_tree_sum(a, -2) + eps)
    return a


def _sinkhorn_bwd_tk(x: torch.Tensor, grad: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """Sinkhorn backward of TileKernels' backward kernel: its forward recomputation sums rows in order and columns
    as butterflies; the reverse pass sums ``g x`` over rows as fma chains from 0 and over columns as butterflies of
    the rounded products."""
    x = x.float()
    g = grad.float()
    e = exp_f32(x - x.amax(-1, keepdim=True)).to(x.device)
    s = e / _seq_sum(e, -1)
    a = s + eps
    tape = []
    cs = _tree_sum(a, -2)
    tape.append((a, cs, True))
    a = a / (cs + eps)
    for _ in range(max(repeat, 1) - 1):
        rs = _seq_sum(a, -1)
        tape.append((a, rs, False))
        a = a / (rs + eps)
        cs = _tree_sum(a, -2)
        tape.append((a, cs, True))
        a = a / (cs + eps)
    for a, sm, cols in reversed(tape):
        d = sm + eps
        if cols:
            t = _tree_sum(g * a, -2) / d
        else:
            t = _fma_chain(g, a, -1) / d
        g = (g - t) / d
    return (g - _fma_chain(g, s, -1)) * s


def _pre_split_mixes_bwd_tk(mixes, scale, base, post, g_pre, g_post, g_comb, n, post_mult, num_sms,
                            block: int = 32):
    """``mhc_pre_split_mixes`` backward on flattened tokens: ``(d_mixes (T, n3), d_scale (3,), d_base (n3,))``.

    ``gz_pre = (g s) (1 - s)``, ``gz_post = (g p) (1 - p / mult)``, ``gz_comb = g``; ``d_mixes = gz scale[group]``.
    Program ``p`` of ``num_sms`` takes the 32-token blocks ``p, p + num_sms, ...``: the base partial adds each
    block's 32-lane butterfly in turn; the scale partial is a per-lane (token slot) fma chain over blocks and
    ``j`` in order, then a 32-lane butterfly.  The partials' rows are added by ``torch.sum(0)``."""
    t, nj = mixes.shape
    dev = mixes.device
    grp = torch.clamp(torch.arange(nj, device=dev) // n, max=2)
    sc = scale[grp]
    s = _sigmoid_tk(fma_f32(mixes[:, :n], scale[0].expand(n), base[:n].expand(t, n)))
    mult = torch.full_like(post, float(post_mult))
    gz = torch.cat([(g_pre * s) * (1.0 - s), (g_post * post) * (1.0 - torch.div(post, mult)),
                    g_comb.reshape(t, n * n)], 1)
    d_mixes = gz * sc
    nb = -(-t // block)
    tp = nb * block
    gzp = torch.cat([gz, gz.new_zeros(tp - t, nj)]).view(nb, block, nj)
    mp = torch.cat([mixes, mixes.new_zeros(tp - t, nj)]).view(nb, block, nj)
    pbase = torch.zeros(num_sms, nj, dtype=torch.float32, device=dev)
    pscale = torch.zeros(num_sms, 3, dtype=torch.float32, device=dev)
    for p in range(min(num_sms, nb)):
        blocks = list(range(p, nb, num_sms))
        acc_b = torch.zeros(nj, device=dev)
        acc_s = torch.zeros(block, 3, device=dev)
        for b in blocks:
            acc_b = acc_b + _lane_tree(gzp[b].t())
            for j in range(nj):
                acc_s[:, grp[j]] = fma_f32(gzp[b, :, j], mp[b, :, j], acc_s[:, grp[j]])
        pbase[p] = acc_b
        pscale[p] = _lane_tree(acc_s.t())
    return d_mixes, pscale.sum(0), pbase.sum(0)


def _head_compute_mix_bwd_tk(x, scale, base, grad, num_sms, block: int = 32):
    """``mhc_head_compute_mix`` backward on flattened tokens ``x (T, n)``: ``(d_x, d_scale (1,), d_base (n,))``.

    ``q = (s (1 - s)) g``, ``d_x = q scale``.  Program ``p`` of ``num_sms`` takes the 32-token blocks ``p,
    p + num_sms, ...``; its lanes are (token slot, j): the scale partial is a per-lane fma chain of ``q x`` then a
    butterfly over all lanes (token-major), the base partial per ``j`` a per-lane running sum then a butterfly over
    the token slots.  The partials' rows are added by ``torch.sum(0)``."""
    t, n = x.shape
    dev = x.device
    s = _sigmoid_tk(fma_f32(x, scale.expand(t, n), base.expand(t, n)))
    q = (s * (1.0 - s)) * grad
    d_x = q * scale
    nb = -(-t // block)
    tp = nb * block
    qp = torch.cat([q, q.new_zeros(tp - t, n)]).view(nb, block, n)
    xp = torch.cat([x, x.new_zeros(tp - t, n)]).view(nb, block, n)
    pscale = torch.zeros(num_sms, 1, dtype=torch.float32, device=dev)
    pbase = torch.zeros(num_sms, n, dtype=torch.float32, device=dev)
    for p in range(min(num_sms, nb)):
        acc_s = torch.zeros(block, n, device=dev)
        acc_b = torch.zeros(block, n, device=dev)
        for b in range(p, nb, num_sms):
            acc_s = fma_f32(qp[b], xp[b], acc_s)
            acc_b = acc_b + qp[b]
        pscale[p, 0] = _lane_tree(_pad_pow2(acc_s, 1).reshape(-1))
        pbase[p] = _lane_tree(_pad_pow2(acc_b, 0).t())
    return d_x, pscale.sum(0), pbase.sum(0)


def _norm_fn_norm_tk(p: torch.Tensor, s: torch.Tensor, d: int, eps: float, fused_tail: bool = False):
    """``norm_fn``'s normalisation of the GEMM's ``p (T, n3)`` and ``s (T,)``: ``fma(p, r, 0)`` with
    ``r = rsqrt(s / D + eps)`` (``pre_big_fuse``'s tail: the plain product ``p r``)."""
    r = torch.rsqrt(torch.div(s, torch.full_like(s, float(d))) + eps)[:, None]
    return p * r if fused_tail else fma_f32(p, r, torch.zeros_like(p))


def _norm_fn_bwd_norm_tk(g: torch.Tensor, p: torch.Tensor, s: torch.Tensor, d: int, eps: float):
    """``norm_fn`` backward's normalisation step: ``(g_p = g r, g_s)`` with ``g_s = ((Σ g p) r / (s + c)) / -2``,
    ``Σ`` a 32-lane butterfly of the rounded products and ``c = fp32(eps D)`` (rounded once, from double)."""
    r = torch.rsqrt(torch.div(s, torch.full_like(s, float(d))) + eps)
    gp = g * r[:, None]
    rg = _lane_tree(_pad_pow2(g * p, 1))
    c = torch.tensor(float(eps) * d, dtype=torch.float32).item()
    gs = torch.div(rg * r, s + c) / -2.0
    return gp, gs
