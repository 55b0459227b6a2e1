"""Test set-up shared by the CPU (interpreter) and GPU runs.

* No GPU: ``TRITON_INTERPRET=1`` is set *before* tritile (and its @triton.jit kernels) is imported,
  so the same tests run the real kernels on the CPU.
* Every test is seeded from its node id (``--seed`` shifts all seeds).
* Outputs are poisoned (NaN / 0x7F bytes) at allocation, so elements a kernel never writes fail.
"""

import os
import zlib

if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch as _torch

        _has_gpu = _torch.cuda.is_available()
    except Exception:  # pragma: no cover
        _has_gpu = False
    if not _has_gpu:
        os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("TRITILE_POISON", "1")

if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("TRITILE_RECORD_LAUNCHES"):
    # note each kernel variant launched, for `python -m tritile.testing.compile_check` (sm_90, no GPU)
    from tritile.testing.compile_check import install_recorder

    install_recorder(os.environ["TRITILE_RECORD_LAUNCHES"])

import pytest  # noqa: E402
import torch  # noqa: E402

import tritile  # noqa: E402,F401

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter and the references run many small torch ops: one thread each is much faster when
    # several workers (pytest -n) or processes share the cores.
    torch.set_num_threads(1)
from tritile.testing import get_device  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=0, help="base seed added to every test's node-id seed")


@pytest.fixture(autouse=True)
def _seed_from_node_id(request):
    seed = (zlib.crc32(request.node.nodeid.encode()) + request.config.getoption("--seed")) % (2**31)
    torch.manual_seed(seed)
    import random

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    yield


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Several pytest workers share one GPU: hand cached blocks back after each test."""
    yield
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    return get_device()


def pytest_report_header(config):
    from tritile.runtime import is_interpreter

    import triton

    mode = "CPU (Triton interpreter)" if is_interpreter() else f"GPU ({torch.cuda.get_device_name()})"
    return f"tritile tests on {mode}; torch {torch.__version__}, triton {triton.__version__}"
