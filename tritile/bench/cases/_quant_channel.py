"""Benchmark registrations of the per-channel casts: per_channel_cast, per_channel_cast_fused,
per_channel_cast_and_transpose.

GPU: TileKernels' anchor shapes (plus a gathered and an FP8-input case of the fused cast, without an
anchor), or with ``grid=True`` its whole benchmark grid (``_quant_grid``); CPU: small shapes (a correctness
pass only).  Bytes as TileKernels counts them: every input read once (a QuantTensor counts data + sf), every
output written once.
"""

from __future__ import annotations

import torch

from tritile.bench import Case, register
from tritile.testing import assert_equal, count_bytes

from . import _quant_grid as _grid
from tritile.quant.per_channel_cast_and_transpose_kernel import per_channel_cast_and_transpose
from tritile.quant.per_channel_cast_fused_kernel import per_channel_cast_fused
from tritile.quant.per_channel_cast_kernel import per_channel_cast

_M = "quant"

# Tuning sweeps (``python -m tritile tune --op OP``), GPU anchor cases only.  Plain per-channel cast, 128-row
# blocks: BLOCK_K columns per program, ROWS_PER_STEP (128: the block in registers, one read; else two
# streamed passes), warps, FINITE_BRANCH (skip the NaN patch of finite tiles), VEC (columns per thread; 0 =
# Triton's choice).
# Default (no input sf, H200 @ 65d4724): WORDS + HMUL_ENC on the one-pass [128, 128] x 4 warps tile (INT_POW2): 25.22 /
# 25.06 us CUPTI (round_sf off / on; per_channel_cast_fused 25.17) against 26.52 / 26.39 for the H200 @ 2615106 default
# (the element kernel, the first candidate).  WORDS (``_per_channel_cast_words_kernel``, same bits): the block as int32
# words of two bf16; sm_90a at [128, 128] x 4 warps (registers, SASS instructions per element, round_sf off / on;
# an sm_90a ptxas / SASS count): element kernel 127 / 128, 9.82 / 8.48 (4 blocks per SM); WORDS 94 / 106, 8.24 /
# 6.41; WORDS + HMUL_ENC 94 / 96, 8.24 / 5.97 (5 blocks per SM).  H200 @ 65d4724 sweep (us, round_sf off / on): WORDS
# alone 25.22 / 25.46, + maxnreg=88 25.67 / 25.93, BLOCK_K=64 26.21 / 25.98, 8 warps 25.98 / 26.00; maxnreg=80
# spilled (25.1 / 23.7 us graph against 22.7 / 22.3).  The element kernel's knobs: BLOCK_K (columns), ROWS_PER_STEP
# (128 one pass; 16-64 two streamed passes), warps, FINITE_BRANCH, VEC, SIGNED_ENC (the NaN patch as a byte merge
# per four codes; sm_90 [128, 64] x 4 warps: 18.0 -> 11.2 instructions per element), INT_POW2 (round_sf scales
# from amax's bits).
_EL = dict(WORDS=False, HMUL_ENC=False)
_TUNE_CHANNEL = [
    dict(_EL),  # the H200 @ 2615106 default (26.52 / 26.39 us)
    dict(_EL, SIGNED_ENC=0, INT_POW2=False, BLOCK_K=64),  # the H200 @ 8b7524c default (30.1-30.8 us graph)
    dict(_EL, BLOCK_K=64),  # the first H200 @ 694bd6c default (27.0-27.1 us CUPTI)
    dict(_EL, BLOCK_K=128, ROWS_PER_STEP=32), dict(_EL, BLOCK_K=64, num_warps=8),
    dict(HMUL_ENC=False), dict(maxnreg=88), dict(BLOCK_K=64), dict(num_warps=8), dict(BLOCK_K=256, num_warps=8),
    # H200 @ bc6f44a candidates on the WORDS kernel (same bits; sm_90a at the anchor, an sm_90a ptxas / SASS count: registers,
    # SASS instructions per element, round_sf off / on; the default 94 / 96, 8.24 / 5.97, 5 blocks per SM):
    # STATIC_STRIDES (the row strides as constexprs: one base register plus immediate offsets per row, no 64-bit
    # address arithmetic per load / store; one compile per stride) 95 / 94, 7.22 / 4.96; FAST_DIV (round_sf off: the
    # two IEEE divisions of each column's scales on a's mantissa, the fast path of div.rn without its range check and
    # slow-path call) 96, 7.05; both 96 / 94, 6.05 / 4.96; with maxnreg=80 (6 blocks per SM) 80 / 80, 6.24 / 5.01, a
    # 32-byte / no spill; BLOCK_K=64 56 / 48 registers (9 / 10 blocks of 4 warps per SM), 8.03 / 6.36; 8 warps
    # 57 / 57, 8.16 / 6.48.  H200 @ bc6f44a sweep (CUPTI, round_sf off, per_channel_cast / _fused): both 24.99 / 24.96 us
    # (the new default), STATIC_STRIDES 25.03 / 25.12, FAST_DIV 25.12 / 25.10, neither (the H200 @ 65d4724 default) 25.28 /
    # 25.28, HMUL_ENC=False 25.09 / 25.22, maxnreg=88 25.61 / 25.80
    dict(STATIC_STRIDES=False, FAST_DIV=False), dict(STATIC_STRIDES=False), dict(FAST_DIV=False),
    dict(maxnreg=80),
    # H200 @ 4d49e57: KFAST on the WORDS kernel (the grid's first dimension over the column blocks; it took four casts -2
    # to -5 % in H200 @ fd8764c).  First sweep (CUPTI, per_channel_cast / _fused, the default 25.03 / 24.93 us): KFAST
    # 23.89 / 24.13, with BLOCK_K=64 24.63 / 24.69
    dict(KFAST=True), dict(KFAST=True, BLOCK_K=64), dict(KFAST=True, BLOCK_K=256, num_warps=8),
    dict(KFAST=True, num_warps=8), dict(KFAST=True, maxnreg=80), dict(KFAST=False),
]
# per_channel_cast_and_transpose.  Defaults (H200 sweeps, 2026-11-30 and H200 @ 694bd6c): npt 128: [128, 64] x 4 warps
# (KFAST since H200 @ 4d49e57), npt 32: [32, 128] x 2 warps; SIGNED_ENC=2; VEC=8, PERM (each thread's rows are consecutive
# tokens: words packed in registers), FINITE_BRANCH off, words.  The first candidate of each list is the first version
# (npt 128: 121.2 us).
_TUNE_TRANSPOSE = {
    128: [dict(BLOCK_K=32, num_warps=2, SIGNED_ENC=0),  # the H200 @ 8b7524c default (57.9-58.6 us)
          dict(BLOCK_K=64, num_warps=8, VEC=0, PERM=False, SIGNED_ENC=0), dict(BLOCK_K=32, num_warps=2),
          dict(FINITE_BRANCH=True), dict(maxnreg=96, FINITE_BRANCH=True), dict(BLOCK_K=16, num_warps=1),
          dict(BLOCK_K=64, num_warps=2), dict(num_warps=4), dict(num_stages=1), dict(PERM=False),
          # SIGNED_ENC (same bits; sm90 hot path per element: default 19.8 instructions / 96 registers,
          # SIGNED_ENC=2 14.0 / 66)
          dict(SIGNED_ENC=2), dict(SIGNED_ENC=1), dict(SIGNED_ENC=2, BLOCK_K=64, num_warps=4),
          dict(SIGNED_ENC=2, BLOCK_K=16, num_warps=1), dict(SIGNED_ENC=2, BLOCK_K=64, num_warps=2),
          dict(SIGNED_ENC=2, INT_POW2=True),
         # H200 @ fd8764c: KFAST (the grid's first dimension over the column blocks; the default since H200 @ 4d49e57) and a
         # register cap (95 -> 80: 6 blocks an SM instead of 5).  scripts/steady_probe.py: 95.2 % of copy in steady
         # state, 4.22 us fixed cost against a copy's 2.50.  Two sweeps (CUPTI, the default 47.05 / 47.07 us): KFAST
         # 46.94 / 46.87 (within the spread: not switched then), maxnreg=80 47.06 / 47.11, both 47.89 / 47.92
         dict(KFAST=False), dict(maxnreg=80), dict(KFAST=True, maxnreg=80),
         # H200 @ 4d49e57: a third sweep, KFAST 46.87 against 47.75, made it the default at npt 128 (KFAST=False above
         # is the old order).  Its fixed cost (4.46 us against a copy's 2.86, steady_probe) is the tail of ~4 us
         # programs; shorter programs and fewer elements a thread lost (KFAST, us): [128, 32] x 2 warps 51.59, x 1
         # warp 51.21 (64-byte row reads), [128, 64] x 8 warps 63.42 (59.79 without KFAST), [128, 128] x 8 warps
         # 56.22 (56.98); removed
         ],
    32: [dict(SIGNED_ENC=0),  # the H200 @ 8b7524c default (57.5-59.1 us)
         dict(BLOCK_K=128, num_warps=4, VEC=0, PERM=False), dict(BLOCK_K=256, num_warps=4),
         dict(BLOCK_K=64, num_warps=1), dict(BLOCK_K=256, num_warps=2), dict(FINITE_BRANCH=True),
         dict(BLOCK_K=64, num_warps=2), dict(num_stages=1), dict(PERM=False),
         dict(SIGNED_ENC=2), dict(SIGNED_ENC=2, BLOCK_K=64, num_warps=1), dict(SIGNED_ENC=2, BLOCK_K=256, num_warps=4),
         dict(SIGNED_ENC=2, INT_POW2=True),
         # H200 @ 4d49e57: KFAST (the npt-128 default since then) lost here (CUPTI, round_sf off / on): 49.36 / 49.37 us
         # against 48.53-48.71 / 48.72-48.79; at npt 128 in the same sweep 46.99 / 47.07 against 47.56 / 47.52
         dict(KFAST=True)],
}


