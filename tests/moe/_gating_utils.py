"""Shared helpers of the MoE tests: TileKernels' ``generate_moe_params`` / ``generate_topk_idx`` (without
``torch.compile``; CPU-sized under the interpreter) and the ``num_sms`` sweep."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List


from tritile.config import set_num_sms
from tritile.testing.generator import generate_moe_params, generate_num_sms, generate_topk_idx  # noqa: F401


def param_id(p: Dict) -> str:
    return "-".join(f"{k}={v}" for k, v in p.items())


def num_sms_values() -> List[int]:
    """Two different persistent-grid sizes (results must not change)."""
    return generate_num_sms()


@contextlib.contextmanager
def sweep_num_sms() -> Iterator[List[int]]:
    try:
        yield num_sms_values()
    finally:
        set_num_sms(None)
