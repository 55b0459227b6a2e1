"""per_block_cast_lossless: the word kernel's speed-only flag GRID_1D (the tiles on a 1-D grid, K fastest, with the
byte-permute fast path; the GPU's default at (1, 128) out blocks) gives the 2-D word kernel's bits: every FP4 code x
every multiplier exponent the fast path accepts (-5..6), zero multipliers, non-finite blocks, both sf layouts in and
out, ragged tiles, and tiles that fall back to the slow (float) path.  Plus ``prmt``'s
interpreter stand-in against a Python model of the PTX ISA's ``prmt.b32`` (on a GPU run the same test checks the real
PTX)."""

import pytest
import torch
import triton
import triton.language as tl

from tritile.quant._lossless_ptx import prmt
from tritile.quant.per_block_cast_lossless_kernel import per_block_cast_lossless
from tritile.runtime import override_config
from tritile.testing import assert_equal, is_gpu_run
from tritile.utils import align, ceil_div

CONFIGS = [(False, True, False), (True, True, True)]  # (col_major, round_sf, packed) of the sf, in and out
# the 1-D grid kernel (its fast path by byte permutes)
GRID_1D_CANDIDATES = [dict(GRID_1D=True)]
# GRID_1D=False spelled out: the GPU's (1, 128) default is GRID_1D; the 2-D word kernel is the default elsewhere
CANDIDATES = [dict(GRID_1D=False)] + GRID_1D_CANDIDATES


def _prmt_model(a: int, b: int, c: int) -> int:
    """PTX ISA, prmt.b32 generic mode: tmp64 = (b << 32) | a; result byte i = byte (ctl[i] & 7) of tmp64, or its
    replicated sign (bit 7) when ctl[i] & 8; ctl[i] = (c >> 4i) & 0xF.  Returns the int32 value."""
    tmp = ((b & 0xFFFFFFFF) << 32) | (a & 0xFFFFFFFF)
    r = 0
    for i in range(4):
        s = (c >> (4 * i)) & 0xF
        v = (tmp >> (8 * (s & 7))) & 0xFF
        if s & 8:
            v = 0xFF if v & 0x80 else 0
        r |= v << (8 * i)
    return r - (1 << 32) if r >= 1 << 31 else r


@triton.jit
def _prmt_kernel(a_ptr, b_ptr, c_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, prmt(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)))


def test_prmt_matches_ptx_model(device):
    n = 2048
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=g).to(torch.int32) for _ in range(3))
    # the selectors the kernel uses: magnitudes (nibbles 0..7) and the sign-replicating 0xD9C8 / 0xFBEA
    c[:256] &= 0x77777777
    c[256:384] = 0xD9C8
    c[384:512] = 0xFBEA
    out = torch.empty(n, dtype=torch.int32, device=device)
    _prmt_kernel[(1,)](a.to(device), b.to(device), c.to(device), out, N=n)
    ref = torch.tensor([_prmt_model(int(x), int(y), int(z)) for x, y, z in zip(a, b, c)], dtype=torch.int32)
    assert_equal(out.cpu(), ref)


def _sf_tensor(e: torch.Tensor, packed: bool, col: bool) -> torch.Tensor:
    """Input scales from biased exponents ``e`` (int64 [Ms, Ks], 0..255): float32 ``2^(e-127)`` (0 -> 0.0,
    255 -> inf) or packed UE8M0 int32 words; ``col``: the TMA-aligned column-major layout."""
    ms, ks = e.shape
    if packed:
        kc = ceil_div(ks, 4)
        eb = torch.zeros((ms, kc * 4), dtype=torch.int64)
        eb[:, :ks] = e
        w = (eb.reshape(ms, kc, 4) << torch.arange(0, 32, 8)).sum(-1)
        sf = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    else:
        sf = (e.to(torch.int32) << 23).view(torch.float32)
    if col:
        storage = torch.zeros((sf.shape[1], align(ms, 4)), dtype=sf.dtype)
        storage[:, :ms] = sf.T
        sf = storage[:, :ms].T
    return sf


def _codes_input(m: int, k: int, e: torch.Tensor, packed: bool, col: bool, device):
    """FP4 data whose rows cycle through all 16 codes (shifted per row, so every code sits in every nibble
    position), with input scale exponents ``e``."""
    codes = (torch.arange(k)[None, :] * 7 + torch.arange(m)[:, None]) % 16
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return data.to(device), _sf_tensor(e, packed, col).to(device)