def _check_pair(out, ref):
    assert_equal(out[0], ref[0])
    assert_equal(out[1], ref[1])


def _ref_fused(x, round_sf, npc=None, pos=None):
    from tritile.torch.per_channel_cast_fused import per_channel_cast_fused as ref

    return ref(x, 128, npc, round_sf, pos)


def _plain_shape(device, m, k, kernel, npts, rnds, call, ref, npt_key, show_npt, tunes):
    """One bf16 ``(m, k)`` input's cases of a plain per-channel cast, one per ``(npt, round_sf)``: ``call(x, npt, rnd)``
    and ``ref(x, npt, rnd)``; TileKernels names npt ``npt_key`` in the kernel's record; ``tunes`` maps
    ``(m, k, npt)`` to the tuning candidates there."""
    gpu = device.type == "cuda"
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    for npt in npts:
        for rnd in rnds:
            out = call(x, npt, rnd)
            params = dict(num_tokens=m, hidden=k, dtype="bf16", **({"num_per_tokens": npt} if show_npt else {}),
                          round_sf=rnd)
            yield Case(params=params, fn=lambda a=(x, npt, rnd): call(*a), ref=lambda a=(x, npt, rnd): ref(*a),
                       check=_check_pair, nbytes=count_bytes(x, out),
                       anchor=(kernel, {"dtype": "bf16", "hidden": k, npt_key: npt, "num_tokens": m, "round_sf": rnd})
                       if gpu else None,
                       tune=(kernel, tunes[m, k, npt]) if gpu and (m, k, npt) in tunes else None)
            del out


