"""Programmatic dependent launch (PDL, sm_90+): back-to-back kernels overlap one's launch with the other's tail.

A kernel launched with ``launch_pdl=True`` may be scheduled before the previous kernel in the stream has finished,
once every program of that kernel has signalled (``griddepcontrol.launch_dependents``).  ``pdl_enter`` signals at
once and then waits (``griddepcontrol.wait``) for the previous kernel to finish and its writes to be visible,
before the kernel touches any memory: results never depend on it, only the launch gap shrinks.  With a
predecessor that does not signal (any non-PDL kernel), the wait returns when it has finished, as without PDL.

``use_pdl(device)`` is True on CUDA devices of compute capability 9.0 or newer, outside the interpreter, unless
``TRITILE_PDL=0``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as _tlcuda

from ..runtime import is_interpreter


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel: with ``PDL``, let the next kernel's programs be scheduled, then wait for the
    previous kernel's writes.  A no-op (no instruction) otherwise."""
    if PDL:
        _tlcuda.gdc_launch_dependents()
        _tlcuda.gdc_wait()


@functools.lru_cache(maxsize=None)
def _device_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda" or is_interpreter() or torch.version.hip is not None:
        return False
    if os.environ.get("TRITILE_PDL", "1").lower() in ("0", "false", "no", "off"):
        return False
    return _device_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device, enabled: bool = True, launch: bool = True) -> dict:
    """Launch keywords for a kernel with a ``PDL: tl.constexpr`` parameter (whose first statement is
    ``pdl_enter(PDL)``) where :func:`use_pdl` allows it and ``enabled``: ``PDL=True`` (signal, then wait) and
    ``launch_pdl=launch``.  An op's later kernels pass ``launch=False``: they start after the op's previous kernel
    as usual (their wait is then a no-op, and a kernel's CUPTI time never includes a wait for its own op's
    previous kernel), but still signal, so that the next op's first kernel overlaps their tail.  Else
    ``PDL=False``."""
    if enabled and use_pdl(device):
        return {"PDL": True, "launch_pdl": True} if launch else {"PDL": True}
    return {"PDL": False}
