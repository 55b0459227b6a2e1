"""per_token_cast / _with_sf_only / _with_precomputed_sf: bitwise vs ``tritile.torch.cast`` (1 x npc blocks).

TileKernels' matrix on the GPU (M in {4001, 8001}, the 7 hidden sizes); on the CPU (interpreter) small
shapes that keep every edge: 0 rows, 3 rows, 130 rows (partial 128-row input blocks), K=576 (partial
128-wide group), every npc / fmt / dtype / sf-layout combination TileKernels tests.
"""

import pytest
import torch

from tritile.quant import per_token_cast, per_token_cast_with_precomputed_sf, per_token_cast_with_sf_only
from tritile.quant.per_token_cast_kernel import SF_QUANT, _launch_cast
from tritile.testing import assert_equal, check_bias, generate_hidden_sizes, pick
from tritile.torch import cast, cast_back

from _cast_utils import _one_torch_thread, assert_sf_equal, hand_picked  # noqa: F401 (autouse fixture)

CONFIGS = [(False, True, False), (True, True, True)]  # (col_major, round_sf, packed) as TileKernels tests
CONFIG_IDS = ["rowmajor-round", "packed"]
M_VALUES = pick(cpu=[3, 130], gpu=[4001, 8001])
K_VALUES = generate_hidden_sizes(64)


def _ref(x, fmt, npc, cfg, x_block_size=None):
    col, rnd, packed = cfg
    return cast(x, fmt, (1, npc), x_block_size=x_block_size, round_sf=rnd, use_tma_aligned_col_major_sf=col,
                use_packed_ue8m0=packed)


def _check(out, sf, ref_out, ref_sf, k, npc):
    assert_equal(out, ref_out)
    assert_sf_equal(sf, ref_sf, k, npc)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("npc", [32, 64, 128, "K"])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_per_token_cast(m, k, npc, in_dtype, fmt, cfg, device):
    npc = k if npc == "K" else npc
    x = torch.randn(m, k, device=device).to(in_dtype)
    out, sf = per_token_cast(x, fmt, npc, None, *cfg)
    ref_out, ref_sf = _ref(x, fmt, npc, cfg)
    _check(out, sf, ref_out, ref_sf, k, npc)
    check_bias(cast_back((out, sf), "fp32", (1, npc)), x)

    if npc != k:
        # sf-only mode: the same scales, nothing else written
        _check(out, per_token_cast_with_sf_only(x, fmt, npc, None, *cfg), ref_out, ref_sf, k, npc)
        if not cfg[0]:
            # precomputed (row-major, power-of-two) scales: encode(x * (1 / sf))
            got = per_token_cast_with_precomputed_sf(x, fmt, npc, sf)
            assert_equal(got, cast(x, fmt, (1, npc), sf=sf))
            assert_equal(got, ref_out)  # power-of-two scales: 1/sf is exact, so the codes match


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_token_cast_non_contiguous(in_dtype, fmt, device):
    m, k = pick(cpu=(33, 576), gpu=(4001, 7168))
    base = torch.randn(m, 2 * k, device=device).to(in_dtype)
    x = base[:, :k]
    assert not x.is_contiguous()
    for npc in (128, k):
        out, sf = per_token_cast(x, fmt, npc)
        ref_out, ref_sf = per_token_cast(x.contiguous(), fmt, npc)
        _check(out, sf, ref_out, ref_sf, k, npc)
        _check(out, sf, *_ref(x, fmt, npc, (False, False, False)), k, npc)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("x_block_size", [(128, 128), (32, 32)], ids=["xb128", "xb32"])
