"""tritile.hf.patch(model, ep_group=...) on 2 gloo ranks: each rank runs the same tiny model (DeepSeek-V3 and
Qwen3-MoE) on its own tokens and keeps half of the experts; the tokens reach their experts through tritile.ep.

Against the unpatched model on each rank's tokens: the logits and every non-expert gradient within the bf16 bound
of test_hf_patch.py (3e-4), and each rank's expert gradients against the sum over the ranks of the unpatched
gradients of those experts (every rank's tokens reach them).  The state dict keeps its keys, with this rank's
experts only; a full state dict loads into a rank's share.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers", minversion="5.0", reason="tritile.hf needs transformers >= 5 (pip install "
                                                             "'tritile[hf]')")

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case(rank: int, model_type: str) -> None:
    import tritile.hf
    from _hf_models import BF16_TOL, assert_close_runs, build, moe_blocks, step

    torch.manual_seed(1234)  # the same model on every rank
    model = build(model_type)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(100 + rank)
    ids = torch.randint(0, model.config.vocab_size, (1, 10 + 3 * rank))  # a different token count on each rank
    ref = step(model, ids)
    tritile.hf.patch(model, ep_group=dist.group.WORLD)
    block = moe_blocks(model)[0]
    num_experts, local = block.num_experts, block.num_local_experts
    assert local == num_experts // WORLD and block.experts.expert_offset == rank * local
    lo = rank * local
    state = model.state_dict()
    assert state.keys() == full.keys()
    for k, v in state.items():
        want = full[k][lo:lo + local] if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else full[k]
        assert torch.equal(v, want), k
    got = step(model, ids)
    # every rank's tokens reach the experts: their gradients are summed over the ranks
    expert_keys = [k for k in ref[1] if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert expert_keys
    for k in expert_keys:
        dist.all_reduce(ref[1][k])
        ref[1][k] = ref[1][k][lo:lo + local]
    assert_close_runs(got, ref, BF16_TOL, BF16_TOL)
    # a full state dict (a checkpoint of the unpatched model) loads into this rank's share
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(full)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _worker(rank: int, port: int, result_dir: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for model_type in ("deepseek_v3", "qwen3_moe"):
            _case(rank, model_type)
            open(os.path.join(result_dir, f"{model_type}{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU; tritile.modeling.moe's tests cover NCCL")
def test_patch_expert_parallel_gloo(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    assert sorted(os.listdir(tmp_path)) == sorted(f"{m}{r}" for m in ("deepseek_v3", "qwen3_moe") for r in range(WORLD))
