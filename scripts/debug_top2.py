"""GPU-only probe of the top2_sum_gate physical-map failure (64 experts, 8 groups, 3 kept): mismatch counts per
launch config, with and without the map / fix / mask."""
import torch
import tritile.moe as moe
import tritile.moe.top2_sum_gate_kernel as K
from tritile.torch import top2_sum_gate as ref_gate
orig = K._config
def run(e, s, k, g, gk, func, cfg=None, n=5001, seed=0, fixp=0.3, maskp=0.8, pm=True):
    torch.manual_seed(seed); dev = "cuda"; x = 7
    logits = torch.randn(n, e, device=dev); bias = torch.randn(e, device=dev)
    pmap = torch.randint(0, e + x, (e + s, x + 1), dtype=torch.int32, device=dev)
    count = torch.randint(1, x + 2, (e + s,), dtype=torch.int32, device=dev)
    mask = torch.rand(n, device=dev) < maskp
    fix = torch.rand(n, device=dev) < fixp
    out = []
    for ep_rank, num_ep, tp_rank, num_tp in [(3, 4, 1, 2), (0, 2, 0, 1), (5, 6, 2, 3), (1, 9, 0, 1)]:
        unm = torch.randint(0, e, (n, k + 3), device=dev)[:, :k]
        args = (logits, bias, k, gk, g, True, s, 2.5, ep_rank, num_ep, tp_rank, num_tp, func)
        kw = dict(mask=mask, fix_routing_mask=fix, to_physical_map=pmap if pm else None,
                  logical_count=count if pm else None, unmapped_topk_idx=unm)
        kwr = dict(kw, unmapped_topk_idx=unm.clone())
        K._config.cache_clear() if hasattr(K._config, "cache_clear") else None
        if cfg is not None:
            K._config = lambda *a, **kk: cfg
        try:
            idx, w = moe.top2_sum_gate(*args, **kw)
        finally:
            K._config = orig
        idx_r, w_r = ref_gate(*args, **kwr)
        d = idx != idx_r; du = unm != kwr["unmapped_topk_idx"]
        out.append((int(d.sum()), int(du.sum()), d.sum(0).tolist()))
    return out
for func in ["sigmoid", "softmax"]:
    # the default config (grouped tiles padded to >= 128 slots), then the unpadded [1, 8, 8] tile that failed
    # on the H200 (2026-11-30: ~25 % of the slots) and other layouts of it
    print(func, "(64, 2, 8, 8, 3) default", run(64, 2, 8, 8, 3, func), flush=True)
    for cfg in [(1, 8, 8, 16, 1), (1, 8, 8, 16, 2), (2, 8, 8, 16, 1), (4, 8, 8, 16, 4), (1, 8, 16, 16, 1)]:
        print(func, "cfg", cfg, run(64, 2, 8, 8, 3, func, cfg=cfg), flush=True)
