"""Host cost per call of the latency-bound MoE wrappers on a GPU-less machine (get_fused_mapping, expand_to_fused,
normalize_weight), with the kernel launches stubbed at two depths:

* ``stub``: ``kernel[grid](...)`` returns at once: the wrapper's own Python and torch work only;
* ``triton``: Triton's real Python launch path runs (argument binding and specialisation, the cache-key lookup,
  ``launch_metadata``) against a fake sm_90 driver whose compiled kernel does nothing: everything but the C
  launcher and ``cuLaunchKernel`` itself (which a GPU adds: about 12 us per bare launch on the H200 machine,
  more with many arguments).

Tensors live on the CPU, so ``torch.empty`` is the CPU allocator's (cheaper than the CUDA caching allocator) and
the synchronising mode's ``.tolist()`` copies no device memory: the figures rank the host work, they are not the
GPU machine's absolute times.  Run without ``TRITON_INTERPRET``::

    python scripts/host_cost_moe.py [--n 3000] [--profile get_fused_mapping] [--baseline HEAD]

``--baseline REV`` also times ``get_fused_mapping`` as committed at ``REV`` (read with ``git show``), interleaved
with the working tree's, so that a shared, noisy machine affects both alike.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run without TRITON_INTERPRET=1 (the launches are stubbed, not interpreted)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import tritile.runtime  # noqa: E402

LAUNCHES = [0]


class _FakeKernel:
    """What JITFunction.run needs of a compiled kernel; its launch only counts."""
    function = None
    packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        LAUNCHES[0] += 1


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
    kernel = _FakeKernel()
    self.device_caches[device][0][key] = kernel
    return kernel


_real_getitem = JITFunction.__getitem__


def _stub_getitem(self, grid):
    def launch(*args, **kwargs):
        LAUNCHES[0] += 1
    return launch


def set_mode(mode: str) -> None:
    JITFunction.__getitem__ = _stub_getitem if mode == "stub" else _real_getitem


driver.set_active(_FakeDriver())
JITFunction._do_compile = _fake_compile
tritile.runtime.kernel_device_ok = lambda device: True  # CPU tensors stand in for GPU ones

from tritile.moe import expand_to_fused, get_fused_mapping, normalize_weight  # noqa: E402
from tritile.testing.generator import generate_topk_idx_rows  # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):  # best of 5 repeats: the machine is shared
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / n)
    return best


def cases():
    dev = torch.device("cpu")
    t, k, e, a = 36068, 9, 4, 128  # the bench anchor of get_fused_mapping
    topk_idx = generate_topk_idx_rows(t, k, e, 64, dev)
    n = 38144  # the bench's fixed size at this shape (the stubbed kernels write nothing to sum)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    t2p = torch.full((64, 8), -1, dtype=torch.int32)
    pe = torch.full((512,), -1, dtype=torch.int32)
    w = torch.rand(21876, 8)
    return {
        "get_fused_mapping sync (N=0)": lambda: get_fused_mapping(topk_idx, e, 0, a),
        "get_fused_mapping fixed (N>0)": lambda: get_fused_mapping(topk_idx, e, n, a),
        "get_fused_mapping force_no_sync": lambda: get_fused_mapping(topk_idx, e, 0, a, force_no_sync=True),
        "expand_to_fused": lambda: expand_to_fused(x, t2p, pe),
        "normalize_weight": lambda: normalize_weight(w),
        "torch.empty(64) (reference)": lambda: torch.empty(64, dtype=torch.int32),
    }


def baseline_cases(rev: str):
    """get_fused_mapping as committed at ``rev``, loaded as a module of the tritile.moe package."""
    src = subprocess.run(["git", "show", f"{rev}:tritile/moe/get_fused_mapping_kernel.py"], capture_output=True,
                         text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "get_fused_mapping_baseline.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("tritile.moe._gfm_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    gfm = mod.get_fused_mapping
    topk_idx = generate_topk_idx_rows(36068, 9, 4, 64, torch.device("cpu"))
    return {
        f"[{rev}] get_fused_mapping sync (N=0)": lambda: gfm(topk_idx, 4, 0, 128),
        f"[{rev}] get_fused_mapping fixed (N>0)": lambda: gfm(topk_idx, 4, 38144, 128),
        f"[{rev}] get_fused_mapping force_no_sync": lambda: gfm(topk_idx, 4, 0, 128, force_no_sync=True),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--profile", default=None, help="cProfile the cases whose name contains this")
    ap.add_argument("--baseline", default=None, help="git revision whose get_fused_mapping is timed too")
    args = ap.parse_args()
    cs = cases()
    if args.baseline:
        base = baseline_cases(args.baseline)
        cs = {k: v for pair in zip(list(cs.items())[:3], base.items()) for k, v in pair} | cs
    print(f"torch {torch.__version__}, triton {triton.__version__}; us per call (min over {args.rounds} interleaved "
          f"rounds of {args.n} calls)")
    best = {(name, mode): float("inf") for name in cs for mode in ("stub", "triton")}
    launches = {}
    for name, fn in cs.items():
        LAUNCHES[0] = 0
        fn()
        launches[name] = LAUNCHES[0]
        for _ in range(50):
            fn()
    for _ in range(args.rounds):  # interleaved: a noisy, shared machine slows every case alike
        for mode in ("stub", "triton"):
            set_mode(mode)
            for name, fn in cs.items():
                t0 = time.perf_counter()
                for _ in range(args.n):
                    fn()
                best[name, mode] = min(best[name, mode], (time.perf_counter() - t0) * 1e6 / args.n)
    print(f"{'case':40s} {'stub':>8s} {'triton':>8s} {'launches':>8s}")
    for name in cs:
        print(f"{name:40s} {best[name, 'stub']:8.2f} {best[name, 'triton']:8.2f} {launches[name]:8d}")
    if args.profile:
        set_mode("triton")
        for name, fn in cs.items():
            if args.profile in name:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.n):
                    fn()
                pr.disable()
                print(f"==== {name}")
                pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
