"""per_block_cast / _with_sf_only / _with_precomputed_sf: bitwise vs ``tritile.torch.cast`` ((bm, bk) blocks).

GPU: TileKernels' matrix (M in {4001, 8001}, 7 hidden sizes).  CPU: M in {0, 33, 161} (partial 32- and
128-row blocks), K in {256, 576} (partial 128-wide blocks), every dtype / fmt / block / sf-layout combination.
"""

import pytest
import torch
import triton
import triton.language as tl

from tritile.language.cast import f32_to_e2m1_code, f32_to_e2m1_code_finite
from tritile.quant import per_block_cast, per_block_cast_with_precomputed_sf, per_block_cast_with_sf_only
from tritile.quant.per_token_cast_kernel import _round_scale_bits
from tritile.testing import assert_equal, check_bias, generate_hidden_sizes, pick
from tritile.torch import cast, cast_back

from _cast_utils import _one_torch_thread, assert_sf_equal, hand_picked  # noqa: F401 (autouse fixture)

CONFIGS = [(False, True, False), (True, True, True)]
CONFIG_IDS = ["rowmajor-round", "packed"]
M_VALUES = pick(cpu=[33, 161], gpu=[4001, 8001])
K_VALUES = generate_hidden_sizes(64)


def _ref(x, fmt, bs, cfg):
    col, rnd, packed = cfg
    return cast(x, fmt, bs, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32)], ids=["b128", "b32"])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_per_block_cast(m, k, in_dtype, fmt, block, cfg, device):
    x = torch.randn(m, k, device=device).to(in_dtype)
    out, sf = per_block_cast(x, fmt, block, *cfg)
    ref_out, ref_sf = _ref(x, fmt, block, cfg)
    assert_equal(out, ref_out)
    assert_sf_equal(sf, ref_sf, k, block[1])
    check_bias(cast_back((out, sf), "fp32", block), x)
    assert_sf_equal(per_block_cast_with_sf_only(x, fmt, block, *cfg), ref_sf, k, block[1])
    if not cfg[0]:
        assert_equal(per_block_cast_with_precomputed_sf(x, fmt, block, sf), cast(x, fmt, block, sf=sf))


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 64)], ids=["b128", "b32", "b16x64"])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_block_cast_other_layouts(fmt, block, device):
    """The sf layouts TileKernels does not test (plain column-major, no rounding), a non-square block,
    non-power-of-two precomputed scales, and a row-strided input."""
    m, k = pick(cpu=(161, 576), gpu=(4001, 7168))
    base = torch.randn(m, 2 * k, device=device)
    x = base[:, :k]
    for cfg in [(False, False, False), (True, False, False)]:
        out, sf = per_block_cast(x, fmt, block, *cfg)
        ref_out, ref_sf = _ref(x, fmt, block, cfg)
        assert_equal(out, ref_out)
        assert_sf_equal(sf, ref_sf, k, block[1])
    sf = torch.rand(ref_sf.shape, device=device) + 0.01  # not powers of two: 1/sf rounds
    assert_equal(per_block_cast_with_precomputed_sf(x, fmt, block, sf), cast(x, fmt, block, sf=sf))


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_block_cast_gpu_tiling(fmt, cfg, device):
    """The GPU's tiling under the interpreter: several programs along K (4 blocks each, whole UE8M0 words),
    masked tail chunks past K."""
    from tritile.quant.per_token_cast_kernel import SF_QUANT, _launch_cast

    m, k = 40, 576  # 18 k-blocks of 32: programs of 4 chunks, the last one has 2 past K
    x = torch.randn(m, k, device=device)
    out, sf = _launch_cast(x, None, fmt, 32, 32, False, SF_QUANT, None, cfg[1], cfg[0], cfg[2], chunks_per_prog=4)
    ref_out, ref_sf = _ref(x, fmt, (32, 32), cfg)
    assert_equal(out, ref_out)
    assert_sf_equal(sf, ref_sf, k, 32)


