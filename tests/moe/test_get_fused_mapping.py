"""get_fused_mapping: TileKernels' invariants, plus bitwise equality with a stable-sort reference
(tritile's canonical order), for both launch paths, every mode of ``num_expanded_tokens`` and two SM counts."""

import pytest
import torch

from tritile.config import set_num_sms
from tritile.moe import get_fused_mapping
from tritile.runtime import override_config
from tritile.testing import assert_equal

from _fused_utils import generate_moe_params, generate_num_sms, generate_topk_idx, moe_param_id, ref_fused_mapping

MOE_PARAMS = generate_moe_params()


@pytest.fixture(autouse=True)
def _restore_num_sms():
    yield
    set_num_sms(None)


def _check_invariants(topk_idx, num_experts, outs):
    """The checks of TileKernels' test, plus front-packing of each segment (DeepGEMM reads a block's expert
    from its first row)."""
    pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end, per_expert, lst = outs
    num_topk = topk_idx.shape[1]
    assert per_expert.tolist() == lst
    start = 0
    for e in range(num_experts):
        assert start == int(expert_start[e])
        seg = pos_to_expert[start:start + lst[e]]
        c = int((topk_idx == e).sum())
        assert int((seg == e).sum()) == c
        assert bool(((seg == e) | (seg == -1)).all())
        assert bool((seg[:c] == e).all()), "valid slots must sit at the front of the segment"
        start += lst[e]
        assert start == int(expert_end[e])
    valid = pos_to_expert >= 0
    if bool(valid.any()):
        flat = pos_to_token_topk[valid].long()
        t, k = flat // num_topk, flat % num_topk
        expect = torch.arange(pos_to_token_topk.numel(), device=flat.device, dtype=torch.int32)[valid]
        assert torch.equal(token_topk_to_pos[t, k], expect)
        assert torch.equal(topk_idx[t, k].int(), pos_to_expert[valid])
        assert torch.equal(flat // num_topk, pos_to_token[valid].long())
    assert torch.equal(~valid, pos_to_token < 0)
    assert torch.equal(~valid, pos_to_token_topk < 0)
    assert torch.equal(token_topk_to_pos < 0, topk_idx < 0)


def _assert_same(outs, ref):
    for a, b in zip(outs[:7], ref[:7]):
        assert_equal(a, b)
    assert outs[7] == ref[7]


@pytest.mark.parametrize("alignment", [64, 128])
@pytest.mark.parametrize("params", MOE_PARAMS, ids=moe_param_id)
def test_get_fused_mapping(params, alignment):
    topk_idx = generate_topk_idx(params)
    num_experts = params["num_experts"]
    ref = ref_fused_mapping(topk_idx, num_experts, 0, alignment)
    for num_sms in generate_num_sms():
        set_num_sms(num_sms)
        outs = get_fused_mapping(topk_idx, num_experts, 0, alignment)
        _check_invariants(topk_idx, num_experts, outs)
        _assert_same(outs, ref)


_PATHS = {
    "one-launch": dict(single_max=1 << 30),
    # count + scatter; the scatter sums the count table itself; packed ranks where E <= 4
    "two-launch": dict(single_max=0, chunk=64, sb=16, scan_tp=2, scan_eb=16),
    # count + scan + scatter, [SB, SB] ranks for every E
    "three-launch": dict(single_max=0, chunk=64, sb=16, scan_tp=2, scan_eb=16, packed=False, fuse_scan=0),
    # two launches without packing (E <= 4 too), and three launches with packing
    "two-launch-unpacked": dict(single_max=0, chunk=32, sb=16, packed=False),
    "three-launch-packed": dict(single_max=0, chunk=32, scan_tp=4, fuse_scan=0),
    # eight 8-bit counters a lane (E > 8)
    "two-launch-field8": dict(single_max=0, chunk=64, field_bits=8),
    # the chunk ranked in sub-blocks (8-bit counters in each, the running base between them), and 16-bit ones
    "two-launch-sub": dict(single_max=0, chunk=128, field_bits=8, sub=32),
    "three-launch-sub16": dict(single_max=0, chunk=64, sub=16, fuse_scan=0),
}


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("num_tokens,num_topk,num_experts,alignment", [
    (1, 1, 1, 1), (7, 3, 5, 4), (33, 9, 4, 128), (130, 8, 32, 16), (57, 2, 9, 1), (41, 6, 72, 7), (25, 4, 300, 3),
    (70, 9, 3, 16), (45, 7, 2, 1)])
def test_get_fused_mapping_shapes(path, num_tokens, num_topk, num_experts, alignment, device):
    """Random ids with -1 anywhere (duplicates allowed), odd sizes and alignments, every launch path
    (multi-launch with small chunks, so that several programs and scan steps take part)."""
    cfg = _PATHS[path]
    topk_idx = torch.randint(-1, num_experts, (num_tokens, num_topk), device=device)
    ref = ref_fused_mapping(topk_idx, num_experts, 0, alignment)
    with override_config("get_fused_mapping", **cfg):
        for num_sms in generate_num_sms():
            set_num_sms(num_sms)
            outs = get_fused_mapping(topk_idx, num_experts, 0, alignment)
            _check_invariants(topk_idx, num_experts, outs)
            _assert_same(outs, ref)


@pytest.mark.parametrize("cfg", [dict(chunk=16, sb=16), dict(chunk=64, sb=32, scan_tp=4), dict(chunk=256, sb=64),
                                 dict(single_max=1 << 30, sb=128), dict(chunk=64, fuse_scan=0),
                                 dict(chunk=16, sb=16, fuse_scan=0, packed=False)])
def test_get_fused_mapping_launch_configs(cfg, device):
    """Chunk and step sizes (GPU ones included) change nothing, with padding longer and shorter than a step,
    in both modes; E = 4 takes the packed ranks unless the config turns them off."""
    for e in (12, 4):
        topk_idx = torch.randint(-1, e, (150, 6), device=device)
        with override_config("get_fused_mapping", **dict(dict(single_max=0), **cfg)):
            for alignment in (1, 16, 2000):
                ref = ref_fused_mapping(topk_idx, e, 0, alignment)
                _assert_same(get_fused_mapping(topk_idx, e, 0, alignment), ref)
            n = int(ref[6].sum()) + 1500
            _assert_same(get_fused_mapping(topk_idx, e, n, 2000), ref_fused_mapping(topk_idx, e, n, 2000, sync=False))


@pytest.mark.parametrize("cfg", [dict(chunk=256), dict(chunk=1024, sub=256)], ids=str)
@pytest.mark.parametrize("num_experts", [16, 32])
def test_get_fused_mapping_field8_full_chunk(num_experts, cfg, device):
    """8-bit counters at their limit: 256-slot chunks (or sub-blocks of a 1024-slot chunk) whose slots all go to one
    expert (the inclusive count of the last slot, 256, carries into the next field), next to mixed and missing ids."""
    ids = torch.full((1280,), num_experts - 2, dtype=torch.int64, device=device)  # blocks 0-2 all one expert
    ids[256:512] = num_experts - 1
    ids[600:700] = torch.randint(-1, num_experts, (100,), device=device)
    ids[1024:] = num_experts - 1
    topk_idx = ids.view(160, 8)
    with override_config("get_fused_mapping", single_max=0, field_bits=8, **cfg):
        for alignment in (1, 128):
            _assert_same(get_fused_mapping(topk_idx, num_experts, 0, alignment),
                         ref_fused_mapping(topk_idx, num_experts, 0, alignment))


@pytest.mark.parametrize("num_experts,num_tokens,num_topk,rule_numel", [
    (9, 700, 2, None), (16, 300, 8, None), (32, 330, 6, None), (32, 1500, 9, None),
    (32, 1500, 9, 112266), (32, 700, 6, 207846), (9, 700, 8, 175480), (16, 40, 9, 360)])
def test_get_fused_mapping_gpu_rule(num_experts, num_tokens, num_topk, rule_numel, device):
    """The GPU's default config for the shape (8-bit counters on 128- / 256-slot chunks; past their table bound,
    512- / 1024-slot chunks ranked in 256-slot sub-blocks; the one-program path), run in the interpreter too.
    ``rule_numel``: take the config the GPU picks for that many slots (the grid's large shapes), on smaller data."""
    from tritile.moe.get_fused_mapping_kernel import _default_config

    cfg = _default_config(num_experts, rule_numel or num_tokens * num_topk, 132, False)
    if rule_numel and rule_numel > 65536:
        assert cfg.get("sub") == 256 and cfg.get("field_bits") == 8, cfg
    topk_idx = torch.randint(-1, num_experts, (num_tokens, num_topk), device=device)
    with override_config("get_fused_mapping", **cfg):
        for alignment in (1, 128):
            _assert_same(get_fused_mapping(topk_idx, num_experts, 0, alignment),
                         ref_fused_mapping(topk_idx, num_experts, 0, alignment))


@pytest.mark.parametrize("extra", [0, 1, 77])
def test_get_fused_mapping_fixed_size(extra, device):
    """num_expanded_tokens > 0: no sync, the list is [], positions past the segments are padding."""
    params = MOE_PARAMS[4]
    topk_idx = generate_topk_idx(params)
    num_experts = params["num_experts"]
    need = int(ref_fused_mapping(topk_idx, num_experts, 0, 16)[6].sum())
    n = need + extra
    ref = ref_fused_mapping(topk_idx, num_experts, n, 16, sync=False)
    outs = get_fused_mapping(topk_idx, num_experts, n, 16)
    assert outs[7] == []
    assert outs[0].shape == (n,)
    _assert_same(outs, ref)


def test_get_fused_mapping_too_small_buffer(device, monkeypatch):
    """Slots that do not fit are dropped (never written out of bounds) and get token_topk_to_pos = -1;
    with force_no_sync and N = 0 every slot is dropped.  TRITILE_CHECKS=1 turns a too small N into an error."""
    topk_idx = torch.randint(-1, 5, (40, 4), device=device)
    need = int(ref_fused_mapping(topk_idx, 5, 0, 8)[6].sum())
    n = need // 2
    ref = ref_fused_mapping(topk_idx, 5, n, 8, sync=False)
    _assert_same(get_fused_mapping(topk_idx, 5, n, 8), ref)
    outs = get_fused_mapping(topk_idx, 5, 0, 8, force_no_sync=True)
    ref = ref_fused_mapping(topk_idx, 5, 0, 8, sync=False)
    _assert_same(outs, ref)
    assert outs[0].shape == (0,) and bool((outs[3] == -1).all())
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="num_expanded_tokens"):
        get_fused_mapping(topk_idx, 5, n, 8)


