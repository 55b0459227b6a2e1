"""Shared helpers of the MoE tests: TileKernels' ``generate_moe_params`` / ``generate_topk_idx`` (without
``torch.compile``; CPU-sized under the interpreter) and the ``num_sms`` sweep."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

import torch

from tritile.config import get_device_num_sms, set_num_sms
from tritile.testing import full_test, get_device, is_gpu_run


def generate_moe_params(is_benchmark: bool = False) -> List[Dict[str, int]]:
    """TileKernels' MoE parameter grid: ``{num_send_tokens, num_topk, num_experts (local), num_ep_ranks}``.

    GPU: num_send_tokens = 4001, K in {2, 6, 8, 9}, (E_total, ep) in {(72, 8), (256, 8), (256, 64)}
    (+ TileKernels' full-test extras).  CPU: the same structure with 33 send tokens (odd, so tails are
    partial) and K in {1, 6, 9}, which keeps the interpreter fast."""
    gpu = is_gpu_run()
    send = 4001 if gpu else 33
    topks = [2, 6, 8, 9] if gpu else [1, 6, 9]
    experts_ep = [(72, 8), (256, 8), (256, 64)]
    if full_test() and gpu:
        topks += [1, 7]
        experts_ep = [(e, ep) for e in (72, 256, 288, 384) for ep in (1, 8, 64, 72, 256) if e % ep == 0]
    params = []
    if full_test() and not is_benchmark:
        params.append(dict(num_send_tokens=0, num_topk=1, num_experts=1, num_ep_ranks=1))
    for k in topks:
        for e_total, ep in experts_ep:
            params.append(dict(num_send_tokens=send, num_topk=k, num_experts=e_total // ep, num_ep_ranks=ep))
    return params


def param_id(p: Dict) -> str:
    return "-".join(f"{k}={v}" for k, v in p.items())


def generate_topk_idx(params: Dict[str, int], device=None) -> torch.Tensor:
    """The receiving side of an EP dispatch: int64 ``(T', K)`` local expert ids, -1 = expert elsewhere;
    rows whose slots are all -1 are dropped (every row keeps at least one valid slot)."""
    device = device if device is not None else get_device()
    e_local, ep, k = params["num_experts"], params["num_ep_ranks"], params["num_topk"]
    rows = params["num_send_tokens"] * ep
    if rows == 0 or e_local * ep < k:
        return torch.empty((0, k), dtype=torch.int64, device=device)
    scores = torch.rand((rows, e_local * ep), dtype=torch.bfloat16, device=device)
    idx = scores.topk(k, dim=1, sorted=False).indices
    idx = torch.where(idx < e_local, idx, -1)
    return idx[(idx >= 0).any(dim=1)].contiguous()


def num_sms_values() -> List[int]:
    """Two different persistent-grid sizes (results must not change)."""
    if is_gpu_run():
        dev = get_device_num_sms()
        return [max(1, dev - 20), dev]
    return [1, 3]


@contextlib.contextmanager
def sweep_num_sms() -> Iterator[List[int]]:
    try:
        yield num_sms_values()
    finally:
        set_num_sms(None)
