"""tritile.hf.patch(model, fp8=True): the accuracy cost of FP8 activations, measured on tiny models (2 layers, the
second MoE, hidden and expert width 128, 16 tokens).

FP8 quantizes the experts' input (e4m3, one scale per 128 channels), the SwiGLU output (per token) and, in the
backward, the weight gradients' operands (per 32 tokens and channel at the CPU's alignment of 32); the routing runs
before any quantization, so the same experts are chosen.  Measured on the CPU (4 seeds each, float32 and UE8M0
scales, 8 experts for DeepSeek-V3 and 4 for Qwen3-MoE): logits calc_diff 1.3e-4 to 1.8e-4 (DeepSeek-V3) and 1.3e-5
to 1.6e-5 (Qwen3-MoE, whose layer adds less to the residual stream); the MoE layer's weight gradients 6e-4 to
4.4e-3 (the worst: the router's, of 16 tokens), every other gradient below 1e-3.  Bounds: 1e-3 (logits), 1e-2
(gradients).  A token routed to another expert gives ~1e-2 on its layer's weight gradients, and bf16 without FP8
stays below 1e-4 (test_hf_patch.py).
"""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="tritile.hf needs transformers >= 5 (pip install "
                                                             "'tritile[hf]')")

import tritile.hf  # noqa: E402

from _hf_models import assert_close_runs, build, hf_selection, moe_blocks, step  # noqa: E402

FP8_LOGITS_TOL, FP8_GRAD_TOL = 1e-3, 1e-2
CONFIGS = {"deepseek_v3": dict(n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2),
           "qwen3_moe": dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("model_type,fp8_scale", [("deepseek_v3", "fp32"), ("qwen3_moe", "ue8m0")])
def test_fp8_accuracy(model_type, fp8_scale):
    model = build(model_type, **CONFIGS[model_type])
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=model.device)
    ref = step(model, ids, capture=True)
    with torch.no_grad():
        ref_idx, _ = hf_selection(moe_blocks(model)[0], ref[2][0])
    tritile.hf.patch(model, fp8=True, fp8_scale=fp8_scale, alignment=32)
    block = moe_blocks(model)[0]
    assert block.fp8 and block.fp8_scale == fp8_scale
    got = step(model, ids)
    diffs = assert_close_runs(got, ref, FP8_LOGITS_TOL, FP8_GRAD_TOL)
    # FP8 is on: its rounding shows on the experts' gradients (bf16 alone stays below 1e-4 there)
    assert max(v for k, v in diffs.items() if ".experts." in k) > 3e-4
    with torch.no_grad():
        idx, _ = block.route(ref[2][0])
    assert torch.equal(idx.sort(-1).values, ref_idx)  # the same experts

