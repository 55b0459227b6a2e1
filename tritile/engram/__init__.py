"""Engram: n-gram hashing and the fused Engram gate (``tile_kernels.engram``)."""

from .engram_fused_weight_kernel import fused_weight  # noqa: F401
from .engram_gate_kernel import engram_gate_bwd, engram_gate_fwd  # noqa: F401
from .engram_grad_w_reduce_kernel import grad_w_reduce  # noqa: F401
from .engram_hash_kernel import engram_hash  # noqa: F401

__all__ = ["fused_weight", "engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce", "engram_hash"]
