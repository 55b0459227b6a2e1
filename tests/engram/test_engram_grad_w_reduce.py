import pytest
import torch

from tritile.config import get_num_sms
from tritile.engram import grad_w_reduce
from tritile.testing import calc_diff, generate_hidden_sizes, pick


def grad_w_reduce_ref(grad_w_partial, wh, we, gwh, gwe):
    s = grad_w_partial.sum(0)
    return gwh + s * we.float(), gwe + s * wh.float()


def _cases():
    gpu = [(get_num_sms(), 4, h) for h in generate_hidden_sizes(128)] + [(5, 4, 7168), (1, 3, 33)]
    # CPU: P = get_num_sms() (4 here), P not a multiple of 4 (1, 5, 70 > one step of rows), odd H / hc
    cpu = [(get_num_sms(), 4, 256), (get_num_sms(), 4, 2560), (1, 4, 256), (5, 3, 33), (70, 2, 7), (5, 0, 8)]
    return pick(cpu=cpu, gpu=gpu)


@pytest.mark.parametrize("P,hc,H", _cases())
def test_grad_w_reduce(device, P, hc, H):
    partial = torch.randn(P, hc, H, dtype=torch.float32, device=device)
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    gwh = torch.randn(hc, H, dtype=torch.float32, device=device)  # accumulates into existing values
    gwe = torch.randn(hc, H, dtype=torch.float32, device=device)
    ref_h, ref_e = grad_w_reduce_ref(partial, wh, we, gwh, gwe)
    assert grad_w_reduce(partial, wh, we, gwh, gwe) is None
    assert calc_diff(gwh, ref_h) < 1e-10
    assert calc_diff(gwe, ref_e) < 1e-10
    torch.testing.assert_close(gwh, ref_h, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gwe, ref_e, rtol=1e-5, atol=1e-4)


def test_grad_w_reduce_strided_and_deterministic(device):
    P, hc, H = 6, 4, 300
    partial = torch.randn(P, hc, H + 20, device=device)[:, :, 20:]
    wh = torch.randn(hc, 2 * H, dtype=torch.bfloat16, device=device)[:, ::2].contiguous()
    we = torch.randn(hc, H + 4, dtype=torch.bfloat16, device=device)[:, 4:]
    base_h = torch.randn(hc, H + 1, device=device)[:, 1:]
    base_e = torch.randn(hc, H, device=device)
    ref_h, ref_e = grad_w_reduce_ref(partial, wh, we, base_h, base_e)
    outs = []
    for _ in range(2):
        gwh, gwe = base_h.clone(), base_e.clone()
        grad_w_reduce(partial, wh, we, gwh, gwe)
        outs.append((gwh, gwe))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert calc_diff(outs[0][0], ref_h) < 1e-10 and calc_diff(outs[0][1], ref_e) < 1e-10
    # a strided in-place target is written through its strides
    gwh = base_h.clone()
    target = torch.zeros(hc, H + 1, device=device)
    target[:, 1:] = base_h
    view = target[:, 1:]
    grad_w_reduce(partial, wh, we, view, base_e.clone())
    assert torch.equal(view, outs[0][0]) and (target[:, 0] == 0).all()


def test_grad_w_reduce_bad_inputs(device):
    P, hc, H = 4, 4, 256
    partial = torch.randn(P, hc, H, device=device)
    w = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    g = torch.zeros(hc, H, device=device)
    g2 = torch.zeros(hc, H, device=device)
    with pytest.raises(TypeError, match="grad_w_partial"):
        grad_w_reduce(partial.bfloat16(), w, w, g, g2)
    with pytest.raises(ValueError, match="grad_w_partial must be 3D"):
        grad_w_reduce(partial[0], w, w, g, g2)
    with pytest.raises(ValueError, match="weight_hidden"):
        grad_w_reduce(partial, w[:3], w, g, g2)  # mismatched hc
    with pytest.raises(ValueError, match="weight_embed"):
        grad_w_reduce(partial, w, w[:, :128], g, g2)  # mismatched H
    with pytest.raises(TypeError, match="weight_embed"):
        grad_w_reduce(partial, w, w.float(), g, g2)
    with pytest.raises(TypeError, match="grad_weight_hidden"):
        grad_w_reduce(partial, w, w, g.bfloat16(), g2)
    with pytest.raises(ValueError, match="grad_weight_embed"):
        grad_w_reduce(partial, w, w, g, g2[:, :100])
    with pytest.raises(ValueError, match="grad_w_partial must have a unit stride"):
        grad_w_reduce(partial.transpose(1, 2).contiguous().transpose(1, 2), w, w, g, g2)
    with pytest.raises(ValueError, match="different tensors"):
        grad_w_reduce(partial, w, w, g, g)


def test_grad_w_reduce_gpu_like_blocks(device, monkeypatch):
    # several row steps with a partial last one (P = 5, 2 rows a step) and several H tiles with a tail
    import tritile.engram.engram_grad_w_reduce_kernel as gm

    monkeypatch.setattr(gm, "_config", lambda P, H: (2, 32, 4, False, False, 0))
    test_grad_w_reduce(device, 5, 3, 100)


def test_grad_w_reduce_opcheck(device):
    import tritile.engram.engram_grad_w_reduce_kernel as gm

    w = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    args = (torch.randn(3, 4, 64, device=device), w, w.clone(), torch.zeros(4, 64, device=device),
            torch.zeros(4, 64, device=device))
    torch.library.opcheck(gm._grad_w_reduce_op.op, args)


@pytest.mark.parametrize("cfg", [dict(ROWS=32, BLOCK_D=128, num_warps=4), dict(ROWS=256, BLOCK_D=32, num_warps=8),
                                 dict(ROWS=4, BLOCK_D=16, num_warps=1), dict(ROWS=256, BLOCK_D=32, EARLY=True),
                                 dict(ROWS=32, BLOCK_D=64, EARLY=True), dict(ROWS=128, BLOCK_D=32, SWAP=True),
                                 dict(ROWS=128, BLOCK_D=32, TAIL=4), dict(ROWS=128, BLOCK_D=64, TAIL=4, SWAP=True),
                                 dict(ROWS=128, BLOCK_D=32, TAIL=8, EARLY=True, SWAP=True),
                                 dict(ROWS=64, BLOCK_D=32, TAIL=4)])  # TAIL too small for P: the loop
def test_grad_w_reduce_launch_configs(device, cfg):
    """The GPU's tune candidates (P = 132 in one step or several, partial column strips) against the reference."""
    from tritile.runtime import override_config

    P, hc, H = 132, 2, 200
    partial = torch.randn(P, hc, H, dtype=torch.float32, device=device)
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    gwh = torch.randn(hc, H, dtype=torch.float32, device=device)
    gwe = torch.randn(hc, H, dtype=torch.float32, device=device)
    ref_h, ref_e = grad_w_reduce_ref(partial, wh, we, gwh, gwe)
    with override_config("grad_w_reduce", **cfg):
        grad_w_reduce(partial, wh, we, gwh, gwe)
    assert calc_diff(gwh, ref_h) < 1e-10 and calc_diff(gwe, ref_e) < 1e-10
    torch.testing.assert_close(gwh, ref_h, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gwe, ref_e, rtol=1e-5, atol=1e-4)
