"""per_token_cast_to_e5m6 vs the torch reference ``tritile.torch.cast_to_e5m6`` (bitwise)."""

import pytest
import torch

from tritile.testing.generator import generate_e5m6_inputs

from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
from tritile.quant.per_token_cast_to_e5m6_kernel import _per_token_cast_to_e5m6_launch, per_token_cast_to_e5m6
from tritile.testing import assert_equal, calc_diff, generate_hidden_sizes, generate_num_tokens
from tritile.runtime import override_config
from tritile.torch.cast_e5m6 import cast_back_from_e5m6, cast_to_e5m6

CONFIGS = [(False, True, False), (True, True, True)]  # (col_major, round_sf, packed), as TileKernels tests
EXTRA_CONFIGS = [(False, False, False), (True, False, False)]
HIDDEN = generate_hidden_sizes(cpu=(256, 576))
TOKENS = [t for t in generate_num_tokens(cpu=(1, 3, 130)) if t > 0]


def _check(x, k, flags):
    out, sf = per_token_cast_to_e5m6(x, k, *flags)
    ref_out, ref_sf = cast_to_e5m6(x, k, *flags)
    assert_equal(out, ref_out)
    # packed sf: the kernel writes whole words with zero unused bytes, so no clear_unused_sf is needed
    assert_equal(sf, ref_sf)
    return out, sf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("flags", CONFIGS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_per_token_cast_to_e5m6(num_tokens, hidden, flags, dtype, device):
    for name, x in generate_e5m6_inputs(num_tokens, hidden, dtype, device).items():
        out, sf = _check(x, hidden, flags)
        assert out.shape == (num_tokens, hidden * 3 // 2) and out.dtype == torch.uint8
        back = cast_back_from_e5m6((out, sf), "fp32", (1, hidden))
        if name == "randn":
            assert calc_diff(back, x) < 1e-4
        else:  # sf = 1 and every special value is an exact E5M6 code
            assert torch.equal(back, x.float()), name


@pytest.mark.parametrize("flags", EXTRA_CONFIGS)
def test_per_token_cast_to_e5m6_unrounded_sf(flags, device):
    """round_sf=False (not in TileKernels' grid): sf_inv is the second division 65024 / a."""
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(33, 576, device=device) * 3).to(dtype)
        _check(x, 576, flags)


@pytest.mark.parametrize("flags", CONFIGS + EXTRA_CONFIGS)
def test_per_token_cast_to_e5m6_zero_tokens(flags, device):
    x = torch.empty((0, 256), dtype=torch.bfloat16, device=device)
    out, sf = per_token_cast_to_e5m6(x, 256, *flags)
    assert out.shape == (0, 384) and out.dtype == torch.uint8
    assert sf.shape == (0, 1) and sf.dtype == (torch.int32 if flags[2] else torch.float32)


def test_per_token_cast_to_e5m6_strided_rows(device):
    big = torch.randn(33, 2 * 576 + 8, device=device, dtype=torch.bfloat16)
    x = big[:, 8:584]
    assert x.stride(0) == big.stride(0) and not x.is_contiguous()
    for flags in CONFIGS:
        out, sf = _check(x, 576, flags)
        out_c, sf_c = per_token_cast_to_e5m6(x.contiguous(), 576, *flags)
        assert_equal(out, out_c)
        assert_equal(sf, sf_c)


def test_per_token_cast_to_e5m6_chunked_rows(device):
    """Rows wider than one block take the two-pass path (forced here with a small block; K=576 leaves a
    partial last chunk)."""
    x = torch.randn(7, 576, device=device, dtype=torch.float32)
    for flags in CONFIGS + EXTRA_CONFIGS:
        out, sf = _per_token_cast_to_e5m6_launch(x, *flags, block_k=128)
        ref_out, ref_sf = cast_to_e5m6(x, 576, *flags)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)
    # a row too wide for one block without forcing (next power of two above the single-pass limit)
    k = 16392
    x = torch.randn(2, k, device=device, dtype=torch.bfloat16)
    _check(x, k, CONFIGS[1])



