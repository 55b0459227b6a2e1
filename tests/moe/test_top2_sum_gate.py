"""top2_sum_gate against tritile.torch.top2_sum_gate (TileKernels' test matrix, plus map/hash/mask edges).

The reference computes the scores with the kernel's float32 formulas on each backend (exp / log per
backend, IEEE division and sqrt), so indices are compared bitwise and, except for softmax (whose
sum order differs), weights too; softmax weights use TileKernels' allclose(rtol=1e-5, atol=1e-8).
Inputs are re-drawn, as in TileKernels, until the ranking has clear gaps, so a one-ulp difference of a
transcendental between backends cannot flip a selection."""

import pytest
import torch

import tritile.moe as moe
from tritile.moe.scoring import ScoringFunc
from tritile.testing import assert_equal, is_gpu_run, pick
from tritile.torch import top2_sum_gate as ref_gate
from tritile.torch import topk_sum_and_topk_group_idx as ref_group

_CONFIGS = [  # (num_groups, num_topk_groups, num_routed_experts, num_shared_experts, num_topk)
    (0, 0, 72, 1, 6), (0, 0, 32, 2, 6), (0, 0, 64, 2, 6), (0, 0, 96, 2, 6), (0, 0, 16, 2, 6), (0, 0, 36, 2, 6),
    (0, 0, 108, 2, 6), (0, 0, 128, 2, 6), (0, 0, 144, 2, 6), (8, 8, 256, 2, 8), (8, 4, 256, 2, 8),
]
_SCORING = [f for f in ScoringFunc if f != ScoringFunc.IDENTITY]
_NUM_EXTRA, _RSF, _EP, _TP = 32, 1.5, 4, 2


def _scores(logits, func):
    if func == ScoringFunc.SIGMOID:
        return logits.sigmoid()
    if func == ScoringFunc.SOFTMAX:
        return logits.softmax(dim=-1)
    return torch.nn.functional.softplus(logits).sqrt()


def _inputs(num_tokens, num_padded, e, g, gk, k, func, device):
    """TileKernels' gap filter: group scores (Gk-th vs next) > 1e-6, consecutive top-k values > 2e-6."""
    for _ in range(100):
        logits = torch.randn(num_tokens + num_padded, e, device=device)
        bias = torch.randn(e, device=device)
        s = _scores(logits[:num_tokens], func)
        rank = (logits[:num_tokens] if func == ScoringFunc.SOFTMAX else s) + bias
        if g != gk:
            gs = rank.view(num_tokens, g, -1).topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
            if not bool((gs[:, gk - 1] - gs[:, gk] > 1e-6).all()):
                continue
            keep = torch.zeros(num_tokens, g, dtype=torch.bool, device=device).scatter_(
                1, ref_group(rank.view(num_tokens, g, -1), 2, gk), True)
            rank = rank.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
        top = rank.topk(k + 1, dim=-1).values
        if bool((top[:, : k - 1] - top[:, 1:k] > 2e-6).all()) and bool((top[:, k - 1] - top[:, k] > 1e-6).all()):
            return logits, bias
    raise AssertionError("could not draw well-separated inputs")


def _kwargs(num_tokens, num_padded, e, s, k, shared, fix, device, unmapped_stride=None):
    n = num_tokens + num_padded
    mask = None
    if num_padded:
        mask = torch.ones(n, dtype=torch.bool, device=device)
        mask[-num_padded:] = False
    pmap = count = fix_mask = None
    width = unmapped_stride or k
    unmapped = torch.zeros(n, width, dtype=torch.int64, device=device)[:, :k]
    if shared:
        pmap = torch.arange(e + s, dtype=torch.int32, device=device).view(-1, 1).expand(-1, _NUM_EXTRA + 1).contiguous()
        count = torch.ones(e + s, dtype=torch.int32, device=device)
    if fix:
        fix_mask = torch.ones(n, dtype=torch.bool, device=device)
        gen = torch.Generator(device=device).manual_seed(42)
        unmapped.copy_(torch.randint(0, e, (n, k), generator=gen, dtype=torch.int64, device=device))
    return dict(mask=mask, fix_routing_mask=fix_mask, to_physical_map=pmap, logical_count=count,
                unmapped_topk_idx=unmapped)


