"""GPU timing of per_token_cast_to_e5m6 configs at the anchor (8001 x 7168 bf16, round_sf, both sf layouts).

    python scripts/e5m6_time.py '{"INT_SF": true}' '{"INT_SF": true, "PAIR_ENC": true, "AMAX16": true}' ...
    ncu --profile-from-start off --metrics ... python scripts/e5m6_time.py --ncu CFG ...   # one profiled call each

Each config is checked bitwise against the default (data: randn rows plus rows with zeros, +-inf, NaN, bf16
subnormals and amax > 65024), then timed with triton.testing.do_bench (L2 cleared between runs, median us).
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
from tritile.runtime import override_config


def main():
    ncu = "--ncu" in sys.argv
    cfgs = [{}] + [json.loads(a) for a in sys.argv[1:] if a != "--ncu"]
    m, k = 8001, 7168
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xe = x.clone()
    xe[1, 3], xe[2, 4], xe[3, 5], xe[4, 6] = float("inf"), float("-inf"), float("nan"), -float("nan")
    xe[5, :100] = 0
    xe[6] *= 1e30
    xe[7, ::2] = torch.tensor(2.0**-130, dtype=torch.bfloat16)
    xe[8, 0] = 70000.0
    xe[9] = torch.randint(-(1 << 15), 1 << 15, (k,), device="cuda", dtype=torch.int16).view(torch.bfloat16)
    xe[9] = torch.where(torch.isfinite(xe[9]), xe[9], 0)
    for flags in [(False, True, False), (True, True, True)]:
        ref = per_token_cast_to_e5m6(x, k, *flags)
        refe = per_token_cast_to_e5m6(xe, k, *flags)
        for cfg in cfgs:
            with override_config("per_token_cast_to_e5m6", **cfg):
                out = per_token_cast_to_e5m6(x, k, *flags)
                oute = per_token_cast_to_e5m6(xe, k, *flags)
                same = all(torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                       b.view(torch.int32) if b.dtype == torch.float32 else b)
                           for a, b in zip(out + oute, ref + refe))
                if ncu:
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    per_token_cast_to_e5m6(x, k, *flags)
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    t = float("nan")
                else:
                    t = triton.testing.do_bench(lambda: per_token_cast_to_e5m6(x, k, *flags), warmup=50, rep=300,
                                                return_mode="median")
            print(f"{flags} {json.dumps(cfg):70s} same={same} {t * 1e3:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
