"""per_block_cast_lossless: the round trip is exact (TileKernels' check), and codes and scales follow the
exponent rule bit for bit (a torch model of the rule below)."""

import pytest
import torch

from tritile.quant.common import unpack_from_e2m1fn_x2
from tritile.quant.per_block_cast_lossless_kernel import per_block_cast_lossless
from tritile.testing import assert_equal, generate_hidden_sizes, generate_num_tokens, generate_rand_float
from tritile.torch.cast import cast, cast_back
from tritile.utils import align, ceil_div

CONFIGS = [(False, True, False), (True, True, True)]  # (col_major, round_sf, packed)
OUT_BLOCKS = [(1, 128), (32, 32), (128, 128)]
HIDDEN = generate_hidden_sizes(cpu=(256, 576))
TOKENS = [t for t in generate_num_tokens(cpu=(1, 33, 161)) if t > 0]


def _clamp_abs_ratio(t, max_ratio=2.0**9):
    """|t| >= max|t| / 2^9, as TileKernels' test builds its inputs (keeps the cast lossless)."""
    if t.numel() == 0:
        return t
    floor = t.abs().max() / max_ratio
    return torch.sign(t) * torch.maximum(t.abs(), floor)


def _fp4_input(m, k, in_flags, device, in_block=(1, 32)):
    x = _clamp_abs_ratio(generate_rand_float((m, k), device=device))
    col, rnd, packed = in_flags
    return cast(x, "e2m1", in_block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)


def _exponents(sf, ms, ks):
    if sf.dtype == torch.int32:
        w = sf.to(torch.int64) & 0xFFFFFFFF
        e = (w.unsqueeze(-1) >> torch.arange(0, 32, 8, device=sf.device)) & 0xFF
        return e.reshape(ms, -1)[:, :ks]
    return (sf.view(torch.int32).to(torch.int64) >> 23) & 0xFF


def _model(x, in_block, out_block, col, packed):
    """The exponent rule in torch: E = max e_in - 6 (saturating; 255 propagates), q * 2^(e_in - E)."""
    data, sf = x
    m, k = data.shape[0], data.shape[1] * 2
    bmi, bki = in_block
    bmo, bko = out_block
    ms_i, ks_i = ceil_div(m, bmi), ceil_div(k, bki)
    e_in = _exponents(sf, ms_i, ks_i)
    rm, rk = bmo // bmi, bko // bki
    ms_o, ks_o = ceil_div(m, bmo), ceil_div(k, bko)
    pad = torch.zeros((ms_o * rm, ks_o * rk), dtype=torch.int64, device=data.device)
    pad[:ms_i, :ks_i] = e_in
    emax = pad.reshape(ms_o, rm, ks_o, rk).amax(dim=(1, 3))
    e_out = torch.where(emax >= 255, 255, torch.where(emax >= 6, emax - 6, 0))
    eb = e_out.repeat_interleave(rm, 0).repeat_interleave(rk, 1)[:ms_i, :ks_i]
    d = torch.where(eb >= 255, 0, (e_in - eb + 127).clamp(0, 254))
    mult = (d << 23).to(torch.int32).view(torch.float32)
    v = unpack_from_e2m1fn_x2(data) * mult.repeat_interleave(bmi, 0).repeat_interleave(bki, 1)[:m, :k]
    out = v.clamp(-448, 448).to(torch.float8_e4m3fn)
    if packed:
        kc = ceil_div(ks_o, 4)
        e = torch.zeros((ms_o, kc * 4), dtype=torch.int64, device=data.device)
        e[:, :ks_o] = e_out
        words = (e.reshape(ms_o, kc, 4) << torch.arange(0, 32, 8, device=data.device)).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        storage = torch.zeros((kc, align(ms_o, 4)), dtype=torch.int32, device=data.device)
        storage[:, :ms_o] = words.T
        out_sf = storage[:, :ms_o].T
    else:
        sf_f = (e_out << 23).to(torch.int32).view(torch.float32)
        if col:
            storage = torch.zeros((ks_o, align(ms_o, 4)), device=data.device)
            storage[:, :ms_o] = sf_f.T
            out_sf = storage[:, :ms_o].T
        else:
            out_sf = sf_f.contiguous()
    return out, out_sf


