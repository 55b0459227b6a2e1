"""swiglu_forward_and_per_token_cast vs ``cast(swiglu_forward(...))``, bitwise (spec/quant.md §3.8).

The grid of TileKernels' test on the GPU (12 MoE configs x 6 H x pos_to_expert x weights x npc x
sf configs x clamp, each for two num_sms values); on the CPU the same flag structure on two small
(MoE config, H) pairs, H = 384 giving a masked chunk (packed) and a non-power-of-two npc = H.
Differences from TileKernels' test, all stricter: padding rows (pos_to_expert < 0) are compared
without masking (tritile defines them as all-zero activations) and hold random values in x, so a
kernel that read them would fail; clamped_count starts non-zero (it must accumulate) and is checked
for npc = H too; packed sf is compared without clearing unused bytes (tritile writes zeros there).
"""

import math

import pytest
import torch
from _cast_utils import assert_bad_inputs

from tritile.config import get_num_sms, set_num_sms
from tritile.quant import swiglu_forward_and_per_token_cast
from tritile.testing import assert_equal, pick
from tritile.torch import swiglu_forward

try:
    from ._swiglu_utils import (MOE_CONFIGS, assert_codes_equal_nan_sign_free, moe_data, num_sms_values,
                                ref_per_token_cast)
except ImportError:
    from _swiglu_utils import (MOE_CONFIGS, assert_codes_equal_nan_sign_free, moe_data, num_sms_values,
                               ref_per_token_cast)

SF_CONFIGS = [(False, True, False), (True, True, True)]  # (col_major, round_sf, packed), as TileKernels