def _check_sf_layouts(x, fmt):
    """per_block_cast of ``x`` with (32, 32) blocks in every sf layout (and the plain float32 one) against the
    reference, codes and sf bitwise."""
    for cfg in CONFIGS + [(False, False, False)]:
        out, sf = per_block_cast(x, fmt, (32, 32), *cfg)
        ref_out, ref_sf = _ref(x, fmt, (32, 32), cfg)
        assert_equal(out, ref_out)
        assert_sf_equal(sf, ref_sf, x.shape[1], 32)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_block_cast_hand_picked(fmt, device):
    mx = 448.0 if fmt == "e4m3" else 6.0
    x = hand_picked(32, 64, device, mx)
    _check_sf_layouts(x, fmt)
    out, sf = per_block_cast(x, fmt, (32, 32))
    assert bool((sf == 1.0).all())
    if fmt == "e4m3":
        assert [int(v) for v in out.view(torch.uint8)[0, :5]] == [0x58, 0x42, 0x28, 0x60, 0x80]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_block_cast_non_finite(fmt, device):
    """A block holding inf/NaN: sf = +inf (0xFF when packed), the block dequantizes to NaN; others unaffected."""
    x = torch.randn(40, 96, device=device)
    x[3, 40] = float("nan")
    x[35, 0] = float("-inf")
    _check_sf_layouts(x, fmt)
    out, sf = per_block_cast(x, fmt, (32, 32))
    assert sf[0, 1] == float("inf") and sf[1, 0] == float("inf") and int(torch.isinf(sf).sum()) == 2
    back = cast_back((out, sf), "fp32", (32, 32))
    assert bool(back[:32, 32:64].isnan().all()) and bool(back[:32, :32].isfinite().all())


@pytest.mark.parametrize("cfg", CONFIGS + [(False, False, False), (True, False, False)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_block_cast_zero_rows(fmt, cfg, device):
    x = torch.randn(0, 576, device=device)
    for block in [(128, 128), (32, 32)]:
        out, sf = per_block_cast(x, fmt, block, *cfg)
        ref_out, ref_sf = _ref(x, fmt, block, cfg)
        assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
        assert sf.shape == ref_sf.shape and sf.dtype == ref_sf.dtype
        assert per_block_cast_with_sf_only(x, fmt, block, *cfg).shape == ref_sf.shape


def test_per_block_cast_bad_input(device):
    x = torch.randn(64, 256, device=device)
    with pytest.raises(TypeError, match="x"):
        per_block_cast(x.half(), "e4m3", (32, 32))
    with pytest.raises(ValueError, match="x"):
        per_block_cast(x[None], "e4m3", (32, 32))
    with pytest.raises(TypeError, match="QuantTensor"):
        per_block_cast(cast(x, "e4m3", (32, 32)), "e4m3", (32, 32))
    with pytest.raises(ValueError, match="block_size"):
        per_block_cast(x, "e4m3", (32, 48))
    with pytest.raises(ValueError, match="block_size"):
        per_block_cast(x, "e4m3", (1, 32))
    with pytest.raises(TypeError, match="block_size"):
        per_block_cast(x, "e4m3", 32)
    with pytest.raises(ValueError, match="fmt"):
        per_block_cast(x, "e5m6", (32, 32))
    with pytest.raises(ValueError, match="K must be even"):
        per_block_cast(torch.randn(4, 33, device=device), "e2m1", (32, 32))
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        per_block_cast(x, "e4m3", (32, 32), False, True, True)
    with pytest.raises(ValueError, match="round_sf"):
        per_block_cast(x, "e4m3", (32, 32), True, False, True)
    with pytest.raises(ValueError, match="stride"):
        per_block_cast(x.T, "e4m3", (32, 32))
    with pytest.raises(ValueError, match="sf"):
        per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 4, device=device))
    with pytest.raises(TypeError, match="sf"):
        per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 8, device=device).double())
    with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
        per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 8, device=device), True)


@pytest.mark.parametrize("case", ["b128-e4m3-bf16", "b32-e2m1-fp32"])
def test_per_block_cast_tune_candidates(case, device):
    """Every launch-config candidate of the benchmark sweep, and the old code paths (FAST=False), give the
    reference bits, non-finite inputs included."""
    from tritile.bench.cases.quant import _PER_BLOCK_128_TUNE, _PER_BLOCK_32_TUNE
    from tritile.runtime import override_config

    if case.startswith("b128"):
        block, fmt, dtype, cfg, cands = (128, 128), "e4m3", torch.bfloat16, (False, True, False), _PER_BLOCK_128_TUNE
        m, k = pick(cpu=(130, 640), gpu=(8001, 7168))
    else:
        block, fmt, dtype, cfg, cands = (32, 32), "e2m1", torch.float32, (True, True, True), _PER_BLOCK_32_TUNE
        m, k = pick(cpu=(40, 576), gpu=(8001, 7168))
    x = torch.randn(m, k, device=device)
    x[0, 3], x[1, 200], x[33, 40], x[34, 41], x[35, 300] = float("nan"), float("inf"), float("-inf"), -0.0, -float("nan")
    x = x.to(dtype)
    ref_out, ref_sf = _ref(x, fmt, block, cfg)
    for cand in [{}] + cands:
        with override_config("per_block_cast", **cand):
            out, sf = per_block_cast(x, fmt, block, *cfg)
        assert_equal(out, ref_out)
        assert_sf_equal(sf, ref_sf, k, block[1])