@pytest.mark.parametrize("out_block", OUT_BLOCKS)
@pytest.mark.parametrize("out_flags", CONFIGS)
@pytest.mark.parametrize("in_flags", CONFIGS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_per_block_cast_lossless(num_tokens, hidden, in_flags, out_flags, out_block, device, monkeypatch):
    monkeypatch.setenv("TRITILE_CHECKS", "1")  # the precondition holds for these inputs
    x_fp4 = _fp4_input(num_tokens, hidden, in_flags, device)
    col, rnd, packed = out_flags
    out, sf = per_block_cast_lossless(x_fp4, "e4m3", (1, 32), out_block, col, rnd, packed)
    # TileKernels' check: the round trip is exact
    assert_equal(cast_back((out, sf), "fp32", out_block), cast_back(x_fp4, "fp32", (1, 32)))
    # tritile's: the exact exponent rule, bit for bit (packed sf as whole words: unused bytes are zero)
    ref_out, ref_sf = _model(x_fp4, (1, 32), out_block, col, packed)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("in_block,out_block", [((32, 32), (128, 128)), ((1, 16), (4, 64)), ((2, 2), (2, 128))])
def test_per_block_cast_lossless_other_blocks(in_block, out_block, device):
    """Input blocks other than (1, 32), incl. 2-D input blocks, on partial tiles."""
    # (True, True, False): a column-major float32 input sf (any strides are read)
    col_float = (True, True, False)
    for in_flags, out_flags in ((CONFIGS[0], CONFIGS[1]), (CONFIGS[1], CONFIGS[0]), (col_float, col_float)):
        x_fp4 = _fp4_input(37, 320, in_flags, device, in_block)
        out, sf = per_block_cast_lossless(x_fp4, "e4m3", in_block, out_block, *out_flags)
        assert_equal(cast_back((out, sf), "fp32", out_block), cast_back(x_fp4, "fp32", in_block))
        ref_out, ref_sf = _model(x_fp4, in_block, out_block, out_flags[0], out_flags[2])
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


@pytest.mark.parametrize("out_flags", CONFIGS)
def test_per_block_cast_lossless_zero_tokens(out_flags, device):
    data = torch.empty((0, 128), dtype=torch.int8, device=device)
    for sf in (torch.empty((0, 8), device=device), torch.empty((0, 2), dtype=torch.int32, device=device)):
        for ob in OUT_BLOCKS:
            out, out_sf = per_block_cast_lossless((data, sf), "e4m3", (1, 32), ob, *out_flags)
            assert out.shape == (0, 256) and out.dtype == torch.float8_e4m3fn
            ks = ceil_div(256, ob[1])
            assert out_sf.shape == ((0, ceil_div(ks, 4)) if out_flags[2] else (0, ks))


def test_per_block_cast_lossless_strided_rows(device):
    x_fp4 = _fp4_input(33, 576, CONFIGS[0], device)
    data, sf = x_fp4
    big = torch.zeros(33, 400, dtype=torch.int8, device=device)
    big[:, 16:304] = data
    view = big[:, 16:304]
    assert not view.is_contiguous()
    for ob in OUT_BLOCKS:
        a = per_block_cast_lossless((view, sf), "e4m3", (1, 32), ob, True, True, True)
        b = per_block_cast_lossless((data, sf), "e4m3", (1, 32), ob, True, True, True)
        assert_equal(a[0], b[0])
        assert_equal(a[1], b[1])


def test_per_block_cast_lossless_non_finite(device):
    """An input block with sf = +inf (a block that held inf/NaN) makes its output block dequantize to NaN."""
    x = _clamp_abs_ratio(torch.randn(40, 256, device=device))
    x[5, 40] = float("inf")
    for in_flags in CONFIGS:
        x_fp4 = cast(x, "e2m1", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=in_flags[0],
                     use_packed_ue8m0=in_flags[2])
        for ob in OUT_BLOCKS:
            for out_flags in CONFIGS:
                out, sf = per_block_cast_lossless(x_fp4, "e4m3", (1, 32), ob, *out_flags)
                back = cast_back((out, sf), "fp32", ob)
                ref = cast_back(x_fp4, "fp32", (1, 32))
                nan = torch.zeros_like(back, dtype=torch.bool)
                r0, c0 = (5 // ob[0]) * ob[0], (40 // ob[1]) * ob[1]
                nan[r0:r0 + ob[0], c0:c0 + ob[1]] = True
                assert torch.equal(torch.isnan(back), nan)
                assert torch.isnan(ref[5, 32:64]).all()
                assert_equal(back[~nan], ref[~nan])
                ref_out, ref_sf = _model(x_fp4, (1, 32), ob, out_flags[0], out_flags[2])
                assert_equal(out, ref_out)
                assert_equal(sf, ref_sf)


def test_per_block_cast_lossless_precondition(device, monkeypatch):
    """Input scales more than 2^11 below their output block's max: rejected under TRITILE_CHECKS=1;
    without checks the small block is rounded (defined output, still the model's bits)."""
    x = torch.randn(4, 128, device=device)
    x[:, :32] *= 2.0**20
    x_fp4 = cast(x, "e2m1", (1, 32), round_sf=True)
    monkeypatch.setenv("TRITILE_CHECKS", "1")
    with pytest.raises(ValueError, match="losslessly"):
        per_block_cast_lossless(x_fp4, "e4m3", (1, 32), (1, 128))
    # a float sf that is not a power of two
    bad_sf = x_fp4[1].clone()
    bad_sf[0, 0] *= 1.5
    with pytest.raises(ValueError, match="powers of two"):
        per_block_cast_lossless((x_fp4[0], bad_sf), "e4m3", (1, 32), (1, 32))
    monkeypatch.setenv("TRITILE_CHECKS", "0")
    out, sf = per_block_cast_lossless(x_fp4, "e4m3", (1, 32), (1, 128))
    ref_out, ref_sf = _model(x_fp4, (1, 32), (1, 128), False, False)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


def test_per_block_cast_lossless_bad_inputs(device):
    x_fp4 = _fp4_input(8, 256, CONFIGS[0], device)
    data, sf = x_fp4
    with pytest.raises(ValueError, match="fmt"):
        per_block_cast_lossless(x_fp4, "e2m1", (1, 32), (1, 128))
    with pytest.raises(TypeError, match="data"):
        per_block_cast_lossless((data.view(torch.uint8), sf), "e4m3", (1, 32), (1, 128))
    with pytest.raises(TypeError, match="data"):
        per_block_cast_lossless((data.view(torch.float8_e4m3fn), sf), "e4m3", (1, 32), (1, 128))
    with pytest.raises(ValueError, match="data"):
        per_block_cast_lossless((data[0], sf), "e4m3", (1, 32), (1, 128))
    with pytest.raises(ValueError, match="divisible by 32"):
        per_block_cast_lossless((data[:, :8], sf[:, :1]), "e4m3", (1, 32), (1, 128))
    with pytest.raises(TypeError, match="sf"):
        per_block_cast_lossless((data, sf.double()), "e4m3", (1, 32), (1, 128))
    with pytest.raises(ValueError, match="sf"):
        per_block_cast_lossless((data, sf[:, :3]), "e4m3", (1, 32), (1, 128))
    with pytest.raises(ValueError, match="x_block_size"):
        per_block_cast_lossless(x_fp4, "e4m3", (1, 48), (1, 96))
    with pytest.raises(ValueError, match="out_block_size"):
        per_block_cast_lossless(x_fp4, "e4m3", (1, 32), (3, 128))
    with pytest.raises(ValueError, match="multiple"):
        per_block_cast_lossless(x_fp4, "e4m3", (1, 32), (1, 16))
    with pytest.raises(ValueError, match="multiple"):
        per_block_cast_lossless(x_fp4, "e4m3", (32, 32), (1, 128))
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        per_block_cast_lossless(x_fp4, "e4m3", (1, 32), (1, 128), False, True, True)
    with pytest.raises(TypeError, match="x must be a"):
        per_block_cast_lossless(data, "e4m3", (1, 32), (1, 128))
