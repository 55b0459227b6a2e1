"""tritile.ep.ll (the low-latency send metadata and receive layout) against tritile.ep.ref's twins, bit for bit."""

import pytest
import torch

from tritile.ep.layout import dispatch_layout
from tritile.ep.ll import ll_cast_send, ll_receive, ll_send_meta
from tritile.ep.ref import ll_receive_ref, ll_send_meta_ref
from tritile.testing import assert_equal, pick

# (num_local, num_ranks, cap, k, has_w, sf_words)
CASES = pick(cpu=[(4, 2, 5, 3, True, 2), (3, 3, 7, 2, False, 0), (1, 2, 1, 1, True, 0), (2, 4, 3, 4, False, 1),
                  (5, 2, 33, 2, True, 3)],
             gpu=[(128, 2, 128, 8, True, 56), (36, 8, 128, 8, False, 14), (32, 8, 256, 8, True, 0),
                  (128, 2, 1, 8, False, 56)])
_SENTINEL = 0x5A5A5A5A


def _meta(num_local, num_ranks, cap, k, has_w, sf_words, device):
    """Received metadata rows: per source block, valid rows first (distinct local ids or -1 per row), then padding
    rows whose source token is -1 and whose other words are garbage (they must be ignored)."""
    width = 1 + k + (k if has_w else 0) + sf_words
    meta = torch.randint(-5, 1 << 20, (num_ranks * cap, width), dtype=torch.int32)
    for s in range(num_ranks):
        c = int(torch.randint(0, cap + 1, ()))
        for i in range(cap):
            row = meta[s * cap + i]
            if i >= c:
                row[0] = -1
                continue
            row[0] = int(torch.randint(0, 1000, ()))
            ids = torch.randperm(num_local + k)[:k]
            row[1:1 + k] = torch.where(ids < num_local, ids, -1).to(torch.int32)
            if has_w:
                row[1 + k:1 + 2 * k] = torch.rand(k).view(torch.int32)
    return meta.to(device)


def _recv_sf(num_local, rm, sf_words, device):
    """The column-major receive scales as the dispatch allocates them, viewed as int32, filled with a sentinel."""
    if sf_words == 0:
        return None
    return torch.full((num_local, sf_words, rm), _SENTINEL, dtype=torch.int32, device=device).transpose(1, 2)


@pytest.mark.parametrize("num_local,num_ranks,cap,k,has_w,sf_words", CASES)
def test_ll_receive(device, num_local, num_ranks, cap, k, has_w, sf_words):
    meta = _meta(num_local, num_ranks, cap, k, has_w, sf_words, device)
    rm = num_ranks * cap
    count = torch.full((num_local,), -7, dtype=torch.int32, device=device)
    recv_sf = _recv_sf(num_local, rm, sf_words, device)
    pos, info, rng, w = ll_receive(meta, k, has_w, sf_words, num_local, num_ranks, cap, count, recv_sf)
    r_pos, r_count, r_info, r_rng, r_w, r_sf = ll_receive_ref(meta, k, has_w, sf_words, num_local, num_ranks, cap)
    for name, a, b in zip(("pos", "recv_count", "src_info", "layout_range", "recv_weights"),
                          (pos, count, info, rng, w), (r_pos, r_count, r_info, r_rng, r_w)):
        assert_equal(a, b, name)
    if recv_sf is not None:
        for e, n in enumerate(r_count.tolist()):
            assert torch.equal(recv_sf[e, :n], r_sf[e, :n]), f"recv_sf[{e}] differs"
            assert bool((recv_sf[e, n:] == _SENTINEL).all()), f"recv_sf[{e}] past the count was written"


def test_ll_receive_all_one_expert(device):
    k, cap = 1, 4
    meta = torch.zeros((2 * cap, 1 + k), dtype=torch.int32, device=device)  # every row selects local expert 0
    meta[:, 0] = torch.arange(8, dtype=torch.int32, device=device)
    count = torch.empty((2,), dtype=torch.int32, device=device)
    pos, info, rng, w = ll_receive(meta, k, False, 0, 2, 2, cap, count)
    assert count.tolist() == [8, 0]
    assert pos.flatten().tolist() == list(range(8))
    assert info[0].tolist() == list(range(8)) and info[1].tolist() == [-1] * 8
    assert rng[0].tolist() == [4, (4 << 32) | 4] and rng[1].tolist() == [0, 0]
    assert tuple(w.shape) == (8, 0)


