"""Host cost per eager call of the latency-bound MoE gating/routing/mapping and small engram wrappers, on a GPU-less machine.

Two depths of stubbing (both on CPU tensors standing in for CUDA ones):

* ``wrapper``: ``JITFunction.run`` returns ``None`` at once, so a call costs the wrapper's own Python and torch work
  (argument checks, config lookups, allocations, views) plus the ``kernel[grid]`` proxy (a lambda);
* ``triton``: Triton 3.6's real Python launch path runs (``JITFunction.run``: the generated binder and
  ``native_specialize_impl`` per argument, ``compute_cache_key``, the global-value check, grid canonicalisation,
  ``launch_metadata``) against a fake sm_90 driver whose "compiled kernel" does nothing.  What a GPU adds on top:
  the C launcher (argument packing) and ``cuLaunchKernel`` itself.

``triton - wrapper`` is Triton's Python launch overhead per call (summed over the op's launches).

Tensors live on the CPU, so ``torch.empty`` is the CPU allocator's (cheaper than the CUDA caching allocator) and the
synchronising ``get_fused_mapping``'s ``.tolist()`` copies no device memory: the figures rank the host work, they are
not the GPU machine's absolute times.  Run without ``TRITON_INTERPRET``::

    python scripts/host_overhead.py [--n 2000] [--rounds 7] [--only topk] [--profile get_fused_mapping,top2]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run without TRITON_INTERPRET=1 (the launches are stubbed, not interpreted)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import tritile.runtime  # noqa: E402

LAUNCHES = [0]
_HOOKS = {}  # id(JITFunction) -> fn(args, kwargs, grid): what a stubbed launch must still write (see _gfm_hook)


class _FakeKernel:
    """What JITFunction.run needs of a compiled kernel; its launch only counts (and runs a hook, if any)."""
    function = None
    packed_metadata = None

    def __init__(self, hook):
        self.hook = hook

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, meta, lmeta, enter, exit_, *args):
        LAUNCHES[0] += 1
        if self.hook is not None:
            self.hook(args, None, (g0, g1, g2))


class _FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    # A real compile hashes the kernel and its callees (``cache_key``), which also records the globals that every
    # later launch compares (``used_global_vals``): do the same.
    self.cache_key
    kernel = _FakeKernel(_HOOKS.get(id(self)))
    self.device_caches[device][0][key] = kernel
    return kernel


_real_run = JITFunction.run


def _stub_run(self, *args, grid, warmup, **kwargs):
    LAUNCHES[0] += 1
    hook = _HOOKS.get(id(self))  # id: hashing a JITFunction computes its cache_key
    if hook is not None:
        hook(args, kwargs, grid)
    return None


def set_mode(mode: str) -> None:
    JITFunction.run = _stub_run if mode == "wrapper" else _real_run


driver.set_active(_FakeDriver())
JITFunction._do_compile = _fake_compile
tritile.runtime.kernel_device_ok = lambda device: True  # CPU tensors stand in for GPU ones

from tritile.engram import engram_hash, fused_weight, grad_w_reduce  # noqa: E402
from tritile.moe import (aux_fi, expand_to_fused, get_fused_mapping, group_count,  # noqa: E402
                         inplace_unique_group_indices, mask_indices_by_tp, normalize_weight, top2_sum_gate, topk_gate,
                         topk_sum_and_topk_group_idx)
from tritile.moe import get_fused_mapping_kernel as _gfm  # noqa: E402
from tritile.testing.generator import generate_topk_idx_rows  # noqa: E402
from tritile.torch.engram import make_offsets  # noqa: E402


def _gfm_hook(args, kwargs, grid):
    """The synchronising get_fused_mapping reads ``num_tokens_per_expert`` back: a stubbed scatter writes zeros
    there (a few words), so the host cuts valid (empty) views instead of views of garbage lengths."""
    a = dict(zip(_gfm._fused_mapping_scatter_kernel.arg_names, args), **(kwargs or {}))
    if a["FILL_TAIL"]:  # not the synchronising mode: nothing is read back
        return
    nprog = grid[0]
    tab = 0 if a["SINGLE"] else (nprog + 1) * a["BLOCK_E"]
    al = lambda x: (x + 31) // 32 * 32  # noqa: E731
    start = al(tab) + 3 * al(a["num_expanded"]) + 2 * al(a["num_experts"])
    a["buf_ptr"][start:start + a["num_experts"]].zero_()


_HOOKS[id(_gfm._fused_mapping_scatter_kernel)] = _gfm_hook


def cases():
    """GPU anchor shapes of tritile/moe/_bench_gating.py, _bench_fused.py and tritile/engram/_bench.py."""
    torch.manual_seed(0)
    dev = torch.device("cpu")
    c = {}
    scores = torch.randn(8001, 256)
    c["topk_gate"] = lambda: topk_gate(scores, 8)

    n, e, s, k, g, gk = 36, 256, 2, 8, 8, 4
    logits, bias = torch.randn(n, e), torch.randn(e)
    mask = torch.ones(n, dtype=torch.bool)
    mask[-4:] = False
    pmap = torch.arange(e + s, dtype=torch.int32).view(-1, 1).expand(-1, 33).contiguous()
    count = torch.ones(e + s, dtype=torch.int32)
    unm = torch.zeros(n, k, dtype=torch.int64)
    c["top2_sum_gate"] = lambda: top2_sum_gate(logits, bias, k, gk, g, True, s, 1.5, 0, 4, 1, 2, "softmax", mask=mask,
                                               to_physical_map=pmap, logical_count=count, unmapped_topk_idx=unm)
    c["top2_sum_gate (no optionals)"] = lambda: top2_sum_gate(logits, bias, k, gk, g, False, 0, 1.5, 0, 4, 1, 2,
                                                              "sigmoid")

    sc3 = torch.randn(8001, 8, 32)
    c["topk_sum_and_topk_group_idx"] = lambda: topk_sum_and_topk_group_idx(sc3, 2, 4)

    idx = generate_topk_idx_rows(21788, 8, 9, 8, dev)
    c["aux_fi"] = lambda: aux_fi(idx, 9, 1)
    c["group_count"] = lambda: group_count(idx, 9)
    c["mask_indices_by_tp"] = lambda: mask_indices_by_tp(idx, 72, 8, 0, 2)
    group = generate_topk_idx_rows(21783, 8, 9, 8, dev) // 9
    c["inplace_unique_group_indices"] = lambda: inplace_unique_group_indices(group, 8)

    topk_idx = generate_topk_idx_rows(36068, 9, 4, 64, dev)
    c["get_fused_mapping sync (N=0)"] = lambda: get_fused_mapping(topk_idx, 4, 0, 128)
    c["get_fused_mapping fixed (N>0)"] = lambda: get_fused_mapping(topk_idx, 4, 38144, 128)
    c["get_fused_mapping force_no_sync"] = lambda: get_fused_mapping(topk_idx, 4, 0, 128, force_no_sync=True)
    topk9 = generate_topk_idx_rows(21913, 8, 9, 8, dev)
    c["get_fused_mapping E=9 fixed"] = lambda: get_fused_mapping(topk9, 9, 176000, 16)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    t2p = torch.full((64, 8), -1, dtype=torch.int32)
    pe = torch.full((512,), -1, dtype=torch.int32)
    c["expand_to_fused"] = lambda: expand_to_fused(x, t2p, pe)
    w = torch.rand(21876, 8)
    c["normalize_weight"] = lambda: normalize_weight(w)

    wh = torch.randn(4, 7168, dtype=torch.bfloat16)
    we = torch.randn(4, 7168, dtype=torch.bfloat16)
    c["fused_weight"] = lambda: fused_weight(wh, we)
    ids = torch.randint(0, 100000, (8001, 3), dtype=torch.int32)
    mult = torch.randint(0, 100000, (2, 3), dtype=torch.int64)
    vocab = torch.randint(100000, 1000000, (2, 2, 8), dtype=torch.int32)
    offsets = make_offsets(vocab)
    # vocab_sizes on the CPU is inspected (a host check that a CUDA tensor skips): time both
    c["engram_hash (cpu: checks vocab)"] = lambda: engram_hash(ids, mult, vocab, offsets)
    partial = torch.randn(132, 4, 7168)
    gwh, gwe = torch.zeros(4, 7168), torch.zeros(4, 7168)
    c["grad_w_reduce"] = lambda: grad_w_reduce(partial, wh, we, gwh, gwe)
    c["(ref) torch.empty(64)"] = lambda: torch.empty(64, dtype=torch.int32)
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000, help="calls per timed round")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the minimum is reported")
    ap.add_argument("--only", default=None, help="only the cases whose name contains one of these (comma list)")
    ap.add_argument("--profile", default=None, help="cProfile (wrapper mode) the cases whose name contains one of "
                                                    "these (comma list)")
    ap.add_argument("--profile-mode", default="wrapper", choices=("wrapper", "triton"))
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    cs = cases()
    if args.only:
        keys = args.only.split(",")
        cs = {k: v for k, v in cs.items() if any(s in k for s in keys)}
    print(f"torch {torch.__version__}, triton {triton.__version__}; us per call, min over {args.rounds} interleaved "
          f"rounds of {args.n} calls")
    launches = {}
    for mode in ("wrapper", "triton"):
        set_mode(mode)
        for name, fn in cs.items():
            LAUNCHES[0] = 0
            fn()
            launches[name] = LAUNCHES[0]
            for _ in range(20):
                fn()
    best = {(name, mode): float("inf") for name in cs for mode in ("wrapper", "triton")}
    for _ in range(args.rounds):  # interleaved: a noisy, shared machine slows every case alike
        for mode in ("wrapper", "triton"):
            set_mode(mode)
            for name, fn in cs.items():
                t0 = time.perf_counter()
                for _ in range(args.n):
                    fn()
                best[name, mode] = min(best[name, mode], (time.perf_counter() - t0) * 1e6 / args.n)
    print(f"{'case':36s} {'wrapper':>8s} {'triton':>8s} {'launch':>8s} {'#':>3s}")
    for name in cs:
        w, t = best[name, "wrapper"], best[name, "triton"]
        print(f"{name:36s} {w:8.2f} {t:8.2f} {t - w:8.2f} {launches[name]:3d}")
    if args.profile:
        set_mode(args.profile_mode)
        keys = args.profile.split(",")
        for name, fn in cs.items():
            if any(s in name for s in keys):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.n):
                    fn()
                pr.disable()
                print(f"==== {name} ({args.profile_mode} mode, {args.n} calls)")
                pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
