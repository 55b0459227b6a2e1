"""Multi-process launcher for tritile.ep tests: ``torch.multiprocessing.spawn`` + a file-based rendezvous.

CPU runs use gloo (the Triton interpreter is inherited through ``TRITON_INTERPRET`` from the parent's conftest);
GPU runs use NCCL with one GPU per rank.  Every group gets a short timeout so a failing rank never hangs the test.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def use_nccl() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()


def can_run(world: int) -> bool:
    return (not use_nccl()) or torch.cuda.device_count() >= world


def _entry(rank: int, world: int, init: str, fn, args) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if use_nccl() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args, env: Optional[Dict[str, str]] = None) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; a failure in any re-raises here.  ``env``: variables
    the processes start with (e.g. ``TRITON_INTERPRET=0``: CPU tensors take tritile.ep's pure-torch twins)."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_entry, args=(world, os.path.join(d, "rendezvous"), fn, args), nprocs=world, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
