"""unpack_from_e2m1fn_x2 (pure torch): every byte, both nibbles, signs, dtypes and shapes."""

import pytest
import torch

from tritile.quant import unpack_from_e2m1fn_x2
from tritile.quant.common import unpack_from_e2m1fn_x2 as unpack_deep

# e2m1 magnitudes of codes 0..7, written out by hand
_MAG = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _value(nibble: int) -> float:
    v = _MAG[nibble & 7]
    return -v if nibble & 8 else v


def _expected_all_bytes():
    vals = []
    for b in range(256):
        vals += [_value(b & 0xF), _value(b >> 4)]  # element 2j: low nibble; 2j+1: high nibble
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.int8])
def test_unpack_all_bytes(in_dtype, device):
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(in_dtype).to(device)
    got = unpack_from_e2m1fn_x2(x)
    want = _expected_all_bytes().to(device)
    assert got.shape == (512,) and got.dtype == torch.float32 and got.device == x.device
    # bitwise: -0.0 (code 8) must keep its sign
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got[16].item() == 0.0 and torch.signbit(got[16])  # byte 8 -> low nibble 8 -> -0.0
    assert got[1].item() == 0.0 and not torch.signbit(got[1])
    assert unpack_deep is unpack_from_e2m1fn_x2


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_unpack_out_dtype(out_dtype, device):
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    got = unpack_from_e2m1fn_x2(x, out_dtype)
    assert got.dtype == out_dtype
    want = _expected_all_bytes().to(device).to(out_dtype)  # every e2m1 value is exact in each of these
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4), (0, 6), (4, 0)])
def test_unpack_shapes(shape, device):
    x = torch.randint(-128, 128, shape, dtype=torch.int8, device=device)
    got = unpack_from_e2m1fn_x2(x)
    assert got.shape == (*shape[:-1], 2 * shape[-1])
    table = _expected_all_bytes().to(device).reshape(256, 2)
    want = table[x.view(torch.uint8).long()].reshape(got.shape)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_unpack_non_contiguous(device):
    base = torch.randint(-128, 128, (6, 10), dtype=torch.int8, device=device)
    x = base[:, 2:8]
    assert torch.equal(unpack_from_e2m1fn_x2(x), unpack_from_e2m1fn_x2(x.contiguous()))
    xt = base.T  # last-dim stride != 1
    assert torch.equal(unpack_from_e2m1fn_x2(xt), unpack_from_e2m1fn_x2(xt.contiguous()))


def test_unpack_bad_inputs(device):
    with pytest.raises(ValueError, match="at least 1 dimension"):
        unpack_from_e2m1fn_x2(torch.tensor(3, dtype=torch.int8, device=device))
    with pytest.raises(TypeError, match="int8 or uint8"):
        unpack_from_e2m1fn_x2(torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="int8 or uint8"):
        unpack_from_e2m1fn_x2(torch.zeros(4, dtype=torch.float32, device=device))
    with pytest.raises(TypeError, match="torch.Tensor"):
        unpack_from_e2m1fn_x2([1, 2, 3])
