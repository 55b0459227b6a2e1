"""swiglu_backward_and_per_token_cast vs ``swiglu_backward`` + ``cast`` (spec/quant.md §3.9).

out, x_grad, dx_fp8 and dx_sf are compared bitwise (signed zeros included); weight_grad with
TileKernels' tolerance (1e-4; a float sum in any order), and bitwise 0 where token_topk_to_pos is -1.
The reference computes exp and the one fma the way the kernel does on each backend
(``tritile.torch._numerics``).  GPU: TileKernels' grid (12 MoE configs x 6 H x npc x round x clamp);
CPU: two small (MoE config, H) pairs, H = 384 giving a masked chunk under the interpreter.  On the CPU the
MoE configs keep TileKernels' top-k but have fewer local experts (2 instead of 9): the same handful of routed
rows, a quarter of the padding rows (each one a full row of interpreter work).
"""

import math

import pytest
import torch

from tritile.quant import swiglu_backward_and_per_token_cast
from tritile.testing import assert_equal, pick
from tritile.torch import cast, swiglu_backward

try:
    from ._swiglu_utils import MOE_CONFIGS, assert_codes_equal_nan_sign_free, moe_data
except ImportError:
    from _swiglu_utils import MOE_CONFIGS, assert_codes_equal_nan_sign_free, moe_data

_CASES = pick(
    cpu=[((9, 256, 64), 128), ((2, 16, 8), 384)],
    gpu=[(moe, h) for moe in MOE_CONFIGS for h in (2048, 2560, 3072, 4096, 6144, 7168)],
)
# The single-config tests' MoE layout: 9 local experts on the GPU (TileKernels' (6, 72, 8)), 2 on the CPU (26 of
# 256 rows routed at npc 128 against 26 of 1024)
_MOE6 = pick(cpu=(6, 16, 8), gpu=(6, 72, 8))


def _params():
    return [(moe, h, npc, rnd, clamp) for moe, h in _CASES for npc in (32, 128) for rnd in (False, True)
            for clamp in (None, 10.0, 0.5)]


def _id(p):
    moe, h, npc, rnd, clamp = p
    return f"k{moe[0]}-e{moe[1]}-ep{moe[2]}-h{h}-npc{npc}-r{int(rnd)}-clamp{clamp}"


def _data(moe, hidden, npc, device, **kw):
    d = moe_data(moe, hidden, npc, device, **kw)
    x = cast(d["x"], "e4m3", (1, npc))
    w = torch.rand((d["num_tokens"], d["num_topk"]), device=device)
    g = torch.randn((d["x"].shape[0], hidden), dtype=torch.bfloat16, device=device)
    return d, x, w, g


def _check(res, x, g, w, d, npc, rnd, clamp, nan_sign_free=False, wg_equal_nan=False):
    out, (dq, dsf), xg, wg = res
    r_out, r_xg, r_wg = swiglu_backward(x, g, w, d["pos_to_token_topk"], d["token_topk_to_pos"], npc, clamp)
    r_dq, r_dsf = cast(r_xg, "e4m3", (1, npc), round_sf=rnd)
    if nan_sign_free:  # NaN payloads: compare NaN positions, the rest bitwise
        for a, b in ((out, r_out.bfloat16()), (xg, r_xg.bfloat16())):
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            assert_equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(b, 0.0))
        assert_codes_equal_nan_sign_free(dq, r_dq)
    else:
        assert_equal(out, r_out.bfloat16())
        assert_equal(xg, r_xg.bfloat16())
        assert_equal(dq, r_dq)
    assert_equal(dsf, r_dsf)
    assert wg.dtype == torch.float32 and wg.shape == w.shape
    torch.testing.assert_close(wg, r_wg, atol=1e-4, rtol=1e-4, equal_nan=wg_equal_nan)
    missing = d["token_topk_to_pos"] < 0
    assert_equal(wg[missing], torch.zeros_like(wg[missing]))


@pytest.mark.parametrize("params", _params(), ids=_id)
def test_swiglu_backward_and_per_token_cast(device, params):
    moe, hidden, npc, rnd, clamp = params
    d, x, w, g = _data(moe, hidden, npc, device)
    res = swiglu_backward_and_per_token_cast(x, g, w, d["pos_to_token_topk"], d["token_topk_to_pos"],
                                             num_per_channels=npc, round_sf=rnd, swiglu_clamp_value=clamp)
    _check(res, x, g, w, d, npc, rnd, clamp)


