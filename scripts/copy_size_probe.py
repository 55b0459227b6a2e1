"""How the device-to-device copy's bandwidth depends on its size (H200 evidence for the transpose target).

For each size: torch's copy (dst.copy_(src)) and tritile's fp8 / bf16 transpose moving the same bytes, timed
by CUDA-graph replay and by CUPTI kernel time (L2 flushed), as the benchmark does.  Prints GB/s (read + write)."""
import torch

from tritile.testing.bench import copy_bandwidth_gbs, time_graph, time_kernels
from tritile.transpose import transpose

ref = copy_bandwidth_gbs()
print(f"copy 1 GiB (events): {ref:.0f} GB/s")
for mb in (29, 58, 116, 231, 462, 1024):
    n = mb * (1 << 20) // 2 * 2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    g = time_graph(lambda: dst.copy_(src))
    # a kernel (copy_ is a memcpy: no CUPTI kernel record; bitwise_not is time_kernels' L2 flush, left out)
    c = time_kernels(lambda: torch.neg(src.view(torch.int32), out=dst.view(torch.int32)))
    line = f"copy {mb:5d} MiB: graph {2 * n / g / 1e3:7.0f} GB/s ({2 * n / g / 1e3 / ref:6.1%})"
    if c:
        line += f"  torch neg CUPTI {2 * n / c / 1e3:7.0f} GB/s ({2 * n / c / 1e3 / ref:6.1%})"
    print(line, flush=True)
for dt, (m, k) in ((torch.float8_e4m3fn, (8064, 7168)), (torch.bfloat16, (8064, 7168))):
    x = torch.randn(m, k, device="cuda").to(dt)
    nb = 2 * x.numel() * x.element_size()
    g = time_graph(lambda: transpose(x))
    c = time_kernels(lambda: transpose(x))
    print(f"transpose {dt} {m}x{k}: graph {g:.2f} us {nb / g / 1e3 / ref:6.1%}, CUPTI {c:.2f} us "
          f"{nb / c / 1e3 / ref:6.1%}", flush=True)
