"""The engram kernels compile for sm_90 (and their big loads vectorise), checked on GPU-less machines too."""

import os
import subprocess
import sys

import pytest

from tritile.testing import is_gpu_run
from tritile.testing.compile_check import have_ptxas

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(is_gpu_run(), reason="on a GPU every test compiles the kernels for real")
@pytest.mark.skipif(not have_ptxas(), reason="this Triton has no NVIDIA backend / ptxas")
def test_engram_kernels_compile_for_sm90():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engram_sm90_compile.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
