"""Host helpers: config, utils, runtime checks, testing helpers, custom-op registration, bench CLI."""

import os
import subprocess
import sys

import pytest
import torch

import tritile
from tritile import config
from tritile.runtime import check_tensor, empty, is_interpreter, poison_outputs
from tritile.testing import assert_equal, calc_diff, check_bias, clear_unused_sf, count_bytes
from tritile.utils import align, ceil_div


def test_utils():
    assert ceil_div(0, 4) == 0 and ceil_div(7, 4) == 2 and ceil_div(8, 4) == 2
    assert align(0, 128) == 0 and align(1, 128) == 128 and align(4001, 64) == 4032


def test_config_without_gpu_fallback():
    n = config.get_device_num_sms()
    assert isinstance(n, int) and n > 0
    assert config.get_max_smem_per_sm() > 0
    old = config.get_num_sms()
    try:
        config.set_num_sms(1)
        assert config.get_num_sms() == 1
        with pytest.raises(ValueError, match="num_sms"):
            config.set_num_sms(0)
        with pytest.raises(TypeError, match="num_sms"):
            config.set_num_sms(2.5)
    finally:
        config.set_num_sms(None)
    assert config.get_num_sms() == old


def test_check_tensor_messages():
    with pytest.raises(TypeError, match=r"x must be bfloat16 or float32, got torch.float16"):
        check_tensor("x", torch.zeros(2, dtype=torch.float16), dtypes=(torch.bfloat16, torch.float32))
    with pytest.raises(ValueError, match=r"x must be 2D, got a 1D tensor"):
        check_tensor("x", torch.zeros(2), ndim=2)


def test_poison():
    with poison_outputs(True):
        f = empty((3,), torch.float32, "cpu")
        i = empty((3,), torch.int32, "cpu")
        b = empty((3,), torch.float8_e4m3fn, "cpu")
    assert torch.isnan(f).all()
    assert (i == 0x7F7F7F7F).all()
    assert (b.view(torch.uint8) == 0x7F).all()


def test_assert_equal_is_bitwise():
    x = torch.tensor([0.0, 1.0])
    assert_equal(x, x.clone())
    with pytest.raises(AssertionError):
        assert_equal(x, torch.tensor([-0.0, 1.0]))  # signed zero differs bitwise
    with pytest.raises(AssertionError, match="dtype"):
        assert_equal(x, x.double())
    with pytest.raises(AssertionError, match="stride"):
        assert_equal(torch.zeros(2, 3), torch.zeros(3, 2).T)
    assert_equal(torch.zeros(0, 3), torch.zeros(3, 0).T)  # no stride check when empty


def test_numeric_helpers():
    x = torch.randn(1000)
    assert calc_diff(x, x) < 1e-12
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert abs(calc_diff(x, -x) - 2.0) < 1e-9
    check_bias(x + 1e-3 * torch.randn(1000), x)
    with pytest.raises(AssertionError, match="biased"):
        check_bias(x + 1.0, x)
    assert count_bytes(torch.zeros(4), (torch.zeros(2, dtype=torch.bfloat16), None), [torch.zeros(1, dtype=torch.int8)]) == 21


def test_clear_unused_sf_does_not_mutate():
    sf = torch.full((3, 1), -1, dtype=torch.int32)  # packed, 2 real groups of 4 bytes
    out = clear_unused_sf(sf, hidden=256, num_per_channels=128)
    assert out.shape == (3, 4) and out.dtype == torch.uint8
    assert (out[:, :2] == 0xFF).all() and (out[:, 2:] == 0).all()
    assert (sf == -1).all()


@pytest.mark.skipif(not is_interpreter(), reason="the CPU path is what this test checks; GPU runs compile the same op")
def test_custom_op_under_torch_compile():
    from tritile.transpose import transpose

    def f(x):
        return transpose(x * 2) + 1

    x = torch.randn(64, 96)
    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, (x * 2).T.contiguous() + 1)
    torch.library.opcheck(torch.ops.tritile.batched_transpose.default, (torch.randn(2, 8, 12),))


