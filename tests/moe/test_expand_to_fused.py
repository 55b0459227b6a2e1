"""expand_to_fused / expand_to_fused_with_sf: bitwise against tritile.torch (strides of the sf included).

Scale inputs are random bits (float32 scales or packed UE8M0 words) standing in for per_token_cast's
output: the op is a pure copy, so any bits must come through unchanged."""

import pytest
import torch

from tritile.moe import expand_to_fused, expand_to_fused_with_sf, get_fused_mapping
from tritile.testing import assert_equal, generate_hidden_sizes, is_gpu_run
from tritile.torch import expand_to_fused as ref_expand
from tritile.torch import expand_to_fused_with_sf as ref_expand_sf
from tritile.utils import ceil_div

from _fused_utils import generate_moe_params, generate_topk_idx, moe_param_id

MOE_PARAMS = generate_moe_params()
HIDDEN = generate_hidden_sizes(cpu=(256, 576))
# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0) as TileKernels tests, plus plain col-major fp32
SF_LAYOUTS = [(False, True, False), (True, True, True), (True, False, False)]


def _mapping(topk_idx, num_experts, alignment=16):
    pos_to_expert, _, _, token_topk_to_pos, *_ = get_fused_mapping(topk_idx, num_experts, 0, alignment)
    return pos_to_expert, token_topk_to_pos


def _random_sf(num_tokens, hidden, npc, packed, device):
    groups = ceil_div(hidden, npc)
    if packed:
        return torch.randint(-2**31, 2**31 - 1, (num_tokens, ceil_div(groups, 4)), dtype=torch.int32, device=device)
    return torch.randn((num_tokens, groups), device=device) * 2.0 ** torch.randint(-20, 20, (num_tokens, groups),
                                                                                 device=device)


def _random_fp8(shape, device):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("params", MOE_PARAMS, ids=moe_param_id)
def test_expand_to_fused(params, hidden, device):
    topk_idx = generate_topk_idx(params)
    x = torch.randn((topk_idx.shape[0], hidden), dtype=torch.bfloat16, device=device)
    pos_to_expert, token_topk_to_pos = _mapping(topk_idx, params["num_experts"])
    out = expand_to_fused(x, token_topk_to_pos, pos_to_expert)
    assert_equal(out, ref_expand(x, token_topk_to_pos, pos_to_expert))


