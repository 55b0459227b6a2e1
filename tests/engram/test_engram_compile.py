"""Every public engram op, and the ``engram_gate`` autograd layer (forward and backward), under
``torch.compile(fullgraph=True)``: the compiled call runs the registered custom ops (``torch.ops.tritile.*``, traced
through their fake kernels) and gives the eager call's bits.  CPU: the "eager" backend; GPU: inductor."""

from __future__ import annotations

import pytest
import torch

from tritile.engram import engram_gate_bwd, engram_gate_fwd, engram_hash, fused_weight, grad_w_reduce
from tritile.modeling.engram import engram_gate
from tritile.testing import assert_tree_equal, is_gpu_run
from tritile.torch.engram import make_offsets

from engram_testlib import CLAMP, EPS, make_gate_data

T, HC, H = 5, 4, 64


def _gate(d):
    x, k, v, wh, we = make_gate_data(T, HC, H, d)
    return x, k, v, fused_weight(wh, we), wh, we


def _fwd(d):
    x, k, v, wf, _, _ = _gate(d)
    return lambda: engram_gate_fwd(x, k, v, wf, EPS, CLAMP, True)


def _fwd_nosave(d):
    x, k, v, wf, _, _ = _gate(d)
    return lambda: engram_gate_fwd(x, k, v, wf, EPS, CLAMP, False)


def _bwd(d):
    x, k, v, wf, _, _ = _gate(d)
    _, dot, gate, rx, rk = engram_gate_fwd(x, k, v, wf, EPS, CLAMP, True)
    go = torch.randn(T, HC, H, device=d).to(torch.bfloat16)
    return lambda: engram_gate_bwd(go, x, k, v, wf, dot, gate, rx, rk, CLAMP)


def _fused(d):
    _, _, _, _, wh, we = _gate(d)
    return lambda: fused_weight(wh, we)


def _reduce(d):
    part = torch.randn(3, HC, H, device=d)
    _, _, _, _, wh, we = _gate(d)
    gwh0, gwe0 = torch.randn(HC, H, device=d), torch.randn(HC, H, device=d)

    def call():  # in place: fresh accumulators each call, returned for the comparison
        gwh, gwe = gwh0.clone(), gwe0.clone()
        grad_w_reduce(part, wh, we, gwh, gwe)
        return gwh, gwe
    return call


def _hash(d):
    N, L, E = 3, 2, 4
    ids = torch.randint(0, 50000, (9, N), dtype=torch.int32, device=d)
    mult = torch.randint(1, 2 ** 20, (L, N), dtype=torch.int64, device=d)
    vocab = torch.randint(100000, 1000000, (L, N - 1, E), dtype=torch.int32, device=d)
    offsets = make_offsets(vocab)
    return lambda: engram_hash(ids, mult, vocab, offsets)


_CASES = {"engram_gate_fwd": _fwd, "engram_gate_fwd_nosave": _fwd_nosave, "engram_gate_bwd": _bwd,
          "fused_weight": _fused, "grad_w_reduce": _reduce, "engram_hash": _hash}
_BACKEND = "inductor" if is_gpu_run() else "eager"


@pytest.mark.parametrize("name", list(_CASES))
def test_compile_fullgraph(device, name):
    torch._dynamo.reset()
    call = _CASES[name](device)
    want = call()
    assert_tree_equal(torch.compile(call, backend=_BACKEND, fullgraph=True)(), want)


@pytest.mark.parametrize("tokens", [0, 3])
def test_engram_gate_compiled_forward_backward(device, tokens):
    """The autograd layer compiled with fullgraph: same output and gradients (x, k, v, both weights) as eager;
    0 tokens included (the backward then sees empty gradients)."""
    torch._dynamo.reset()
    x, k, v, wh, we = make_gate_data(tokens, HC, H, device)
    go = torch.randn(tokens, HC, H, device=device).to(torch.bfloat16)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, k, v, wh, we)]
        out = fn(*leaves)
        out.backward(go)
        return [out.detach()] + [t.grad for t in leaves]

    def layer(x, k, v, wh, we):
        return engram_gate(x, k, v, wh, we, CLAMP, EPS)

    want = run(layer)
    got = run(torch.compile(layer, backend=_BACKEND, fullgraph=True))
    assert_tree_equal(got, want)
