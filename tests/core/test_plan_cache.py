"""The plan cache (tritile.runtime.plan): a replayed call gives the bits of an unplanned one, whatever changes
between calls of the same shape (strides, storage offset, alignment, dtype, flags, group width, top-k, token count,
stream, CUDA graphs), and a bad call after a good one of the same shape still raises."""

import pytest
import torch

import tritile.engram as engram
import tritile.moe as moe
import tritile.quant as quant
from tritile.runtime import plan as P
from tritile.testing import assert_equal, pick


def _bits(t):
    if isinstance(t, (tuple, list)):
        return [_bits(e) for e in t]
    if t is None or not isinstance(t, torch.Tensor):
        return t
    return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone(), t.shape, t.stride()


def _same(a, b):
    if isinstance(a, list):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
        return
    if isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor):
        assert a[1] == b[1] and a[2] == b[2], (a[1:], b[1:])
        assert_equal(a[0], b[0])
        return
    assert a == b


def _unplanned(fn, *args, **kwargs):
    old = P.set_plan_cache(False)
    try:
        return _bits(fn(*args, **kwargs))
    finally:
        P.set_plan_cache(old)


def _replayed(fn, *args, **kwargs):
    """The second of two calls: the first records the plan, the second replays it."""
    fn(*args, **kwargs)
    return _bits(fn(*args, **kwargs))


@pytest.fixture(autouse=True)
def _fresh_plans():
    P.clear_plans()
    yield
    P.clear_plans()


def _check(fn, *args, **kwargs):
    _same(_replayed(fn, *args, **kwargs), _unplanned(fn, *args, **kwargs))


def test_per_token_cast_interleaved_metadata(device):
    m, k = pick(cpu=(33, 256), gpu=(4001, 7168))
    base = torch.randn(m + 1, k + 64, device=device)
    variants = [
        base[:m, :k].bfloat16().contiguous(),                  # dense bf16
        base[:m, :k],                                          # strided rows, float32
        base[1:, :k].bfloat16(),                               # another copy, dense
        base.bfloat16()[1:, 8:8 + k],                          # offset by 16 bytes: still aligned
        base.bfloat16()[1:, 1:1 + k],                          # offset by 2 bytes: misaligned
        base[:0, :k],                                          # zero tokens
    ]
    for x in variants + variants[::-1]:
        for npc in (32, 128):
            for flags in ((False, False, False), (True, True, True), (True, False, False)):
                _check(quant.per_token_cast, x, "e4m3", npc, None, *flags)
        _check(quant.per_token_cast, x, "e2m1", 32)
    stats = P.plan_stats()["per_token_cast"]
    assert stats[0] > 0 and stats[1] == 0, stats


def test_plan_replays_and_bad_call_still_raises(device):
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
    quant.per_token_cast(x, "e4m3", 128)
    quant.per_token_cast(x, "e4m3", 128)
    assert P.plan_stats()["per_token_cast"] == (1, 0)
    # same shapes, other flags or values: never the cached plan's errors (or their absence)
    with pytest.raises(ValueError, match="num_per_channels"):
        quant.per_token_cast(x, "e4m3", 100)
    with pytest.raises(TypeError, match="num_per_channels"):
        quant.per_token_cast(x, "e4m3", 128.0)
    with pytest.raises(ValueError, match="fmt"):
        quant.per_token_cast(x, "e5m2", 128)
    with pytest.raises(TypeError):
        quant.per_token_cast(x.half(), "e4m3", 128)
    quant.per_token_cast(x, "e4m3", 128)
    assert P.plan_stats()["per_token_cast"] == (1, 0)


def test_bool_is_not_int_in_keys(device):
    scores = torch.randn(5, 16, device=device)
    moe.topk_gate(scores, 1)
    with pytest.raises(TypeError, match="num_topk"):
        moe.topk_gate(scores, True)


def test_topk_gate_topk_and_tokens(device):
    e = pick(cpu=16, gpu=256)
    for t in (7, 0, 7, 1, 0):
        scores = torch.randn(t, e, device=device)
        for k in (1, 6, 8, 6):
            _check(moe.topk_gate, scores, k)


