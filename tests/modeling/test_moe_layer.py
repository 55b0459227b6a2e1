"""tritile.modeling.moe.MoE (DeepSeek-V3 MoE layer from tritile's kernels) against PlainMoE, the plain PyTorch
layer with the same weights: forward, and backward for the input and every parameter (gate weight, routed and
shared experts), on 1 process and on 2 and 4 gloo ranks (expert parallelism through tritile.ep), in bf16 and FP8.

Tolerances (calc_diff = 1 - 2<x,y> / (|x|^2 + |y|^2)):

* bf16: both layers round every GEMM output and the activation to bf16 (relative error <= 2^-9 each), at
  different places (ours applies the routing weight before the down projection, the plain layer after it, and
  ours rounds the routed sum to bf16 before adding the shared expert), so the two differ by a few bf16
  roundings: calc_diff ~ 1e-5 (measured on the CPU: <= 1.3e-5 for the output and every gradient).  Bound: 1e-4.
* FP8: e4m3 keeps 3 mantissa bits (relative error <= 2^-4, about 2.6e-2 rms with per-group scales, so one
  quantized operand costs calc_diff ~ 3.5e-4).  The output and the input gradient pass through 2 quantized
  operands (measured 6e-4 to 8.5e-4), the weight gradients through 2 FP8 weight-gradient operands on top
  (measured 1.5e-3 to 2e-3).  Bounds: 3e-3 and 6e-3.  A wrong expert, weight or routing gives calc_diff > 0.1.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tritile.modeling.moe as moe_mod
from tritile.modeling._swiglu_bf16 import _swiglu_bf16, _swiglu_bf16_backward
from tritile.modeling.moe import MoE, PlainMoE, StageTimer, STAGES, grouped_linear
from tritile.testing import calc_diff, pick

CFG = pick(cpu=dict(hidden_size=128, num_experts=16, moe_intermediate_size=64, num_shared_experts=1, num_topk=4,
                    num_groups=4, num_topk_groups=2, routed_scaling_factor=2.5),
           gpu=dict(hidden_size=2048, num_experts=64, moe_intermediate_size=512, num_shared_experts=1, num_topk=6,
                    num_groups=8, num_topk_groups=4, routed_scaling_factor=2.5))
FP8_CFG = pick(cpu=dict(hidden_size=128, num_experts=4, moe_intermediate_size=128, num_shared_experts=1, num_topk=2,
                        num_groups=1, num_topk_groups=1, routed_scaling_factor=2.5),
               gpu=dict(hidden_size=2048, num_experts=64, moe_intermediate_size=512, num_shared_experts=1,
                        num_topk=6, num_groups=8, num_topk_groups=4, routed_scaling_factor=2.5))
TOKENS = pick(cpu=32, gpu=4001)
FP8_TOKENS = pick(cpu=24, gpu=4001)
FP8_ALIGN = pick(cpu=32, gpu=128)
BF16_TOL = 1e-4
FP8_TOL, FP8_WGRAD_TOL = 3e-3, 6e-3


def _run(layer, x, g):
    """Forward + backward; returns (y, x.grad, {param name: grad})."""
    x = x.detach().requires_grad_()  # keeps x's strides
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(g)
    # a parameter that took no part (the plain layer's experts when no token reaches them) has no gradient
    return y.detach(), x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                for n, p in layer.named_parameters()}


def _compare(ours, ref, tol, wtol, local=None):
    y, gx, grads = ours
    ry, rgx, rgrads = ref
    assert y.dtype == torch.bfloat16 and y.shape == ry.shape
    assert calc_diff(y.float(), ry.float()) < tol, calc_diff(y.float(), ry.float())
    assert calc_diff(gx.float(), rgx.float()) < tol, calc_diff(gx.float(), rgx.float())
    assert set(grads) == set(rgrads)
    for name, gr in grads.items():
        want = rgrads[name]
        if local is not None and name in ("w13", "w2"):
            want = want[local]
        assert gr.shape == want.shape, name
        assert torch.isfinite(gr.float()).all(), name
        d = calc_diff(gr.float(), want.float())
        assert d < (wtol if name in ("w13", "w2", "gate_weight") else tol), (name, d)


def _sorted(idx):
    return idx.sort(dim=-1).values


@pytest.mark.parametrize("shape", [(TOKENS,), (2, TOKENS // 2 + 1), "strided"])
def test_moe_bf16_matches_plain(shape, device):
    ours = MoE(**CFG, device=device)
    plain = ours.plain()
    if shape == "strided":  # rows of a wider tensor
        x = torch.randn(TOKENS, 2 * CFG["hidden_size"], device=device).bfloat16()[:, :CFG["hidden_size"]]
    else:
        x = torch.randn(*shape, CFG["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)
    # the routing: same experts (order within a row may differ on ties), same weights
    with torch.no_grad():
        idx, w = ours.route(x.view(-1, CFG["hidden_size"]))
        ridx, rw = plain.route(x.view(-1, CFG["hidden_size"]))
    # exp differs by ulps between the kernel and torch (GPU), which may swap experts at an exact near-tie
    same = (idx == ridx).all(1)
    assert same.float().mean() >= pick(cpu=1.0, gpu=0.999), same.float().mean()
    torch.testing.assert_close(w[same], rw[same], rtol=1e-5, atol=1e-6)
    res = _run(ours, x, g)
    assert res[0].shape == x.shape and res[1].shape == x.shape
    _compare(res, _run(plain, x, g), BF16_TOL, BF16_TOL)


@pytest.mark.parametrize("fp8_scale", ["fp32", "ue8m0"])
def test_moe_fp8_matches_plain(fp8_scale, device):
    ours = MoE(**FP8_CFG, fp8=True, fp8_scale=fp8_scale, alignment=FP8_ALIGN, device=device)
    x = torch.randn(FP8_TOKENS, FP8_CFG["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)
    _compare(_run(ours, x, g), _run(ours.plain(), x, g), FP8_TOL, FP8_WGRAD_TOL)


def _emulated_fp8_grouped_linear(xq, x_sf, wq, w_sf, offs):
    """What torch._scaled_grouped_mm computes with row-wise scales, in float32 on any device."""
    out = torch.empty((xq.shape[0], wq.shape[1]), dtype=torch.bfloat16, device=xq.device)
    s = 0
    for e, end in enumerate(offs.tolist()):
        a = xq[s:end].float() * x_sf.reshape(-1)[s:end, None]
        out[s:end] = (a @ (wq[e].float() * w_sf[e][:, None]).T).bfloat16()
        s = end
    return out


def test_moe_fp8_gemm_path(device, monkeypatch):
    # The FP8-GEMM path (row-wise re-quantization of the dispatched rows, SwiGLU cast with one scale per row,
    # cached FP8 weights), with torch._scaled_grouped_mm emulated where the device has none.
    if not moe_mod.fp8_grouped_mm_available(torch.device(device)):
        monkeypatch.setattr(moe_mod, "_fp8_grouped_linear", _emulated_fp8_grouped_linear)
        monkeypatch.setattr(MoE, "_fp8_gemm", lambda self: True)
    ours = MoE(**FP8_CFG, fp8=True, alignment=FP8_ALIGN, device=device)
    x = torch.randn(FP8_TOKENS, FP8_CFG["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)
    _compare(_run(ours, x, g), _run(ours.plain(), x, g), FP8_TOL, FP8_WGRAD_TOL)
    cached = ours._fp8_weights()
    assert ours._fp8_weights() is cached
    with torch.no_grad():
        ours.w2.mul_(2)  # a weight update re-quantizes
    assert ours._fp8_weights() is not cached
    with torch.no_grad():
        assert calc_diff(ours(x).float(), ours.plain()(x).float()) < FP8_TOL


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_zero_tokens(fp8, device):
    cfg = FP8_CFG if fp8 else CFG
    ours = MoE(**cfg, fp8=fp8, alignment=32, device=device)
    x = torch.zeros(0, cfg["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
    y = ours(x)
    assert y.shape == (0, cfg["hidden_size"]) and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in ours.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_moe_single_token_and_unused_experts(device):
    # one token reaches num_topk experts: every other expert's segment is empty and its gradient is zero
    ours = MoE(**CFG, device=device)
    x = torch.randn(1, CFG["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)
    res = _run(ours, x, g)
    _compare(res, _run(ours.plain(), x, g), BF16_TOL, BF16_TOL)
    used = ours.route(x)[0].flatten().tolist()
    for e in range(CFG["num_experts"]):
        assert bool(res[2]["w13"][e].any()) == (e in used), e


def test_moe_no_shared_and_no_group_limit(device):
    cfg = dict(CFG, num_shared_experts=0, num_groups=1, num_topk_groups=1)
    ours = MoE(**cfg, alignment=1, device=device)
    assert ours.shared_w13 is None
    x = torch.randn(TOKENS, cfg["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)
    _compare(_run(ours, x, g), _run(ours.plain(), x, g), BF16_TOL, BF16_TOL)


def test_grouped_linear_loop_matches_grouped_mm(device, monkeypatch):
    e, k, m = 5, 64, 48
    counts = [16, 0, 32, 16, 0]  # multiples of 16, as the layer's alignment makes them; experts 1 and 4 empty
    x = torch.randn(sum(counts), k, device=device).bfloat16()
    w = torch.randn(e, m, k, device=device).bfloat16()
    ref = torch.cat([x[s:s + c].float() @ w[i].float().T
                     for i, (s, c) in enumerate(zip([0, 16, 16, 48, 64], counts))])
    fast = grouped_linear(x, w, counts)
    monkeypatch.setattr(moe_mod, "grouped_mm_available", lambda dev: False)
    loop = grouped_linear(x, w, counts)
    # both round one float32-accumulated dot product to bf16: at most 1 bf16 ulp apart from the float32 result
    torch.testing.assert_close(fast.float(), ref, rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(loop.float(), ref, rtol=2 ** -8, atol=1e-3)
    dw_loop = moe_mod._grouped_wgrad(fast.T, x.T, counts)
    monkeypatch.undo()
    dw_fast = moe_mod._grouped_wgrad(fast.T, x.T, counts)
    assert not dw_fast[1].any() and not dw_fast[4].any() and not dw_loop[1].any()
    dw_ref = torch.stack([fast[s:s + c].float().T @ x[s:s + c].float()
                          for s, c in zip([0, 16, 16, 48, 64], counts)])
    torch.testing.assert_close(dw_fast.float(), dw_ref, rtol=2 ** -8, atol=1e-2)
    torch.testing.assert_close(dw_loop.float(), dw_ref, rtol=2 ** -8, atol=1e-2)


def test_grouped_wgrad_unaligned_segments(device):
    """Segments that are not a multiple of 8 rows (alignment=1): the grouped kernel would assert on the GPU (its
    reduction dimension needs 16-byte steps), so these take the per-expert loop; the same result either way."""
    counts = [5, 0, 11, 16, 3]
    m, k = 24, 40
    grad = torch.randn(sum(counts), m, device=device).bfloat16()
    x = torch.randn(sum(counts), k, device=device).bfloat16()
    dw = moe_mod._grouped_wgrad(grad.T, x.T, counts)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    dw_ref = torch.stack([grad[s:s + c].float().T @ x[s:s + c].float() for s, c in zip(starts, counts)])
    assert not dw[1].any()
    torch.testing.assert_close(dw.float(), dw_ref, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("rows,inter", [(0, 64), (1, 64), (77, 96), (pick(cpu=130, gpu=40001), 320)])
def test_swiglu_bf16_kernels(rows, inter, device):
    # the bf16 mode's SwiGLU forward / backward kernels against float32 autograd: one bf16 rounding of each output
    h = (torch.randn(rows, 2 * inter, device=device) * 3).bfloat16()
    w = torch.rand(rows, device=device)
    g = torch.randn(rows, inter, device=device).bfloat16()
    act = _swiglu_bf16(h, w)
    dh, act_w, dw = _swiglu_bf16_backward(h, w, g)
    hf, wf = h.float().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.silu(hf[:, :inter]) * hf[:, inter:] * wf[:, None]
    ref.backward(g.float())
    # bf16 keeps 8 significant bits (relative rounding error <= 2^-9); the float32 maths differ in the last bits
    torch.testing.assert_close(act.float(), ref.detach(), rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(dh.float(), hf.grad, rtol=2 ** -8, atol=1e-6)
    # dw sums `inter` float32 products per row in the kernel's order, autograd in its own: both lie within
    # inter * 2^-24 * sum|terms| of the exact sum (float64 here), which cancellation can make large against |dw|
    terms = (torch.nn.functional.silu(h[:, :inter].double()) * h[:, inter:].double() * g.double())
    exact = terms.sum(-1)
    bound = inter * 2.0 ** -24 * terms.abs().sum(-1) + 1e-30
    assert bool(((dw.double() - exact).abs() <= bound).all())
    assert bool(((wf.grad.double() - exact).abs() <= bound).all())
    assert torch.equal(act, act_w)


def test_moe_stage_timer(device):
    ours = MoE(**CFG, device=device)
    timer = StageTimer(device)
    x = torch.randn(TOKENS, CFG["hidden_size"], device=device).bfloat16().requires_grad_()
    ours(x, timer).sum().backward()
    split = timer.summary()
    assert set(split) == {"fwd", "bwd"}
    assert set(split["fwd"]) == set(STAGES)
    assert set(split["bwd"]) == set(STAGES)
    assert all(v >= 0 for ph in split.values() for v in ph.values())
    timer.reset()
    assert timer.summary() == {}


def test_moe_bad_inputs(device):
    with pytest.raises(ValueError, match="num_topk"):
        MoE(**dict(CFG, num_topk=CFG["num_experts"] + 1), device=device)
    with pytest.raises(ValueError, match="num_groups"):
        MoE(**dict(CFG, num_groups=3), device=device)
    with pytest.raises(ValueError, match="hidden_size"):
        MoE(**dict(CFG, hidden_size=0), device=device)
    with pytest.raises(ValueError, match="fp8_scale"):
        MoE(**CFG, fp8=True, fp8_scale="e8m0", device=device)
    with pytest.raises(ValueError, match="128"):
        MoE(**dict(CFG, moe_intermediate_size=96), fp8=True, device=device)
    with pytest.raises(ValueError, match="alignment"):
        MoE(**dict(FP8_CFG), fp8=True, alignment=16, device=device)
    with pytest.raises(ValueError, match="alignment"):
        MoE(**CFG, alignment=0, device=device)
    with pytest.raises(TypeError, match="dtype"):
        MoE(**CFG, dtype=torch.float32, device=device)
    ours = MoE(**CFG, device=device)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        ours(torch.randn(4, CFG["hidden_size"], device=device))
    with pytest.raises(ValueError, match="hidden_size"):
        ours(torch.randn(4, CFG["hidden_size"] + 1, device=device).bfloat16())
    with pytest.raises(TypeError, match="plain"):
        ours.load_plain(ours)
    with pytest.raises(ValueError, match="num_topk"):
        ours.load_plain(PlainMoE(**dict(CFG, num_topk=2), device=device))


def test_moe_load_plain_copies_weights(device):
    plain = PlainMoE(**CFG, device=device)
    ours = MoE(**CFG, device=device).load_plain(plain)
    x = torch.randn(TOKENS, CFG["hidden_size"], device=device).bfloat16()
    with torch.no_grad():
        assert calc_diff(ours(x).float(), plain(x).float()) < BF16_TOL


# ---------------------------------------------------------------------------------------------
# Expert parallelism: 2 and 4 gloo ranks
# ---------------------------------------------------------------------------------------------
def _ep_available() -> bool:
    try:
        from tritile.ep import Buffer  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_case(rank, world, mode):
    fp8 = mode != "bf16"
    cfg = FP8_CFG if fp8 else CFG
    cfg = dict(cfg, num_experts=max(cfg["num_experts"], 2 * world))
    torch.manual_seed(1234)  # the same full weights on every rank
    plain = PlainMoE(**cfg)
    ours = MoE(**cfg, group=dist.group.WORLD, fp8=fp8, fp8_scale=mode if fp8 else "fp32",
               alignment=32 if fp8 else 8).load_plain(plain)
    torch.manual_seed(100 + rank)
    # uneven; in bf16 the last rank holds 0 (4 ranks) or 3 tokens (FP8 keeps >= 16 a rank: the gate gradient
    # of a few tokens is dominated by FP8 noise)
    t = 16 + 4 * rank if fp8 else (12 + 5 * rank) if rank != world - 1 else (0 if world > 2 else 3)
    x = torch.randn(t, cfg["hidden_size"]).bfloat16()
    g = torch.randn_like(x)
    res = _run(ours, x, g)
    ref = _run(plain, x, g)
    for name in ("w13", "w2"):  # each rank's experts see every rank's tokens
        dist.all_reduce(ref[2][name])
    lo = rank * ours.num_local_experts
    local = slice(lo, lo + ours.num_local_experts)
    if fp8:
        _compare(res, ref, FP8_TOL, FP8_WGRAD_TOL, local=local)
    else:
        _compare(res, ref, BF16_TOL, BF16_TOL, local=local)


def _ep_worker(rank, world, port, modes, result_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for mode in modes:
            _ep_case(rank, world, mode)
            open(os.path.join(result_dir, f"{mode}{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not _ep_available(), reason="needs tritile.ep.Buffer and torch.distributed with gloo")
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU; the GPU run covers 1 rank")
@pytest.mark.parametrize("world,modes", [(2, ("bf16", "fp32", "ue8m0")), (4, ("bf16",))])
def test_moe_expert_parallel_gloo(world, modes, tmp_path):
    # one set of processes per world size (their start-up is most of the cost): bf16, then on 2 ranks the FP8
    # dispatch with float32 scales and with packed UE8M0 scales
    mp.spawn(_ep_worker, args=(world, _free_port(), modes, str(tmp_path)), nprocs=world, join=True)
    assert sorted(os.listdir(tmp_path)) == sorted(f"{m}{r}" for m in modes for r in range(world))


def test_moe_torch_compile(device):
    # The gate and the routed experts run eagerly inside the compiled module (their segment sizes come from a
    # host sync); the shared experts and the sums compile.  Same bits as the eager module, forward and backward.
    ours = MoE(**CFG, device=device)
    x = torch.randn(TOKENS, CFG["hidden_size"], device=device).bfloat16()
    g = torch.randn_like(x)
    eager = _run(ours, x, g)
    compiled = _run(torch.compile(ours, backend="eager" if device.type == "cpu" else "inductor"), x, g)
    if device.type == "cpu":  # every piece runs eagerly on both sides: the same bits
        same = torch.equal
    else:  # inductor fuses the shared expert's element-wise chain differently
        def same(a, b):
            return calc_diff(a.float(), b.float()) < 1e-6
    assert same(compiled[0], eager[0]) and same(compiled[1], eager[1])
    for name, gr in eager[2].items():
        assert same(compiled[2]["_orig_mod." + name], gr), name
