"""swiglu_forward_and_per_channel_cast_and_transpose vs ``cast(swiglu_forward(x, c).bfloat16(), (npt, 1))``,
bitwise, codes transposed unless ``without_transpose`` (spec/quant.md §3.10).

GPU: TileKernels' grid (M in {4096, 8064}, 7 H, npt, without_transpose, round_sf, clamp).  CPU: the same
flags on (M, H) in {(128, 192), (256, 256)}: H = 192 leaves a partial column tile, M = 256 two row tiles.
"""

import pytest
import torch
from _cast_utils import assert_bad_inputs

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
    assert_bad_inputs([
        (TypeError, "x", lambda: f(x.float(), "e4m3", 128)),
        (ValueError, "x", lambda: f(x[:100], "e4m3", 128)),
        (ValueError, "x", lambda: f(x[:, :192], "e4m3", 128)),
        (ValueError, "x", lambda: f(x[0], "e4m3", 128)),
        (ValueError, "x", lambda: f(torch.randn((256, 128), dtype=torch.bfloat16, device=device).T, "e4m3", 128)),
        (ValueError, "fmt", lambda: f(x, "e2m1", 128)),
        (ValueError, "num_per_tokens", lambda: f(x, "e4m3", 64)),
        (TypeError, "num_per_tokens", lambda: f(x, "e4m3", "128")),
        (TypeError, "round_sf", lambda: f(x, "e4m3", 128, round_sf=None)),
        (TypeError, "without_transpose", lambda: f(x, "e4m3", 128, without_transpose=1)),
        (ValueError, "swiglu_clamp_value", lambda: f(x, "e4m3", 128, swiglu_clamp_value=float("inf"))),
    ])


# ------------------------------------------------------------------------------------------------
# WORDS path (config key WORDS, a tuning candidate; _swiglu_channel_words_kernel): forced through
# override_config and checked bit for bit against the reference.  Under the interpreter the fused PTX
# and the packed max are replaced by their element forms; SCALE_BITS, HMUL_ENC (emulated bf16 product),
# NO_MASK, the word layout, the int16 code stores and the transposed byte stores run as on the GPU.
# ------------------------------------------------------------------------------------------------
from tritile.runtime import override_config  # noqa: E402

_OP = "swiglu_forward_and_per_channel_cast_and_transpose"
_WORDS_CFGS = [
    dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=1, FUSED_SILU=4, HMUL_ENC=True),  # even tiles (NO_MASK)
    dict(WORDS=True, BLOCK_K=128, VEC=8, num_warps=2, FUSED_SILU=4),                # H=192: masked tail
    dict(WORDS=True, BLOCK_K=32, VEC=4, num_warps=1, SCALE_BITS=False, PACKED_MAX=False, NO_MASK=False),
    dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=1, FUSED_SILU=4, KFAST=True),  # the column blocks first
]


def _words_call(x, cfg, npt, rnd, wt, clamp):
    with override_config(_OP, **cfg):
        return swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", npt, rnd, wt, clamp)


@pytest.mark.parametrize("cfg", _WORDS_CFGS, ids=["even-hmul", "masked", "plain", "kfast"])
@pytest.mark.parametrize("npt,without_transpose,rnd,clamp", [(32, True, True, None), (32, False, True, 0.5),
                                                             (128, True, False, 10.0), (128, False, False, None)])
def test_words_path(device, cfg, npt, without_transpose, rnd, clamp):
    m, hidden = pick(cpu=(128, 192), gpu=(4096, 7168))
    x = torch.randn((m, 2 * hidden), dtype=torch.bfloat16, device=device) * 4
    out, sf = _words_call(x, cfg, npt, rnd, without_transpose, clamp)
    ref_out, ref_sf = _ref(x, npt, rnd, without_transpose, clamp)
    assert_equal(sf, ref_sf)
    assert_equal(out, ref_out)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf * 0, exp overflow in the interpreter