def _check(args, kw, func):
    kw_ref = dict(kw, unmapped_topk_idx=kw["unmapped_topk_idx"].clone())
    idx, w = moe.top2_sum_gate(*args, **kw)
    idx_ref, w_ref = ref_gate(*args, **kw_ref)
    assert_equal(idx, idx_ref)  # column order included (TileKernels sorts rows first)
    assert_equal(kw["unmapped_topk_idx"], kw_ref["unmapped_topk_idx"], check_stride=False)
    if func == ScoringFunc.SOFTMAX:
        assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-8), (w - w_ref).abs().max()
    else:
        assert_equal(w, w_ref)
    return idx, w


@pytest.mark.parametrize("config", _CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_top2_sum_gate(device, config):
    g, gk, e, s, k = config
    shared_valid = k % s == 0 and e % (k // s) == 0
    # CPU: (padded, tp_rank) in {(0, 0), (10, 1)} instead of the full product (interpreter time).
    pad_tp = pick(cpu=[(0, 0), (10, 1)], gpu=[(p, t) for p in (0, 10) for t in range(_TP)])
    for num_tokens in pick(cpu=[33], gpu=[4001, 8001]):
        for num_padded, tp_rank in pad_tp:
            for shared in (False, True) if shared_valid else (False,):
                for func in _SCORING:
                    for fix in (False, True):
                        logits, bias = _inputs(num_tokens, num_padded, e, g, gk, k, func, device)
                        args = (logits, bias, k, gk, g, shared, s, _RSF, 0, _EP, tp_rank, _TP, str(func))
                        _check(args, _kwargs(num_tokens, num_padded, e, s, k, shared, fix, device), func)

    # Stability: all-zero logits and bias -> the first experts in index order, column by column.
    n = num_tokens + num_padded
    logits = torch.zeros(n, e, device=device)
    bias = torch.zeros(e, device=device)
    args = (logits, bias, k, gk, g, shared, s, _RSF, 0, _EP, 0, _TP, "sigmoid")
    idx, _ = moe.top2_sum_gate(*args, **_kwargs(num_tokens, num_padded, e, s, k, shared, False, device))
    m = min(e // _EP, k)
    assert_equal(idx[:num_tokens, :m], torch.arange(m, device=device).expand(num_tokens, m), check_stride=False)


@pytest.mark.parametrize("func", _SCORING, ids=str)
def test_top2_sum_gate_zero_tokens(device, func):
    logits = torch.empty(0, 256, device=device)
    bias = torch.randn(256, device=device)
    unm = torch.empty(0, 8, dtype=torch.int64, device=device)
    pmap = torch.arange(258, dtype=torch.int32, device=device).view(-1, 1).expand(-1, 33).contiguous()
    idx, w = moe.top2_sum_gate(logits, bias, 8, 4, 8, True, 2, 2.5, 0, 4, 0, 2, str(func), mask=torch.empty(
        0, dtype=torch.bool, device=device), to_physical_map=pmap, logical_count=torch.ones(258, dtype=torch.int32,
        device=device), unmapped_topk_idx=unm)
    assert idx.shape == (0, 10) and idx.dtype == torch.int64 and w.shape == (0, 10) and w.dtype == torch.float32


@pytest.mark.parametrize("func", _SCORING, ids=str)
@pytest.mark.parametrize("e,s,k,g,gk", [(64, 2, 8, 0, 0), (64, 2, 8, 8, 3), (45, 1, 5, 9, 4)])
def test_top2_sum_gate_physical_map(device, func, e, s, k, g, gk):
    """Random replicas (logical_count > 1, so the (ep_rank + t*23333) hash matters), every EP/TP rank,
    a partly fixed routing, a random mask and a strided unmapped_topk_idx; odd token count; groups of
    5 experts (padded tiles)."""
    x = 7
    num_tokens = pick(cpu=301, gpu=5001)  # CPU: 2 programs
    logits = torch.randn(num_tokens, e, device=device)
    bias = torch.randn(e, device=device)
    pmap = torch.randint(0, e + x, (e + s, x + 1), dtype=torch.int32, device=device)
    count = torch.randint(1, x + 2, (e + s,), dtype=torch.int32, device=device)
    mask = torch.rand(num_tokens, device=device) < 0.8
    fix = torch.rand(num_tokens, device=device) < 0.3
    for ep_rank, num_ep, tp_rank, num_tp in [(3, 4, 1, 2), (0, 2, 0, 1), (5, 6, 2, 3), (1, 9, 0, 1)]:
        unm = torch.randint(0, e, (num_tokens, k + 3), device=device)[:, :k]
        args = (logits, bias, k, gk, g, True, s, 2.5, ep_rank, num_ep, tp_rank, num_tp, str(func))
        idx, w = _check(args, dict(mask=mask, fix_routing_mask=fix, to_physical_map=pmap, logical_count=count,
                                   unmapped_topk_idx=unm), func)
        assert bool((w[~mask] == 0).all()) and bool((idx[~mask] == -1).all())
        assert bool((w[mask][:, k:] == 1.0).all())


def test_top2_sum_gate_no_optional(device):
    """No mask / map / unmapped output; E = 15 (not a multiple of 4: TileKernels' limit, not ours);
    K = E (every expert taken); masked rows only; K above the experts of the kept groups."""
    e = 15
    logits = torch.randn(9, e, device=device)
    bias = torch.randn(e, device=device)
    for func in _SCORING:
        args = (logits, bias, e, 0, 0, False, 0, 1.0, 0, 1, 0, 1, str(func))
        idx, w = moe.top2_sum_gate(*args)
        idx_ref, w_ref = ref_gate(*args)
        assert_equal(idx, idx_ref)
        assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-8)
    mask = torch.zeros(9, 1, dtype=torch.bool, device=device)  # any shape with T elements
    idx, w = moe.top2_sum_gate(logits, bias, 4, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid", mask=mask)
    assert bool((idx == -1).all()) and bool((w == 0).all())
    # K larger than the experts of the kept groups: the excluded experts follow, in index order
    for func in _SCORING:
        args = (logits, bias, 7, 1, 3, False, 0, 1.0, 0, 1, 0, 1, str(func))
        idx, w = moe.top2_sum_gate(*args)
        idx_ref, w_ref = ref_gate(*args)
        assert_equal(idx, idx_ref)
        assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-8)


@pytest.mark.skipif(not is_gpu_run(), reason="needs 92037+ tokens (the int32 overflow of t * 23333): GPU only")
def test_top2_sum_gate_hash_int64(device):
    e, s, k, x, n = 32, 1, 4, 5, 100_003
    logits = torch.randn(n, e, device=device)
    bias = torch.randn(e, device=device)
    pmap = torch.randint(0, e + x, (e + s, x + 1), dtype=torch.int32, device=device)
    count = torch.full((e + s,), x + 1, dtype=torch.int32, device=device)
    args = (logits, bias, k, 0, 0, True, s, 1.0, 1, 1, 0, 1, "sigmoid")
    _check(args, dict(to_physical_map=pmap, logical_count=count, unmapped_topk_idx=torch.zeros(
        n, k, dtype=torch.int64, device=device)), ScoringFunc.SIGMOID)


def test_top2_sum_gate_bad_input(device):
    e = 16
    lg = torch.randn(5, e, device=device)
    b = torch.randn(e, device=device)
    base = (lg, b, 4, 0, 0, False, 0, 1.0, 0, 2, 0, 2, "sigmoid")

    def call(*over, **kw):
        args = list(base)
        for i, v in over:
            args[i] = v
        return moe.top2_sum_gate(*args, **kw)

    with pytest.raises(TypeError, match="logits"):
        call((0, lg.double()))
    with pytest.raises(ValueError, match="logits"):
        call((0, lg.t().contiguous().t()))
    with pytest.raises(ValueError, match="bias"):
        call((1, torch.randn(e + 1, device=device)))
    with pytest.raises(ValueError, match="num_topk"):
        call((2, e + 1))
    with pytest.raises(ValueError, match="num_groups"):
        call((3, 2), (4, 0))
    with pytest.raises(ValueError, match="num_topk_groups"):
        call((3, 5), (4, 4))
    with pytest.raises(ValueError, match="num_groups"):
        call((3, 1), (4, 3))
    with pytest.raises(ValueError, match="scoring_func"):
        call((12, "identity"))
    with pytest.raises(ValueError, match="scoring_func"):
        call((12, "relu"))
    with pytest.raises(ValueError, match="tp_rank"):
        call((10, 2))
    with pytest.raises(ValueError, match="num_ep_ranks"):
        call((9, 0))
    with pytest.raises(ValueError, match="num_shared_experts"):
        call((5, True), (6, 3))
    with pytest.raises(ValueError, match="num_shared_experts"):  # shared experts need a physical map
        call((5, True), (6, 2))
    with pytest.raises(ValueError, match="mask"):
        call(mask=torch.ones(4, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="mask"):
        call(mask=torch.ones(5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="logical_count"):
        call(to_physical_map=torch.zeros(e, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="to_physical_map"):
        call(to_physical_map=torch.zeros(e + 1, 2, dtype=torch.int32, device=device),
             logical_count=torch.ones(e + 1, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="to_physical_map"):
        call(to_physical_map=torch.zeros(e, 2, dtype=torch.int64, device=device),
             logical_count=torch.ones(e, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="unmapped_topk_idx"):
        call(unmapped_topk_idx=torch.zeros(5, 3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="unmapped_topk_idx"):
        call(unmapped_topk_idx=torch.zeros(4, 5, dtype=torch.int64, device=device).t())
    with pytest.raises(ValueError, match="unmapped_topk_idx"):  # rows overlap
        call(unmapped_topk_idx=torch.zeros(1, 4, dtype=torch.int64, device=device).expand(5, 4))
    with pytest.raises(ValueError, match="unmapped_topk_idx"):
        call(fix_routing_mask=torch.ones(5, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="fix_routing_mask"):
        call(fix_routing_mask=torch.ones(4, dtype=torch.bool, device=device),
             unmapped_topk_idx=torch.zeros(5, 4, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="num_topk"):
        call((2, 4.0))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN row computes NaN in the interpreter
def test_top2_sum_gate_checks(device, monkeypatch):
    """TRITILE_CHECKS=1 catches what only the data shows: non-finite logits, fixed ids out of range."""
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    e = 16
    lg = torch.randn(5, e, device=device)
    b = torch.randn(e, device=device)
    lg[2, 3] = float("nan")
    with pytest.raises(ValueError, match="logits"):
        moe.top2_sum_gate(lg, b, 4, 0, 0, False, 0, 1.0, 0, 2, 0, 2, "sigmoid")
    mask = torch.ones(5, dtype=torch.bool, device=device)
    mask[2] = False  # a masked row may hold anything
    moe.top2_sum_gate(lg, b, 4, 0, 0, False, 0, 1.0, 0, 2, 0, 2, "sigmoid", mask=mask)
    unm = torch.full((5, 4), e, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="unmapped_topk_idx"):
        moe.top2_sum_gate(lg.nan_to_num(), b, 4, 0, 0, False, 0, 1.0, 0, 2, 0, 2, "sigmoid",
                          fix_routing_mask=torch.ones(5, dtype=torch.bool, device=device), unmapped_topk_idx=unm)


def test_scoring_func():
    assert [int(f) for f in ScoringFunc] == [0, 1, 2, 3]
    assert str(ScoringFunc.SQRTSOFTPLUS) == "sqrtsoftplus"
    assert ScoringFunc.from_str("SoftMax") is ScoringFunc.SOFTMAX
    with pytest.raises(ValueError, match="not a valid ScoringFunc"):
        ScoringFunc.from_str("tanh")
