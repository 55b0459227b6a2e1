"""The FP4 -> FP4 per-token requantization by byte permutes (``tritile/quant/_fp4_requant.py``): the same codes and
scales as the general kernel for every code and every input scale byte, on the CPU and on the GPU."""

import math

import pytest
import torch
import triton
import triton.language as tl

from tritile.quant import per_token_cast
from tritile.quant._fp4_requant import K_MAX, K_MIN, _block_max_exp, _lut_select, _lut_words, _map_table_values
from tritile.runtime import override_config
from tritile.testing import assert_equal, pick
from tritile.torch import cast


@triton.jit
def _lut_probe(out_ptr, N: tl.constexpr):
    k = tl.arange(0, N) - 8
    lo, hi = _lut_select(k)
    tl.store(out_ptr + tl.arange(0, N), lo)
    tl.store(out_ptr + N + tl.arange(0, N), hi)


def test_lut_constants(device):
    # the kernel's where-chain holds the maps _lut_words computes exactly (Fractions, ties to even)
    out = torch.empty(32, dtype=torch.int32, device=device)
    _lut_probe[(1,)](out, N=16)
    got = out.cpu().tolist()
    for i, k in enumerate(range(-8, 8)):
        kk = min(max(k, K_MIN - 1), K_MAX)
        want = (0, 0) if kk < K_MIN else _lut_words(kk)
        assert (got[i] & 0xFFFFFFFF, got[16 + i] & 0xFFFFFFFF) == want, k
    # k = 2 maps 0.5 -> 2 (code 4), 6 -> 24 saturates (code 7); k = -1 maps 0.5 -> 0.25 (a tie: code 0)
    assert _lut_words(2)[0] & 0xFF00 == 0x0400 and _lut_words(-1)[0] & 0xFF00 == 0


