"""``mhc_pre_split_mixes`` (forward + backward) against the reference and its autograd."""

import pytest
import torch

from tritile.config import get_num_sms, set_num_sms
from tritile.modeling.mhc.ops.pre_split_mixes import mhc_pre_split_mixes
from tritile.testing import pick
from tritile.torch.mhc import _pre_split_mixes_bwd_tk, mhc_pre_split_mixes_ref

POST_MULT = 2.0
PRE_EPS = 1e-2


def _tester(impl, mixes, scale, base, grads, n=4, post_mult=POST_MULT):
    m_, s_, b_ = (t.clone().requires_grad_() for t in (mixes, scale, base))
    outs = impl(m_, s_, b_, n, post_mult, PRE_EPS)
    torch.autograd.backward(list(outs), list(grads))
    return (*outs, m_.grad, s_.grad, b_.grad)


def _data(n0, n1, n, device):
    n3 = n * (n + 2)
    mixes = torch.randn(n0, n1, n3, device=device)
    scale = torch.randn(3, device=device)
    base = torch.randn(n3, device=device)
    grads = (torch.randn(n0, n1, n, 1, device=device), torch.randn(n0, n1, n, 1, device=device),
             torch.randn(n0, n1, n, n, device=device))
    return mixes, scale, base, grads


@pytest.mark.parametrize("n0,n1", pick(cpu=[(1, 1), (2, 37), (1, 600)],
                                       gpu=[(n0, n1) for n0 in (1, 2) for n1 in (1024, 4096)]))