_CASES = pick(
    cpu=[((6, 72, 8), 256), ((9, 256, 64), 384)],
    gpu=[(moe, h // 2) for moe in MOE_CONFIGS for h in (2048, 2560, 3072, 4096, 6144, 7168)],
)


def _params():
    out = []
    for moe, hidden in _CASES:
        for p2e in (True, False):
            for weights in (True, False):
                for npc in (128, hidden):
                    for col, rnd, packed in SF_CONFIGS:
                        if (packed and weights) or (col and npc == hidden and npc != 128):
                            continue
                        for clamp in (None, 10.0, 0.5):
                            out.append((moe, hidden, p2e, weights, npc, col, rnd, packed, clamp))
    return out


def _id(p):
    moe, hidden, p2e, weights, npc, col, rnd, packed, clamp = p
    return f"k{moe[0]}-e{moe[1]}-ep{moe[2]}-h{hidden}-p2e{int(p2e)}-w{int(weights)}-npc{npc}-" \
           f"c{int(col)}r{int(rnd)}p{int(packed)}-clamp{clamp}"


def _anchor_flags_cast(x, clamp, counts0, cfg):
    """The op with the anchor's flags (npc 128, column-major packed UE8M0 sf, round_sf) under launch config ``cfg``:
    ``(out, sf, counts)``, counts accumulated onto a copy of ``counts0`` when there is a clamp."""
    from tritile.runtime import override_config

    counts = counts0.clone() if clamp is not None else None
    with override_config("swiglu_forward_and_per_token_cast", **cfg):
        out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True,
                                                    use_packed_ue8m0=True, swiglu_clamp_value=clamp,
                                                    clamped_count=counts)
    return out, sf, counts


def _run_ref(x, npc, ptt, w, clamp, counts, col, rnd, packed, clamp_min=None):
    act = swiglu_forward(x, ptt, w, clamp, counts)
    return ref_per_token_cast(act, npc, rnd, col, packed, clamp_min)


def _moe_inputs(moe, hidden, p2e, weights, device):
    """(data, x for the kernel, x for the reference, pos_to_token_topk, routing weights): with ``p2e`` the
    padding rows hold garbage the kernel must ignore (prefetched or not); the reference sees them as zeros."""
    d = moe_data(moe, hidden, 16, device)
    x = d["x"]
    x_ref = x
    if p2e:
        pad = d["pos_to_expert"] < 0
        x = x.clone()
        x[pad] = (torch.randn((int(pad.sum()), 2 * hidden), device=device) * 4).to(x.dtype)
    ptt = d["pos_to_token_topk"] if weights else None
    w = torch.randn((d["num_tokens"], d["num_topk"]), device=device) if weights else None
    return d, x, x_ref, ptt, w


@pytest.mark.parametrize("params", _params(), ids=_id)
def test_swiglu_forward_and_per_token_cast(device, params):
    moe, hidden, p2e, weights, npc, col, rnd, packed, clamp = params
    d, x, x_ref, ptt, w = _moe_inputs(moe, hidden, p2e, weights, device)
    counts0 = torch.tensor([5, 7, 11], dtype=torch.int64, device=device)
    ref_counts = counts0.clone() if clamp is not None else None
    ref_out, ref_sf = _run_ref(x_ref, npc, ptt, w, clamp, ref_counts, col, rnd, packed)
    old = get_num_sms()
    try:
        for num_sms in (num_sms_values() if clamp is not None else [old]):
            set_num_sms(num_sms)
            counts = counts0.clone() if clamp is not None else None
            out, sf = swiglu_forward_and_per_token_cast(
                x, "e4m3", npc, pos_to_token_topk=ptt, topk_weights=w,
                pos_to_expert=d["pos_to_expert"] if p2e else None, use_tma_aligned_col_major_sf=col,
                round_sf=rnd, use_packed_ue8m0=packed, swiglu_clamp_value=clamp, clamped_count=counts)
            assert_equal(out, ref_out)
            assert_equal(sf, ref_sf)
            if clamp is not None:
                assert_equal(counts, ref_counts)
    finally:
        set_num_sms(old)


@pytest.mark.parametrize("col,rnd,packed", [(False, False, False), (True, False, False), (True, True, False)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_other_layouts_and_fp32(device, col, rnd, packed, x_dtype):
    """sf layouts and rounding outside TileKernels' two configs; float32 x; routing weights with
    negative indices mixed in."""
    hidden = pick(cpu=384, gpu=3584)
    d = moe_data((8, 256, 8), hidden, 16, device)
    x = d["x"].to(x_dtype)
    w = torch.randn((d["num_tokens"], d["num_topk"]), device=device)
    ref_out, ref_sf = _run_ref(x, 128, d["pos_to_token_topk"], w, 0.5, None, col, rnd, packed)
    out, sf = swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, d["pos_to_token_topk"], w, d["pos_to_expert"], col, rnd, packed, 0.5)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("col,rnd,packed", [(False, False, False), (True, True, False), (True, True, True)])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_hidden_128(device, col, rnd, packed, clamp):
    """H = 128: one scale group a row, npc = H (packed UE8M0 sf: one group in a word's first byte)."""
    x = torch.randn((37, 256), device=device).bfloat16()
    ref_out, ref_sf = _run_ref(x, 128, None, None, clamp, None, col, rnd, packed)
    out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=col, round_sf=rnd,
                                                use_packed_ue8m0=packed, swiglu_clamp_value=clamp)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("npc_is_h", [False, True])
@pytest.mark.parametrize("rnd", [False, True])
def test_sf_clamp_min(device, npc_is_h, rnd):
    hidden = pick(cpu=256, gpu=2048)
    npc = hidden if npc_is_h else 128
    x = torch.randn((pick(cpu=70, gpu=4001), 2 * hidden), dtype=torch.bfloat16, device=device)
    x[:7] *= 1e-3  # amax below the custom clamp on these rows
    x[7:9] = 0
    for clamp_min in (1e-2, 3e-6):
        ref_out, ref_sf = _run_ref(x, npc, None, None, None, None, False, rnd, False, clamp_min)
        out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", npc, round_sf=rnd, sf_clamp_min=clamp_min)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


def test_strided_rows(device):
    hidden = pick(cpu=256, gpu=3584)
    big = torch.randn((pick(cpu=67, gpu=4001), 2 * hidden + 128), dtype=torch.bfloat16, device=device)
    x = big[:, : 2 * hidden]
    assert not x.is_contiguous()
    for col, rnd, packed in SF_CONFIGS:
        out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=col,
                                                    round_sf=rnd, use_packed_ue8m0=packed, swiglu_clamp_value=0.5)
        ref_out, ref_sf = swiglu_forward_and_per_token_cast(
            x.contiguous(), "e4m3", 128, use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed,
            swiglu_clamp_value=0.5)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


