"""``transpose`` / ``batched_transpose`` under ``torch.compile(fullgraph=True)``: the compiled call runs
``torch.ops.tritile.batched_transpose`` (traced through its fake kernel) and gives the eager call's bits.
CPU: the "eager" backend (tests/quant runs inductor on the CPU); GPU: inductor."""

from __future__ import annotations

import pytest
import torch

from tritile.testing import assert_equal, is_gpu_run
from tritile.transpose import batched_transpose, transpose


@pytest.mark.parametrize("name,dtype,backend", [
    ("transpose", torch.bfloat16, "eager"), ("transpose", torch.float8_e4m3fn, "eager"),
    ("batched_transpose", torch.float32, "eager")])
def test_compile_fullgraph(device, name, dtype, backend):
    if is_gpu_run():
        backend = "inductor"
    torch._dynamo.reset()
    shape = (3, 40, 72) if name == "batched_transpose" else (40, 72)
    x = torch.randn(shape, device=device).to(dtype)
    fn = {"transpose": transpose, "batched_transpose": batched_transpose}[name]
    want = fn(x)
    got = torch.compile(lambda t: fn(t), backend=backend, fullgraph=True)(x)
    assert_equal(got, want)
