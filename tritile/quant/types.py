"""Quantized tensor type (``tile_kernels.quant.types``)."""

from typing import Tuple

import torch

#: ``(data, sf)``: quantized codes and their dequant scale factors (``x ≈ data * sf``).
QuantTensor = Tuple[torch.Tensor, torch.Tensor]

__all__ = ["QuantTensor"]