@pytest.mark.parametrize("col,rnd,packed,npc_is_h", [(c, r, p, h) for c, r, p in SF_CONFIGS + [(False, False, False)]
                                                     for h in (False, True) if not (c and h)])
def test_zero_rows(device, col, rnd, packed, npc_is_h):
    hidden = 384
    npc = hidden if npc_is_h else 128
    x = torch.empty((0, 2 * hidden), dtype=torch.bfloat16, device=device)
    counts = torch.tensor([1, 2, 3], dtype=torch.int64, device=device)
    out, sf = swiglu_forward_and_per_token_cast(
        x, "e4m3", npc, pos_to_token_topk=torch.empty(0, dtype=torch.int32, device=device),
        topk_weights=torch.empty((0, 4), device=device), pos_to_expert=torch.empty(0, dtype=torch.int32, device=device),
        use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed, swiglu_clamp_value=0.5,
        clamped_count=counts)
    ref_out, ref_sf = ref_per_token_cast(torch.empty((0, hidden), device=device), npc, rnd, col, packed)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    assert counts.tolist() == [1, 2, 3]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_non_finite(device, clamp):
    """A group holding inf/NaN gets sf = +inf (UE8M0 0xFF); its finite elements encode as +-0 and its
    non-finite ones as NaN; other groups are untouched."""
    hidden = 256
    x = torch.randn((9, 2 * hidden), dtype=torch.bfloat16, device=device)
    x[1, 5] = float("inf")            # l = +inf: act = +-inf without a clamp
    x[2, hidden + 130] = float("-inf")  # r = -inf
    x[3, 200] = float("nan")           # l = NaN: act NaN
    x[4, hidden + 7] = float("nan")    # r = NaN
    for col, rnd, packed in SF_CONFIGS + [(False, False, False)]:
        counts = torch.zeros(3, dtype=torch.int64, device=device) if clamp is not None else None
        ref_counts = torch.zeros(3, dtype=torch.int64, device=device) if clamp is not None else None
        out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=col, round_sf=rnd,
                                                    use_packed_ue8m0=packed, swiglu_clamp_value=clamp,
                                                    clamped_count=counts)
        ref_out, ref_sf = _run_ref(x, 128, None, None, clamp, ref_counts, col, rnd, packed)
        assert_codes_equal_nan_sign_free(out, ref_out)
        assert_equal(sf, ref_sf)
        if clamp is not None:
            assert_equal(counts, ref_counts)
    # the rule itself, in the float row-major layout
    out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, swiglu_clamp_value=clamp)
    # with a clamp the infinities are clamped away; NaN stays NaN
    bad = {(3, 1), (4, 0)} if clamp is not None else {(1, 0), (2, 1), (3, 1), (4, 0)}
    for r, g in bad:
        assert sf[r, g].item() == float("inf")
        codes = out[r, g * 128:(g + 1) * 128].view(torch.uint8)
        assert bool((((codes & 0x7F) == 0) | ((codes & 0x7F) == 0x7F)).all())
        assert bool(((codes & 0x7F) == 0x7F).any())
    for r in range(sf.shape[0]):
        for g in range(sf.shape[1]):
            if (r, g) not in bad:
                assert sf[r, g].item() != float("inf"), (r, g)


