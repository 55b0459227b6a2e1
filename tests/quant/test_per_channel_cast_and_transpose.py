"""per_channel_cast_and_transpose vs the torch reference (bitwise): e4m3 codes of (npt x 1) scale blocks,
written transposed ``(K, M)``; sf ``(M / npt, K)`` not transposed."""

import pytest
import torch
from _cast_utils import assert_bad_inputs

from tritile.quant import per_channel_cast_and_transpose
from tritile.testing import assert_equal, generate_hidden_sizes, pick
from tritile.torch.per_channel_cast_fused import per_channel_cast_values

TOKENS = pick(cpu=[0, 128, 256], gpu=[0, 4096, 8064])
HIDDEN = generate_hidden_sizes(64, cpu=(256, 576))


def _ref(x, npt, round_sf):
    out, sf = per_channel_cast_values(x.float(), npt, round_sf)
    return out.T.contiguous(), sf


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("num_per_tokens", [32, 128])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_per_channel_cast_and_transpose(num_tokens, hidden, num_per_tokens, round_sf, device):
    x = torch.randn(num_tokens, hidden, device=device).bfloat16()
    out, sf = per_channel_cast_and_transpose(x, "e4m3", num_per_tokens, round_sf)
    ref_out, ref_sf = _ref(x, num_per_tokens, round_sf)
    assert out.shape == (hidden, num_tokens) and sf.shape == (num_tokens // num_per_tokens, hidden)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("num_per_tokens", [32, 128])
def test_per_channel_cast_and_transpose_strided_rows(num_per_tokens, device):
    m, k = pick(cpu=(128, 192), gpu=(4096, 7168))
    big = torch.randn(m, k + 64, device=device).bfloat16()
    x = big[:, :k]
    out, sf = per_channel_cast_and_transpose(x, "e4m3", num_per_tokens, True)
    ref_out, ref_sf = per_channel_cast_and_transpose(x.contiguous(), "e4m3", num_per_tokens, True)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
@pytest.mark.parametrize("num_per_tokens", [32, 128])
def test_per_channel_cast_and_transpose_non_finite(num_per_tokens, device):
    """A block holding +-inf or NaN gets sf = +inf, +-0 codes for its finite elements and 0x7F | sign
    for its non-finite ones; the other blocks are unaffected."""
    x = torch.randn(128, 64, device=device)
    x[40, 1] = float("inf")
    x[0, 2] = -float("inf")
    x[127, 5] = float("nan")
    x = x.bfloat16()
    out, sf = per_channel_cast_and_transpose(x, "e4m3", num_per_tokens)
    ref_out, ref_sf = _ref(x, num_per_tokens, False)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
    g = lambda r: r // num_per_tokens  # noqa: E731
    inf = float("inf")
    assert sf[g(40), 1] == inf and sf[g(0), 2] == inf and sf[g(127), 5] == inf
    assert int(torch.isinf(sf).sum()) == 3
    codes = out.view(torch.uint8)
    nan_code = 0xFF if bool(torch.signbit(x[127, 5].float())) else 0x7F  # torch's bf16 NaN may carry a sign
    assert codes[1, 40] == 0x7F and codes[2, 0] == 0xFF and codes[5, 127] == nan_code
    blk = codes[1, g(40) * num_per_tokens:(g(40) + 1) * num_per_tokens].clone()
    blk[40 % num_per_tokens] = 0
    assert bool(((blk & 0x7F) == 0).all())


def test_per_channel_cast_and_transpose_bad_inputs(device):
    x = torch.randn(128, 256, device=device).bfloat16()
    assert_bad_inputs([
        (ValueError, "fmt", lambda: per_channel_cast_and_transpose(x, "e5m6", 128)),
        (ValueError, "num_per_tokens", lambda: per_channel_cast_and_transpose(x, "e4m3", 64)),
        (TypeError, "num_per_tokens", lambda: per_channel_cast_and_transpose(x, "e4m3", None)),
        (TypeError, "round_sf", lambda: per_channel_cast_and_transpose(x, "e4m3", 128, round_sf="yes")),
        (TypeError, "x must be bfloat16", lambda: per_channel_cast_and_transpose(x.float(), "e4m3", 128)),
        (ValueError, "x must be 2D", lambda: per_channel_cast_and_transpose(x[None], "e4m3", 128)),
        (ValueError, "multiple of 128 rows", lambda: per_channel_cast_and_transpose(x[:96], "e4m3", 32)),
        (ValueError, "multiple of 64 columns", lambda: per_channel_cast_and_transpose(x[:, :160], "e4m3", 128)),
        (ValueError, "x must have a unit stride",
         lambda: per_channel_cast_and_transpose(torch.randn(256, 128, device=device).bfloat16().T, "e4m3", 128)),
    ])


@pytest.mark.parametrize("config", [dict(BLOCK_M=128, BLOCK_K=128, PACK_WORDS=True),
                                    dict(BLOCK_M=128, BLOCK_K=64, PACK_WORDS=False),
                                    dict(BLOCK_M=256, BLOCK_K=128, PACK_WORDS=True, num_warps=4),
                                    dict(BLOCK_M=256, BLOCK_K=256, PACK_WORDS=False),
                                    dict(BLOCK_M="npt", BLOCK_K=128, num_warps=4),
                                    dict(BLOCK_M="npt", BLOCK_K=64, PACK_WORDS=False),
                                    dict(BLOCK_M="npt", BLOCK_K=64, KFAST=True)])
@pytest.mark.parametrize("num_per_tokens", [32, 128])
def test_per_channel_cast_and_transpose_launch_configs(config, num_per_tokens, device):
    """Every tile shape and store path the launch rule may pick (the GPU's, too, under the interpreter):
    several column tiles, a partial last row tile (384 rows in 256-row tiles), words or bytes."""
    from tritile.quant.per_channel_cast_and_transpose_kernel import _launch

    x = torch.randn(384, 320, device=device).bfloat16()
    if config.get("BLOCK_M") == "npt":  # the GPU default: one scale block of rows per tile
        config = dict(config, BLOCK_M=num_per_tokens)
    out, sf = _launch(x, num_per_tokens, True, config)
    ref_out, ref_sf = _ref(x, num_per_tokens, True)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
@pytest.mark.parametrize("finite_branch", [False, True])
@pytest.mark.parametrize("num_per_tokens,bk,warps,reps", [(128, 64, 8, 4), (128, 64, 4, 8), (128, 128, 8, 8),
                                                         (32, 128, 4, 4), (32, 128, 2, 8), (32, 256, 4, 8)])
def test_per_channel_cast_and_transpose_permuted_rows(num_per_tokens, bk, warps, reps, finite_branch, device):
    """The GPU tiles with VEC=8 and the row permutation that packs each word inside a thread (PERM_ROWS:
    4 or 8 consecutive tokens per thread), with and without FINITE_BRANCH, several row and column tiles
    (a partial last one), one block holding inf/NaN."""
    from tritile.quant.per_channel_cast_and_transpose_kernel import _launch, _perm_rows

    bm = num_per_tokens
    assert _perm_rows(bm, bk, warps, 8, num_per_tokens, True) == bm // reps
    x = torch.randn(256, 320, device=device)
    x[3, 70] = float("inf")
    x[200, 5] = -float("inf")
    x[37, 129] = float("nan")
    x = x.bfloat16()
    for rnd in (False, True):
        config = dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=warps, VEC=8, PERM=True, PACK_WORDS=True,
                      FINITE_BRANCH=finite_branch)
        out, sf = _launch(x, num_per_tokens, rnd, config)
        ref_out, ref_sf = _ref(x, num_per_tokens, rnd)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


def test_per_channel_cast_and_transpose_torch_compile(device):
    x = torch.randn(128, 128, device=device).bfloat16()
    fn = torch.compile(lambda t: per_channel_cast_and_transpose(t, "e4m3", 32, True), backend="eager",
                       fullgraph=True)
    out, sf = fn(x)
    ref_out, ref_sf = per_channel_cast_and_transpose(x, "e4m3", 32, True)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)
