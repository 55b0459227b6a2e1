"""per_channel_cast_fused vs the torch reference (bitwise): plain and MoE-gathered inputs, bf16/fp32 or an
FP8 QuantTensor with non-power-of-two input scales, round_sf on and off."""

import pytest
import torch
from _cast_utils import assert_bad_inputs
from _moe_maps import MOE_CONFIGS, expand, generate_topk_idx, get_fused_mapping

from tritile.quant import per_channel_cast_fused
from tritile.bench.cases.quant import _TUNE_CAST_BACK
from tritile.testing import assert_equal, generate_hidden_sizes, is_gpu_run, pick
from tritile.torch.cast import cast
from tritile.torch.per_channel_cast_fused import per_channel_cast_fused as ref_fused

TOKENS = pick(cpu=[0, 128, 256], gpu=[0, 4096])
HIDDEN = generate_hidden_sizes(128, cpu=(256, 640))
SEND_TOKENS = pick(cpu=17, gpu=4001)
MOE_HIDDEN = (256, 384)  # CPU only: K % 128 == 0, one of them a partial power-of-two tile


def _check(x, round_sf, npc=None, pos_to_token=None):
    out, sf = per_channel_cast_fused(x, "e4m3", 128, round_sf, npc, pos_to_token)
    ref_out, ref_sf = ref_fused(x, 128, npc, round_sf, pos_to_token)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    return out, sf


