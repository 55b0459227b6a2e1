"""``mhc_pre_big_fuse``: the inference form of ``mhc_pre`` in two launches
(``tile_kernels.modeling.mhc.ops.pre_big_fuse``)."""

from __future__ import annotations

from typing import Tuple

import torch

from tritile.mhc.norm_fn_kernel import check_norm_fn_inputs, flatten_residual
from tritile.mhc.pre_big_fuse_kernel import pre_big_fuse
from tritile.mhc._common import check_nonzero, check_positive
from tritile.runtime import check_contiguous, check_int, check_same_device, check_shape, check_tensor, custom_op
from tritile.runtime.plan import planned

__all__ = ["mhc_pre_big_fuse"]


def _fake(x, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat, n):
    T, D = x.shape
    return (x.new_empty((T, n), dtype=torch.float32), x.new_empty((T, n, n), dtype=torch.float32),
            x.new_empty((T, D // n), dtype=torch.bfloat16))


@custom_op("mhc_pre_big_fuse", fake=_fake)
def _big_fuse_op(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
                 pre_eps: float, sk_eps: float, post_mult: float, repeat: int, n: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return pre_big_fuse(x, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat, n)


@planned("mhc_pre_big_fuse")
def mhc_pre_big_fuse(residual: torch.Tensor, fn: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                     rms_eps: float, mhc_pre_eps: float, mhc_sinkhorn_eps: float, mhc_post_mult_value: float,
                     sinkhorn_repeat: int, n_splits: int = 16) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_pre_norm_fn`` (no norm weight) + ``mhc_pre_split_mixes`` + ``sinkhorn_normalize`` +
    ``mhc_pre_apply_mix`` in two kernels, without autograd (inference).

    Bitwise equal to ``mhc_pre_norm_fn(residual, fn, None, rms_eps, fuse_grad_acc=False)`` ->
    ``mhc_pre_split_mixes(mixes, mhc_scale, mhc_base, n, mhc_post_mult_value, mhc_pre_eps)`` ->
    ``sinkhorn_normalize(comb, sinkhorn_repeat, mhc_sinkhorn_eps)`` -> ``mhc_pre_apply_mix(residual, pre)``.

    Args:
        residual: bfloat16 ``(..., n, H)`` contiguous, ``n = 4``.
        fn: float32 ``(n3, n H)`` with ``n3 = n (n + 2) = 24``, contiguous (fold a norm weight in beforehand).
        mhc_scale: float32 ``(3,)``; mhc_base: float32 ``(n3,)``.
        rms_eps, mhc_pre_eps, mhc_sinkhorn_eps: the epsilons of the RMS, the pre sigmoid and Sinkhorn (positive).
        mhc_post_mult_value: the post multiplier (non-zero and finite).
        sinkhorn_repeat: Sinkhorn iterations, ``>= 1``.
        n_splits: accepted for compatibility and ignored.

    Returns:
        ``(post_mix, comb_mix, layer_input)``: float32 ``(..., n, 1)``, float32 ``(..., n, n)`` (after Sinkhorn,
        indexed ``[input stream, output stream]``) and bfloat16 ``(..., H)``.  The pre mix is not returned.

    Bits against TileKernels: the kernel after the GEMM is TileKernels' order (bitwise on the same GEMM outputs);
    the GEMM is not (see ``mhc_pre_norm_fn``): the mixes differ in their last bits, so the post and comb mixes
    differ within 1e-5 (measured 2.4e-7) and a layer input next to a bf16 rounding boundary by one ulp.
    """
    n, H, n3 = check_norm_fn_inputs(residual, fn, "fn")
    check_tensor("mhc_scale", mhc_scale, dtypes=(torch.float32,))
    check_shape("mhc_scale", mhc_scale, (3,))
    check_tensor("mhc_base", mhc_base, dtypes=(torch.float32,))
    check_shape("mhc_base", mhc_base, (n3,))
    check_same_device(residual=residual, mhc_scale=mhc_scale, mhc_base=mhc_base)
    check_contiguous("mhc_scale", mhc_scale)
    check_contiguous("mhc_base", mhc_base)
    check_int("sinkhorn_repeat", sinkhorn_repeat, 1)
    rms_eps = check_positive("rms_eps", rms_eps)
    mhc_pre_eps = check_positive("mhc_pre_eps", mhc_pre_eps)
    mhc_sinkhorn_eps = check_positive("mhc_sinkhorn_eps", mhc_sinkhorn_eps)
    mhc_post_mult_value = check_nonzero("mhc_post_mult_value", mhc_post_mult_value)
    x = flatten_residual(residual)
    post, comb, out = _big_fuse_op(x, fn, mhc_scale, mhc_base, float(rms_eps), float(mhc_pre_eps),
                                   float(mhc_sinkhorn_eps), float(mhc_post_mult_value), int(sinkhorn_repeat), n)
    outer = tuple(residual.shape[:-2])
    return post.view(*outer, n, 1), comb.view(*outer, n, n), out.view(*outer, H)