@pytest.mark.parametrize("npc", [32, 128])
@pytest.mark.parametrize("in_fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("m,k", pick(cpu=[(3, 256), (130, 576)], gpu=[(m, k) for m in M_VALUES for k in K_VALUES]))
def test_per_token_cast_quant_input(m, k, in_fmt, npc, x_block_size, fmt, cfg, device):
    """QuantTensor input, made by the reference cast with the same flags (as TileKernels does)."""
    col, rnd, packed = cfg
    x_ref = torch.randn(m, k, device=device).bfloat16()
    qx = cast(x_ref, in_fmt, x_block_size, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    out, sf = per_token_cast(qx, fmt, npc, x_block_size, *cfg)
    _check(out, sf, *_ref(qx, fmt, npc, cfg, x_block_size), k, npc)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_quant_input_non_pow2_sf(fmt, device):
    """§2.4: dequantize first (``f32(q * sf_in)``), then ``* sf_inv``; input scales not powers of two,
    column-major float sf; a strided e4m3 data view."""
    m, k = pick(cpu=(33, 576), gpu=(4001, 7168))
    x = torch.randn(m, k, device=device) * 3
    data, sf_in = cast(x, "e4m3", (32, 32), use_tma_aligned_col_major_sf=True)
    assert sf_in.stride(0) == 1
    base = torch.zeros(m, 2 * k, device=device, dtype=torch.float8_e4m3fn)
    base[:, :k] = data
    for d in (data, base[:, :k]):
        out, sf = per_token_cast((d, sf_in), fmt, 128, (32, 32))
        _check(out, sf, *cast((d, sf_in), fmt, (1, 128), x_block_size=(32, 32)), k, 128)


@pytest.mark.parametrize("cfg", CONFIGS + [(False, False, False), (True, False, False)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_zero_rows(fmt, cfg, device):
    k = 576
    x = torch.randn(0, k, device=device).bfloat16()
    for npc in (128, 576):
        out, sf = per_token_cast(x, fmt, npc, None, *cfg)
        ref_out, ref_sf = _ref(x, fmt, npc, cfg)
        assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
        assert sf.shape == ref_sf.shape and sf.dtype == ref_sf.dtype
        assert per_token_cast_with_sf_only(x, fmt, npc, None, *cfg).shape == ref_sf.shape
    assert per_token_cast_with_precomputed_sf(x, fmt, 128, torch.empty(0, 5, device=device)).shape == out.shape


@pytest.mark.parametrize("npc", [16, 32, 128])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_hand_picked(fmt, npc, device):
    """Ties (17, 2.5, 0.25), carry (31.4), fp8 subnormals, -0.0, negatives that round to 0, saturation;
    every group's max is the format's max, so the codes are those of the values themselves."""
    mx = 448.0 if fmt == "e4m3" else 6.0
    x = hand_picked(4, 256, device, mx)
    for cfg in CONFIGS + [(False, False, False)]:
        out, sf = per_token_cast(x, fmt, npc, None, *cfg)
        ref_out, ref_sf = _ref(x, fmt, npc, cfg)
        _check(out, sf, ref_out, ref_sf, 256, npc)
    # spot-check absolute codes (scale 1): 17 -> 16 (tie to even), 31.4 -> 32 (carry), -0.0 -> 0x80
    out, sf = per_token_cast(x, fmt, npc, None, False, True, False)
    assert bool((sf == 1.0).all())
    if fmt == "e4m3":
        b = out.view(torch.uint8)[0]
        assert [int(v) for v in b[:5]] == [0x58, 0x42, 0x28, 0x60, 0x80]
        assert int(b[5]) == 0x80 and int(b[6]) == 0x02 and int(b[8]) == 0x80  # -1e-9, 2^-9*1.5 -> 2^-8, -2^-10
    else:
        b = out.view(torch.uint8)[0]
        # (0.25->0, 2.5->2), (0.75->1, 1.25->1), (1.75->2, 3.5->4), (5->4, -0.0)
        assert [int(v) for v in b[:4]] == [0x40, 0x22, 0x64, 0x86]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_non_finite(fmt, round_sf, device):
    """tritile's rule: a group holding inf/NaN gets sf = +inf (byte 0xFF), its finite elements encode as
    +-0 and the non-finite ones as NaN (e4m3 0x7F|sign; e2m1 +-0); other groups are unaffected."""
    x = torch.randn(3, 128, device=device)
    x[0, 5] = float("inf")
    x[1, 70] = float("nan")
    x[2, 0] = float("-inf")
    x[2, 1] = -1.0
    cfgs = [(False, round_sf, False)] + ([(True, True, True)] if round_sf else [])
    for cfg in cfgs:
        out, sf = per_token_cast(x, fmt, 64, None, *cfg)
        _check(out, sf, *_ref(x, fmt, 64, cfg), 128, 64)
    out, sf = per_token_cast(x, fmt, 64, None, False, round_sf, False)
    assert sf[0, 0] == float("inf") and sf[1, 1] == float("inf") and sf[2, 0] == float("inf")
    assert torch.isfinite(sf[0, 1]) and torch.isfinite(sf[1, 0])
    back = cast_back((out, sf), "fp32", (1, 64))
    assert bool(back[0, :64].isnan().all()) and bool(back[0, 64:].isfinite().all())
    if fmt == "e4m3":
        b = out.view(torch.uint8)
        assert int(b[0, 5]) == 0x7F and int(b[2, 0]) == 0xFF and int(b[2, 1]) == 0x80 and int(b[1, 70]) in (0x7F, 0xFF)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_row_group_multi_chunk(fmt, device):
    """npc == K wider than one tile: amax is reduced across chunks (forced small tiles)."""
    m, k = 5, 576
    x = torch.randn(m, k, device=device).bfloat16()
    for cfg in CONFIGS:
        out, sf = _launch_cast(x, None, fmt, 1, k, True, SF_QUANT, None, cfg[1], cfg[0], cfg[2], block_m=2,
                               block_k=128)
        _check(out, sf, *_ref(x, fmt, k, cfg), k, k)


def test_per_token_cast_e5m6_dispatch(device):
    """fmt='e5m6' goes to per_token_cast_to_e5m6 (same arguments, same result)."""
    from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6

    x = torch.randn(5, 256, device=device).bfloat16()
    for cfg in CONFIGS:
        out, sf = per_token_cast(x, "e5m6", 256, None, *cfg)
        ref_out, ref_sf = per_token_cast_to_e5m6(x, 256, *cfg)
        assert_equal(out, ref_out)
        assert_sf_equal(sf, ref_sf, 256, 256)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_gpu_tiling(fmt, cfg, device):
    """The GPU's tiling under the interpreter: 2-row tiles, several programs along K, masked tail chunks."""
    m, k, npc = 5, 576, 32
    x = torch.randn(m, k, device=device).bfloat16()
    out, sf = _launch_cast(x, None, fmt, 1, npc, False, SF_QUANT, None, cfg[1], cfg[0], cfg[2], block_m=2,
                           block_k=128, chunks_per_prog=3)
    _check(out, sf, *_ref(x, fmt, npc, cfg), k, npc)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_per_token_cast_bad_input(device):
    x = torch.randn(4, 256, device=device).bfloat16()
    with pytest.raises(TypeError, match="x"):
        per_token_cast(x.half(), "e4m3", 128)
    with pytest.raises(ValueError, match="x"):
        per_token_cast(x[0], "e4m3", 128)
    with pytest.raises(ValueError, match="num_per_channels"):
        per_token_cast(x, "e4m3", 96)
    with pytest.raises(ValueError, match="num_per_channels"):
        per_token_cast(torch.randn(4, 96, device=device), "e4m3", 96)  # npc == K needs K % 64 == 0
    with pytest.raises(TypeError, match="num_per_channels"):
        per_token_cast(x, "e4m3", 128.0)
    with pytest.raises(ValueError, match="fmt"):
        per_token_cast(x, "e5m2", 128)
    with pytest.raises(ValueError, match="K must be even"):
        per_token_cast(torch.randn(4, 64 + 17, device=device), "e2m1", 16)
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        per_token_cast(x, "e4m3", 128, None, False, True, True)
    with pytest.raises(ValueError, match="round_sf"):
        per_token_cast(x, "e4m3", 128, None, True, False, True)
    with pytest.raises(ValueError, match="x_block_size"):
        per_token_cast(x, "e4m3", 128, (32, 32))
    with pytest.raises(ValueError, match="stride"):
        per_token_cast(torch.randn(256, 4, device=device).bfloat16().T, "e4m3", 128)
    with pytest.raises(ValueError, match="x_block_size"):
        per_token_cast(x, "e5m6", 256, (32, 32))
    with pytest.raises(TypeError, match="x"):
        per_token_cast("not a tensor", "e4m3", 128)


def test_per_token_cast_bad_quant_input(device):
    x = torch.randn(4, 256, device=device)
    q = cast(x, "e4m3", (32, 32))
    with pytest.raises(ValueError, match="x_block_size"):
        per_token_cast(q, "e4m3", 128)
    with pytest.raises(TypeError, match="data"):
        per_token_cast((x.bfloat16(), q[1]), "e4m3", 128, (32, 32))
    with pytest.raises(TypeError, match="sf"):
        per_token_cast((q[0], q[1].double()), "e4m3", 128, (32, 32))
    with pytest.raises(ValueError, match="sf"):
        per_token_cast((q[0], q[1][:, :4]), "e4m3", 128, (32, 32))
    with pytest.raises(ValueError, match="sf"):
        per_token_cast((q[0], q[1]), "e4m3", 128, (1, 32))
    with pytest.raises(TypeError, match="x_block_size"):
        per_token_cast(q, "e4m3", 128, 32)
    with pytest.raises(TypeError, match="QuantTensor"):
        per_token_cast_with_precomputed_sf(q, "e4m3", 128, torch.ones(4, 2, device=device))


def test_per_token_cast_precomputed_bad_input(device):
    x = torch.randn(4, 256, device=device)
    sf = torch.ones(4, 2, device=device)
    with pytest.raises(ValueError, match="sf"):
        per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.ones(4, 3, device=device))
    with pytest.raises(TypeError, match="sf"):
        per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf.int())
    with pytest.raises(ValueError, match="stride"):
        per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.ones(2, 4, device=device).T)
    with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
        per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf, None, True)
    with pytest.raises(ValueError, match="x_block_size"):
        per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf, (32, 32))
    with pytest.raises(ValueError, match="fmt"):
        per_token_cast_with_sf_only(x, "e5m6", 256)