@pytest.mark.parametrize("num_expanded_tokens", [0, 5])
def test_get_fused_mapping_zero_tokens(num_expanded_tokens, device):
    topk_idx = torch.empty((0, 6), dtype=torch.int64, device=device)
    outs = get_fused_mapping(topk_idx, 4, num_expanded_tokens, 128)
    assert outs[3].shape == (0, 6) and outs[3].dtype == torch.int32
    for t in outs[4:7]:
        assert t.shape == (4,) and t.dtype == torch.int32 and bool((t == 0).all())
    for t in outs[:3]:
        assert t.shape == (num_expanded_tokens,) and bool((t == -1).all())
    assert outs[7] == ([0] * 4 if num_expanded_tokens == 0 else [])


def test_get_fused_mapping_out_of_range_ids(device, monkeypatch):
    """Ids outside [-1, E) never write out of bounds (the kernel treats them as -1); TRITILE_CHECKS=1 rejects them."""
    topk_idx = torch.randint(-1, 6, (50, 4), device=device)
    topk_idx[3, 1] = 6
    topk_idx[10, 0] = -7
    topk_idx[20, 2] = 1 << 40
    ref = ref_fused_mapping(topk_idx, 6, 0, 16)
    _assert_same(get_fused_mapping(topk_idx, 6, 0, 16), ref)
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="topk_idx"):
        get_fused_mapping(topk_idx, 6, 0, 16)


