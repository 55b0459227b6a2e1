import pytest
import torch

from tritile.engram import fused_weight
from tritile.testing import assert_equal, generate_hidden_sizes, pick


def _shapes():
    return pick(cpu=[(4, 256), (4, 2560), (1, 1), (3, 7), (4, 33), (0, 256), (4, 0)],
                gpu=[(4, h) for h in generate_hidden_sizes(128)] + [(3, 33), (0, 256)])


@pytest.mark.parametrize("hc,H", _shapes())
def test_fused_weight(device, hc, H):
    wh = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    we = torch.randn(hc, H, dtype=torch.bfloat16, device=device)
    out = fused_weight(wh, we)
    assert_equal(out, wh.float() * we.float())  # exact products: bitwise, same dtype/shape/strides


def test_fused_weight_strided_rows(device):
    H = 300
    big_h = torch.randn(4, 2 * H, dtype=torch.bfloat16, device=device)
    big_e = torch.randn(4, H + 5, dtype=torch.bfloat16, device=device)
    wh, we = big_h[:, 10:10 + H], big_e[:, 5:]
    assert not wh.is_contiguous() and not we.is_contiguous()
    assert_equal(fused_weight(wh, we), wh.float() * we.float())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fused_weight_special_values(device):
    # every bf16 bit pattern against a random one: subnormals, overflow to inf, NaN, signed zeros
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    wh = codes.view(torch.bfloat16).reshape(4, -1).to(device)
    we = torch.randn(4, wh.shape[1], dtype=torch.bfloat16, device=device) * 2.0 ** 100
    we[0, :5] = torch.tensor([0.0, -0.0, float("inf"), 2.0 ** -133, 3.0e38], dtype=torch.bfloat16)
    out = fused_weight(wh, we)
    ref = wh.float() * we.float()
    assert_equal(out.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert_equal(out[keep], ref[keep])


def test_fused_weight_bad_inputs(device):
    wh = torch.randn(4, 256, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="weight_hidden"):
        fused_weight(wh.float(), wh)
    with pytest.raises(TypeError, match="weight_embed"):
        fused_weight(wh, wh.half())
    with pytest.raises(ValueError, match="weight_embed"):
        fused_weight(wh, wh[:3])  # mismatched hc
    with pytest.raises(ValueError, match="weight_embed"):
        fused_weight(wh, wh[:, :128])  # mismatched H
    with pytest.raises(ValueError, match="weight_hidden"):
        fused_weight(wh[0], wh[0])
    with pytest.raises(ValueError, match="weight_hidden"):
        fused_weight(wh.t().contiguous().t()[:, ::2], wh[:, :128])  # non-unit inner stride
    with pytest.raises(TypeError, match="weight_hidden"):
        fused_weight([1.0], wh)


def test_fused_weight_gpu_like_blocks(device, monkeypatch):
    import tritile.engram.engram_fused_weight_kernel as fm

    monkeypatch.setattr(fm, "_config", lambda H: 32)
    wh = torch.randn(3, 100, dtype=torch.bfloat16, device=device)
    we = torch.randn(3, 100, dtype=torch.bfloat16, device=device)
    assert_equal(fused_weight(wh, we), wh.float() * we.float())


def test_fused_weight_opcheck(device):
    import tritile.engram.engram_fused_weight_kernel as fm

    wh = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(fm._fused_weight_op.op, (wh, torch.randn_like(wh)))
