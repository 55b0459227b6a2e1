"""``python -m tritile demo hf``: a randomly initialised transformers model (DeepSeek-V3 or Qwen3-MoE), trained for
a few steps (forward + backward of the language-model loss) without and with ``tritile.hf.patch``: tokens/s, the
speed-up, and the check that the patched model computes the same function (logits, gradients, chosen experts).

On a GPU the layers have the real widths: DeepSeek-V3 (hidden 7168, 256 routed experts of width 2048, top-8 of 4 of 8
groups, one shared expert, MLA attention with 128 heads) or Qwen3-30B-A3B (hidden 2048, 128 experts of width 768,
top-8, 32 query and 4 key-value heads), every layer an MoE layer, 4096 tokens a step, and a small vocabulary (1024)
so that the decoder layers are what is timed.  If the weights and their gradients do not fit in the GPU's memory
the routed-expert count is halved until they do, and the report says so.  On the CPU (Triton's interpreter) the
model is tiny.

Baselines: the unpatched model with transformers' default experts implementation (``grouped_mm``: sort, gather and
``torch._grouped_mm``) and with its ``eager`` loop over experts.  A step is ``model(ids, labels=ids).loss`` and its
``backward()`` (no optimizer step: it costs the same with and without the patch).

The check: the patched model's logits and gradients against the unpatched model's (calc_diff; the expert weights'
gradients on the first ``--check-experts`` experts of each layer, every other gradient in full), and each MoE layer's
chosen experts on the same input (the input the unpatched model gave that layer) against transformers' router.  A
tensor passes when its calc_diff is within the fixed bound (``TOL``) or, where bf16 rounding differences grow through
the layers of a random-weight model at real widths, when the patched model is no further from a float32 evaluation of
the same weights (the unpatched model widened exactly to float32, transformers' ``eager`` experts loop) than
``RATIO`` times the unpatched bf16 model's own distance from it (plus ``FLOOR``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

MODELS = ("deepseek_v3", "qwen3_moe")
# calc_diff bounds of the check (tests/hf/test_hf_patch.py and test_hf_fp8.py give the measured values they cover)
# (on the GPU FP8 also quantizes the weights for the FP8 GEMMs, which the CPU does not run: the logits' bound is wider)
TOL = {False: (5e-4, 5e-4), True: (3e-3, 1e-2)}  # fp8 -> (logits, gradients)
# Against the float32 evaluation: calc_diff(patched, f32) <= RATIO * calc_diff(unpatched bf16, f32) + FLOOR.  Tiny
# models on the CPU measure ratios of 1.0-1.3 in bf16; FP8 is further from float32 by design (up to 82x there), so
# its check keeps the fixed bounds alone.
RATIO = {False: 4.0, True: None}
FLOOR = 1e-6


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tritile demo hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek_v3", choices=MODELS, help="architecture (default deepseek_v3)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers, all MoE (default: 2 on a GPU, 1 on the CPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens a step (default: 4096 on a GPU, 32 on the CPU)")
    p.add_argument("--experts", type=int, default=None, help="routed experts a layer (default: the model's, halved "
                   "until the weights and gradients fit)")
    p.add_argument("--fp8", action="store_true", help="patch with fp8=True")
    p.add_argument("--baseline", default="both", choices=("grouped_mm", "eager", "both"),
                   help="transformers' experts implementation(s) to time without the patch (default both)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default: 10 on a GPU, 1 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 2 on a GPU, 1 on the CPU)")
    p.add_argument("--check-experts", type=int, default=None,
                   help="compare the expert weights' gradients on this many experts of each layer (default: 32 on a "
                        "GPU, all on the CPU)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the unpatched model")
    p.add_argument("--json", help="write the results as JSON here")
    return p


def _config(model: str, args, device: torch.device):
    on_gpu = device.type == "cuda"
    layers = args.layers if args.layers is not None else (2 if on_gpu else 1)
    if model == "deepseek_v3":
        from transformers import DeepseekV3Config

        if on_gpu:  # DeepSeek-V3's widths (transformers' defaults)
            cfg = DeepseekV3Config(vocab_size=1024, num_hidden_layers=layers, first_k_dense_replace=0,
                                   max_position_embeddings=8192)
        else:
            cfg = DeepseekV3Config(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                   n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                                   topk_group=2, first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=32,
                                   qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                                   max_position_embeddings=256)
        experts_key = "n_routed_experts"
    else:
        from transformers import Qwen3MoeConfig

        if on_gpu:  # Qwen3-30B-A3B's widths
            cfg = Qwen3MoeConfig(vocab_size=1024, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                 num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                                 head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                 max_position_embeddings=8192)
        else:
            cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 max_position_embeddings=256)
        experts_key = "num_experts"
    note = None
    if args.experts is not None:
        setattr(cfg, experts_key, args.experts)
    elif on_gpu:
        free, _ = torch.cuda.mem_get_info(device)
        e = getattr(cfg, experts_key)
        # bf16 weights and gradients, and the FP8 copies of the weights that the FP8 GEMMs read; the check's float32
        # evaluation holds float32 weights and gradients (8 bytes an element) for one step
        nbytes = 8 if not args.no_check else (5 if args.fp8 else 4)
        per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * nbytes * layers
        while e > 8 and e * per_expert > 0.7 * free:
            e //= 2
        if e != getattr(cfg, experts_key):
            note = f"routed experts reduced from {getattr(cfg, experts_key)} to {e} a layer to fit the GPU's memory"
            setattr(cfg, experts_key, e)
    if model == "deepseek_v3" and cfg.n_routed_experts % cfg.n_group:
        cfg.n_group = cfg.topk_group = 1
    return cfg, note


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def _time(model, ids, device, iters, warmup) -> float:
    """Median milliseconds of a training step."""
    for _ in range(warmup):
        _step(model, ids)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        _step(model, ids)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _calc_diff(x: torch.Tensor, y: torch.Tensor, rows: int = 1 << 24) -> float:
    """calc_diff in float64, over chunks (expert gradients at real widths are GiBs)."""
    x, y = x.reshape(-1), y.reshape(-1)
    xy = den = 0.0
    for i in range(0, x.numel(), rows):
        a, b = x[i:i + rows].double(), y[i:i + rows].double()
        xy += float((a * b).sum())
        den += float((a * a + b * b).sum())
    return 0.0 if den == 0.0 else 1 - 2 * xy / den


def _moe_blocks(model) -> List[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


def _hf_selection(block, x2):
    """transformers' chosen experts (sorted per token) for the flattened input ``x2`` of an unpatched block."""
    out = block.gate(x2)
    if isinstance(out, tuple):
        idx = out[2]
    else:  # transformers 5.0: the block routes the router's logits
        idx = block.route_tokens_to_experts(out)[0]
    return idx.sort(-1).values