def test_per_token_cast_torch_library(device):
    """``tritile::block_cast`` passes opcheck and per_token_cast runs under torch.compile(fullgraph=True)."""
    from tritile.quant.per_token_cast_kernel import _block_cast_op

    x = torch.randn(33, 256, device=device).bfloat16()
    for fmt, bm, bk, row_group, mode, cfg in [("e4m3", 1, 128, False, 0, (True, True, True)),
                                              ("e2m1", 32, 32, False, 0, (True, False, False)),
                                              ("e4m3", 1, 256, True, 0, (False, True, False)),
                                              ("e2m1", 1, 32, False, 1, (True, True, True))]:
        args = (x, None, None, fmt, 1, 1, bm, bk, row_group, mode, cfg[1], cfg[0], cfg[2])
        torch.library.opcheck(_block_cast_op.op, args)
    f = torch.compile(lambda x: per_token_cast(x, "e4m3", 128, None, True, True, True), backend="eager",
                      fullgraph=True)
    out, sf = f(x)
    _check(out, sf, *_ref(x, "e4m3", 128, CONFIGS[1]), 256, 128)
    q = cast(x, "e4m3", (32, 32))
    g = torch.compile(lambda d, s: per_token_cast((d, s), "e2m1", 32, (32, 32)), backend="eager", fullgraph=True)
    _check(*g(*q), *cast(q, "e2m1", (1, 32), x_block_size=(32, 32)), 256, 32)


