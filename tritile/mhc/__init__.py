"""Manifold HyperConnection (mHC) kernels (``tile_kernels.mhc``).

Unlike TileKernels' empty package, this re-exports the public kernel-level functions; the submodules
(``post_kernel``, ``multilayer_recompute_kernel``, ``norm_fn_kernel``, ``expand_kernel``, ...) stay importable.
The autograd ops are in ``tritile.modeling.mhc``; the references in ``tritile.torch.mhc``.
"""

from .multilayer_recompute_kernel import mhc_multilayer_recompute
from .post_kernel import mhc_post_bwd, mhc_post_fwd

__all__ = ["mhc_post_fwd", "mhc_post_bwd", "mhc_multilayer_recompute"]

try:
    from .norm_fn_kernel import round_to_tf32  # noqa: F401
except ModuleNotFoundError as _e:  # built separately
    if _e.name != f"{__name__}.norm_fn_kernel":
        raise
else:
    __all__.append("round_to_tf32")
