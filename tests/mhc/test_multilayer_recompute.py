"""``mhc_multilayer_recompute``: bitwise equal to chaining ``mhc_pre_apply_mix`` and ``mhc_post``."""

import pytest
import torch

from tritile.modeling.mhc.ops.multilayer_recompute import mhc_multilayer_recompute
from tritile.modeling.mhc.ops.post import mhc_post
from tritile.modeling.mhc.ops.pre_apply_mix import mhc_pre_apply_mix
from tritile.testing import pick

N = 4


def _data(num_layers, num_post, bs, seq, h, device, n=N):
    torch.manual_seed(0)
    r0 = torch.randn(bs, seq, n, h, device=device).bfloat16()
    pre = [torch.randn(bs, seq, n, 1, device=device) for _ in range(num_layers)]
    y = [torch.randn(bs, seq, h, device=device).bfloat16() for _ in range(num_post)]
    post = [torch.randn(bs, seq, n, 1, device=device) for _ in range(num_post)]
    comb = [torch.randn(bs, seq, n, n, device=device) for _ in range(num_post)]
    li = [torch.empty(bs, seq, h, dtype=torch.bfloat16, device=device) for _ in range(num_layers)]
    res = [torch.empty(bs, seq, n, h, dtype=torch.bfloat16, device=device) for _ in range(num_post)]
    return r0, pre, y, post, comb, li, res


def _chain(r0, pre, y, post, comb):
    r, li, res = r0, [], []
    with torch.no_grad():
        for i in range(len(pre)):
            li.append(mhc_pre_apply_mix(r, pre[i]))
            if i < len(y):
                r = mhc_post(y[i], r, post[i], comb[i])
                res.append(r)
    return li, res


@pytest.mark.parametrize("num_layers,num_post,seq,h", pick(
    cpu=[(1, 1, 3, 64), (3, 2, 13, 80), (3, 3, 2, 1280), (4, 3, 1, 48)],
    gpu=[(1, 1, 8192, 2560), (3, 2, 8192, 2560), (3, 3, 8192, 2560)]
    + [(10, lp, 8192, h) for h in (2560, 4096, 7168, 8192) for lp in (9, 10)]))
def test_multilayer_recompute(device, num_layers, num_post, seq, h):
    r0, pre, y, post, comb, li, res = _data(num_layers, num_post, 1, seq, h, device)
    assert mhc_multilayer_recompute(r0, pre, y, post, comb, li, res) is None
    li_ref, res_ref = _chain(r0, pre, y, post, comb)
    for a, b in zip(li, li_ref):
        assert torch.equal(a, b)
    for a, b in zip(res, res_ref):
        assert torch.equal(a, b)


def test_multilayer_recompute_other_n_and_zero_tokens(device):
    r0, pre, y, post, comb, li, res = _data(2, 2, 2, 3, 64, device, n=2)
    mhc_multilayer_recompute(r0, pre, y, post, comb, li, res)
    li_ref, res_ref = _chain(r0, pre, y, post, comb)
    assert all(torch.equal(a, b) for a, b in zip(li + res, li_ref + res_ref))
    args = _data(2, 1, 1, 0, 64, device)
    assert mhc_multilayer_recompute(*args) is None


def test_multilayer_recompute_bad_input(device):
    r0, pre, y, post, comb, li, res = _data(2, 2, 1, 3, 64, device)
    with pytest.raises(ValueError, match="layer_output_list"):
        mhc_multilayer_recompute(r0, pre, y[:0], post[:0], comb[:0], li, res[:0])
    with pytest.raises(ValueError, match="post_mix_list"):
        mhc_multilayer_recompute(r0, pre, y, post[:1], comb, li, res)
    with pytest.raises(ValueError, match="pre_mix_list"):
        mhc_multilayer_recompute(r0, [], [], [], [], [], [])
    with pytest.raises(TypeError, match="initial_residual"):
        mhc_multilayer_recompute(r0.float(), pre, y, post, comb, li, res)
    with pytest.raises(TypeError, match=r"layer_input_list\[1\]"):
        mhc_multilayer_recompute(r0, pre, y, post, comb, [li[0], li[1].float()], res)
    with pytest.raises(ValueError, match=r"residual_list\[0\]"):
        mhc_multilayer_recompute(r0, pre, y, post, comb, li, [res[0][..., :32], res[1]])
    with pytest.raises(ValueError, match=r"comb_mix_list\[1\]"):
        mhc_multilayer_recompute(r0, pre, y, post, [comb[0], comb[1].transpose(-1, -2)], li, res)
    with pytest.raises(TypeError, match="pre_mix_list"):
        mhc_multilayer_recompute(r0, pre[0], y, post, comb, li, res)


def test_multilayer_recompute_compile(device):
    r0, pre, y, post, comb, li, res = _data(2, 1, 1, 3, 64, device)
    li2 = [torch.empty_like(t) for t in li]
    res2 = [torch.empty_like(t) for t in res]

    def fn(r0, pre, y, post, comb, li, res):
        mhc_multilayer_recompute(r0, pre, y, post, comb, li, res)

    torch.compile(fn, fullgraph=True, backend=pick(cpu="eager", gpu="inductor"))(r0, pre, y, post, comb, li2, res2)
    mhc_multilayer_recompute(r0, pre, y, post, comb, li, res)
    assert all(torch.equal(a, b) for a, b in zip(li + res, li2 + res2))



def test_multilayer_recompute_other_tiling(device):
    """Bitwise equal to the chain even when its tiles differ from the chained kernels' (per-element math)."""
    from tritile.runtime import override_config

    r0, pre, y, post, comb, li, res = _data(3, 3, 1, 6, 96, device)
    with override_config("mhc_multilayer_recompute", BT=2, BH=32, num_warps=1):
        mhc_multilayer_recompute(r0, pre, y, post, comb, li, res)
    li_ref, res_ref = _chain(r0, pre, y, post, comb)
    assert all(torch.equal(a, b) for a, b in zip(li + res, li_ref + res_ref))
