"""tritile.ep: expert-parallel dispatch / combine with DeepEP's APIs (v1 ``Buffer``, v2 ``ElasticBuffer``), on
torch.distributed.

``tritile.ep.Buffer(group)`` offers DeepEP v1's methods and return tuples: ``get_dispatch_layout``, ``dispatch``
(also cached, through ``handle=``), ``combine``, ``internode_dispatch`` / ``internode_combine`` (the same engine),
``low_latency_dispatch`` / ``low_latency_combine``, ``get_next_low_latency_combine_buffer``, the low-latency rank
mask calls, ``get_local_buffer_tensor``, static ``capture`` and ``is_sm90_compiled``, ``get_comm_stream``,
``destroy``.  ``tritile.ep.ElasticBuffer(group)`` offers DeepEP v2's: ``dispatch`` / ``combine`` with an
:class:`EPHandle`, ``engram_write`` / ``engram_fetch``, ``pp_set_config`` / ``pp_send`` / ``pp_recv``, the AGRS
session calls and ``all_gather`` (plus a deterministic ``reduce_scatter``), ``barrier``, the size hints, the
domain sizes and the (advisory) analytical SM / QP counts.  Also exported: ``DispatchHandle`` (v1's handle,
indexable as DeepEP's tuple), ``LowLatencyHandle``, ``EventOverlap``, ``EventHandle``, ``Config`` (advisory),
``PeerFailure``, ``topk_idx_t``, ``get_physical_domain_size`` and ``get_logical_domain_size``.  ``docs/EP.md``
lists what differs from DeepEP, call by call.

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
    * ``ElasticBuffer.combine`` sums in DeepEP v2's reference order instead: the biases, then each destination
      rank's row in the order of that rank's last top-k slot (bit-exact against DeepEP's ``refs.combine``).
    * Low-latency combine is weighted (``sum_j w[t, j] * y``), float32 accumulation.

Arguments
    DeepEP-only arguments that cannot apply are accepted and ignored: ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``num_tokens_per_rdma_rank``, ``config`` / ``Config``
    (SM counts and chunk sizes), ``Buffer.set_num_sms``, v2's ``num_sms`` / ``num_qps`` / buffer sizes (checked).
    ``num_nvl_bytes`` / ``num_rdma_bytes`` only size ``get_local_buffer_tensor``'s scratch memory.  Unsupported
    ones that would change results raise ``ValueError``: ``comm``, ``use_logfmt``, the ``*_wait_recv_cost_stats``
    tensors.
    ``low_latency_dispatch(return_recv_hook=True)`` issues the exchange asynchronously and returns a hook that
    waits for it and places the rows: an "async hook", **not zero-SM** (NCCL kernels run on SMs while the exchange
    is in flight).  ``low_latency_combine``'s hook is a no-op (the combine has completed on its stream).

Low-latency path
    Fixed capacity ``M`` rows per (source, destination) pair, equal splits, no host sync (without peer checks), no
    host-to-device copy, staging buffers reused across calls: capturable in a CUDA graph (after one eager warm-up
    call).  Rows are deduplicated per rank (DeepEP's LL sends
    one copy per (token, expert)).  Output slabs ``(L, R*M, H)`` with rows in ascending source rank / token order.

Async model
    On CUDA every call runs on the buffer's communication stream after waiting on ``previous_event`` (or the
    current stream); ``async_finish=False`` makes the current stream wait before returning, else wait on the
    returned :class:`EventOverlap` (``event.current_stream_wait()`` or ``with event:``).  On the CPU these are
    no-ops with the same return types.

Errors and timeouts
    Arguments are checked locally first; then every call's first collective is a fixed-size header all-gather
    (the call, the arguments that must agree, a status), so mismatched hidden sizes, dtypes, top-k, expert counts
    or capacities raise the same ``ValueError`` on every rank, and a rank that fails locally raises its own error
    while its peers raise :class:`PeerFailure` naming it.  Uncached dispatch always exchanges the header (with the
    counts, whose host sync it needs anyway); combine, cached and fixed-capacity dispatch and the low-latency calls
    do only with ``peer_checks`` (default True, or ``TRITILE_EP_PEER_CHECKS``): one tiny all-gather and a host
    sync, never during CUDA-graph capture.  ``peer_checks=False`` makes those paths sync-free; mismatched arguments
    are then undefined behaviour of the collective.  Sync-free paths drop expert ids outside ``[-1, E)``
    (``TRITILE_CHECKS=1`` raises).  Collectives use the process group's timeout (``ElasticBuffer``'s header
    exchange also ``num_cpu_timeout_secs`` on gloo): create groups with a short one (e.g. 60 s).

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