def test_in_place_outputs_are_checked_on_replay(device):
    p, hc, h = 4, 4, 64
    part = torch.randn(p, hc, h, device=device)
    w = torch.randn(hc, h, dtype=torch.bfloat16, device=device)
    g1, g2 = torch.zeros(hc, h, device=device), torch.zeros(hc, h, device=device)
    engram.grad_w_reduce(part, w, w, g1, g2)
    engram.grad_w_reduce(part, w, w, g1, g2)  # replayed: accumulates again
    want = 2 * (part.sum(0) * w.float())
    torch.testing.assert_close(g1, want)
    with pytest.raises(ValueError, match="different tensors"):
        engram.grad_w_reduce(part, w, w, g1, g1)
    big = torch.zeros(2 * p, hc, h, device=device)
    with pytest.raises(ValueError, match="overlap"):
        engram.grad_w_reduce(big[:p], w, w, g1, big[1])  # an in-place output inside an input's span (a replay)


def test_recorded_overlap_checks_on_replay(device):
    """A check_no_overlap recorded with a plan runs on every replay: the address ranges first, the exact check where
    they meet (the logits in the gap between two rows of the ids pass, the logits over the ids raise)."""
    t, e, k, row = 8, 16, 2, 100  # row: int64 words between two rows of unmapped_topk_idx
    bias = torch.randn(e, device=device)
    args = (k, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "softmax")
    logits = torch.randn(t, e, device=device)

    def gate(x, unm):
        return moe.top2_sum_gate(x, bias, *args, unmapped_topk_idx=unm)

    def ids(buf):
        return buf.view(t, row)[:, :k]

    def logits_at(buf, word):  # t * e float32 at int64 word ``word`` of ``buf``
        x = buf[word:word + t * e // 2].view(torch.float32).view(t, e)
        x.copy_(logits)
        return x

    want = gate(logits, ids(torch.zeros(t * row, dtype=torch.int64, device=device)))  # recorded: two buffers
    buf = torch.zeros(t * row, dtype=torch.int64, device=device)
    got = gate(logits_at(buf, k), ids(buf))  # replayed: one buffer, the logits between the ids' first two rows
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    buf = torch.zeros(t * row, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="unmapped_topk_idx must not overlap the input logits"):
        gate(logits_at(buf, 0), ids(buf))  # the same metadata, the logits over the ids' first row


def test_dtype_changes_same_shape(device):
    import tritile.transpose as tr

    for dt in (torch.bfloat16, torch.float32, torch.int8, torch.bfloat16):
        x = torch.randn(17, 40, device=device).to(dt)
        _check(tr.transpose, x)
        _check(tr.transpose, x[:, 8:])


def test_cache_off_is_the_same_route(device):
    x = torch.randn(9, 128, device=device, dtype=torch.bfloat16)
    old = P.set_plan_cache(False)
    try:
        quant.per_token_cast(x, "e4m3", 32)
        assert "per_token_cast" not in P.plan_stats()
    finally:
        P.set_plan_cache(old)


def test_unplannable_calls_run_unplanned(device):
    # get_fused_mapping without num_expanded_tokens reads a count back (a host sync): never replayed
    topk = torch.randint(0, 8, (6, 2), device=device)
    for _ in range(2):
        a = moe.get_fused_mapping(topk, 8, 0, 1)
    b = _unplanned(moe.get_fused_mapping, topk, 8, 0, 1)
    _same(_bits(a), b)
    plans, unplannable = P.plan_stats()["get_fused_mapping"]
    assert plans == 0 and unplannable == 1


def test_no_cuda_runs_the_host_code(device, monkeypatch):
    """Where this build or process has no CUDA (the current device cannot be read: e.g. tritile.ep's CPU path on
    a CPU-only torch), a planned op runs its host code and records nothing."""
    def no_cuda():
        raise AssertionError("Torch not compiled with CUDA enabled")

    x = torch.randn(9, 128, device=device, dtype=torch.bfloat16)
    want = quant.per_token_cast(x, "e4m3", 32)
    P.clear_plans()
    monkeypatch.setattr(P, "_current_device", no_cuda)
    got = quant.per_token_cast(x, "e4m3", 32)
    _same(_bits(got), _bits(want))
    assert "per_token_cast" not in P.plan_stats()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and CUDA graphs")
def test_streams_and_cuda_graphs():
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16)
    want = _unplanned(quant.per_token_cast, x, "e4m3", 128, None, True, True, True)
    quant.per_token_cast(x, "e4m3", 128, None, True, True, True)  # recorded
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _bits(quant.per_token_cast(x, "e4m3", 128, None, True, True, True))  # replayed on another stream
    torch.cuda.current_stream().wait_stream(s)
    _same(got, want)
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        quant.per_token_cast(x, "e4m3", 128, None, True, True, True)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = quant.per_token_cast(x, "e4m3", 128, None, True, True, True)  # a replay captured
    x2 = torch.randn_like(x)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    _same(_bits(out), _unplanned(quant.per_token_cast, x2, "e4m3", 128, None, True, True, True))
    # a counting op whose workspace is replaced by fresh zeros under capture
    idx = torch.randint(-1, 64, (4096, 8), device="cuda")
    moe.group_count(idx, 64)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        c = moe.group_count(idx, 64)
    for _ in range(3):
        g2.replay()
        eager = moe.group_count(idx, 64)
    torch.cuda.synchronize()
    assert_equal(c, eager)


