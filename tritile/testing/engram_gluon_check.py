"""Launch the one-pass Gluon ``engram_gate_bwd`` kernel at shapes that really take it, for compute-sanitizer.

``python -m tritile.testing.engram_gluon_check`` (CUDA, Hopper, Triton with Gluon) runs ``engram_gate_bwd`` on a few
small shapes the one-pass kernel covers (hc in {1, 2, 4}, H a multiple of 256: long token chunks that wrap the
shared-memory ring, chunks of one token, rows without tokens), checks that the Gluon kernel ran, and compares
grad_v (calc_diff < 1e-8, the spec's bound; the elements that differ at all are counted and printed) and grad_x /
grad_k / grad_w_partial (calc_diff < 1e-5) against the two-pass Triton kernels.  Run under
``compute-sanitizer --tool racecheck`` / ``--tool synccheck`` (``scripts/gpu_check.sh``): exits 1 when the kernel
cannot run here or a result differs.
"""

from __future__ import annotations

import sys
from typing import List, Tuple

import torch

__all__ = ["SHAPES", "main"]

# (num_tokens, hc, hidden_size, num_sms): few programs make long chunks whose token loop wraps the ring many times
SHAPES: List[Tuple[int, int, int, int]] = [(40, 4, 2048, 3), (9, 1, 1024, 4), (17, 2, 4096, 132), (5, 4, 256, 8)]


def _check_shape(T: int, hc: int, H: int, num_sms: int) -> List[str]:
    from .. import config
    from ..engram import _engram_bwd_gluon as onepass
    from ..engram import engram_gate_bwd, engram_gate_fwd, fused_weight
    from ..runtime import override_config
    from .numeric import calc_diff

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T * 1000 + H)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)

    x, k, go = rnd(T, hc, H), rnd(T, hc, H), rnd(T, hc, H)
    v, wh, we = rnd(T, H), rnd(hc, H), rnd(hc, H)
    wf = fused_weight(wh, we)
    _, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wf, 1e-20, 1e-6, True)
    if not onepass.supports(go, x, k, v, wf):
        return [f"T={T} hc={hc} H={H}: the one-pass kernel does not cover this shape"]
    calls = [0]
    launch = onepass.launch

    def counted(*a, **kw):
        calls[0] += 1
        return launch(*a, **kw)

    old_sms = config.get_num_sms()
    config.set_num_sms(num_sms)
    onepass.launch = counted
    try:
        one = engram_gate_bwd(go, x, k, v, wf, dot, gate, rx, rk, 1e-6)
        with override_config("engram_gate_bwd", ONEPASS=False):
            two = engram_gate_bwd(go, x, k, v, wf, dot, gate, rx, rk, 1e-6)
        torch.cuda.synchronize()
    finally:
        onepass.launch = launch
        config.set_num_sms(old_sms)
    errors = []
    if calls[0] != 1:
        errors.append(f"T={T} hc={hc} H={H}: the one-pass kernel ran {calls[0]} times, expected once")
    # grad_v = bf16(sum_h g_h G_h) in head order; the spec leaves FMA contraction open (its bound is calc_diff
    # < 1e-8), so the two designs may differ by a rounding: report how many elements differ and by how much.
    nd = int((one[2].view(torch.int16) != two[2].view(torch.int16)).sum())
    if nd:
        ulps = (one[2].view(torch.int16).int() - two[2].view(torch.int16).int()).abs().max().item()
        print(f"T={T} hc={hc} H={H}: grad_v: {nd} of {one[2].numel()} elements differ from the two-pass kernels "
              f"(at most {ulps} bf16 ulp)")
    pairs = (("grad_v", one[2], two[2], 1e-8), ("grad_x", one[0], two[0], 1e-5), ("grad_k", one[1], two[1], 1e-5),
             ("grad_w", one[3].sum(0), two[3].sum(0), 1e-5))
    for name, a, b, bound in pairs:
        d = calc_diff(a.float(), b.float())
        if not d < bound:
            errors.append(f"T={T} hc={hc} H={H}: {name} differs from the two-pass kernels (diff {d:.3g})")
    return errors


def main() -> int:
    from ..engram import _engram_bwd_gluon as onepass

    if not torch.cuda.is_available() or not onepass.available(torch.device("cuda")):
        print("the one-pass Gluon kernel cannot run here (needs a Hopper-class GPU and Triton 3.6's Gluon)")
        return 1
    errors = []
    for shape in SHAPES:
        errs = _check_shape(*shape)
        errors += errs
        print(f"T, hc, H, num_sms = {shape}: {'ok' if not errs else 'FAILED'}", flush=True)
    for e in errors:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