def _kept_grads(model, check_experts: Optional[int]) -> Dict[str, torch.Tensor]:
    keep = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and check_experts is not None:
            g = g[:check_experts]
        keep[name] = g.detach().clone()
    return keep


def _float32_reference(model, ids, check_experts: Optional[int]) -> Dict[str, Any]:
    """Logits and kept gradients of ``model`` evaluated in float32 (every parameter and buffer widened exactly, then
    restored to its own dtype), with transformers' ``eager`` experts loop (``torch._grouped_mm`` takes bf16 only)."""
    tensors = list(model.parameters()) + list(model.buffers())
    dtypes = [t.dtype for t in tensors]
    model.zero_grad(set_to_none=True)
    try:
        for t in tensors:
            if t.is_floating_point():
                t.data = t.data.float()
        model.set_experts_implementation("eager")
        out = _step(model, ids)
        ref = dict(logits=out.logits.detach().float(), grads=_kept_grads(model, check_experts))
        del out
    finally:
        model.zero_grad(set_to_none=True)
        for t, dt in zip(tensors, dtypes):
            if t.dtype != dt:
                t.data = t.data.to(dt)
        model.set_experts_implementation("grouped_mm")
    return ref


def _check(diffs: Dict[str, float], base_err: Dict[str, float], err: Dict[str, float],
           fp8: bool) -> Dict[str, Optional[str]]:
    """Per tensor: ``"fixed"`` within the fixed bound, else ``"ratio"`` within ``RATIO`` of the unpatched model's
    float32 error, else None (failed)."""
    tol, gtol = TOL[fp8]
    verdict: Dict[str, Optional[str]] = {}
    for k, d in diffs.items():
        if d < (tol if k == "logits" else gtol):
            verdict[k] = "fixed"
        elif RATIO[fp8] is not None and err[k] <= RATIO[fp8] * base_err[k] + FLOOR:
            verdict[k] = "ratio"
        else:
            verdict[k] = None
    return verdict