def _to_fp8(x, **flags):
    """Per-token (1 x 128) e4m3 QuantTensor of ``x`` (reference cast; round_sf=False gives
    non-power-of-two scales)."""
    return cast(x, "e4m3", (1, 128), **flags)


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("fused_cast_back", [False, True])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_per_channel_cast_fused_plain(num_tokens, hidden, fused_cast_back, round_sf, device):
    x = torch.randn(num_tokens, hidden, device=device).bfloat16()
    if fused_cast_back:
        x = _to_fp8(x)
        assert num_tokens == 0 or not bool((x[1] == torch.exp2(torch.round(torch.log2(x[1])))).all())
    out, sf = _check(x, round_sf, 128 if fused_cast_back else None)
    assert out.shape == (num_tokens, hidden) and sf.shape == (num_tokens // 128, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_cast_fused_any_hidden(dtype, device):
    """A plain input needs no particular K: 576 leaves a partial column tile."""
    _check(torch.randn(256, 576, device=device).to(dtype), False)


def _moe_cases():
    """GPU: TileKernels' grid (12 MoE configs x K x alignment {16, 128} x fused_cast_back x round_sf).
    CPU: every MoE config with both alignments and all four flag pairs; K alternates between configs."""
    flags = [(f, r) for f in (False, True) for r in (False, True)]
    cases = []
    for i, (topk, experts, ranks) in enumerate(MOE_CONFIGS):
        for j, alignment in enumerate((16, 128)):
            if is_gpu_run():
                cases += [(topk, experts, ranks, alignment, k, f, r) for k in HIDDEN for f, r in flags]
                continue
            k = MOE_HIDDEN[(i + j) % 2]
            cases += [(topk, experts, ranks, alignment, k, f, r) for f, r in flags]
    return cases


@pytest.mark.parametrize("topk,experts,ranks,alignment,hidden,fused_cast_back,round_sf", _moe_cases())
def test_per_channel_cast_fused_moe(topk, experts, ranks, alignment, hidden, fused_cast_back, round_sf, device):
    """As TileKernels' test: x is the expanded (fused) tensor and pos_to_token gathers its rows again."""
    num_experts = experts // ranks
    topk_idx = generate_topk_idx(SEND_TOKENS, topk, num_experts, ranks, device=device)
    _, pos_to_token, _, token_topk_to_pos = get_fused_mapping(topk_idx, num_experts, alignment)
    x = torch.randn(topk_idx.shape[0], hidden, device=device).bfloat16()
    x = expand(x, token_topk_to_pos, pos_to_token.numel())
    if fused_cast_back:
        x = _to_fp8(x)
    out, sf = _check(x, round_sf, 128 if fused_cast_back else None, pos_to_token)
    assert out.shape == (pos_to_token.numel(), hidden)


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("num_rows", [0, 16, 48, 144])
def test_per_channel_cast_fused_partial_blocks(num_rows, round_sf, device):
    """Mo % 128 != 0: the last 128-row block takes only the existing rows; -1 rows are zeros."""
    n = 40
    pos = torch.randint(-1, n, (num_rows,), device=device, dtype=torch.int32)
    x = torch.randn(n, 384, device=device)
    out, sf = _check(x, round_sf, None, pos)
    assert sf.shape == ((num_rows + 127) // 128, 384)
    assert bool((out.view(torch.uint8)[pos < 0] == 0).all())
    xq = _to_fp8(x)
    _check(xq, round_sf, 128, pos)


@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_per_channel_cast_fused_sf_layouts(layout, device):
    """Input sf in any layout: row-major, TMA-aligned column-major float32, packed UE8M0 (a tritile
    extension), with a gather."""
    flags = {"row": {}, "col": dict(use_tma_aligned_col_major_sf=True),
             "packed": dict(round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)}[layout]
    x = torch.randn(70, 640, device=device)
    xq = _to_fp8(x, **flags)
    pos = torch.randint(-1, 70, (160,), device=device, dtype=torch.int32)
    for round_sf in (False, True):
        _check(xq, round_sf, 128, pos)


def test_per_channel_cast_fused_strided_rows(device):
    big = torch.randn(256, 1024, device=device).bfloat16()
    x = big[:, :512]
    pos = torch.randint(-1, 256, (128,), device=device, dtype=torch.int32)
    for p in (None, pos):
        out, sf = per_channel_cast_fused(x, "e4m3", 128, pos_to_token=p)
        ref_out, ref_sf = per_channel_cast_fused(x.contiguous(), "e4m3", 128, pos_to_token=p)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)
    xq = _to_fp8(big)
    xq = (xq[0][:, :512], xq[1][:, :4])
    out, sf = per_channel_cast_fused(xq, "e4m3", 128, num_per_channels=128, pos_to_token=pos)
    ref_out, ref_sf = per_channel_cast_fused((xq[0].contiguous(), xq[1].contiguous()), "e4m3", 128,
                                             num_per_channels=128, pos_to_token=pos)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("config", [dict(BLOCK_K=128, ROWS_PER_STEP=32),
                                    dict(BLOCK_K=256, num_warps=4, ROWS_PER_STEP=16),
                                    dict(BLOCK_K=64, ROWS_PER_STEP=128), dict(BLOCK_K=128, ROWS_PER_STEP=128),
                                    dict(BLOCK_K=64, ROWS_PER_STEP=64)])
def test_per_channel_cast_fused_launch_configs(config, device):
    """The GPU's tile shapes under the interpreter too: one (BLOCK_K=128) or two (256) input-scale groups
    per tile, several column tiles, a partial last column tile (plain input, K=576, BLOCK_K=256 or 64),
    one pass over the 128-row block or two streamed passes in 16/32/64-row steps."""
    from tritile.quant.per_channel_cast_fused_kernel import _launch

    pos = torch.randint(-1, 50, (160,), device=device, dtype=torch.int32)
    x = torch.randn(50, 576, device=device).bfloat16()
    out, sf = _launch(x, None, False, pos, 160, True, config)
    ref_out, ref_sf = ref_fused(x, 128, None, True, pos)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    if config["BLOCK_K"] < 128:
        return
    x = torch.randn(50, 640, device=device)
    for flags in ({}, dict(round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)):
        data, sf_in = _to_fp8(x, **flags)
        out, sf = _launch(data, sf_in, sf_in.dtype == torch.int32, pos, 160, False, config)
        ref_out, ref_sf = ref_fused((data, sf_in), 128, 128, False, pos)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
@pytest.mark.parametrize("config", [{}] + _TUNE_CAST_BACK, ids=str)
def test_per_channel_cast_fused_cast_back_tune_candidates(config, device):
    """The default and every tune candidate of a QuantTensor input (``_TUNE_CAST_BACK``; the GPU default decodes with
    the hardware e4m3 conversion, HW_DECODE=False and the interpreter in software): the reference's bits, with
    NaN codes of both signs, zeros of both signs and the largest codes in the data, gathered with padding rows."""
    from tritile.quant.per_channel_cast_fused_kernel import _launch

    x = torch.randn(200, 384, device=device)
    pos = torch.randint(-1, 200, (256,), device=device, dtype=torch.int32)
    for flags in ({}, dict(round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)):
        data, sf_in = _to_fp8(x, **flags)
        codes = data.view(torch.uint8)
        codes[5, 7], codes[6, 130], codes[7, 300] = 0x7F, 0xFF, 0x80  # +NaN, -NaN, -0
        codes[8, :128], codes[9, 3] = 0x7E, 0xFE  # +-448
        pos[:10] = torch.arange(10, dtype=torch.int32)
        for rnd in (False, True):
            out, sf = _launch(data, sf_in, sf_in.dtype == torch.int32, pos, 256, rnd, config)
            ref_out, ref_sf = ref_fused((data, sf_in), 128, 128, rnd, pos)
            assert_equal(out, ref_out)
            assert_equal(sf, ref_sf)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
def test_per_channel_cast_fused_non_finite(device):
    x = torch.randn(50, 256, device=device)
    x[3, 10] = float("inf")
    x[4, 11] = -float("nan")
    pos = torch.full((256,), -1, device=device, dtype=torch.int32)
    pos[:50] = torch.arange(50, dtype=torch.int32)
    pos[200] = 3  # row 3 again in the second block
    out, sf = _check(x, False, None, pos)
    assert sf[0, 10] == float("inf") and sf[1, 10] == float("inf") and sf[0, 11] == float("inf")
    assert int(torch.isinf(sf).sum()) == 3
    codes = out.view(torch.uint8)
    assert codes[3, 10] == 0x7F and codes[200, 10] == 0x7F and codes[4, 11] == 0xFF
    assert bool(((codes[:50, 12] & 0x7F) != 0).any())  # other columns are untouched


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
@pytest.mark.parametrize("config", [dict(BLOCK_K=128, ROWS_PER_STEP=16, VEC=8, FINITE_BRANCH=True),
                                    dict(BLOCK_K=128, ROWS_PER_STEP=16, VEC=8, FINITE_BRANCH=False),
                                    dict(BLOCK_K=64, ROWS_PER_STEP=128, VEC=8, FINITE_BRANCH=True),
                                    dict(BLOCK_K=256, ROWS_PER_STEP=32, VEC=8, num_warps=8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_channel_cast_fused_vec_configs(config, dtype, device):
    """The GPU defaults (VEC=8, FINITE_BRANCH, 16-row steps) and their candidates under the interpreter,
    gathered, with non-finite blocks: bf16 takes the column max on the bf16 patterns (NaN and inf
    patterns clamp to inf), float32 the NaN-propagating float max."""
    from tritile.quant.per_channel_cast_fused_kernel import _launch

    x = torch.randn(50, 320, device=device)
    x[3, 10] = float("inf")
    x[4, 11] = -float("nan")
    x[7, 300] = -float("inf")
    x = x.to(dtype)
    pos = torch.randint(-1, 50, (256,), device=device, dtype=torch.int32)
    pos[:50] = torch.arange(50, dtype=torch.int32)
    for rnd in (False, True):
        out, sf = _launch(x, None, False, pos, 256, rnd, config)
        ref_out, ref_sf = ref_fused(x, 128, None, rnd, pos)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)
    assert sf[0, 10] == float("inf") and sf[0, 11] == float("inf") and sf[0, 300] == float("inf")
    # no map, plain rows
    xs = torch.randn(256, 192, device=device).to(dtype)
    out, sf = _launch(xs, None, False, None, 256, False, config)
    ref_out, ref_sf = ref_fused(xs, 128, None, False, None)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


def test_per_channel_cast_fused_out_of_range_map(device, monkeypatch):
    """Entries past N: rejected under TRITILE_CHECKS=1, otherwise read as padding rows (no OOB access)."""
    x = torch.randn(20, 256, device=device)
    pos = torch.randint(-1, 20, (32,), device=device, dtype=torch.int32)
    pos[5] = 20
    pos[9] = 1 << 30
    out, sf = per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos)
    fixed = torch.where(pos >= 20, -1, pos)
    ref_out, ref_sf = ref_fused(x, 128, None, False, fixed)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="pos_to_token entries"):
        per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos)
    pos[5], pos[9] = 0, -2
    with pytest.raises(ValueError, match="pos_to_token entries"):
        per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos)