def _random_fp4(m, k, xbs, device, gen, byte_lo=0, byte_hi=255):
    """A QuantTensor with random FP4 codes and random UE8M0 scale bytes in [byte_lo, byte_hi] (packed, column-major:
    the layout from the reference cast)."""
    data, sf = cast(torch.randn(m, k, device=device).bfloat16(), "e2m1", xbs, round_sf=True,
                    use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    data.view(torch.uint8).copy_(torch.randint(0, 256, data.shape, generator=gen).to(torch.uint8))
    sf.copy_(_words(torch.randint(byte_lo, byte_hi + 1, tuple(sf.shape) + (4,), generator=gen)).to(device))
    return data, sf


def _words(b):
    """int32 words from their four bytes (last dimension, byte 0 lowest)."""
    w = (b.to(torch.int64) << (8 * torch.arange(4))).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


# the output's scale flags (col-major, round_sf, packed): the fast path needs round_sf
OUT_FLAGS = [(True, True, True), (True, True, False), (False, True, False)]
OUT_IDS = ["packed", "colmajor_f32", "rowmajor_f32"]


# the byte-permute paths where an input block lies in one group: the maps from the table in memory, or by selects
# (the path taken while a CUDA graph is captured before the table exists)
PATHS = [dict(), dict(TABLE=False), dict(KFAST=True), dict(KFAST=False)]  # (KFAST: the GPU default since commit
                                                                          # fd8764c)
PATH_IDS = ["table", "selects", "kfast", "rows_first"]


def _three_ways(qx, npc, xbs, flags, cfg=None):
    """(fast path, the new kernel's general branch, the general kernel): (out, sf) each, the first two with the config
    overrides ``cfg``; checks that the first two ran the requantization kernel and the third did not."""
    import tritile.quant.per_token_cast_kernel as ptk

    launched = []
    real = ptk._fp4_requant_launch

    def spy(*a, **kw):
        launched.append(real(*a, **kw))
        return launched[-1]

    ptk._fp4_requant_launch = spy
    try:
        return _three_ways_run(qx, npc, xbs, flags, launched, cfg or {})
    finally:
        ptk._fp4_requant_launch = real


def _three_ways_run(qx, npc, xbs, flags, launched, cfg):
    with override_config("per_token_cast", **cfg):
        fast = per_token_cast(qx, "e2m1", npc, xbs, *flags)
    with override_config("per_token_cast", FAST_LIMIT=-1, **cfg):
        general_branch = per_token_cast(qx, "e2m1", npc, xbs, *flags)
    with override_config("per_token_cast", FP4_REQUANT=False):
        general = per_token_cast(qx, "e2m1", npc, xbs, *flags)
    assert launched == [True, True]
    return fast, general_branch, general


@pytest.mark.parametrize("cfg", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flags", OUT_FLAGS, ids=OUT_IDS)
@pytest.mark.parametrize("xbs", [(32, 32), (1, 64), (128, 128)], ids=["xb32", "xb1x64", "xb128"])
@pytest.mark.parametrize("npc", [16, 32, 64, 128])
def test_fp4_requant_matches_general(device, npc, xbs, flags, cfg):
    # random codes and every finite-path scale byte (0..252): the fast path on every tile
    gen = torch.Generator().manual_seed(npc * 7 + xbs[1] + flags[2])
    m, k = pick(cpu=(37, 1088), gpu=(4001, 7168))
    qx = _random_fp4(m, k, xbs, device, gen, 0, 252)
    fast, branch, general = _three_ways(qx, npc, xbs, flags, cfg)
    for a, b in ((fast, general), (branch, general)):
        assert_equal(a[0], b[0])
        assert_equal(a[1], b[1])


@pytest.mark.parametrize("cfg", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flags", OUT_FLAGS, ids=OUT_IDS)
def test_fp4_requant_every_byte(device, flags, cfg):
    # every scale byte 0..255 with every code: bytes above 252 send their tile to the general branch (inf / NaN
    # blocks), the others take the byte permutes; neighbouring scale bytes give every k in -8..8 within a group
    gen = torch.Generator().manual_seed(5 + flags[2])
    xbs = (1, 32)
    m, k = 256, 512
    data, sf = _random_fp4(m, k, xbs, device, gen)
    # row r: its 16 input blocks get bytes r, r-1, ..., r-7, r+1, ..., r+8 (clamped to 0..255)
    r = torch.arange(m)[:, None]
    off = torch.tensor([0, -1, -2, -3, -4, -5, -6, -7, 1, 2, 3, 4, 5, 6, 7, 8])[None, :]
    b = (r + off).clamp(0, 255).to(torch.uint8)
    assert sf.shape == (m, 4)
    # write bytes through the packed layout: byte j of row i lives in word (i, j // 4), byte j % 4
    sf.copy_(_words(b.view(m, 4, 4)).to(device))
    fast, branch, general = _three_ways((data, sf), 128, xbs, flags, cfg)
    for a, bb in ((fast, general), (branch, general)):
        assert_equal(a[0], bb[0])
        assert_equal(a[1], bb[1])


def test_fp4_requant_matches_reference(device):
    # the fast path against tritile.torch's cast of the dequantized tensor (as test_per_token_cast does)
    gen = torch.Generator().manual_seed(11)
    m, k = pick(cpu=(19, 576), gpu=(8001, 7168))
    qx = _random_fp4(m, k, (32, 32), device, gen, 100, 140)
    out, sf = per_token_cast(qx, "e2m1", 128, (32, 32), True, True, True)
    ref_out, ref_sf = cast(qx, "e2m1", (1, 128), x_block_size=(32, 32), round_sf=True,
                           use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=4, num_warps=2), dict(BLOCK_M=2, BLOCK_K=2048, num_warps=2),
                                 dict(BLOCKS=False), dict(BLOCK_M=4, num_warps=2, maxnreg=32),
                                 dict(BLOCK_M=8, num_warps=2, maxnreg=40),
                                 dict(BLOCK_M=8, num_warps=1, maxnreg=80),
                                 dict(BLOCK_M=2, BLOCK_K=2048, num_warps=1, maxnreg=80)],
                         ids=["tile4", "wide", "per_word", "cap32", "rows8_cap40", "rows8_cap80", "wide_cap80"])
@pytest.mark.parametrize("byte_hi", [252, 255], ids=["finite", "every_byte"])
def test_fp4_requant_configs(device, cfg, byte_hi):
    # other tiles and the per-word path (BLOCKS=False) on the anchor's blocks; bytes up to 255 send some tiles to the
    # general code
    gen = torch.Generator().manual_seed(17 + byte_hi)
    m, k = pick(cpu=(23, 1600), gpu=(4001, 7168))
    qx = _random_fp4(m, k, (32, 32), device, gen, 120, byte_hi) if byte_hi == 255 else \
        _random_fp4(m, k, (32, 32), device, gen, 0, byte_hi)
    flags = (True, True, True)
    with override_config("per_token_cast", **cfg):
        got = per_token_cast(qx, "e2m1", 128, (32, 32), *flags)
    with override_config("per_token_cast", FP4_REQUANT=False):
        want = per_token_cast(qx, "e2m1", 128, (32, 32), *flags)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])


