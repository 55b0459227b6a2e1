"""Shape and input generators that know CPU (interpreter) from GPU.

The same test files run on both: on the GPU they use TileKernels' full shapes, on the CPU small
grids that keep every edge (partial blocks, odd sizes, 0 tokens) but cost few interpreter programs.
"""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple, TypeVar

import torch
from torch.types import Device

from ..runtime import is_interpreter
from ..utils import align

__all__ = ["get_device", "is_gpu_run", "full_test", "pick", "generate_num_tokens", "generate_hidden_sizes",
           "generate_rand_float", "generate_moe_params", "generate_topk_idx", "generate_num_sms",
           "generate_topk_idx_rows", "generate_e5m6_inputs"]


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


_T = TypeVar("_T")


def pick(cpu: _T, gpu: _T) -> _T:
    """``gpu`` on a GPU run, ``cpu`` under the interpreter."""
    return gpu if is_gpu_run() else cpu


def generate_num_tokens(alignment: int = 1, cpu: Sequence[int] = (0, 3, 130)) -> List[int]:
    """TileKernels' [4001, 8001] (aligned up) plus 0 on the GPU; a small grid on the CPU."""
    if is_gpu_run():
        vals = [align(4001, alignment), align(8001, alignment)]
        return [0] + vals
    return [align(v, alignment) if v else 0 for v in cpu]


def generate_hidden_sizes(align_to: int = 64, cpu: Sequence[int] = (256, 576)) -> List[int]:
    """TileKernels' hidden sizes (filtered by ``align_to``) on the GPU; a small set on the CPU."""
    if is_gpu_run():
        sizes = [576, 2048, 2560, 3072, 4096, 6144, 7168]
    else:
        sizes = list(cpu)
    return [h for h in sizes if h % align_to == 0]


def generate_rand_float(shape: Tuple[int, ...], device: Device = None, min_exp: int = -110,
                        max_exp: int = 126) -> torch.Tensor:
    """float32 with a random sign, mantissa and exponent in [min_exp, max_exp] (wide dynamic range)."""
    device = device if device is not None else get_device()
    mant = torch.rand(shape, device=device) + 1.0
    exp = torch.randint(min_exp, max_exp + 1, shape, device=device).float()
    sign = torch.where(torch.rand(shape, device=device) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).float()


def generate_moe_params(is_benchmark: bool = False, cpu_num_send_tokens: int = 33,
                        cpu_topks: Sequence[int] = (1, 6, 9)) -> List[dict]:
    """TileKernels' MoE grid: dicts ``{num_send_tokens, num_topk, num_experts (local), num_ep_ranks}``.

    GPU: 4001 senders per rank, K in {2, 6, 8, 9}, (E_total, ep) in {(72, 8), (256, 8), (256, 64)}
    (+ TileKernels' full-test extras).  CPU: the same structure with ``cpu_num_send_tokens`` senders (odd, so
    tails are partial) and ``cpu_topks``, which keeps the interpreter fast.  Full test (``TRITILE_FULL_TEST=1``)
    also adds the empty case unless benchmarking."""
    gpu = is_gpu_run()
    send = 4001 if gpu else cpu_num_send_tokens
    topks = [2, 6, 8, 9] if gpu else list(cpu_topks)
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


def generate_topk_idx(params: dict, device: Device = None) -> torch.Tensor:
    """The receiving side of an EP dispatch, as TileKernels generates it (without ``torch.compile``).

    ``num_send_tokens * ep`` senders draw distinct experts among ``E_local * ep``; ids outside the local range
    become -1 and rows with no local expert are dropped.  Returns int64 ``(T', K)``; every row keeps at least
    one valid slot."""
    device = device if device is not None else get_device()
    e_local, ep, k = params["num_experts"], params["num_ep_ranks"], params["num_topk"]
    rows = params["num_send_tokens"] * ep
    if rows == 0 or e_local * ep < k:
        return torch.empty((0, k), dtype=torch.int64, device=device)
    scores = torch.rand((rows, e_local * ep), device=device).to(torch.bfloat16)
    idx = scores.topk(k, dim=1, sorted=False).indices
    idx = torch.where(idx < e_local, idx, -1)
    return idx[(idx >= 0).any(dim=1)].contiguous()


def generate_num_sms() -> List[int]:
    """Two persistent-grid sizes (TileKernels: device - 20 and device; [1, 3] on the CPU)."""
    from ..config import get_device_num_sms

    if is_gpu_run():
        dev = get_device_num_sms()
        return [max(1, dev - 20), dev]
    return [1, 3]


def generate_topk_idx_rows(num_tokens: int, num_topk: int, num_experts: int, num_ep_ranks: int,
                           device: Device = None, seed: int = 0) -> torch.Tensor:
    """``generate_topk_idx``'s EP-receive routing, drawn until exactly ``num_tokens`` rows are kept (the
    benchmarks' anchor shapes give the received token count).  Reproducible: its own generator, ``seed``."""
    device = device if device is not None else get_device()
    total = num_experts * num_ep_ranks
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    rows, have = [], 0
    while have < num_tokens:
        n = max(1024, 2 * (num_tokens - have) * max(1, total // (num_topk * num_experts)))
        idx = torch.rand((n, total), device=device, generator=g).to(torch.bfloat16).topk(num_topk, dim=1,
                                                                                          sorted=False).indices
        idx = torch.where(idx < num_experts, idx, -1)
        idx = idx[(idx >= 0).any(dim=1)]
        rows.append(idx)
        have += idx.shape[0]
    if not rows:
        return torch.empty((0, num_topk), dtype=torch.int64, device=device)
    return torch.cat(rows)[:num_tokens].contiguous()


def generate_e5m6_inputs(m: int, k: int, dtype: torch.dtype, device: Device = None) -> dict:
    """TileKernels' E5M6 test inputs: ``randn`` plus three 'special' tensors filled with 2^-20, 63*2^-20 or
    2^-14 whose last column is 65024 (so the row's sf is exactly 1)."""
    device = device if device is not None else get_device()
    out = {"randn": torch.randn(m, k, device=device).to(dtype)}
    for name, v in (("2^-20", 2.0**-20), ("63*2^-20", 63 * 2.0**-20), ("2^-14", 2.0**-14)):
        x = torch.full((m, k), v, device=device)
        x[:, -1] = 65024.0
        out[name] = x.to(dtype)
    return out
