"""Programmatic dependent launch (PDL, sm_90+): back-to-back kernels overlap one's launch with the other's tail.

A kernel launched with ``launch_pdl=True`` may be scheduled before the previous kernel in the stream has finished,
once every program of that kernel has signalled (``griddepcontrol.launch_dependents``).  ``pdl_enter`` signals at
once and then waits (``griddepcontrol.wait``) for the previous kernel to finish and its writes to be visible,
before the kernel touches any memory: results never depend on it, only the launch gap shrinks.  With a
predecessor that does not signal (any non-PDL kernel), the wait returns when it has finished, as without PDL.

``use_pdl(device)`` is True on CUDA devices of compute capability 9.0 or newer, outside the interpreter, unless
``TRITILE_PDL=0`` was set at import or ``set_pdl(False)`` was called.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from torch.types import Device
import triton.language as tl
from triton.language.extra import cuda as _tlcuda

from ..runtime import is_interpreter

__all__ = ["pdl_enter", "set_pdl", "use_pdl", "pdl_args"]

_INTERPRET = is_interpreter()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel: with ``PDL``, let the next kernel's programs be scheduled, then wait for the
    previous kernel's writes.  A no-op (no instruction) otherwise."""
    if PDL:
        _tlcuda.gdc_launch_dependents()
        _tlcuda.gdc_wait()


# Read once (as TRITON_INTERPRET is); ``set_pdl`` changes it at run time.
_ENABLED = os.environ.get("TRITILE_PDL", "1").lower() not in ("0", "false", "no", "off")


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for later launches (initially off when ``TRITILE_PDL=0``);
    returns the previous setting.  Kernels already compiled both ways are reused."""
    global _ENABLED
    from ..runtime.plan import clear_plans  # plans hold their launches' PDL flags

    old, _ENABLED = _ENABLED, bool(enabled)
    clear_plans()
    return old


@functools.lru_cache(maxsize=None)
def _device_pdl(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: Device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring)."""
    if not _ENABLED or _INTERPRET:
        return False
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return False
    return _device_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: Device, enabled: bool = True, launch: bool = True) -> dict:
    """Launch keywords for a kernel with a ``PDL: tl.constexpr`` parameter (whose first statement is
    ``pdl_enter(PDL)``) where :func:`use_pdl` allows it and ``enabled``: ``PDL=True`` (signal, then wait) and
    ``launch_pdl=launch``.  An op's later kernels pass ``launch=False``: they start after the op's previous kernel
    as usual (their wait is then a no-op, and a kernel's CUPTI time never includes a wait for its own op's
    previous kernel), but still signal, so that the next op's first kernel overlaps their tail.  Else
    ``PDL=False``."""
    if enabled and use_pdl(device):
        return {"PDL": True, "launch_pdl": True} if launch else {"PDL": True}
    return {"PDL": False}
