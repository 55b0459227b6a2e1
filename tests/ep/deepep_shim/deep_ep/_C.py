"""The names of DeepEP's compiled extension that its Python utilities (``deep_ep/utils``) import, from tritile.ep.
Calls that need DeepEP's own NCCL communicator raise: tritile.ep works on torch.distributed groups."""

from tritile.ep import Config, EventHandle, topk_idx_t  # noqa: F401
from tritile.ep.elastic import BUFFER_ALIGNMENT


def is_sm90_compiled() -> bool:
    return True


def get_elastic_buffer_alignment() -> int:
    return BUFFER_ALIGNMENT


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts) -> int:
    return 0


def _no_comm(*args, **kwargs):
    raise NotImplementedError("tritile.ep has no raw NCCL communicator API: it works on torch.distributed groups "
                              "(use deep_ep.get_physical_domain_size(group) / get_logical_domain_size(group))")


get_local_nccl_unique_id = create_nccl_comm = destroy_nccl_comm = _no_comm
get_physical_domain_size = get_logical_domain_size = calculate_elastic_buffer_size = _no_comm
