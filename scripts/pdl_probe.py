"""Graph-replay time of batched_transpose (fp32, 32 x 8064 x 7168) and transpose (fp8) with PDL on and off, at
several calls per graph: does programmatic dependent launch change back-to-back throughput of a large kernel?"""

import torch

from tritile.language.pdl import set_pdl
from tritile.testing.bench import time_graph, time_kernels
from tritile.transpose import batched_transpose, transpose


def probe(name, x, fn):
    for pdl in (True, False, True):
        set_pdl(pdl)
        fn(x)
        res = {cpg: time_graph(lambda: fn(x), calls_per_graph=cpg, rep=8) for cpg in (2, 10, 20)}
        cupti = time_kernels(lambda: fn(x), rep=10)
        print(f"{name} PDL={pdl}: graph " + ", ".join(f"{k}/graph {v:.1f} us" for k, v in res.items())
              + f"; CUPTI {cupti:.1f} us", flush=True)


probe("transpose fp8 8064x7168", torch.randn(8064, 7168, device="cuda").to(torch.float8_e4m3fn), transpose)
probe("batched fp32 32x8064x7168", torch.randn(32, 8064, 7168, device="cuda"), batched_transpose)
