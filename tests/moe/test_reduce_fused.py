"""reduce_fused: bitwise against tritile.torch.reduce_fused, which accumulates with one rounding per fma on
the GPU (as tl.fma does there) and with two under the CPU interpreter (numpy's a*b+c, as tl.fma does there)."""

import itertools

import pytest
import torch

from tritile.moe import get_fused_mapping, reduce_fused
from tritile.runtime import override_config
from tritile.testing import assert_equal, generate_hidden_sizes, is_gpu_run
from tritile.torch import reduce_fused as ref_reduce

from _fused_utils import generate_moe_params, generate_topk_idx, moe_param_id

MOE_PARAMS = generate_moe_params()
# TileKernels' sizes (H % 256 == 0) on the GPU; on the CPU 256 and 576 (not a multiple of 256: tritile masks tails)
HIDDEN = generate_hidden_sizes(256) if is_gpu_run() else [256, 576]
FLAGS = list(itertools.product([True, False], [torch.float32, torch.bfloat16], [False, True], [True, False]))


def _flag_id(f):
    w, ind, fp8, xsf = f
    return f"{'w' if w else 'now'}-{'f32' if ind == torch.float32 else 'bf16'}-{'e4m3' if fp8 else 'same'}-" \
           f"{'xsf' if xsf else 'noxsf'}"


def _inputs(params, hidden, flags, device):
    with_weights, in_dtype, fp8_out, with_x_sf = flags
    topk_idx = generate_topk_idx(params)
    num_tokens, num_topk = topk_idx.shape
    _, _, _, token_topk_to_pos, *_ = get_fused_mapping(topk_idx, params["num_experts"], 0, 1)
    expanded = torch.randn((num_tokens * num_topk, hidden), device=device).to(in_dtype)
    weights = torch.rand((num_tokens, num_topk), device=device) if with_weights else None
    sf = torch.randn((1,), device=device) if fp8_out else None
    x_sf = torch.randn((num_tokens * num_topk,), device=device) if with_x_sf else None
    x = (expanded, x_sf) if with_x_sf else expanded
    return x, weights, token_topk_to_pos, "e4m3" if fp8_out else "", sf


# CPU: every flag combination on two routing configs and both hidden sizes, and every routing config on
# one flag combination (the benchmark's); the GPU runs TileKernels' full product.
if is_gpu_run():
    CASES = [(p, h, f) for p in MOE_PARAMS for h in HIDDEN for f in FLAGS]
else:
    CASES = [(p, h, f) for p in (MOE_PARAMS[2], MOE_PARAMS[10]) for h in HIDDEN for f in FLAGS]
    CASES += [(p, 576, (True, torch.bfloat16, True, False)) for p in MOE_PARAMS if p not in (MOE_PARAMS[2],
                                                                                          MOE_PARAMS[10])]


@pytest.mark.parametrize("params,hidden,flags", CASES,
                         ids=[f"{moe_param_id(p)}-H{h}-{_flag_id(f)}" for p, h, f in CASES])
def test_reduce_fused(params, hidden, flags, device):
    x, weights, token_topk_to_pos, fmt, sf = _inputs(params, hidden, flags, device)
    out = reduce_fused(x, weights, token_topk_to_pos, fmt, sf, None)
    assert_equal(out, ref_reduce(x, weights, token_topk_to_pos, fmt, sf))


@pytest.mark.parametrize("fp8_out", [False, True])
def test_reduce_fused_out(fp8_out, device):
    """out= is written in place (also a row-strided view) and returned."""
    params = MOE_PARAMS[6]
    x, weights, t2p, fmt, sf = _inputs(params, 256, (True, torch.bfloat16, fp8_out, True), device)
    ref = ref_reduce(x, weights, t2p, fmt, sf)
    big = torch.empty((t2p.shape[0], 300), dtype=ref.dtype, device=device)
    out = big[:, 20:276]
    got = reduce_fused(x, weights, t2p, fmt, sf, out=out)
    assert got is out
    assert_equal(out.contiguous(), ref)


