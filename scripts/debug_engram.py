"""GPU debug: which outputs of the engram zero-rows case differ from the float64 oracle."""
import sys
sys.path.insert(0, "tests/engram")
import torch
from engram_testlib import EPS, gate_oracle, make_gate_data
from tritile.engram import engram_gate_fwd, fused_weight

torch.manual_seed(0)
T, hc, H = 3, 2, 64
x, k, v, wh, we = make_gate_data(T, hc, H, "cuda")
x[0, 0] = 0
k[1, 1] = 0
wh[1] = -wh[1].abs(); we[1] = we[1].abs(); x[1, 1] = x[1, 1].abs()
wf = fused_weight(wh, we)
out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wf, EPS, 1e-2)
o = gate_oracle(x, k, v, wf, EPS, 1e-2)
bad = out != o[0]
print("n bad", int(bad.sum()), "of", bad.numel())
idx = bad.nonzero()[:10]
for t, h, d in idx.tolist():
    print(t, h, d, "x", x[t, h, d].item(), "v", v[t, d].item(), "g", gate[t, h].item(), "og", o[2][t, h].item(),
          "out", out[t, h, d].item(), "oracle", o[0][t, h, d].item())
print("gate", gate.tolist(), "oracle", o[2].tolist())
print("dot", dot.tolist(), o[1].tolist())
print("rx", rx.tolist(), o[3].tolist())
print("rk", rk.tolist(), o[4].tolist())
