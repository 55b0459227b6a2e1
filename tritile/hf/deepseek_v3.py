"""DeepSeek-V3 (and Kimi-K2, the same architecture) in transformers: ``DeepseekV3MoE`` as a tritile block.

transformers' block, per token (T tokens of width H, E routed experts, top-K)::

    logits = x @ gate.weight.T (float32); s = sigmoid(logits); b = s + e_score_correction_bias
    keep the topk_group of n_group groups with the largest sum of their two best b, the rest rank as -inf
    idx = the K largest b; w = s[idx], divided by (sum + 1e-20) when norm_topk_prob, times routed_scaling_factor
    y = sum_k w_k * down_proj[idx_k] @ (silu(gate_proj x) * up_proj x) + shared_experts(x)

The patched block computes the same function with tritile's kernels: the selection and the normalised weights by
``tritile.moe.top2_sum_gate`` (one kernel; its backward in closed form below), the routed experts by
``tritile.modeling.moe.MoE`` (fused-layout expansion, grouped GEMMs, the SwiGLU kernels, reduce_fused; FP8 and expert
parallelism as options), and the shared experts by transformers' own MLP module, unchanged.  The router stays the
block's ``gate`` module (its class becomes ``DeepseekV3TopkRouter`` below, a subclass of transformers' router), so
its parameters, its hooks and the ``router_logits`` that transformers records from it stay as they were.

Differences from transformers, none of which changes the chosen experts in practice:

* the kernel computes the sigmoid as ``1 / (1 + exp(-l))`` and sums the weights in selection order: the weights
  may differ from torch's by an ulp or two (float32), and an exact near-tie in the ranking (two biased scores an
  ulp apart) may resolve the other way (ties themselves go to the smaller expert id);
* the routed output is accumulated in float32 and rounded to bf16 once (transformers' eager loop adds each
  expert's bf16 rows into a bf16 sum).
* transformers 5.0's block filled the dropped groups' scores with 0 instead of -inf; the two differ only when a
  kept expert's biased score is negative.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as _hf

from .. import moe as _moe
from ._block import HFMoEBlock

__all__ = ["TritileDeepseekV3MoE", "DeepseekV3TopkRouter", "HF_BLOCK"]

HF_BLOCK = _hf.DeepseekV3MoE


class _GroupedSigmoidTopK(torch.autograd.Function):
    """``(logits float32 (T, E)) -> (topk_weights float32 (T, K), topk_idx int64 (T, K))``, DeepSeek-V3's routing.

    Backward, with ``s = sigmoid(l)`` at the selected experts, ``c = routed_scaling_factor`` and ``g`` the weights'
    gradient: normalised (``w = c s / D``, ``D = 1e-20 + sum_k s_k``) ``dl_k = s_k (1 - s_k) (c g_k - sum_j g_j
    w_j) / D``; else (``w = c s``) ``dl_k = s_k (1 - s_k) c g_k``; zero at the other experts (the correction bias
    only ranks and gets no gradient).
    """

    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, norm, scale):
        idx, w = _moe.top2_sum_gate(logits, bias, top_k, topk_group, n_group, False, 0, scale if norm else 1.0,
                                    0, 1, 0, 1, "sigmoid")
        if not norm:
            w = torch.sigmoid(logits.gather(1, idx)) * scale
        ctx.save_for_backward(logits, idx, w)
        ctx.norm, ctx.scale = norm, scale
        ctx.mark_non_differentiable(idx)
        return w, idx

    @staticmethod
    def backward(ctx, grad_w, _grad_idx):
        logits, idx, w = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        if grad_w is not None and logits.shape[0]:
            s = torch.sigmoid(logits.gather(1, idx))
            g = grad_w.float()
            if ctx.norm:
                ds = (ctx.scale * g - (g * w).sum(-1, keepdim=True)) / (s.sum(-1, keepdim=True) + 1e-20)
            else:
                ds = ctx.scale * g
            grad_logits.scatter_(1, idx, ds * s * (1 - s))
        return grad_logits, None, None, None, None, None, None


@torch.compiler.disable
def grouped_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                         norm_topk_prob: bool, routed_scaling_factor: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing of float32 ``logits`` (T, E) with the correction ``bias`` (E,), differentiable in
    ``logits``: ``(topk_weights float32 (T, K), topk_idx int64 (T, K))``, largest biased score first.  Runs eagerly
    under ``torch.compile`` (as ``MoE``'s gate does)."""
    return _GroupedSigmoidTopK.apply(logits.contiguous(), bias.float().contiguous(), top_k, n_group, topk_group,
                                     bool(norm_topk_prob), float(routed_scaling_factor))


