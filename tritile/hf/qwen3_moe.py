"""Qwen3-MoE in transformers: ``Qwen3MoeSparseMoeBlock`` as a tritile block.

transformers' block, per token (E experts, top-K, no shared experts)::

    logits = x @ gate.weight.T (the model's dtype); p = softmax(logits) in float32
    idx, w = torch.topk(p, K); w /= sum(w) when norm_topk_prob; w in the logits' dtype
    y = sum_k w_k * down_proj[idx_k] @ (silu(gate_proj x) * up_proj x)

The patched block keeps transformers' router (``gate``) and runs it as it is: the routed experts, nearly all of the
block's work, run through ``tritile.modeling.moe.MoE`` (fused-layout expansion, grouped GEMMs, the SwiGLU kernels,
reduce_fused; FP8 and expert parallelism as options).  The router is kept because in a bf16 model its logits are
bf16, and equal logits are common: with 128 experts, top-8 and random bf16 logits of a width-2048 layer, 6.9 % of
the tokens tie at the K-th place and ``torch.topk`` breaks 3.4 % of them unlike a stable top-k (measured on the CPU,
4096 tokens).  Which of the tied experts a token takes is ``torch.topk``'s choice, so only transformers' own router
chooses the same experts for every token.  It is also what records ``router_logits`` for the load-balancing loss.

The routed output is accumulated in float32 and rounded to bf16 once (transformers' eager loop adds each expert's
bf16 rows into a bf16 sum); the routing weights are applied in float32 before the down projection.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn
from transformers.models.qwen3_moe import modeling_qwen3_moe as _hf

from ._block import HFMoEBlock

__all__ = ["TritileQwen3MoeSparseMoeBlock", "HF_BLOCK"]

HF_BLOCK = _hf.Qwen3MoeSparseMoeBlock


class TritileQwen3MoeSparseMoeBlock(HFMoEBlock):
    """transformers' ``Qwen3MoeSparseMoeBlock`` on tritile's kernels (see the module docstring); build with
    ``from_hf``.

    Submodules, as in transformers: ``gate`` (transformers' router, ``weight`` (E, H)) and ``experts``
    (``gate_up_proj`` (L, 2I, H), ``down_proj`` (L, H, I); L = E / ranks).
    ``forward(hidden_states)``: bf16 ``(..., H)`` -> bf16 ``(..., H)``.
    """

    @classmethod
    def from_hf(cls, block: nn.Module, config, name: str = "mlp", *, fp8: bool = False, fp8_scale: str = "fp32",
                alignment: Optional[int] = None, group=None) -> "TritileQwen3MoeSparseMoeBlock":
        """The tritile block over ``block``'s parameters (``block`` itself is left as it was, except that, with
        expert parallelism, it loses its experts to this rank's share)."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{name}: the experts' activation must be silu, got {config.hidden_act!r}")
        num_experts = config.num_experts
        self = cls.__new__(cls)
        self._setup(name, block, hidden_size=config.hidden_size, num_experts=num_experts,
                    moe_intermediate_size=config.moe_intermediate_size, num_shared_experts=0,
                    num_topk=config.num_experts_per_tok, num_groups=1, num_topk_groups=1, routed_scaling_factor=1.0,
                    group=group, fp8=fp8, fp8_scale=fp8_scale, alignment=alignment)
        self.config = config
        self.norm_topk_prob = bool(config.norm_topk_prob)
        if tuple(block.gate.weight.shape) != (num_experts, config.hidden_size):
            raise ValueError(f"{name}.gate.weight must be {(num_experts, config.hidden_size)}, got "
                             f"{tuple(block.gate.weight.shape)}")
        self.gate = block.gate
        return self

    @property
    def gate_weight(self) -> nn.Parameter:
        return self.gate.weight

    @property
    def e_score_correction_bias(self) -> None:
        return None

    def route(self, x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        _, w, idx = self.gate(x2)
        return idx, w

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x2 = self._flat_input(hidden_states)
        _, w, idx = self.gate(x2)
        return self._routed(x2, idx, w).view(hidden_states.shape)