def _exponents(ms: int, ks: int, rm: int, rk: int, emax: int) -> torch.Tensor:
    """[ms, ks] input exponents: every ``rm x rk`` output block holds ``emax`` (at its first input block) and the
    offsets 0..11 below it (multipliers 2^6 .. 2^-5) in turn; every fourth row of output blocks has its max at 5
    instead (out exponent saturated at 0, multipliers 2^0 .. 2^5, scale byte 0 included)."""
    i, j = torch.arange(ms)[:, None], torch.arange(ks)[None, :]
    e = emax - (j + 5 * i) % 12
    e[::rm, ::rk] = emax
    sat = ((torch.arange(ms) // rm) % 4 == 1)
    e[sat] = (e[sat] - emax + 5).clamp(min=0)
    return e


def _compare(x, in_block, ob, cand, cfg=None):
    for out_flags in CONFIGS:
        with override_config("per_block_cast_lossless", **(cfg or {})):
            ref = per_block_cast_lossless(x, "e4m3", in_block, ob, *out_flags)
        with override_config("per_block_cast_lossless", **(cfg or {}), **cand):
            got = per_block_cast_lossless(x, "e4m3", in_block, ob, *out_flags)
        assert_equal(got[0], ref[0])
        assert_equal(got[1], ref[1])


@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("ob", [(1, 128), (32, 32), (128, 128)])
def test_lossless_flags_all_codes_and_offsets(ob, cand, device):
    """Every code x every multiplier 2^-5 .. 2^6 (fast path), both input sf layouts, both output layouts, ragged M."""
    m, k = 37, 384
    e = _exponents(m, k // 32, ob[0], ob[1] // 32, 140)
    for in_flags in CONFIGS:
        x = _codes_input(m, k, e, in_flags[2], in_flags[0], device)
        _compare(x, (1, 32), ob, cand)


@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: "+".join(c))
def test_lossless_flags_zero_nonfinite_and_slow_path(cand, device):
    """Zero multipliers (scale byte 0 next to a large one; a zero-scale row), a non-finite block (its output block
    gets +-0 codes and sf inf), and tiles breaking the precondition (the slow float path, rounding) among fast
    ones; with GPU-sized tiles (4 rows x 32 words: ragged in M and K) and the default tile."""
    m, k = 13, 320
    ks = k // 32
    e = torch.full((m, ks), 140, dtype=torch.int64)
    e[:, 1::2] = 138
    e[2, 1:4] = 0          # zero multipliers (2^-134 below their neighbours)
    e[3] = 0               # an all-zero-scale row: E = 0, multiplier 2^0 at (1, 128); zeros at (32, 32)
    e[5, 2] = 255          # non-finite: its output block is +-0 with sf inf
    e[9, 4] = 100          # 2^-40 below its neighbours: its tiles take the slow path (rounding / flushing)
    e[12, 9] = 200         # the last, partial tiles: slow path too
    for in_flags in CONFIGS:
        x = _codes_input(m, k, e, in_flags[2], in_flags[0], device)
        for ob in ((1, 128), (32, 32)):
            _compare(x, (1, 32), ob, cand)
            # GPU-sized tiles, 4 blocks wide: fast and slow tiles side by side, ragged in M and K
            _compare(x, (1, 32), ob, cand, dict(TM=max(4, ob[0]), TW=16, num_warps=1))


@pytest.mark.parametrize("cand", GRID_1D_CANDIDATES, ids=lambda c: "+".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("ob", [(1, 128), (32, 32), (128, 128)])
def test_lossless_grid_1d_tiles(ob, cand, device):
    """The 1-D grid kernel over GPU-sized tiles (TM = max(4, bm_out) rows x 16 words: 6-40 tiles, consecutive
    programs along K), partial last tiles in M (37 rows) and K (384 values: the packed sf's padded blocks past K),
    every code x every multiplier offset, both sf layouts in and out."""
    m, k = 37, 384
    e = _exponents(m, k // 32, ob[0], ob[1] // 32, 140)
    for in_flags in CONFIGS:
        x = _codes_input(m, k, e, in_flags[2], in_flags[0], device)
        _compare(x, (1, 32), ob, cand, dict(TM=max(4, ob[0]), TW=16, num_warps=1))


@pytest.mark.parametrize("in_block,ob", [((32, 32), (128, 128)), ((1, 16), (4, 64)), ((1, 8), (2, 64))])
def test_lossless_flags_other_blocks(in_block, ob, device):
    """Input blocks of 2 and 1 words per row and 2-D input blocks."""
    m, k = 70, 256
    ms, ks = ceil_div(m, in_block[0]), k // in_block[1]
    e = _exponents(ms, ks, ob[0] // in_block[0], ob[1] // in_block[1], 135)
    for cand in CANDIDATES:
        for in_flags in CONFIGS:
            x = _codes_input(m, k, e, in_flags[2], in_flags[0], device)
            _compare(x, in_block, ob, cand)


@pytest.mark.skipif(not is_gpu_run(), reason="GPU only: the real PTX at the GPU launch configs, a larger tensor")
@pytest.mark.parametrize("ob", [(1, 128), (32, 32), (128, 128)])
def test_lossless_flags_exhaustive_gpu(ob, device):
    """All 16 codes x all multiplier offsets (and E saturated at 0) x every candidate and tile of the tune list."""
    from tritile.bench.cases.quant import _TUNE_LOSSLESS

    m, k = 1031, 7168
    e = _exponents(m, k // 32, ob[0], ob[1] // 32, 140)
    cands = [c for c in _TUNE_LOSSLESS[ob] if c.get("GRID_1D")] + CANDIDATES
    for in_flags in CONFIGS:
        x = _codes_input(m, k, e, in_flags[2], in_flags[0], device)
        for cand in cands:
            _compare(x, (1, 32), ob, cand)


@pytest.mark.parametrize("key", ["PRMT", "STREAM"])
def test_lossless_unknown_config_key(key, device):
    """A launch config key the kernels do not have (PRMT, the byte-permute fast path, is GRID_1D's) is a ValueError
    naming it, before any launch."""
    x = _codes_input(4, 256, torch.full((4, 8), 130, dtype=torch.int64), False, False, device)
    with override_config("per_block_cast_lossless", **{key: True}), \
            pytest.raises(ValueError, match=f"unknown keys.*{key}"):
        per_block_cast_lossless(x, "e4m3", (1, 32), (1, 128))
