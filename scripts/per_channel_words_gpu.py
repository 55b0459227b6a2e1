"""GPU check of the per-channel WORDS candidates at the anchor (bf16 4096 x 7168): bitwise against the default
path (with inf/NaN/denormal columns), then the time of each (CUDA graph replays, median us).

    PYTHONPATH=. python scripts/per_channel_words_gpu.py
"""

from __future__ import annotations

import torch
import triton

from tritile.quant.per_channel_cast_fused_kernel import _launch
from tritile.runtime import override_config

CANDIDATES = [{}, dict(WORDS=True), dict(WORDS=True, HMUL_ENC=True), dict(WORDS=True, HMUL_ENC=True, maxnreg=80),
              dict(WORDS=True, HMUL_ENC=True, maxnreg=88), dict(WORDS=True, HMUL_ENC=True, BLOCK_K=64),
              dict(WORDS=True, HMUL_ENC=True, num_warps=8), dict(WORDS=True, BLOCK_K=64)]


def main() -> None:
    m, k = 4096, 7168
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    odd = x.clone()
    bits = odd.view(torch.int16)
    odd[5, 4] = float("inf")
    odd[300, 9] = -float("inf")
    bits[7, 6] = -64
    bits[900, 11] = 0x7FC1
    bits[:, 2] = torch.randint(1, 128, (m,), device="cuda", dtype=torch.int16)
    odd[:, 3] = 3.0e38
    pos = torch.randint(-1, m, (2 * m,), device="cuda", dtype=torch.int32)
    for rnd in (False, True):
        refs = {}
        for cfg in CANDIDATES:
            with override_config("per_channel_cast_fused", **cfg):
                for name, inp, p in (("plain", x, None), ("odd", odd, None), ("gather", odd, pos)):
                    out, sf = _launch(inp, None, False, p, m if p is None else 2 * m, rnd)
                    key = (name,)
                    if not cfg:
                        refs[key] = (out.view(torch.uint8).clone(), sf.clone())
                    else:
                        same = torch.equal(out.view(torch.uint8), refs[key][0]) and torch.equal(
                            sf.view(torch.int32), refs[key][1].view(torch.int32))
                        if not same:
                            print("MISMATCH", cfg, name, rnd)
                t = triton.testing.do_bench_cudagraph(lambda: _launch(x, None, False, None, m, rnd), rep=200,
                                                      return_mode="median")
            print(f"round_sf={rnd} {cfg}: {t * 1e3:.1f} us")


if __name__ == "__main__":
    main()
