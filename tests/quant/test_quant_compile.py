"""Every public quant op under ``torch.compile(fullgraph=True)``: the compiled call runs the registered custom op
(``torch.ops.tritile.*``, traced through its fake kernel) and gives the eager call's bits.

CPU: the "eager" backend (Dynamo + the fake kernels, no code generation) for every op; the ops marked
``inductor=True`` also run under inductor (it compiles C++ on the CPU: slow, so a representative few).
GPU: inductor for every op."""

from __future__ import annotations

import pytest
import torch

import tritile.quant as quant
from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
from tritile.testing import assert_tree_equal, is_gpu_run


def _x(device, m=8, k=256, dtype=torch.bfloat16):
    return torch.randn(m, k, device=device).to(dtype)


def _fp4(device, m=8, k=256):
    return quant.per_token_cast(_x(device, m, k), "e2m1", 32, round_sf=True)


def _maps(device, n=4):
    idx = torch.arange(n, dtype=torch.int32, device=device)
    return idx, idx.reshape(n, 1)


def _swiglu_bwd(d):
    n, hidden, npc = 4, 128, 128
    xq = quant.per_token_cast(_x(d, n, 2 * hidden), "e4m3", npc)
    g, w, (ptt, ttp) = _x(d, n, hidden), torch.rand((n, 1), device=d), _maps(d, n)
    return lambda: quant.swiglu_backward_and_per_token_cast(xq, g, w, ptt, ttp, npc, round_sf=True,
                                                            swiglu_clamp_value=3.0)


def _precomputed(d, block):
    x = _x(d)
    if block:
        sf = quant.per_block_cast_with_sf_only(x, "e4m3", (32, 32))
        return lambda: quant.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), sf)
    sf = quant.per_token_cast_with_sf_only(x, "e4m3", 128)
    return lambda: quant.per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf)


def _bound(fn, make_args):
    """A factory: device -> zero-argument call of ``fn`` on inputs built for that device."""
    def factory(d):
        args = make_args(d)
        return lambda: fn(*args)
    return factory


def _routed(d):
    x, (ptt, _), w = _x(d), _maps(d, 8), torch.rand(8, 1, device=d)
    return lambda: quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_token_topk=ptt, topk_weights=w)


# name -> factory(device) -> zero-argument call; every public quant op, and the input kinds that take other paths
_CASES = {
    "per_token_cast": _bound(lambda x: quant.per_token_cast(x, "e4m3", 128, round_sf=True), lambda d: (_x(d),)),
    "per_token_cast_e2m1_packed": _bound(
        lambda x: quant.per_token_cast(x, "e2m1", 32, use_tma_aligned_col_major_sf=True, round_sf=True,
                                       use_packed_ue8m0=True), lambda d: (_x(d),)),
    "per_token_cast_from_fp4": _bound(lambda q: quant.per_token_cast(q, "e4m3", 128, x_block_size=(1, 32)),
                                      lambda d: (_fp4(d),)),
    "per_token_cast_with_sf_only": _bound(lambda x: quant.per_token_cast_with_sf_only(x, "e4m3", 64),
                                          lambda d: (_x(d),)),
    "per_token_cast_with_precomputed_sf": lambda d: _precomputed(d, False),
    "per_block_cast": _bound(lambda x: quant.per_block_cast(x, "e4m3", (32, 32)), lambda d: (_x(d),)),
    "per_block_cast_with_sf_only": _bound(lambda x: quant.per_block_cast_with_sf_only(x, "e4m3", (32, 32)),
                                          lambda d: (_x(d),)),
    "per_block_cast_with_precomputed_sf": lambda d: _precomputed(d, True),
    "per_block_cast_lossless": _bound(lambda q: quant.per_block_cast_lossless(q, "e4m3", (1, 32), (1, 128)),
                                      lambda d: (_fp4(d),)),
    "per_channel_cast": _bound(lambda x: quant.per_channel_cast(x, "e4m3", 128), lambda d: (_x(d, 128, 128),)),
    "per_channel_cast_fused": _bound(lambda x: quant.per_channel_cast_fused(x, "e4m3", 128),
                                     lambda d: (_x(d, 128, 128),)),
    "per_channel_cast_and_transpose": _bound(lambda x: quant.per_channel_cast_and_transpose(x, "e4m3", 128),
                                             lambda d: (_x(d, 128, 128),)),
    "swiglu_forward_and_per_token_cast": _bound(
        lambda x: quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, swiglu_clamp_value=2.0),
        lambda d: (_x(d),)),
    "swiglu_forward_and_per_token_cast_routed": _routed,
    "swiglu_forward_and_per_channel_cast_and_transpose": _bound(
        lambda x: quant.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 128),
        lambda d: (_x(d, 128, 128),)),
    "swiglu_backward_and_per_token_cast": _swiglu_bwd,
    "cast_back": _bound(lambda q: quant.cast_back(q, "bf16", (1, 32)), lambda d: (_fp4(d),)),
    "per_token_cast_back": _bound(lambda q: quant.per_token_cast_back(q, "fp32", 32), lambda d: (_fp4(d),)),
    "per_token_cast_to_e5m6": _bound(lambda x: per_token_cast_to_e5m6(x, 256, round_sf=True), lambda d: (_x(d),)),
    "cast_back_e5m6": _bound(lambda q: cast_back_e5m6(q, "bf16", (1, 256)),
                             lambda d: (per_token_cast_to_e5m6(_x(d), 256),)),
    "unpack_from_e2m1fn_x2": _bound(lambda q: quant.unpack_from_e2m1fn_x2(q[0]), lambda d: (_fp4(d),)),
}


_NAMES = list(_CASES)
# inductor on the CPU (C++ code generation: seconds per op): one op of each registration style
_INDUCTOR_CPU = {"per_token_cast", "per_channel_cast_and_transpose", "swiglu_forward_and_per_token_cast", "cast_back"}


def _backends(name):
    if is_gpu_run():
        return ["inductor"]
    return ["eager"] + (["inductor"] if name in _INDUCTOR_CPU else [])


@pytest.mark.parametrize("name,backend", [(n, b) for n in _NAMES for b in _backends(n)])
def test_compile_fullgraph(device, name, backend):
    torch._dynamo.reset()
    call = _CASES[name](device)
    want = call()
    got = torch.compile(call, backend=backend, fullgraph=True)()
    assert_tree_equal(got, want)