class DeepseekV3TopkRouter(_hf.DeepseekV3TopkRouter):
    """transformers' router with tritile's gate kernel: ``forward(hidden_states) -> (router_logits float32 (T, E),
    topk_weights float32 (T, K), topk_indices int64 (T, K))``, as transformers' router returns them.

    A patched block's router is transformers' own router object with this class (the same parameters, buffers
    and hooks); ``top_k``, ``num_group``, ``topk_group``, ``norm_topk_prob`` and ``routed_scaling_factor`` are set
    from the model's configuration.
    """

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.weight.shape[1])
        logits = F.linear(x.float(), self.weight.float())
        w, idx = grouped_sigmoid_topk(logits, self.e_score_correction_bias, self.top_k, self.num_group,
                                      self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)
        return logits, w, idx


class TritileDeepseekV3MoE(HFMoEBlock):
    """transformers' ``DeepseekV3MoE`` on tritile's kernels (see the module docstring); build with ``from_hf``.

    Submodules, as in transformers: ``gate`` (the router: ``weight`` (E, H), buffer ``e_score_correction_bias``
    (E,)), ``experts`` (``gate_up_proj`` (L, 2I, H), ``down_proj`` (L, H, I); L = E / ranks) and
    ``shared_experts`` (transformers' MLP).  ``forward(hidden_states)``: bf16 ``(..., H)`` -> bf16 ``(..., H)``.
    """

    @classmethod
    def from_hf(cls, block: nn.Module, config, name: str = "mlp", *, fp8: bool = False, fp8_scale: str = "fp32",
                alignment: Optional[int] = None, group=None) -> "TritileDeepseekV3MoE":
        """The tritile block over ``block``'s parameters (``block`` itself is left as it was, except that its
        router's class changes, and, with expert parallelism, it loses its experts to this rank's share)."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{name}: the experts' activation must be silu, got {config.hidden_act!r}")
        num_experts = getattr(config, "n_routed_experts", None) or config.num_local_experts
        self = cls.__new__(cls)
        self._setup(name, block, hidden_size=config.hidden_size, num_experts=num_experts,
                    moe_intermediate_size=config.moe_intermediate_size,
                    num_shared_experts=config.n_shared_experts or 0, num_topk=config.num_experts_per_tok,
                    num_groups=config.n_group, num_topk_groups=config.topk_group,
                    routed_scaling_factor=config.routed_scaling_factor, group=group, fp8=fp8, fp8_scale=fp8_scale,
                    alignment=alignment)
        self.config = config
        self.norm_topk_prob = bool(config.norm_topk_prob)
        gate = block.gate
        if tuple(gate.weight.shape) != (num_experts, config.hidden_size):
            raise ValueError(f"{name}.gate.weight must be {(num_experts, config.hidden_size)}, got "
                             f"{tuple(gate.weight.shape)}")
        if not isinstance(gate, DeepseekV3TopkRouter):
            gate.__class__ = DeepseekV3TopkRouter
        gate.top_k, gate.num_experts, gate.hidden_dim = config.num_experts_per_tok, num_experts, config.hidden_size
        gate.num_group, gate.topk_group = config.n_group, config.topk_group
        gate.norm_topk_prob, gate.routed_scaling_factor = self.norm_topk_prob, float(config.routed_scaling_factor)
        self.gate = gate
        self.shared_experts = block.shared_experts
        return self

    @property
    def gate_weight(self) -> nn.Parameter:
        return self.gate.weight

    @property
    def e_score_correction_bias(self) -> torch.Tensor:
        return self.gate.e_score_correction_bias

    def route(self, x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        _, w, idx = self.gate(x2)
        return idx, w

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x2 = self._flat_input(hidden_states)
        _, w, idx = self.gate(x2)
        y = self._routed(x2, idx, w).view(hidden_states.shape)
        return y + self.shared_experts(hidden_states)