def _mhc_chain(device, tokens, hidden, norm_weight, seed=0):
    """expand -> mhc_pre (norm_fn, split, Sinkhorn, apply-mix) -> mhc_post -> mhc_head, forward and backward, and
    mhc_pre_big_fuse: every output and gradient."""
    from tritile.modeling.mhc import expand_from_embedding, mhc_head, mhc_pre
    from tritile.modeling.mhc.ops import mhc_post, mhc_pre_big_fuse

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device)

    emb = rnd(1, tokens, hidden).bfloat16().requires_grad_()
    fn = rnd(24, 4 * hidden, s=0.01).requires_grad_()
    scale = (1 + rnd(3, s=0.1)).requires_grad_()
    base = rnd(24, s=0.1).requires_grad_()
    w = (rnd(4 * hidden).abs() + 0.5) if norm_weight else None
    r = expand_from_embedding(emb, mhc_mult=4)
    u, (post, comb) = mhc_pre(r, fn, scale, base, norm_weight=w)
    r2 = mhc_post(u * 2, r, post, comb)
    fh = rnd(4, 4 * hidden, s=0.01).requires_grad_()
    sh = (1 + rnd(1, s=0.1)).requires_grad_()
    bh = rnd(4, s=0.1).requires_grad_()
    h = mhc_head(r2, fh, sh, bh)
    h.float().square().sum().backward()
    with torch.no_grad():
        fused = mhc_pre_big_fuse(r.detach(), fn.detach(), scale.detach(), base.detach(), 1e-6, 1e-6, 1e-6, 2.0, 20)
    return [h, u, post, comb, emb.grad, fn.grad, scale.grad, base.grad, fh.grad, sh.grad, bh.grad, *fused]


def test_mhc_chain_replayed_bit_for_bit(device):
    """Every mHC launcher is planned: the chain's forward and backward replayed (token counts interleaved, zero
    included) give the bits of the unplanned run, and every plan is a real one (none unplannable)."""
    hidden = pick(cpu=128, gpu=1280)
    for tokens in pick(cpu=(40, 0, 7, 40), gpu=(4096, 0, 333, 4096)):
        for nw in (False, True):
            _same(_replayed(_mhc_chain, device, tokens, hidden, nw),
                  _unplanned(_mhc_chain, device, tokens, hidden, nw))
    stats = P.plan_stats()
    for name in ("mhc_pre_norm_fn_fwd", "mhc_pre_norm_fn_bwd", "mhc_pre_split_mixes_fwd", "mhc_pre_split_mixes_bwd",
                 "mhc_sinkhorn_fwd", "mhc_sinkhorn_bwd", "mhc_pre_apply_mix_fwd", "mhc_post_fwd",
                 "mhc_post_bwd_launch", "mhc_head_compute_mix_fwd", "mhc_head_compute_mix_bwd", "mhc_expand_alloc",
                 "mhc_expand_bwd", "mhc_pre_big_fuse"):
        assert stats.get(name, (0, 0))[0] > 0, (name, stats.get(name))
    assert not any(v[1] for k, v in stats.items() if k.startswith("mhc")), \
        {c.name: list(c.why.values()) for c in P._CACHES if c.why}