def _plain_shapes(device, quick, grid, default):
    """TileKernels' benchmark grid of the plain per-channel casts (``generate_num_tokens(128)`` x
    ``generate_hidden_sizes()``), else the anchor shape ``default`` (GPU, CPU)."""
    return _grid.shapes(device, 128) if _grid.on(quick, grid) else [default[device.type != "cuda"]]


@register(_M, "per_channel_cast")
def _per_channel_cast_cases(device, quick, grid=False):
    """The anchor shape (round_sf off / on), or TileKernels' grid: M 4096 / 8064 x its 7 hidden sizes x round_sf."""
    for m, k in _plain_shapes(device, quick, grid, ((4096, 7168), (256, 576))):
        yield from _plain_shape(device, m, k, "per_channel_cast", npts=(128,),
                                rnds=(False,) if quick else (False, True),
                                call=lambda x, npt, rnd: per_channel_cast(x, "e4m3", npt, rnd),
                                ref=lambda x, npt, rnd: _ref_fused(x, rnd), npt_key="num_per_tokens", show_npt=False,
                                tunes={(4096, 7168, 128): _TUNE_CHANNEL})


#: The fused cast's anchor (TileKernels' record): a plain 4096 x 7168 input, no map.
_FUSED_ANCHOR = dict(hidden=7168, is_fused_cast_back=False, num_ep_ranks=0, num_experts=0, num_per_channels=128,
                     num_per_tokens=128, num_tokens=4096, num_topk=0, round_sf=False)


