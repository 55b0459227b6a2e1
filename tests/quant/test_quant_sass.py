"""The GPU variants of the casts at small widths compile for sm_90 without a known ptxas fault (no GPU needed).

ptxas 12.8 (Triton 3.6's) builds the second byte of an e4m3 pair conversion from a stale register (the stack
pointer, or a constant the register held before) when a thread holds exactly two elements
(``tritile.testing.compile_check.stack_pointer_reads`` and ``stale_pair_merges``): every other code is wrong on
the GPU, right in the interpreter.  The launch rules avoid that layout; this test records the GPU configs' launches
of the casts at the widths where few elements fall to a thread and holds their SASS to the check.
"""

import os
import subprocess
import sys

import pytest
import torch

import tritile.runtime as rt
from tritile.quant import per_token_cast, swiglu_forward_and_per_token_cast
from tritile.testing import compile_check


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not compile_check.have_ptxas(),
                    reason="records the interpreter's launches and compiles them with Triton's bundled ptxas")
def test_small_width_casts_sass(tmp_path, monkeypatch):
    path = tmp_path / "launches.jsonl"
    monkeypatch.setattr(rt, "_INTERPRETER_CONFIGS", False)  # the GPU's launch configs
    uninstall = compile_check.install_recorder(str(path))
    try:
        for k in (64, 128, 192, 256, 320, 512):  # npc = K: one tile a row, 0.5 to 4 elements a thread
            for dt in (torch.bfloat16, torch.float32):
                per_token_cast(torch.randn(2, k).to(dt), "e4m3", k, None, False, True, False)
        for k in (128, 256, 512):  # QuantTensor inputs: FP8 (1, 128) and FP4 (1, 32) blocks, re-cast per token
            for src, xb in (("e4m3", 128), ("e2m1", 32)):
                qt = per_token_cast(torch.randn(2, k).bfloat16(), src, xb)
                for npc in sorted({128, k}):
                    per_token_cast(qt, "e4m3", npc, (1, xb))
        for h in (128, 256, 384):  # SwiGLU + cast, npc = H (one chunk a row) and npc = 128
            x = torch.randn(2, 2 * h).bfloat16()
            for npc in sorted({128, h}):
                swiglu_forward_and_per_token_cast(x, "e4m3", npc)
    finally:
        uninstall()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tritile.testing.compile_check", str(path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " 0 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