def run(opts: Dict[str, Any]) -> Dict[str, Any]:
    """Build, check and time the model; returns the results."""
    import transformers

    import tritile.hf

    args = argparse.Namespace(**opts)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    cfg, note = _config(args.model, args, device)
    tokens = args.tokens if args.tokens is not None else (4096 if on_gpu else 32)
    iters = args.iters if args.iters is not None else (10 if on_gpu else 1)
    warmup = args.warmup if args.warmup is not None else (2 if on_gpu else 1)
    check_experts = args.check_experts if args.check_experts is not None else (32 if on_gpu else None)
    baselines = ["grouped_mm", "eager"] if args.baseline == "both" else [args.baseline]

    torch.manual_seed(0)
    cls = transformers.DeepseekV3ForCausalLM if args.model == "deepseek_v3" else transformers.Qwen3MoeForCausalLM
    with torch.device(device):
        model = cls._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if args.model == "deepseek_v3":  # a correction bias that takes part in the ranking (transformers' init: zeros)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=device)
    num_experts = cfg.n_routed_experts if args.model == "deepseek_v3" else cfg.num_experts
    res: Dict[str, Any] = dict(model=args.model, layers=cfg.num_hidden_layers, tokens=tokens, fp8=args.fp8,
                               hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                               num_experts=num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                               vocab_size=cfg.vocab_size, device=str(device), note=note,
                               transformers=transformers.__version__)
    print(f"{args.model}: {cfg.num_hidden_layers} MoE layer(s), hidden {cfg.hidden_size}, {num_experts} experts of "
          f"width {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}, {tokens} tokens a step, "
          f"{'FP8' if args.fp8 else 'bf16'}, on {_device_name(device)}" + (f" ({note})" if note else ""),
          file=sys.stderr)

    ref = None
    if not args.no_check:
        model.set_experts_implementation("grouped_mm")
        inputs: List[torch.Tensor] = []
        hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
                 for b in _moe_blocks(model)]
        out = _step(model, ids)
        for h in hooks:
            h.remove()
        with torch.no_grad():
            sel = [_hf_selection(b, x) for b, x in zip(_moe_blocks(model), inputs)]
        ref = dict(logits=out.logits.detach().float(), grads=_kept_grads(model, check_experts), inputs=inputs, sel=sel)
        del out
        model.zero_grad(set_to_none=True)
        f32 = _float32_reference(model, ids, check_experts)
        ref["base_err"] = {"logits": _calc_diff(ref["logits"], f32["logits"])}
        for name, g in ref["grads"].items():
            if name in f32["grads"]:
                ref["base_err"][f"{name}.grad"] = _calc_diff(g.float(), f32["grads"][name].float())
        ref["f32"] = f32

    timing: Dict[str, float] = {}
    for impl in baselines:
        model.set_experts_implementation(impl)
        timing[f"hf_{impl}"] = _time(model, ids, device, iters, warmup)
        print(f"unpatched ({impl}): {timing[f'hf_{impl}']:.2f} ms a step", file=sys.stderr)
    model.set_experts_implementation("grouped_mm")

    tritile.hf.patch(model, fp8=args.fp8, alignment=None if on_gpu or not args.fp8 else 32)

    if ref is not None:
        out = _step(model, ids)
        tol, gtol = TOL[args.fp8]
        f32 = ref["f32"]
        logits = out.logits.detach().float()
        diffs = {"logits": _calc_diff(logits, ref["logits"])}
        err = {"logits": _calc_diff(logits, f32["logits"])}
        got = _kept_grads(model, check_experts)
        missing = sorted(set(ref["grads"]) ^ set(got))
        for name, g in ref["grads"].items():
            if name in got:
                diffs[f"{name}.grad"] = _calc_diff(got[name].float(), g.float())
                err[f"{name}.grad"] = _calc_diff(got[name].float(), f32["grads"][name].float())
        del out, got, logits
        model.zero_grad(set_to_none=True)
        mismatched = []
        with torch.no_grad():
            for i, (b, x, want) in enumerate(zip(_moe_blocks(model), ref["inputs"], ref["sel"])):
                idx, _ = b.route(x)
                mismatched.append(int((idx.sort(-1).values != want).any(-1).sum()))
        worst = max(((v, k) for k, v in diffs.items() if k != "logits"), default=(0.0, "-"))
        verdict = _check(diffs, ref["base_err"], err, args.fp8)
        failed = sorted(k for k, v in verdict.items() if v is None)
        ok = not missing and not failed and not any(mismatched)
        res["check"] = dict(ok=ok, logits_calc_diff=diffs["logits"], worst_grad=dict(name=worst[1], calc_diff=worst[0]),
                            calc_diff=diffs, tol=tol, grad_tol=gtol, tokens_with_other_experts=mismatched,
                            grads_missing=missing, expert_grads_compared_on=check_experts or num_experts,
                            float32=dict(ratio=RATIO[args.fp8], floor=FLOOR, patched=err, unpatched=ref["base_err"],
                                         within_ratio=sorted(k for k, v in verdict.items() if v == "ratio")),
                            failed=failed)
        del ref, f32
        print(f"check: {'ok' if ok else 'FAILED'} (logits calc_diff {diffs['logits']:.2e}, worst gradient "
              f"{worst[0]:.2e} on {worst[1]}, tokens routed to other experts per layer {mismatched})",
              file=sys.stderr)

    timing["tritile"] = _time(model, ids, device, iters, warmup)
    print(f"patched: {timing['tritile']:.2f} ms a step", file=sys.stderr)
    res["ms_per_step"] = timing
    res["tokens_per_s"] = {k: tokens / v * 1e3 for k, v in timing.items()}
    res["speedup"] = {k: v / timing["tritile"] for k, v in timing.items() if k != "tritile"}
    res["meta"] = _meta(device)
    return res


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"