# A QuantTensor input (is_fused_cast_back): the default is the hardware e4m3 decode (HW_DECODE, same bits) in 64-row
# steps of [128, 128] blocks: 32.44 us at 4096 x 7168 on the H200 (CUPTI, 2026-12-02, commit be9d783), against 81.52
# for the software decode in 32-row steps.  sm_90 SASS of the [128, 128] x 4 warps program, 32-row steps: 2296 ->
# 1120 static instructions with HW_DECODE.
_TUNE_CAST_BACK = [
    dict(ROWS_PER_STEP=32), dict(ROWS_PER_STEP=16), dict(HW_DECODE=False, ROWS_PER_STEP=32),
    dict(ROWS_PER_STEP=128, num_warps=8), dict(FINITE_BRANCH=False), dict(BLOCK_K=256, num_warps=8),
]


def _fused_case(inp, rnd, npc, pos, params, anchor=None, tune=None):
    """A case of ``per_channel_cast_fused(inp, 'e4m3', 128, rnd, npc, pos)`` against the reference."""
    out = per_channel_cast_fused(inp, "e4m3", 128, rnd, npc, pos)
    case = Case(params=params, fn=lambda a=(inp, rnd, npc, pos): per_channel_cast_fused(a[0], "e4m3", 128, *a[1:]),
                ref=lambda a=(inp, rnd, npc, pos): _ref_fused(*a), check=_check_pair, nbytes=count_bytes(inp, pos, out),
                anchor=anchor, tune=tune)
    del out
    return case


