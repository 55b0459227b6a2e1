"""Transpose references."""

import torch

__all__ = ["transpose_ref", "batched_transpose_ref"]


def transpose_ref(x: torch.Tensor) -> torch.Tensor:
    """``(M, N) -> (N, M)`` contiguous copy."""
    return x.T.contiguous()


def batched_transpose_ref(x: torch.Tensor) -> torch.Tensor:
    """``(B, M, N) -> (B, N, M)`` contiguous copy."""
    return x.transpose(1, 2).contiguous()
