"""Tiny transformers models and the helpers the tests of tritile.hf share (imported after the transformers skip)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

import transformers

from tritile.testing import calc_diff, get_device

# calc_diff bounds, patched against unpatched, bf16 (tests/hf/test_hf_patch.py's docstring gives the measurements)
BF16_TOL = 5e-4
BLOCK_TOL = 1e-4


def deepseek_config(**kw) -> "transformers.DeepseekV3Config":
    """2 layers, the first dense, the second MoE: 16 experts of width 128 in 4 groups, top-4 of the best 2 groups."""
    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
               num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=32,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
               norm_topk_prob=True, routed_scaling_factor=2.5)
    cfg.update(kw)
    return transformers.DeepseekV3Config(**cfg)


def qwen3_config(**kw) -> "transformers.Qwen3MoeConfig":
    """2 layers, the first dense (mlp_only_layers), the second MoE: 8 experts of width 64, top-2."""
    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
               mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=128)
    cfg.update(kw)
    return transformers.Qwen3MoeConfig(**cfg)


def build(model_type: str, **kw):
    """A randomly initialised bf16 causal LM on the test device (transformers' init; DeepSeek's correction bias
    drawn N(0, 0.05) so that it takes part in the ranking)."""
    if model_type == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM._from_config(deepseek_config(**kw), dtype=torch.bfloat16)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.05)
    else:
        model = transformers.Qwen3MoeForCausalLM._from_config(qwen3_config(**kw), dtype=torch.bfloat16)
    return model.to(get_device()).train()


def moe_blocks(model) -> List[torch.nn.Module]:
    from tritile.hf._block import HFMoEBlock

    hf = (transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
          transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)
    return [m for m in model.modules() if isinstance(m, hf + (HFMoEBlock,))]


def hf_selection(block, x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``(topk_idx, topk_weights)`` of an unpatched block for the flattened input ``x2``, each row
    sorted by expert id."""
    out = block.gate(x2)
    if isinstance(out, tuple):
        idx, w = out[2], out[1]
    else:  # transformers 5.0's DeepSeek block routes the router's logits itself
        idx, w = block.route_tokens_to_experts(out)
    order = idx.argsort(-1)
    return idx.gather(1, order), w.gather(1, order).float()


def step(model, ids: torch.Tensor, capture: bool = False):
    """Forward + backward of the language-model loss: ``(logits float32, {name: grad float32}, [MoE inputs])``."""
    inputs: List[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
             for b in moe_blocks(model)] if capture else []
    try:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads, inputs


def assert_close_runs(got, ref, tol: float, grad_tol: float) -> Dict[str, float]:
    """The logits and every gradient within the calc_diff bounds; returns the measured values."""
    logits, grads, _ = got
    rlogits, rgrads, _ = ref
    assert logits.shape == rlogits.shape
    diffs = {"logits": calc_diff(logits, rlogits)}
    assert set(grads) == set(rgrads), set(grads) ^ set(rgrads)
    for name, g in rgrads.items():
        assert grads[name].shape == g.shape, name
        assert torch.isfinite(grads[name]).all(), name
        diffs[name] = calc_diff(grads[name], g)
    assert diffs["logits"] < tol, diffs["logits"]
    bad = {k: v for k, v in diffs.items() if k != "logits" and not v < grad_tol}
    assert not bad, bad
    return diffs
