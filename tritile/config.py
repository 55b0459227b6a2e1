"""Device configuration (same names as ``tile_kernels.config``), usable without a GPU.

``set_num_sms`` only changes launch grids of persistent kernels; results never depend on it.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

__all__ = ["get_device_num_sms", "get_num_sms", "set_num_sms", "get_max_smem_per_sm"]

_num_sms: Optional[int] = None

# Used when no GPU is present (CPU interpreter): a small persistent grid keeps interpreter runs fast.
_CPU_NUM_SMS = 4
_CPU_SMEM_PER_SM = 228 * 1024


def _cuda_ok() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _device_props(index: int):
    return torch.cuda.get_device_properties(index)


def get_device_num_sms() -> int:
    """Number of multiprocessors on the current CUDA device (a small fixed count on the CPU)."""
    if not _cuda_ok():
        return _CPU_NUM_SMS
    return _device_props(torch.cuda.current_device()).multi_processor_count


def get_num_sms() -> int:
    """The SM count kernels plan their persistent grids for: ``set_num_sms``'s value, else the device's."""
    return _num_sms if _num_sms is not None else get_device_num_sms()


def set_num_sms(num_sms: int) -> None:
    """Limit persistent grids to ``num_sms`` programs.

    Launch-only for every op but two mHC backwards: ``mhc_pre_split_mixes``' gradients of ``mhc_scale`` /
    ``mhc_base`` and ``mhc_head_compute_mix``'s are sums of one partial a program (as TileKernels sums one partial an
    SM), so their last bits follow the count, as TileKernels' follow the GPU's SM count."""
    global _num_sms
    from .runtime.plan import clear_plans  # plans hold grids sized by the SM count

    clear_plans()
    if num_sms is None:
        _num_sms = None
        return
    if isinstance(num_sms, bool) or not isinstance(num_sms, int):
        raise TypeError(f"num_sms must be an int, got {type(num_sms).__name__}")
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    device_sms = get_device_num_sms()
    if _cuda_ok() and num_sms > device_sms:
        raise ValueError(f"num_sms must be at most the device's {device_sms} SMs, got {num_sms}")
    _num_sms = num_sms


def get_max_smem_per_sm() -> int:
    """Shared memory per SM in bytes (the H100/H200 figure on the CPU)."""
    if not _cuda_ok():
        return _CPU_SMEM_PER_SM
    props = _device_props(torch.cuda.current_device())
    for attr in ("shared_memory_per_multiprocessor", "max_shared_memory_per_multiprocessor"):
        v = getattr(props, attr, None)
        if v:
            return int(v)
    return _CPU_SMEM_PER_SM