def test_ll_receive_bad_args(device):
    meta = torch.zeros((6, 3), dtype=torch.int32, device=device)
    count = torch.zeros((2,), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="R\\*M"):
        ll_receive(meta, 2, False, 0, 2, 2, 4, count)
    with pytest.raises(TypeError, match="meta"):
        ll_receive(meta.float(), 2, False, 0, 2, 2, 3, count)
    with pytest.raises(ValueError, match="recv_sf"):
        ll_receive(torch.zeros((6, 4), dtype=torch.int32, device=device), 2, False, 1, 2, 2, 3, count)
    with pytest.raises(ValueError, match="recv_sf"):
        ll_receive(meta, 2, False, 0, 2, 2, 3, count, torch.zeros((2, 6, 1), dtype=torch.int32, device=device))


def test_ll_receive_compile(device):
    meta = _meta(3, 2, 4, 2, True, 1, device)
    sf = _recv_sf(3, 8, 1, device)
    count = torch.empty((3,), dtype=torch.int32, device=device)

    def f(m, c, s):
        return ll_receive(m, 2, True, 1, 3, 2, 4, c, s)

    fn = torch.compile(f, fullgraph=True, backend="eager" if device.type == "cpu" else "inductor")
    got = fn(meta, count, sf)
    ref = ll_receive_ref(meta, 2, True, 1, 3, 2, 4)
    for a, b in zip(got, (ref[0], ref[2], ref[3], ref[4])):
        assert torch.equal(a, b)
    assert torch.equal(count, ref[1])
    for e, n in enumerate(ref[1].tolist()):
        assert torch.equal(sf[e, :n], ref[5][e, :n])


# (num_tokens, capacity, num_experts, num_ranks, k, has_w, extra words)
SEND_CASES = pick(cpu=[(5, 7, 8, 2, 3, True, 2), (0, 3, 6, 3, 2, False, 0), (33, 33, 12, 4, 4, True, 0),
                       (70, 80, 9, 3, 1, False, 1), (9, 9, 4, 1, 2, True, 3)],
                  gpu=[(128, 128, 288, 1, 8, False, 56), (256, 256, 256, 8, 8, True, 14), (1, 128, 64, 4, 6, True, 0),
                       (1000, 1024, 72, 8, 9, False, 0)])


def _routing(num_tokens, num_experts, k, g, device, idx_dtype=torch.int64):
    idx = torch.rand((num_tokens, num_experts), generator=g).topk(k, dim=1).indices
    idx[torch.rand((num_tokens, k), generator=g) < 0.25] = -1
    idx[::4, 0] = num_experts + 3  # out of range: ignored for routing
    if idx_dtype == torch.int64:  # ids an int32 cast would wrap into range
        idx[1::5, -1] = (1 << 32) + 1
        idx[2::7, 0] = -(1 << 32)
    return idx.to(idx_dtype).to(device)


@pytest.mark.parametrize("num_tokens,cap,num_experts,num_ranks,k,has_w,extra", SEND_CASES)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_ll_send_meta(device, num_tokens, cap, num_experts, num_ranks, k, has_w, extra, idx_dtype):
    g = torch.Generator().manual_seed(num_tokens * 7 + k)
    idx = _routing(num_tokens, num_experts, k, g, device, idx_dtype)
    w = torch.rand((num_tokens, k), generator=g).to(device) if has_w else None
    n = 1 + k + (k if has_w else 0)
    out = torch.full((num_ranks * cap, n + extra), _SENTINEL, dtype=torch.int32, device=device)
    slot = ll_send_meta(idx, w, num_experts, num_ranks, cap, out)
    r_slot, r_meta = ll_send_meta_ref(idx, w, num_experts, num_ranks, cap, n + extra)
    assert_equal(slot, r_slot, "send_slot")
    assert_equal(slot, dispatch_layout(idx, num_experts, num_ranks)[3], "send_slot (dispatch_layout)")
    sent = r_meta[:, 0] >= 0
    assert_equal(out[sent, :n], r_meta[sent, :n], "sent rows")
    assert bool((out[sent, n:] == _SENTINEL).all()), "the scale words must be left to the cast"
    assert bool((out[~sent, 0] == -1).all()), "padding rows must carry source token -1"
    assert bool((out[~sent, 1:] == _SENTINEL).all()), "padding rows' other words must be left as they are"