@pytest.mark.parametrize("block_q", [4, 8])
def test_per_token_cast_to_e5m6_quad_chunked(block_q, device):
    """The quad kernel (bf16, K % 32 == 0) with rows wider than one block: two passes (576 = 18 quads: a
    partial last chunk), non-finite rows included."""
    x = (torch.randn(9, 576, device=device) * 3).to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[2, 300] = float("-inf")
    x[3, 575] = float("inf")
    for flags in CONFIGS + EXTRA_CONFIGS:
        out, sf = _per_token_cast_to_e5m6_launch(x, *flags, block_q=block_q)
        ref_out, ref_sf = cast_to_e5m6(x, 576, *flags)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


def test_per_token_cast_to_e5m6_kernel_choice(device):
    """bf16 rows that the quad kernel cannot read as int32 words (odd row stride, K % 32 != 0) and the
    QUAD=False / BLOCK_Q overrides (tune candidates) give the same bits."""
    big = torch.randn(7, 2 * 577, device=device, dtype=torch.bfloat16)
    _check(big[:, 1:577].as_strided((7, 576), (577, 1)), 576, CONFIGS[0])  # odd row stride
    _check(torch.randn(5, 72, device=device, dtype=torch.bfloat16), 72, CONFIGS[1])  # 72 % 32 != 0
    x = torch.randn(6, 576, device=device, dtype=torch.bfloat16)
    x[2, 5] = float("nan")
    with override_config("per_token_cast_to_e5m6", QUAD=False):
        _check(x, 576, CONFIGS[0])
    with override_config("per_token_cast_to_e5m6", BLOCK_M=2, BLOCK_Q=8, num_warps=1):
        _check(x, 576, CONFIGS[1])
    # a launch-config key with no code behind it
    for key in ("HW_RTZ", "COAL_ST"):
        with override_config("per_token_cast_to_e5m6", **{key: False}), pytest.raises(ValueError, match=key):
            per_token_cast_to_e5m6(x, 576, *CONFIGS[0])

@pytest.mark.parametrize("cfg", [
    dict(QUAD=True),  # one pass, a quad per lane-quad (4 lanes x 16 bytes, the 4th masked)
    dict(BLOCK_Q=8, num_warps=1),  # two passes, a partial last chunk (18 quads)
    dict(BLOCK_M=2, BLOCK_Q=32, num_warps=2),  # two rows per program, a partial last row tile
])
def test_per_token_cast_to_e5m6_coalesced_stores(cfg, device):
    """The quad kernel's lane-contiguous 16-byte stores (through a layout conversion) at several tilings give the
    reference's bits, non-finite rows included."""
    x = (torch.randn(5, 576, device=device) * 3).to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[3, 575] = float("-inf")
    for flags in (CONFIGS[1], EXTRA_CONFIGS[0]):
        ref = _check(x, 576, flags)
        with override_config("per_token_cast_to_e5m6", **cfg):
            out, sf = per_token_cast_to_e5m6(x, 576, *flags)
        assert_equal(out, ref[0])
        assert_equal(sf, ref[1])


def _codes(out):
    """uint8 (M, K*3/2) -> int codes (M, K)."""
    b = out.cpu().to(torch.int64).reshape(out.shape[0], -1, 4)
    w = (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24).reshape(out.shape[0], -1, 3)
    w0, w1, w2 = w.unbind(-1)
    c = [w0 >> 20, (w0 >> 8) & 0xFFF, ((w0 & 0xFF) << 4) | (w1 >> 28), (w1 >> 16) & 0xFFF, (w1 >> 4) & 0xFFF,
         ((w1 & 0xF) << 8) | (w2 >> 24), (w2 >> 12) & 0xFFF, w2 & 0xFFF]
    return torch.stack(c, -1).reshape(out.shape[0], -1)


