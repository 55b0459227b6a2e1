"""Benchmark registrations of tritile.transpose."""

import torch

from ..bench import Case, register
from ..testing import assert_equal, count_bytes
from ..torch.transpose import batched_transpose_ref, transpose_ref
from . import batched_transpose, transpose

_DT = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def _tune(dt: str, batched: bool):
    """Launch-config candidates for ``python -m tritile tune`` (name "transpose")."""
    if dt == "fp8":
        cands = [dict(BLOCK_M4=bm, BLOCK_N4=bn, num_warps=w) for bm in (32, 64) for bn in (16, 32, 64) for w in (4, 8)]
        cands += [dict(PERSIST=p, BLOCK_M4=bm, BLOCK_N4=bn, num_warps=w)
                  for p, bm, bn, w in [(2, 64, 32, 4), (4, 64, 32, 4), (8, 64, 32, 4), (4, 32, 32, 4), (2, 64, 64, 8),
                                       (1, 64, 64, 8)]]
        cands += [dict(word_path=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
                  for bm, bn, w in [(128, 128, 8), (128, 256, 8), (256, 128, 8)]]
        return cands + _tma_tune(dt)
    cands = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, STREAM=st) for bm, bn in [(64, 64), (128, 64), (128, 128),
                                                                             (256, 64), (64, 128)]
             for w in (4, 8) for st in ((False, True) if batched else (False,))]
    return cands + _tma_tune(dt)


def _tma_tune(dt: str):
    """TMA candidates (``TMA=True``; tensor descriptors, one shared-memory round trip per tile).  The tile shape
    sets the shared-memory bank conflicts of the transposed side (see ``_tma_launch``), so it is swept widely;
    PERSIST/STAGES add a pipelined persistent grid (STAGES - 1 tile loads in flight per program)."""
    if dt == "fp8":  # words: BLOCK_M4 x BLOCK_N4 int32 words = 4*BLOCK_M4 x 4*BLOCK_N4 bytes
        c = [dict(TMA=True, BLOCK_M4=bm, BLOCK_N4=bn, num_warps=w)
             for bm, bn, w in [(32, 32, 4), (64, 16, 4), (32, 16, 4), (16, 32, 4), (64, 32, 4), (64, 32, 8), (64, 8, 4)]]
        c += [dict(TMA=True, BLOCK_M4=bm, BLOCK_N4=bn, num_warps=4, PERSIST=p, STAGES=st)
              for bm, bn, p, st in [(32, 32, 2, 3), (32, 32, 1, 4), (64, 16, 2, 3), (32, 16, 4, 3)]]
        # bytes: [256, 16] keeps the byte stores to shared memory free of bank conflicts; [128, 128] does not
        c += [dict(TMA=True, word_path=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, **p)
              for bm, bn, p in [(256, 16, {}), (128, 128, {}), (256, 16, dict(PERSIST=4, STAGES=4))]]
        # row pairs as 16-bit elements (byte loads from shared memory, 16-byte stores to it)
        return c + [dict(TMA=True, word_path=False, PAIRS=True, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
                    for bm, bn in [(256, 64), (128, 64)]]
    if dt == "bf16":
        return [dict(TMA=True, BLOCK_M=bm, BLOCK_N=bn, num_warps=4) for bm, bn in [(128, 64), (256, 32), (64, 64)]]
    c = [dict(TMA=True, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
         for bm, bn, w in [(64, 64, 4), (64, 64, 8), (128, 32, 4), (256, 16, 4), (32, 32, 4)]]
    return c + [dict(TMA=True, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, PERSIST=p, STAGES=st)
                for bm, bn, p, st in [(64, 64, 2, 3), (128, 32, 2, 3), (64, 64, 1, 4)]]


def _x(shape, dtype, device):
    return torch.randn(shape, device=device).to(_DT[dtype])


@register("transpose", "batched_transpose")
def _batched(device, quick):
    gpu = device.type == "cuda"
    shapes = [(32, 8064, 7168)] if gpu else [(3, 64, 192)]
    dtypes = ["fp32"] if quick else ["fp32", "bf16", "fp8"]
    for dt in dtypes:
        for b, m, n in shapes:
            x = _x((b, m, n), dt, device)
            out = batched_transpose(x)
            anchor = ("batched_transpose", dict(dtype=dt, hidden=n, num_experts=b, num_tokens=m)) if gpu else None
            yield Case(params=dict(dtype=dt, B=b, M=m, N=n), fn=lambda x=x: batched_transpose(x),
                       ref=lambda x=x: batched_transpose_ref(x), check=assert_equal, nbytes=count_bytes(x, out),
                       anchor=anchor, tune=("transpose", _tune(dt, True)) if gpu else None)
            del out


@register("transpose", "transpose")
def _plain(device, quick):
    gpu = device.type == "cuda"
    shapes = [(8064, 7168)] if gpu else [(192, 576)]
    if gpu and not quick:
        shapes.append((4032, 2048))
    for dt in ["bf16", "fp8"]:
        for m, n in shapes:
            x = _x((m, n), dt, device)
            out = transpose(x)
            yield Case(params=dict(dtype=dt, M=m, N=n), fn=lambda x=x: transpose(x), ref=lambda x=x: transpose_ref(x),
                       check=assert_equal, nbytes=count_bytes(x, out),
                       tune=("transpose", _tune(dt, False)) if gpu and m == 8064 else None)
            del out
