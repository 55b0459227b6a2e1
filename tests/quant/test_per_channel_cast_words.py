"""The per-channel casts' WORDS path (bf16 x held as int32 words of two columns; ``_per_channel_cast_words_kernel``)
forced through ``tritile.runtime.override_config``, bitwise against the default element path: codes (NaN signs
included) and scales, on data with zeros, +-inf, NaN of both signs, bf16 denormals and saturating values, ragged
shapes (M not a multiple of 128 through a gather, odd K and strided rows: the element fallback), round_sf both ways,
HMUL_ENC and INT_POW2 both ways."""

import pytest
import torch
import triton
import triton.language as tl

from tritile.language import quant_scale
from tritile.quant.per_channel_cast_fused_kernel import _column_scale_fast_div
from tritile.runtime import override_config
from tritile.testing import assert_equal

_WORDS = [dict(WORDS=True, HMUL_ENC=False), dict(WORDS=True, HMUL_ENC=True), dict(WORDS=True, INT_POW2=False),
          dict(WORDS=True, BLOCK_K=128, VEC=8), dict(WORDS=True, BLOCK_K=64, VEC=8),
          dict(WORDS=True, BLOCK_K=32, VEC=8, num_warps=1),
          # speed-only candidates (same bits): row strides as constexprs, the round_sf-off scales by in-range divisions
          dict(WORDS=True, HMUL_ENC=True, STATIC_STRIDES=True), dict(WORDS=True, HMUL_ENC=True, FAST_DIV=True),
          dict(WORDS=True, HMUL_ENC=True, STATIC_STRIDES=True, FAST_DIV=True),
          dict(WORDS=True, HMUL_ENC=True, STATIC_STRIDES=True, FAST_DIV=True, BLOCK_K=64, VEC=8),
          # the GPU default of commit 65d4724 (both off; on by default since commit bc6f44a)
          dict(WORDS=True, HMUL_ENC=True, STATIC_STRIDES=False, FAST_DIV=False),
          # the grid's first dimension over the column blocks (a candidate of commit fd8764c; several column blocks
          # here)
          dict(WORDS=True, HMUL_ENC=True, KFAST=True, BLOCK_K=64, VEC=8)]