def test_per_token_cast_to_e5m6_hand_picked(device):
    """Row with last column 65024 (sf = 1, so x is encoded as is): ties, carries, signs, the fp16-subnormal
    quirk; codes checked against values worked out by hand."""
    cases = [
        (1.0, 0x3C0), (-1.0, 0xBC0), (0.0, 0x000), (-0.0, 0x800),
        (1.0 + 2.0**-7, 0x3C0),            # tie -> even (down)
        (1.0 + 3 * 2.0**-7, 0x3C2),        # tie -> even (up)
        (1.0 + 2.0**-7 + 2.0**-20, 0x3C1),  # just above the tie
        (2.0 - 2.0**-10, 0x400),           # carry into the exponent: 2.0
        (65024.0, 0x7BF), (-65024.0, 0xFBF),
        (2.0**-14, 0x040),                 # smallest fp16 normal
        (2.0**-20, 0x001),                 # smallest E5M6 subnormal
        (63 * 2.0**-20, 0x03F),            # largest E5M6 subnormal
        (-2.0**-26, 0x800),                # negative that rounds to zero
        (2.0**-21, 0x000),                 # half the smallest subnormal: truncated by the fp16 RZ step
        (1.75 * 2.0**-20, 0x001),          # quirk: true RNE would give 2; the float32 low bits are 0
        (2.0**-20 * (1 + 0x10001 * 2.0**-23), 0x002),  # quirk: ~1.008 steps rounds up on the float32 bits
    ]
    vals = torch.tensor([v for v, _ in cases] + [0.0] * (31 - len(cases)) + [65024.0], device=device)
    x = vals[None, :].repeat(3, 1)
    for dtype_flags in CONFIGS + EXTRA_CONFIGS:
        out, sf = _check(x, 32, dtype_flags)
        got = _codes(out)[0, : len(cases)]
        want = torch.tensor([c for _, c in cases])
        assert torch.equal(got, want), [(hex(a), hex(b)) for a, b in zip(got.tolist(), want.tolist()) if a != b]


def test_per_token_cast_to_e5m6_non_finite(device):
    """NaN counts as +inf in amax; such rows get sf = +inf (0xFF), finite codes +-0, non-finite codes NaN."""
    x = torch.randn(5, 64, device=device)
    x[0, 3] = float("inf")
    x[1, 10] = float("-inf")
    x[2, 63] = float("nan")
    for flags in CONFIGS + EXTRA_CONFIGS:
        out, sf = _check(x, 64, flags)
        back = cast_back_e5m6((out, sf), "fp32", (1, 64))
        assert torch.isnan(back[:3]).all()
        assert torch.isfinite(back[3:]).all()
        c = _codes(out)
        assert int(c[0, 3]) == 0x7E0 and int(c[1, 10]) == 0xFE0 and (int(c[2, 63]) & 0x7FF) == 0x7E0
        finite = torch.isfinite(x[:3]).cpu()
        assert ((c[:3] & 0x7FF)[finite] == 0).all()


def test_per_token_cast_to_e5m6_bad_inputs(device):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_per_channels"):
        per_token_cast_to_e5m6(x, 32)
    with pytest.raises(TypeError, match="num_per_channels"):
        per_token_cast_to_e5m6(x, 64.0)
    with pytest.raises(ValueError, match="divisible by 8"):
        per_token_cast_to_e5m6(torch.randn(4, 12, device=device), 12)
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        per_token_cast_to_e5m6(x.half(), 64)
    with pytest.raises(ValueError, match="x must be 2D"):
        per_token_cast_to_e5m6(x[0], 64)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        per_token_cast_to_e5m6(x.tolist(), 64)
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        per_token_cast_to_e5m6(x, 64, False, True, True)
    with pytest.raises(ValueError, match="round_sf"):
        per_token_cast_to_e5m6(x, 64, True, False, True)
    with pytest.raises(ValueError, match="x must have a unit stride"):
        per_token_cast_to_e5m6(torch.randn(64, 8, device=device).T, 64)


