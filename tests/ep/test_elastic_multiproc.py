"""tritile.ep.ElasticBuffer (DeepEP v2's API) across processes: gloo ranks on the CPU, NCCL ranks on GPUs; with two
ranks also the cross-rank errors and the DeepEP v1 surface of ``_ep_checks.py``.

One spawn per world size runs every check inside.  Dispatch is compared bit for bit with
:func:`tritile.ep.ref.dispatch_reference` (``all_to_all_single`` of rows); combine with a reference written here
from ``all_to_all_single`` that sums in DeepEP v2's order (bias, then each rank's partial at its last top-k slot);
Engram, PP and AGRS with ``all_gather`` references.  Ranks hold different token counts, rank 0 none at all, and
one routing sends nothing to the last rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist_utils import can_run, spawn, use_nccl

WORLDS = (2, 3, 4)


def _eq(a, b, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a is None} vs {b is None}"
        return
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    a, b = a.flatten(), b.flatten()  # (contiguous, even when empty with odd strides)
    if a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a.cpu(), b.cpu()), f"{what}: values differ"


def _fmt_eq(a, b, what: str) -> None:
    if isinstance(a, tuple):
        _eq(a[0], b[0], what + "[0]")
        _eq(a[1], b[1], what + "[1]")
    else:
        _eq(a, b, what)


def _routing(kind: str, t: int, k: int, num_experts: int, world: int, gen, dev) -> torch.Tensor:
    per = num_experts // world
    scores = torch.rand((t, num_experts), generator=gen)
    if kind == "no_last":  # nothing for the last rank
        scores[:, (world - 1) * per:] = -1.0
    idx = scores.topk(k, dim=1).indices
    if kind == "masked":
        idx[torch.rand((t, k), generator=gen) < 0.3] = -1
        idx[::4] = -1
    return idx.to(dev)


def _payload(t: int, hidden: int, fmt: str, gen, dev):
    x = torch.randn((t, hidden), generator=gen).to(torch.bfloat16)
    if fmt == "bf16":
        return x.to(dev)
    data = (torch.randn((t, hidden), generator=gen) * 8).to(torch.float8_e4m3fn)
    if fmt == "fp8":
        sf = torch.rand(((hidden + 127) // 128, t), generator=gen).t()  # column-major, as DeepEP's tests
        return data.to(dev), sf.to(dev)
    sf = torch.randint(100, 150, (t, 3 * 4), generator=gen, dtype=torch.int32).to(torch.uint8)  # 3 opaque packs
    return data.to(dev), sf.view(torch.int32).to(dev)


def _combine_v2_ref(y, rh, topk_idx, per: int, bias=None):
    """DeepEP v2's combine, from ``all_to_all_single``: ``y`` ``(N, H)`` in the reference receive order goes back;
    per token ``f32(bias0) + f32(bias1)``, then each rank's row in the order of that rank's last top-k slot."""
    from tritile.ep.ref import _a2a

    world = dist.get_world_size()
    t, k = topk_idx.shape
    hidden = y.shape[1]
    s = sum(rh["send_counts"])
    back = _a2a(y, s, rh["send_counts"], rh["recv_counts"], None).view(torch.bfloat16).reshape(s, hidden)
    rows = torch.zeros((t, world, hidden), dtype=torch.float32, device=y.device)
    has = torch.zeros((t, world), dtype=torch.bool, device=y.device)
    off = 0
    for r, tok in enumerate(rh["send_tokens"]):
        c = rh["send_counts"][r]
        rows[tok, r] = back[off:off + c].float()
        has[tok, r] = True
        off += c
    b0, b1 = (bias, None) if bias is None or isinstance(bias, torch.Tensor) else bias
    acc = torch.zeros((t, hidden), dtype=torch.float32, device=y.device)
    if b0 is not None:
        acc = acc + b0.float()
    if b1 is not None:
        acc = acc + b1.float()
    owner = torch.where(topk_idx >= 0, torch.div(topk_idx, per, rounding_mode="floor"), -1)
    for j in range(k):  # rank r's partial sits at its last slot
        later = (owner[:, j + 1:] == owner[:, j:j + 1]).any(1) if j + 1 < k else torch.zeros_like(owner[:, 0],
                                                                                                 dtype=torch.bool)
        sel = (owner[:, j] >= 0) & ~later
        r = owner[sel, j]
        tok = sel.nonzero().flatten()
        acc[tok] = acc[tok] + rows[tok, r]
    return acc.to(torch.bfloat16)


def _check_dispatch_combine(buf, rank, world, dev, gen, t, hidden, num_experts, k, kind, fmt, alignment, sync,
                            M) -> None:
    from tritile.ep import ref

    per = num_experts // world
    idx = _routing(kind, t, k, num_experts, world, gen, dev)
    w = torch.rand((t, k), generator=gen).to(dev)
    x = _payload(t, hidden, fmt, gen, dev)
    ref_x, ref_idx, ref_w, ref_lst, rh = ref.dispatch_reference(x, idx, w, num_experts, expert_alignment=alignment)
    n = int(sum(rh["recv_counts"]))
    stats = torch.full((per,), 3, dtype=torch.int32, device=dev)
    recv_x, recv_idx, recv_w, h, ev = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, cumulative_local_expert_recv_stats=stats, num_experts=num_experts,
        num_max_tokens_per_rank=M, expert_alignment=alignment, do_cpu_sync=sync, async_with_compute_stream=True)
    ev.current_stream_wait()
    rows = n if sync else world * M
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    assert data.shape[0] == rows and h.num_recv_tokens == rows
    cut = (lambda v: v) if sync else (lambda v: v[:n])
    _fmt_eq(tuple(cut(v) for v in recv_x) if isinstance(recv_x, tuple) else cut(recv_x), ref_x, "recv_x")
    _eq(cut(recv_idx), ref_idx, "recv_topk_idx")
    _eq(cut(recv_w), ref_w, "recv_topk_weights")
    if not sync:
        assert bool((recv_idx[n:] == -1).all()) and bool((recv_w[n:] == 0).all())
    assert h.num_recv_tokens_per_expert_list == (ref_lst if sync else [])
    assert (stats - 3).tolist() == rh["num_recv_tokens_per_expert"], "cumulative_local_expert_recv_stats"
    psum_rank = h.psum_num_recv_tokens_per_scaleup_rank.tolist()
    want = [sum(rh["recv_counts"][:i + 1]) for i in range(world)]
    assert psum_rank == want, (psum_rank, want)
    meta = h.recv_src_metadata
    assert meta.dtype == torch.int32 and tuple(meta.shape) == (rows, 2 + k)
    src_global = h._core.recv_src_global[:n]
    _eq(meta[:n, 0], src_global.to(torch.int32), "recv_src_metadata[:, 0]")
    want_global = rh["recv_src_rank"].long() * M + rh["recv_src_idx"].long()
    _eq(src_global, want_global, "source global ids")
    assert bool((src_global.sort().values == src_global).all()), "rows not in source-global order"
    last = torch.where(ref_idx >= 0, torch.arange(k, device=dev), -1).amax(1) if n else ref_idx[:, 0]
    _eq(meta[:n, 1], (rh["recv_src_rank"] * k + last).to(torch.int32), "recv_src_metadata[:, 1]")
    psum = [0] + h.psum_num_recv_tokens_per_expert.tolist()
    aligned = [((c + alignment - 1) // alignment) * alignment for c in rh["num_recv_tokens_per_expert"]]
    assert [b - a for a, b in zip(psum, psum[1:])] == aligned
    _eq(h.num_unaligned_recv_tokens_per_expert,
        torch.tensor(rh["num_recv_tokens_per_expert"], dtype=torch.int32, device=dev), "unaligned counts")
    # dst_buffer_slot_idx: the row of each (token, slot) in its destination's block
    dst = h.dst_buffer_slot_idx
    owner = torch.where(idx >= 0, idx // per, -1)
    for r in range(world):
        tok = rh["send_tokens"][r]
        sel = owner[tok] == r
        if sel.any():
            base = sum(rh["send_counts"][:r]) if sync else r * M
            pos = torch.arange(tok.numel(), device=dev)[:, None].expand_as(sel)[sel] + base
            _eq(dst[tok][sel], pos.to(torch.int32), f"dst_buffer_slot_idx (rank {r})")
    assert bool((dst[idx < 0] == -1).all())
    assert h.topk_idx is not idx and torch.equal(h.topk_idx, idx)

    # cached dispatch: the same rows, with and without weights
    c_x, c_idx, c_w, c_h, _ = buf.dispatch(x, handle=h)
    _fmt_eq(c_x, recv_x, "recv_x (cached)")
    _eq(c_idx, recv_idx, "recv_topk_idx (cached)")
    assert c_w is None and c_h is h
    _eq(buf.dispatch(x, handle=h, topk_weights=w)[2], recv_w, "recv_topk_weights (cached)")

    # combine: DeepEP v2's reduction order, bit for bit, with 0, 1 and 2 biases; weights come back unchanged
    y = torch.randn((rows, hidden), generator=gen).to(torch.bfloat16).to(dev)
    for nb in (0, 1, 2):
        biases = [torch.randn((t, hidden), generator=gen).to(torch.bfloat16).to(dev) for _ in range(nb)]
        bias = None if nb == 0 else (biases[0] if nb == 1 else tuple(biases))
        cx, cw, _ = buf.combine(y, h, topk_weights=recv_w, bias=bias)
        _eq(cx, _combine_v2_ref(y[:n], rh, idx, per, bias), f"combined_x ({nb} bias)")
        _eq(cw, torch.where(idx >= 0, w, 0.0), "combined_topk_weights")
    # garbage in the weights of other ranks' slots is ignored
    noisy = torch.where(recv_idx >= 0, recv_w, torch.full_like(recv_w, 7.0))
    _eq(buf.combine(y, h, topk_weights=noisy)[1], torch.where(idx >= 0, w, 0.0), "weights from the owning rank")

    # expand mode: segments per expert, aligned, padding zero; rows and weights where the metadata says
    e_x, e_idx, e_w, eh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts,
                                          num_max_tokens_per_rank=M, expert_alignment=alignment, do_cpu_sync=sync,
                                          do_expand=True, do_zero_padding=True, use_tma_aligned_col_major_sf=True)
    assert e_idx is None
    edata = e_x[0] if isinstance(e_x, tuple) else e_x
    assert edata.shape[0] == eh.num_expanded_tokens
    if sync:
        assert eh.num_expanded_tokens == sum(aligned) and eh.num_recv_tokens_per_expert_list == aligned
    else:
        assert eh.num_expanded_tokens == -(-(world * M * min(k, per) + (alignment - 1) * per) // alignment) * \
            alignment
    pos = eh.recv_src_metadata[:n, 2:]
    valid = pos >= 0
    _eq(valid, ref_idx >= 0, "expanded slots")
    rrows = torch.arange(n, device=dev)[:, None].expand_as(valid)[valid]
    rdata = ref_x[0] if isinstance(ref_x, tuple) else ref_x
    _eq(edata[pos[valid].long()], rdata[rrows], "expanded rows")
    _eq(e_w[pos[valid].long()], ref_w[valid], "expanded weights")
    if isinstance(e_x, tuple):
        n_e = edata.shape[0]
        assert e_x[1].stride() == (1, -(-max(n_e, 1) // 4) * 4) or n_e <= 1, e_x[1].stride()
        _eq(e_x[1][pos[valid].long()], ref_x[1][rrows], "expanded scales")
    ps = [0] + eh.psum_num_recv_tokens_per_expert.tolist()
    for i in range(per):  # expert i: [align(psum[i-1]), psum[i]) holds its rows in receive order
        start = -(-ps[i] // alignment) * alignment
        seg = pos[ref_idx == i]
        assert seg.tolist() == list(range(start, start + seg.numel())) and ps[i + 1] == start + seg.numel()
    filled = torch.zeros(edata.shape[0], dtype=torch.bool, device=dev)
    filled[pos[valid].long()] = True
    assert bool((edata.view(torch.uint8)[~filled] == 0).all()) and bool((e_w[~filled] == 0).all())
    ce_x, _, ce_w, _, _ = buf.dispatch(x, handle=eh, topk_weights=w, do_expand=True, do_zero_padding=True,
                                       use_tma_aligned_col_major_sf=True)
    _fmt_eq(ce_x, e_x, "cached expand")
    _eq(ce_w, e_w, "cached expand weights")
    # expand combine with local reduction: slot-order float32 sum per rank, one rounding, then v2's order
    ye = torch.randn((edata.shape[0], hidden), generator=gen).to(torch.bfloat16).to(dev)
    pre = torch.zeros((n, hidden), dtype=torch.float32, device=dev)
    for j in range(k):
        ok = pos[:, j] >= 0
        pre[ok] = pre[ok] + ye[pos[ok, j].long()].float()
    bias = torch.randn((t, hidden), generator=gen).to(torch.bfloat16).to(dev)
    ecx, ecw, _ = buf.combine(ye, eh, topk_weights=e_w, bias=bias)
    _eq(ecx, _combine_v2_ref(pre.to(torch.bfloat16), rh, idx, per, bias), "combined_x (expand)")
    _eq(ecw, torch.where(idx >= 0, w, 0.0), "combined weights (expand)")
    return eh, ye, pos, n, rh, idx, bias


def _check_no_multiple_reduction(world, dev, gen, eh, ye, pos, n, rh, idx, bias, hidden, k) -> None:
    """Expand combine with ``allow_multiple_reduction=False``: every (token, slot) row comes back; the sum runs
    over the slots in order (float32, one rounding)."""
    from tritile.ep import ElasticBuffer
    from tritile.ep.ref import _a2a

    buf = ElasticBuffer(None, allow_multiple_reduction=False)
    t = idx.shape[0]
    send = torch.zeros((n, k, hidden), dtype=torch.bfloat16, device=dev)
    ok = pos >= 0
    send[ok] = ye[pos[ok].long()]
    s = sum(rh["send_counts"])
    back = _a2a(send.view(n, -1), s, rh["send_counts"], rh["recv_counts"], None).view(torch.bfloat16).reshape(
        s, k, hidden)
    per_rank = torch.zeros((t, world, k, hidden), dtype=torch.bfloat16, device=dev)
    off = 0
    for r, tok in enumerate(rh["send_tokens"]):
        c = rh["send_counts"][r]
        per_rank[tok, r] = back[off:off + c]
        off += c
    per = eh.num_experts // world
    owner = torch.where(idx >= 0, idx // per, 0)
    acc = bias.float().clone()
    for j in range(k):
        v = per_rank[torch.arange(t, device=dev), owner[:, j], j].float()
        acc = torch.where((idx[:, j] >= 0)[:, None], acc + v, acc)
    with pytest.raises(ValueError, match="allow_multiple_reduction"):
        buf.combine(ye, eh, topk_weights=torch.zeros(ye.shape[0], device=dev), bias=bias)
    _eq(buf.combine(ye, eh, bias=bias)[0], acc.to(torch.bfloat16), "combined_x (no multiple reduction)")
    buf.destroy()


def _check_engram(buf, rank, world, dev, gen, fp8: bool) -> None:
    entries, hidden = 6, 256
    local = torch.randn((entries, hidden), generator=gen).to(torch.bfloat16)
    sf = None
    if fp8:
        local = (local.float() * 4).to(torch.float8_e4m3fn)
        sf = torch.rand((world * entries, 2), generator=torch.Generator().manual_seed(5))  # replicated
    buf.engram_write(local.to(dev), sf=None if sf is None else sf.to(dev))
    table = torch.empty((world * entries, hidden), dtype=local.dtype, device=dev)
    dist.all_gather_into_tensor(table.view(torch.uint8), local.to(dev).view(torch.uint8))
    t = 0 if rank == 1 else 3 + rank
    indices = torch.randint(0, world * entries, (t, 3), generator=gen, dtype=torch.int32).to(dev)
    for col_major in (False, True):
        data, got_sf = buf.engram_fetch(indices, use_tma_aligned_col_major_sf=col_major)()
        _eq(data, table[indices.reshape(-1).long()].reshape(t, 3 * hidden), "engram data")
        if fp8:
            _eq(got_sf.contiguous(), sf.to(dev)[indices.reshape(-1).long()].reshape(t, 3 * 2), "engram scales")
            if col_major and t > 1:
                assert got_sf.stride()[0] == 1
        else:
            assert got_sf is None
    with pytest.raises(ValueError, match="indices"):
        bad = indices.clone() if rank != world - 1 else torch.full((2, 3), world * entries, dtype=torch.int32,
                                                                    device=dev)
        buf.engram_fetch(bad)


def _check_pp(buf, rank, world, dev, gen) -> None:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf.pp_set_config(64 * 4, 3)
    mine = [torch.randn((4, 16), generator=torch.Generator().manual_seed(100 * rank + i)).to(dev) for i in range(3)]
    for m in mine:  # three sends in flight before any receive
        buf.pp_send(m, nxt)
    for i in range(3):
        got = torch.empty((4, 16), device=dev)
        buf.pp_recv(got, prv)
        _eq(got, torch.randn((4, 16), generator=torch.Generator().manual_seed(100 * prv + i)).to(dev), "pp_recv")
    with pytest.raises(ValueError, match="dst_rank_idx"):
        buf.pp_send(mine[0], (rank + 2) % world if world > 3 else world + 5)
    with pytest.raises(ValueError, match="num_max_tensor_bytes"):
        buf.pp_send(torch.zeros((100, 16), device=dev), nxt)


def _check_agrs(buf, rank, world, dev, gen) -> None:
    shapes = [(3, 5), (7,)]
    nbytes = buf.get_agrs_num_max_session_bytes(None, shapes, torch.bfloat16) * 2
    assert nbytes == 2 * sum(-(-world * s * 2 // 32) * 32 for s in (15, 7))
    buf.agrs_set_config(buf.get_agrs_buffer_size_hint(None, nbytes), 4)
    mk = [[torch.randn(s, generator=torch.Generator().manual_seed(31 * r + i)).to(torch.bfloat16).to(dev)
           for i, s in enumerate(shapes)] for r in range(world)]
    with buf.agrs_new_session():
        g0, g1, hook = buf.all_gather(mk[rank])
        ip = buf.agrs_get_inplace_tensor(shapes, torch.bfloat16)
        for a, b in zip(ip, mk[rank]):
            a.copy_(b)
        h0, hook2 = buf.all_gather(ip[0])
        h1, hook3 = buf.all_gather(ip[1])
        hook3()
        hook()
        hook2()
        for i, (g, h) in enumerate(((g0, h0), (g1, h1))):
            want = torch.stack([mk[r][i] for r in range(world)])
            _eq(g, want, f"all_gather {i}")
            _eq(h, want, f"all_gather in place {i}")
        with pytest.raises(ValueError, match="num_max_all_gathers_per_session"):
            buf.all_gather(mk[rank][0])
    with pytest.raises(ValueError, match="session"):
        buf.all_gather(mk[rank][0])
    # reduce-scatter: float32 sum in ascending rank order, one rounding
    parts = [torch.randn((world, 6), generator=torch.Generator().manual_seed(7 * r)).to(torch.bfloat16)
             for r in range(world)]
    with buf.agrs_new_session():
        out, hook = buf.reduce_scatter(parts[rank].to(dev))
        hook()
    acc = torch.zeros(6)
    for r in range(world):
        acc = acc + parts[r][rank].float()
    _eq(out, acc.to(torch.bfloat16).to(dev), "reduce_scatter")
    # the same total bytes split differently on two ranks: a ValueError on every rank, not a backend abort
    swap = rank == world - 1
    with buf.agrs_new_session():
        with pytest.raises(ValueError, match="per-tensor bytes"):
            buf.all_gather([torch.ones((2 if swap else 4,), device=dev), torch.ones((4 if swap else 2,), device=dev)])
        with pytest.raises(ValueError, match="per-tensor bytes"):
            buf.reduce_scatter([torch.ones((world, 2 if swap else 4), device=dev),
                                torch.ones((world, 4 if swap else 2), device=dev)])
        # a bad in-place shape raises before allocating: the session stays as it was
        with pytest.raises(ValueError, match="shapes"):
            buf.agrs_get_inplace_tensor((-2, 3), torch.float32)
        t = buf.agrs_get_inplace_tensor((4,), torch.float32)
        t.fill_(rank)
        g, hook = buf.all_gather(t)
        hook()
        _eq(g, torch.arange(world, dtype=torch.float32, device=dev)[:, None].expand(world, 4), "in-place gather")


def _check_misc(buf, rank, world, dev) -> None:
    from tritile.ep import ElasticBuffer, EventHandle, EventOverlap, get_logical_domain_size, get_physical_domain_size

    assert buf.get_logical_domain_size() == (1, world) == get_logical_domain_size(None)
    assert buf.get_physical_domain_size() == get_physical_domain_size(None) == (1, world)  # one host
    ev = ElasticBuffer.capture()
    assert isinstance(ev, EventHandle)
    ov = EventOverlap(ev)
    seen = []
    ov.register_hook_after_wait(lambda: seen.append(1))
    with pytest.raises(ValueError, match="hook"):
        ov.register_hook_after_wait(lambda: None)
    with ov(release_handle=True):
        pass
    assert seen == [1] and ov.event is None
    buf.barrier()
    buf.barrier(use_comm_stream=False, with_cpu_sync=True)
    assert ElasticBuffer.get_engram_storage_size_hint(1000, 128, 64) == (2 << 20, 2 << 20)
    assert ElasticBuffer.get_pp_buffer_size_hint(1000, 4) == 2 << 20
    assert ElasticBuffer.get_buffer_size_hint(None, 4096, 7168, 8) % (2 << 20) == 0
    sms = buf.get_theoretical_num_sms(48 * world, 8)
    assert sms % 2 == 0 and 4 <= sms
    assert buf.get_theoretical_num_qps(sms) <= buf.num_allocated_qps
    with pytest.raises(ValueError, match="num_topk"):
        buf.get_theoretical_num_sms(48 * world, 0)


def _worker(rank: int, world: int, seed: int) -> None:
    from tritile.ep import ElasticBuffer
    from tritile.testing import pick

    dev = torch.device("cuda", rank) if use_nccl() else torch.device("cpu")
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    gpu = pick(cpu=False, gpu=True)
    M = pick(cpu=12, gpu=512)
    buf = ElasticBuffer(None, num_max_tokens_per_rank=M, explicitly_destroy=True)
    t = 0 if rank == 0 else M - rank  # uneven, and an empty rank
    cases = [
        # hidden, experts, k, routing, format, alignment, sync
        (pick(cpu=64, gpu=7168), 2 * world, 3, "masked", "bf16", 4, True),
        (pick(cpu=256, gpu=7168), 4 * world, 3, "no_last", "fp8", 1, False),
        (pick(cpu=128, gpu=2048), 2 * world, 2, "balanced", "packs", 2, True),
    ]
    if not gpu and world > 2:
        cases = cases[world - 3:world - 2]
    last = None
    for hidden, experts, k, kind, fmt, a, sync in cases:
        last = _check_dispatch_combine(buf, rank, world, dev, gen, t, hidden, experts, k, kind, fmt, a, sync, M)
        last = last + (hidden, k)
    if gpu or world == 2:
        eh, ye, pos, n, rh, idx, bias, hidden, k = last
        _check_no_multiple_reduction(world, dev, gen, eh, ye, pos, n, rh, idx, bias, hidden, k)
    _check_engram(buf, rank, world, dev, gen, fp8=(world != 3))
    _check_pp(buf, rank, world, dev, gen)
    _check_agrs(buf, rank, world, dev, gen)
    _check_misc(buf, rank, world, dev)
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.barrier()
    if world == 2:
        from _ep_checks import check_errors, check_v1_surface

        check_v1_surface(rank, world, dev)
        check_errors(rank, dev)


@pytest.mark.parametrize("world", WORLDS)
def test_elastic_multiproc(world):
    """Every check of the module docstring with ``world`` ranks.  On the CPU two ranks run the Triton kernels under
    the interpreter; three and four ranks (one case each) run tritile.ep's pure-torch twins of them, to keep the
    suite's time (the twins are checked against the kernels in tests/ep/test_{layout,pack,reduce,ll}.py)."""
    if not can_run(world):
        pytest.skip(f"needs {world} GPUs for NCCL ranks, found {torch.cuda.device_count()}")
    twins = not use_nccl() and world > 2
    spawn(_worker, world, world, env={"TRITON_INTERPRET": "0"} if twins else None)
