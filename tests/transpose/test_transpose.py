"""transpose / batched_transpose: bit-exact copies, strides included (TileKernels' test matrix on GPU)."""

import pytest
import torch

from tritile.testing import assert_equal, is_gpu_run, pick
from tritile.torch.transpose import batched_transpose_ref, transpose_ref
from tritile.transpose import batched_transpose, transpose
from tritile.transpose.batched_transpose_kernel import batched_transpose_with_config

DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def _rand(shape, dtype, device):
    """Random bit patterns (NaNs and all) so that any bit lost in the copy shows."""
    n = 1
    for s in shape:
        n *= s
    esz = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * esz,), dtype=torch.uint8, device=device)
    return raw.view(dtype).reshape(shape)


M_VALUES = pick(cpu=[0, 64, 192], gpu=[0, 4032, 8064])
N_VALUES = pick(cpu=[64, 576], gpu=[576, 2048, 2560, 3072, 4096, 6144, 7168])


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_transpose_row_strided(m, n, dtype, device):
    base = _rand((m, 2 * n), DTYPES[dtype], device)
    x = base[:, :n]  # row-strided view: stride(0) = 2n, as TileKernels tests
    out = transpose(x)
    assert_equal(out, transpose_ref(x))


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("b", pick(cpu=[1, 3], gpu=[8, 32]))
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_batched_transpose(b, m, n, dtype, device):
    x = _rand((b, m, n), DTYPES[dtype], device)
    assert_equal(batched_transpose(x), batched_transpose_ref(x))


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 33), (2, 65, 130), (5, 4, 12), (1, 100, 3)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.int16, torch.float16, torch.float32,
                                   torch.int64, torch.float64])
def test_odd_shapes_and_dtypes(shape, dtype, device):
    """TileKernels needs M, N % 64 == 0; tritile takes any shape and any element width."""
    x = _rand(shape, dtype, device)
    assert_equal(batched_transpose(x), batched_transpose_ref(x))
    assert_equal(transpose(x[0]), transpose_ref(x[0]))


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_arbitrary_strides(dtype, device):
    """Non-unit inner strides, sliced batches and column offsets: no .contiguous() copy needed."""
    base = _rand((4, 70, 3 * 66), DTYPES[dtype], device)
    for x in (base[::2, 3:67, ::3], base[1:, :, 5:65], base.transpose(1, 2)[:, :64, :]):
        assert_equal(batched_transpose(x), batched_transpose_ref(x))
    assert_equal(transpose(base[0].T), transpose_ref(base[0].T))


def test_word_path_matches_generic(device):
    """The 1-byte word path (4x4 byte transposes in int32) and the generic path give the same bytes."""
    x = _rand((2, 96, 160), torch.float8_e4m3fn, device)
    a = batched_transpose(x)
    b = batched_transpose_with_config(x, {"word_path": False})
    assert_equal(a, b)
    assert_equal(a, batched_transpose_ref(x))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_grid_orders(dtype, device):
    """Both plain grid orders (MFAST: the grid's first dimension over the m blocks, the kernel swapping its ids back;
    the default of the word path and of 2- and 4-byte elements) give the reference's bytes on ragged shapes whose m
    and n block counts differ, on the word path and on the generic one."""
    x = _rand((2, 100, 36), DTYPES[dtype], device)
    cfgs = [{"MFAST": mfast, "BLOCK_M": 32, "BLOCK_N": 16, "word_path": False} for mfast in (False, True)]
    if dtype == "fp8":
        cfgs += [{"MFAST": mfast, "BLOCK_M4": 4, "BLOCK_N4": 4} for mfast in (False, True)]
    for cfg in cfgs:
        assert_equal(batched_transpose_with_config(x, cfg), batched_transpose_ref(x))


@pytest.mark.skipif(not is_gpu_run(), reason="over 65535 row blocks: millions of interpreter programs")
@pytest.mark.parametrize("shape, dtype, cfg", [
    ((8_388_736, 4), torch.float8_e4m3fn, {}),                      # word path, m blocks first by default
    ((8_388_736, 4), torch.float8_e4m3fn, {"MFAST": False}),        # ... asked for n first: swapped back
    ((4_194_368, 3), torch.float8_e4m3fn, {}),                      # 1-byte generic path (n % 4 != 0)
    ((4_194_368, 2), torch.float64, {}),                            # 8-byte generic path
    ((8_388_736, 2), torch.bfloat16, {"MFAST": False}),  # 2-byte generic path
])
def test_tall_grid(shape, dtype, cfg, device):
    """Tensors with more than 65535 blocks of rows (the grid's second dimension) launch on every path: the grid puts
    the m blocks first whatever the config asks (tritile.language.grid.tile_grid)."""
    x = _rand(shape, dtype, device)
    assert_equal(batched_transpose_with_config(x.unsqueeze(0), cfg).squeeze(0), transpose_ref(x))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_pdl_chain(dtype, device):
    """Programmatic dependent launch (``PDL``: a no-op under the interpreter): each call waits for the previous
    kernel's writes, so a chain that transposes the previous call's output gets the right bytes."""
    x = _rand((3, 256, 384), DTYPES[dtype], device)
    y = batched_transpose_with_config(x, {"PDL": True})
    for _ in range(3):
        z = batched_transpose_with_config(y, {"PDL": True})
        y = batched_transpose_with_config(z, {"PDL": True})
    assert_equal(z, x)
    assert_equal(y, batched_transpose_ref(x))


@pytest.mark.parametrize("shape", [(0, 64, 64), (2, 0, 64), (2, 64, 0)])
def test_empty(shape, device):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    out = batched_transpose(x)
    assert out.shape == (shape[0], shape[2], shape[1]) and out.dtype == x.dtype
    out2 = transpose(x[0] if shape[0] else torch.empty(shape[1:], dtype=torch.bfloat16, device=device))
    assert out2.shape == (shape[2], shape[1])


def test_bad_input(device):
    with pytest.raises(ValueError, match="x must be 3D"):
        batched_transpose(torch.zeros(4, 4, device=device))
    with pytest.raises(ValueError, match="x must be 2D"):
        transpose(torch.zeros(2, 4, 4, device=device))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        transpose([[1, 2]])
    with pytest.raises(TypeError, match="x must have 1-, 2-, 4- or 8-byte elements"):
        transpose(torch.zeros(4, 4, dtype=torch.complex128, device=device))
    with pytest.raises(ValueError, match="unknown keys \\['STREAM'\\]"):  # a launch-config key with no code behind it
        batched_transpose_with_config(torch.zeros(1, 4, 4, device=device), {"STREAM": True})
