"""Float32 primitives the references share with the kernels, per backend.

The kernels compute ``exp`` with libdevice ``expf`` on the GPU (the same as torch CUDA) and with
numpy's float32 ``exp`` under the CPU interpreter; ``tl.fma`` is fused on the GPU and unfused in the
interpreter.  The references call these helpers so that, on each backend, they compute the same way
the kernels do and can be compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``exp``: torch's on CUDA, numpy float32's on the CPU (what the interpreter computes)."""
    x = x.float()
    if x.device.type == "cpu":
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return torch.from_numpy(np.exp(x.numpy())).reshape(x.shape)
    return torch.exp(x)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a*b + c`` rounded once on CUDA (float64 emulation is exact for float32 inputs), twice on the CPU."""
    a, b, c = a.float(), b.float(), c.float()
    if a.device.type == "cpu":
        return a * b + c
    return (a.double() * b.double() + c.double()).float()
