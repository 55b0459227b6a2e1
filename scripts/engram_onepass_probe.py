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
    for label, over in (("one-pass", {}), ("two-pass", dict(ONEPASS=False))):
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


if __name__ == "__main__":
    main()