def test_per_channel_cast_fused_bad_inputs(device):
    x = torch.randn(128, 256, device=device).bfloat16()
    xq = _to_fp8(x)
    pos = torch.zeros(32, dtype=torch.int32, device=device)
    f = per_channel_cast_fused
    assert_bad_inputs([
        (ValueError, "fmt", lambda: f(x, "e2m1", 128)),
        (ValueError, "num_per_tokens", lambda: f(x, "e4m3", 32)),
        (TypeError, "num_per_tokens", lambda: f(x, "e4m3", "128")),
        (TypeError, "round_sf", lambda: f(x, "e4m3", 128, round_sf=None)),
        (TypeError, "x must be bfloat16 or float32", lambda: f(x.half(), "e4m3", 128)),
        (ValueError, "x must be 2D", lambda: f(x.flatten(), "e4m3", 128)),
        (ValueError, "x must have a unit stride", lambda: f(torch.randn(256, 128, device=device).T, "e4m3", 128)),
        (ValueError, "multiple of 128 rows", lambda: f(x[:64], "e4m3", 128)),
        (ValueError, "num_per_channels", lambda: f(x, "e4m3", 128, num_per_channels=128)),
    ])
    # QuantTensor inputs
    assert_bad_inputs([
        (ValueError, "num_per_channels", lambda: f(xq, "e4m3", 128)),
        (ValueError, "num_per_channels", lambda: f(xq, "e4m3", 128, num_per_channels=64)),
        (ValueError, "pair", lambda: f((xq[0], xq[1], xq[1]), "e4m3", 128, num_per_channels=128)),
        (TypeError, r"x\[0\]", lambda: f((x, xq[1]), "e4m3", 128, num_per_channels=128)),
        (ValueError, r"x\[0\].*multiple of 128 columns",
         lambda: f((xq[0][:, :192], xq[1][:, :2]), "e4m3", 128, num_per_channels=128)),
        (TypeError, r"x\[1\]", lambda: f((xq[0], xq[1].bfloat16()), "e4m3", 128, num_per_channels=128)),
        (ValueError, r"x\[1\].*shape", lambda: f((xq[0], xq[1][:, :1]), "e4m3", 128, num_per_channels=128)),
        (ValueError, r"x\[1\].*shape", lambda: f((xq[0], xq[1][:64]), "e4m3", 128, num_per_channels=128)),
        (TypeError, r"x\[1\]", lambda: f((xq[0], None), "e4m3", 128, num_per_channels=128)),
    ])
    # pos_to_token
    assert_bad_inputs([
        (TypeError, "pos_to_token", lambda: f(x, "e4m3", 128, pos_to_token=pos.long())),
        (ValueError, "pos_to_token", lambda: f(x, "e4m3", 128, pos_to_token=pos.view(2, 16))),
        (ValueError, "pos_to_token.*multiple of 16", lambda: f(x, "e4m3", 128, pos_to_token=pos[:24])),
        (TypeError, "pos_to_token", lambda: f(x, "e4m3", 128, pos_to_token=pos.tolist())),
    ])


def test_per_channel_cast_fused_torch_compile(device):
    x = torch.randn(40, 256, device=device)
    xq = _to_fp8(x)
    pos = torch.randint(-1, 40, (128,), device=device, dtype=torch.int32)
    fn = torch.compile(lambda d, s, p: per_channel_cast_fused((d, s), "e4m3", 128, False, 128, p), backend="eager",
                       fullgraph=True)
    out, sf = fn(xq[0], xq[1], pos)
    ref_out, ref_sf = per_channel_cast_fused(xq, "e4m3", 128, False, 128, pos)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