@triton.jit
def _max_probe(w_ptr, e_ptr, lut_ptr, out_ptr, N: tl.constexpr, TABLE: tl.constexpr):
    from_words = tl.load(w_ptr + tl.arange(0, 4 * N)).reshape(N, 4)
    e = tl.load(e_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), _block_max_exp(from_words & 0x77777777, e, 1, lut_ptr, TABLE))


@pytest.mark.parametrize("table", [True, False], ids=["table", "constants"])
def test_block_max_exp(device, table):
    # the one-hot maximum over four words of eight nibbles each, as the biased float32 exponent of val(max code) *
    # 2^(e - 127): every code as the maximum, words whose top nibble is set (negative int32), a single non-zero nibble,
    # scale bytes 0..252 (products below the normal range included)
    gen = torch.Generator().manual_seed(3)
    n = 256
    w = torch.randint(-2**31, 2**31, (n, 4), generator=gen, dtype=torch.int64)
    w[:64] &= 0x11111111  # magnitudes 0 / 1
    w[64:96] = 0
    w[64:96, 1] = torch.tensor([1 << (4 * (i % 8)) for i in range(32)]) * (torch.arange(32) % 7 + 1)
    w[96:160] &= torch.tensor([0x11111111, 0x22222222, 0x33333333, 0x44444444, 0x55555555, 0x66666666, 0x77777777,
                               0])[torch.arange(64) % 8][:, None]
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    e = torch.randint(0, 253, (n,), generator=gen, dtype=torch.int32)
    e[:8] = torch.arange(8, dtype=torch.int32)
    out = torch.empty(n, dtype=torch.int32, device=device)
    lut = torch.tensor(_map_table_values(), dtype=torch.int64, device=device)
    _max_probe[(1,)](w.to(device), e.to(device), lut, out, N=n, TABLE=table)
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = [max(((int(x) & 0xFFFFFFFF) >> (4 * i)) & 7 for x in row for i in range(8)) for row in w]
    assert set(codes) == set(range(8))
    got = out.cpu().tolist()
    for c, eb, q in zip(codes, e.tolist(), got):
        if c == 0:
            assert q == 0
            continue
        assert q == math.frexp(vals[c])[1] - 1 + eb  # val(c) = f * 2^E, 1 <= f < 2
        prod = torch.tensor(vals[c], dtype=torch.float32) * torch.tensor(2.0 ** (eb - 127), dtype=torch.float32)
        if prod >= 2.0**-126:  # normal: the float32 product's biased exponent
            assert q == int(prod.view(torch.int32)) >> 23


def test_map_table():
    # the table holds the zero map, then the maps of k = K_MIN..K_MAX as lo | hi << 32, then the one-hot bytes
    t = _map_table_values()
    assert t[0] == 0 and len(t) == K_MAX - K_MIN + 3
    for i, k in enumerate(range(K_MIN, K_MAX + 1)):
        lo, hi = _lut_words(k)
        assert t[i + 1] == lo | hi << 32
    # then the one-hot bytes 1 << c, c = 0..7 (signed int64)
    assert [(t[-1] >> (8 * c)) & 0xFF for c in range(8)] == [1 << c for c in range(8)]


@pytest.mark.parametrize("cfg", PATHS, ids=PATH_IDS)
def test_fp4_requant_zero_blocks(device, cfg):
    # input blocks whose codes are all +-0 under the largest scale byte of their group: they must not set the group's
    # scale (a zero block's maximum is 0 whatever its scale), nor turn into anything but signed zeros
    gen = torch.Generator().manual_seed(29)
    m, k = pick(cpu=(40, 1024), gpu=(4000, 7168))
    data, sf = _random_fp4(m, k, (1, 32), device, gen, 100, 200)
    blocks = data.view(torch.uint8).view(m, k // 32, 16)  # 32 codes = 16 bytes a block
    zero = (torch.arange(k // 32, device=device) % 3 == 1)[None, :, None]
    blocks.copy_(torch.where(zero, blocks & 0x88, blocks))  # magnitudes 0, random signs
    b = torch.randint(100, 201, (m, k // 32), generator=gen).to(torch.int64)
    b[:, 1::3] = 252
    sf.copy_(_words(b.view(m, -1, 4)).to(device))
    flags = (True, True, True)
    with override_config("per_token_cast", **cfg):
        got = per_token_cast((data, sf), "e2m1", 128, (1, 32), *flags)
    with override_config("per_token_cast", FP4_REQUANT=False):
        want = per_token_cast((data, sf), "e2m1", 128, (1, 32), *flags)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])
