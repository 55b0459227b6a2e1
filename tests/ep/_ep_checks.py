"""Checks run inside two ranks by ``test_elastic_multiproc.py`` (in its two-rank spawn, to spawn once):
arguments that differ across ranks, a rank that fails locally, bad FP8 scales, and DeepEP v1 surface that DeepEP's
own tests use (handle tuples, static ``capture``, ``internode_*``, the low-latency rank mask and two dispatches in
flight, the local buffer, the domain sizes).

Every cross-rank error must raise on every rank (the same ``ValueError`` for a mismatch; the failing rank's own
error there and :class:`tritile.ep.PeerFailure` naming it on the others) and leave the group usable.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist



def _same_everywhere(text: str) -> None:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, text)
    assert len(set(got)) == 1, got


def _raises_everywhere(fn, exc, match: str) -> None:
    with pytest.raises(exc, match=match) as info:
        fn()
    _same_everywhere(str(info.value))


def check_errors(rank, dev) -> None:
    from tritile.ep import Buffer, ElasticBuffer, PeerFailure
    from tritile.ep._dist import HEADER_WORDS

    buf = Buffer(None)
    ebuf = ElasticBuffer(None, num_max_tokens_per_rank=8)
    t, k, E = 6, 2, 8
    gen = torch.Generator().manual_seed(rank)
    idx = torch.rand((t, E), generator=gen).topk(k, dim=1).indices.to(dev)
    x = torch.randn((t, 128), generator=gen).to(torch.bfloat16).to(dev)

    # mismatches: the same ValueError on every rank (not a gloo abort)
    _raises_everywhere(lambda: buf.dispatch(x, topk_idx=idx, num_experts=4 if rank == 0 else 8), ValueError,
                       "num_experts")
    _raises_everywhere(lambda: ebuf.dispatch(x, topk_idx=idx, num_experts=4 if rank == 0 else 8), ValueError,
                       "num_experts")
    _raises_everywhere(lambda: ebuf.dispatch(x[:, :64 + 64 * rank], topk_idx=idx, num_experts=E), ValueError,
                       "hidden")
    _raises_everywhere(lambda: ebuf.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=8 + rank),
                       ValueError, "num_max_tokens_per_rank")
    _raises_everywhere(lambda: ebuf.engram_write(torch.zeros((4 + rank, 16), dtype=torch.bfloat16, device=dev)),
                       ValueError, "num_entries")

    # one rank fails locally: it raises its own error, the others a PeerFailure naming it
    def local(fail_rank, call, exc, match):
        if rank == fail_rank:
            with pytest.raises(exc, match=match):
                call(True)
        else:
            with pytest.raises(PeerFailure, match=f"rank {fail_rank} raised {exc.__name__}"):
                call(False)

    local(1, lambda bad: buf.dispatch(x, topk_idx=idx, num_experts=E + 1 if bad else E), ValueError, "num_experts")
    xt = torch.empty((128, t), dtype=torch.bfloat16, device=dev).t()
    local(1, lambda bad: ebuf.dispatch(xt if bad else x, topk_idx=idx, num_experts=E), ValueError, "x")
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    local(0, lambda bad: buf.combine(torch.cat([recv_x, recv_x[:1]]) if bad else recv_x, h), ValueError, "rows")
    ex, _, _, eh, _ = ebuf.dispatch(x, topk_idx=idx, num_experts=E)
    local(0, lambda bad: ebuf.combine(ex[:-1] if bad else ex, eh), ValueError, "rows")
    gone = Buffer(None)
    gone.destroy()
    local(1, lambda bad: (gone if bad else buf).dispatch(x, topk_idx=idx, num_experts=E), RuntimeError, "destroyed")
    ebuf.engram_write(torch.zeros((4, 16), dtype=torch.bfloat16, device=dev))
    local(0, lambda bad: ebuf.engram_fetch(torch.zeros((2,) if bad else (2, 1), dtype=torch.int32, device=dev)),
          ValueError, "indices")

    # FP8 scales must match the hidden size (one float32 per 128 channels, or packed UE8M0 of those)
    data = x.to(torch.float8_e4m3fn)
    for bad_sf in (torch.ones((t, 2), device=dev), torch.ones((t, 3), device=dev).t().contiguous().t()):
        with pytest.raises(ValueError, match=r"x\[1\]"):
            buf.dispatch((data, bad_sf), topk_idx=idx, num_experts=E)
    data256 = torch.cat([data, data], 1)
    with pytest.raises(ValueError, match=r"x\[1\]"):
        buf.dispatch((data256, torch.ones((t, 1), device=dev)), topk_idx=idx, num_experts=E)
    with pytest.raises(ValueError, match=r"x\[1\]"):
        buf.dispatch((data256, torch.ones((t, 2), dtype=torch.int32, device=dev)), topk_idx=idx, num_experts=E)
    ok = buf.dispatch((data256, torch.ones((t, 2), device=dev)), topk_idx=idx, num_experts=E)
    assert ok[0][1].shape == (ok[0][0].shape[0], 2)

    # the groups still work
    out = buf.dispatch(x, topk_idx=idx, num_experts=E)
    assert torch.equal(buf.combine(out[0], out[4])[0].float(), x.float() * out[4].is_token_in_rank.sum(1,
                                                                                             keepdim=True))
    ebuf.destroy()

    # no answer within num_cpu_timeout_secs: a RuntimeError naming the call (gloo; NCCL uses the group timeout)
    if dev.type == "cpu":
        group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
        late = ElasticBuffer(group, num_cpu_timeout_secs=2)
        if rank == 0:
            with pytest.raises(RuntimeError, match="dispatch.*timed out"):
                late.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=8)
        else:
            time.sleep(3)
            # join the header's all-gather late, so rank 0's timed-out collective completes: a gloo collective still
            # pending when its process exits aborts it ("terminate called without an active exception")
            words = HEADER_WORDS + 2
            dist.all_gather_into_tensor(torch.empty((2 * words,), dtype=torch.int64), torch.zeros((words,),
                                        dtype=torch.int64), group=group)
        dist.barrier()


def check_v1_surface(rank, world, dev) -> None:
    from tritile.ep import Buffer, EventOverlap, get_physical_domain_size

    assert Buffer.is_sm90_compiled() is True
    ev = Buffer.capture()
    assert isinstance(ev, EventOverlap)
    ev.current_stream_wait(release_handle=True)
    assert ev.event is None
    assert get_physical_domain_size(None) == (1, world)
    buf = Buffer(None, num_nvl_bytes=256)
    t, k, E = 5 + rank, 2, 4 * world
    gen = torch.Generator().manual_seed(10 + rank)
    idx = torch.rand((t, E), generator=gen).topk(k, dim=1).indices.to(dev)
    idx[0] = -1
    x = torch.randn((t, 64), generator=gen).to(torch.bfloat16).to(dev)
    per_rank, per_rdma, per_expert, is_in, _ = buf.get_dispatch_layout(idx, E)
    assert per_rdma.tolist() == [int(is_in.any(1).sum())]
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, num_experts=E, num_tokens_per_rank=per_rank,
                                         is_token_in_rank=is_in, num_tokens_per_expert=per_expert)
    # DeepEP's intranode handle tuple
    rpm, cpm, rcpm, src, in_rank, head = h
    assert len(h) == 6 and torch.equal(h[0], h.rank_prefix_matrix) and torch.equal(rpm, h.rank_prefix_matrix)
    assert torch.equal(src, h.recv_src_idx) and in_rank is h.is_token_in_rank and head is h.send_slot
    assert cpm.flatten().tolist() == per_rank.tolist()
    col = rpm[:, rank].tolist()
    assert rcpm.flatten().tolist() == [0] + col[:-1] and col[-1] == recv_x.shape[0]
    # internode entry points: the same engine
    ix = buf.internode_dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank,
                                is_token_in_rank=is_in, num_tokens_per_expert=per_expert)
    assert torch.equal(ix[0], recv_x)
    assert torch.equal(buf.internode_combine(recv_x, ix[4])[0], buf.combine(recv_x, h)[0])
    # the local buffer: plain device memory, viewed
    t32 = buf.get_local_buffer_tensor(torch.int32, torch.Size((4, 8)), offset=4)
    t32.fill_(7)
    assert buf.get_local_buffer_tensor(torch.int32)[4:36].eq(7).all()
    with pytest.raises(ValueError, match="size"):
        buf.get_local_buffer_tensor(torch.int32, torch.Size((100,)))
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        buf.get_local_buffer_tensor(torch.int32, use_rdma_buffer=True)
    # low-latency rank mask: slots of the masked rank are dropped, the same bits as routing without them; then
    # another rank masked (the routing must follow the new mask, not the first one's cached table)
    M, per = 8, E // world
    status = torch.empty((world,), dtype=torch.int32, device=dev)
    w = torch.rand((t, k), generator=gen).to(dev)
    for masked in dict.fromkeys((world - 1, 0)):
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_update_mask_buffer(masked, True)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(r == masked) for r in range(world)]
        mx, mcount, mh, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        y = torch.randn(mx.shape, generator=gen).to(torch.bfloat16).to(dev)
        mout = buf.low_latency_combine(y, idx, w, mh)[0]
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
        if rank == masked:
            plain_idx = torch.full_like(idx, -1)
        else:
            plain_idx = torch.where((idx >= masked * per) & (idx < (masked + 1) * per), -1, idx)
        px, pcount, ph, _, _ = buf.low_latency_dispatch(x, plain_idx, M, E, use_fp8=False)
        assert torch.equal(mcount, pcount), (masked, mcount.tolist(), pcount.tolist())
        if rank == masked:
            assert mcount.sum() == 0
        for e in range(per):
            c = int(pcount[e])
            assert torch.equal(mx[e, :c], px[e, :c])
        assert torch.equal(mout, buf.low_latency_combine(y, plain_idx, w, ph)[0])
    # two low-latency dispatches in flight behind their hooks (reused internal buffers alternate per call)
    x2 = torch.randn(x.shape, generator=gen).to(torch.bfloat16).to(dev)
    first = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    second = buf.low_latency_dispatch(x2, idx, M, E, use_fp8=False, return_recv_hook=True)
    second[4]()
    first[4]()
    for got, src in ((first, x), (second, x2)):
        want = buf.low_latency_dispatch(src, idx, M, E, use_fp8=False)
        assert torch.equal(got[1], want[1])
        for e in range(per):
            c = int(want[1][e])
            assert torch.equal(got[0][e, :c], want[0][e, :c])
    buf.destroy()
