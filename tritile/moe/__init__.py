"""MoE gating and routing (``tile_kernels.moe``)."""

import importlib as _importlib

# op file (named as in TileKernels) -> public names it exports
_EXPORTS = {
    "topk_gate_kernel": ("topk_gate",),
    "top2_sum_gate_kernel": ("top2_sum_gate",),
    "topk_sum_and_topk_group_idx_kernel": ("topk_sum_and_topk_group_idx",),
    "normalize_weight_kernel": ("normalize_weight",),
    "aux_fi_kernel": ("aux_fi",),
    "group_count_kernel": ("group_count",),
    "mask_indices_by_tp_kernel": ("mask_indices_by_tp",),
    "inplace_unique_group_indices_kernel": ("inplace_unique_group_indices",),
    "get_fused_mapping_kernel": ("get_fused_mapping",),
    "expand_to_fused_kernel": ("expand_to_fused", "expand_to_fused_with_sf"),
    "reduce_fused_kernel": ("reduce_fused",),
    "scoring": (),
}

# TODO(integration): switch to plain imports once every file exists.
for _file, _names in _EXPORTS.items():
    try:
        _mod = _importlib.import_module(f"{__name__}.{_file}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_file}":
            raise
        continue
    for _n in _names:
        globals()[_n] = getattr(_mod, _n)
del _importlib