def test_per_block_cast_bad_tune_config(device):
    from tritile.runtime import override_config

    x = torch.randn(64, 256, device=device)
    with override_config("per_block_cast", BLOCK_K=64):
        with pytest.raises(ValueError, match="BLOCK_K"):
            per_block_cast(x, "e4m3", (32, 32))
    with override_config("per_block_cast", CHUNKS_PER_PROG=3):  # packed UE8M0 words need 4 blocks
        with pytest.raises(ValueError, match="CHUNKS_PER_PROG"):
            per_block_cast(x, "e4m3", (32, 32), True, True, True)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_block_cast_pairs_and_finite(in_dtype, device):
    """The FP4 pair-tile path (PAIRS: x read as words of two elements) and the finite-chunk encode (FINITE),
    each on and off, against the reference: FP4 ties and saturation (hand-picked values times 2^k, so the
    scales vary), a non-finite block next to finite ones, an even row stride (pair words) and inputs the pair
    view cannot take (odd row stride, odd start: the plain path)."""
    from tritile.runtime import override_config

    x = hand_picked(64, 128, device, 6.0) * torch.tensor([1.0, 4.0, 2.0**-20, 3.0], device=device).repeat(32)
    x[40, 70] = float("nan")
    x[41, 100] = float("-inf")
    base = torch.randn(64, 2 * 128 + 2, device=device)
    base[:, :128] = x
    inputs = [x, base[:, :128], base[:, 1:129], torch.randn(64, 129, device=device)[:, :128]]
    for xin in inputs:
        xin = xin.to(in_dtype)
        for cfg in CONFIGS + [(False, False, False)]:
            ref_out, ref_sf = _ref(xin, "e2m1", (32, 32), cfg)
            for cand in [dict(PAIRS=True, FINITE=True), dict(PAIRS=True, FINITE=False),
                         dict(PAIRS=False, FINITE=True), dict(PAIRS=False, FINITE=False, FAST=False)]:
                with override_config("per_block_cast", **cand):
                    out, sf = per_block_cast(xin, "e2m1", (32, 32), *cfg)
                assert_equal(out, ref_out)
                assert_sf_equal(sf, ref_sf, 128, 32)



