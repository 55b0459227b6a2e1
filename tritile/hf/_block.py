"""The base of tritile's Hugging Face MoE blocks: ``tritile.modeling.moe.MoE`` computing over a transformers
block's own parameters.

A patched block is a ``MoE`` (the routed experts run through its dispatch, fused-layout expansion, grouped GEMMs,
SwiGLU kernels and combine, in bf16 or FP8, on one process or expert-parallel through ``tritile.ep``) whose
parameters are not allocated by ``MoE`` but taken over from the Hugging Face block: the router (``gate``), the
routed experts (``experts.gate_up_proj`` / ``experts.down_proj``, transformers 5's fused 3D layout, which is
``MoE``'s ``w13`` / ``w2`` layout) and, where the model has them, the shared experts.  The module tree under the
block keeps Hugging Face's names, so ``state_dict()`` keys and shapes are unchanged; on one process the very same
``Parameter`` objects are kept, so an optimizer built before the patch still updates them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ..modeling.moe import _NULL_TIMER, MoE, _dense, _routed_experts
from ..runtime import check_tensor

__all__ = ["Experts", "HFMoEBlock"]


class Experts(nn.Module):
    """The routed experts of a patched block, under Hugging Face's names.

    ``gate_up_proj``: ``(L, 2I, H)``, rows ``[0, I)`` an expert's gate projection and ``[I, 2I)`` its up
    projection (``nn.Linear`` layout); ``down_proj``: ``(L, H, I)``.  ``L`` is this rank's share of the
    ``num_experts`` experts, starting at global id ``expert_offset`` (all of them, offset 0, without expert
    parallelism).  A state dict with all ``num_experts`` experts (a full checkpoint) loads into a rank's share:
    its rows ``[expert_offset, expert_offset + L)`` are taken.
    """

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, num_experts: int, expert_offset: int):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.num_experts = num_experts
        self.expert_offset = expert_offset

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        n = self.num_local_experts
        if n != self.num_experts:
            for name in ("gate_up_proj", "down_proj"):
                t = state_dict.get(prefix + name)
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == self.num_experts:
                    state_dict[prefix + name] = t[self.expert_offset:self.expert_offset + n]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, *args, **kwargs):
        raise RuntimeError("tritile.hf.Experts holds weights only: the patched block runs the experts")

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, local experts [{self.expert_offset}, "
                f"{self.expert_offset + self.num_local_experts}), gate_up_proj={tuple(self.gate_up_proj.shape)}, "
                f"down_proj={tuple(self.down_proj.shape)}")


def _take_experts(hf_experts: nn.Module, name: str, num_experts: int, inter: int, hidden: int, rank: int,
                  world: int) -> Experts:
    """An ``Experts`` holding ``hf_experts``' weights (the same Parameters on one rank, this rank's rows else)."""
    gu, dn = getattr(hf_experts, "gate_up_proj", None), getattr(hf_experts, "down_proj", None)
    if not isinstance(gu, nn.Parameter) or not isinstance(dn, nn.Parameter):
        raise ValueError(f"{name}.experts must hold the fused Parameters gate_up_proj and down_proj "
                         f"(transformers 5 layout), got {type(hf_experts).__name__}")
    if tuple(gu.shape) != (num_experts, 2 * inter, hidden) or tuple(dn.shape) != (num_experts, hidden, inter):
        raise ValueError(f"{name}.experts: gate_up_proj must be {(num_experts, 2 * inter, hidden)} and down_proj "
                         f"{(num_experts, hidden, inter)}, got {tuple(gu.shape)} and {tuple(dn.shape)}")
    for pname, p in (("gate_up_proj", gu), ("down_proj", dn)):
        check_tensor(f"{name}.experts.{pname}", p, dtypes=(torch.bfloat16,))
    if world == 1:
        return Experts(gu, dn, num_experts, 0)
    n = num_experts // world
    lo = rank * n
    return Experts(nn.Parameter(gu.detach()[lo:lo + n].clone(), requires_grad=gu.requires_grad),
                   nn.Parameter(dn.detach()[lo:lo + n].clone(), requires_grad=dn.requires_grad), num_experts, lo)


class HFMoEBlock(MoE):
    """``MoE`` over a Hugging Face block's parameters; the model-specific subclasses set up the router.

    Subclasses call ``_setup(...)`` with the block's configuration, then set ``gate`` (and ``shared_experts``),
    and implement ``route`` and ``forward``.  ``w13`` / ``w2`` are ``experts.gate_up_proj`` /
    ``experts.down_proj``.
    """

    # MoE's own parameter allocation is skipped: the weights are the Hugging Face block's.
    def _init_params(self, hidden_size, num_experts, num_local, moe_intermediate_size, num_shared_experts,
                     device, dtype):
        self.shared_w13 = self.shared_w2 = None

    def _setup(self, name: str, hf_block: nn.Module, *, hidden_size: int, num_experts: int, moe_intermediate_size: int,
               num_shared_experts: int, num_topk: int, num_groups: int, num_topk_groups: int,
               routed_scaling_factor: float, group, fp8: bool, fp8_scale: str, alignment: Optional[int]) -> None:
        try:
            MoE.__init__(self, hidden_size=hidden_size, num_experts=num_experts,
                         moe_intermediate_size=moe_intermediate_size, num_shared_experts=num_shared_experts,
                         num_topk=num_topk, num_groups=num_groups, num_topk_groups=num_topk_groups,
                         routed_scaling_factor=routed_scaling_factor, group=group, fp8=fp8, fp8_scale=fp8_scale,
                         alignment=alignment, dtype=torch.bfloat16)
        except ValueError as e:
            raise ValueError(f"{name} ({type(hf_block).__name__}) cannot be patched: {e}") from None
        self.experts = _take_experts(hf_block.experts, name, num_experts, moe_intermediate_size, hidden_size,
                                     self.rank, self.world_size)

    @property
    def w13(self) -> nn.Parameter:
        return self.experts.gate_up_proj

    @property
    def w2(self) -> nn.Parameter:
        return self.experts.down_proj

    def _routed(self, x2: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for the flattened tokens ``x2`` (T, H): bf16 (T, H)."""
        return _routed_experts(_dense(x2), topk_idx, topk_weights.float(), self.w13, self.w2, self, _NULL_TIMER)

    def _flat_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        check_tensor("hidden_states", hidden_states, dtypes=(torch.bfloat16,))
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be (..., {self.hidden_size}) (hidden_size), got shape "
                             f"{tuple(hidden_states.shape)}")
        for pname, p in (("experts.gate_up_proj", self.w13), ("experts.down_proj", self.w2)):
            check_tensor(pname, p, dtypes=(torch.bfloat16,))
        if hidden_states.device != self.w13.device:
            raise ValueError(f"hidden_states must be on the experts' device {self.w13.device}, got "
                             f"{hidden_states.device}")
        return hidden_states.reshape(-1, self.hidden_size)

    def route(self, x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx int64 (T, K), topk_weights (T, K))`` of the flattened tokens ``x2`` (T, H), global ids."""
        raise NotImplementedError

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Hugging Face's initialisation of the block: normal with the model's ``initializer_range``."""
        std = self.config.initializer_range
        for p in (self.gate.weight, self.w13, self.w2):
            p.normal_(0.0, std)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.zero_()

    def plain(self):
        raise NotImplementedError("a patched Hugging Face block has no PlainMoE twin: the unpatched block "
                                  "(transformers' own) is its reference")

    def load_plain(self, plain):
        raise NotImplementedError("a patched Hugging Face block loads Hugging Face state dicts (load_state_dict)")

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", fp8={self.fp8}" + (f" ({self.fp8_scale} scales)" if self.fp8 else "")
                + f", alignment={self.alignment}, ranks={self.world_size}")