@pytest.mark.parametrize("layout", SF_LAYOUTS, ids=["row", "col-packed", "col-fp32"])
@pytest.mark.parametrize("npc", [32, 128])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("params", MOE_PARAMS if is_gpu_run() else MOE_PARAMS[::2], ids=moe_param_id)
def test_expand_to_fused_with_sf(params, hidden, npc, layout, device):
    col_major, _round_sf, packed = layout
    topk_idx = generate_topk_idx(params)
    num_tokens = topk_idx.shape[0]
    x = _random_fp8((num_tokens, hidden), device)
    x_sf = _random_sf(num_tokens, hidden, npc, packed, device)
    pos_to_expert, token_topk_to_pos = _mapping(topk_idx, params["num_experts"])
    out, out_sf = expand_to_fused_with_sf((x, x_sf), npc, token_topk_to_pos, pos_to_expert, col_major)
    ref, ref_sf = ref_expand_sf((x, x_sf), npc, token_topk_to_pos, pos_to_expert, col_major)
    assert_equal(out, ref)
    assert_equal(out_sf, ref_sf, check_stride=num_tokens > 0)
    if col_major and pos_to_expert.numel() > 0:
        assert out_sf.stride() == (1, (pos_to_expert.numel() + 3) // 4 * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
@pytest.mark.parametrize("num_tokens,num_topk,num_experts,hidden,alignment", [
    (1, 1, 1, 1, 1), (7, 3, 5, 33, 4), (33, 2, 9, 7, 16), (130, 8, 4, 100, 128)])
def test_expand_to_fused_shapes(dtype, num_tokens, num_topk, num_experts, hidden, alignment, device):
    """Odd hidden sizes (narrower int words), every dtype (copied bit for bit: NaN payloads included)."""
    topk_idx = torch.randint(-1, num_experts, (num_tokens, num_topk), device=device)
    nbytes = torch.empty((), dtype=dtype).element_size()
    x = torch.randint(0, 256, (num_tokens, hidden * nbytes), dtype=torch.uint8, device=device).view(dtype)
    pos_to_expert, token_topk_to_pos = _mapping(topk_idx, num_experts, alignment)
    assert_equal(expand_to_fused(x, token_topk_to_pos, pos_to_expert), ref_expand(x, token_topk_to_pos, pos_to_expert))


def test_expand_to_fused_strided_inputs(device):
    """Row-strided x / x_sf and a strided mapping (the quant tests pass pos_to_token as pos_to_expert)."""
    topk_idx = torch.randint(-1, 6, (45, 4), device=device)
    pos_to_expert, pos_to_token, _, token_topk_to_pos, *_ = get_fused_mapping(topk_idx, 6, 0, 8)
    big = torch.randn((45, 600), dtype=torch.bfloat16, device=device)
    x = big[:, 8:584]
    t2p = torch.stack([token_topk_to_pos, token_topk_to_pos], dim=2)[:, :, 0]
    pte = torch.stack([pos_to_token, pos_to_token], dim=1)[:, 1]
    assert not x.is_contiguous() and not t2p.is_contiguous() and not pte.is_contiguous()
    assert_equal(expand_to_fused(x, t2p, pte), ref_expand(x.contiguous(), token_topk_to_pos, pos_to_expert))
    fp8 = _random_fp8((45, 300), device)[:, :256]
    sf_big = torch.randn((45, 4), device=device)
    sf = sf_big[:, :2]
    out, out_sf = expand_to_fused_with_sf((fp8, sf), 128, t2p, pte, True)
    ref, ref_sf = ref_expand_sf((fp8.contiguous(), sf.contiguous()), 128, token_topk_to_pos, pos_to_expert, True)
    assert_equal(out, ref)
    assert_equal(out_sf, ref_sf)


@pytest.mark.parametrize("with_sf", [False, True])
@pytest.mark.parametrize("num_expanded", [0, 9])
def test_expand_to_fused_zero_tokens(with_sf, num_expanded, device):
    """T = 0: correctly shaped outputs; with a caller-sized mapping the padding rows are still zeroed."""
    t2p = torch.empty((0, 4), dtype=torch.int32, device=device)
    pos_to_expert = torch.full((num_expanded,), -1, dtype=torch.int32, device=device)
    x = torch.empty((0, 256), dtype=torch.bfloat16, device=device)
    if not with_sf:
        out = expand_to_fused(x, t2p, pos_to_expert)
        assert_equal(out, torch.zeros((num_expanded, 256), dtype=torch.bfloat16, device=device))
        return
    fp8 = _random_fp8((0, 256), device)
    for col_major, sf in ((False, torch.empty((0, 2), device=device)),
                          (True, torch.empty((0, 1), dtype=torch.int32, device=device))):
        out, out_sf = expand_to_fused_with_sf((fp8, sf), 128, t2p, pos_to_expert, col_major)
        ref, ref_sf = ref_expand_sf((fp8, sf), 128, t2p, pos_to_expert, col_major)
        assert_equal(out, ref)
        assert_equal(out_sf, ref_sf)


def test_expand_to_fused_bad_positions(device, monkeypatch):
    """Positions >= N are skipped (never written out of bounds); TRITILE_CHECKS=1 rejects them."""
    topk_idx = torch.randint(-1, 3, (20, 2), device=device)
    pos_to_expert, token_topk_to_pos = _mapping(topk_idx, 3, 4)
    x = torch.randn((20, 64), device=device)
    bad = token_topk_to_pos.clone()
    bad[bad >= 0] += 1000
    out = expand_to_fused(x, bad, pos_to_expert)
    assert bool(out[pos_to_expert < 0].eq(0).all())
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        expand_to_fused(x, bad, pos_to_expert)


def test_expand_to_fused_bad_input(device):
    t2p = torch.zeros((4, 2), dtype=torch.int32, device=device)
    pe = torch.zeros((8,), dtype=torch.int32, device=device)
    x = torch.randn((4, 64), device=device)
    with pytest.raises(ValueError, match="x"):
        expand_to_fused(x[0], t2p, pe)
    with pytest.raises(ValueError, match="x"):
        expand_to_fused(x.t(), t2p, pe)
    with pytest.raises(TypeError, match="token_topk_to_pos"):
        expand_to_fused(x, t2p.long(), pe)
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        expand_to_fused(x, t2p[:3], pe)
    with pytest.raises(TypeError, match="pos_to_expert"):
        expand_to_fused(x, t2p, pe.float())
    with pytest.raises(ValueError, match="pos_to_expert"):
        expand_to_fused(x, t2p, pe.view(2, 4))
    fp8 = _random_fp8((4, 256), device)
    sf = torch.randn((4, 2), device=device)
    packed = torch.zeros((4, 1), dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="x"):
        expand_to_fused_with_sf(fp8, 128, t2p, pe)
    with pytest.raises(ValueError, match="num_per_channels"):
        expand_to_fused_with_sf((fp8, sf), 64, t2p, pe)
    with pytest.raises(TypeError, match="x_sf"):
        expand_to_fused_with_sf((fp8, sf.double()), 128, t2p, pe)
    with pytest.raises(ValueError, match="x_sf"):
        expand_to_fused_with_sf((fp8, sf[:, :1]), 128, t2p, pe)
    with pytest.raises(ValueError, match="x_sf"):
        expand_to_fused_with_sf((fp8, sf[:3]), 128, t2p, pe)
    with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
        expand_to_fused_with_sf((fp8, packed), 128, t2p, pe, False)
    with pytest.raises(TypeError, match="use_tma_aligned_col_major_sf"):
        expand_to_fused_with_sf((fp8, sf), 128, t2p, pe, 1)
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        expand_to_fused_with_sf((fp8, sf), 128, t2p[:2], pe)


@pytest.mark.parametrize("layout", SF_LAYOUTS[:2], ids=["row", "col-packed"])
def test_expand_to_fused_with_per_token_cast(layout, device):
    """TileKernels' own input: tritile.quant.per_token_cast output (its col-major sf made contiguous)."""
    import tritile.quant as quant

    per_token_cast = getattr(quant, "per_token_cast", None)
    if per_token_cast is None:
        pytest.skip("tritile.quant has no per_token_cast yet (the quant module is written in parallel)")
    col_major, round_sf, packed = layout
    params = MOE_PARAMS[10]
    topk_idx = generate_topk_idx(params)
    x = torch.randn((topk_idx.shape[0], 576), dtype=torch.bfloat16, device=device)
    x_fp8, x_sf = per_token_cast(x, "e4m3", num_per_channels=128, use_tma_aligned_col_major_sf=col_major,
                                 round_sf=round_sf, use_packed_ue8m0=packed)
    pos_to_expert, token_topk_to_pos = _mapping(topk_idx, params["num_experts"])
    args = ((x_fp8, x_sf.contiguous()), 128, token_topk_to_pos, pos_to_expert, col_major)
    out, out_sf = expand_to_fused_with_sf(*args)
    ref, ref_sf = ref_expand_sf(*args)
    assert_equal(out, ref)
    assert_equal(out_sf, ref_sf)


# Launch-config candidates of the tune lists (tritile/bench/cases/moe.py) at small tiles, so that several
# token tiles, column blocks and padding programs run: COMPACT (one [BT, KP] index load, a store per valid
# slot rank) and PAD_FIRST (padding programs on the low program ids), each on and off.
_CANDIDATES = [dict(), dict(COMPACT=False, PAD_FIRST=False), dict(COMPACT=True, PAD_FIRST=False),
               dict(COMPACT=False, PAD_FIRST=True), dict(COMPACT=True, PAD_FIRST=True),
               dict(COMPACT=True, BT=1, PBT=4, PSUB=2)]


@pytest.mark.parametrize("overrides", _CANDIDATES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "base")
@pytest.mark.parametrize("layout", SF_LAYOUTS[:2], ids=["row", "col-packed"])
def test_expand_to_fused_candidates(overrides, layout, device):
    from tritile.runtime import override_config
    col_major, _round_sf, packed = layout
    num_tokens, num_topk, num_experts = 37, 5, 3
    # sparse rows as at ep 64 (most slots -1, some tokens with 2-3 valid slots)
    topk_idx = torch.randint(0, num_experts * 4, (num_tokens, num_topk), device=device)
    topk_idx = torch.where(topk_idx < num_experts, topk_idx, torch.full_like(topk_idx, -1))
    pos_to_expert, token_topk_to_pos = _mapping(topk_idx, num_experts, 8)
    x = _random_fp8((num_tokens, 256), device)
    x_sf = _random_sf(num_tokens, 256, 32, packed, device)
    cfg = dict(BT=8, BH=16, PBT=8, PSUB=2, num_warps=4)
    cfg.update(overrides)
    with override_config("expand_to_fused_with_sf", **cfg):
        out, out_sf = expand_to_fused_with_sf((x, x_sf), 32, token_topk_to_pos, pos_to_expert, col_major)
    ref, ref_sf = ref_expand_sf((x, x_sf), 32, token_topk_to_pos, pos_to_expert, col_major)
    assert_equal(out, ref)
    assert_equal(out_sf, ref_sf)
    xb = torch.randn((num_tokens, 40), dtype=torch.bfloat16, device=device)
    with override_config("expand_to_fused", **cfg):
        out = expand_to_fused(xb, token_topk_to_pos, pos_to_expert)
    assert_equal(out, ref_expand(xb, token_topk_to_pos, pos_to_expert))
