"""``mhc_pre_norm_fn`` (forward, backward, fused residual-gradient buffer, norm-weight merge) and ``round_to_tf32``.

TF32: the op always uses ``round_to_tf32(fn)`` as the GEMM operand (as TileKernels does), and on CUDA also rounds
``g_p`` before the backward GEMMs, where the reference runs with ``allow_tf32``.  On the CPU the reference is plain
float32 (no TF32 there) and the kernel's ``g_p`` stays float32; TileKernels' tolerances hold on both (the TF32
rounding of ``fn`` moves the outputs by ~2^-11 relative, far inside ``1e-3``).  ``test_backward_exact`` checks the
backward formulas tightly against a float64 evaluation that applies the same TF32 policy as the kernel.
"""

import pytest
import torch
import triton
import triton.language as tl

from tritile.mhc import norm_fn_kernel, round_to_tf32
from tritile.modeling.mhc.ops import mhc_pre_norm_fn
from tritile.runtime import override_config
from tritile.testing import pick
from tritile.torch.mhc import mhc_pre_norm_fn_ref

N = 4
N3 = N * (N + 2)
EPS = 1e-6


def _data(n1, H, normw, device, n0=1):
    stream = 1 + torch.arange(N, device=device).mul(0.01)
    residual = (torch.randn(n0, n1, N, H, device=device) * stream.view(1, 1, -1, 1)).bfloat16()
    fn = (torch.randn(N3, N, H, device=device) * 1e-4 * stream.view(1, -1, 1)).flatten(1, 2)
    w = torch.randn(N * H, device=device) * 0.1 + 1.0 if normw else None
    g = torch.randn(n0, n1, N3, device=device)
    return residual, fn, w, g


def _leaf(t):
    return None if t is None else t.clone().requires_grad_()


def _ref(residual, fn, w, g, device):
    r, f, nw = _leaf(residual), _leaf(fn), _leaf(w)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = device.type == "cuda"  # TileKernels' reference runs on TF32
    try:
        out = mhc_pre_norm_fn_ref(r, f, nw, EPS)
        out.backward(g)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out, r.grad, f.grad, None if nw is None else nw.grad


@pytest.mark.parametrize("n1,H,normw", pick(
    cpu=[(13, 64, False), (48, 72, True), (1, 160, True)],
    gpu=[(n1, H, w) for n1 in (4096, 8192) for H in (1280, 2560, 7168) for w in (False, True)]))