def test_bad_inputs(device):
    H = 128
    x = torch.randn((8, 2 * H), dtype=torch.bfloat16, device=device)
    i32 = torch.zeros(8, dtype=torch.int32, device=device)
    w = torch.rand((4, 2), device=device)
    f = swiglu_forward_and_per_token_cast
    assert_bad_inputs([
        (TypeError, "x", lambda: f(x.half(), "e4m3", 128)),
        (TypeError, "x", lambda: f(x.tolist(), "e4m3", 128)),
        (ValueError, "x", lambda: f(x[:, :200], "e4m3", 128)),
        (ValueError, "x", lambda: f(x[0], "e4m3", 128)),
        (ValueError, "x", lambda: f(x[:, :0], "e4m3", 128)),
        (ValueError, "x", lambda: f(torch.randn((2 * H, 8), dtype=torch.bfloat16, device=device).T, "e4m3", 128)),
        (ValueError, "fmt", lambda: f(x, "e2m1", 128)),
        (ValueError, "num_per_channels", lambda: f(x, "e4m3", 64)),
        (TypeError, "num_per_channels", lambda: f(x, "e4m3", 128.0)),
    ])
    x2 = torch.randn((8, 512), dtype=torch.bfloat16, device=device)
    assert_bad_inputs([
        (ValueError, "use_tma_aligned_col_major_sf", lambda: f(x2, "e4m3", 256, use_tma_aligned_col_major_sf=True)),
        (ValueError, "use_packed_ue8m0", lambda: f(x, "e4m3", 128, round_sf=True, use_packed_ue8m0=True)),
        (ValueError, "round_sf", lambda: f(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)),
        (ValueError, "topk_weights", lambda: f(x, "e4m3", 128, pos_to_token_topk=i32)),
        (ValueError, "pos_to_token_topk", lambda: f(x, "e4m3", 128, topk_weights=w)),
        (TypeError, "pos_to_token_topk", lambda: f(x, "e4m3", 128, pos_to_token_topk=i32.long(), topk_weights=w)),
        (ValueError, "pos_to_token_topk", lambda: f(x, "e4m3", 128, pos_to_token_topk=i32[:5], topk_weights=w)),
        (TypeError, "topk_weights", lambda: f(x, "e4m3", 128, pos_to_token_topk=i32, topk_weights=w.double())),
        (ValueError, "topk_weights", lambda: f(x, "e4m3", 128, pos_to_token_topk=i32, topk_weights=w.T)),
        (TypeError, "pos_to_expert", lambda: f(x, "e4m3", 128, pos_to_expert=i32.float())),
        (ValueError, "pos_to_expert", lambda: f(x, "e4m3", 128, pos_to_expert=i32[:3])),
    ])
    cnt = torch.zeros(3, dtype=torch.int64, device=device)
    assert_bad_inputs([
        (ValueError, "clamped_count", lambda: f(x, "e4m3", 128, clamped_count=cnt)),
        (TypeError, "clamped_count", lambda: f(x, "e4m3", 128, swiglu_clamp_value=1.0, clamped_count=cnt.int())),
        (ValueError, "clamped_count",
         lambda: f(x, "e4m3", 128, swiglu_clamp_value=1.0, clamped_count=torch.zeros(4, dtype=torch.int64, device=device))),
        (ValueError, "swiglu_clamp_value", lambda: f(x, "e4m3", 128, swiglu_clamp_value=-1.0)),
        (ValueError, "swiglu_clamp_value", lambda: f(x, "e4m3", 128, swiglu_clamp_value=float("nan"))),
        (TypeError, "swiglu_clamp_value", lambda: f(x, "e4m3", 128, swiglu_clamp_value="1")),
        (ValueError, "sf_clamp_min", lambda: f(x, "e4m3", 128, sf_clamp_min=0.0)),
        (TypeError, "round_sf", lambda: f(x, "e4m3", 128, round_sf=1)),
    ])


_FWD_PATHS = [
    # the defaults before 2026-11-30: bf16 x as int16 codes, float32 clamp, compare counts, div_rn
    dict(WORDS=False, BF16X2_COUNT=False, BF16X2_CLAMP=False, FAST_DIV=False),
    dict(WORDS=False),  # int16 codes with the 4-wide division
    dict(WORDS=True, BF16X2_COUNT=False, BF16X2_CLAMP=False),  # int32 words (even/odd column tiles)
    dict(),  # the defaults: words, counts and clamp on the bf16 pairs, 4-wide division
    dict(PREFETCH=True),
    dict(PREFETCH=True, PREFETCH_RB=True),  # the prefetch crosses row blocks (maps read a row block ahead)
    dict(WORDS=True, BF16X2_COUNT=False, PACKED_COUNT=False, FAST_MAX=False, FAST_ENC=False, MINMAX_CLAMP=False),
]


@pytest.mark.parametrize("path", _FWD_PATHS, ids=lambda p: "-".join(f"{k}{int(v)}" for k, v in p.items()) or "default")
@pytest.mark.parametrize("p2e,weights,packed,clamp", [(True, True, False, 0.5), (False, False, True, 0.5),
                                                       (False, True, False, 0.3), (True, False, True, None)])