@triton.jit
def _e2m1_codes_kernel(x_ptr, ref_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(ref_ptr + offs, f32_to_e2m1_code(x), mask=m)
    tl.store(out_ptr + offs, f32_to_e2m1_code_finite(x), mask=m)


def test_f32_to_e2m1_code_finite(device):
    """``tritile.language.cast.f32_to_e2m1_code_finite`` (the FINITE encode) gives ``f32_to_e2m1_code``'s codes
    for non-NaN inputs: every FP4 tie and grid point +-16 ulps, both signs, zeros, denormals, +-inf, large and
    random values."""
    pts = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    bits = (pts.view(torch.int32)[:, None] + torch.arange(-16, 17, dtype=torch.int32)[None, :]).reshape(-1)
    special = torch.tensor([0.0, 1e-45, 1e-38, 1e-10, 3e38, float("inf"), 6.0000005, 5.9999995])
    x = torch.cat([bits.view(torch.float32), special, torch.randn(4096) * 3, torch.randn(1024) * 1e3])
    x = torch.cat([x, -x]).to(device)
    ref = torch.empty(x.numel(), dtype=torch.int32, device=device)
    out = torch.empty_like(ref)
    _e2m1_codes_kernel[(triton.cdiv(x.numel(), 1024),)](x, ref, out, x.numel(), BLOCK=1024)
    assert_equal(out, ref)


# Candidates behind tune-config keys (default off): WIDE (+ WIDE_VEC) and INT_SF.
_WIDE_CANDS = [
    dict(WIDE=True, CHUNKS_PER_PROG=4),
    dict(WIDE=True, WIDE_VEC=4, INT_SF=True, CHUNKS_PER_PROG=4),
    dict(WIDE=True, WIDE_VEC=8, INT_SF=True, CHUNKS_PER_PROG=4, FINITE=False),
    dict(WIDE=True, WIDE_VEC=4, INT_SF=True, CHUNKS_PER_PROG=8, num_warps=8),
    dict(WIDE=True, WIDE_VEC=2, CHUNKS_PER_PROG=2),
    dict(INT_SF=True, CHUNKS_PER_PROG=4),
    dict(INT_SF=True, PAIRS=False, CHUNKS_PER_PROG=4),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_block_cast_wide_and_int_sf(in_dtype, device):
    """WIDE (a program's CHUNKS_PER_PROG blocks as one pair tile: one load, one amax reduction, one store; WIDE_VEC
    caps the store's vector) and INT_SF (round_sf scales from the amax bits, no division) against the reference:
    FP4 ties and saturation at several scales, a non-finite block next to finite ones, partial row blocks,
    partial and fully masked k-blocks (K = 144: 4.5 blocks, so the second program of 4 holds half a block and
    three empty ones), an even row stride and inputs the pair view cannot take (the plain path), and every sf
    layout (INT_SF is ignored without round_sf)."""
    from tritile.runtime import override_config

    x = hand_picked(64, 128, device, 6.0) * torch.tensor([1.0, 4.0, 2.0**-20, 3.0], device=device).repeat(32)
    x[40, 70] = float("nan")
    x[41, 100] = float("-inf")
    base = torch.randn(64, 2 * 128 + 2, device=device) * 1e3
    base[:, :128] = x
    odd = torch.randn(40, 144, device=device) * torch.tensor([1e-30, 1.0, 1e30], device=device).repeat_interleave(48)
    odd[33, 140] = -float("nan")
    inputs = [x, base[:, 2:130], base[:, 1:129], odd, torch.randn(33, 64, device=device)]
    for xin in inputs:
        xin = xin.to(in_dtype)
        k = xin.shape[1]
        for cfg in CONFIGS + [(False, False, False)]:
            ref_out, ref_sf = _ref(xin, "e2m1", (32, 32), cfg)
            for cand in _WIDE_CANDS:
                if cfg[2] and cand["CHUNKS_PER_PROG"] % 4:
                    continue  # packed UE8M0 needs whole words per program
                with override_config("per_block_cast", **cand):
                    out, sf = per_block_cast(xin, "e2m1", (32, 32), *cfg)
                assert_equal(out, ref_out)
                assert_sf_equal(sf, ref_sf, k, 32)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_per_block_cast_int_sf_e4m3(device):
    """INT_SF on the e4m3 paths (MAX = 448, CLAMP = 1e-4), 32x32 and 128x128 blocks, non-finite blocks too."""
    from tritile.runtime import override_config

    x = torch.randn(40, 256, device=device) * torch.logspace(-12, 12, 256, device=device)
    x[3, 5], x[35, 200] = float("nan"), float("inf")
    x[:, 64:96] = 0.0  # amax 0: sf from the clamp
    for block in [(32, 32), (128, 128)]:
        for cfg in CONFIGS:
            ref_out, ref_sf = _ref(x, "e4m3", block, cfg)
            for cand in [dict(INT_SF=True), dict(INT_SF=True, FAST=False, FINITE=False)]:
                with override_config("per_block_cast", **cand):
                    out, sf = per_block_cast(x, "e4m3", block, *cfg)
                assert_equal(out, ref_out)
                assert_sf_equal(sf, ref_sf, 256, block[1])


@triton.jit
def _round_scale_bits_kernel(am_ptr, sf_ptr, inv_ptr, n, CLAMP: tl.constexpr, MAX: tl.constexpr,
                             BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    sf, inv = _round_scale_bits(tl.load(am_ptr + offs, mask=m, other=0), CLAMP, MAX)
    tl.store(sf_ptr + offs, sf.to(tl.int32, bitcast=True), mask=m)
    tl.store(inv_ptr + offs, inv.to(tl.int32, bitcast=True), mask=m)


def _round_sf_ref(am: torch.Tensor, mx: float, clamp: float):
    """The round_sf scale of ``tritile.torch.cast`` (``sf = 2^ceil(log2(RN(max(amax, clamp) / MAX)))``,
    ``sf_inv = 1 / sf``; +inf amax -> (+inf, 0)) as int32 bit patterns, amax given as bit patterns."""
    a = am.view(torch.float32).clamp_min(clamp)
    sf = torch.div(a, torch.full_like(a, mx))
    up = ((sf.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    sf = torch.where(sf == float("inf"), sf, up)
    inv = torch.where(sf == float("inf"), 0.0, torch.div(torch.ones_like(sf), sf))
    return sf.view(torch.int32), inv.view(torch.int32)


def _round_sf_int(am: torch.Tensor, mx: float, clamp: float):
    """``_round_scale_bits``'s integer formula in torch."""
    cb = torch.tensor([clamp], dtype=torch.float32).view(torch.int32).item()
    mb = torch.tensor([mx], dtype=torch.float32).view(torch.int32).item()
    e = ((torch.clamp_min(am, cb) + (0x3F800000 + 0x7FFFFF - mb)) >> 23) & 0xFF
    inf = am >= 0x7F800000
    return torch.where(inf, 0x7F800000, e << 23).int(), torch.where(inf, 0, (254 - e) << 23).int()


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_round_scale_bits(fmt, device):
    """``_round_scale_bits`` (INT_SF) gives the reference round_sf scales: in torch for every amax bit pattern
    0 .. 0x7F800000 (all non-negative floats and +inf; a few minutes per format on 2 cores, passed for both) with
    ``TRITILE_EXHAUSTIVE=1``, else for every 61st pattern; the Triton function itself on 2^20 patterns (every
    2041st, each power-of-two ``MAX * 2^k`` +-64 ulps, the clamp, 0, the largest float, +inf)."""
    import os

    from tritile.quant.common import FMT_CLAMP, FMT_MAX

    mx, clamp = FMT_MAX[fmt], torch.tensor(FMT_CLAMP[fmt], dtype=torch.float32).item()
    step = 1 if os.environ.get("TRITILE_EXHAUSTIVE") == "1" else 61
    n = 1 << 26
    for s in range(0, 0x7F800001, n * step):
        am = torch.arange(s, min(s + n * step, 0x7F800001), step, dtype=torch.int32)
        r, m = _round_sf_ref(am, mx, clamp), _round_sf_int(am, mx, clamp)
        assert torch.equal(r[0], m[0]) and torch.equal(r[1], m[1]), s
    mb = torch.tensor([mx], dtype=torch.float32).view(torch.int32).item()
    edges = (torch.arange(-127, 128, dtype=torch.int32)[:, None] * (1 << 23) + mb
             + torch.arange(-64, 65, dtype=torch.int32)[None, :]).reshape(-1)
    special = torch.tensor([0, 1, 0x7F7FFFFF, 0x7F800000], dtype=torch.int32)
    clampb = torch.tensor([clamp], dtype=torch.float32).view(torch.int32) + torch.arange(-3, 4, dtype=torch.int32)
    am = torch.cat([torch.arange(0, 0x7F800000, 2041, dtype=torch.int32), edges, special, clampb])
    am = am[(am >= 0) & (am <= 0x7F800000)].to(device)
    sf = torch.empty_like(am)
    inv = torch.empty_like(am)
    block = pick(cpu=65536, gpu=1024)
    _round_scale_bits_kernel[(triton.cdiv(am.numel(), block),)](am, sf, inv, am.numel(), CLAMP=FMT_CLAMP[fmt],
                                                                 MAX=mx, BLOCK=block)
    r = _round_sf_ref(am.cpu(), mx, clamp)
    assert_equal(sf.cpu(), r[0])
    assert_equal(inv.cpu(), r[1])


def _words_data(m: int, k: int, device) -> torch.Tensor:
    """bf16 ``(m, k)`` over every edge of the e4m3 encode, in 128-column bands of different magnitudes (so the block
    scales vary): zeros (a whole block of them, and +-0), +-inf and NaN of both signs (blocks with sf = +inf),
    bf16 denormals (alone in a block, and next to normal values: they encode as +-0 or the smallest codes), huge
    values (near the bf16 maximum) and values whose scaled magnitude rounds up to 448 (saturation by the
    division's rounding), random normals elsewhere."""
    x = torch.randn(m, k, device=device) * torch.logspace(-30, 30, k, device=device)
    x[:, : min(k, 128)] *= torch.tensor([1.0, 447.9, 448.0, 448.1, 1e-3, 3.0], device=device).repeat(22)[: min(k, 128)]
    x = x.to(torch.bfloat16)
    bits = x.view(torch.int16)
    r = min(m, 129)
    if k > 256:
        x[: r, 128:256] = 0.0  # amax 0: sf from the clamp
        x[1: r: 2, 128:256] = -0.0
        den = torch.randint(1, 0x80, (r, min(k, 384) - 256), dtype=torch.int16, device=device)
        den = den | (torch.randint(0, 2, den.shape, dtype=torch.int16, device=device) << 15)
        bits[: r, 256:384] = den  # a block of bf16 denormals only
    bits[2, 5] = 0x0001  # denormals next to normal values
    bits[3, 6] = -32767  # 0x8001
    bits[4, 7] = 0x7F7F  # the largest bf16
    x[0, 3], x[1, k - 1], x[m - 1, 0] = float("nan"), float("inf"), float("-inf")
    x[m - 1, k // 2] = -float("nan")
    return x


# WORDS variants the interpreter tells apart (num_warps / maxnreg only matter on the GPU)
_WORDS_CANDS = [dict(WORDS=True), dict(WORDS=True, INT_SF=True, CHUNKS_PER_PROG=1),
                dict(WORDS=True, INT_SF=True, PREFETCH=True, CHUNKS_PER_PROG=4)]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("shape", [(130, 640), (129, 577), (33, 200)], ids=["130x640", "129x577-odd", "33x200"])
def test_per_block_cast_words(shape, device):
    """WORDS (raw bf16 words until a per-four-element encode) with INT_SF / CHUNKS_PER_PROG 1, 2, 4 / PREFETCH gives
    the default path's codes and scales bit for bit in every sf layout (row- / column-major, round_sf on and off,
    packed UE8M0), 128x128 and 32x32 blocks, on ``_words_data`` (zeros, +-inf, NaN of both signs, denormals,
    saturation) with ragged M and K (odd K included) and from a row-strided view at an odd offset; so do the
    benchmark's WORDS candidates and FINITE=False / FAST=False (the plain path) in the anchor's layout; fp32 input and
    e2m1 output ignore the flag (the default path)."""
    from tritile.bench.cases.quant import _PER_BLOCK_128_TUNE
    from tritile.runtime import override_config

    m, k = shape
    x = _words_data(m, k, device)
    base = torch.zeros(m, k + 3, dtype=torch.bfloat16, device=device)
    base[:, 1: k + 1] = x
    anchor = (False, True, False)
    tune = [dict(WORDS=True, FINITE=False), dict(WORDS=True, FAST=False)]
    for c in _PER_BLOCK_128_TUNE:  # one of each variant the interpreter tells apart
        c = {"WORDS": True, **{key: v for key, v in c.items() if key not in ("num_warps", "maxnreg")}}
        if c["WORDS"] and c not in tune + _WORDS_CANDS:
            tune.append(c)
    layouts = [(False, False, False), (True, False, False), anchor, (True, True, False), (True, True, True)]
    for xin, block in [(x, (128, 128)), (base[:, 1: k + 1], (128, 128)), (x, (32, 32))]:
        for cfg in layouts if block == (128, 128) and xin is x else [anchor, (True, True, True)]:
            with override_config("per_block_cast", WORDS=False):  # the element path (WORDS is the GPU default)
                ref_out, ref_sf = per_block_cast(xin, "e4m3", block, *cfg)
            cands = _WORDS_CANDS + (tune if cfg == anchor and block == (128, 128) and xin is x else [])
            for cand in cands:
                if cfg[2] and cand.get("CHUNKS_PER_PROG", 4) % 4:
                    continue  # packed UE8M0 with 2D blocks: whole words per program
                with override_config("per_block_cast", **cand):
                    out, sf = per_block_cast(xin, "e4m3", block, *cfg)
                assert_equal(out, ref_out)
                assert_sf_equal(sf, ref_sf, k, block[1])
    cfg = (True, True, True)
    for xin, fmt in [(x.float(), "e4m3"), (x[:, : k - k % 2], "e2m1")]:
        ref_out, ref_sf = per_block_cast(xin, fmt, (128, 128), *cfg)
        with override_config("per_block_cast", WORDS=True):
            out, sf = per_block_cast(xin, fmt, (128, 128), *cfg)
        assert_equal(out, ref_out)
        assert_sf_equal(sf, ref_sf, xin.shape[1], 128)
