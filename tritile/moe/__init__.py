"""MoE gating and routing (``tile_kernels.moe``)."""

from . import scoring  # noqa: F401
from .aux_fi_kernel import aux_fi  # noqa: F401
from .expand_to_fused_kernel import expand_to_fused, expand_to_fused_with_sf  # noqa: F401
from .get_fused_mapping_kernel import get_fused_mapping  # noqa: F401
from .group_count_kernel import group_count  # noqa: F401
from .inplace_unique_group_indices_kernel import inplace_unique_group_indices  # noqa: F401
from .mask_indices_by_tp_kernel import mask_indices_by_tp  # noqa: F401
from .normalize_weight_kernel import normalize_weight  # noqa: F401
from .reduce_fused_kernel import reduce_fused  # noqa: F401
from .top2_sum_gate_kernel import top2_sum_gate  # noqa: F401
from .topk_gate_kernel import topk_gate  # noqa: F401
from .topk_sum_and_topk_group_idx_kernel import topk_sum_and_topk_group_idx  # noqa: F401

__all__ = ["topk_gate", "top2_sum_gate", "topk_sum_and_topk_group_idx", "normalize_weight", "aux_fi", "group_count",
           "mask_indices_by_tp", "inplace_unique_group_indices", "get_fused_mapping", "expand_to_fused",
           "expand_to_fused_with_sf", "reduce_fused"]
