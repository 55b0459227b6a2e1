"""Benchmarks of ``tritile.engram`` at TileKernels' anchor shapes (GPU) or small shapes (CPU check)."""

from __future__ import annotations

import torch

from tritile.bench import TRITILE, Case, op, register
from tritile.config import get_num_sms
from tritile.engram import engram_gate_fwd, engram_hash, fused_weight
from tritile.testing import assert_equal, calc_diff, count_bytes
from tritile.torch.engram import engram_gate_ref, engram_hash_ref, make_offsets

EPS, CLAMP = 1e-20, 1e-6

# Tuning candidates (``python -m tritile tune --module engram``) at the GPU anchor shapes.
_FUSED_WEIGHT_TUNE = [dict(BLOCK=b, WARPS=w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8)
                      if b // (32 * w) >= 4]
# BLOCK_H / ROWS / WARPS / PERSIST change the fwd's reduction layout: a candidate that changes them may differ in the
# last bits of dot / rstd (hence "output differs"); the tests' calc_diff bounds still hold for each of them.
# Default: the persistent kernel (PERSIST, 16 warps, PREFETCH); PERSIST=False, ROWS=1, WARPS=16 is the old default.
_GATE_FWD_TUNE = ([dict(PERSIST=False, ROWS=1, WARPS=16), dict(PERSIST=False, ROWS=1, WARPS=32),
                   dict(PERSIST=False, ROWS=2, WARPS=16)]
                  + [dict(PREFETCH=False), dict(WARPS=32), dict(WARPS=32, PREFETCH=False), dict(WARPS=8),
                     dict(WAVES=2), dict(WAVES=2, PREFETCH=False)]
                  # without the register cap (the rule before CAP_REGS): 1.36x slower at 2048 with save
                  + [dict(CAP_REGS=False)])
# Default: the two passes, pass 1 at 4 warps (8 warps, the default before H200 @ 694bd6c: 1169 us CUPTI on the H200), pass 2
# one [4, 512] tile a program at 4 warps (H200 @ 65d4724: 746 us).
# Pass-2 knobs (BLOCK_D2, WARPS2, SPLIT, PREFETCH) never change a bit; the pass-1 tile and warps sum gamma in
# another order, and COEF=False computes delta in pass 2 (other FMA contractions), so these may show "output
# differs" (within the tests' bounds).  The one-pass kernels were removed after losing in three sweeps
# (docs/PERFORMANCE.md); so were candidates that lost by 2.5 % or more in two sweeps (WARPS1=8: 1165 us, TOK=4: 805,
# BLOCK_D2=1024 x 8 warps: 806).
_GATE_BWD_TUNE = [
    dict(WARPS1=2), dict(TOK=2), dict(BLOCK_D1=2048), dict(BLOCK_D1=512, WARPS1=2), dict(SPLIT=4),
] + [
    # H200 @ 65d4724 sweeps (CUPTI): the default is now one [4, 512] tile a program at 4 warps without prefetch (746.2 us);
    # the H200 @ 2615106 default (two programs per SM at 8 warps, each streaming half of the tiles with PREFETCH) 765.9,
    # COEF=False (the gamma kernel, then delta in pass 2) 746.2-748.5 at several tiles.  The L2_CHUNK candidates
    # (both passes per launch chunk, so that pass 2 re-reads grad_out from L2) took 865-1183 us and were removed.
    dict(SPLIT=2, PREFETCH=True, WARPS2=8), dict(PREFETCH=True), dict(WARPS2=8),
    dict(BLOCK_D2=256), dict(BLOCK_D2=256, WARPS2=2), dict(BLOCK_D2=1024, WARPS2=8),
    dict(COEF=False), dict(COEF=False, BLOCK_D2=256),
    # H200 @ d53c6fa: pass 2 (one [4, 512] tile a program, 4 warps) has 162 registers (sm_90a): 3 blocks per SM, one token's
    # 12 KB of loads in flight per block (~36 KB per SM; Nsight: 80 % of peak DRAM against a copy's 88 %).  PIPE: the
    # token loop software-pipelined by the compiler (cp.async into shared memory; 168 registers at PIPE=2, 231 at 3);
    # MAXNREG2: a register cap (128: 40 B of stack, 4 blocks per SM).  Expected: more bytes in flight per SM, pass 2
    # toward the copy's rate (-50 us at best: still short of TileKernels' 644 us)
    # Swept (CUPTI, us; default 747.27): PIPE=3 732.25 (the new default), PIPE=3 + MAXNREG2=128 754.44, PIPE=2 773.50,
    # MAXNREG2=128 783.83.  Relative to the new default:
    dict(PIPE=0), dict(PIPE=4), dict(BLOCK_D2=256), dict(WARPS2=8),
]
# H200 @ 31c87fe: the one-pass Gluon kernel (``_engram_bwd_gluon``: TMA rings, grad_out's row in shared memory, grad_w
# read-modified-written in L2) is the GPU default where it covers the shape; the two-pass candidates above run with
# ONEPASS=False.  NSLOT: its ring of x / k / w tiles (32 KB a slot at hc=4); the shared memory left holds grad_w
# accumulator tiles (the others stay in registers), so fewer slots mean fewer register tiles.  Swept (CUPTI, us):
# one pass NSLOT=3 638.15, NSLOT=2 682.18, the two passes (ONEPASS=False) 732.68.
_GATE_BWD_TUNE = [dict(ONEPASS=False, **c) for c in _GATE_BWD_TUNE] + [
    dict(ONEPASS=False), dict(NSLOT=2),
]
_HASH_TUNE = ([dict(BLOCK_T=b, WARPS=w) for b in (32, 64, 128, 256) for w in (1, 2, 4) if b * 8 // (32 * w) >= 1]
              + [dict(BLOCK_T=b, WARPS=w, FAST_MOD=False) for b, w in ((128, 4), (64, 2), (32, 1))])


def _gpu(device) -> bool:
    return torch.device(device).type == "cuda"


def _weights(device, hc, H):
    """The gate's two bf16 ``(hc, H)`` weights ``w_hidden``, ``w_embed``."""
    return (torch.randn(hc, H, dtype=torch.bfloat16, device=device),
            torch.randn(hc, H, dtype=torch.bfloat16, device=device))


def _gate_data(device, T, hc, H, grad=False):
    x = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    k = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device)
    v = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    wh, we = _weights(device, hc, H)
    go = torch.randn(T, hc, H, dtype=torch.bfloat16, device=device) if grad else None
    return x, k, v, wh, we, go


def _gate_shape(device):
    return (8001, 4, 7168) if _gpu(device) else (33, 4, 2560)


def _grid_hidden(device):
    """TileKernels' ``generate_hidden_sizes(128)`` (CPU: two small multiples of 128, a correctness pass)."""
    return [2048, 2560, 3072, 4096, 6144, 7168] if _gpu(device) else [256, 640]


def _over_weight_hidden(cases):
    """The benchmark generator of a weight-only op (``fused_weight``, ``grad_w_reduce``) from ``cases(device, hc,
    H)``: hc = 4 and TileKernels' hidden sizes (the grid) or the anchor's."""
    def gen(device, quick, grid=False):
        for H in (_grid_hidden(device) if grid and not quick else [7168 if _gpu(device) else 2560]):
            yield from cases(device, 4, H)
    return gen


def _grid_gate_shapes(device, quick, grid):
    """(T, hc, H) of the gate benchmarks: TileKernels' grid (T in {4001, 8001} x its hidden sizes) or the anchor."""
    if grid and not quick:
        return [(t, 4, h) for t in ((4001, 8001) if _gpu(device) else (9, 33)) for h in _grid_hidden(device)]
    return [_gate_shape(device)]


def _check_diffs(tol):
    def check(out, ref):
        for a, b in zip(out, ref):
            if a is None and b is None:
                continue
            d = calc_diff(a, b)
            assert d < tol, f"calc_diff {d:.3e} >= {tol:g}"
    return check


@register("engram", "fused_weight")
@_over_weight_hidden
def _fused_weight(device, hc, H):
    wh, we = _weights(device, hc, H)
    out = fused_weight(wh, we)
    yield Case(params=dict(hc=hc, hidden=H), impl=op("engram.fused_weight", wh, we),
               ref=lambda: wh.float() * we.float(),
               check=assert_equal, nbytes=count_bytes(wh, we, out), latency_bound=True,
               anchor=("fused_weight", dict(hc=hc, hidden=H)) if _gpu(device) else None,
               tune=("fused_weight", _FUSED_WEIGHT_TUNE) if _gpu(device) else None)


@register("engram", "engram_gate_fwd")
def _gate_fwd(device, quick, grid=False):
    for T, hc, H in _grid_gate_shapes(device, quick, grid):
        yield from _gate_fwd_cases(device, quick, T, hc, H)


def _gate_fwd_cases(device, quick, T, hc, H):
    x, k, v, wh, we, _ = _gate_data(device, T, hc, H)
    wf = fused_weight(wh, we)
    for save in ((True,) if quick else (True, False)):
        res = engram_gate_fwd(x, k, v, wf, EPS, CLAMP, save)
        nbytes = count_bytes(x, k, v, wf, res)
        ref_fn = (lambda: engram_gate_ref(x, k, v, wh, we, CLAMP, EPS, save_for_backward=True)) if save else \
            (lambda: (engram_gate_ref(x, k, v, wh, we, CLAMP, EPS),))
        yield Case(params=dict(hc=hc, hidden=H, num_tokens=T, save=save),
                   impl=op("engram.engram_gate_fwd", x, k, v, wf, EPS, CLAMP, save),
                   ref=ref_fn, check=_check_diffs(2e-10), nbytes=nbytes, label=f"save={save}",
                   anchor=("engram_gate_fwd", dict(hc=hc, hidden=H, num_tokens=T, save=save)) if _gpu(device) else None,
                   tune=("engram_gate_fwd", _GATE_FWD_TUNE) if _gpu(device) else None)
        del res


@register("engram", "engram_gate_bwd")
def _gate_bwd(device, quick, grid=False):
    for T, hc, H in _grid_gate_shapes(device, quick, grid):
        yield from _gate_bwd_cases(device, T, hc, H)


def _gate_bwd_cases(device, T, hc, H):
    x, k, v, wh, we, go = _gate_data(device, T, hc, H, grad=True)
    wf = fused_weight(wh, we)
    with torch.no_grad():
        _, dot, gate, rx, rk = engram_gate_ref(x, k, v, wh, we, CLAMP, EPS, save_for_backward=True)

    impl = op("engram.engram_gate_bwd", go, x, k, v, wf, dot, gate, rx, rk, CLAMP)
    fn = impl(TRITILE)

    def run():
        gx, gk, gv, gwp = fn()
        gw = gwp.sum(0)
        return gx, gk, gv, gw * we.float(), gw * wh.float()

    def ref():
        xr, kr, vr = (t.clone().requires_grad_(True) for t in (x, k, v))
        whr, wer = (t.float().requires_grad_(True) for t in (wh, we))
        engram_gate_ref(xr, kr, vr, whr, wer, CLAMP, EPS).backward(go)
        return xr.grad, kr.grad, vr.grad, whr.grad, wer.grad

    outs = run()
    nbytes = count_bytes(go, x, k, v, wf, dot, gate, rx, rk, outs)
    del outs
    case = Case(params=dict(hc=hc, hidden=H, num_tokens=T), fn=fn, impl=impl, ref=ref, nbytes=nbytes,
                anchor=("engram_gate_bwd", dict(hc=hc, hidden=H, num_tokens=T)) if _gpu(device) else None,
                tune=("engram_gate_bwd", _GATE_BWD_TUNE) if _gpu(device) else None)
    # the check needs grad_w summed over its partial rows: run() wraps fn for the correctness pass
    case.check = lambda _out, want: _check_diffs(1e-8)(run(), want)
    yield case


@register("engram", "grad_w_reduce")
@_over_weight_hidden
def _grad_w_reduce(device, hc, H):
    P = get_num_sms()
    partial = torch.randn(P, hc, H, device=device)
    wh, we = _weights(device, hc, H)
    gwh = torch.zeros(hc, H, device=device)
    gwe = torch.zeros(hc, H, device=device)

    def impl(get):
        reduce_ = get("engram.grad_w_reduce")

        def call():
            reduce_(partial, wh, we, gwh, gwe)  # accumulates: the check below starts from zero
            return gwh, gwe
        return call

    fn = impl(TRITILE)

    def check(_out, want):
        gwh.zero_()
        gwe.zero_()
        got = fn()
        _check_diffs(1e-10)(got, want)

    def ref():
        s = partial.sum(0)
        return s * we.float(), s * wh.float()

    yield Case(params=dict(hidden=H), fn=fn, impl=impl, ref=ref, check=check, latency_bound=True,
               nbytes=count_bytes(partial, wh, we, gwh, gwe),  # TileKernels: each tensor once
               anchor=("grad_w_reduce", dict(hidden=H)) if _gpu(device) else None,
               tune=("grad_w_reduce", _GWR_TUNE) if _gpu(device) else None)


# grad_w_reduce (P = 132, hc = 4, H = 7168); default (H200 @ 694bd6c): [128, 32] x 4 warps, TAIL = 4, EARLY.  The first
# version's [32, 128] steps, 4 warps, come first; then the H200 @ 8b7524c default
_GWR_TUNE = [dict(ROWS=32, BLOCK_D=128, num_warps=4, TAIL=0), dict(TAIL=0, EARLY=False),
             dict(ROWS=256, BLOCK_D=32, num_warps=8),
             dict(ROWS=128, BLOCK_D=64, num_warps=4), dict(ROWS=128, BLOCK_D=64, num_warps=8),
             dict(ROWS=256, BLOCK_D=64, num_warps=8), dict(ROWS=64, BLOCK_D=128, num_warps=8),
             dict(ROWS=128, BLOCK_D=32, num_warps=4), dict(ROWS=256, BLOCK_D=16, num_warps=4)]
# EARLY (the epilogue's loads first) with every partial row in one step (P = 132 <= ROWS): one DRAM round trip
_GWR_TUNE += [dict(EARLY=True), dict(EARLY=True, ROWS=256), dict(EARLY=True, ROWS=256, num_warps=8),
              dict(EARLY=True, ROWS=256, BLOCK_D=16), dict(EARLY=True, ROWS=256, BLOCK_D=64, num_warps=8)]
# SWAP: column strips fastest in the grid (consecutive programs read neighbouring 128-byte strips of one row);
# TAIL: 128 + 4 rows as two tiles issued together (one round trip, no 256-row padding)
_GWR_TUNE += [dict(SWAP=True), dict(SWAP=True, EARLY=True), dict(TAIL=4), dict(TAIL=4, EARLY=True),
              dict(TAIL=4, SWAP=True), dict(TAIL=4, SWAP=True, EARLY=True), dict(TAIL=4, BLOCK_D=64, num_warps=8),
              dict(TAIL=4, SWAP=True, BLOCK_D=64, num_warps=8)]
# H200 @ 2615106: the default's tile with other warp counts and narrower strips (more programs, fewer bytes each)
_GWR_TUNE += [dict(TAIL=4, EARLY=True, num_warps=2), dict(TAIL=4, EARLY=True, num_warps=8),
              dict(TAIL=4, EARLY=True, BLOCK_D=16, num_warps=2), dict(TAIL=4, EARLY=True, BLOCK_D=16, num_warps=4)]
# H200 @ 31c87fe: wider strips with fewer programs (448 / 224 / 112 instead of 896, every row still in one round trip)
# lost: BLOCK_D=64 / 128 / 256 at 8 warps 8.30 / 8.67 / 12.32 us against 6.90 for the default (removed)


@register("engram", "engram_hash")
def _engram_hash(device, quick, grid=False):
    tokens = ((4001, 8001) if _gpu(device) else (700, 1500)) if grid and not quick else \
        ((8001,) if _gpu(device) else (1500,))
    for T in tokens:
        yield from _engram_hash_case(device, T, 3, 2, 8)


def _engram_hash_case(device, T, N, L, E):
    ids = torch.randint(0, 100000, (T, N), dtype=torch.int32, device=device)
    mult = torch.randint(0, 100000, (L, N), dtype=torch.int64, device=device)
    vocab = torch.randint(100000, 1000000, (L, N - 1, E), dtype=torch.int32, device=device)
    offsets = make_offsets(vocab)
    out = engram_hash(ids, mult, vocab, offsets)
    yield Case(params=dict(layers=L, ngram=N, num_tokens=T, tables=E),
               impl=op("engram.engram_hash", ids, mult, vocab, offsets),
               ref=lambda: engram_hash_ref(ids, mult, vocab, offsets), check=assert_equal,
               nbytes=count_bytes(ids, mult, vocab, offsets, out), latency_bound=True,
               anchor=("engram_hash", dict(layers=L, ngram=N, num_tokens=T, tables=E)) if _gpu(device) else None,
               tune=("engram_hash", _HASH_TUNE) if _gpu(device) else None)