def test_get_fused_mapping_bad_input(device):
    idx = torch.randint(-1, 4, (8, 2), device=device)
    with pytest.raises(TypeError, match="topk_idx"):
        get_fused_mapping(idx.int(), 4, 0, 16)
    with pytest.raises(TypeError, match="topk_idx"):
        get_fused_mapping(idx.tolist(), 4, 0, 16)
    with pytest.raises(ValueError, match="topk_idx"):
        get_fused_mapping(idx.flatten(), 4, 0, 16)
    with pytest.raises(ValueError, match="topk_idx"):
        get_fused_mapping(idx.t(), 4, 0, 16)
    with pytest.raises(ValueError, match="num_experts"):
        get_fused_mapping(idx, 0, 0, 16)
    with pytest.raises(ValueError, match="num_experts"):
        get_fused_mapping(idx, 2000, 0, 16)
    with pytest.raises(TypeError, match="num_experts"):
        get_fused_mapping(idx, 4.0, 0, 16)
    with pytest.raises(ValueError, match="num_expanded_tokens"):
        get_fused_mapping(idx, 4, -1, 16)
    with pytest.raises(ValueError, match="alignment"):
        get_fused_mapping(idx, 4, 0, 0)
    with pytest.raises(ValueError, match="alignment"):
        get_fused_mapping(idx, 4, 0, 1 << 30)
    with pytest.raises(ValueError, match="num_expanded_tokens"):
        get_fused_mapping(idx, 4, 1 << 31, 16)
    with pytest.raises(TypeError, match="force_no_sync"):
        get_fused_mapping(idx, 4, 0, 16, force_no_sync=1)