def test_plan_returns_views_of_outputs(device):
    """A planned op may return a view of an output it allocated (norm_fn's single-split partial): rebuilt on replay
    as the same view of the new output."""
    from tritile.mhc.norm_fn_kernel import norm_fn_fwd
    from tritile.runtime import override_config

    x = torch.randn(24, 4 * 64, device=device).bfloat16()
    fn = torch.randn(24, 4 * 64, device=device) * 0.01
    with override_config("mhc_norm_fn_gemm", SPLITS=1):
        a = _replayed(norm_fn_fwd, x, fn, 1e-6)
        b = _unplanned(norm_fn_fwd, x, fn, 1e-6)
        _same(a, b)
        out = norm_fn_fwd(x, fn, 1e-6)
        assert out[1].data_ptr() != norm_fn_fwd(x, fn, 1e-6)[1].data_ptr()  # a fresh output each call
        assert P.plan_stats()["mhc_pre_norm_fn_fwd"] == (1, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_mhc_inference_chain_in_a_cuda_graph():
    """mHC's inference chain (big_fuse, then mhc_post_fwd) captured as planned replays: the graph's replay on new
    residual data gives the eager bits."""
    from tritile.mhc import mhc_post_fwd
    from tritile.modeling.mhc.ops import mhc_pre_big_fuse

    T, H = 1024, 1280
    r = torch.randn(1, T, 4, H, device="cuda").bfloat16()
    fn = torch.randn(24, 4 * H, device="cuda") * 1e-3
    scale, base = torch.ones(3, device="cuda"), torch.zeros(24, device="cuda")

    def chain():
        post, comb, li = mhc_pre_big_fuse(r, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
        return mhc_post_fwd(li, r, post, comb)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()  # recorded
        chain()  # replayed
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain()
    r.copy_(torch.randn_like(r.float()).bfloat16())
    g.replay()
    torch.cuda.synchronize()
    assert_equal(out, _unplanned(chain)[0])


def test_plan_holds_a_constant(device):
    """A launch may read a registered constant (``runtime.constant``: per_token_cast's FP4 requantization maps): the
    call is planned, the plan holds the table and passes its address, and replays give the unplanned bits (two
    inputs in turn, so a replay cannot pass for a stale output)."""
    from tritile.torch import cast

    g = torch.Generator().manual_seed(3)
    qs = [cast(torch.randn(48, 256, generator=g).to(device) * s, "e2m1", (32, 32), round_sf=True,
               use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True) for s in (1.0, 1e-3)]
    for q in qs + qs:
        _same(_replayed(quant.per_token_cast, q, "e2m1", 128, (32, 32), True, True, True),
              _unplanned(quant.per_token_cast, q, "e2m1", 128, (32, 32), True, True, True))
    assert P.plan_stats()["per_token_cast"] == (1, 0), {c.name: c.why for c in P._CACHES if c.why}
    plan = next(iter(quant.per_token_cast.plan_cache.d.values()))
    assert len(plan.consts) == 1 and plan.consts[0].dtype == torch.int64


def test_inputs_carved_from_one_buffer(device):
    """Inputs that are disjoint parts of one buffer (as get_fused_mapping returns its maps) are planned: each launch
    argument is located in the input whose bytes hold it, and calls alternating carved and separate inputs of the
    same metadata give the unplanned bits.  Inputs that overlap (the same weights twice) are not planned."""
    from tritile.engram import grad_w_reduce
    from tritile.moe import expand_to_fused, get_fused_mapping

    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, 8, (40, 4), generator=g).to(device)
    pos_to_expert, _, _, t2p, *_ = get_fused_mapping(idx, 8, 0, 16)
    # both maps in one buffer, at 16-byte offsets (the alignment a separate allocation has: the same plan key)
    n1, n2 = t2p.numel(), pos_to_expert.numel()
    o2 = (n1 + 3) // 4 * 4 + 4
    buf = torch.full((o2 + n2 + 4,), -9, dtype=torch.int32, device=device)
    carved = (buf[:n1].view(t2p.shape), buf[o2:o2 + n2].view(pos_to_expert.shape))
    carved[0].copy_(t2p)
    carved[1].copy_(pos_to_expert)
    separate = (t2p.clone(), pos_to_expert.clone())
    xs = [torch.randn(40, 64, generator=g).bfloat16().to(device) for _ in range(2)]
    for x, maps in ((xs[0], carved), (xs[1], separate), (xs[1], carved), (xs[0], separate)):
        _same(_replayed(expand_to_fused, x, *maps), _unplanned(expand_to_fused, x, *maps))
    assert P.plan_stats()["expand_to_fused"] == (1, 0), {c.name: c.why for c in P._CACHES if c.why}

    part = torch.randn(4, 2, 32, generator=g).to(device)
    w = torch.randn(2, 32, generator=g).bfloat16().to(device)
    acc = [torch.zeros(2, 32, device=device) for _ in range(2)]
    grad_w_reduce(part, w, w, *acc)
    grad_w_reduce(part, w, w, *acc)
    assert P.plan_stats()["grad_w_reduce"] == (0, 1)  # unplannable: each call runs the op's own route
    want = part.sum(0) * w.float()
    assert_equal(acc[0], 2 * want)
    assert_equal(acc[1], 2 * want)
