"""Helpers shared by the core-cast tests (test_per_token_cast / test_per_block_cast / test_cast_back)."""

from __future__ import annotations

import pytest
import torch

from tritile.testing import assert_equal, clear_unused_sf  # noqa: F401  (re-exported for the tests)


def assert_bad_inputs(cases) -> None:
    """Each ``(exception type, message pattern, call)`` of ``cases``: ``call()`` raises that exception with a message
    matching the pattern (a bad-input table: every call is checked, in order)."""
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def assert_sf_equal(sf: torch.Tensor, ref: torch.Tensor, hidden: int, block_k: int) -> None:
    """Bitwise sf comparison: dtype, shape and strides, plus the logical bytes (packed: used bytes only)."""
    assert sf.dtype == ref.dtype, (sf.dtype, ref.dtype)
    assert sf.shape == ref.shape, (sf.shape, ref.shape)
    if sf.numel() > 0:
        assert sf.stride() == ref.stride(), (sf.stride(), ref.stride())
    if sf.dtype == torch.int32 and sf.numel() > 0:
        assert_equal(clear_unused_sf(sf, hidden, block_k), clear_unused_sf(ref, hidden, block_k))
        # tritile writes zeros in unused bytes: check it without clearing too
        assert_equal(dense(sf), dense(ref))
    else:
        assert_equal(dense(sf), dense(ref))


def dense(t: torch.Tensor) -> torch.Tensor:
    """Row-major copy (``assert_equal``'s ``.contiguous()`` keeps the strides of an ``(M, 1)`` column-major
    int32 sf, whose byte view then fails)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def hand_picked(rows: int, cols: int, device, mx: float) -> torch.Tensor:
    """float32 ``(rows, cols)``, cols % 16 == 0, of the spec's hand-picked values: every 16 columns hold 15
    edge values and the format's max ``mx`` (448 or 6), so any group of >= 16 columns has scale 1.

    Row 0 is the list in order; the other rows shuffle each group's 15 values and flip signs at random."""
    if mx == 448.0:  # ties (17 -> 16, 232 -> 224), carries (31.4 -> 32, 7.87 -> 8, 31.88 -> 32),
        # fp8 subnormals (1.5*2^-9 -> 2^-8 tie, 0.00146 -> 2^-9), -0.0, negatives rounding to -0 (-1e-9, -2^-10)
        vals = [17.0, 2.5, 0.25, 31.4, -0.0, -1e-9, 1.5 * 2**-9, 0.00146, -(2**-10), 7.87, 31.88, 0.3, -0.24,
                232.0, 13.0]
    else:  # ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; -0.0; -0.1 -> -0
        vals = [0.25, 2.5, 0.75, 1.25, 1.75, 3.5, 5.0, -0.0, -0.1, -0.24, 0.2500001, 2.9, -4.5, 0.0, 1.0]
    assert cols % 16 == 0
    group = torch.tensor(vals + [mx])
    x = group.repeat(rows, cols // 16).reshape(rows, cols // 16, 16)
    for r in range(1, rows):
        for g in range(cols // 16):
            perm = torch.randperm(15)
            sign = torch.where(torch.rand(15) < 0.5, -1.0, 1.0)
            x[r, g, :15] = x[r, g, perm] * sign
    return x.reshape(rows, cols).to(device)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The references run many tiny torch ops; with intra-op threads on a busy 2-core machine each op can
    wait milliseconds for the OpenMP pool (measured: 0.4-1.2 s vs 2-10 ms per reference call at 130x576).
    One thread for the duration of each test; restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
