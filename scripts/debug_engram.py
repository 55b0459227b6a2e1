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

# --- autograd at H=7168: which grad_x is off, and against what?
from tritile.engram import engram_gate_bwd
from tritile.modeling.engram import engram_gate
from tritile.testing import calc_diff
from tritile.torch.engram import engram_gate_ref

T, hc, H = 4000, 4, 7168
x, k, v, wh, we = (t.requires_grad_(True) for t in make_gate_data(T, hc, H, "cuda"))
go = torch.randn(T, hc, H, dtype=torch.bfloat16, device="cuda")
out = engram_gate(x, k, v, wh, we, 1e-6, EPS)
out.backward(go)
gx_auto = x.grad.clone()
xr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (x, k, v))
whr, wer = (t.detach().float().requires_grad_(True) for t in (wh, we))
o, dot, gate, rx, rk = engram_gate_ref(xr, kr, vr, whr, wer, 1e-6, EPS, save_for_backward=True)
o.backward(go)
wf = wh.detach().float() * we.detach().float()
_, kdot, kgate, krx, krk = engram_gate_fwd(x.detach(), k.detach(), v.detach(), wf, EPS, 1e-6)
gx_refsaved = engram_gate_bwd(go, x.detach(), k.detach(), v.detach(), wf, dot.detach(), gate.detach(), rx.detach(),
                              rk.detach(), 1e-6)[0]
gx_kersaved = engram_gate_bwd(go, x.detach(), k.detach(), v.detach(), wf, kdot, kgate, krx, krk, 1e-6)[0]
print("autograd vs ref-autograd", calc_diff(gx_auto, xr.grad))
print("kernel-bwd(ref saved) vs ref-autograd", calc_diff(gx_refsaved, xr.grad))
print("kernel-bwd(kernel saved) vs ref-autograd", calc_diff(gx_kersaved, xr.grad))
print("kernel-bwd(kernel saved) vs autograd path", calc_diff(gx_kersaved, gx_auto))
print("saved diffs: dot", calc_diff(kdot, dot), "gate", calc_diff(kgate, gate), "rx", calc_diff(krx, rx), "rk",
      calc_diff(krk, rk))
print("wf vs fused_weight", calc_diff(wf, fused_weight(wh.detach(), we.detach())))