def test_ll_send_meta_bad_args(device):
    idx = torch.zeros((4, 2), dtype=torch.int64, device=device)
    out = torch.zeros((2 * 4, 3), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="capacity"):
        ll_send_meta(idx, None, 4, 2, 3, torch.zeros((6, 3), dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out must be"):
        ll_send_meta(idx, None, 4, 2, 4, out[:, :2])
    with pytest.raises(ValueError, match="topk_weights"):
        ll_send_meta(idx, torch.zeros((4, 3), device=device), 4, 2, 4, torch.zeros((8, 5), dtype=torch.int32,
                                                                                    device=device))
    with pytest.raises(ValueError, match="divisible"):
        ll_send_meta(idx, None, 5, 2, 4, out)
    with pytest.raises(TypeError, match="topk_idx"):
        ll_send_meta(idx.float(), None, 4, 2, 4, out)


# (num_tokens, capacity, hidden, num_ranks): partial 128-groups and 512-wide tiles, partial row blocks
CAST_CASES = pick(cpu=[(5, 7, 256, 2), (17, 20, 200, 3), (1, 1, 640, 1), (0, 4, 128, 2), (9, 12, 72, 4)],
                  gpu=[(128, 128, 7168, 1), (256, 256, 7168, 8), (33, 64, 2560, 4), (7, 8, 200, 2)])


@pytest.mark.parametrize("num_tokens,cap,hidden,num_ranks", CAST_CASES)
@pytest.mark.parametrize("round_sf,ue8m0", [(False, False), (True, False), (True, True)])
def test_ll_cast_send(device, num_tokens, cap, hidden, num_ranks, round_sf, ue8m0):
    """Each sent row is per_token_cast's row, bit for bit, in its slot; its scales in the metadata row's last
    words; nothing else written."""
    from tritile.quant import per_token_cast

    g = torch.Generator().manual_seed(num_tokens + hidden)
    x = (torch.randn((num_tokens, hidden + 8), generator=g) * 3).to(torch.bfloat16).to(device)[:, 4:4 + hidden]
    if num_tokens > 2:
        x[1, :5] = 0.0  # a zero group
        x[2, 3] = 6e4  # a large value
    idx = _routing(num_tokens, 4 * num_ranks, 3, g, device)
    slot = dispatch_layout(idx, 4 * num_ranks, num_ranks)[3]
    sw = -(-hidden // 512) if ue8m0 else -(-hidden // 128)
    width = 3 + sw
    rm = num_ranks * cap
    out = torch.full((rm, hidden), 0x5A, dtype=torch.uint8, device=device)
    meta = torch.full((rm, width), _SENTINEL, dtype=torch.int32, device=device)
    ll_cast_send(x, slot, cap, round_sf, ue8m0, out.view(torch.float8_e4m3fn), meta)
    data, sf = per_token_cast(x, "e4m3", 128, round_sf=round_sf, use_tma_aligned_col_major_sf=ue8m0,
                              use_packed_ue8m0=ue8m0)
    words = (sf if ue8m0 else sf.view(torch.int32)).contiguous()
    written = torch.zeros((rm,), dtype=torch.bool, device=device)
    for r in range(num_ranks):
        sel = slot[:, r] >= 0
        dst = r * cap + slot[sel, r].long()
        written[dst] = True
        assert torch.equal(out[dst], data.view(torch.uint8)[sel]), f"rows sent to rank {r}"
        assert torch.equal(meta[dst, width - sw:], words[sel]), f"scale words of the rows sent to rank {r}"
    assert bool((out[~written] == 0x5A).all()), "rows no token targets must be left as they are"
    assert bool((meta[:, :width - sw] == _SENTINEL).all()), "only the scale words may be written"
    assert bool((meta[~written] == _SENTINEL).all())


def test_ll_cast_send_bad_args(device):
    x = torch.zeros((4, 256), dtype=torch.bfloat16, device=device)
    slot = torch.zeros((4, 2), dtype=torch.int32, device=device)
    out = torch.zeros((8, 256), dtype=torch.float8_e4m3fn, device=device)
    meta = torch.zeros((8, 4), dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="x"):
        ll_cast_send(x.float(), slot, 4, False, False, out, meta)
    with pytest.raises(ValueError, match="out must be"):
        ll_cast_send(x, slot, 3, False, False, out, meta)
    with pytest.raises(ValueError, match="meta must be"):
        ll_cast_send(x, slot, 4, False, False, out, meta[:, :1])
    with pytest.raises(ValueError, match="send_slot"):
        ll_cast_send(x, slot[:3], 4, False, False, out, meta)


@pytest.mark.parametrize("num_local,num_ranks,cap,k,has_w,sf_words", CASES[:3])
def test_ll_pack_unpack_are_the_parts(device, num_local, num_ranks, cap, k, has_w, sf_words):
    """ll_pack is ll_send_meta then ll_cast_send, ll_unpack is ll_receive then the rows' scatter, bit for bit; each
    called twice (the second call replays its plan)."""
    from tritile.ep.ll import ll_pack, ll_unpack
    from tritile.ep.pack import scatter_rows_into

    g = torch.Generator().manual_seed(num_local * 31 + cap)
    tokens, hidden, rm = min(cap, 9), 256, num_ranks * cap
    idx = _routing(tokens, num_local * num_ranks, k, g, device)
    w = torch.rand((tokens, k), generator=g).to(device) if has_w else None
    x = (torch.randn((tokens, hidden), generator=g) * 3).to(torch.bfloat16).to(device)
    width = 1 + k + (k if has_w else 0) + 2
    for _ in range(2):
        metas = [torch.full((rm, width), _SENTINEL, dtype=torch.int32, device=device) for _ in range(2)]
        outs = [torch.full((rm, hidden), 0x5A, dtype=torch.uint8, device=device) for _ in range(2)]
        slot = ll_pack(idx, w, x, num_local * num_ranks, num_ranks, cap, False, False, metas[0],
                       outs[0].view(torch.float8_e4m3fn))
        want = ll_send_meta(idx, w, num_local * num_ranks, num_ranks, cap, metas[1])
        ll_cast_send(x, want, cap, False, False, outs[1].view(torch.float8_e4m3fn), metas[1])
        assert_equal(slot, want, "send_slot")
        assert_equal(metas[0], metas[1], "meta")
        assert_equal(outs[0], outs[1], "rows")

    meta = _meta(num_local, num_ranks, cap, k, has_w, sf_words, device)
    rows = torch.randint(0, 1 << 30, (rm, 6), dtype=torch.int32, generator=g).to(device)
    zeros = torch.zeros((k,), dtype=torch.int32, device=device)
    for _ in range(2):
        counts = [torch.empty((num_local,), dtype=torch.int32, device=device) for _ in range(2)]
        sfs = [_recv_sf(num_local, rm, sf_words, device) for _ in range(2)]
        slabs = [torch.zeros((num_local * rm, 6), dtype=torch.int32, device=device) for _ in range(2)]
        got = ll_unpack(meta, rows, k, has_w, sf_words, num_local, num_ranks, cap, counts[0], sfs[0], zeros, slabs[0])
        want = ll_receive(meta, k, has_w, sf_words, num_local, num_ranks, cap, counts[1], sfs[1])
        scatter_rows_into(rows, want[0], zeros, slabs[1])
        for name, a, b in zip(("pos", "src_info", "layout_range", "recv_weights"), got, want):
            assert_equal(a, b, name)
        assert_equal(counts[0], counts[1], "recv_count")
        assert_equal(slabs[0], slabs[1], "slab")
        if sfs[0] is not None:
            assert_equal(sfs[0], sfs[1], "recv_sf")