def _fast_path_edges(device):
    """bf16 (20, 96) rows (3 quads: a ragged, non-power-of-two quad count) for the INT_SF / PAIR_ENC / AMAX16
    candidates: random bit patterns (odd/even mantissas, so rounding ties both ways) at row scales from the clamp
    to 3e38 (sf_inv from 2^29 down to 2^-113, the pair path's ``sf_inv >= 1`` limit on both sides; the last
    random row's small values scale to float32 subnormals), zeros of both signs, bf16 subnormals, +-inf, NaN of
    both signs, values at the E5M6 overflow (65024 = 0x7BF) and at the fp16 normal / subnormal / zero boundaries
    (an sf = 1 row).  Rows pair up by kind, for BLOCK_M = 2 tiles."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for e_max, span in ((-20, 40), (-14, 40), (0, 40), (3, 40), (15, 40), (16, 40), (40, 40), (127, 40),
                        (127, 150)):  # per-row largest exponent, exponent span below it
        bits = torch.randint(0, 1 << 16, (96,), generator=g) & 0x807F  # sign, mantissa
        bits |= ((e_max + 127 - torch.randint(0, span, (96,), generator=g)).clamp(0, 254) << 7)
        rows.append(bits)
    rows[8][0] = 0x7F00  # 2^127: sf_inv = 2^-113
    rows[2][:8] = torch.tensor([0, 0x8000, 1, 0x8001, 0x7F, 0x807F, 0x40, 0x8041])  # zeros, bf16 subnormals
    rows[4][:4] = torch.tensor([0x477E, 0xC77E, 0x477F, 0x477D])  # 65024, -65024, 65280 (row amax), 64768
    edge = torch.zeros(96, dtype=torch.int64)
    edge[:18] = torch.tensor([0x3880, 0x387F, 0x3881, 0x3380, 0x3381, 0x3390, 0x33C1, 0x3300, 0x3400, 0x3401,
                              0xB381, 0x3600, 0x3680, 0x3681, 0x36FF, 0x0001, 0x8000, 0x8001])  # 2^-14 .. 2^-25
    edge[-1] = 0x477E  # sf = 1: encoded as is
    sub = torch.zeros(96, dtype=torch.int64)  # only zeros and bf16 subnormals: the clamp row
    sub[::3], sub[1::3] = 0x8003, 0x0041
    nonfinite = []
    for b, col in ((0x7F80, 5), (0xFF80, 90), (0x7FC0, 0), (0xFFC1, 95)):  # +inf, -inf, NaN, -NaN
        row = rows[3].clone()
        row[col] = b
        nonfinite.append(row)
    r = torch.stack(rows[:4] + [edge, sub, rows[4], rows[5], rows[6], rows[7], rows[8], torch.zeros_like(edge)]
                    + nonfinite + [rows[0] | 0x8000, rows[1], rows[8], rows[2]])
    return r.to(torch.int16).view(torch.bfloat16).to(device)


@pytest.mark.parametrize("cfg", [
    dict(INT_SF=True, PAIR_ENC=False, AMAX16=False), dict(AMAX16=True, INT_SF=False, PAIR_ENC=False),
    dict(PAIR_ENC=True, INT_SF=False, AMAX16=False, BLOCK_M=2),
    dict(INT_SF=True, PAIR_ENC=True, AMAX16=True, BLOCK_M=2, BLOCK_Q=2, num_warps=1),  # two passes
    dict(INT_SF=True, PAIR_ENC=True, AMAX16=True, BLOCK_M=4),
])
def test_per_token_cast_to_e5m6_fast_candidates(cfg, device):
    """The instruction cuts (INT_SF: division-free power-of-two scales; PAIR_ENC: the bf16-pair encoder for
    power-of-two sf_inv >= 1; AMAX16: 16x2 amax) give the default path's bits, every sf layout (round_sf=False
    ignores INT_SF / PAIR_ENC)."""
    x = _fast_path_edges(device)
    for flags in CONFIGS + EXTRA_CONFIGS[:1]:
        with override_config("per_token_cast_to_e5m6", INT_SF=False, PAIR_ENC=False, AMAX16=False):
            ref = per_token_cast_to_e5m6(x, 96, *flags)  # the plain path (the cuts are the GPU default)
        with override_config("per_token_cast_to_e5m6", **cfg):
            out, sf = per_token_cast_to_e5m6(x, 96, *flags)
        assert_equal(out, ref[0])
        assert_equal(sf, ref[1])