@register(_M, "per_channel_cast_fused")
def _per_channel_cast_fused_cases(device, quick, grid=False):
    """The anchor (plain 4096 x 7168) plus a gathered bf16 and a gathered FP8 input, or TileKernels' grid."""
    if _grid.on(quick, grid):
        yield from _fused_grid(device)
        return
    gpu = device.type == "cuda"
    n, k = (4096, 7168) if gpu else (256, 512)
    g = torch.Generator(device=device)
    g.manual_seed(0)
    x = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    # anchor: plain input, no map
    yield _fused_case(x, False, None, None,
                      dict(num_tokens=n, hidden=k, fused_cast_back=False, gather=False, round_sf=False),
                      anchor=("per_channel_cast_fused", _FUSED_ANCHOR) if gpu else None,
                      tune=("per_channel_cast_fused", _TUNE_CHANNEL) if gpu else None)
    if quick:
        return
    # FP8 input with per-token (1 x 128) scales, gathered through a map with ~10% padding rows
    amax = x.float().reshape(n, k // 128, 128).abs().amax(dim=2).clamp_min(1e-4)
    sf_in = amax / torch.full_like(amax, 448.0)
    q = (x.float() / sf_in.repeat_interleave(128, dim=1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    xq = (q, sf_in)
    mo = 2 * n
    pos = torch.randint(0, n, (mo,), device=device, generator=g, dtype=torch.int32)
    pos[torch.rand(mo, device=device, generator=g) < 0.1] = -1
    for inp, npc, name in ((x, None, False), (xq, 128, True)):
        yield _fused_case(inp, False, npc, pos,
                          dict(num_tokens=mo, hidden=k, fused_cast_back=name, gather=True, round_sf=False),
                          tune=("per_channel_cast_fused", _TUNE_CAST_BACK) if gpu and name else None)


def _fused_grid(device):
    """TileKernels' benchmark grid of the fused cast: a plain 4096-row input (no map) and the routing points of
    ``num_topk`` 6 (x ``expand_to_fused`` of ``randn``, the map ``get_fused_mapping(topk_idx, E, 0, 128)``'s
    ``pos_to_token``), x ``generate_hidden_sizes(128)`` x fused cast-back (x replaced by TileKernels'
    ``per_token_cast(x, 'e4m3', 128)``) x round_sf."""
    from tritile.torch.cast import cast

    gpu = device.type == "cuda"
    points = [(4096 if gpu else 128, 0, 0, 0)] + list(_grid.moe_points(device, "per_channel_cast_fused", topk=(6,)))
    for T, K, E, ep in points:
        for k in _grid.hidden_sizes(device, 128):
            if K:
                x, _, pos, _, _ = _grid.moe_inputs(device, T, K, E, ep, k, 128)
            else:
                x, pos = torch.randn(T, k, device=device, dtype=torch.bfloat16), None
            xq = cast(x, "e4m3", (1, 128))  # row-major float32 scales, not powers of two
            for fused, inp in ((False, x), (True, xq)):
                for rnd in (False, True):
                    tk = dict(num_tokens=T, num_topk=K, num_experts=E, num_ep_ranks=ep, hidden=k, num_per_tokens=128,
                              num_per_channels=128, is_fused_cast_back=fused, round_sf=rnd)
                    tune = None
                    if gpu and tk == _FUSED_ANCHOR:
                        tune = ("per_channel_cast_fused", _TUNE_CHANNEL)
                    elif gpu and fused and not K:
                        tune = ("per_channel_cast_fused", _TUNE_CAST_BACK)
                    yield _fused_case(inp, rnd, 128 if fused else None, pos, dict(tk, num_rows=x.shape[0]),
                                      anchor=("per_channel_cast_fused", tk) if gpu else None, tune=tune)


@register(_M, "per_channel_cast_and_transpose")
def _per_channel_cast_and_transpose_cases(device, quick, grid=False):
    """The anchor shape (npt 128 / 32 x round_sf), or TileKernels' grid: M 4096 / 8064 x its 7 hidden sizes x npt
    128 / 32 x round_sf."""
    from tritile.torch.per_channel_cast_fused import per_channel_cast_values

    def ref(x, npt, rnd):
        o, s = per_channel_cast_values(x.float(), npt, rnd)
        return o.T.contiguous(), s

    for m, k in _plain_shapes(device, quick, grid, ((8064, 7168), (256, 576))):
        yield from _plain_shape(device, m, k, "per_channel_cast_and_transpose", npts=(128,) if quick else (128, 32),
                                rnds=(False,) if quick else (False, True),
                                call=lambda x, npt, rnd: per_channel_cast_and_transpose(x, "e4m3", npt, rnd), ref=ref,
                                npt_key="num_per_channels", show_npt=True,
                                tunes={(8064, 7168, npt): _TUNE_TRANSPOSE[npt] for npt in (128, 32)})