def test_correctness(device, n1, H, normw):
    residual, fn, w, g = _data(n1, H, normw, device)
    r, f, nw = _leaf(residual), _leaf(fn), _leaf(w)
    out = mhc_pre_norm_fn(r, f, nw, EPS)
    assert out.shape == (1, n1, N3) and out.dtype == torch.float32
    # the fused protocol: mhc_post's backward would have set this buffer; norm_fn adds into it in place
    buf = torch.zeros_like(r)
    r.untyped_storage().grad_from_mhc_post = buf
    out.backward(g)
    assert r.grad is None
    assert not hasattr(r.untyped_storage(), "grad_from_mhc_post")
    out_ref, r_grad, f_grad, w_grad = _ref(residual, fn, w, g, device)
    torch.testing.assert_close(out, out_ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(buf, r_grad)
    torch.testing.assert_close(f.grad, f_grad, atol=3e-2, rtol=1e-3)
    if normw:
        # g_w = sum_rows(g_fn' * fn): |fn| ~ 1e-4 scales g_fn's tolerance (3e-2) down to ~3e-6 per row
        torch.testing.assert_close(nw.grad, w_grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("n1,H", pick(cpu=[(13, 64), (48, 80), (512, 32)],
                                      gpu=[(n1, H) for n1 in (13, 48, 512) for H in (1280, 2560, 4096, 7168)]))
def test_split_k_correctness(device, n1, H, splits):
    """Tail token tiles and the split over D (the rule's choice, and a forced 3-way split with a partial last one)."""
    residual, fn, _, _ = _data(n1, H, False, device)
    with override_config("mhc_norm_fn_gemm", **({} if splits is None else dict(SPLITS=splits, BLOCK_D=32))):
        out = mhc_pre_norm_fn(residual, fn, None, EPS, n_splits=16)
    out_ref, *_ = _ref(residual, fn, None, torch.zeros(1, n1, N3, device=device), device)
    torch.testing.assert_close(out, out_ref, atol=1e-3, rtol=1e-3)


def _tf32_exact(x):
    return ((x.view(torch.int32) + 0x1000) & -8192).view(torch.float32)


@pytest.mark.parametrize("split_bf16", [False, True])
@pytest.mark.parametrize("n1,H", pick(cpu=[(37, 64)], gpu=[(4001, 2560), (8192, 7168)]))
def test_forward_exact(device, n1, H, split_bf16):
    """The forward GEMM's operands, both ways (``x`` widened to float32 on TF32 MMAs, or ``tf32(fn)`` as exact bf16
    hi/lo pairs on bf16 MMAs): ``p`` within float32 accumulation error of the float64 ``x . tf32(fn)^T``
    (``2^-17 sum |x f|``; an operand off by bf16's or TF32's rounding moves ``p`` past it) and ``s = sum x^2``
    within ``2^-17 s``."""
    from tritile.mhc.norm_fn_kernel import norm_fn_fwd

    if split_bf16 and device.type != "cuda":
        pytest.skip("Triton's interpreter computes tl.dot on bfloat16 operands wrongly (off by ~1e10 on unit values)")
    residual, fn, _, _ = _data(n1, H, False, device)
    fn[:, :N] *= 1e3  # a few large columns: a lost low part of fn would show against the bound
    D = N * H
    x = residual.view(-1, D)
    with override_config("mhc_norm_fn_gemm", SPLIT_BF16=split_bf16):
        _, p, s = norm_fn_fwd(x, fn, EPS)
    xd, fd = x.double(), _tf32_exact(fn).double()
    p_ref = xd @ fd.t()
    mag = xd.abs() @ fd.abs().t()
    assert bool(((p.double() - p_ref).abs() <= mag * 2.0 ** -17).all())
    s_ref = (xd * xd).sum(1)
    assert bool(((s.double() - s_ref).abs() <= s_ref * 2.0 ** -17).all())
    # not vacuous: fn unrounded, or only its bf16 high part, misses the bound somewhere
    for wrong in (fn.double(), fn.bfloat16().double()):
        assert not bool((((xd @ wrong.t()) - p_ref).abs() <= mag * 2.0 ** -17).all())


@pytest.mark.parametrize("n1,H,acc", pick(cpu=[(37, 96, True), (5, 64, False)], gpu=[(4001, 2560, True),
                                                                                     (33, 7168, False)]))
def test_backward_exact(device, n1, H, acc):
    """The backward kernels against the spec's formulas in float64 on the forward's own saved ``p``, ``s``:
    ``g_p = g r`` (TF32-rounded on CUDA), ``g_s = -(g . p) r / (2 (s + eps D))``, ``g_fn = g_p^T x``,
    ``g_x = bf16(acc + g_p . tf32(fn) + 2 x g_s)`` (within one bf16 rounding of the float64 value)."""
    from tritile.mhc.norm_fn_kernel import norm_fn_bwd, norm_fn_fwd

    residual, fn, _, g = _data(n1, H, False, device)
    D = N * H
    x = residual.view(-1, D)
    g = g.view(-1, N3)
    _, p, s = norm_fn_fwd(x, fn, EPS)
    start = torch.randn(n1, D, device=device).bfloat16() if acc else None
    xg = start.clone() if acc else torch.empty_like(x)
    tf32 = device.type == "cuda"
    g_fn = norm_fn_bwd(g, x, fn, p, s, EPS, xg, acc, tf32)
    sd, pd, gd = s.double(), p.double(), g.double()
    r32 = torch.rsqrt(torch.div(s, torch.full_like(s, D)) + EPS)  # float32, as the kernel (IEEE division)
    r = r32.double()
    gp = g * r32[:, None]
    gp = (_tf32_exact(gp) if tf32 else gp).double()
    gs = -(gd * pd).sum(1) * r / (sd + EPS * D) / 2
    fd = _tf32_exact(fn).double()
    gx = gp @ fd + 2 * x.double() * gs[:, None]
    gs_abs = (gd * pd).abs().sum(1) * r / (sd + EPS * D) / 2  # bounds g_s's float32 rounding error as well
    gx_abs = gp.abs() @ fd.abs() + 2 * x.double().abs() * gs_abs[:, None]
    if acc:
        gx = gx + start.double()
        gx_abs = gx_abs + start.double().abs()
    # float32 sums: error within (terms) * 2^-24 * sum|terms|; then one bf16 rounding (half an ulp: 2^-8 relative)
    gfn_ref = gp.t() @ x.double()
    # On CUDA, rsqrt is approximate (MUFU) in torch and in Triton alike but not guaranteed to give the same bits: a
    # g_p next to a TF32 rounding boundary may round the other way (one TF32 ulp, 2^-10 relative).
    slack = 2 ** -10 if tf32 else 0.0
    gfn_bound = (n1 * 2 ** -24 + slack) * (gp.abs().t() @ x.double().abs()) + 1e-30
    assert ((g_fn.double() - gfn_ref).abs() <= gfn_bound).all()
    gx_abs = gx_abs + slack * (gp.abs() @ fd.abs())
    gx_bound = 2 ** -8 * (gx.abs() + (N3 + 2) * 2 ** -23 * gx_abs) * 1.01 + (N3 + 2) * 2 ** -24 * gx_abs + 1e-30
    assert ((xg.double() - gx).abs() <= gx_bound).all()


def test_fuse_off_and_missing_buffer(device):
    """``fuse_grad_acc=False`` returns the residual gradient; with fusion on but no buffer set (a residual no
    ``mhc_post`` consumed, as in ``mhc_head``) it is returned as well (TileKernels raises AttributeError)."""
    residual, fn, w, g = _data(9, 64, True, device)
    grads = []
    for fuse in (False, True):
        r, f, nw = _leaf(residual), _leaf(fn), _leaf(w)
        mhc_pre_norm_fn(r, f, nw, EPS, fuse_grad_acc=fuse).backward(g)
        grads.append((r.grad, f.grad, nw.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, r_grad, f_grad, w_grad = _ref(residual, fn, w, g, device)
    torch.testing.assert_close(grads[0][0], r_grad)
    torch.testing.assert_close(grads[0][1], f_grad, atol=3e-2, rtol=1e-3)
    torch.testing.assert_close(grads[0][2], w_grad, atol=1e-4, rtol=1e-3)


def test_main_grad(device):
    """Megatron-style ``main_grad`` on ``fn`` and ``norm_weight``: accumulated in place, ``None`` returned."""
    residual, fn, w, g = _data(7, 64, True, device)
    r, f, nw = _leaf(residual), _leaf(fn), _leaf(w)
    mhc_pre_norm_fn(r, f, nw, EPS, fuse_grad_acc=False).backward(g)
    r2, f2, nw2 = _leaf(residual), _leaf(fn), _leaf(w)
    f2.main_grad = torch.randn_like(fn)
    nw2.main_grad = torch.randn_like(w)
    f_start, w_start = f2.main_grad.clone(), nw2.main_grad.clone()
    mhc_pre_norm_fn(r2, f2, nw2, EPS, fuse_grad_acc=False).backward(g)
    assert f2.grad is None and nw2.grad is None
    torch.testing.assert_close(f2.main_grad, f_start + f.grad, rtol=0, atol=0)
    torch.testing.assert_close(nw2.main_grad, w_start + nw.grad, rtol=0, atol=0)
    torch.testing.assert_close(r2.grad, r.grad, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_zero_tokens(device, shape):
    residual = torch.empty(*shape, N, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    fn = (torch.randn(N3, N * 64, device=device) * 1e-4).requires_grad_()
    out = mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False)
    assert out.shape == (*shape, N3)
    out.sum().backward()
    assert residual.grad.shape == residual.shape
    assert torch.equal(fn.grad, torch.zeros_like(fn))


def test_bad_inputs(device):
    H = 32
    r = torch.randn(1, 3, N, H, device=device).bfloat16()
    fn = torch.randn(N3, N * H, device=device)
    with pytest.raises(TypeError, match="residual"):
        mhc_pre_norm_fn(r.float(), fn, None, EPS)
    for eps in (0.0, -1e-6, float("inf")):
        with pytest.raises(ValueError, match="mhc_norm_eps must be positive"):
            mhc_pre_norm_fn(r, fn, None, eps)
    with pytest.raises(TypeError, match="mhc_fn"):
        mhc_pre_norm_fn(r, fn.bfloat16(), None, EPS)
    with pytest.raises(ValueError, match="residual"):
        mhc_pre_norm_fn(r.view(-1), fn, None, EPS)
    with pytest.raises(ValueError, match="mhc_fn"):
        mhc_pre_norm_fn(r, fn.view(-1), None, EPS)
    with pytest.raises(ValueError, match="mhc_fn"):  # width is not mhc_mult * hidden_size
        mhc_pre_norm_fn(r, fn[:, :-4].contiguous(), None, EPS)
    with pytest.raises(ValueError, match="24 rows"):  # mhc_mult = 2: n3 = 8 is not supported
        mhc_pre_norm_fn(r.view(1, 3, 2, 2 * H), torch.randn(8, N * H, device=device), None, EPS)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        mhc_pre_norm_fn(torch.randn(1, 3, H, N, device=device).bfloat16().transpose(-1, -2), fn, None, EPS)
    with pytest.raises(ValueError, match="mhc_norm_weight"):
        mhc_pre_norm_fn(r, fn, torch.ones(N * H + 1, device=device), EPS)
    with pytest.raises(TypeError, match="mhc_norm_weight"):
        mhc_pre_norm_fn(r, fn, torch.ones(N * H, device=device).bfloat16(), EPS)
    with pytest.raises(TypeError, match="x"):
        round_to_tf32(torch.ones(3, device=device).bfloat16())
    # a residual-gradient buffer that cannot be accumulated into
    leaf = r.clone().requires_grad_()
    out = mhc_pre_norm_fn(leaf, fn * 1e-4, None, EPS)
    leaf.untyped_storage().grad_from_mhc_post = torch.zeros(leaf.shape, device=device)
    with pytest.raises(ValueError, match="grad_from_mhc_post"):
        out.sum().backward()


def test_round_to_tf32(device):
    x = torch.tensor([1 + 2 ** -11, -(1 + 2 ** -11), 1.0007324, 0.0, 3.0], device=device)
    y = round_to_tf32(x)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32) + 0x1000)  # low bits are not cleared
    assert y[2].item() == pytest.approx(1.0012207, abs=1e-7)
    masked = (y.view(torch.int32) & -8192).view(torch.float32)
    assert masked[0].item() == 1 + 2 ** -10 and masked[1].item() == -(1 + 2 ** -10)
    assert masked[2].item() == pytest.approx(1.0009766, abs=1e-7)


@triton.jit
def _split_probe_kernel(fn_ptr, w_ptr, D, N3: tl.constexpr, N3P: tl.constexpr, BLOCK_D: tl.constexpr):
    """``w[0] + w[1] = tf32(fn)^T`` through the backward's ``_split_tf32`` (zero-padded to ``N3P`` columns)."""
    cols = tl.arange(0, BLOCK_D)
    j = tl.arange(0, N3P)
    f = tl.load(fn_ptr + j[None, :] * D + cols[:, None], mask=(j < N3)[None, :], other=0.0)
    hi, lo = norm_fn_kernel._split_tf32(norm_fn_kernel._tf32(f))
    offs = cols[:, None] * N3P + j[None, :]
    tl.store(w_ptr + offs, hi)
    tl.store(w_ptr + D * N3P + offs, lo)


def test_tf32_bf16_split(device):
    """The backward's MMA operands: ``tf32(v) = hi + lo`` exactly with bf16 ``hi``, ``lo`` (``hi`` = the top 16 bits),
    for every finite value down to bf16's normal range; infinities and NaNs stay in ``hi`` with ``lo = 0``; zero
    padding stays zero."""
    D = 128
    vals = torch.tensor([0.0, -0.0, 1.0, 1 + 2 ** -10, -(1 + 2 ** -11), 1 - 2 ** -24, 3.0e38, -3.3e38, 2.0 ** -110,
                         -(2.0 ** -100) * 1.37, 1e-4, 12345.678, float("inf"), -float("inf"), float("nan")],
                        device=device)
    fn = torch.randn(N3, D, device=device) * torch.logspace(-30, 30, D, device=device)
    fn.view(-1)[:vals.numel()] = vals
    w = torch.empty((2, D, 32), dtype=torch.bfloat16, device=device)
    _split_probe_kernel[(1,)](fn, w, D, N3=N3, N3P=32, BLOCK_D=D)
    v = (round_to_tf32(fn).view(torch.int32) & -8192).view(torch.float32)
    hi, lo = w[0, :, :N3].t().float(), w[1, :, :N3].t().float()
    assert torch.equal(w[:, :, N3:].float(), torch.zeros_like(w[:, :, N3:].float()))
    assert torch.equal(hi.view(torch.int32) & 0xFFFF, torch.zeros_like(hi.view(torch.int32)))
    finite = torch.isfinite(v)
    assert torch.equal((hi + lo)[finite], v[finite])
    assert torch.equal(hi[~finite].isnan(), v[~finite].isnan())
    assert torch.equal(hi[v.isinf()], v[v.isinf()]) and bool((lo[~finite] == 0).all())


def test_torch_compile(device):
    residual, fn, w, g = _data(9, 64, True, device)
    r, f, nw = _leaf(residual), _leaf(fn), _leaf(w)
    out = mhc_pre_norm_fn(r, f, nw, EPS, fuse_grad_acc=False)
    out.backward(g)
    compiled = torch.compile(lambda a, b, c: mhc_pre_norm_fn(a, b, c, EPS, fuse_grad_acc=False), fullgraph=True,
                             backend="eager" if device.type == "cpu" else "inductor")
    r2, f2, nw2 = _leaf(residual), _leaf(fn), _leaf(w)
    out2 = compiled(r2, f2, nw2)
    out2.backward(g)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    for a, b in ((r2.grad, r.grad), (f2.grad, f.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the merge node's sum over fn's rows is plain torch: inductor (GPU) may add in another order
    torch.testing.assert_close(nw2.grad, nw.grad, **({} if device.type == "cuda" else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("T,H", [(37, 96), (5, 1280)])
def test_normalisation_steps_exact(device, T, H):
    """The normalisation steps around the GEMMs in TileKernels' order, bit for bit: forward
    ``fma(p, rsqrt(s / D + eps), 0)``; backward ``g_p = g r`` and ``g_s = ((sum g p) r / (s + fp32(eps D))) / -2``
    with the sum a 32-lane butterfly of the rounded products."""
    from tritile.mhc.norm_fn_kernel import bwd_normalise, normalise
    from tritile.torch.mhc import _norm_fn_bwd_norm_tk, _norm_fn_norm_tk

    D = N * H
    p = torch.randn(1, T, N3, device=device) * 30
    s = torch.rand(1, T, device=device) * D * 2
    mixes, p_sum, s_sum = normalise(p, s, D, EPS)
    assert torch.equal(p_sum, p[0]) and torch.equal(s_sum, s[0])
    assert torch.equal(mixes, _norm_fn_norm_tk(p[0], s[0], D, EPS))
    g = torch.randn(T, N3, device=device)
    gp, gs = bwd_normalise(g, p[0], s[0], D, EPS, False)
    gp_e, gs_e = _norm_fn_bwd_norm_tk(g, p[0], s[0], D, EPS)
    assert torch.equal(gp[:, :N3], gp_e) and torch.equal(gs, gs_e)
    assert torch.equal(gp[:, N3:], torch.zeros_like(gp[:, N3:]))


def test_gemm_plan_rule(monkeypatch):
    """The GPU's GEMM plan (host logic only): about 512 programs at many tokens, and each split at least 512 columns
    wide, so a few-token (decode) call still gets D / 512 programs whatever the tile width."""
    monkeypatch.setattr(norm_fn_kernel, "_INTERPRET", False)
    for tokens, hidden, splits, programs in ((8192, 7168, 8, 512), (4096, 7168, 16, 512), (8192, 2560, 8, 512),
                                             (16, 7168, 56, 56), (1, 2560, 20, 20)):
        cfg = norm_fn_kernel.gemm_config(tokens, N * hidden)
        assert cfg["SPLITS"] == splits and -(-tokens // cfg["BLOCK_T"]) * cfg["SPLITS"] == programs
        assert cfg["ITERS"] * cfg["BLOCK_D"] >= 512 or cfg["SPLITS"] == 1
        assert (cfg["SPLITS"] - 1) * cfg["ITERS"] * cfg["BLOCK_D"] < N * hidden  # no empty split
    with override_config("mhc_norm_fn_gemm", BLOCK_D=64):
        assert norm_fn_kernel.gemm_config(16, N * 7168)["SPLITS"] == 56  # the width rule, not a tile count
