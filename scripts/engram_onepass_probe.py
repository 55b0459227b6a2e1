"""GPU smoke test and timing of the one-pass engram backward against the two passes (T=8001, hc=4, H=7168 unless
given): max differences of every output, then CUDA-event times (median of 20, L2 flushed before each)."""
import sys

import torch

import tritile.engram._engram_bwd_gluon as onepass
from tritile.engram import engram_gate_bwd, engram_gate_fwd, fused_weight
from tritile.runtime import override_config


def main():
    T, hc, H = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (8001, 4, 7168)))
    dev = torch.device("cuda")
    print("available", onepass.available(dev), torch.cuda.get_device_name())
    g = torch.Generator(device=dev).manual_seed(0)
    x, k = (torch.randn(T, hc, H, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    wh, we = (torch.randn(hc, H, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    wf = fused_weight(wh, we)
    _, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wf, 1e-20, 1e-6, True)
    go = torch.randn(T, hc, H, device=dev, dtype=torch.bfloat16, generator=g)
    args = (go, x, k, v, wf, dot, gate, rx, rk, 1e-6)
    one = engram_gate_bwd(*args)
    torch.cuda.synchronize()
    with override_config("engram_gate_bwd", ONEPASS=False):
        two = engram_gate_bwd(*args)
    for name, a, b in zip(("grad_x", "grad_k", "grad_v", "grad_w"), one, two):
        if name == "grad_w":
            a, b = a.sum(0), b.sum(0)
        d = (a.float() - b.float()).abs()
        print(f"{name}: max |diff| {d.max().item():.3e}  bitwise equal {torch.equal(a, b)}  "
              f"max |ref| {b.float().abs().max().item():.3e}")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for label, over in (("one-pass", {}), ("one-pass NSLOT=2", dict(NSLOT=2)), ("two-pass", dict(ONEPASS=False))):
        ts = []
        with override_config("engram_gate_bwd", **over):
            for i in range(23):
                flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                engram_gate_bwd(*args)
                e.record()
                torch.cuda.synchronize()
                if i >= 3:
                    ts.append(s.elapsed_time(e) * 1e3)
        ts.sort()
        print(f"{label}: median {ts[len(ts) // 2]:.1f} us  min {ts[0]:.1f} us")
    from tritile.testing.bench import time_graph, time_host, time_kernels
    for label, over in (("one-pass", {}), ("two-pass", dict(ONEPASS=False))):
        with override_config("engram_gate_bwd", **over):
            f = lambda: engram_gate_bwd(*args)  # noqa: E731
            print(f"{label}: CUPTI {time_kernels(f):.1f} us, graph x1 {time_graph(f, 1, 10):.1f}, "
                  f"graph x3 {time_graph(f, 3, 5):.1f}, graph x3 with L2 flush between calls "
                  f"{time_graph(lambda: (flush.zero_(), f()), 3, 5):.1f} (flush included)")
    small = tuple(a[:132] if a.dim() and a.shape[0] == T else a for a in args[:9]) + (args[9],)
    for label, over in (("one-pass", {}), ("two-pass", dict(ONEPASS=False))):
        with override_config("engram_gate_bwd", **over):
            print(f"{label}: host {time_host(lambda: engram_gate_bwd(*small), 100):.1f} us a call at T=132")
    if T >= 50 * 132:
        for nslot in (3, 2):
            profile(args, onepass.config(H, hc)["NT"], nslot)


def profile(args, nt, nslot=3):
    """Per-phase times (us) of programs 0-3 from the kernel's global-timer marks (PROF), tokens 2-49 averaged."""
    import tritile.engram.engram_gate_kernel as gk
    from tritile.config import get_num_sms
    from tritile.utils import ceil_div

    go, x, k, v, wf, dot, gate, rx, rk, clamp = args
    T, hc, H = x.shape
    kp = 2 + 2 * nt
    prof = torch.zeros(4, 64, kp, dtype=torch.int64, device=x.device)
    outs = [torch.empty_like(x), torch.empty_like(k), torch.empty_like(v),
            torch.empty(get_num_sms(), hc, H, dtype=torch.float32, device=x.device)]
    for _ in range(2):
        onepass.launch(go, x, k, v, wf, dot, gate, rx, rk, clamp, gk._scale(H), *outs,
                       ceil_div(T, get_num_sms()), nslot, prof=prof)
    torch.cuda.synchronize()
    p = prof.double() / 1e3
    tok = (p[:, 3:50, 0] - p[:, 2:49, 0]).mean().item()
    a = (p[:, 2:49, 1] - p[:, 2:49, 0]).mean().item()
    waits, comps = [], []
    prev = p[:, 2:49, 1]
    for i in range(nt):
        waits.append((p[:, 2:49, 2 + i] - prev).mean().item())
        comps.append((p[:, 2:49, 2 + nt + i] - p[:, 2:49, 2 + i]).mean().item())
        prev = p[:, 2:49, 2 + nt + i]
    tail = (p[:, 3:50, 0] - prev).mean().item()
    print(f"nslot={nslot}: token {tok:.2f} us = phase A {a:.2f} + B waits "
          f"{' '.join(f'{w:.2f}' for w in waits)} + B tiles {' '.join(f'{c:.2f}' for c in comps)} + loop {tail:.2f}")


if __name__ == "__main__":
    main()