@pytest.mark.parametrize("num_tokens,num_topk,hidden", [(1, 1, 1), (7, 3, 33), (33, 9, 100), (130, 2, 7)])
def test_reduce_fused_shapes(num_tokens, num_topk, hidden, device):
    """Odd sizes, duplicated and missing positions, a negative sf on empty rows (-0.0 must come out)."""
    n = max(1, num_tokens * num_topk // 2)
    t2p = torch.randint(-1, n, (num_tokens, num_topk), dtype=torch.int32, device=device)
    t2p[0] = -1
    x = torch.randn((n, hidden), dtype=torch.bfloat16, device=device)
    w = torch.rand((num_tokens, num_topk), device=device)
    sf = -torch.rand((1,), device=device) - 0.5
    for args in (((x, w, t2p, "e4m3", sf)), ((x, None, t2p, "", None)), ((x.float(), w, t2p, "", None))):
        assert_equal(reduce_fused(*args), ref_reduce(*args))
    out = reduce_fused(x, w, t2p, "e4m3", sf)
    assert bool((out[0].view(torch.uint8) == 0x80).all())  # sf * (+0) = -0.0



# launch configs of the GPU paths (tune candidates included), run on small shapes: compacted gathers (NG) with
# tokens holding 0, 1, 2 and more valid slots, each prefetch depth, the FMA-skipping branch, both e4m3 paths
PATH_CONFIGS = [
    dict(BT=1, BH=64, COL_ITERS=4, NG=1, PREFETCH=3, PREFETCH_DENSE=0, SKIP=True),
    dict(BT=1, BH=32, COL_ITERS=5, NG=1, PREFETCH=2, PREFETCH_DENSE=3, SKIP=False, SATFINITE=False),
    dict(BT=1, BH=64, COL_ITERS=3, NG=2, PREFETCH=1, PREFETCH_DENSE=2, SKIP=True, num_warps=2),
    dict(BT=2, BH=32, COL_ITERS=2, NG=2, PREFETCH=3, PREFETCH_DENSE=1, SKIP=True),
    dict(BT=1, BH=64, COL_ITERS=4, NG=0, PREFETCH=2, SKIP=True),
    dict(BT=4, BH=64, COL_ITERS=2, NG=0, PREFETCH=1, SKIP=False, WORDS=False),
    dict(BT=1, BH=128, COL_ITERS=1, NG=4, PREFETCH=0, SKIP=True),
    dict(GATHER=False, BT=2, BH=64, COL_ITERS=2, SKIP=True),
]


@pytest.mark.parametrize("cfg", PATH_CONFIGS, ids=[str(i) for i in range(len(PATH_CONFIGS))])
def test_reduce_fused_paths(cfg, device):
    num_tokens, num_topk, n = 16, 6, 40
    t2p = torch.full((num_tokens, num_topk), -1, dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(1)
    for t in range(num_tokens):  # 0, 1, 2, ... valid slots, at random places
        nv = [0, 1, 1, 1, 2, 1, 3, 6][t % 8]
        ks = torch.randperm(num_topk, generator=g)[:nv]
        t2p[t, ks] = torch.randint(0, n, (nv,), generator=g, dtype=torch.int32).to(device)
    x = torch.randn((n, 130), dtype=torch.bfloat16, device=device)
    w = torch.rand((num_tokens, num_topk), device=device)
    x_sf = torch.randn((n,), device=device)
    sf = -torch.rand((1,), device=device) - 0.5
    with override_config("reduce_fused", **cfg):
        for args in ((x, w, t2p, "e4m3", sf), ((x, x_sf), None, t2p, "", None), (x.float(), w, t2p, "e4m3", None),
                     (x[:, :96], w, t2p, "", None)):
            assert_equal(reduce_fused(*args), ref_reduce(*args))


def test_reduce_fused_bad_config(device):
    x = torch.randn((8, 64), device=device)
    t2p = torch.zeros((4, 2), dtype=torch.int32, device=device)
    with override_config("reduce_fused", NG=3), pytest.raises(ValueError, match="NG"):
        reduce_fused(x, None, t2p)

def test_reduce_fused_strided(device):
    """Row-strided x and non-contiguous weights / mapping."""
    t2p = torch.randint(-1, 50, (40, 3), dtype=torch.int32, device=device)
    big = torch.randn((50, 300), device=device)
    x = big[:, :256]
    w = torch.rand((3, 40), device=device).t()
    t2p_nc = torch.stack([t2p, t2p], dim=2)[:, :, 1]
    assert not (x.is_contiguous() or w.is_contiguous() or t2p_nc.is_contiguous())
    assert_equal(reduce_fused(x, w, t2p_nc), ref_reduce(x.contiguous(), w.contiguous(), t2p))


@pytest.mark.parametrize("with_out", [False, True])
def test_reduce_fused_zero_tokens(with_out, device):
    t2p = torch.empty((0, 6), dtype=torch.int32, device=device)
    x = torch.randn((5, 256), dtype=torch.bfloat16, device=device)
    out = torch.empty((0, 256), dtype=torch.float8_e4m3fn, device=device) if with_out else None
    got = reduce_fused(x, None, t2p, "e4m3", torch.ones(1, device=device), out)
    assert got.shape == (0, 256) and got.dtype == torch.float8_e4m3fn
    if with_out:
        assert got is out


def test_reduce_fused_bad_positions(device, monkeypatch):
    """Positions >= N are skipped (never read out of bounds); TRITILE_CHECKS=1 rejects them."""
    x = torch.randn((4, 64), device=device)
    t2p = torch.tensor([[0, 1000], [-1, 3]], dtype=torch.int32, device=device)
    good = torch.tensor([[0, -1], [-1, 3]], dtype=torch.int32, device=device)
    assert_equal(reduce_fused(x, None, t2p), ref_reduce(x, None, good))
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        reduce_fused(x, None, t2p)


def test_reduce_fused_bad_input(device):
    x = torch.randn((8, 256), device=device)
    t2p = torch.zeros((4, 2), dtype=torch.int32, device=device)
    w = torch.rand((4, 2), device=device)
    with pytest.raises(TypeError, match="x"):
        reduce_fused(x.half(), w, t2p)
    with pytest.raises(ValueError, match="x"):
        reduce_fused(x[0], w, t2p)
    with pytest.raises(ValueError, match="x"):
        reduce_fused(x.t(), w, t2p)
    with pytest.raises(TypeError, match="x"):
        reduce_fused((x,), w, t2p)
    with pytest.raises(TypeError, match="x_sf"):
        reduce_fused((x, torch.ones(8, dtype=torch.bfloat16, device=device)), w, t2p)
    with pytest.raises(ValueError, match="x_sf"):
        reduce_fused((x, torch.ones(7, device=device)), w, t2p)
    with pytest.raises(TypeError, match="topk_weights"):
        reduce_fused(x, w.double(), t2p)
    with pytest.raises(ValueError, match="topk_weights"):
        reduce_fused(x, w[:3], t2p)
    with pytest.raises(TypeError, match="token_topk_to_pos"):
        reduce_fused(x, w, t2p.long())
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        reduce_fused(x, w, t2p[0])
    with pytest.raises(ValueError, match="fp8_format"):
        reduce_fused(x, w, t2p, "e5m2")
    with pytest.raises(ValueError, match="sf"):
        reduce_fused(x, w, t2p, "", torch.ones(1, device=device))
    with pytest.raises(TypeError, match="sf"):
        reduce_fused(x, w, t2p, "e4m3", torch.ones(1, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="sf"):
        reduce_fused(x, w, t2p, "e4m3", torch.ones(2, device=device))
    with pytest.raises(ValueError, match="out"):
        reduce_fused(x, w, t2p, out=torch.empty((4, 128), device=device))
    with pytest.raises(TypeError, match="out"):
        reduce_fused(x, w, t2p, "e4m3", out=torch.empty((4, 256), device=device))
    with pytest.raises(ValueError, match="out"):
        reduce_fused(x, w, t2p, out=torch.empty((256, 4), device=device).t())