def test_code_paths(device, path, p2e, weights, packed, clamp):
    """Each load / count / clamp / division / encode path (config keys) bitwise against the reference, with
    the counts; clamp 0.5 is a bf16 value (the bf16 pair clamp), 0.3 is not (the float32 clamp)."""
    from tritile.runtime import override_config

    hidden = 256
    d = moe_data((6, 72, 8), hidden, 16, device)
    x = d["x"]
    ptt = d["pos_to_token_topk"] if weights else None
    w = torch.randn((d["num_tokens"], d["num_topk"]), device=device) if weights else None
    col, rnd = packed, packed
    counts0 = torch.tensor([5, 7, 11], dtype=torch.int64, device=device)
    ref_counts = counts0.clone() if clamp is not None else None
    ref_out, ref_sf = _run_ref(x, 128, ptt, w, clamp, ref_counts, col, rnd, packed)
    counts = counts0.clone() if clamp is not None else None
    with override_config("swiglu_forward_and_per_token_cast", **path):
        out, sf = swiglu_forward_and_per_token_cast(
            x, "e4m3", 128, pos_to_token_topk=ptt, topk_weights=w, pos_to_expert=d["pos_to_expert"] if p2e else None,
            use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed, swiglu_clamp_value=clamp,
            clamped_count=counts)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    if clamp is not None:
        assert_equal(counts, ref_counts)


def _check_persistent(device, hidden, cfg, p2e, weights, packed, clamp):
    """A persistent grid of 2 programs (programs_per_sm=1, num_sms=2) over the moe_data rows with the launch
    config ``cfg``: padding rows hold values the kernel must ignore (prefetched or not); out, sf and the counts
    bitwise against the reference."""
    from tritile.runtime import override_config

    d, x, x_ref, ptt, w = _moe_inputs((6, 72, 8), hidden, p2e, weights, device)
    counts0 = torch.tensor([5, 7, 11], dtype=torch.int64, device=device)
    ref_counts = counts0.clone() if clamp is not None else None
    ref_out, ref_sf = _run_ref(x_ref, 128, ptt, w, clamp, ref_counts, packed, packed, packed)
    counts = counts0.clone() if clamp is not None else None
    old = get_num_sms()
    try:
        set_num_sms(2)
        with override_config("swiglu_forward_and_per_token_cast", programs_per_sm=1, **cfg):
            out, sf = swiglu_forward_and_per_token_cast(
                x, "e4m3", 128, pos_to_token_topk=ptt, topk_weights=w,
                pos_to_expert=d["pos_to_expert"] if p2e else None, use_tma_aligned_col_major_sf=packed,
                round_sf=packed, use_packed_ue8m0=packed, swiglu_clamp_value=clamp, clamped_count=counts)
    finally:
        set_num_sms(old)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    if clamp is not None:
        assert_equal(counts, ref_counts)


@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("p2e,weights,packed,clamp", [(True, True, False, 0.5), (False, False, True, 0.5),
                                                       (True, False, False, None), (False, True, False, 0.3)])
def test_prefetch_row_blocks(device, words, p2e, weights, packed, clamp):
    """PREFETCH_RB walking many small row blocks, several chunks each (the next-row-block prefetch, the maps
    read a row block ahead and the grid's tail all run); without a clamp the grid is persistent too."""
    _check_persistent(device, 512, dict(PREFETCH=True, PREFETCH_RB=True, WORDS=words, BLOCK_R=8,
                                        CH=256 if not packed else 512), p2e, weights, packed, clamp)


@pytest.mark.parametrize("ch", [512, 1024])
@pytest.mark.parametrize("p2e,weights,packed,clamp", [(True, True, False, 0.5), (False, False, True, 0.5),
                                                       (True, False, True, None)])
def test_prefetch_two_ahead(device, ch, p2e, weights, packed, clamp):
    """PREFETCH2 (two chunks in flight): H = 1536 in 3 chunks of 512 (the look-ahead crosses into the next row
    block at the second and the last chunk) or 2 of 1024 (the second masked; it crosses at every chunk)."""
    _check_persistent(device, 1536, dict(PREFETCH=True, PREFETCH_RB=True, PREFETCH2=True, BLOCK_R=16, CH=ch),
                      p2e, weights, packed, clamp)


