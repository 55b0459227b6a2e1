"""cast_back / per_token_cast_back: bitwise vs ``tritile.torch.cast_back``, plus calc_diff vs the original.

Per-token data comes from tritile's own ``per_token_cast`` (as TileKernels tests), block data from the
reference ``cast``.  Every sf layout (row-major, column-major, packed UE8M0) is read through its strides.
"""

import pytest
import torch

from tritile.quant import cast_back, per_token_cast, per_token_cast_back
from tritile.testing import assert_equal, calc_diff, generate_hidden_sizes, pick
from tritile.torch import cast
from tritile.torch import cast_back as cast_back_ref

from _cast_utils import _one_torch_thread  # noqa: F401 (autouse fixture)

CONFIGS = [(False, True, False), (True, True, True)]
CONFIG_IDS = ["rowmajor-round", "packed"]
M_VALUES = pick(cpu=[3, 130], gpu=[4001, 8001])
K_VALUES = generate_hidden_sizes(64)
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("out", ["fp32", "bf16"])
@pytest.mark.parametrize("npc", [128, "K"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_per_token_cast_back(m, k, fmt, cfg, npc, out, device):
    npc = k if npc == "K" else npc
    x = torch.randn(m, k, device=device).to(OUT_DTYPES[out])
    q = per_token_cast(x, fmt, npc, None, *cfg)
    back = per_token_cast_back(q, out, npc)
    assert back.dtype == OUT_DTYPES[out] and back.shape == (m, k) and back.is_contiguous()
    assert calc_diff(back, x) < (2e-2 if fmt == "e2m1" else 1e-3)
    assert_equal(back, cast_back_ref(q, out, (1, npc)))


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("block", [(128, 1), (128, 128)], ids=["b128x1", "b128"])
@pytest.mark.parametrize("out", ["fp32", "bf16"])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_block_cast_back(m, k, out, block, round_sf, device):
    x = torch.randn(m, k, device=device)
    q = cast(x, "e4m3", block, round_sf=round_sf)
    assert_equal(cast_back(q, out, block), cast_back_ref(q, out, block))


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_cast_back_layouts(fmt, device):
    """Blocks and layouts beyond TileKernels' grid: (32, 32) and (1, 32) scales in all three layouts,
    non-power-of-two float scales, a row-strided data view, FP4 data, and a partial last block."""
    m, k = pick(cpu=(33, 576), gpu=(4001, 7168))
    x = torch.randn(m, k, device=device) * 5
    for block in [(32, 32), (1, 32), (1, k)]:
        for col, rnd, packed in [(False, False, False), (True, False, False), (True, True, True)]:
            q = cast(x, fmt, block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
            for out in ("fp32", "bf16"):
                assert_equal(cast_back(q, out, block), cast_back_ref(q, out, block))
    data, sf = cast(x, fmt, (32, 32))
    base = torch.zeros(m, 2 * data.shape[1], dtype=data.dtype, device=device)
    base[:, : data.shape[1]] = data
    strided = base[:, : data.shape[1]]
    assert_equal(cast_back((strided, sf), "bf16", (32, 32)), cast_back_ref((data, sf), "bf16", (32, 32)))


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def _assert_equal_nan(x, y):
    """Bitwise except NaN payloads (which differ between backends): same NaN positions, other bits equal."""
    nan = x.isnan()
    assert bool((nan == y.isnan()).all())
    assert_equal(x.masked_fill(nan, 0), y.masked_fill(nan, 0))


def test_cast_back_special_values(device):
    """NaN codes, +inf scales (tritile's non-finite blocks) and UE8M0 byte 0 (decodes to 0.0)."""
    data = torch.tensor([[0x7F, 0xFF, 0x80, 0x01, 0x7E, 0xFE, 0x00, 0x38] * 8] * 2, dtype=torch.uint8, device=device)
    data = data.view(torch.float8_e4m3fn)
    sf = torch.tensor([[1.0, float("inf")], [2.0**-20, 3.0]], device=device)
    for out in ("fp32", "bf16"):
        got = cast_back((data, sf), out, (1, 32))
        _assert_equal_nan(got, cast_back_ref((data, sf), out, (1, 32)))
        assert not bool(got[0, 32:].isfinite().any())  # +inf scale: inf or NaN
    packed = torch.tensor([[0x00FF7F00], [0x00000080]], dtype=torch.int32, device=device)  # bytes 0, 127, 255
    packed = torch.empty_strided((2, 1), (1, 4), dtype=torch.int32, device=device).copy_(packed)
    d3 = torch.cat([data, data[:, :32]], dim=1)  # 96 columns: 3 groups of 32
    for out in ("fp32", "bf16"):
        got = cast_back((d3, packed), out, (1, 32))
        _assert_equal_nan(got, cast_back_ref((d3, packed), out, (1, 32)))
        assert not bool(got[0, 64:].isfinite().any())  # byte 0xFF: +inf scale
        finite = ~d3[0, :32].float().isnan()
        assert bool((got[0, :32][finite] == 0).all())  # byte 0: scale 0.0


def test_cast_back_e5m6_dispatch(device):
    """x_special_fmt='e5m6' goes to cast_back_e5m6 (also through per_token_cast_back)."""
    from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
    from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6

    x = torch.randn(5, 256, device=device)
    q = per_token_cast_to_e5m6(x, 256, False, True, False)
    ref = cast_back_e5m6(q, "fp32", (1, 256))
    assert_equal(cast_back(q, "fp32", (1, 256), "e5m6"), ref)
    assert_equal(per_token_cast_back(q, "fp32", 256, "e5m6"), ref)


def test_cast_back_zero_rows(device):
    for data in (torch.empty(0, 256, dtype=torch.float8_e4m3fn, device=device),
                 torch.empty(0, 128, dtype=torch.int8, device=device)):
        for out in ("fp32", "bf16"):
            got = per_token_cast_back((data, torch.empty(0, 2, device=device)), out, 128)
            assert got.shape == (0, 256) and got.dtype == OUT_DTYPES[out]


def test_cast_back_bad_input(device):
    x = torch.randn(4, 256, device=device)
    q = cast(x, "e4m3", (1, 128))
    with pytest.raises(ValueError, match="fmt"):
        cast_back(q, "fp16", (1, 128))
    with pytest.raises(ValueError, match="x_special_fmt"):
        cast_back(q, "bf16", (1, 128), "e4m3")
    with pytest.raises(TypeError, match="QuantTensor"):
        cast_back(x, "bf16", (1, 128))
    with pytest.raises(TypeError, match="data"):
        cast_back((x.half(), q[1]), "bf16", (1, 128))
    with pytest.raises(ValueError, match="data"):
        cast_back((q[0][None], q[1]), "bf16", (1, 128))
    with pytest.raises(TypeError, match="sf"):
        cast_back((q[0], q[1].bfloat16()), "bf16", (1, 128))
    with pytest.raises(ValueError, match="sf"):
        cast_back(q, "bf16", (1, 64))
    with pytest.raises(ValueError, match="sf"):
        cast_back((q[0], q[1][:, None]), "bf16", (1, 128))
    with pytest.raises(TypeError, match="x_block_size"):
        cast_back(q, "bf16", 128)
    with pytest.raises(ValueError, match="x_block_size"):
        cast_back(q, "bf16", (0, 128))
    with pytest.raises(ValueError, match="num_per_channels"):
        per_token_cast_back(q, "bf16", 0)
    with pytest.raises(TypeError, match="num_per_channels"):
        per_token_cast_back(q, "bf16", None)
    with pytest.raises(ValueError, match="x_block_size"):
        cast_back(q, "bf16", None)


def test_cast_back_torch_library(device):
    """``tritile::cast_back`` passes opcheck (test_schema skipped: it multiplies the fp8 inputs, which torch
    does not implement) and cast_back runs under torch.compile(fullgraph=True)."""
    from tritile.quant.cast_back_kernel import _cast_back_op

    x = torch.randn(33, 256, device=device)
    q = cast(x, "e4m3", (32, 32))
    torch.library.opcheck(_cast_back_op.op, (q[0], q[1], "bf16", 32, 32),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    q4 = cast(x, "e2m1", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    torch.library.opcheck(_cast_back_op.op, (q4[0], q4[1], "fp32", 1, 32))
    f = torch.compile(lambda d, s: cast_back((d, s), "bf16", (1, 32)), backend="eager", fullgraph=True)
    assert_equal(f(*q4), cast_back_ref(q4, "bf16", (1, 32)))


def test_cast_back_tune_candidates(device):
    """Every launch-config candidate of the benchmark sweep (and the software e4m3 decode, HW_DECODE=False)
    gives the reference bits; NaN codes and a non-finite scale included."""
    from tritile.bench.cases.quant import _CAST_BACK_TUNE
    from tritile.runtime import override_config

    m, k = pick(cpu=(5, 1024), gpu=(8001, 7168))
    x = torch.randn(m, k, device=device)
    x[1, 200] = float("inf")
    q = cast(x, "e4m3", (1, 128), round_sf=True)
    data = q[0].view(torch.uint8).clone()
    data[0, :4] = torch.tensor([0x7F, 0xFF, 0x80, 0x01], dtype=torch.uint8)
    q = (data.view(torch.float8_e4m3fn), q[1])
    for out in ("bf16", "fp32"):
        ref = cast_back_ref(q, out, (1, 128))
        # BLOCK_K=256 x 4 chunks: the unrolled PREFETCH loop with several iterations (the CPU's default tile is one
        # chunk), so that scripts/compile_check.sh compiles that loop for sm_90 as the GPU runs it
        for cand in [{}, dict(BLOCK_K=256, CHUNKS_PER_PROG=4)] + _CAST_BACK_TUNE:
            with override_config("cast_back", **cand):
                _assert_equal_nan(per_token_cast_back(q, out, 128), ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("k", [576, 1024])
def test_cast_back_row_block_candidate(fmt, k, device):
    """``ROW_BLOCK`` (one scale a row read through a chunk-wide scale block, the default) and the scale load per
    element (its tune candidate): the reference bits for per-row scales
    (npc = K, float32 and packed UE8M0), and unchanged ones where a row holds several blocks (npc = 128)."""
    from tritile.bench.cases.quant import _CAST_BACK_ROW_TUNE
    from tritile.runtime import override_config

    x = torch.randn(37, k, device=device)
    x[3, 5] = float("inf")
    for npc in (k, 128):
        for flags in ((False, False, False), (True, True, True)):
            q = per_token_cast(x, fmt, npc, None, *flags)
            for out in ("bf16", "fp32"):
                ref = cast_back_ref(q, out, (1, npc))
                for cand in [{}] + _CAST_BACK_ROW_TUNE:
                    with override_config("cast_back", **cand):
                        _assert_equal_nan(per_token_cast_back(q, out, npc), ref)