def _data(m, k, device, stride=None):
    """bf16 (m, k) (row stride ``stride`` when given) with inf, NaN (as bit patterns: both signs), zeros,
    denormals, huge and tiny columns."""
    base = torch.empty(m, stride or k, dtype=torch.bfloat16, device=device)
    x = base[:, :k]
    x.copy_(torch.randn(m, k, device=device) * torch.logspace(-6, 6, k, device=device))
    bits = x.view(torch.int16)
    x[:, 0] = 0.0
    x[1::3, 1] = -0.0
    bits[:, 2] = torch.randint(1, 128, (m,), device=device, dtype=torch.int16)  # bf16 denormals
    bits[::2, 2] |= -32768                                                    # negative ones
    x[:, 3] = 3.0e38 * torch.sign(torch.randn(m, device=device))               # saturating, huge amax
    x[5, 4] = float("inf")
    x[m - 1, 5] = -float("inf")
    bits[7, 6] = -64                      # -NaN (0xFFC0)
    bits[8, 6 % k] = 0x7FC1               # +NaN
    bits[m // 2, k - 1] = 0x7F81          # a signalling NaN pattern, just above inf
    x[9, 7 % k] = 1e-30                   # a tiny column: amax below the 1e-4 clamp
    x[:, 8 % k] = 1e-6 * torch.randn(m, device=device)
    return x


_ELEMENT = dict(WORDS=False, HMUL_ENC=False)  # the element kernel (WORDS + HMUL_ENC is the GPU default)


def _run(name, cfg, x, rnd, pos=None, rows=None):
    from tritile.quant.per_channel_cast_fused_kernel import _launch

    rows = x.shape[0] if rows is None else rows
    with override_config(name, **cfg):
        return _launch(x, None, False, pos, rows, rnd, name=name)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("cfg", _WORDS)
def test_per_channel_cast_words_equal(cfg, device):
    """per_channel_cast (256 x 192: a partial column block for BLOCK_K 128 under the GPU configs) and
    per_channel_cast_fused with a gather (200 rows: a ragged last block, padding and out-of-range entries)."""
    from tritile.quant import per_channel_cast

    x = _data(256, 192, device)
    pos = torch.randint(-1, 256, (208,), device=device, dtype=torch.int32)
    pos[:6] = torch.tensor([5, 7, 8, 255, 128, -1], dtype=torch.int32)
    for rnd in (False, True):
        ref = _run("per_channel_cast", _ELEMENT, x, rnd)
        got = _run("per_channel_cast", cfg, x, rnd)
        assert_equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert_equal(got[1], ref[1])
        with override_config("per_channel_cast", **cfg):
            pub = per_channel_cast(x, "e4m3", 128, rnd)
        assert_equal(pub[0].view(torch.uint8), ref[0].view(torch.uint8))
        ref = _run("per_channel_cast_fused", _ELEMENT, x, rnd, pos, 208)
        got = _run("per_channel_cast_fused", cfg, x, rnd, pos, 208)
        assert_equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert_equal(got[1], ref[1])
    codes = ref[0].view(torch.uint8)
    assert codes[1, 6] == 0xFF and codes[2, 6] == 0x7F  # the NaN codes keep x's sign (rows 7 and 8 via pos)


@pytest.mark.parametrize("rnd", [False, True])
def test_per_channel_cast_words_fallback(rnd, device):
    """Odd K, an odd row stride and a misaligned base run the element kernel (same bits); the words kernel
    is really taken for an even K (checked through a spy on the launcher)."""
    import tritile.quant.per_channel_cast_fused_kernel as K

    calls = []
    real = K._launch_words

    def spy(*a, **kw):
        took = real(*a, **kw)
        calls.append(took)
        return took

    K._launch_words, saved = spy, K._launch_words
    try:
        cases = [_data(128, 67, device),                 # odd K
                 _data(128, 66, device, stride=67),      # odd row stride
                 _data(130, 64, device).view(-1)[1:1 + 128 * 64].view(128, 64),  # base 2 bytes off 4-byte alignment
                 _data(128, 66, device, stride=68)]      # even stride: words
        for x in cases:
            ref = _run("per_channel_cast_fused", _ELEMENT, x, rnd)
            got = _run("per_channel_cast_fused", dict(WORDS=True), x, rnd)
            assert_equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
            assert_equal(got[1], ref[1])
    finally:
        K._launch_words = saved
    assert calls == [False, False, False, True]


def test_per_channel_cast_words_float32_input_ignored(device):
    """WORDS leaves a float32 x on the element kernel (same bits)."""
    x = _data(128, 64, device).float()
    ref = _run("per_channel_cast_fused", _ELEMENT, x, False)
    got = _run("per_channel_cast_fused", dict(WORDS=True), x, False)
    assert_equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
    assert_equal(got[1], ref[1])


@pytest.mark.parametrize("cfg", [dict(WORDS=True, HMUL_ENC=True, STATIC_STRIDES=True, FAST_DIV=True),
                                 dict(WORDS=True, HMUL_ENC=True, STATIC_STRIDES=True, FAST_DIV=True, BLOCK_K=64)])
@pytest.mark.parametrize("rnd", [False, True])
def test_per_channel_cast_words_static_strides(cfg, rnd, device):
    """STATIC_STRIDES on strided rows (x row stride 68 elements = 34 words; the output stays contiguous), plain and
    gathered: the same bits as the element kernel."""
    x = _data(256, 66, device, stride=68)
    pos = torch.randint(-1, 256, (144,), device=device, dtype=torch.int32)
    for name, p, rows in (("per_channel_cast", None, None), ("per_channel_cast_fused", pos, 144)):
        ref = _run(name, _ELEMENT, x, rnd, p, rows)
        got = _run(name, cfg, x, rnd, p, rows)
        assert_equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert_equal(got[1], ref[1])


@triton.jit
def _scale_fast_div_kernel(m_ptr, sf_ptr, si_ptr, rsf_ptr, rsi_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    m = tl.load(m_ptr + i)
    sf, si = _column_scale_fast_div(m)
    rsf, rsi = quant_scale((tl.minimum(m, 0x7F80) << 16).to(tl.float32, bitcast=True), 1e-4, 448.0, False)
    tl.store(sf_ptr + i, sf)
    tl.store(si_ptr + i, si)
    tl.store(rsf_ptr + i, rsf)
    tl.store(rsi_ptr + i, rsi)


def test_column_scale_fast_div_exhaustive(device):
    """``_column_scale_fast_div`` against ``quant_scale(max(amax, 1e-4), 1e-4, 448, False)`` on every max-magnitude
    pattern 0..0x7FFF (NaN patterns included).  Under the interpreter this checks the mantissa decomposition (its
    divisions are div_rn); on the GPU the in-range division sequence too."""
    n = 32768
    m = torch.arange(n, dtype=torch.int32, device=device)
    outs = [torch.full((n,), float("nan"), device=device) for _ in range(4)]
    _scale_fast_div_kernel[(1,)](m, *outs, N=n)
    assert_equal(outs[0].view(torch.int32), outs[2].view(torch.int32))
    assert_equal(outs[1].view(torch.int32), outs[3].view(torch.int32))
    assert torch.isinf(outs[0][0x7F80:]).all() and (outs[1][0x7F80:] == 0).all()