def _exhaustive_case(l, r, clamp, device):
    """x = [l | r], the starting counts, and the reference's counts, codes and sf at the anchor's flags (npc 128,
    TMA-aligned packed UE8M0, round_sf)."""
    x = torch.cat([l, r], dim=1)
    counts0 = torch.tensor([1, 2, 3], dtype=torch.int64, device=device)
    ref_counts = counts0.clone() if clamp is not None else None
    ref_out, ref_sf = _run_ref(x, 128, None, None, clamp, ref_counts, True, True, True)
    return x, counts0, ref_counts, ref_out, ref_sf


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
@pytest.mark.parametrize("clamp", [None, 0.5, 0.3, 0.0, -0.0, 1e-40, 9.2e-41, 10.0, 3.0e38])
def test_every_bf16(device, clamp):
    """Every bf16 pattern (subnormals, infinities and NaNs included) as l and as r, through every step
    (the 4-wide division sees every l <= c, its slow path included): the codes and the clamp counts
    (taken on bf16 pairs by default: c rounded down to bf16, exact for any float32 c, 1e-40 and 9.2e-41
    giving the bf16 patterns 1 and 0) against the reference."""
    hidden = 512
    v = torch.arange(65536, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)
    l = v.reshape(-1, hidden)
    r = v[torch.randperm(65536, device=device)].reshape(-1, hidden)
    x, counts0, ref_counts, ref_out, ref_sf = _exhaustive_case(l, r, clamp, device)
    for path in (dict(), dict(WORDS=False, BF16X2_COUNT=False, BF16X2_CLAMP=False, FAST_DIV=False)):
        out, sf, counts = _anchor_flags_cast(x, clamp, counts0, path)
        if clamp is not None:
            assert_equal(counts, ref_counts)
        if clamp == 0.0 and math.copysign(1.0, clamp) < 0 and device.type == "cpu":
            # the interpreter passes a -0.0 scalar argument as +0.0 (the kernel then clamps as for c = +0):
            # the codes of c = -0.0 are compared on the GPU only; its counts are exact (checked above)
            continue
        assert_codes_equal_nan_sign_free(out, ref_out)
        assert_equal(sf, ref_sf)


def test_odd_row_stride(device):
    """bf16 rows with an odd stride cannot be read as int32 words: the int16 path runs instead."""
    hidden = 256
    big = torch.randn((pick(cpu=37, gpu=4001), 2 * hidden + 1), dtype=torch.bfloat16, device=device)
    x = big[:, : 2 * hidden]
    counts0 = torch.zeros(3, dtype=torch.int64, device=device)
    ref_counts = counts0.clone()
    ref_out, ref_sf = _run_ref(x.contiguous(), 128, None, None, 0.5, ref_counts, True, True, True)
    counts = counts0.clone()
    out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True,
                                                use_packed_ue8m0=True, swiglu_clamp_value=0.5, clamped_count=counts)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    assert_equal(counts, ref_counts)


# Same-bits instruction-count candidates (config keys; sm_90a counts in tritile/bench/cases/quant.py's _FWD_TUNE).
# Under the interpreter FUSED_SILU and XORSIGN_CLAMP run their element-wise stand-ins (inline PTX cannot run there),
# INT_COUNT its emulated mask sums and INT_SCALE itself; on the GPU the same tests run the PTX.
_ALL_CANDIDATES = dict(FUSED_SILU=4, INT_COUNT=True, XORSIGN_CLAMP=True, INT_SCALE=True)
# (the keys are independent: each one alone is the default config plus that key, a subset of these paths)
_CANDIDATE_CASES = [(_ALL_CANDIDATES, True, True, False, 0.5), (_ALL_CANDIDATES, False, False, True, 0.5),
                    (_ALL_CANDIDATES, False, True, False, 0.3), (_ALL_CANDIDATES, True, False, True, None),
                    (dict(_ALL_CANDIDATES, CNT_FLUSH=1), True, False, True, 0.5)]


