"""``python -m tritile bench --module quant --grid``: every quant op declares TileKernels' benchmark grid, its sizes
and routing points are TileKernels', and the first cases of each op's grid run and match their reference (on the
CPU a structural pass at tiny sizes; the whole CPU grid is ``python -m tritile bench --module quant --grid``)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from tritile.bench import load_all
from tritile.bench.runner import make_cases
from tritile.bench.cases import _grid as grid

_OPS = {b.op: b for b in load_all(["quant"])}
#: Cases of each op's grid: TileKernels' count on the GPU, and that of the CPU pass (same flags, fewer shapes: 1 token
#: count x 2 hidden sizes, one routing point).
_COUNTS = {"per_token_cast": (448, 64), "per_block_cast": (224, 32), "per_token_cast_back": (336, 48),
           "per_token_cast_to_e5m6": (56, 8), "cast_back_e5m6": (56, 8), "per_block_cast_lossless": (168, 24),
           "per_channel_cast": (28, 4), "per_channel_cast_fused": (96, 8), "per_channel_cast_and_transpose": (56, 8),
           "swiglu_forward_and_per_channel_cast_and_transpose": (224, 32),
           "swiglu_forward_and_per_token_cast": (288, 4), "swiglu_backward_and_per_token_cast": (288, 4)}
#: Ops whose CPU grid is only sampled here (the whole CPU grid takes 15-70 s each): the cases built; the first two
#: of them (at most) run and are checked.  per_block_cast's first 8: every fmt, config and block of a bf16 input.
_SAMPLED = {"swiglu_backward_and_per_token_cast": 1, "swiglu_forward_and_per_token_cast": 1, "per_block_cast": 8}


def test_every_quant_op_has_a_grid():
    assert len(_OPS) == 12
    for name, bop in _OPS.items():
        assert "grid" in inspect.signature(bop.make_cases).parameters, name
        gen = make_cases(bop, torch.device("cpu"), False, grid=True)
        assert gen.gi_frame.f_locals.get("grid") is True, name  # a generator, not run: no kernel launched


def test_grid_sizes_are_tilekernels():
    cuda = torch.device("cuda")  # only selects TileKernels' sizes; nothing is allocated
    assert grid.token_counts(cuda) == [4001, 8001]
    assert grid.token_counts(cuda, 128) == [4096, 8064]
    assert grid.hidden_sizes(cuda) == [576, 2048, 2560, 3072, 4096, 6144, 7168]
    assert grid.hidden_sizes(cuda, 128) == [2048, 2560, 3072, 4096, 6144, 7168]
    assert grid.hidden_sizes(cuda, 256, cpu=(512,)) == grid.hidden_sizes(cuda, 256)
    assert len(grid.shapes(cuda, 128)) == 14
    cpu = torch.device("cpu")
    assert grid.shapes(cpu) == [(33, 192), (33, 576)] and grid.shapes(cpu, 128) == [(128, 192), (128, 576)]
    assert grid.hidden_sizes(cpu, 256) == [256] and grid.hidden_sizes(cpu, 256, cpu=(512,)) == [512]
    assert grid.sf_flags(grid.PACKED, "out_") == dict(out_round_sf=True, out_use_packed_ue8m0=True,
                                                      out_use_tma_aligned_col_major_sf=True)
    # the CPU pass keeps one routing point (the last of TileKernels' order, or of the op's filter)
    assert [p[1:] for p in grid.moe_points(cpu, "swiglu_backward_and_per_token_cast")] == [(9, 4, 64)]
    assert [p[1:] for p in grid.moe_points(cpu, "per_channel_cast_fused", topk=(6,))] == [(6, 4, 64)]


def _units(device, op):
    """How many shapes (routing points x hidden sizes for the MoE ops) the op's grid spans on ``device``."""
    GRID = grid.GRID

    points = len(GRID) if device.type == "cuda" else 1  # the CPU pass keeps one routing point
    if op == "per_channel_cast_fused":  # a plain input, then the points of num_topk 6
        topk6 = sum(k == 6 for k, _, _ in GRID) if device.type == "cuda" else 1
        return (1 + topk6) * len(grid.hidden_sizes(device, 128))
    if op.startswith("swiglu_forward_and_per_token") or op.startswith("swiglu_backward"):
        return points * len(grid.hidden_sizes(device, 256, cpu=(512,)))
    if "per_channel" in op:
        return len(grid.shapes(device, 128))
    return len(grid.shapes(device))


def test_gpu_counts_follow_the_cpu_structure():
    """The GPU grid has the CPU grid's cases (counted in test_grid_cases_run_and_check) at every one of its shapes."""
    for op, (gpu, cpu) in _COUNTS.items():
        assert gpu * _units(torch.device("cpu"), op) == cpu * _units(torch.device("cuda"), op), op
    assert sum(gpu for gpu, _ in _COUNTS.values()) == 2268


def test_fused_maps_are_canonical():
    topk_idx = torch.tensor([[1, -1], [0, 1], [-1, 0]])
    p2e, p2t, p2tk, tk2p = grid.fused_maps(topk_idx, 2, 4)
    assert p2e.tolist() == [0, 0, -1, -1, 1, 1, -1, -1]
    assert p2t.tolist() == [1, 2, -1, -1, 0, 1, -1, -1]
    assert p2tk.tolist() == [2, 5, -1, -1, 0, 3, -1, -1]
    assert tk2p.tolist() == [[4, -1], [0, 5], [-1, 1]]
    x = torch.arange(6.0).reshape(3, 2)
    assert grid.expand(x, p2t).tolist() == [[2, 3], [4, 5], [0, 0], [0, 0], [0, 1], [2, 3], [0, 0], [0, 0]]


@pytest.mark.parametrize("op", sorted(_OPS))
def test_grid_cases_run_and_check(op, device):
    """The op's grid: on the CPU every case is built (the generator runs the kernel once for its byte count) and
    counted (the slowest ops: their first cases), and the first two run and match their reference; on a GPU the
    first cases only (each new config compiles)."""
    whole = device.type != "cuda" and op not in _SAMPLED
    gen = make_cases(_OPS[op], device, False, grid=True)
    cases = list(gen if whole else itertools.islice(gen, _SAMPLED.get(op, 2)))
    if whole:
        assert len(cases) == _COUNTS[op][1], op
    seen = set()
    for i, case in enumerate(cases):
        assert case.nbytes > 0 and case.ref is not None and case.check is not None
        assert all(not isinstance(v, torch.Tensor) for v in case.params.values())
        key = (case.label, tuple(case.params.items()))
        assert key not in seen, (op, key)  # every case of the grid is a distinct point
        seen.add(key)
        if i < 2:
            case.check(case.fn(), case.ref())
        if device.type == "cuda" or op in ("per_token_cast_to_e5m6", "cast_back_e5m6", "per_block_cast_lossless"):
            kernel, params = case.anchor  # TileKernels' record form: its kernel name and parameter names
            assert params["hidden"] == case.params["hidden"], (op, params)