def _with_specials(x):
    """Put NaN, +-inf and -0.0 into a few rows (blocks with non-finite values, a signed zero)."""
    x = x.clone()
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    if x.shape[0] > 2:
        x[2, 7] = float("-inf")
        x[2, 8] = -0.0
        x[2, 9] = -float("nan")
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_token_cast_tune_candidates(fmt, in_dtype, device):
    """Every launch-config candidate of the benchmark sweep (``python -m tritile tune``), and the old code
    paths (FAST=False), give the reference bits, non-finite inputs included."""
    from tritile.bench.cases.quant import _PER_TOKEN_E2M1_PLAIN_TUNE, _PER_TOKEN_TUNE
    from tritile.runtime import override_config

    m, k, cfg = 5, pick(cpu=1024, gpu=7168), CONFIGS[1]
    x = _with_specials(torch.randn(m, k, device=device)).to(in_dtype)
    ref = _ref(x, fmt, 128, cfg)
    for cand in [{}] + _PER_TOKEN_TUNE + (_PER_TOKEN_E2M1_PLAIN_TUNE if fmt == "e2m1" else []):
        with override_config("per_token_cast", **cand):
            out, sf = per_token_cast(x, fmt, 128, None, *cfg)
        _check(out, sf, *ref, k, 128)
    q = cast(x.float(), fmt, (32, 32), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    ref = cast(q, fmt, (1, 128), x_block_size=(32, 32), round_sf=True, use_tma_aligned_col_major_sf=True,
               use_packed_ue8m0=True)
    for cand in [{}, dict(FAST=False), dict(BLOCK_M=1, BLOCK_K=512, num_warps=1)]:
        with override_config("per_token_cast", **cand):
            _check(*per_token_cast(q, fmt, 128, (32, 32), *cfg), *ref, k, 128)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_fp8_input_tune_candidates(fmt, device):
    """The FP8-input candidates (HW_DECODE: the hardware e4m3 decode; taller tiles) give the reference bits, NaN
    codes (0x7F, 0xFF) in the input included."""
    from tritile.bench.cases.quant import _PER_TOKEN_FP8_IN_TUNE
    from tritile.runtime import override_config

    m, k, cfg = 6, pick(cpu=512, gpu=7168), CONFIGS[1]
    q = cast(torch.randn(m, k, device=device).bfloat16(), "e4m3", (128, 128), round_sf=True,
             use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    data = q[0].view(torch.uint8)
    data[1, 3], data[4, 200], data[5, 0] = 0x7F, 0xFF, 0x80  # NaN, -NaN, -0
    ref = cast(q, fmt, (1, 128), x_block_size=(128, 128), round_sf=True, use_tma_aligned_col_major_sf=True,
               use_packed_ue8m0=True)
    for cand in [{}] + _PER_TOKEN_FP8_IN_TUNE:
        with override_config("per_token_cast", **cand):
            _check(*per_token_cast(q, fmt, 128, (128, 128), *cfg), *ref, k, 128)


def test_per_token_cast_bad_tune_config(device):
    from tritile.runtime import override_config

    x = torch.randn(4, 1024, device=device).bfloat16()
    with override_config("per_token_cast", BLOCK_K=256):  # 2 groups of 128: not whole UE8M0 words
        with pytest.raises(ValueError, match="BLOCK_K"):
            per_token_cast(x, "e4m3", 128, None, True, True, True)
    with override_config("per_token_cast", BLOCK_K=64):
        with pytest.raises(ValueError, match="BLOCK_K"):
            per_token_cast(x, "e4m3", 128)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", pick(cpu=[3], gpu=[3, 4001]))
def test_per_token_cast_row_group_small_k(m, in_dtype, fmt, device):
    """npc == K for rows of 64 to 320 columns: one tile a row, from one element a thread to four (the GPU's
    256-column tile once had two a thread, which ptxas miscompiled: every other e4m3 code wrong)."""
    for k in (64, 128, 192, 256, 320):
        x = torch.randn(m, k, device=device).to(in_dtype)
        for cfg in CONFIGS + [(False, False, False)]:
            out, sf = per_token_cast(x, fmt, k, None, *cfg)
            _check(out, sf, *_ref(x, fmt, k, cfg), k, k)



@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("m", pick(cpu=[3], gpu=[3, 4001]))
def test_per_token_cast_token_block_input_small_k(m, fmt, device):
    """QuantTensor inputs with (1, 128) FP8 and (1, 32) FP4 token blocks (what the MoE layer re-casts) at 128 to 512
    columns: a 128-column FP8 input on the GPU's 2-warp tile once put two elements on a thread, which ptxas
    miscompiled (every other e4m3 code wrong)."""
    for k in (128, 256, 512):
        x = torch.randn(m, k, device=device).bfloat16()
        for src, xb in (("e4m3", 128), ("e2m1", 32)):
            qx = cast(x, src, (1, xb))
            for npc in sorted({128, k}):
                for cfg in CONFIGS:
                    if cfg[0] and npc != 128:
                        continue
                    out, sf = per_token_cast(qx, fmt, npc, (1, xb), *cfg)
                    _check(out, sf, *_ref(qx, fmt, npc, cfg, (1, xb)), k, npc)
