"""Inputs a hostile (or unlucky) caller passes, across modules, by kind:

* valid input that must work: empty tensors with zero strides (``torch.zeros(()).expand(0, K)``, the gradient a
  ``.sum()`` hands a backward on 0 tokens);
* errors that must name the right argument (``sf=None``, one of two weights with the wrong shape, a string as a
  dtype);
* bad input that must not be taken silently: output buffers overlapping an input or each other, negative / NaN /
  infinite ``eps`` and ``clamp_value``.
"""

from __future__ import annotations

import pytest
import torch

import tritile.quant as quant
from tritile.engram import engram_gate_bwd, engram_gate_fwd, fused_weight, grad_w_reduce
from tritile.modeling.engram import engram_gate
from tritile.quant.cast_back_e5m6_kernel import cast_back_e5m6
from tritile.quant.per_token_cast_to_e5m6_kernel import per_token_cast_to_e5m6
from tritile.runtime import check_no_overlap
from tritile.testing import assert_equal
from tritile.transpose import batched_transpose, transpose

HC, H = 4, 64


def _zs(shape, dtype, device):
    """An empty tensor of ``shape`` whose strides are all 0 (an expanded scalar)."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def _ones(mk):
    """A dense float32 (HC, H) weight on the device ``mk`` builds on."""
    return torch.ones(HC, H, device=mk((0,), torch.float32).device)


# name -> call(make) where make(shape, dtype) builds the empty input: a zero-stride one or a plain one
_EMPTY_CASES = {
    "per_token_cast": lambda mk: quant.per_token_cast(mk((0, 256), torch.bfloat16), "e4m3", 128),
    "per_token_cast_e2m1": lambda mk: quant.per_token_cast(mk((0, 256), torch.float32), "e2m1", 32),
    "per_token_cast_fp4_in": lambda mk: quant.per_token_cast((mk((0, 128), torch.int8), mk((0, 8), torch.float32)),
                                                             "e4m3", 128, x_block_size=(1, 32)),
    "per_token_cast_with_sf_only": lambda mk: quant.per_token_cast_with_sf_only(mk((0, 256), torch.bfloat16),
                                                                                "e4m3", 128),
    "per_token_cast_with_precomputed_sf": lambda mk: quant.per_token_cast_with_precomputed_sf(
        mk((0, 256), torch.bfloat16), "e4m3", 128, mk((0, 2), torch.float32)),
    "per_block_cast": lambda mk: quant.per_block_cast(mk((0, 256), torch.bfloat16), "e4m3", (128, 128)),
    "per_block_cast_lossless": lambda mk: quant.per_block_cast_lossless(
        (mk((0, 128), torch.int8), mk((0, 8), torch.float32)), "e4m3", (1, 32), (1, 128)),
    "per_channel_cast": lambda mk: quant.per_channel_cast(mk((0, 128), torch.bfloat16), "e4m3", 128),
    "per_channel_cast_fused": lambda mk: quant.per_channel_cast_fused(mk((0, 128), torch.bfloat16), "e4m3", 128),
    "per_channel_cast_and_transpose": lambda mk: quant.per_channel_cast_and_transpose(
        mk((0, 128), torch.bfloat16), "e4m3", 128),
    "swiglu_forward_and_per_token_cast": lambda mk: quant.swiglu_forward_and_per_token_cast(
        mk((0, 256), torch.bfloat16), "e4m3", 128),
    "swiglu_forward_and_per_channel_cast_and_transpose": lambda mk: (
        quant.swiglu_forward_and_per_channel_cast_and_transpose(mk((0, 256), torch.bfloat16), "e4m3", 128)),
    "swiglu_backward_and_per_token_cast": lambda mk: quant.swiglu_backward_and_per_token_cast(
        (mk((0, 256), torch.float8_e4m3fn), mk((0, 2), torch.float32)), mk((0, 128), torch.bfloat16),
        mk((0, 1), torch.float32), mk((0,), torch.int32), mk((0, 1), torch.int32), 128),
    "cast_back": lambda mk: quant.cast_back((mk((0, 256), torch.float8_e4m3fn), mk((0, 2), torch.float32)),
                                           "bf16", (1, 128)),
    "per_token_cast_to_e5m6": lambda mk: per_token_cast_to_e5m6(mk((0, 256), torch.bfloat16), 256),
    "cast_back_e5m6": lambda mk: cast_back_e5m6((mk((0, 384), torch.uint8), mk((0, 1), torch.float32)), "fp32",
                                                (1, 256)),
    "unpack_from_e2m1fn_x2": lambda mk: quant.unpack_from_e2m1fn_x2(mk((0, 128), torch.int8)),
    "transpose": lambda mk: transpose(mk((0, 256), torch.bfloat16)),
    "batched_transpose": lambda mk: batched_transpose(mk((2, 0, 256), torch.float32)),
    "engram_gate_fwd": lambda mk: engram_gate_fwd(mk((0, HC, H), torch.bfloat16), mk((0, HC, H), torch.bfloat16),
                                                  mk((0, H), torch.bfloat16), _ones(mk), 1e-20, 1e-6, True),
    "engram_gate_bwd": lambda mk: engram_gate_bwd(
        mk((0, HC, H), torch.bfloat16), mk((0, HC, H), torch.bfloat16), mk((0, HC, H), torch.bfloat16),
        mk((0, H), torch.bfloat16), _ones(mk), *[mk((0, HC), torch.float32)] * 4, 1e-6),
}


def _flat(res):
    if isinstance(res, (tuple, list)):
        return [t for r in res for t in _flat(r)]
    return [res]


@pytest.mark.parametrize("name", list(_EMPTY_CASES))
def test_empty_zero_stride_inputs(device, name):
    """Every op takes empty inputs whose strides are 0 and returns what it returns for plain empty inputs."""
    zero = _EMPTY_CASES[name](lambda shape, dtype: _zs(shape, dtype, device))
    plain = _EMPTY_CASES[name](lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
    zero, plain = _flat(zero), _flat(plain)
    assert len(zero) == len(plain)
    for z, p in zip(zero, plain):
        assert_equal(z, p, check_stride=False)
        assert z.shape == p.shape and z.dtype == p.dtype


def test_engram_gate_zero_tokens_sum_backward(device):
    """``.sum()`` of a 0-token output hands the backward a zero-stride empty gradient: all gradients come back
    with their inputs' shapes (the weights' gradients zero)."""
    leaves = [torch.zeros(0, HC, H, dtype=torch.bfloat16, device=device), torch.zeros(0, HC, H, dtype=torch.bfloat16,
              device=device), torch.zeros(0, H, dtype=torch.bfloat16, device=device),
              torch.randn(HC, H, device=device).bfloat16(), torch.randn(HC, H, device=device).bfloat16()]
    leaves = [t.requires_grad_() for t in leaves]
    engram_gate(*leaves, 1e-6, 1e-20).sum().backward()
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape
    assert not leaves[3].grad.any() and not leaves[4].grad.any()


@pytest.mark.parametrize("op", ["per_token", "per_block"])
def test_precomputed_sf_none(device, op):
    x = torch.randn(8, 256, device=device).bfloat16()
    with pytest.raises(TypeError, match="sf must be a torch.Tensor, got NoneType"):
        if op == "per_token":
            quant.per_token_cast_with_precomputed_sf(x, "e4m3", 128, None)
        else:
            quant.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), None)


@pytest.mark.parametrize("bad", ["weight_hidden", "weight_embed"])
def test_engram_gate_names_the_bad_weight(device, bad):
    x = torch.randn(3, HC, H, device=device).bfloat16()
    v = torch.randn(3, H, device=device).bfloat16()
    w = {n: torch.randn(HC, H, device=device).bfloat16() for n in ("weight_hidden", "weight_embed")}
    w[bad] = torch.randn(HC, H + 1, device=device).bfloat16()
    with pytest.raises(ValueError, match=f"^{bad} must have shape"):
        engram_gate(x, x.clone(), v, w["weight_hidden"], w["weight_embed"], 1e-6, 1e-20)
    with pytest.raises(ValueError, match="weight_hidden and weight_embed must have the same shape"):
        fused_weight(w["weight_hidden"], w["weight_embed"])


@pytest.mark.parametrize("out_dtype", ["fp32", torch.int32, torch.float8_e4m3fn, None])
def test_unpack_out_dtype(device, out_dtype):
    x = torch.zeros(4, 8, dtype=torch.int8, device=device)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        quant.unpack_from_e2m1fn_x2(x, out_dtype)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("arg", ["eps", "clamp_value"])
def test_engram_eps_clamp_values(device, arg, value):
    T = 2
    x = torch.randn(T, HC, H, device=device).bfloat16()
    v = torch.randn(T, H, device=device).bfloat16()
    wh, we = torch.randn(HC, H, device=device).bfloat16(), torch.randn(HC, H, device=device).bfloat16()
    wf = fused_weight(wh, we)
    kw = dict(eps=1e-20, clamp_value=1e-6)
    kw[arg] = value
    match = f"{arg} must be a finite number >= 0"
    with pytest.raises(ValueError, match=match):
        engram_gate_fwd(x, x, v, wf, kw["eps"], kw["clamp_value"], True)
    with pytest.raises(ValueError, match=match):
        engram_gate(x, x, v, wh, we, kw["clamp_value"], kw["eps"])
    if arg == "clamp_value":
        _, dot, g, rx, rk = engram_gate_fwd(x, x, v, wf, 1e-20, 1e-6, True)
        with pytest.raises(ValueError, match=match):
            engram_gate_bwd(x, x, x, v, wf, dot, g, rx, rk, value)


def test_grad_w_reduce_overlapping_buffers(device):
    part = torch.randn(2, HC, H, device=device)
    wh, we = torch.randn(HC, H, device=device).bfloat16(), torch.randn(HC, H, device=device).bfloat16()
    buf = torch.zeros(HC + 1, H, device=device)
    with pytest.raises(ValueError, match="grad_weight_hidden must not overlap grad_weight_embed"):
        grad_w_reduce(part, wh, we, buf[:HC], buf[1:])
    with pytest.raises(ValueError, match="grad_weight_hidden must not overlap the input grad_w_partial"):
        grad_w_reduce(part, wh, we, part[1], torch.zeros(HC, H, device=device))
    with pytest.raises(ValueError, match="grad_weight_embed must not overlap the input grad_w_partial"):
        grad_w_reduce(part, wh, we, torch.zeros(HC, H, device=device), part[0])
    wide = torch.zeros(HC, 2 * H, device=device)  # interleaving halves of one row: disjoint, accepted
    grad_w_reduce(part, wh, we, wide[:, :H], wide[:, H:])
    ref = part.sum(0)
    assert_equal(wide[:, :H].contiguous(), ref * we.float())
    assert_equal(wide[:, H:].contiguous(), ref * wh.float())


def test_engram_gate_shared_main_grad(device):
    """Both weights accumulating into one ``main_grad`` would race: refused with the argument named."""
    x = torch.randn(2, HC, H, device=device).bfloat16().requires_grad_()
    v = torch.randn(2, H, device=device).bfloat16()
    wh = torch.randn(HC, H, device=device).bfloat16().requires_grad_()
    we = torch.randn(HC, H, device=device).bfloat16().requires_grad_()
    wh.main_grad = we.main_grad = torch.zeros(HC, H, device=device)
    out = engram_gate(x, x.detach(), v, wh, we, 1e-6, 1e-20)
    with pytest.raises(ValueError, match="grad_weight_hidden and grad_weight_embed must be different tensors"):
        out.backward(torch.ones_like(out))


def test_swiglu_clamped_count_overlapping_input(device):
    x = torch.randn(4, 256, device=device).bfloat16()
    raw = x.view(torch.int64)  # (4, 64) int64 over x's bytes
    with pytest.raises(ValueError, match="clamped_count must not overlap the input x"):
        quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, swiglu_clamp_value=1.0, clamped_count=raw[0, :3])


def test_check_no_overlap_helper():
    buf = torch.zeros(10)
    check_no_overlap(dict(a=buf[:5], b=buf[5:]), dict(c=torch.zeros(3)))
    check_no_overlap(dict(a=buf[:0], b=buf[:0]))  # empty tensors span nothing
    with pytest.raises(ValueError, match="a must not overlap b"):
        check_no_overlap(dict(a=buf[:6], b=buf[5:]))
    with pytest.raises(ValueError, match="b must not overlap the input c"):
        check_no_overlap(dict(a=buf[:2], b=buf[5:]), dict(c=buf[9:]))


def test_check_no_overlap_interleaved():
    buf = torch.zeros(4, 8)
    check_no_overlap(dict(a=buf[:, :4], b=buf[:, 4:]))  # column halves: spans overlap, runs do not
    check_no_overlap(dict(a=buf[:, ::2], b=buf[:, 1::2]))  # alternate elements
    check_no_overlap(dict(a=buf[::2], b=buf[1::2]))  # alternate rows
    with pytest.raises(ValueError, match="a must not overlap b"):
        check_no_overlap(dict(a=buf[:, :5], b=buf[:, 4:]))
    with pytest.raises(ValueError, match="a must not overlap b"):
        check_no_overlap(dict(a=buf[:, ::2], b=buf[:, 2::3]))
    with pytest.raises(ValueError, match="a must not overlap b"):
        check_no_overlap(dict(a=buf.view(torch.int64)[3, 3:], b=buf[3, 7:]))  # other dtypes, the last bytes
