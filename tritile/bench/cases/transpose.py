"""Benchmark registrations of tritile.transpose."""

import torch

from tritile.bench import Case, op, register
from tritile.testing import assert_equal, count_bytes
from tritile.torch.transpose import batched_transpose_ref, transpose_ref
from tritile.transpose import batched_transpose, transpose

_DT = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def _tune(dt: str, batched: bool):
    """Launch-config candidates for ``python -m tritile tune`` (name "transpose")."""
    if dt == "fp8":
        cands = [dict(BLOCK_M4=bm, BLOCK_N4=bn, num_warps=w) for bm in (32, 64) for bn in (16, 32, 64) for w in (4, 8)]
        cands += [dict(PDL=False), dict(PDL=True, BLOCK_M4=32, BLOCK_N4=32, num_warps=4),
                  dict(PDL=True, BLOCK_M4=64, BLOCK_N4=64, num_warps=8)]
        cands += [dict(PDL=True, BLOCK_M4=32, BLOCK_N4=64, num_warps=4),
                  dict(PDL=True, BLOCK_M4=16, BLOCK_N4=32, num_warps=4), dict(PDL=True, BLOCK_M4=32, BLOCK_N4=16, num_warps=2)]
        # H200 @ 4d49e57: the grid's first dimension over the m blocks (MFAST, now the default with 128 x 256-byte tiles;
        # the candidates above run with it unless they set it).  The programs running together then write whole
        # output rows' runs and read narrow strips of many input rows.  Two sweeps (CUPTI, us): batches of 32 MFAST
        # 901.3 against 941.9 for the old default ([64, 32] words, no MFAST), 918.5 with [64, 32]; one matrix 30.81 /
        # 30.62 against 30.90 / 30.77 for the old default ([32, 32], no MFAST), 30.96 / 30.98 with [32, 32].
        old = dict(MFAST=False, BLOCK_M4=32 if not batched else 64, BLOCK_N4=32, num_warps=4)  # the old default
        cands += [old, dict(MFAST=False), dict(MFAST=True, BLOCK_M4=32, BLOCK_N4=32, num_warps=4),
                  dict(MFAST=True, BLOCK_M4=64, BLOCK_N4=32, num_warps=4),
                  dict(MFAST=True, BLOCK_M4=16, BLOCK_N4=64, num_warps=4),
                  dict(MFAST=True, BLOCK_M4=32, BLOCK_N4=128, num_warps=4),
                  dict(MFAST=True, BLOCK_M4=32, BLOCK_N4=64, num_warps=8),
                  dict(MFAST=True, BLOCK_M4=32, BLOCK_N4=64, num_warps=2)]
        return cands + [dict(word_path=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
                        for bm, bn, w in [(128, 128, 8), (128, 256, 8), (256, 128, 8)]]
    # PDL (the default on sm_90+; H200, H200 @ 2615106: bf16 58.9 us graph against 59.5 without): programmatic dependent
    # launch, the next call's programs are scheduled during this one's tail
    pdl = [dict(PDL=False), dict(PDL=True, BLOCK_M=64, BLOCK_N=64, num_warps=8),
           dict(PDL=True, BLOCK_M=128, BLOCK_N=256, num_warps=8)]
    # H200 @ 4d49e57 (see fp8): MFAST, now the default of 2- and 4-byte elements (the candidates here run with it unless
    # they set it).  Two sweeps (CUPTI, us): fp32 batches 3542.7 / 3537.0 against 3647.1 / 3628.8 without, bf16
    # batches 1766.6 against 1804.3, one bf16 matrix 64.51 / 57.84 against 65.41 / 58.57
    mfast = [dict(MFAST=False), dict(MFAST=True, BLOCK_M=64, BLOCK_N=64, num_warps=8),
             dict(MFAST=True, BLOCK_M=128, BLOCK_N=64, num_warps=8),
             dict(MFAST=True, BLOCK_M=64, BLOCK_N=128, num_warps=8),
             dict(MFAST=True, BLOCK_M=128, BLOCK_N=128, num_warps=8)]
    return pdl + mfast + [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
                          for bm, bn in [(64, 64), (128, 64), (128, 128), (256, 64), (64, 128)] for w in (4, 8)]


def _x(shape, dtype, device):
    return torch.randn(shape, device=device).to(_DT[dtype])


#: TileKernels' benchmark grid (``generate_num_tokens(64)`` x ``generate_hidden_sizes()``); the CPU keeps its
#: structure at small sizes (a correctness pass).
def _grid_mn(device):
    if device.type == "cuda":
        return [(m, n) for m in (4032, 8064) for n in (576, 2048, 2560, 3072, 4096, 6144, 7168)]
    return [(m, n) for m in (64, 128) for n in (64, 192)]


@register("transpose", "batched_transpose")
def _batched(device, quick, grid=False):
    gpu = device.type == "cuda"
    shapes = [(32, 8064, 7168)] if gpu else [(3, 64, 192)]
    dtypes = ["fp32"] if quick else ["fp32", "bf16", "fp8"]
    if grid and not quick:  # num_experts in {8, 32} (CPU: 2, 3)
        shapes = [(b, m, n) for m, n in _grid_mn(device) for b in ((8, 32) if gpu else (2, 3))]
    for dt in dtypes:
        for b, m, n in shapes:
            x = _x((b, m, n), dt, device)
            out = batched_transpose(x)
            anchor = ("batched_transpose", dict(dtype=dt, hidden=n, num_experts=b, num_tokens=m)) if gpu else None
            yield Case(params=dict(dtype=dt, B=b, M=m, N=n), impl=op("transpose.batched_transpose", x),
                       ref=lambda x=x: batched_transpose_ref(x), check=assert_equal, nbytes=count_bytes(x, out),
                       anchor=anchor, tune=("transpose", _tune(dt, True)) if gpu else None)
            del out


@register("transpose", "transpose")
def _plain(device, quick, grid=False):
    gpu = device.type == "cuda"
    shapes = [(8064, 7168)] if gpu else [(192, 576)]
    if gpu and not quick:
        shapes.append((4032, 2048))
    if grid and not quick:
        shapes = _grid_mn(device)
    for dt in ["bf16", "fp8"]:
        for m, n in shapes:
            x = _x((m, n), dt, device)
            out = transpose(x)
            yield Case(params=dict(dtype=dt, M=m, N=n), impl=op("transpose.transpose", x),
                       ref=lambda x=x: transpose_ref(x),
                       check=assert_equal, nbytes=count_bytes(x, out),
                       anchor=("transpose", dict(dtype=dt, hidden=n, num_tokens=m)) if gpu else None,
                       tune=("transpose", _tune(dt, False)) if gpu and m == 8064 and n == 7168 else None)
            del out
