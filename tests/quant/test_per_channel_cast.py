"""per_channel_cast vs the torch reference (bitwise): e4m3 codes with (128 x 1) scale blocks."""

import pytest
import torch
from _cast_utils import assert_bad_inputs

from tritile.quant import per_channel_cast
from tritile.testing import assert_equal, check_bias, generate_hidden_sizes, pick
from tritile.torch.per_channel_cast_fused import per_channel_cast_fused as ref_fused

TOKENS = pick(cpu=[0, 128, 256], gpu=[0, 4096, 8064])
HIDDEN = generate_hidden_sizes(64, cpu=(256, 576))
DTYPES = pick(cpu=[torch.bfloat16, torch.float32], gpu=[torch.bfloat16])


def _ref(x, round_sf):
    return ref_fused(x, 128, None, round_sf, None)


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_channel_cast(num_tokens, hidden, round_sf, dtype, device):
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    out, sf = per_channel_cast(x, "e4m3", 128, round_sf)
    ref_out, ref_sf = _ref(x, round_sf)
    assert out.shape == (num_tokens, hidden) and sf.shape == (num_tokens // 128, hidden)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    if num_tokens > 0:
        back = out.float() * sf.repeat_interleave(128, dim=0)
        check_bias(back, x.float())


def test_per_channel_cast_strided_rows(device):
    m, k = pick(cpu=(128, 576), gpu=(4096, 7168))
    big = torch.randn(m, 2 * k, device=device).bfloat16()
    x = big[:, :k]
    assert not x.is_contiguous()
    out, sf = per_channel_cast(x, "e4m3", 128)
    ref_out, ref_sf = per_channel_cast(x.contiguous(), "e4m3", 128)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_cast_hand_picked(round_sf, device):
    """Ties (17, 2.5, 168), the carry (31.4 -> 32), fp8 subnormals, -0.0 and negatives that round to 0,
    each in a column whose amax is 448 (scale 1)."""
    vals = torch.tensor([17.0, 2.5, 0.25, 31.4, -0.0, -1e-9, 0.00293, 0.00146, -0.0009765625, 3.0 * 2**-9,
                         168.0, -168.0, 7.87, 31.88, 440.0, -0.3, 0.0, 240.0, 232.0, 13.0, 19.0, 448.0])
    x = torch.randn(128, 64)
    x[0] = 448.0
    x[1:1 + vals.numel(), :] = vals[:, None]
    x[1:, 1::2] *= 0.5  # odd columns: amax still 448, values halved
    x = x.to(device)
    out, sf = per_channel_cast(x, "e4m3", 128, round_sf)
    ref_out, ref_sf = _ref(x, round_sf)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    assert bool((sf == 1.0).all())
    codes = out.view(torch.uint8)[1:1 + vals.numel(), 0].tolist()
    # 17 -> 16 (tie to even), 31.4 -> 32 (carry), -0.0 -> 0x80, -1e-9 -> 0x80, 168 -> 160, 440 -> 448
    assert codes[0] == 0x58 and codes[3] == 0x60 and codes[4] == 0x80 and codes[5] == 0x80
    assert codes[10] == 0x72 and codes[11] == 0xF2 and codes[14] == 0x7E


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_cast_non_finite(round_sf, device):
    """A (128 x 1) block holding +-inf or NaN gets sf = +inf; its finite elements encode as +-0 and its
    non-finite ones as 0x7F | sign; every other block is unaffected."""
    x = torch.randn(256, 128, device=device)
    x[5, 3] = float("inf")
    x[130, 7] = -float("inf")
    x[7, 9] = float("nan")
    x[200, 9] = -float("nan")  # -NaN in the other row block of column 9
    x[9, 3] = -x[9, 3].abs()
    out, sf = per_channel_cast(x, "e4m3", 128, round_sf)
    ref_out, ref_sf = _ref(x, round_sf)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    inf = float("inf")
    assert sf[0, 3] == inf and sf[1, 7] == inf and sf[0, 9] == inf and sf[1, 9] == inf
    finite = torch.isfinite(sf)
    assert int(finite.sum()) == sf.numel() - 4
    codes = out.view(torch.uint8)
    assert codes[5, 3] == 0x7F and codes[130, 7] == 0xFF and codes[7, 9] == 0x7F and codes[200, 9] == 0xFF
    assert codes[9, 3] == 0x80 and codes[4, 3] == (0x80 if x[4, 3] < 0 else 0x00)
    blk = codes[:128, 3].clone()
    blk[5] = 0
    assert bool(((blk & 0x7F) == 0).all())


def test_per_channel_cast_bad_inputs(device):
    x = torch.randn(128, 256, device=device).bfloat16()
    assert_bad_inputs([
        (ValueError, "fmt", lambda: per_channel_cast(x, "e2m1", 128)),
        (ValueError, "num_per_tokens", lambda: per_channel_cast(x, "e4m3", 32)),
        (TypeError, "num_per_tokens", lambda: per_channel_cast(x, "e4m3", 128.0)),
        (TypeError, "round_sf", lambda: per_channel_cast(x, "e4m3", 128, round_sf=1)),
        (TypeError, "x", lambda: per_channel_cast(x.half(), "e4m3", 128)),
        (TypeError, "x", lambda: per_channel_cast(x.float().cpu().numpy(), "e4m3", 128)),
        (ValueError, "x must be 2D", lambda: per_channel_cast(x[0], "e4m3", 128)),
        (ValueError, "multiple of 128 rows", lambda: per_channel_cast(x[:100], "e4m3", 128)),
        (ValueError, "multiple of 64 columns", lambda: per_channel_cast(x[:, :96], "e4m3", 128)),
        (ValueError, "x must have a unit stride",
         lambda: per_channel_cast(torch.randn(256, 128, device=device).bfloat16().T, "e4m3", 128)),
    ])