def test_packed_sf_3d_and_strided(device):
    """x with packed UE8M0 column-major sf, x given as 3D, grad_out with strided rows: same results."""
    hidden, npc = pick(cpu=256, gpu=4096), 128
    d = moe_data(pick(cpu=(9, 128, 64), gpu=(9, 256, 64)), hidden, npc, device)  # 2 / 4 local experts
    xq = cast(d["x"], "e4m3", (1, npc), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    w = torch.rand((d["num_tokens"], d["num_topk"]), device=device)
    n = d["x"].shape[0]
    g_big = torch.randn((n, hidden + 64), dtype=torch.bfloat16, device=device)
    g = g_big[:, :hidden]
    args = (w, d["pos_to_token_topk"], d["token_topk_to_pos"])
    res = swiglu_backward_and_per_token_cast(xq, g, *args, num_per_channels=npc, round_sf=True,
                                             swiglu_clamp_value=0.5)
    _check(res, xq, g, w, d, npc, True, 0.5)
    # 3D data (2, n/2, 2H) with its sf (2, n/2, 2H/npc): the same bits as the 2D call
    xf = cast(d["x"], "e4m3", (1, npc))
    res2 = swiglu_backward_and_per_token_cast(xf, g.contiguous(), *args, num_per_channels=npc)
    res3 = swiglu_backward_and_per_token_cast((xf[0].reshape(2, n // 2, -1), xf[1].reshape(2, n // 2, -1)),
                                              g.reshape(2, n // 2, hidden), *args, num_per_channels=npc)
    for a, b in zip((res2[0], res2[1][0], res2[1][1], res2[2], res2[3]),
                    (res3[0], res3[1][0], res3[1][1], res3[2], res3[3])):
        assert_equal(a, b)


def test_zero_rows(device):
    hidden, npc, T, K = 256, 128, 5, 3
    x = (torch.empty((0, 2 * hidden), dtype=torch.float8_e4m3fn, device=device),
         torch.empty((0, 2 * hidden // npc), device=device))
    g = torch.empty((0, hidden), dtype=torch.bfloat16, device=device)
    w = torch.rand((T, K), device=device)
    ttp = torch.full((T, K), -1, dtype=torch.int32, device=device)
    out, (dq, dsf), xg, wg = swiglu_backward_and_per_token_cast(
        x, g, w, torch.empty(0, dtype=torch.int32, device=device), ttp, npc, round_sf=True, swiglu_clamp_value=0.5)
    assert out.shape == (0, hidden) and out.dtype == torch.bfloat16
    assert dq.shape == (0, 2 * hidden) and dq.dtype == torch.float8_e4m3fn
    assert dsf.shape == (0, 2 * hidden // npc) and dsf.dtype == torch.float32
    assert xg.shape == (0, 2 * hidden) and xg.dtype == torch.bfloat16
    assert_equal(wg, torch.zeros((T, K), device=device))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite(device):
    """A NaN code in x: the groups of dx it reaches get sf = +inf and NaN codes; the rest is bitwise."""
    hidden, npc = 128, 32
    d, x, w, g = _data(_MOE6, hidden, npc, device)
    rows = (d["pos_to_token_topk"] >= 0).nonzero().flatten()[:3]
    data = x[0].clone()
    data.view(torch.uint8)[rows[0], 3] = 0x7F            # xf = NaN
    data.view(torch.uint8)[rows[1], hidden + 40] = 0xFF  # yf = NaN
    x = (data, x[1])
    res = swiglu_backward_and_per_token_cast(x, g, w, d["pos_to_token_topk"], d["token_topk_to_pos"], npc)
    out, (dq, dsf), xg, wg = res
    # xf NaN at column 3 poisons dx[:, 3] (group 0) and dx[:, H + 3] (group H/npc); yf NaN at column 40
    # poisons dx[:, 40] (group 1) only (dx[:, H + j] = gws * xf does not involve yf)
    for r, gi in ((rows[0], 0), (rows[0], hidden // npc), (rows[1], 1)):
        assert dsf[r, gi].item() == float("inf")
    assert torch.isfinite(dsf[rows[1], hidden // npc:]).all()
    r_out, r_xg, r_wg = swiglu_backward(x, g, w, d["pos_to_token_topk"], d["token_topk_to_pos"], npc)
    r_dq, r_dsf = cast(r_xg, "e4m3", (1, npc))
    assert_equal(dsf, r_dsf)
    assert_codes_equal_nan_sign_free(dq, r_dq)
    for a, b in ((out, r_out.bfloat16()), (xg, r_xg.bfloat16())):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert_equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(b, 0.0))



@pytest.mark.parametrize("path", [dict(FAST_DIV=False), dict(),
                                  dict(FAST_ENC=False, FAST_MAX=False, MINMAX_CLAMP=False, MASK_FLAGS=False),
                                  dict(ROWSUM_PAIRS=True, CH=128)],
                         ids=["div_rn", "default", "slow_flags", "rowsum_pairs"])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_code_paths(device, path, clamp):
    """The division paths (config keys): ``div_rn`` twice, the shared 4-wide reciprocal/division (the default),
    and the flags off, each bitwise against the reference."""
    from tritile.runtime import override_config

    npc = 128
    d, x, w, g = _data(_MOE6, 256, npc, device)
    with override_config("swiglu_backward_and_per_token_cast", **path):
        res = swiglu_backward_and_per_token_cast(x, g, w, d["pos_to_token_topk"], d["token_topk_to_pos"],
                                                 num_per_channels=npc, round_sf=True, swiglu_clamp_value=clamp)
    _check(res, x, g, w, d, npc, True, clamp)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("clamp", [None, 0.5, 0.0, -0.0])
def test_every_e4m3(device, clamp):
    """Every e4m3 code (NaN codes included) as x and as y, under scales from 2^-130 (subnormal xf) to 2^90
    (xf past the exp overflow): the 4-wide division's fast and slow paths against the reference.  c = +-0
    checks the signed zeros of the clamp (c = -0.0 takes the comparison path: ``_minmax_clamp_ok``)."""
    if clamp == 0.0 and math.copysign(1.0, clamp) < 0 and device.type == "cpu":
        pytest.skip("the interpreter passes a -0.0 scalar argument as +0.0 (compared on the GPU only)")
    hidden, npc = 256, 128
    scales = [1.0, 2.0**-130, 2.0**-100, 2.0**-60, 2.0**-10, 0.37, 3.0, 2.0**20, 2.0**60, 2.0**90]
    n = 2 * len(scales)
    gen = torch.Generator(device="cpu").manual_seed(0)
    codes = torch.stack([torch.randperm(256, generator=gen) for _ in range(2 * n)]).to(torch.uint8)
    data = torch.cat([codes[:n], codes[n:]], dim=1).to(device).view(torch.float8_e4m3fn)  # (n, 2H)
    sf = torch.tensor(scales * 2, dtype=torch.float32, device=device)[:, None].repeat(1, 2 * hidden // npc)
    sf[len(scales):] = sf[len(scales):].flip(0)  # other (x, y) scale pairs in the second half
    sf[:, 1::2] = sf[:, 1::2].roll(3, 0)
    x = (data, sf)
    w = torch.rand((n, 1), device=device)
    g = torch.randn((n, hidden), dtype=torch.bfloat16, device=device)
    idx = torch.arange(n, dtype=torch.int32, device=device)
    d = dict(pos_to_token_topk=idx, token_topk_to_pos=idx.reshape(n, 1))
    res = swiglu_backward_and_per_token_cast(x, g, w, idx, idx.reshape(n, 1), npc, round_sf=True,
                                             swiglu_clamp_value=clamp)
    _check(res, x, g, w, d, npc, True, clamp, nan_sign_free=True, wg_equal_nan=True)  # NaN codes: NaN row sums


def test_bad_inputs(device):
    H, npc, E, T, K = 128, 128, 8, 4, 2
    data = torch.zeros((E, 2 * H), dtype=torch.float8_e4m3fn, device=device)
    sf = torch.ones((E, 2 * H // npc), device=device)
    g = torch.zeros((E, H), dtype=torch.bfloat16, device=device)
    w = torch.rand((T, K), device=device)
    ptt = torch.full((E,), -1, dtype=torch.int32, device=device)
    ttp = torch.full((T, K), -1, dtype=torch.int32, device=device)
    f = swiglu_backward_and_per_token_cast
    f((data, sf), g, w, ptt, ttp, npc)  # valid
    with pytest.raises(TypeError, match="x"):
        f(data, g, w, ptt, ttp, npc)
    with pytest.raises(TypeError, match=r"x\[0\]"):
        f((data.float(), sf), g, w, ptt, ttp, npc)
    with pytest.raises(ValueError, match=r"x\[0\]"):
        f((data[:, :200], sf), g, w, ptt, ttp, npc)
    with pytest.raises(ValueError, match=r"x\[1\]"):
        f((data, sf[:, :1]), g, w, ptt, ttp, npc)
    with pytest.raises(TypeError, match=r"x\[1\]"):
        f((data, sf.double()), g, w, ptt, ttp, npc)
    with pytest.raises(ValueError, match="num_per_channels"):
        f((data, sf), g, w, ptt, ttp, 64)
    with pytest.raises(TypeError, match="grad_out"):
        f((data, sf), g.float(), w, ptt, ttp, npc)
    with pytest.raises(ValueError, match="grad_out"):
        f((data, sf), g[:4], w, ptt, ttp, npc)
    with pytest.raises(TypeError, match="weight"):
        f((data, sf), g, w.half(), ptt, ttp, npc)
    with pytest.raises(ValueError, match="weight"):
        f((data, sf), g, w.T, ptt, ttp.T.contiguous(), npc)
    with pytest.raises(TypeError, match="pos_to_token_topk"):
        f((data, sf), g, w, ptt.long(), ttp, npc)
    with pytest.raises(ValueError, match="pos_to_token_topk"):
        f((data, sf), g, w, ptt[:3], ttp, npc)
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        f((data, sf), g, w, ptt, ttp[:, :1], npc)
    with pytest.raises(TypeError, match="token_topk_to_pos"):
        f((data, sf), g, w, ptt, ttp.long(), npc)
    with pytest.raises(ValueError, match="swiglu_clamp_value"):
        f((data, sf), g, w, ptt, ttp, npc, swiglu_clamp_value=-0.5)
    with pytest.raises(TypeError, match="round_sf"):
        f((data, sf), g, w, ptt, ttp, npc, round_sf=None)


@pytest.mark.parametrize("cfg,match", [(dict(FUSED_BWD=8), "FUSED_BWD"), (dict(RCP=True), "RCP"),
                                       (dict(CH=96), "CH")])
def test_bad_launch_config(device, cfg, match):
    """A tuning override the kernel has no code for (an unknown key, FUSED_BWD other than 0 or 4, a CH that is not a
    power of two) raises a ValueError naming it, before any launch."""
    from tritile.runtime import override_config

    H, npc, E = 128, 32, 4
    x = (torch.zeros((E, 2 * H), dtype=torch.float8_e4m3fn, device=device),
         torch.ones((E, 2 * H // npc), device=device))
    g = torch.zeros((E, H), dtype=torch.bfloat16, device=device)
    ptt = torch.full((E,), -1, dtype=torch.int32, device=device)
    ttp = torch.full((1, 1), -1, dtype=torch.int32, device=device)
    with override_config("swiglu_backward_and_per_token_cast", **cfg), pytest.raises(ValueError, match=match):
        swiglu_backward_and_per_token_cast(x, g, torch.zeros((1, 1), device=device), ptt, ttp, npc)


# Same-bits instruction-count candidates (config keys; sm_90a counts in tritile/bench/cases/quant.py's _BWD_TUNE).
# Under the interpreter FUSED_BWD runs its element-wise stand-in (inline PTX cannot run there; XORSIGN_CLAMP is part
# of the PTX) and INT_SCALE itself; on the GPU the same tests run the PTX.
_ALL_CANDIDATES = dict(FUSED_BWD=4, XORSIGN_CLAMP=True, INT_SCALE=True)
_CANDIDATE_CASES = [(_ALL_CANDIDATES, 128, False, 0.5, True), (_ALL_CANDIDATES, 32, True, None, True),
                    (_ALL_CANDIDATES, 32, False, 0.0, False), (dict(FUSED_BWD=4), 32, False, 0.5, True),
                    (dict(INT_SCALE=True), 32, False, 0.5, True),
                    # CH=128 and BLOCK_R=4 on the CPU (the GPU test keeps its launch shape): two chunks and four rows
                    # a program
                    (dict(_ALL_CANDIDATES, CH=128, BLOCK_R=4), 32, False, 0.5, True),
                    (dict(CH=128, BLOCK_R=4), 32, True, None, False)]


@pytest.mark.parametrize("path,npc,packed_sf,clamp,rnd", _CANDIDATE_CASES,
                         ids=lambda p: "-".join(f"{k}{int(v)}" for k, v in p.items()) if isinstance(p, dict) else str(p))
def test_candidate_paths(device, path, npc, packed_sf, clamp, rnd):
    """Each candidate config (all together, FUSED_BWD alone, INT_SCALE alone) on the default GPU launch shape
    ([1, 512] x 1 warp with ROWSUM_PAIRS; the interpreter's default on the CPU): out, x_grad, dx codes and scales
    bitwise against the reference, weight_grad within the op's tolerance."""
    from tritile.runtime import override_config

    hidden = pick(cpu=256, gpu=2048)
    d, x, w, g = _data(_MOE6, hidden, npc, device)
    if packed_sf:
        x = cast(d["x"], "e4m3", (1, npc), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    cfg = dict(path)
    if device.type == "cuda":
        cfg.update(BLOCK_R=1, CH=512, num_warps=1, ROWSUM_PAIRS=True)  # the GPU default's launch shape
    with override_config("swiglu_backward_and_per_token_cast", **cfg):
        res = swiglu_backward_and_per_token_cast(x, g, w, d["pos_to_token_topk"], d["token_topk_to_pos"],
                                                 num_per_channels=npc, round_sf=rnd, swiglu_clamp_value=clamp)
    _check(res, x, g, w, d, npc, rnd, clamp)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("clamp", pick(cpu=[None, 0.5], gpu=[None, 0.5, 10.0, 0.0, 0.3]))
def test_candidates_all_bf16_x_values(device, clamp):
    """Every bf16 pattern as xf (NaN, +-inf, subnormals; code 1.0 times a per-group scale equal to it; under the
    interpreter every 32nd pattern and all the special ones, to keep it short) through all the candidates at once: exp, s and xf / t (the fused block on the GPU) depend on xf alone, so this checks them
    exhaustively, and the division's slow path (|xf| > 41 or inf in a thread's four values); yf, grad_out and the
    weights random.  out, x_grad (NaN positions, the rest bitwise), dx codes (NaN codes sign-free) and scales."""
    from tritile.runtime import override_config

    hidden, npc = 256, 32
    hg = hidden // npc
    i = torch.arange(65536, dtype=torch.int32)
    if device.type == "cpu":  # the interpreter: every 32nd pattern (4 mantissas of every exponent and sign), all
        # NaN / inf / subnormal / zero ones, |x| near 41
        e = (i >> 7) & 0xFF
        i = i[(i % 32 == 0) | (e == 0) | (e == 0xFF) | ((i & 0x7FFF) - 0x4224).abs().le(4)]
        i = torch.cat([i, i[: (-i.numel()) % hg]])
    n = i.numel() // hg  # rows: one bf16 pattern per x group
    gen = torch.Generator(device="cpu").manual_seed(1)
    v = i.to(torch.int16).view(torch.bfloat16).float()
    codes = torch.randint(0, 256, (n, 2 * hidden), generator=gen, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x3F
    codes[codes == 0xFF] = 0xBF
    codes[:, :hidden] = 0x38  # 1.0: xf = the group's scale
    sf = torch.empty((n, 2 * hg))
    sf[:, :hg] = v.reshape(n, hg)
    sf[:, hg:] = torch.rand((n, hg), generator=gen) * 0.25 + 2.0 ** torch.randint(-8, 4, (n, hg), generator=gen)
    x = (codes.view(torch.float8_e4m3fn).to(device), sf.to(device))
    g = torch.randn((n, hidden), generator=gen).to(torch.bfloat16).to(device)
    w = torch.rand((n, 1), generator=gen).to(device)
    idx = torch.arange(n, dtype=torch.int32, device=device)
    cfg = dict(FUSED_BWD=4, XORSIGN_CLAMP=True, INT_SCALE=True)
    if device.type == "cuda":
        cfg.update(BLOCK_R=1, CH=256, num_warps=1, ROWSUM_PAIRS=False)
    else:
        cfg.update(BLOCK_R=256)  # few interpreter programs
    with override_config("swiglu_backward_and_per_token_cast", **cfg):
        out, (dq, dsf), xg, _ = swiglu_backward_and_per_token_cast(x, g, w, idx, idx.reshape(n, 1), npc, round_sf=True,
                                                                   swiglu_clamp_value=clamp)
    r_out, r_xg, _ = swiglu_backward(x, g, w, idx, idx.reshape(n, 1), npc, clamp)
    r_dq, r_dsf = cast(r_xg, "e4m3", (1, npc), round_sf=True)
    for a, b in ((out, r_out.bfloat16()), (xg, r_xg.bfloat16())):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert_equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(b, 0.0))
    assert_codes_equal_nan_sign_free(dq, r_dq)
    assert_equal(dsf, r_dsf)


# Launches of several chunks a row: ragged row blocks (21 rows) and a ragged last chunk (hidden % CH != 0), random codes
# (NaN codes and |x| past 41 included, so the division's slow path runs too).
def _loop_data(device, hidden, npc, no_weights=False, finite=False):
    gen = torch.Generator(device="cpu").manual_seed(hidden)
    n = 21
    codes = torch.randint(0, 256, (n, 2 * hidden), generator=gen, dtype=torch.uint8)
    if finite:  # no NaN codes (0x7F / 0xFF) and |x| <= 448 * 1.5: finite row sums
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    sf = 2.0 ** torch.randint(-4, 1 if finite else 7, (n, 2 * hidden // npc), generator=gen).float()  # |x| past 41:
    # slow paths too
    sf *= 1.0 + torch.rand(sf.shape, generator=gen) * 0.5
    x = (codes.view(torch.float8_e4m3fn).to(device), sf.to(device))
    g = torch.randn((n, hidden), generator=gen).to(torch.bfloat16).to(device)
    if no_weights:  # no routing weights at all: every w is 0
        w = torch.empty((0, 1), device=device)
        ptt = torch.full((n,), -1, dtype=torch.int32)
        ttp = torch.empty((0, 1), dtype=torch.int32)
    else:
        w = torch.rand((n, 1), generator=gen).to(device)
        ptt = torch.arange(n, dtype=torch.int32)
        ptt[::5] = -1  # rows without a weight
        ttp = torch.where(ptt >= 0, ptt, -1).reshape(n, 1)
    return x, g, w, ptt.to(device), ttp.to(device)


def _loop_run(device, cfg, hidden, npc, clamp, no_weights=False, finite=False):
    from tritile.runtime import override_config

    x, g, w, ptt, ttp = _loop_data(device, hidden, npc, no_weights, finite)
    with override_config("swiglu_backward_and_per_token_cast", **cfg):
        out, (dq, dsf), xg, wg = swiglu_backward_and_per_token_cast(x, g, w, ptt, ttp, num_per_channels=npc,
                                                                     round_sf=True, swiglu_clamp_value=clamp)
    return out, dq, dsf, xg, wg


# (overrides, hidden, clamp, no_weights); CPU: CH=64, BLOCK_R=8 (3 row blocks); GPU: CH=256 at its launch shape
_LOOP_H = pick(cpu=352, gpu=1408)  # 6 chunks, the last one half masked
_LOOP_CASES = [({}, _LOOP_H, 0.5, False), ({}, _LOOP_H, None, False), ({}, _LOOP_H, 0.5, True),  # no weights
               ({}, pick(cpu=288, gpu=1152), 0.5, False)]  # 5 chunks


def _path_cases(cases):
    """Parametrize over ``(path, hidden, clamp, no_weights)`` (ids from the config keys), with the interpreter's
    overflow / NaN warnings of the random codes filtered."""
    def deco(fn):
        fn = pytest.mark.parametrize("path,hidden,clamp,no_weights", cases,
                                     ids=lambda p: "-".join(f"{k}{int(v)}" for k, v in p.items())
                                     if isinstance(p, dict) else str(p))(fn)
        fn = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")(fn)
        return pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")(fn)
    return deco


@_path_cases(_LOOP_CASES)
def test_chunk_loop(device, path, hidden, clamp, no_weights):
    """Whole rows a program (SPLIT=1) over several chunks against the reference (NaN codes in the data: NaN signs
    free, NaN row sums)."""
    npc = 32
    base = dict(CH=64, BLOCK_R=8, SPLIT=1) if device.type == "cpu" else dict(CH=256, SPLIT=1)
    res = _loop_run(device, dict(base, **path), hidden, npc, clamp, no_weights)
    x, g, w, ptt, ttp = _loop_data(device, hidden, npc, no_weights)
    out, dq, dsf, xg, wg = res
    _check((out, (dq, dsf), xg, wg), x, g, w, dict(pos_to_token_topk=ptt, token_topk_to_pos=ttp), npc, True, clamp,
           nan_sign_free=True, wg_equal_nan=True)


# SPLIT (H200, 2026-11-30, commit fd8764c): each row block's chunks over SPLIT programs (ceil(chunks / SPLIT) a part but
# the last), the parts' row sums added by the weight_grad kernel: every output keeps its bits but weight_grad, a float32
# sum in another order (TileKernels' test compares it with a tolerance: so does this one, and the reference check below)
_SPLIT_CASES = [
    (dict(SPLIT=2), _LOOP_H, 0.5, False),                        # 6 chunks: 3 + 3 (the second part starts odd)
    (dict(SPLIT=2), pick(cpu=288, gpu=1152), 0.5, False),      # 5 chunks: 3 + 2
    (dict(SPLIT=2), pick(cpu=288, gpu=1152), None, True),      # no weights
    (dict(SPLIT=2), _LOOP_H + pick(cpu=64, gpu=256), 0.5, False),  # 7 chunks: 4 + 3
    # plain row sums (a chunk summed twice would hide in ROWSUM_PAIRS' pending sum)
    (dict(SPLIT=2, ROWSUM_PAIRS=False), _LOOP_H, None, False),
]


@_path_cases(_SPLIT_CASES)
def test_split_parts(device, path, hidden, clamp, no_weights):
    npc = 32
    # ROWSUM_PAIRS (the GPU default's row-sum order: chunk pairs): a part's odd last chunk adds its pending sum
    base = dict(CH=64, BLOCK_R=8, ROWSUM_PAIRS=True, SPLIT=1) if device.type == "cpu" else \
        dict(CH=256, ROWSUM_PAIRS=True, SPLIT=1)
    ref = _loop_run(device, base, hidden, npc, clamp, no_weights, finite=True)
    res = _loop_run(device, dict(base, **path), hidden, npc, clamp, no_weights, finite=True)
    for a, b in zip(res[:4], ref[:4]):
        assert_equal(a, b)
    assert torch.isfinite(ref[4]).all() and (no_weights or (ref[4] != 0).any())  # a row-sum order can show
    torch.testing.assert_close(res[4], ref[4], atol=1e-4, rtol=1e-4)
    x, g, w, ptt, ttp = _loop_data(device, hidden, npc, no_weights, finite=True)
    out, dq, dsf, xg, wg = res
    _check((out, (dq, dsf), xg, wg), x, g, w, dict(pos_to_token_topk=ptt, token_topk_to_pos=ttp), npc, True, clamp)


def test_split_part_counts():
    from tritile.quant.swiglu_backward_and_per_token_cast_kernel import _split_parts

    for chunks in range(1, 40):
        for split in range(1, 12):
            s = _split_parts(chunks, split)
            cpp = -(-chunks // s)  # the kernel's chunks a part
            assert 1 <= s <= max(1, min(split, chunks))
            assert (s - 1) * cpp < chunks <= s * cpp  # every part holds a chunk, every chunk a part
    assert _split_parts(14, 2) == 2 and _split_parts(14, 7) == 7 and _split_parts(14, 5) == 5
    assert _split_parts(14, 6) == 5 and _split_parts(5, 4) == 3
