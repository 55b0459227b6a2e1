"""``python -m tritile bench --grid`` for the moe ops: the grid's points, its token counts (TileKernels' where its
records have the shape), the ``grid`` switch of the registry, and the per-op tables (no kernel runs here)."""

from __future__ import annotations

import io

import torch

from tritile.bench import load_all
from tritile.bench.runner import make_cases, print_grid_tables
from tritile.bench.cases import _grid as grid


def test_grid_points():
    pts = grid.points(quick=False, grid=True, default=(8, 9, 8))
    assert len(pts) == len(set(pts)) == 12
    assert {k for k, _, _ in pts} == {2, 6, 8, 9}
    assert {(e * ep, ep) for _, e, ep in pts} == {(72, 8), (256, 8), (256, 64)}
    assert grid.points(quick=True, grid=True, default=(8, 9, 8)) == [(8, 9, 8)]
    assert grid.points(quick=False, grid=False, default=(8, 9, 8)) == [(8, 9, 8)]


def test_grid_tokens_follow_the_records():
    cuda = torch.device("cuda")  # only selects TileKernels' sizes; nothing is allocated
    t, rec = grid.num_tokens(cuda, "get_fused_mapping", 2, 9, 8, alignment=128)
    assert (t, rec["time_us"]) == (7902, 6.68)
    t, rec = grid.num_tokens(cuda, "normalize_weight", 8, 9, 8)  # the anchor shape of tilekernels-h200.json
    assert t == 21876 and rec is not None
    # no record: one seeded draw of TileKernels' routing; on the CPU (other tie-breaking of the bf16 scores than
    # CUDA's topk) it lands within 6 % of TileKernels' own draws on the H200 (measured: -2.6, -5.2 and -0.6 %)
    for (k, e, ep), seen in {(2, 9, 8): 7902, (6, 32, 8): 18711, (8, 9, 8): 21876}.items():
        assert abs(grid.received_tokens(4001, k, e, ep) / seen - 1) < 0.06, (k, e, ep)


def test_grid_switch_reaches_the_generators():
    ops = {b.op: b for b in load_all(["moe"])}
    for name in ("get_fused_mapping", "normalize_weight", "reduce_fused", "expand_to_fused_with_sf",
                 "inplace_unique_group_indices", "mask_indices_by_tp", "topk_gate"):
        gen = make_cases(ops[name], torch.device("cpu"), False, grid=True)
        assert gen.gi_frame.f_locals.get("grid") is True, name  # a generator, not run: no kernel launched


def test_grid_tables():
    rows = [dict(op="x", params="a=1", tk_us=2.0, cupti_us=1.0, vs_tk=2.0, pct_copy=5.0, event_us=4.0, host_us=3.0,
                 status="ok"),
            dict(op="x", params="a=2", tk_us=1.0, cupti_us=2.0, vs_tk=0.5, status="ok"),
            dict(op="x", params="a=3", us=3.0, vs_tk="no anchor", status="ok"),
            dict(op="y", params="b=1", us=1.0, status="ok")]
    out = io.StringIO()
    print_grid_tables(rows, out)
    text = out.getvalue()
    assert "| a=1 | 2.0 | 1.0 | 2.00 | 5.0 | 4.0 | 3.0 |" in text
    assert "x: 3 shapes, 2 with a TileKernels figure; worst 0.50× TK at a=2; geometric mean 1.00×." in text
    assert "y: 1 shapes, none with a TileKernels figure." in text
