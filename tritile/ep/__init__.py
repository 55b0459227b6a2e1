"""tritile.ep: expert-parallel dispatch / combine with DeepEP v1's API, on torch.distributed.

``tritile.ep.Buffer(group)`` offers DeepEP v1's methods and return tuples: ``get_dispatch_layout``, ``dispatch``
(also cached, through ``handle=``), ``combine``, ``low_latency_dispatch`` / ``low_latency_combine``,
``get_next_low_latency_combine_buffer``, ``capture``, ``get_comm_stream``, ``destroy``; plus ``EPHandle``,
``LowLatencyHandle``, ``EventOverlap``, ``Config`` (advisory) and ``topk_idx_t``.

Engine
    NCCL groups (CUDA tensors) or gloo groups (CPU tensors); ranks come from ``torchrun`` or
    ``torch.multiprocessing``.  A high-throughput dispatch is: a Triton layout pass (rank mask, counts, send
    slots), one small ``all_to_all_single`` of counts plus a header (the only host sync), a Triton pack, one
    ``all_to_all_single`` for the rows (received straight into ``recv_x``) and one for per-row metadata
    (source token, local expert ids, weights, scales), then a Triton unpack.  Combine is one or two reverse
    ``all_to_all_single`` calls and a Triton reduction.  Every payload travels as bytes.  No NVSHMEM, no custom
    transport.  Kernels: :mod:`.layout`, :mod:`.pack`, :mod:`.reduce`, :mod:`.ll`; pure-torch twins and the
    ``all_to_all_single`` reference in :mod:`.ref`.  CPU tensors run the same kernels under the Triton interpreter
    (``TRITON_INTERPRET=1``), or the twins without it.

Contract (stricter than DeepEP)
    * A token goes once to each rank that owns at least one of its experts; ``recv_topk_idx`` holds local expert
      ids (``e - rank * L``) and ``-1`` elsewhere; ``recv_topk_weights`` is 0 at ``-1`` slots.
    * Received rows are ordered by ascending source rank, then ascending source token (expand mode: the same
      order inside each expert segment; segments start at ``expert_alignment``-aligned offsets; padding rows are
      zero).
    * ``num_recv_tokens_per_expert_list`` is aligned (v1); the handle also carries device psums and unaligned
      counts (v2).
    * Combine = ``bf16(f32(bias0) + f32(bias1) + sum over destination ranks in ascending rank order of f32(row))``
      (expand mode first sums each token's local rows in top-k slot order, one bf16 rounding per rank); combined
      weights are summed the same way, so they equal the original weights.  Bit-exact against
      :func:`tritile.ep.ref.combine_reference` and reproducible run to run.
    * Low-latency combine is weighted (``sum_j w[t, j] * y``), float32 accumulation.

Arguments
    DeepEP-only arguments that cannot apply are accepted and ignored: ``num_nvl_bytes``, ``num_rdma_bytes``,
    ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``num_tokens_per_rdma_rank``,
    ``config`` / ``Config`` (SM counts and chunk sizes), ``Buffer.set_num_sms``.  Unsupported ones that would
    change results raise ``ValueError``: ``enable_shrink``, ``use_logfmt``, the ``*_wait_recv_cost_stats`` tensors.
    ``low_latency_dispatch(return_recv_hook=True)`` issues the exchange asynchronously and returns a hook that
    waits for it and places the rows: an "async hook", **not zero-SM** (NCCL kernels run on SMs while the exchange
    is in flight).  ``low_latency_combine``'s hook is a no-op (the combine has completed on its stream).

Low-latency path
    Fixed capacity ``M`` rows per (source, destination) pair, equal splits, no host sync, no host-to-device copy:
    capturable in a CUDA graph (after one eager warm-up call).  Rows are deduplicated per rank (DeepEP's LL sends
    one copy per (token, expert)).  Output slabs ``(L, R*M, H)`` with rows in ascending source rank / token order.

Async model
    On CUDA every call runs on the buffer's communication stream after waiting on ``previous_event`` (or the
    current stream); ``async_finish=False`` makes the current stream wait before returning, else wait on the
    returned :class:`EventOverlap` (``event.current_stream_wait()`` or ``with event:``).  On the CPU these are
    no-ops with the same return types.

Errors and timeouts
    Arguments are checked locally before any collective.  Uncached dispatch exchanges a header with the counts,
    so mismatched hidden sizes, dtypes, top-k, expert counts or expert ids outside ``[-1, E)`` raise the same
    ``ValueError`` on every rank.  With ``Buffer(peer_checks=True)`` (the default) combine, cached dispatch and
    the low-latency calls exchange the header too (one extra tiny collective and a host sync) and
    ``num_worst_tokens`` dispatch syncs on its header; never during CUDA-graph capture.  ``peer_checks=False``
    makes those paths sync-free; mismatched arguments are then undefined behaviour of the collective.  Sync-free
    paths drop expert ids outside ``[-1, E)`` (``TRITILE_CHECKS=1`` raises).  Collectives use the process
    group's timeout: create groups with a short one (e.g. 60 s) so that a rank that fails makes the others raise
    instead of hanging.

Autograd (MoE layers)
    The backward of ``dispatch`` is ``combine`` of the gradient of ``recv_x`` (and of ``recv_topk_weights`` through
    ``combine``'s ``topk_weights``), with the same handle; the backward of ``combine`` is a cached ``dispatch`` of
    the gradient of ``combined_x`` (``dispatch(grad, handle=handle)``), which in expand mode returns one copy per
    expanded row, exactly the gradient of the pre-reduction.

Benchmark hooks
    ``Buffer.phase_hook`` (None or ``name -> context manager``) wraps each phase of a call (``layout``, ``notify``,
    ``pack``, ``exchange``, ``unpack``, ``expand``, ``prereduce``, ``reduce``), e.g. with CUDA-event timers.
    ``Buffer(peer_checks=False)`` removes the header checks' extra collective and host sync (measure with it off).
"""

from ._dist import (EventHandle, EventOverlap, PeerFailure, get_logical_domain_size,  # noqa: F401
                    get_physical_domain_size)
from .buffer import Buffer, Config, DispatchHandle, LowLatencyHandle, topk_idx_t  # noqa: F401
from .elastic import ElasticBuffer, EPHandle  # noqa: F401

__all__ = ["Buffer", "ElasticBuffer", "Config", "EPHandle", "DispatchHandle", "LowLatencyHandle", "EventOverlap",
           "EventHandle", "PeerFailure", "topk_idx_t", "get_physical_domain_size", "get_logical_domain_size"]