def test_pre_split_mixes_comprehensive(device, n0, n1):
    mixes, scale, base, grads = _data(n0, n1, 4, device)
    res = _tester(mhc_pre_split_mixes, mixes, scale, base, grads)
    ref = _tester(mhc_pre_split_mixes_ref, mixes, scale, base, grads)
    assert res[0].shape == (n0, n1, 4, 1) and res[1].shape == (n0, n1, 4, 1) and res[2].shape == (n0, n1, 4, 4)
    for a, b in zip(res, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    _check_exact(res, mixes, scale, base, grads, 4, POST_MULT)


def _check_exact(res, mixes, scale, base, grads, n, post_mult):
    """TileKernels' order, bit for bit: ``(g s)(1 - s)``, ``(g p)(1 - p / mult)``, and the scale and base gradients
    from one row of partial sums per SM (32-token blocks, butterflies, chains) added by ``torch.sum``."""
    t = mixes.shape[0] * mixes.shape[1]
    want = _pre_split_mixes_bwd_tk(mixes.reshape(t, -1), scale, base, res[1].detach().reshape(t, n),
                                   grads[0].reshape(t, n), grads[1].reshape(t, n), grads[2].reshape(t, n, n), n,
                                   post_mult, get_num_sms())
    assert torch.equal(res[3].reshape(t, -1), want[0])
    assert torch.equal(res[4], want[1]) and torch.equal(res[5], want[2])


@pytest.mark.parametrize("n,post_mult", [(2, 1.0), (3, 0.5), (8, 2.0)])
def test_pre_split_mixes_other_sizes(device, n, post_mult):
    mixes, scale, base, grads = _data(1, 5, n, device)
    res = _tester(mhc_pre_split_mixes, mixes, scale, base, grads, n, post_mult)
    ref = _tester(mhc_pre_split_mixes_ref, mixes, scale, base, grads, n, post_mult)
    for a, b in zip(res, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    _check_exact(res, mixes, scale, base, grads, n, post_mult)


def test_pre_split_mixes_partial_grads_and_determinism(device):
    """Only the comb output used (the other grads are None); the per-token gradients do not depend on the SM count,
    the scale and base gradients are TileKernels' for each count (one row of partial sums per SM)."""
    mixes, scale, base, _ = _data(1, 70, 4, device)
    g = torch.randn(1, 70, 4, 4, device=device)
    outs = []
    old = get_num_sms()
    for sms in (1, 3):
        set_num_sms(sms)
        try:
            m_, s_, b_ = (t.clone().requires_grad_() for t in (mixes, scale, base))
            _, _, comb = mhc_pre_split_mixes(m_, s_, b_, 4, POST_MULT, PRE_EPS)
            comb.backward(g)
            outs.append((m_.grad, s_.grad, b_.grad))
            z = torch.zeros(70, 4, device=device)
            want = _pre_split_mixes_bwd_tk(mixes.view(70, -1), scale, base, z, z, z, g.view(70, 4, 4), 4, POST_MULT,
                                           sms)
            assert torch.equal(s_.grad, want[1]) and torch.equal(b_.grad, want[2])
        finally:
            set_num_sms(old)
    m_, s_, b_ = (t.clone().requires_grad_() for t in (mixes, scale, base))
    mhc_pre_split_mixes_ref(m_, s_, b_, 4, POST_MULT, PRE_EPS)[2].backward(g)
    for got in outs:
        for a, b in zip(got, (m_.grad, s_.grad, b_.grad)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    assert torch.equal(outs[0][0], outs[1][0])  # per-token grads do not depend on the partition


def test_pre_split_mixes_zero_tokens(device):
    mixes, scale, base, grads = _data(2, 0, 4, device)
    res = _tester(mhc_pre_split_mixes, mixes, scale, base, grads)
    assert res[0].shape == (2, 0, 4, 1) and res[3].shape == (2, 0, 24)
    assert torch.equal(res[4], torch.zeros(3, device=device)) and torch.equal(res[5], torch.zeros(24, device=device))


def test_pre_split_mixes_bad_input(device):
    mixes, scale, base, _ = _data(1, 3, 4, device)
    with pytest.raises(ValueError, match="input_mixes"):
        mhc_pre_split_mixes(mixes.view(3, 24), scale, base, 4, POST_MULT, PRE_EPS)
    with pytest.raises(ValueError, match="mhc_pre_eps must be positive"):
        mhc_pre_split_mixes(mixes, scale, base, 4, POST_MULT, -1e-2)
    with pytest.raises(ValueError, match="mhc_post_mult_value must be non-zero"):
        mhc_pre_split_mixes(mixes, scale, base, 4, float("nan"), PRE_EPS)
    with pytest.raises(ValueError, match="input_mixes"):
        mhc_pre_split_mixes(mixes, scale, base, 3, POST_MULT, PRE_EPS)
    with pytest.raises(TypeError, match="input_mixes"):
        mhc_pre_split_mixes(mixes.bfloat16(), scale, base, 4, POST_MULT, PRE_EPS)
    with pytest.raises(ValueError, match="input_mixes"):
        mhc_pre_split_mixes(torch.randn(1, 24, 3, device=device).transpose(1, 2), scale, base, 4, POST_MULT,
                            PRE_EPS)
    with pytest.raises(ValueError, match="mhc_scale"):
        mhc_pre_split_mixes(mixes, scale[:2], base, 4, POST_MULT, PRE_EPS)
    with pytest.raises(ValueError, match="mhc_base"):
        mhc_pre_split_mixes(mixes, scale, base[:20], 4, POST_MULT, PRE_EPS)
    with pytest.raises(ValueError, match="mhc_post_mult_value"):
        mhc_pre_split_mixes(mixes, scale, base, 4, 0.0, PRE_EPS)
    with pytest.raises(TypeError, match="mhc_mult"):
        mhc_pre_split_mixes(mixes, scale, base, 4.0, POST_MULT, PRE_EPS)


def test_pre_split_mixes_compile(device):
    mixes, scale, base, grads = _data(1, 6, 4, device)
    fn = torch.compile(mhc_pre_split_mixes, fullgraph=True, backend=pick(cpu="eager", gpu="inductor"))
    for a, b in zip(_tester(fn, mixes, scale, base, grads), _tester(mhc_pre_split_mixes, mixes, scale, base, grads)):
        assert torch.equal(a, b)


def test_pre_split_mixes_without_a_graph(device):
    """With nothing to differentiate the op launches its kernel without an autograd node: the same bits as the
    recorded forward and no ``grad_fn``."""
    mixes = torch.randn(2, 7, 24, device=device)
    scale, base = torch.randn(3, device=device), torch.randn(24, device=device)
    with_graph = mhc_pre_split_mixes(mixes, scale.clone().requires_grad_(), base, 4, 2.0, 1e-2)
    with torch.no_grad():
        off = mhc_pre_split_mixes(mixes.clone().requires_grad_(), scale, base, 4, 2.0, 1e-2)
    for outs in (mhc_pre_split_mixes(mixes, scale, base, 4, 2.0, 1e-2), off):
        for a, b in zip(outs, with_graph):
            assert a.grad_fn is None and a.shape == b.shape
            assert torch.equal(a, b.detach())
