"""tritile in Hugging Face transformers models: ``tritile.hf.patch(model)`` runs their MoE blocks on tritile's kernels.

```python
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
tritile.hf.patch(model)                      # fp8=True: FP8 activations; ep_group=g: expert parallelism
loss = model(input_ids, labels=input_ids).loss; loss.backward()
```

Supported (transformers 5.x, ``pip install tritile[hf]``): ``deepseek_v3`` (DeepSeek-V3, and Kimi-K2 loaded
through transformers' DeepSeek-V3 classes), whose ``DeepseekV3MoE`` blocks become ``TritileDeepseekV3MoE``, and
``qwen3_moe``, whose ``Qwen3MoeSparseMoeBlock`` blocks become ``TritileQwen3MoeSparseMoeBlock``.  Both are
``tritile.modeling.moe.MoE`` layers computing over the Hugging Face block's own parameters: the module names and
shapes under each block stay as they were, so ``state_dict()`` has the same keys and a checkpoint loads before or
after the patch.  The dense MLPs, attention and norms are left alone.

Accuracy (bf16, ``tests/hf``, tiny models on the CPU): a patched block matches transformers' block to calc_diff
<= 2.7e-5 (output and every gradient; bound 1e-4), a patched model the unpatched one to <= 8.4e-6 on the logits and
<= 1.6e-4 on every gradient (bound 5e-4; transformers' own eager and grouped_mm experts differ by up to 6.4e-5),
with the same experts chosen for every token.  At DeepSeek-V3's widths (one layer, 4096 tokens, H100) the patched
model is as far from a float32 evaluation of the same weights as the unpatched bf16 model (calc_diff ratio <= 1.003
on the logits and every gradient; benchmarks/RESULTS.md).  FP8 (``fp8=True``: e4m3 expert inputs with one scale per 128
channels, SwiGLU outputs cast per token, the weight gradients' operands cast per 32 or 128 tokens, and FP8 grouped
GEMMs where torch has them, on the GPU) costs, on the one-MoE-layer models of ``tests/hf/test_hf_fp8.py``:
calc_diff 1.3e-4 to 1.8e-4 on the logits (DeepSeek-V3; 1.3e-5 to 1.6e-5 for Qwen3-MoE, whose layer adds less to
the residual stream), 6e-4 to 4.4e-3 on the MoE layer's weight gradients and < 1e-3 on the others (bounds 1e-3
and 1e-2).  In a deeper model the rounding of earlier layers, bf16 or FP8, can flip a later layer's choice
between two experts whose scores nearly tie, as it does between transformers' own implementations.

Expert parallelism: with ``ep_group`` (a ``torch.distributed`` process group of R ranks, every rank running the
same model on its own tokens), rank r keeps experts ``[r E/R, (r+1) E/R)`` only, and tokens travel to their experts
and back through ``tritile.ep``.  Every rank must patch the full model (each keeps its slice); a full
checkpoint's expert tensors load into a rank's slice (``load_state_dict``), and ``state_dict()`` holds that slice.
The other parameters stay replicated: average their gradients over the ranks as in data parallelism.
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import nn

__all__ = ["patch", "SUPPORTED_MODEL_TYPES", "MIN_TRANSFORMERS"]

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "qwen3_moe")
MIN_TRANSFORMERS = "5.0"


def _transformers_major() -> int:
    try:
        import transformers
    except ImportError:
        raise ImportError("tritile.hf needs transformers >= 5 (pip install 'tritile[hf]')") from None
    try:
        return int(transformers.__version__.split(".")[0])
    except ValueError:  # pragma: no cover - a version string without a number
        return 0


def _builders() -> Dict[type, type]:
    """transformers' block class -> tritile's block class."""
    major = _transformers_major()
    if major < 5:
        import transformers

        raise ImportError(f"tritile.hf needs transformers >= 5 (fused 3D expert weights), got "
                          f"{transformers.__version__}")
    from . import deepseek_v3, qwen3_moe

    return {deepseek_v3.HF_BLOCK: deepseek_v3.TritileDeepseekV3MoE,
            qwen3_moe.HF_BLOCK: qwen3_moe.TritileQwen3MoeSparseMoeBlock}


def _block_config(block: nn.Module, model: nn.Module):
    for owner in (block, getattr(block, "experts", None), model):
        cfg = getattr(owner, "config", None)
        if cfg is not None:
            return cfg
    raise ValueError(f"{type(block).__name__} has no config (nor its experts, nor the model)")


def patch(model: nn.Module, fp8: bool = False, ep_group=None, *, fp8_scale: str = "fp32",
          alignment: Optional[int] = None) -> nn.Module:
    """Replace, in place, every MoE block of a transformers model by its tritile block; returns ``model``.

    Args:
        model: a transformers 5.x model (any head, or the bare model, or a module holding one) of a supported type
            (``SUPPORTED_MODEL_TYPES``), in bf16 (the experts' weights must be ``torch.bfloat16``).
        fp8: FP8 (e4m3) activations in the routed experts (``tritile.modeling.moe.MoE``'s FP8 mode); needs the
            hidden and expert widths to be multiples of 128.
        ep_group: a ``torch.distributed`` process group for expert parallelism (None: every expert on this
            process).  Every rank of the group must call ``patch`` with the same model and options.
        fp8_scale: ``'fp32'`` or ``'ue8m0'`` scales of the FP8 dispatch (with ``fp8``).
        alignment: rows per expert segment are padded to this multiple (default: ``MoE``'s, 16, or 128 with
            ``fp8``).

    Raises:
        ValueError: the model has no supported MoE block (naming its model type), a block's configuration is one
            tritile's layer does not take, or the model was patched before with other options.
        TypeError: the experts' weights are not bf16, or an argument has the wrong type.
        ImportError: transformers is missing or older than 5.

    Modules replaced: ``DeepseekV3MoE`` -> ``TritileDeepseekV3MoE``, ``Qwen3MoeSparseMoeBlock`` ->
    ``TritileQwen3MoeSparseMoeBlock`` (both ``tritile.modeling.moe.MoE``).  Hooks registered on a replaced block
    itself do not carry over (those on its router, experts' owner and shared experts do: they are kept).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    builders = _builders()
    from ._block import HFMoEBlock

    options = dict(fp8=fp8, fp8_scale=fp8_scale, alignment=alignment, group=ep_group)
    targets, patched = [], []
    for prefix, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if type(child) in builders:
                targets.append((parent, child_name, name, child))
            elif isinstance(child, HFMoEBlock):
                patched.append((name, child))
    if not targets and not patched:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"tritile.hf.patch supports the model types {list(SUPPORTED_MODEL_TYPES)} "
                             f"(transformers' DeepseekV3MoE and Qwen3MoeSparseMoeBlock blocks), got model type "
                             f"{model_type!r} ({type(model).__name__})")
        return model  # a supported model without MoE layers
    for name, block in patched:
        have = dict(fp8=block.fp8, fp8_scale=block.fp8_scale if block.fp8 else fp8_scale,
                    alignment=block.alignment if alignment is not None else None, group=block.group)
        if have != options:
            raise ValueError(f"model is already patched ({name}: fp8={block.fp8}, fp8_scale={block.fp8_scale!r}, "
                             f"alignment={block.alignment}, ep_group={block.group}); patch a fresh model to change "
                             f"the options")
    # every block is built before any is replaced, so a block that cannot be patched leaves the model as it was
    new = [builders[type(child)].from_hf(child, _block_config(child, model), name, **options)
           for _, _, name, child in targets]
    for (parent, child_name, _, _), block in zip(targets, new):
        setattr(parent, child_name, block)
    return model