def test_api_parity_transpose_config_utils():
    """The names tritile shares with TileKernels for the modules owned by the foundation."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    tool = os.path.join(root, "..", "shared", "tools", "api_parity.py")
    if not os.path.exists(tool):
        pytest.skip("../shared/tools/api_parity.py is not beside this checkout")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, tool, "transpose", "config", "utils"], capture_output=True, text=True,
                       env=env, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr


def test_bench_cli_on_cpu():
    if not is_interpreter():
        pytest.skip("on a GPU the CLI times; scripts/gpu_check.sh runs it there")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    r = subprocess.run([sys.executable, "-m", "tritile", "bench", "--module", "transpose", "--quick"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "timings need a GPU" in r.stdout and "| ok |" in r.stdout


def test_tuned_override_config():
    from tritile.runtime import override_config, tuned

    base = dict(BLOCK=64, num_warps=4)
    assert tuned("tritile_test_op", base) is base
    with override_config("tritile_test_op", num_warps=8):
        assert tuned("tritile_test_op", base) == dict(BLOCK=64, num_warps=8)
        with override_config("tritile_test_op", BLOCK=128):
            assert tuned("tritile_test_op", base) == dict(BLOCK=128, num_warps=8)
        assert tuned("tritile_test_op", base) == dict(BLOCK=64, num_warps=8)
    assert tuned("tritile_test_op", base) == base


def test_pdl_gating():
    """Programmatic dependent launch only on CUDA sm_90+ outside the interpreter, and never after set_pdl(False)."""
    from tritile.language.pdl import pdl_args, set_pdl, use_pdl
    assert use_pdl("cpu") is False and pdl_args("cpu") == {"PDL": False}
    if torch.cuda.is_available():
        assert pdl_args("cuda", enabled=False) == {"PDL": False}
        old = set_pdl(False)
        try:
            assert use_pdl("cuda") is False and pdl_args("cuda") == {"PDL": False}
        finally:
            set_pdl(old)
        sm90 = torch.cuda.get_device_capability()[0] >= 9
        assert use_pdl("cuda") is (old and sm90 and torch.version.hip is None)
        if use_pdl("cuda"):
            assert pdl_args("cuda") == {"PDL": True, "launch_pdl": True}
            assert pdl_args("cuda", launch=False) == {"PDL": True}


def test_tile_grid_order():
    from tritile.language.grid import tile_grid

    assert tile_grid(5, 3, True) == ((3, 5), True)  # KFAST: the column blocks first
    assert tile_grid(5, 3, False) == ((5, 3), False)
    # row blocks past the grid's second dimension (65535): the rows stay first, KFAST off
    assert tile_grid(70000, 3, True) == ((70000, 3), False)
    assert tile_grid(65535, 3, True) == ((3, 65535), True)
    # column blocks past it in the rows-first order: the columns go first instead, KFAST on
    assert tile_grid(3, 70000, False) == ((70000, 3), True)
    assert tile_grid(3, 65535, False) == ((3, 65535), False)


def test_stack_pointer_reads():
    """compile_check's SASS check: integer arithmetic on R1 (the stack pointer) is flagged; addresses, the packing
    and float instructions' undefined operands and other registers are not."""
    from tritile.testing.compile_check import stack_pointer_reads

    sass = "\n".join([
        "--:-:0:-:1\tLDC R1, c[0x0][0x28] ;",
        "--:-:-:-:1\tLOP3.LUT R14, R1, 0xffff, RZ, 0xc0, !PT ;",
        "--:-:-:-:1\t@P0 IADD3 R2, R1.reuse, 0x4, RZ ;",
        "--:-:-:-:1\tSTL [R1+0x4], R3 ;",
        "--:-:-:-:1\tF2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R0, R1, R0, RZ ;",
        "--:-:-:-:1\tPRMT R4, R1, 0x5410, R2 ;",
        "--:-:-:-:1\tFMNMX R19, R1, R1, !PT ;",
        "--:-:-:-:1\tLOP3.LUT R14, R11, 0xffff, RZ, 0xc0, !PT ;",
        "--:-:-:-:1\tMOV R1, R2 ;",
    ])
    assert stack_pointer_reads(sass) == ["LOP3.LUT R14, R1, 0xffff, RZ, 0xc0, !PT", "IADD3 R2, R1.reuse, 0x4, RZ"]


def test_stale_pair_merges():
    """compile_check's second SASS check: an e4m3 pair conversion merging a high half whose ``>> 8`` was computed
    before the conversion (the H200 fault of an FP8-input per-token cast on 2 warps) is flagged; the shift of the
    conversion's own result, after it, and a merge operand written otherwise are not."""
    from tritile.testing.compile_check import stale_pair_merges

    bad = "\n".join([
        "--:-:-:Y:7\tIMAD.MOV.U32 R0, RZ, RZ, 0x43e00000 ;",
        "--:-:-:-:1\tLOP3.LUT R0, R0, 0xffff, RZ, 0xc0, !PT ;",
        "--:-:-:-:1\tFMUL R10, R10, R12.reuse ;",
        "--:-:-:-:1\tSHF.R.U32.HI R0, RZ, 0x8, R0 ;",
        "--:-:-:-:2\tPRMT R4, R13, 0x5410, R4 ;",
        "--:-:-:Y:2\tF2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R0, R10, R9, R0 ;",
    ])
    assert stale_pair_merges(bad) == ["SHF.R.U32.HI R0, RZ, 0x8, R0  ->  "
                                      "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R0, R10, R9, R0"]
    good = "\n".join([
        "--:-:-:-:1\tIMAD.MOV.U32 R3, RZ, RZ, RZ ;",
        "--:-:-:-:1\tF2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R0, R10, R9, R3 ;",
        "--:-:-:-:1\tSHF.R.U32.HI R5, RZ, 0x8, R0 ;",
        "--:-:-:-:1\tSHF.R.U32.HI R6, RZ, 0x8, R2 ;",
        "--:-:-:-:1\tF2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R7, R10, R9, RZ ;",
    ])
    assert stale_pair_merges(good) == []