def _meta(device) -> Dict[str, Any]:
    import triton

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=_device_name(device), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, interpreter=os.environ.get("TRITON_INTERPRET") == "1")


def print_report(res: Dict[str, Any], out=sys.stdout) -> None:
    """Markdown table of the step times and the check."""
    print(f"\n### {res['model']} in transformers {res['transformers']}: {res['layers']} MoE layer(s), hidden "
          f"{res['hidden_size']}, {res['num_experts']} experts of width {res['moe_intermediate_size']}, "
          f"top-{res['num_experts_per_tok']}, {res['tokens']} tokens a step, "
          f"{'FP8' if res['fp8'] else 'bf16'}, {res['meta']['device']}", file=out)
    if res.get("note"):
        print(f"\n({res['note']})", file=out)
    if res["meta"]["interpreter"]:
        print("\n(CPU: tritile's kernels run in Triton's interpreter; the times say nothing about speed)", file=out)
    print("\n| model | ms a step (fwd+bwd) | tokens/s | patched speed-up |", file=out)
    print("|---|---|---|---|", file=out)
    names = {"hf_grouped_mm": "unpatched, grouped_mm (transformers' default)", "hf_eager": "unpatched, eager",
             "tritile": "tritile.hf.patch" + (" (fp8)" if res["fp8"] else "")}
    for k, ms in res["ms_per_step"].items():
        sp = f"{res['speedup'][k]:.2f}x" if k in res["speedup"] else ""
        print(f"| {names[k]} | {ms:.2f} | {res['tokens_per_s'][k]:,.0f} | {sp} |", file=out)
    if "check" in res:
        c = res["check"]
        print(f"\ncheck: {'ok' if c['ok'] else 'FAILED'}; logits calc_diff {c['logits_calc_diff']:.1e} (bound "
              f"{c['tol']:.0e}), worst gradient {c['worst_grad']['calc_diff']:.1e} on {c['worst_grad']['name']} "
              f"(bound {c['grad_tol']:.0e}; expert gradients on {c['expert_grads_compared_on']} experts a layer), "
              f"tokens routed to other experts per layer: {c['tokens_with_other_experts']}", file=out)
        f = c.get("float32")
        if f:
            lg = (f["patched"]["logits"], f["unpatched"]["logits"])
            ratio = (f"{len(f['within_ratio'])} tensor(s) past the fixed bound pass within {f['ratio']:g}x the "
                     f"unpatched model's float32 error" if f["ratio"] is not None else "FP8: the fixed bounds alone")
            print(f"against float32: logits calc_diff {lg[0]:.1e} patched, {lg[1]:.1e} unpatched bf16; {ratio}"
                  + (f"; failed: {', '.join(c['failed'])}" if c["failed"] else ""), file=out)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for name in ("layers", "tokens", "experts", "iters", "check_experts"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    try:
        res = run(vars(args))
    except ImportError as e:
        raise SystemExit(f"demo hf: {e}") from None
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
