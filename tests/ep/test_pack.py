"""tritile.ep.pack: pack_rows / pack_meta / gather_rows / unpack_meta against tritile.ep.ref, bit for bit."""

import pytest
import torch

from tritile.ep.layout import dispatch_layout
from tritile.ep.pack import as_words, gather_rows, meta_width, pack_meta, pack_rows, unpack_meta
from tritile.ep.ref import gather_rows_ref, pack_meta_ref, pack_rows_ref, unpack_meta_ref
from tritile.testing import assert_equal, pick

CASES = pick(
    cpu=[(0, 2, 8, 2, 64), (1, 1, 4, 4, 33), (29, 4, 16, 4, 72), (40, 3, 6, 3, 128), (17, 2, 8, 2, 7)],
    gpu=[(0, 8, 256, 2, 7168), (4096, 8, 256, 2, 7168), (8192, 8, 256, 2, 7168), (4001, 6, 64, 8, 2048)])


def _layout(t, k, num_experts, num_ranks, device):
    idx = torch.rand((t, num_experts)).topk(k, dim=1).indices if t else torch.zeros((0, k), dtype=torch.int64)
    if t:
        idx[torch.rand((t, k)) < 0.25] = -1
    idx = idx.to(device)
    per_rank, _, _, slot, _ = dispatch_layout(idx, num_experts, num_ranks)
    return idx, slot, (per_rank.cumsum(0) - per_rank).to(torch.int32), int(per_rank.sum())


def _targeted(slot, base, rows):
    hit = torch.zeros((rows,), dtype=torch.bool, device=slot.device)
    for r in range(slot.shape[1]):
        sel = slot[:, r] >= 0
        hit[base[r].long() + slot[sel, r].long()] = True
    return hit


@pytest.mark.parametrize("t,k,num_experts,num_ranks,hidden", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_pack_rows(device, t, k, num_experts, num_ranks, hidden, dtype):
    idx, slot, base, rows = _layout(t, k, num_experts, num_ranks, device)
    x = torch.randn((t, hidden + 3), device=device).to(dtype)[:, :hidden]  # strided rows
    w = as_words(x)
    out = pack_rows(w, slot, base, rows)
    assert_equal(out, pack_rows_ref(w, slot, base, rows), "pack_rows")
    # fixed-capacity blocks with gaps: only the targeted rows are compared
    cap = max(t, 1) + 2
    fbase = torch.arange(num_ranks, dtype=torch.int32, device=device) * cap
    out = pack_rows(w, slot, fbase, num_ranks * cap)
    hit = _targeted(slot, fbase, num_ranks * cap)
    assert_equal(out[hit], pack_rows_ref(w, slot, fbase, num_ranks * cap)[hit], "pack_rows (fixed)")


@pytest.mark.parametrize("t,k,num_experts,num_ranks,hidden", CASES)
@pytest.mark.parametrize("parts", ["all", "idx", "sf", "none"])
def test_pack_unpack_meta(device, t, k, num_experts, num_ranks, hidden, parts):
    idx, slot, base, rows = _layout(t, k, num_experts, num_ranks, device)
    w = torch.rand((t, k), device=device) if parts == "all" else None
    ids = idx if parts in ("all", "idx") else None
    if ids is not None and ids.dtype == torch.int64 and t > 2:
        ids = ids.clone()
        ids[1, 0] = (1 << 32) + 1  # out of range, in range after an int32 cast: packed as -1
    nsf = (hidden + 127) // 128
    sf = torch.rand((nsf, t), device=device).t().view(torch.int32) if parts in ("all", "sf") else None  # col-major
    per = num_experts // num_ranks
    meta = pack_meta(ids, w, sf, slot, base, rows, per, k)
    assert meta.shape == (rows, meta_width(k, ids is not None, w is not None, 0 if sf is None else nsf))
    assert_equal(meta, pack_meta_ref(ids, w, sf, slot, base, rows, per, k), "pack_meta")
    sw = 0 if sf is None else nsf
    row_map = torch.randint(-1, max(rows, 1), (rows + 5,), dtype=torch.int32, device=device)
    if rows == 0:
        row_map.fill_(-1)
    for rm in (None, row_map):
        got = unpack_meta(meta, rm, k, ids is not None, w is not None, sw)
        ref = unpack_meta_ref(meta, rm, k, ids is not None, w is not None, sw)
        for name, a, b in zip(("idx", "weights", "src", "sf"), got, ref):
            assert_equal(a, b, name)
    # padding rows filled
    filled = pack_meta(ids, w, sf, slot, torch.arange(num_ranks, dtype=torch.int32, device=device) * (t + 1),
                       num_ranks * (t + 1), per, k, fill=-1)
    hit = _targeted(slot, torch.arange(num_ranks, dtype=torch.int32, device=device) * (t + 1), num_ranks * (t + 1))
    assert bool((filled[~hit] == -1).all())


@pytest.mark.parametrize("rows,words,out_rows", pick(cpu=[(0, 8, 3), (13, 36, 20), (7, 1, 7)],
                                                     gpu=[(8192, 3584, 16384), (0, 3584, 5)]))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_gather_rows(device, rows, words, out_rows, dtype):
    src = torch.randint(-100, 100, (rows, words), device=device).to(dtype)
    row_map = torch.randint(-1, max(rows, 1), (out_rows,), dtype=torch.int32, device=device)
    if rows == 0:
        row_map.fill_(-1)
    assert_equal(gather_rows(src, row_map), gather_rows_ref(src, row_map), "gather_rows")


def test_as_words():
    x = torch.zeros((3, 7), dtype=torch.bfloat16)
    assert as_words(x).dtype == torch.int16 and as_words(x).shape == (3, 7)
    assert as_words(torch.zeros((3, 8), dtype=torch.bfloat16)).shape == (3, 4)
    assert as_words(torch.zeros((3, 5), dtype=torch.float8_e4m3fn)).dtype == torch.uint8
    with pytest.raises(ValueError, match="stride"):
        as_words(torch.zeros((4, 4), dtype=torch.bfloat16).t())


def test_pack_bad_args(device):
    idx, slot, base, rows = _layout(6, 2, 8, 2, device)
    x = torch.zeros((6, 4), dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="x"):
        pack_rows(x.float(), slot, base, rows)
    with pytest.raises(ValueError, match="send_slot"):
        pack_rows(x[:5], slot, base, rows)
    with pytest.raises(TypeError, match="send_slot"):
        pack_meta(idx, None, None, slot.long(), base, rows, 4, 2)
    with pytest.raises(ValueError, match="topk_weights"):
        pack_meta(None, torch.zeros((6, 2), device=device), None, slot, base, rows, 4, 2)
    with pytest.raises(TypeError, match="row_map"):
        gather_rows(x, torch.zeros(3, device=device))


def test_pack_compile(device):
    idx, slot, base, rows = _layout(9, 2, 8, 2, device)
    x = as_words(torch.randn((9, 16), device=device).to(torch.bfloat16))
    be = "eager" if device.type == "cpu" else "inductor"

    def fn(x, idx, slot, base):
        p = pack_rows(x, slot, base, rows)
        m = pack_meta(idx, None, None, slot, base, rows, 4, 2)
        u = unpack_meta(m, None, 2, True, False, 0)
        g = gather_rows(p, torch.arange(rows, dtype=torch.int32, device=x.device))
        return p, m, u[0], g

    got = torch.compile(fn, fullgraph=True, backend=be)(x, idx, slot, base)
    ref = fn(x, idx, slot, base)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