@pytest.mark.parametrize("rnd", [True, False])
def test_words_all_bf16_gate_values(device, rnd):
    """Every bf16 pattern as l (NaN and +-inf blocks included), r = +-1 / +-1.5: the act, i.e. the
    fused silu of the GPU path, is checked exhaustively (it depends on l alone)."""
    m, hidden = 128, 512
    l = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(m, hidden)
    r = torch.tensor([1.0, -1.5], dtype=torch.bfloat16).repeat(m * hidden // 2).reshape(m, hidden)
    x = torch.cat([l, r], dim=1).to(device)
    out, sf = _words_call(x, dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=1, FUSED_SILU=4, HMUL_ENC=True), 32, rnd,
                          True, None)
    ref_out, ref_sf = _ref(x, 32, rnd, True, None)
    assert_equal(sf, ref_sf)
    assert_codes_equal_nan_sign_free(out, ref_out)
    fin = torch.isfinite(ref_sf).repeat_interleave(32, dim=0)  # blocks without inf/NaN: bitwise
    assert_equal(out.view(torch.uint8)[fin], ref_out.view(torch.uint8)[fin])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("without_transpose", [True, False])
def test_words_scales_and_non_finite(device, without_transpose):
    """Column scales over 2^-64 .. 2^63, all-zero columns (the 1e-4 clamp) and inf/NaN blocks."""
    m, hidden = 128, 128
    x = torch.randn((m, 2 * hidden), dtype=torch.bfloat16, device=device)
    k = torch.arange(hidden, device=device) - hidden // 2
    x[:, hidden:] *= torch.exp2(k.float()).to(torch.bfloat16)
    x[:, hidden + 3] = 0.0
    x[:, 7] = 0.0
    x[5, 11] = float("inf")
    x[40, hidden + 12] = float("nan")
    x[33, 13] = float("-inf")
    for rnd in (True, False):
        out, sf = _words_call(x, dict(WORDS=True, BLOCK_K=32, VEC=8, num_warps=1, HMUL_ENC=True), 32, rnd,
                              without_transpose, None)
        ref_out, ref_sf = _ref(x, 32, rnd, without_transpose, None)
        assert_equal(sf, ref_sf)
        assert_codes_equal_nan_sign_free(out, ref_out)


def test_words_strided_rows(device):
    hidden = pick(cpu=192, gpu=7168)
    big = torch.randn((128, 2 * hidden + 66), dtype=torch.bfloat16, device=device)
    for cut in (0, 1):  # even row stride: WORDS; odd offset (2-byte aligned only): element-kernel fallback
        x = big[:, cut: cut + 2 * hidden]
        out, sf = _words_call(x, dict(WORDS=True, BLOCK_K=64, VEC=8, num_warps=1), 32, True, True, 0.5)
        ref_out, ref_sf = _ref(x.contiguous(), 32, True, True, 0.5)
        assert_equal(sf, ref_sf)
        assert_equal(out, ref_out)


def test_pow2_scale_bits_formula():
    """_pow2_scale_bits (the WORDS path's SCALE_BITS) against quant_scale's round_sf rule on all 32768
    bf16 magnitude patterns (NaN patterns count as inf), in plain torch."""
    mm = torch.arange(0x8000, dtype=torch.int64)
    a = (torch.minimum(mm, torch.tensor(0x7F80)) << 16).to(torch.int32).view(torch.float32)
    sf = torch.clamp_min(a, 1e-4) / 448.0
    b = sf.view(torch.int32).to(torch.int64)
    e = torch.where(torch.isinf(sf), torch.tensor(128), ((b - 1) >> 23) + 1 - 127)
    ref_sf = torch.where(e >= 128, float("inf"), ((e + 127) << 23).to(torch.int32).view(torch.float32))
    ref_inv = torch.where(e >= 128, 0.0, ((127 - e).clamp_min(1) << 23).to(torch.int32).view(torch.float32))
    t = torch.clamp_min((mm - 993) >> 7, 105)
    t = torch.where(mm >= 0x7F80, torch.tensor(255), t)
    new_sf = (t << 23).to(torch.int32).view(torch.float32)
    new_inv = torch.clamp_min((254 - t) << 23, 0).to(torch.int32).view(torch.float32)
    assert torch.equal(new_sf.view(torch.int32), ref_sf.view(torch.int32))
    assert torch.equal(new_inv.view(torch.int32), ref_inv.view(torch.int32))
