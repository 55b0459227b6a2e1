"""cast_back_e5m6 vs the torch reference ``tritile.torch.cast_back_from_e5m6`` (bitwise)."""

import pytest
import torch

from tritile.testing.generator import generate_e5m6_inputs

from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
from tritile.testing import assert_equal, calc_diff, generate_hidden_sizes, generate_num_tokens
from tritile.torch.cast_e5m6 import _pack_codes, _sf_to_float, cast_back_from_e5m6, cast_to_e5m6
from tritile.utils import align, ceil_div

CONFIGS = [(False, True, False), (True, True, True)]
HIDDEN = generate_hidden_sizes(cpu=(256, 576))
TOKENS = [t for t in generate_num_tokens(cpu=(1, 130)) if t > 0]


@pytest.mark.parametrize("out_fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("flags", CONFIGS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_cast_back_e5m6(num_tokens, hidden, flags, dtype, out_fmt, device):
    for name, x in generate_e5m6_inputs(num_tokens, hidden, dtype, device).items():
        # data from the reference forward (the kernel's forward is tested bitwise against it)
        packed, sf = cast_to_e5m6(x, hidden, *flags)
        back = cast_back_e5m6((packed, sf), out_fmt, (1, hidden))
        ref = cast_back_from_e5m6((packed, sf), out_fmt, (1, hidden))
        assert_equal(back, ref)
        assert back.shape == (num_tokens, hidden)
        # TileKernels' tolerances: 1e-4 (random), 5e-6 (special)
        assert calc_diff(back, x) < (1e-4 if name == "randn" else 5e-6), name


def _nan_aware_equal(a, b):
    """Bitwise equal where not NaN; NaN at the same places (NaN payloads differ across backends)."""
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb)
    assert_equal(torch.where(na, torch.zeros_like(a), a), torch.where(nb, torch.zeros_like(b), b))


def _all_codes(device):
    """Every 12-bit code once (8 rows x 512 columns), packed."""
    return _pack_codes(torch.arange(4096, device=device, dtype=torch.int64).reshape(8, 512))


@pytest.mark.parametrize("out_fmt", ["bf16", "fp32"])
def test_cast_back_e5m6_all_codes_any_sf_layout(out_fmt, device):
    """All 4096 codes (zeros, subnormals, inf, NaN) with several block shapes and sf layouts."""
    data = _all_codes(device)
    m, k = 8, 512
    for bm, bk in ((1, 512), (1, 128), (2, 64), (8, 512), (3, 96)):
        ms, ks = ceil_div(m, bm), ceil_div(k, bk)
        sf = torch.rand(ms, ks, device=device) * 4 + 0.25
        col = torch.zeros(ks, align(ms, 4), device=device)[:, :ms].T
        col.copy_(sf)
        e = torch.randint(100, 150, (ms, ceil_div(ks, 4) * 4), device=device, dtype=torch.int64)
        e[:, ks:] = 0
        words = (e.reshape(ms, -1, 4) << torch.arange(0, 32, 8, device=device)).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        for s in (sf, col, words, words.T.contiguous().T):
            got = cast_back_e5m6((data, s), out_fmt, (bm, bk))
            ref = cast_back_from_e5m6((data, s), out_fmt, (bm, bk))
            _nan_aware_equal(got, ref)
            # independent decode of the finite codes: fp16 bits (code << 4) times the scale
    # fp16 check of every code with sf = 1
    ones = torch.ones(8, 1, device=device)
    got = cast_back_e5m6((data, ones), "fp32", (1, 512))
    h = (torch.arange(4096, device=device) << 4)
    want = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.float16).float().reshape(8, 512)
    _nan_aware_equal(got, want)


def test_cast_back_e5m6_packed_ue8m0_zero_byte(device):
    """UE8M0 byte 0 decodes to 0.0 (as TileKernels), byte 0xFF to +inf."""
    data = _all_codes(device)[:, :96]  # 8 x 64 codes
    words = torch.tensor([[0], [127], [0xFF], [128], [0], [1], [254], [126]], dtype=torch.int32, device=device)
    got = cast_back_e5m6((data, words), "fp32", (1, 64))
    ref = cast_back_from_e5m6((data, words), "fp32", (1, 64))
    _nan_aware_equal(got, ref)
    assert torch.equal(_sf_to_float(words, 1)[:, 0].cpu(), torch.tensor(
        [0.0, 1.0, float("inf"), 2.0, 0.0, 2.0**-126, 2.0**127, 0.5]))


def test_cast_back_e5m6_zero_tokens(device):
    data = torch.empty((0, 384), dtype=torch.uint8, device=device)
    for sf in (torch.empty((0, 1), device=device), torch.empty((0, 1), dtype=torch.int32, device=device)):
        for fmt, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            out = cast_back_e5m6((data, sf), fmt, (1, 256))
            assert out.shape == (0, 256) and out.dtype == dt


def test_cast_back_e5m6_strided_rows(device):
    x = torch.randn(33, 576, device=device)
    packed, sf = per_token_cast_to_e5m6(x, 576, True, True, True)
    big = torch.zeros(33, 864 + 12, dtype=torch.uint8, device=device)
    big[:, 4:868] = packed
    view = big[:, 4:868]
    assert not view.is_contiguous()
    assert_equal(cast_back_e5m6((view, sf), "bf16", (1, 576)), cast_back_e5m6((packed, sf), "bf16", (1, 576)))


def test_cast_back_e5m6_bad_inputs(device):
    x = torch.randn(4, 64, device=device)
    data, sf = per_token_cast_to_e5m6(x, 64)
    with pytest.raises(ValueError, match="fmt"):
        cast_back_e5m6((data, sf), "fp16", (1, 64))
    with pytest.raises(TypeError, match="data"):
        cast_back_e5m6((data.view(torch.int8), sf), "fp32", (1, 64))
    with pytest.raises(ValueError, match="data"):
        cast_back_e5m6((data[0], sf), "fp32", (1, 64))
    with pytest.raises(ValueError, match="multiple of 12"):
        cast_back_e5m6((data[:, :90], sf), "fp32", (1, 64))
    with pytest.raises(TypeError, match="sf"):
        cast_back_e5m6((data, sf.double()), "fp32", (1, 64))
    with pytest.raises(ValueError, match="sf"):
        cast_back_e5m6((data, sf[:3]), "fp32", (1, 64))
    with pytest.raises(ValueError, match="sf"):
        cast_back_e5m6((data, sf), "fp32", (1, 32))  # (4, 2) scales expected
    with pytest.raises(ValueError, match="x_block_size"):
        cast_back_e5m6((data, sf), "fp32", (0, 64))
    with pytest.raises(ValueError, match="x_block_size"):
        cast_back_e5m6((data, sf), "fp32", 64)
    with pytest.raises(TypeError, match="x must be a"):
        cast_back_e5m6(data, "fp32", (1, 64))
    big = torch.zeros(4, 98, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="4-byte"):
        cast_back_e5m6((big[:, 1:97], sf), "fp32", (1, 64))
