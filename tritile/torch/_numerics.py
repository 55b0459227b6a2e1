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


def fma_exact_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a*b + c`` with a single rounding, on any device.

    The float64 product of two float32 values is exact; the float64 sum is made round-to-odd with TwoSum,
    which makes the final rounding to float32 correct (a plain float64 ``a*b+c`` rounds twice and is
    wrong in rare cases)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)  # TwoSum: s + err == p + cd exactly
    odd_fix = (err != 0) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(odd_fix, torch.nextafter(s, toward), s).float()


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``tl.fma`` as the kernels get it: one rounding on CUDA, two on the CPU (the interpreter's numpy)."""
    a, b, c = a.float(), b.float(), c.float()
    if a.device.type == "cpu":
        return a * b + c
    return fma_exact_f32(a, b, c)
