"""swiglu_forward_and_per_channel_cast_and_transpose vs ``cast(swiglu_forward(x, c).bfloat16(), (npt, 1))``,
bitwise, codes transposed unless ``without_transpose`` (spec/quant.md §3.10).

GPU: TileKernels' grid (M in {4096, 8064}, 7 H, npt, without_transpose, round_sf, clamp).  CPU: the same
flags on (M, H) in {(128, 192), (256, 256)}: H = 192 leaves a partial column tile, M = 256 two row tiles.
"""

import pytest
import torch

from tritile.quant import swiglu_forward_and_per_channel_cast_and_transpose
from tritile.testing import assert_equal, pick
from tritile.torch import cast, swiglu_forward

try:
    from ._swiglu_utils import assert_codes_equal_nan_sign_free
except ImportError:
    from _swiglu_utils import assert_codes_equal_nan_sign_free

_SHAPES = pick(cpu=[(128, 192), (256, 256)],
               gpu=[(m, h) for m in (4096, 8064) for h in (576, 2048, 2560, 3072, 4096, 6144, 7168)])


def _ref(x, npt, rnd, without_transpose, clamp):
    act = swiglu_forward(x, swiglu_clamp_value=clamp).bfloat16()
    out, sf = cast(act, "e4m3", (npt, 1), round_sf=rnd)
    return (out if without_transpose else out.T.contiguous()), sf


@pytest.mark.parametrize("clamp", [None, 10.0, 0.5])
@pytest.mark.parametrize("rnd", [True, False])
@pytest.mark.parametrize("without_transpose", [True, False])
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("m,hidden", _SHAPES)
def test_swiglu_forward_and_per_channel_cast_and_transpose(device, m, hidden, npt, without_transpose, rnd, clamp):
    x = torch.randn((m, 2 * hidden), dtype=torch.bfloat16, device=device)
    out, sf = swiglu_forward_and_per_channel_cast_and_transpose(
        x, "e4m3", num_per_tokens=npt, round_sf=rnd, without_transpose=without_transpose, swiglu_clamp_value=clamp)
    ref_out, ref_sf = _ref(x, npt, rnd, without_transpose, clamp)
    assert_equal(sf, ref_sf)
    assert_equal(out, ref_out)


@pytest.mark.parametrize("without_transpose", [True, False])
def test_strided_rows_and_zero_rows(device, without_transpose):
    hidden = pick(cpu=192, gpu=7168)
    big = torch.randn((128, 2 * hidden + 64), dtype=torch.bfloat16, device=device)
    x = big[:, : 2 * hidden]
    out, sf = swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, True, without_transpose, 0.5)
    ref_out, ref_sf = _ref(x.contiguous(), 32, True, without_transpose, 0.5)
    assert_equal(sf, ref_sf)
    assert_equal(out, ref_out)
    x0 = torch.empty((0, 2 * hidden), dtype=torch.bfloat16, device=device)
    out, sf = swiglu_forward_and_per_channel_cast_and_transpose(x0, "e4m3", 128, False, without_transpose)
    ref_out, ref_sf = _ref(x0, 128, False, without_transpose, None)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    assert out.shape == ((0, hidden) if without_transpose else (hidden, 0))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
def test_non_finite(device):
    """A (npt x 1) block holding inf/NaN gets sf = +inf and NaN codes for its non-finite elements,
    +-0 for the others; other blocks are untouched."""
    hidden = 128
    x = torch.randn((128, 2 * hidden), dtype=torch.bfloat16, device=device)
    x[3, 5] = float("inf")           # act[3, 5] = +-inf
    x[40, hidden + 9] = float("nan")  # act[40, 9] = NaN
    out, sf = swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, without_transpose=True)
    ref_out, ref_sf = _ref(x, 32, False, True, None)
    assert_equal(sf, ref_sf)
    assert_codes_equal_nan_sign_free(out, ref_out)
    assert sf[0, 5].item() == float("inf") and sf[1, 9].item() == float("inf")
    assert int(torch.isinf(sf).sum()) == 2
    col = out[:32, 5].view(torch.uint8) & 0x7F
    assert bool(((col == 0) | (col == 0x7F)).all()) and int((col == 0x7F).sum()) == 1


def test_bad_inputs(device):
    x = torch.randn((128, 256), dtype=torch.bfloat16, device=device)
    f = swiglu_forward_and_per_channel_cast_and_transpose
    with pytest.raises(TypeError, match="x"):
        f(x.float(), "e4m3", 128)
    with pytest.raises(ValueError, match="x"):
        f(x[:100], "e4m3", 128)
    with pytest.raises(ValueError, match="x"):
        f(x[:, :192], "e4m3", 128)
    with pytest.raises(ValueError, match="x"):
        f(x[0], "e4m3", 128)
    with pytest.raises(ValueError, match="x"):
        f(torch.randn((256, 128), dtype=torch.bfloat16, device=device).T, "e4m3", 128)
    with pytest.raises(ValueError, match="fmt"):
        f(x, "e2m1", 128)
    with pytest.raises(ValueError, match="num_per_tokens"):
        f(x, "e4m3", 64)
    with pytest.raises(TypeError, match="num_per_tokens"):
        f(x, "e4m3", "128")
    with pytest.raises(TypeError, match="round_sf"):
        f(x, "e4m3", 128, round_sf=None)
    with pytest.raises(TypeError, match="without_transpose"):
        f(x, "e4m3", 128, without_transpose=1)
    with pytest.raises(ValueError, match="swiglu_clamp_value"):
        f(x, "e4m3", 128, swiglu_clamp_value=float("inf"))
