"""Shape and input generators that know CPU (interpreter) from GPU.

The same test files run on both: on the GPU they use TileKernels' full shapes, on the CPU small
grids that keep every edge (partial blocks, odd sizes, 0 tokens) but cost few interpreter programs.
"""

from __future__ import annotations

import os
from typing import List

import torch

from ..runtime import is_interpreter
from ..utils import align


def get_device() -> torch.device:
    """``cuda`` when kernels run on a GPU, else ``cpu`` (the interpreter)."""
    if not is_interpreter() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_gpu_run() -> bool:
    """True on a GPU with TileKernels' full shapes (``TRITILE_SMALL_SHAPES=1`` keeps the CPU grids on a GPU,
    e.g. under compute-sanitizer)."""
    return get_device().type == "cuda" and os.environ.get("TRITILE_SMALL_SHAPES", "0") != "1"


def full_test() -> bool:
    """``TRITILE_FULL_TEST=1`` (or TileKernels' ``TK_FULL_TEST=1``) widens grids."""
    return os.environ.get("TRITILE_FULL_TEST", os.environ.get("TK_FULL_TEST", "0")) == "1"


def pick(cpu, gpu):
    """``gpu`` on a GPU run, ``cpu`` under the interpreter."""
    return gpu if is_gpu_run() else cpu


def generate_num_tokens(alignment: int = 1, cpu=(0, 3, 130)) -> List[int]:
    """TileKernels' [4001, 8001] (aligned up) plus 0 on the GPU; a small grid on the CPU."""
    if is_gpu_run():
        vals = [align(4001, alignment), align(8001, alignment)]
        return [0] + vals
    return [align(v, alignment) if v else 0 for v in cpu]


def generate_hidden_sizes(align_to: int = 64, cpu=(256, 576)) -> List[int]:
    """TileKernels' hidden sizes (filtered by ``align_to``) on the GPU; a small set on the CPU."""
    if is_gpu_run():
        sizes = [576, 2048, 2560, 3072, 4096, 6144, 7168]
    else:
        sizes = list(cpu)
    return [h for h in sizes if h % align_to == 0]


def generate_rand_float(shape, device=None, min_exp: int = -110, max_exp: int = 126) -> torch.Tensor:
    """float32 with a random sign, mantissa and exponent in [min_exp, max_exp] (wide dynamic range)."""
    device = device if device is not None else get_device()
    mant = torch.rand(shape, device=device) + 1.0
    exp = torch.randint(min_exp, max_exp + 1, shape, device=device).float()
    sign = torch.where(torch.rand(shape, device=device) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).float()
