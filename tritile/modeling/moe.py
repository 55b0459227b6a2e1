"""``MoE``: a DeepSeek-V3 mixture-of-experts layer built from tritile's kernels, and ``PlainMoE``, the plain
PyTorch layer it is tested and benchmarked against.

Forward, per rank (T tokens of width H, E routed experts of which L = E / world_size live here, top-K)::

    gate      logits = x @ gate_weight.T (float32); top2_sum_gate -> topk_idx (T, K), topk_weights (T, K)
    dispatch  world size 1: the tokens stay; else tritile.ep.Buffer.dispatch (bf16, or FP8 with float32 or
              UE8M0 scales) -> received rows with local expert ids; get_fused_mapping (expert segments
              aligned to ``alignment`` rows) and expand_to_fused(_with_sf) -> x_f (N, H)
    gemm      h = x_f @ w13[e].T per expert segment (torch._grouped_mm, else a per-expert loop)
    act       act = silu(h[:, :I]) * h[:, I:] * routing weight: swiglu_forward_and_per_token_cast (FP8 mode)
              or the bf16 SwiGLU kernel of _swiglu_bf16.py (bf16 mode)
    gemm      y_f = act @ w2[e].T per segment
    combine   reduce_fused(y_f, None, token_topk_to_pos) -> one row per received token; world size 1: done,
              else tritile.ep.Buffer.combine (bf16, summed over ranks in ascending rank order)

plus the shared experts (a dense SwiGLU MLP, torch) added to the routed output.  Backward runs the reverse:
the cached dispatch of the output gradient, expand_to_fused (reduce_fused's transpose), the transposed grouped
GEMMs, the SwiGLU backward (swiglu_backward_and_per_token_cast in FP8 mode, whose weight gradient is the
routing weights' gradient), reduce_fused (expand's transpose), combine (dispatch's transpose), and the gate's
backward (sigmoid, normalisation and scaling of the selected scores).  In FP8 mode the weight gradients'
operands go through per_channel_cast_and_transpose (one scale per 128 tokens and column, the layout an FP8
weight-gradient GEMM reads) and are dequantized for the bf16 GEMM: torch has no block-scaled grouped GEMM.

Every stage runs inside ``StageTimer.stage(name)`` with the names of ``STAGES``, so callers (the demo, the
benchmark) can split the layer's time.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import moe as _moe
from .. import quant as _quant
from ..runtime import check_tensor, records_graph
from ._swiglu_bf16 import _swiglu_bf16, _swiglu_bf16_backward

__all__ = ["MoE", "PlainMoE", "StageTimer", "STAGES", "grouped_linear", "grouped_mm_available",
           "fp8_grouped_mm_available"]

STAGES = ("gate", "dispatch", "gemm", "act", "combine")


# ---------------------------------------------------------------------------------------------
# Stage timer
# ---------------------------------------------------------------------------------------------
class StageTimer:
    """Accumulates the time of named stages, per phase (``"fwd"`` / ``"bwd"``).

    On CUDA each stage is bracketed by CUDA events (no synchronisation until ``summary``); on the CPU by
    ``time.perf_counter``.  ``summary()`` returns ``{phase: {stage: milliseconds}}`` summed over the calls
    since the last ``reset()``.  In the backward a stage's entry is the time of its own backward (e.g.
    ``combine``: the cached dispatch of the output gradient and expand_to_fused; ``dispatch``: reduce_fused and
    the combine of the input gradient).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.phase = "fwd"
        self._cuda = self.device.type == "cuda"
        self._records: List[Tuple[str, str, object, object]] = []

    def reset(self) -> None:
        """Forget the recorded stages."""
        self._records.clear()

    @contextlib.contextmanager
    def stage(self, name: str):
        """Context manager: time the enclosed work as stage ``name`` of the current phase."""
        phase = self.phase
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._records.append((phase, name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._records.append((phase, name, t0, time.perf_counter()))

    def summary(self) -> Dict[str, Dict[str, float]]:
        """``{phase: {stage: milliseconds}}`` summed over the recorded calls (synchronises CUDA)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        out: Dict[str, Dict[str, float]] = {}
        for phase, name, a, b in self._records:
            ms = a.elapsed_time(b) if self._cuda else (b - a) * 1e3
            d = out.setdefault(phase, {})
            d[name] = d.get(name, 0.0) + ms
        return out


class _NullTimer:
    phase = "fwd"

    @staticmethod
    def stage(name: str):
        return contextlib.nullcontext()


_NULL_TIMER = _NullTimer()


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs over the fused (expert-major, aligned) layout
# ---------------------------------------------------------------------------------------------
def grouped_mm_available(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` (bf16) runs on ``device``: the CPU, or CUDA sm_90+ (Hopper and newer)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return False


_FP8_MM_OK: Dict[Tuple[str, int], bool] = {}


def fp8_grouped_mm_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` with row-wise scales runs on ``device`` (CUDA sm_90+) and agrees
    with a dequantized matmul on a small probe problem (checked once per device)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _FP8_MM_OK:
        ok = False
        if torch.cuda.get_device_capability(device) >= (9, 0):
            try:
                g, m, n, k = 2, 64, 64, 128
                a = torch.randn(g * m, k, device=device)
                b = torch.randn(g, n, k, device=device)
                aq, bq = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                sa = torch.rand(g * m, device=device) + 0.5
                sb = torch.rand(g, n, device=device) + 0.5
                offs = torch.arange(1, g + 1, device=device, dtype=torch.int32) * m
                y = torch._scaled_grouped_mm(aq, bq.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16)
                ref = torch.cat([(aq[i * m:(i + 1) * m].float() * sa[i * m:(i + 1) * m, None])
                                 @ (bq[i].float() * sb[i, :, None]).T for i in range(g)])
                ok = bool(((y.float() - ref).abs() <= 1e-2 * ref.abs() + 1e-1).all())
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _FP8_MM_OK[key] = ok
    return _FP8_MM_OK[key]


_GROUPED_MM_FAILED: Dict[str, str] = {}


def _grouped_mm_failed(kind: str, err: Exception) -> None:
    """Remember (and say once) that ``torch._grouped_mm`` refused a call of this kind; the loop takes over."""
    import warnings

    _GROUPED_MM_FAILED[kind] = str(err)
    warnings.warn(f"torch._grouped_mm failed ({kind}): {err}; using a per-expert loop instead", RuntimeWarning)


def _offsets(counts: List[int], device: torch.device) -> torch.Tensor:
    ends, s = [], 0
    for c in counts:
        s += c
        ends.append(s)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: List[int],
                   offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-expert linear map of the fused layout: ``out[p] = x[p] @ weight[e].T`` for the rows ``p`` of expert
    ``e``'s segment.

    Args:
        x: bf16 ``(N, K)``, ``N = sum(counts)``, expert-major (segment ``e`` is ``counts[e]`` rows long).
        weight: bf16 ``(E, M, K)`` (``nn.Linear`` layout per expert).
        counts: ``E`` segment lengths (host ints).
        offs: optional int32 ``(E,)`` cumulative segment ends on ``x``'s device (built when None).

    Returns:
        bf16 ``(N, M)`` (float32 accumulation).  ``torch._grouped_mm`` where available, else a per-expert loop.
    """
    n, e = x.shape[0], weight.shape[0]
    if n == 0:
        return x.new_zeros((0, weight.shape[1]))
    if grouped_mm_available(x.device) and "linear" not in _GROUPED_MM_FAILED:
        if offs is None:
            offs = _offsets(counts, x.device)
        try:
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
        except RuntimeError as e:  # a layout this torch build rejects: the loop below always works
            _grouped_mm_failed("linear", e)
    out = x.new_empty((n, weight.shape[1]))
    s = 0
    for i in range(e):
        c = counts[i]
        if c:
            torch.mm(x[s:s + c], weight[i].T, out=out[s:s + c])
        s += c
    return out


def _runs(idx: List[int]) -> List[Tuple[int, int]]:
    """``[a, b)`` ranges of consecutive integers covering the sorted list ``idx``."""
    out: List[Tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _grouped_wgrad(grad_t: torch.Tensor, x_t: torch.Tensor, counts: List[int],
                   offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dW[e] = grad_e.T @ x_e`` over the segments, from the transposed operands: ``grad_t`` bf16 ``(M, N)`` and
    ``x_t`` bf16 ``(K, N)`` (``N = sum(counts)`` rows of the fused layout) -> bf16 ``(E, M, K)``.

    Transposed operands are what the grouped kernel runs fastest on (row-major A, column-major B: H200, M = 4096,
    K = 7168, 128 rows an expert, 6.3 ms against 7.2 ms on the untransposed views); the FP8 path's casts produce
    them directly."""
    e = len(counts)
    out_shape = (e, grad_t.shape[0], x_t.shape[0])
    if grad_t.shape[1] == 0:
        return grad_t.new_zeros(out_shape)
    empty = [i for i, c in enumerate(counts) if not c]
    # The grouped kernel reduces over the segments: it asserts on the device (no error to catch; the CUDA context is
    # lost) unless every segment but the last is a multiple of 16 bytes of rows (8 bf16), as TMA needs.
    rows16 = 16 // grad_t.element_size()
    if (grouped_mm_available(grad_t.device) and "wgrad" not in _GROUPED_MM_FAILED
            and all(c % rows16 == 0 for c in counts[:-1])):
        if offs is None:
            offs = _offsets(counts, grad_t.device)
        try:
            # Experts without rows stay in the call (an empty group; only an all-empty call is rejected, and
            # that one returned above); not every GPU's kernel writes zeros for them (pytorch/pytorch#172439),
            # so their slices are cleared here: a memset per run of empty experts, no copy of the result.
            dw = torch._grouped_mm(grad_t.contiguous(), x_t.contiguous().T, offs=offs)
        except RuntimeError as err:
            _grouped_mm_failed("wgrad", err)
        else:
            for a, b in _runs(empty):
                dw[a:b].zero_()
            return dw
    dw = grad_t.new_empty(out_shape)
    s = 0
    for i in range(e):
        c = counts[i]
        if c:
            torch.mm(grad_t[:, s:s + c], x_t[:, s:s + c].T, out=dw[i])
        s += c
    for a, b in _runs(empty):
        dw[a:b].zero_()
    return dw


def _fp8_grouped_linear(xq: torch.Tensor, x_sf: torch.Tensor, wq: torch.Tensor, w_sf: torch.Tensor,
                        offs: torch.Tensor) -> torch.Tensor:
    """Row-wise scaled FP8 grouped GEMM: ``out[p] = (xq[p] * x_sf[p]) @ (wq[e] * w_sf[e, :, None]).T`` in bf16."""
    if xq.shape[0] == 0:
        return torch.zeros((0, wq.shape[1]), dtype=torch.bfloat16, device=xq.device)
    return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), x_sf.reshape(-1), w_sf, offs=offs,
                                    out_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Gate
# ---------------------------------------------------------------------------------------------
class _GateFn(torch.autograd.Function):
    """The gate: ``logits = x @ gate_weight.T`` (float32), then ``top2_sum_gate`` (sigmoid scoring).

    Forward: ``(topk_idx int64 (T, K), topk_weights float32 (T, K))``.  Backward: with ``s = sigmoid(l)`` at the
    selected experts, ``D = 1e-20 + sum_k s_k`` and ``w = s / D * c``:
    ``dl_k = s_k (1 - s_k) (c g_k - sum_j g_j w_j) / D`` at the selected columns (the bias only ranks and gets no
    gradient), then ``dx = dl @ gate_weight`` and ``d gate_weight = dl.T @ x``.
    """

    @staticmethod
    def forward(ctx, x, gate_weight, bias, num_topk, num_topk_groups, num_groups, scale, timer):
        with timer.stage("gate"):
            logits = F.linear(x.float(), gate_weight)
            idx, w = _moe.top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, False, 0, scale,
                                        0, 1, 0, 1, "sigmoid")
        ctx.save_for_backward(x, gate_weight, logits, idx, w)
        ctx.scale, ctx.timer = scale, timer
        ctx.mark_non_differentiable(idx)
        return idx, w

    @staticmethod
    def backward(ctx, _grad_idx, grad_w):
        x, gate_weight, logits, idx, w = ctx.saved_tensors
        timer = ctx.timer
        prev_phase, timer.phase = timer.phase, "bwd"
        try:
            with timer.stage("gate"):
                grad_logits = torch.zeros_like(logits)
                if logits.shape[0] and grad_w is not None:
                    s = torch.sigmoid(logits.gather(1, idx))
                    d = s.sum(-1, keepdim=True) + 1e-20
                    g = grad_w.float()
                    ds = (ctx.scale * g - (g * w).sum(-1, keepdim=True)) / d
                    grad_logits.scatter_(1, idx, ds * s * (1 - s))
                grad_x = (grad_logits @ gate_weight).to(x.dtype) if ctx.needs_input_grad[0] else None
                grad_gw = grad_logits.T @ x.float() if ctx.needs_input_grad[1] else None
        finally:
            timer.phase = prev_phase
        return grad_x, grad_gw, None, None, None, None, None, None


class _SharedFn(torch.autograd.Function):
    """The shared experts: one dense SwiGLU MLP ``y = (silu(x W_g.T) * (x W_u.T)) W_2.T`` (bf16 GEMMs, float32
    activation), with ``w13 = [W_g; W_u]`` (2I', H) and ``w2`` (H, I')."""

    @staticmethod
    def forward(ctx, x, w13, w2, timer):
        with timer.stage("gemm"):
            h = F.linear(x, w13)
        with timer.stage("act"):
            ones = torch.ones((x.shape[0],), dtype=torch.float32, device=x.device)
            act = _swiglu_bf16(h, ones)
        with timer.stage("gemm"):
            y = F.linear(act, w2)
        ctx.save_for_backward(x, h, w13, w2)
        ctx.timer = timer
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, h, w13, w2 = ctx.saved_tensors
        timer = ctx.timer
        prev_phase, timer.phase = timer.phase, "bwd"
        try:
            grad_y = grad_y.to(x.dtype)
            with timer.stage("gemm"):
                grad_act = grad_y @ w2
            with timer.stage("act"):
                ones = torch.ones((x.shape[0],), dtype=torch.float32, device=x.device)
                dh, act, _ = _swiglu_bf16_backward(h, ones, grad_act)
            with timer.stage("gemm"):
                dw2 = grad_y.T @ act
                dw13 = dh.T @ x
                dx = dh @ w13
        finally:
            timer.phase = prev_phase
        return dx, dw13, dw2, None


def _plain_routing(logits: torch.Tensor, bias: torch.Tensor, num_topk: int, num_groups: int,
                   num_topk_groups: int, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing in plain torch (differentiable in the logits)."""
    t, e = logits.shape
    scores = torch.sigmoid(logits)
    biased = scores.detach() + bias
    if num_groups != num_topk_groups:
        gscore = biased.view(t, num_groups, e // num_groups).topk(2, dim=-1).values.sum(-1)
        keep = gscore.topk(num_topk_groups, dim=-1).indices
        gmask = torch.zeros((t, num_groups), dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
        biased = biased.masked_fill(~gmask.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    idx = biased.topk(num_topk, dim=-1).indices
    w = scores.gather(1, idx)
    return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


# ---------------------------------------------------------------------------------------------
# Dispatch / combine back ends
# ---------------------------------------------------------------------------------------------
class _LocalComm:
    """World size 1: every expert is local, the tokens stay where they are."""

    world_size = 1
    rank = 0

    def dispatch(self, x, topk_idx, topk_weights):
        return x, topk_idx, topk_weights, None

    def combine(self, y, handle):
        return y

    def dispatch_grad(self, grad_y, handle):  # combine's transpose
        return grad_y

    def combine_grads(self, grad_x, grad_w, handle):  # dispatch's transpose (rows and routing weights)
        return grad_x, grad_w


class _EPComm:
    """Expert parallelism over a process group through ``tritile.ep.Buffer`` (DeepEP v1 calls)."""

    def __init__(self, group, num_experts: int):
        from .. import ep as _ep  # imported lazily: only multi-rank layers need it

        self.group = group
        self.num_experts = num_experts
        self.world_size = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)
        self.buffer = _ep.Buffer(group)

    def dispatch(self, x, topk_idx, topk_weights):
        ntr, _, nte, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=ntr,
            is_token_in_rank=in_rank, num_tokens_per_expert=nte, num_experts=self.num_experts)
        return recv_x, recv_idx, recv_w, handle

    def combine(self, y, handle):
        return self.buffer.combine(y, handle)[0]

    def dispatch_grad(self, grad_y, handle):
        return self.buffer.dispatch(grad_y, handle=handle)[0]

    def combine_grads(self, grad_x, grad_w, handle):
        # A slot's weight went to every rank its token went to, but only the rank owning the slot's expert
        # holds it as a local slot (the others see -1, with a zero gradient): the sum over ranks is the gradient.
        out = self.buffer.combine(grad_x, handle, topk_weights=grad_w.contiguous())
        return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# Routed experts: one autograd Function from the tokens to the combined output
# ---------------------------------------------------------------------------------------------
def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, with row-major strides even when ``t`` is empty (autograd hands out zero-stride
    empty gradients, which ``contiguous()`` keeps)."""
    return t.clone(memory_format=torch.contiguous_format) if t.numel() == 0 else t.contiguous()


def _row_weights(topk_weights: torch.Tensor, pos_to_token_topk: torch.Tensor) -> torch.Tensor:
    """float32 ``(N,)``: the routing weight of each fused row, 0 for padding rows."""
    flat = topk_weights.reshape(-1)
    valid = pos_to_token_topk >= 0
    if flat.numel() == 0:
        return torch.zeros(pos_to_token_topk.shape, dtype=torch.float32, device=flat.device)
    return torch.where(valid, flat[pos_to_token_topk.clamp(min=0).long()], flat.new_zeros(()))


def _dequant_bf16(q: torch.Tensor, sf: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    if q.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
    return _quant.cast_back((q, sf), "bf16", block)


def _fp8_wgrad_operand(t: torch.Tensor, npt: int) -> torch.Tensor:
    """``t`` (N, C) bf16 with ``N % npt == 0`` -> FP8 per (npt tokens x 1 column) and back, as ``(C, N)`` bf16.

    ``npt`` divides the expert alignment, so no scale block straddles two experts."""
    n = t.shape[0]
    if n == 0:
        return t.new_zeros((t.shape[1], 0))
    pad = -n % 128  # the cast wants whole 128-row blocks; zero rows form their own npt-row blocks
    src = torch.cat([t, t.new_zeros((pad, t.shape[1]))]) if pad else t.contiguous()
    q, sf = _quant.per_channel_cast_and_transpose(src, "e4m3", npt)
    return _quant.cast_back((q, sf.T), "bf16", (1, npt))[:, :n]


class _RoutedExpertsFn(torch.autograd.Function):
    """``y = combine(reduce_fused(ffn(expand(dispatch(x)))))`` with its backward; see the module docstring."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2, layer, timer, need_bwd):
        comm, fp8 = layer._comm, layer.fp8
        num_local = w13.shape[0]
        inter = w2.shape[2]
        with timer.stage("dispatch"):
            if fp8:
                payload = _quant.per_token_cast(x, "e4m3", 128, **layer._sf_flags())
                if layer.fp8_scale == "ue8m0":
                    payload = (payload[0], payload[1].contiguous())
            else:
                payload = x
            recv_x, recv_idx, recv_w, handle = comm.dispatch(payload, topk_idx, topk_weights)
            recv_w = recv_w.float().contiguous()
            pte, _, ptk, ttp, _, _, _, counts = _moe.get_fused_mapping(recv_idx.contiguous(), num_local, 0,
                                                                       layer.alignment)
            offs = _offsets(counts, x.device)
            if fp8:
                xq, xsf = _moe.expand_to_fused_with_sf(recv_x, 128, ttp, pte,
                                                       use_tma_aligned_col_major_sf=layer.fp8_scale == "ue8m0")
            else:
                x_f = _moe.expand_to_fused(recv_x, ttp, pte)
        with timer.stage("gemm"):
            fp8_mm = fp8 and layer._fp8_gemm()
            if fp8_mm:
                rq, rsf = _quant.per_token_cast((xq, xsf), "e4m3", xq.shape[1], x_block_size=(1, 128))
                w13q, w13s, w2q, w2s = layer._fp8_weights()
                h = _fp8_grouped_linear(rq, rsf, w13q, w13s, offs)
            else:
                if fp8:
                    x_f = _dequant_bf16(xq, xsf, (1, 128))
                h = grouped_linear(x_f, w13, counts, offs)
        with timer.stage("act"):
            if fp8:
                n = h.shape[0]
                if n:
                    npc = inter if fp8_mm else 128
                    aq, asf = _quant.swiglu_forward_and_per_token_cast(h, "e4m3", npc, ptk, recv_w, pte)
                    # the backward's SwiGLU input (only when a backward will run)
                    hq = _quant.per_token_cast(h, "e4m3", 128) if need_bwd else (None, None)
                else:
                    aq = torch.zeros((0, inter), dtype=torch.float8_e4m3fn, device=x.device)
                    asf = torch.zeros((0, 1), dtype=torch.float32, device=x.device)
                    hq = (h.new_zeros((0, 2 * inter), dtype=torch.float8_e4m3fn),
                          torch.zeros((0, 2 * inter // 128), dtype=torch.float32, device=x.device))
            else:
                w_row = _row_weights(recv_w, ptk)
                act = _swiglu_bf16(h, w_row)
        with timer.stage("gemm"):
            if fp8_mm:
                y_f = _fp8_grouped_linear(aq, asf, w2q, w2s, offs)
            else:
                if fp8:
                    act = _dequant_bf16(aq, asf, (1, 128))
                y_f = grouped_linear(act, w2, counts, offs)
        with timer.stage("combine"):
            if y_f.shape[0]:
                y_recv = _moe.reduce_fused(y_f, None, ttp)
            else:
                y_recv = y_f.new_zeros((ttp.shape[0], y_f.shape[1]))
            y = comm.combine(y_recv, handle)
        if not need_bwd:
            pass
        elif fp8:
            ctx.save_for_backward(xq, xsf, hq[0], hq[1], recv_w, pte, ptk, ttp, offs, w13, w2)
        else:
            ctx.save_for_backward(x_f, h, w_row, recv_w, pte, ptk, ttp, offs, w13, w2)
        ctx.counts, ctx.handle, ctx.layer, ctx.timer = counts, handle, layer, timer
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, grad_y):
        layer, timer, comm, counts, handle = ctx.layer, ctx.timer, ctx.layer._comm, ctx.counts, ctx.handle
        fp8 = layer.fp8
        if fp8:
            xq, xsf, hq, hsf, recv_w, pte, ptk, ttp, offs, w13, w2 = ctx.saved_tensors
            n = xq.shape[0]
        else:
            x_f, h, w_row, recv_w, pte, ptk, ttp, offs, w13, w2 = ctx.saved_tensors
            n = x_f.shape[0]
        prev_phase, timer.phase = timer.phase, "bwd"
        try:
            with timer.stage("combine"):
                grad_recv = comm.dispatch_grad(_dense(grad_y.to(torch.bfloat16)), handle)
                grad_yf = _moe.expand_to_fused(grad_recv, ttp, pte)
            with timer.stage("gemm"):
                grad_act = grouped_linear(grad_yf, w2.transpose(1, 2), counts, offs)
            with timer.stage("act"):
                if fp8:
                    if n:
                        act_w, _, dh, wgrad = _quant.swiglu_backward_and_per_token_cast(
                            (hq, hsf), grad_act, recv_w, ptk, ttp, 128)
                    else:
                        act_w = grad_act.new_zeros((0, w2.shape[2]))
                        dh = grad_act.new_zeros((0, w13.shape[1]))
                        wgrad = torch.zeros_like(recv_w)
                    npt = 128 if layer.alignment % 128 == 0 else 32
                    gy_t = _fp8_wgrad_operand(grad_yf, npt)
                    act_t = _fp8_wgrad_operand(act_w, npt)
                    dh_t = _fp8_wgrad_operand(dh, npt)
                    x_t = _fp8_wgrad_operand(_dequant_bf16(xq, xsf, (1, 128)), npt)
                else:
                    dh, act_w, d_row = _swiglu_bf16_backward(h, w_row, grad_act)
                    wgrad = torch.zeros(recv_w.numel(), dtype=torch.float32, device=recv_w.device)
                    valid = ptk >= 0
                    wgrad.index_put_((ptk[valid].long(),), d_row[valid])
                    wgrad = wgrad.view_as(recv_w)
            with timer.stage("gemm"):
                if fp8:
                    dw2 = _grouped_wgrad(gy_t, act_t, counts, offs)
                    dw13 = _grouped_wgrad(dh_t, x_t, counts, offs)
                else:
                    dw2 = _grouped_wgrad(grad_yf.T, act_w.T, counts, offs)
                    dw13 = _grouped_wgrad(dh.T, x_f.T, counts, offs)
                grad_xf = grouped_linear(dh, w13.transpose(1, 2), counts, offs)
            with timer.stage("dispatch"):
                if n:
                    grad_recv_x = _moe.reduce_fused(grad_xf, None, ttp)
                else:
                    grad_recv_x = grad_xf.new_zeros((ttp.shape[0], grad_xf.shape[1]))
                grad_x, grad_w = comm.combine_grads(_dense(grad_recv_x), wgrad, handle)
        finally:
            timer.phase = prev_phase
        return grad_x.view(ctx.x_shape), None, grad_w, dw13, dw2, None, None, None


@torch.compiler.disable
def _routed_experts(x, topk_idx, topk_weights, w13, w2, layer, timer):
    """``_RoutedExpertsFn.apply``, run eagerly under ``torch.compile``: its segment sizes come from a host sync
    (as DeepEP's dispatch does), so the compiled graph breaks around it."""
    need_bwd = records_graph(x, topk_weights, w13, w2)
    return _RoutedExpertsFn.apply(x, topk_idx, topk_weights, w13, w2, layer, timer, need_bwd)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------
def _shared_ffn(x: torch.Tensor, w13: Optional[torch.Tensor], w2: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if w13 is None:
        return None
    h = F.linear(x, w13)
    inter = h.shape[-1] // 2
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    return F.linear(act, w2)


def _check_config(hidden_size, num_experts, moe_intermediate_size, num_shared_experts, num_topk, num_groups,
                  num_topk_groups):
    for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts),
                    ("moe_intermediate_size", moe_intermediate_size), ("num_topk", num_topk)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be a non-negative int, got {num_shared_experts!r}")
    if num_topk > num_experts:
        raise ValueError(f"num_topk must be <= num_experts ({num_experts}), got {num_topk}")
    if not (isinstance(num_groups, int) and isinstance(num_topk_groups, int)) or num_groups < 1 \
            or not 1 <= num_topk_groups <= num_groups or num_experts % num_groups:
        raise ValueError(f"num_groups must divide num_experts ({num_experts}) and 1 <= num_topk_groups <= "
                         f"num_groups, got num_groups={num_groups!r}, num_topk_groups={num_topk_groups!r}")
    if num_groups != num_topk_groups and (num_groups > 32 or num_experts // num_groups < 2):
        raise ValueError(f"group-limited routing needs num_groups <= 32 and >= 2 experts per group, "
                         f"got num_groups={num_groups} for num_experts={num_experts}")
    if num_topk > num_topk_groups * (num_experts // num_groups):
        raise ValueError(f"num_topk ({num_topk}) exceeds the experts of num_topk_groups ({num_topk_groups}) groups")


class _MoEBase(nn.Module):
    def _init_params(self, hidden_size, num_experts, num_local, moe_intermediate_size, num_shared_experts,
                     device, dtype):
        h, inter = hidden_size, moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty((num_experts, h), device=device, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros((num_experts,), device=device,
                                                                    dtype=torch.float32))
        self.w13 = nn.Parameter(torch.empty((num_local, 2 * inter, h), device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty((num_local, h, inter), device=device, dtype=dtype))
        if num_shared_experts:
            si = num_shared_experts * inter
            self.shared_w13 = nn.Parameter(torch.empty((2 * si, h), device=device, dtype=dtype))
            self.shared_w2 = nn.Parameter(torch.empty((h, si), device=device, dtype=dtype))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal init with std ``1/sqrt(fan_in)``; bias ``0.1 * randn``."""
        h = self.hidden_size
        inter = self.moe_intermediate_size
        self.gate_weight.normal_(0, 1 / math.sqrt(h))
        self.e_score_correction_bias.normal_(0, 0.1)
        self.w13.normal_(0, 1 / math.sqrt(h))
        self.w2.normal_(0, 1 / math.sqrt(inter))
        if self.shared_w13 is not None:
            self.shared_w13.normal_(0, 1 / math.sqrt(h))
            self.shared_w2.normal_(0, 1 / math.sqrt(self.shared_w2.shape[1]))

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, dtypes=(torch.bfloat16,))
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (..., {self.hidden_size}) (hidden_size), got shape {tuple(x.shape)}")
        if x.device != self.w13.device:
            raise ValueError(f"x must be on the layer's device {self.w13.device}, got {x.device}")
        return x.reshape(-1, self.hidden_size)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, "
                f"moe_intermediate_size={self.moe_intermediate_size}, num_shared_experts={self.num_shared_experts}, "
                f"num_topk={self.num_topk}, num_groups={self.num_groups}, num_topk_groups={self.num_topk_groups}")


class PlainMoE(_MoEBase):
    """The same DeepSeek-V3 MoE layer written in plain PyTorch (bf16, no FP8): the baseline and test oracle.

    Routing in torch (sigmoid, group-limited top-k, normalised weights), then per expert: gather its tokens
    with ``index_select``, two bf16 matmuls and the SwiGLU between them, and ``index_add_`` of the
    weighted rows (float32 accumulation); plus the shared experts.  All experts are local.

    ``forward(x)``: x bf16 ``(..., H)`` -> bf16 ``(..., H)``.
    """

    def __init__(self, hidden_size: int = 7168, num_experts: int = 256, moe_intermediate_size: int = 2048,
                 num_shared_experts: int = 1, num_topk: int = 8, num_groups: int = 8, num_topk_groups: int = 4,
                 routed_scaling_factor: float = 2.5, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_config(hidden_size, num_experts, moe_intermediate_size, num_shared_experts, num_topk, num_groups,
                      num_topk_groups)
        self.hidden_size, self.num_experts, self.moe_intermediate_size = hidden_size, num_experts, moe_intermediate_size
        self.num_shared_experts, self.num_topk = num_shared_experts, num_topk
        self.num_groups, self.num_topk_groups = num_groups, num_topk_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
        self._init_params(hidden_size, num_experts, num_experts, moe_intermediate_size, num_shared_experts,
                          device, dtype)

    def route(self, x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx int64 (T, K), topk_weights float32 (T, K))`` of the flattened input ``x2`` (T, H)."""
        logits = F.linear(x2.float(), self.gate_weight)
        return _plain_routing(logits, self.e_score_correction_bias, self.num_topk, self.num_groups,
                              self.num_topk_groups, self.routed_scaling_factor)

    def forward(self, x: torch.Tensor, timer: Optional[StageTimer] = None) -> torch.Tensor:
        """x bf16 ``(..., H)`` -> bf16 ``(..., H)``; stages timed into ``timer`` when given."""
        timer = timer or _NULL_TIMER
        x2 = self._check_input(x)
        inter = self.moe_intermediate_size
        with timer.stage("gate"):
            idx, w = self.route(x2)
        with timer.stage("dispatch"):
            flat = idx.flatten()
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
            token_of = order // self.num_topk
        out = torch.zeros(x2.shape, dtype=torch.float32, device=x2.device)
        wflat = w.flatten()
        # One unbind per weight: its backward stacks the experts' gradients once (indexing the parameter per
        # expert would add a full-size zero-padded gradient per expert).
        w13s, w2s = self.w13.unbind(0), self.w2.unbind(0)
        s = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            sel = order[s:s + c]
            tok = token_of[s:s + c]
            s += c
            with timer.stage("dispatch"):
                xe = x2.index_select(0, tok)
            with timer.stage("gemm"):
                he = F.linear(xe, w13s[e])
            with timer.stage("act"):
                ae = (F.silu(he[:, :inter].float()) * he[:, inter:].float()).to(x2.dtype)
            with timer.stage("gemm"):
                ye = F.linear(ae, w2s[e])
            with timer.stage("combine"):
                out.index_add_(0, tok, ye.float() * wflat[sel, None])
        with timer.stage("gemm"):
            shared = _shared_ffn(x2, self.shared_w13, self.shared_w2)
        with timer.stage("combine"):
            y = out if shared is None else out + shared.float()
            y = y.to(x2.dtype)
        return y.view(x.shape)


class MoE(_MoEBase):
    """DeepSeek-V3 MoE layer from tritile's kernels, expert-parallel over ``group``.

    Args:
        hidden_size: H (7168 in DeepSeek-V3).
        num_experts: E routed experts in total (256); ``E % world_size == 0``, and rank r holds experts
            ``[r * L, (r + 1) * L)``, L = E / world_size.
        moe_intermediate_size: I, each expert's FFN width (2048).
        num_shared_experts: S shared experts, one dense SwiGLU MLP of width S * I (1).
        num_topk, num_groups, num_topk_groups: top-K (8) of the experts inside the ``num_topk_groups`` (4) best
            of ``num_groups`` (8) groups (group score: sum of its two best biased sigmoid scores).
        routed_scaling_factor: scale of the normalised routing weights (2.5).
        group: a ``torch.distributed`` process group for expert parallelism, or None (world size 1, no
            process group needed).
        fp8: FP8 (e4m3) activations: dispatch in FP8 with per-128-channel scales, SwiGLU output cast per token,
            backward through ``swiglu_backward_and_per_token_cast`` and ``per_channel_cast_and_transpose``.
            The GEMMs run in FP8 (``torch._scaled_grouped_mm``, row-wise scales) where
            ``fp8_grouped_mm_available`` says so, else in bf16 on the dequantized operands.  Needs H and I
            multiples of 128 and an alignment that is a multiple of 32 (128: one weight-gradient scale per 128
            tokens; else per 32).
        fp8_scale: ``'fp32'`` (float32 scales) or ``'ue8m0'`` (power-of-two scales packed 4 per int32) for the
            FP8 dispatch.
        alignment: rows per expert segment are padded to this multiple.  Default: 16 (the weight gradients'
            grouped GEMM needs segments of a multiple of 8 rows; others take a per-expert loop; padding rows cost
            GEMM work, ~A/2 rows per expert), 128 in FP8
            mode (the M tile of DeepGEMM-style FP8 GEMMs and the weight gradients' 128-token scale blocks).
        device, dtype: parameters' device; the expert and shared weights' dtype (bf16).

    Parameters: ``gate_weight`` float32 (E, H); buffer ``e_score_correction_bias`` float32 (E,) (ranking only,
    no gradient); ``w13`` (L, 2I, H) (the gate projection's rows first, then the up projection's); ``w2``
    (L, H, I); ``shared_w13`` (2SI, H) and ``shared_w2`` (H, SI) when S > 0.

    ``forward(x, timer=None)``: x bf16 ``(..., H)`` (any number of tokens, 0 included) -> bf16 ``(..., H)``.
    """

    def __init__(self, hidden_size: int = 7168, num_experts: int = 256, moe_intermediate_size: int = 2048,
                 num_shared_experts: int = 1, num_topk: int = 8, num_groups: int = 8, num_topk_groups: int = 4,
                 routed_scaling_factor: float = 2.5, group=None, fp8: bool = False, fp8_scale: str = "fp32",
                 alignment: Optional[int] = None, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_config(hidden_size, num_experts, moe_intermediate_size, num_shared_experts, num_topk, num_groups,
                      num_topk_groups)
        if dtype != torch.bfloat16:
            raise TypeError(f"dtype must be torch.bfloat16, got {dtype}")
        if fp8_scale not in ("fp32", "ue8m0"):
            raise ValueError(f"fp8_scale must be 'fp32' or 'ue8m0', got {fp8_scale!r}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        if alignment is None:
            alignment = 128 if fp8 else 16
        if not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be a positive int, got {alignment!r}")
        if fp8:
            if hidden_size % 128 or moe_intermediate_size % 128:
                raise ValueError(f"fp8 needs hidden_size and moe_intermediate_size divisible by 128, got "
                                 f"{hidden_size} and {moe_intermediate_size}")
            if alignment % 32:
                raise ValueError(f"fp8 needs an alignment that is a multiple of 32, got {alignment}")
        world = 1 if group is None else torch.distributed.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the group's size ({world})")
        self.hidden_size, self.num_experts, self.moe_intermediate_size = hidden_size, num_experts, moe_intermediate_size
        self.num_shared_experts, self.num_topk = num_shared_experts, num_topk
        self.num_groups, self.num_topk_groups = num_groups, num_topk_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.fp8, self.fp8_scale, self.alignment = bool(fp8), fp8_scale, alignment
        self.group = group
        self._comm = _LocalComm() if group is None or world == 1 else _EPComm(group, num_experts)
        self.num_local_experts = num_experts // world
        self._init_params(hidden_size, num_experts, self.num_local_experts, moe_intermediate_size,
                          num_shared_experts, device, dtype)
        self._fp8_cache: Optional[tuple] = None

    @property
    def rank(self) -> int:
        """This process's rank in ``group`` (0 without one)."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """The size of ``group`` (1 without one)."""
        return self._comm.world_size

    def _sf_flags(self) -> dict:
        ue = self.fp8_scale == "ue8m0"
        return dict(use_tma_aligned_col_major_sf=ue, round_sf=ue, use_packed_ue8m0=ue)

    def _fp8_gemm(self) -> bool:
        return fp8_grouped_mm_available(self.w13.device)

    def _fp8_weights(self):
        """Row-wise FP8 copies of w13 and w2 (per output channel scales), cached until the weights change."""
        key = (self.w13._version, self.w2._version, self.w13.data_ptr(), self.w2.data_ptr())
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            packs = []
            for w in (self.w13, self.w2):
                e, m, k = w.shape
                q, sf = _quant.per_token_cast(w.detach().reshape(e * m, k), "e4m3", k)
                packs += [q.view(e, m, k), sf.view(e, m)]
            self._fp8_cache = (key, tuple(packs))
        return self._fp8_cache[1]

    @torch.no_grad()
    def load_plain(self, plain: PlainMoE) -> "MoE":
        """Copy the weights of a full ``PlainMoE`` of the same configuration (this rank's experts only)."""
        if not isinstance(plain, PlainMoE):
            raise TypeError(f"plain must be a PlainMoE, got {type(plain).__name__}")
        for name in ("hidden_size", "num_experts", "moe_intermediate_size", "num_shared_experts", "num_topk",
                     "num_groups", "num_topk_groups", "routed_scaling_factor"):
            if getattr(plain, name) != getattr(self, name):
                raise ValueError(f"plain.{name} must be {getattr(self, name)}, got {getattr(plain, name)}")
        lo = self.rank * self.num_local_experts
        hi = lo + self.num_local_experts
        self.gate_weight.copy_(plain.gate_weight)
        self.e_score_correction_bias.copy_(plain.e_score_correction_bias)
        self.w13.copy_(plain.w13[lo:hi])
        self.w2.copy_(plain.w2[lo:hi])
        if self.shared_w13 is not None:
            self.shared_w13.copy_(plain.shared_w13)
            self.shared_w2.copy_(plain.shared_w2)
        return self

    def plain(self) -> PlainMoE:
        """A ``PlainMoE`` sharing this layer's parameters (world size 1 only): the baseline at no extra memory."""
        if self.world_size != 1:
            raise ValueError(f"plain() needs world size 1, got {self.world_size}; build a PlainMoE and "
                             f"load_plain() it instead")
        p = PlainMoE.__new__(PlainMoE)
        nn.Module.__init__(p)
        for name in ("hidden_size", "num_experts", "moe_intermediate_size", "num_shared_experts", "num_topk",
                     "num_groups", "num_topk_groups", "routed_scaling_factor"):
            setattr(p, name, getattr(self, name))
        p.gate_weight, p.w13, p.w2 = self.gate_weight, self.w13, self.w2
        p.register_buffer("e_score_correction_bias", self.e_score_correction_bias)
        p.shared_w13, p.shared_w2 = self.shared_w13, self.shared_w2
        return p

    def route(self, x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx int64 (T, K), topk_weights float32 (T, K))``: global expert ids, differentiable weights."""
        return self._route(x2, _NULL_TIMER)

    @torch.compiler.disable
    def _route(self, x2, timer):
        return _GateFn.apply(x2, self.gate_weight, self.e_score_correction_bias, self.num_topk,
                             self.num_topk_groups, self.num_groups, self.routed_scaling_factor, timer)

    def forward(self, x: torch.Tensor, timer: Optional[StageTimer] = None) -> torch.Tensor:
        """x bf16 ``(..., H)`` (any strides, 0 tokens included) -> bf16 ``(..., H)``; differentiable in ``x`` and
        every parameter.  ``timer`` (a ``StageTimer``) records the forward's and the backward's stages."""
        timer = timer or _NULL_TIMER
        x2 = _dense(self._check_input(x))
        idx, w = self._route(x2, timer)
        y = _routed_experts(x2, idx, w, self.w13, self.w2, self, timer)
        shared = None if self.shared_w13 is None else _SharedFn.apply(x2, self.shared_w13, self.shared_w2, timer)
        if shared is not None:
            with timer.stage("combine"):
                y = (y.float() + shared.float()).to(torch.bfloat16)
        return y.view(x.shape)
