"""The persistent TMA transpose (Gluon, Hopper): its rules everywhere, its copies on the GPU, its sm_90 build on the
CPU.  On the GPU ``transpose`` / ``batched_transpose`` take it by default, so test_transpose.py covers TileKernels'
shapes with it; this file adds partial tiles, strides, every ring depth and the fallback."""

import os
import subprocess
import sys

import pytest
import torch

import tritile.transpose._transpose_gluon as tg
from tritile.testing import assert_equal, is_gpu_run
from tritile.transpose import batched_transpose
from tritile.transpose.batched_transpose_kernel import batched_transpose_with_config

from test_transpose import DTYPES, _rand


def test_tma_config_rules():
    for es in (1, 2, 4):
        c = tg.config(es)
        assert c["BN"] * es == 128 and c["BM"] * es == 128  # box rows of 128 bytes: the 128-byte swizzle
        assert c["VR"] * c["TR"] * c["WR"] == c["BM"] and c["VC"] * c["TC"] * c["WC"] == c["BN"]
        assert c["WK"] == c["K"] and c["TR"] * c["TC"] == 32 and c["WK"] * c["WR"] * c["WC"] == tg.NUM_WARPS
    with pytest.raises(ValueError):
        tg.config(8)


def test_tma_supports():
    x = torch.empty(2, 64, 128, dtype=torch.bfloat16)
    assert tg.supports(x)
    assert not tg.supports(x[:, :, 1:65])  # base 2 bytes off
    assert not tg.supports(torch.empty(2, 64, 132, dtype=torch.bfloat16)[:, :, :128])  # row stride 264 bytes
    assert not tg.supports(torch.empty(2, 60, 128, dtype=torch.bfloat16))  # the output's row stride, 120 bytes
    assert not tg.supports(torch.empty(2, 32, 128, dtype=torch.bfloat16))  # M below a box
    assert not tg.supports(torch.empty(2, 64, 128, dtype=torch.float64))
    assert not tg.available(torch.device("cpu"))


gpu_only = pytest.mark.skipif(not is_gpu_run() or not tg.available(torch.device("cuda")),
                              reason="the TMA transpose needs a Hopper-class GPU and Triton's Gluon")


@pytest.fixture
def calls(monkeypatch):
    n = [0]
    launch = tg.launch

    def counted(*a, **kw):
        n[0] += 1
        return launch(*a, **kw)

    monkeypatch.setattr(tg, "launch", counted)
    return n


@gpu_only
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 8064, 7168), (3, 208, 272), (5, 400, 144), (2, 128, 128), (1, 4096, 48)])
def test_tma_transpose(device, calls, dtype, shape):
    # partial tiles along M and N, odd batches, one tile
    es = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    if not tg.supports(torch.empty(shape, dtype=DTYPES[dtype])):
        pytest.skip(f"{shape} is not TMA-aligned for {es}-byte elements")
    x = _rand(shape, DTYPES[dtype], device)
    out = batched_transpose(x)
    assert calls[0] == 1
    assert_equal(out, x.transpose(1, 2).contiguous())


@gpu_only
@pytest.mark.parametrize("stages,per_sm", [(2, 1), (3, 1), (6, 1), (8, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_tma_ring_depths(device, calls, dtype, stages, per_sm):
    x = _rand((3, 1000, 656), DTYPES[dtype], device) if dtype != "fp8" else _rand((3, 1008, 656), DTYPES[dtype],
                                                                                    device)
    out = batched_transpose_with_config(x, dict(STAGES=stages, PER_SM=per_sm))
    assert calls[0] == 1
    assert_equal(out, x.transpose(1, 2).contiguous())


@gpu_only
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_tma_strided_and_fallback(device, calls, dtype):
    es = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    big = _rand((4, 512, 1024 + 64), DTYPES[dtype], device)
    off = 64 // es
    x = big[1:, :, off:off + 768]  # 16-byte aligned rows of a wider tensor, 64 bytes in, a batch offset
    out = batched_transpose(x)
    assert calls[0] == 1
    assert_equal(out, x.transpose(1, 2).contiguous())
    y = big[:, :, 1:769]  # one element in: not 16-byte aligned, the Triton kernels
    out = batched_transpose(y)
    assert calls[0] == 1
    assert_equal(out, y.transpose(1, 2).contiguous())
    out = batched_transpose_with_config(x, dict(TMA=False))
    assert calls[0] == 1
    assert_equal(out, x.transpose(1, 2).contiguous())


def _have_nvidia_backend():
    try:
        import triton

        return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
    except ImportError:  # pragma: no cover
        return False


@pytest.mark.skipif(is_gpu_run(), reason="on a GPU the tests above compile the kernel for real")
@pytest.mark.skipif(not _have_nvidia_backend(), reason="this Triton has no NVIDIA backend / ptxas")
@pytest.mark.skipif(tg._gluon() is None, reason="no Gluon 3.6 API")
def test_tma_kernel_compiles_for_sm90():
    code = ("import tritile.transpose._transpose_gluon as tg\n"
            "for es in (1, 2, 4):\n"
            "    for s in (2, 4, 8):\n"
            "        k = tg.compile_offline(es, s)\n"
            "        assert 'cp.async.bulk.tensor' in k.asm['ptx']\n"
            "        assert k.metadata.shared <= 227 * 1024\n"
            "print('ok')\n")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
