"""``mhc_multilayer_recompute`` (``tile_kernels.modeling.mhc.ops.multilayer_recompute``): a plain in-place
function, re-exported from :mod:`tritile.mhc.multilayer_recompute_kernel`."""

from tritile.mhc.multilayer_recompute_kernel import mhc_multilayer_recompute

__all__ = ["mhc_multilayer_recompute"]