@pytest.mark.parametrize("path,p2e,weights,packed,clamp", _CANDIDATE_CASES,
                         ids=lambda p: "-".join(f"{k}{int(v)}" for k, v in p.items()) if isinstance(p, dict) else str(p))
def test_candidate_paths(device, path, p2e, weights, packed, clamp):
    """Each candidate, alone and together, on the default GPU launch shape ([1, 512] x 1 warp, PREFETCH_RB on a
    persistent grid of 2 programs, so each program walks many row blocks; CNT_FLUSH=1 flushes the mask sums
    after every row block): out, sf and counts bitwise against the reference."""
    _check_persistent(device, 512, dict(path, PREFETCH=True, PREFETCH_RB=True, BLOCK_R=pick(cpu=16, gpu=1), CH=512,
                                        num_warps=1), p2e, weights, packed, clamp)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
@pytest.mark.parametrize("clamp", pick(cpu=[None, 0.5], gpu=[None, 0.5, 10.0, 0.0, 0.3]))
def test_candidates_all_bf16_gate_values(device, clamp):
    """Every bf16 pattern as l (NaN, +-inf, subnormals) with r = +-1 / +-1.5 / random, through all four
    candidates at once: the act (the fused silu on the GPU) depends on l alone, so this checks it exhaustively
    (and the division's slow path: |l| > 41 or NaN/inf in a thread's eight values); then every bf16 as r (the
    xorsign clamp and the r counts).  Codes (NaN codes sign-free), sf and the counts bitwise.  c = 0 and 0.3
    take the comparison clamp (c = 0 is not > 0; 0.3 is not a bf16 value), and FUSED_SILU stays off for 0.3."""

    hidden = 512
    v = torch.arange(65536, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)
    cfg = dict(_ALL_CANDIDATES, BLOCK_R=pick(cpu=64, gpu=1), CH=512, num_warps=1)
    for case in ("l", "r"):
        if case == "l":
            l = v.reshape(-1, hidden)
            r = torch.tensor([1.0, -1.5], dtype=torch.bfloat16, device=device).repeat(65536 // 2).reshape(-1, hidden)
            r[::3] = torch.randn((r[::3].shape), device=device).to(torch.bfloat16)
        else:
            r = v.reshape(-1, hidden)
            l = v[torch.randperm(65536, device=device)].reshape(-1, hidden)
        x, counts0, ref_counts, ref_out, ref_sf = _exhaustive_case(l, r, clamp, device)
        out, sf, counts = _anchor_flags_cast(x, clamp, counts0, cfg)
        if clamp is not None:
            assert_equal(counts, ref_counts)
        assert_equal(sf, ref_sf)
        assert_codes_equal_nan_sign_free(out, ref_out)


def test_int_scale_every_mantissa():
    """INT_SCALE's sf bits ``(bits(a) + 0x1FFFFF - 8 * 2^23) & 0xFF800000`` equal ``2^ceil(log2(div_rn(a, 448)))``
    for every float32 mantissa at the exponents where it could fail (-118: the smallest allowed, sf = 2^-126;
    -13 near the 1e-4 clamp; 127 the largest; the formula is the same shift at every exponent between), and
    sf_inv = 1 / sf (plain torch, CPU)."""
    m = torch.arange(1 << 23, dtype=torch.int64)
    for e in (-118, -13, 127):
        t = ((e + 127) << 23) + m
        a = t.to(torch.int32).view(torch.float32)
        q = a / torch.full_like(a, 448.0)  # IEEE division on the CPU
        qb = q.view(torch.int32).to(torch.int64)
        ceil_e = ((qb - 1) >> 23) + 1 - 127  # ceil(log2(q)) for normal q (tritile.language.cast.ceil_pow2_exponent)
        assert bool((q > 0).all()) and bool(torch.isfinite(q).all())
        ref_bits = (ceil_e + 127) << 23
        s = (t + (0x1FFFFF - (8 << 23))) & 0xFF800000
        assert torch.equal(s, ref_bits), e
        inv = (0x7F000000 - s).to(torch.int32).view(torch.float32)
        sf = s.to(torch.int32).view(torch.float32)
        assert torch.equal(inv * sf, torch.ones_like(sf)), e
