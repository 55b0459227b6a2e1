"""The per-channel casts' SIGNED_ENC / FAST_DIV candidates (``tritile.runtime.override_config``) against the
references, bitwise, under the interpreter and on GPUs: per_channel_cast_fused (bf16 one-pass and streamed,
float32, FP8 input with scales, gathered), per_channel_cast_and_transpose (npt 32 and 128, permuted rows) and
the SwiGLU per-channel cast (clamp, transpose, round_sf), each with blocks holding inf/NaN.

SIGNED_ENC writes a NaN product's code as ``(e4m3(v) & 0x7F) | sign(x)`` (one byte merge per four codes)
instead of a compare-and-select: these tests pin that the bits do not change, NaN codes' signs included."""

import pytest
import torch

from tritile.runtime import override_config
from tritile.testing import assert_equal, is_gpu_run
from tritile.torch import cast, swiglu_forward
from tritile.torch.per_channel_cast_fused import per_channel_cast_fused as ref_fused
from tritile.torch.per_channel_cast_fused import per_channel_cast_values

try:
    from ._swiglu_utils import assert_codes_equal_nan_sign_free
except ImportError:
    from _swiglu_utils import assert_codes_equal_nan_sign_free

_NAN_OK = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0


def _poke(x):
    """Blocks with +inf, -inf, +NaN and -NaN (the NaN codes' signs must follow x).  The NaNs are written as bit
    patterns in x's own dtype: torch's CUDA float -> bf16 conversion turns every NaN into +NaN (0x7FC0), so a
    -NaN poked before the cast (or through a float scalar) loses its sign on the GPU."""
    x[3, 10] = float("inf")
    x[200, 70] = -float("inf")
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[x.dtype]
    quiet = -64 if x.dtype == torch.bfloat16 else -4194304  # 0xFFC0 / 0xFFC00000: sign, all-ones exponent, quiet
    x.view(ints)[4, 11] = quiet
    x.view(ints)[130, 12] = quiet & (0x7FFF if x.dtype == torch.bfloat16 else 0x7FFFFFFF)
    return x


@_NAN_OK
@pytest.mark.parametrize("config", [dict(BLOCK_K=64, ROWS_PER_STEP=128, VEC=8, SIGNED_ENC=2),
                                    dict(BLOCK_K=64, ROWS_PER_STEP=128, VEC=8, SIGNED_ENC=2, INT_POW2=True),
                                    dict(BLOCK_K=64, ROWS_PER_STEP=128, VEC=8, SIGNED_ENC=1),
                                    dict(BLOCK_K=128, ROWS_PER_STEP=32, VEC=8, SIGNED_ENC=1, INT_POW2=True),
                                    dict(BLOCK_K=32, ROWS_PER_STEP=128, VEC=8, num_warps=1, SIGNED_ENC=2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_channel_cast_fused_signed_enc(config, dtype, device):
    """Plain rows (256 x 192: a partial column tile for BLOCK_K=128) and a gathered map with padding rows."""
    from tritile.quant.per_channel_cast_fused_kernel import _launch

    x = _poke(torch.randn(256, 192, device=device).to(dtype))
    pos = torch.randint(-1, 256, (384,), device=device, dtype=torch.int32)
    pos[:4] = torch.tensor([3, 4, 130, 200], dtype=torch.int32)
    for rnd in (False, True):
        for p, rows in ((None, 256), (pos, 384)):
            with override_config("per_channel_cast_fused", **config):
                out, sf = _launch(x, None, False, p, rows, rnd)
            ref_out, ref_sf = ref_fused(x, 128, None, rnd, p)
            assert_equal(out, ref_out)
            assert_equal(sf, ref_sf)
    codes = out.view(torch.uint8)
    assert codes[0, 10] == 0x7F and codes[1, 11] == 0xFF and codes[3, 70] == 0xFF  # (+NaN may load signed)


@_NAN_OK
@pytest.mark.parametrize("signed_enc", [1, 2])
def test_per_channel_cast_fused_signed_enc_fp8_input(signed_enc, device):
    """An FP8 QuantTensor input (non-power-of-two scales, one infinite scale): the dequantized values' signs."""
    from tritile.quant import per_channel_cast_fused

    x = torch.randn(256, 256, device=device)
    q, s = cast(x, "e4m3", (1, 128))
    s = s.clone()
    s[5, 1] = float("inf")
    for config in (dict(SIGNED_ENC=signed_enc), dict(BLOCK_K=128, ROWS_PER_STEP=32, SIGNED_ENC=signed_enc)):
        with override_config("per_channel_cast_fused", **config):
            out, sf = per_channel_cast_fused((q, s), "e4m3", 128, False, 128)
        ref_out, ref_sf = ref_fused((q, s), 128, 128, False, None)
        assert_equal(out, ref_out)
        assert_equal(sf, ref_sf)


@_NAN_OK
@pytest.mark.parametrize("signed_enc", [1, 2])
@pytest.mark.parametrize("npt,bk,warps", [(128, 32, 2), (128, 64, 4), (32, 128, 2)])
def test_per_channel_cast_and_transpose_signed_enc(npt, bk, warps, signed_enc, device):
    """The GPU tiles (one scale block of rows, VEC=8, PERM) and the byte path (PACK_WORDS off, 128-row tiles
    for npt 32: SIGNED_ENC 2 falls back to 1 there)."""
    from tritile.quant.per_channel_cast_and_transpose_kernel import _launch

    x = _poke(torch.randn(256, 320, device=device).bfloat16())
    for rnd in (False, True):
        for config in (dict(BLOCK_M=npt, BLOCK_K=bk, num_warps=warps, VEC=8, PERM=True, PACK_WORDS=True),
                       dict(BLOCK_M=128, BLOCK_K=64, PACK_WORDS=False, VEC=0, PERM=False)):
            with override_config("per_channel_cast_and_transpose", **config, SIGNED_ENC=signed_enc,
                                 INT_POW2=signed_enc == 2):
                out, sf = _launch(x, npt, rnd)
            o, ref_sf = per_channel_cast_values(x.float(), npt, rnd)
            assert_equal(out, o.T.contiguous())
            assert_equal(sf, ref_sf)


@_NAN_OK
@pytest.mark.parametrize("fast_div,signed_enc,int_pow2", [(True, 0, False), (False, 2, False), (True, 2, True),
                                                         (True, 1, False), (False, 0, True)])
@pytest.mark.parametrize("npt", [32, 128])
def test_swiglu_per_channel_fast_paths(npt, fast_div, signed_enc, int_pow2, device):
    """FAST_DIV (the per-token kernel's division), SIGNED_ENC and INT_POW2 with the GPU tiles ([32, 32] x 1
    warp for npt 32, [128, 32] x 4 warps for 128), clamp off/on, transposed or not, round_sf off/on."""
    from tritile.quant import swiglu_forward_and_per_channel_cast_and_transpose as f

    hidden = 192  # 2H % 128 == 0; six 32-column tiles
    x = torch.randn((256, 2 * hidden), dtype=torch.bfloat16, device=device) * 4
    x[3, 5] = float("inf")
    x[40, hidden + 9] = -float("nan")
    x[200, 50] = -float("inf")
    tile = dict(BLOCK_M=32, BLOCK_K=32, num_warps=1) if npt == 32 else dict(BLOCK_M=128, BLOCK_K=32, num_warps=4)
    for clamp, wt, rnd in ((None, True, True), (0.5, False, False), (10.0, True, False), (None, False, True)):
        with override_config("swiglu_forward_and_per_channel_cast_and_transpose", **tile, VEC=8, FAST_DIV=fast_div,
                             SIGNED_ENC=signed_enc, INT_POW2=int_pow2):
            out, sf = f(x, "e4m3", npt, round_sf=rnd, without_transpose=wt, swiglu_clamp_value=clamp)
        act = swiglu_forward(x, swiglu_clamp_value=clamp).bfloat16()
        ref_out, ref_sf = cast(act, "e4m3", (npt, 1), round_sf=rnd)
        assert_equal(sf, ref_sf)
        # the sign of a NaN activation differs between torch and the kernels' backends (as in the op's tests)
        assert_codes_equal_nan_sign_free(out, ref_out if wt else ref_out.T.contiguous())


@_NAN_OK
def test_int_pow2_scale_every_bf16_amax(device):
    """INT_POW2 against the division for every positive bf16 amax (and inf, and values below the 1e-4
    clamp), under the backend's own arithmetic: one 128-row block per column, amax in row 0."""
    from tritile.quant.per_channel_cast_fused_kernel import _launch

    pats = torch.arange(0, 0x7F81, device=device, dtype=torch.int32).to(torch.int16)  # +0 .. +inf
    amax = pats.view(torch.bfloat16)
    k = 128 * ((amax.numel() + 127) // 128)
    x = torch.zeros(128, k, device=device, dtype=torch.bfloat16)
    x[0, :amax.numel()] = amax
    x[1, :amax.numel()] = -amax / 3
    outs = []
    for ip2 in (False, True):
        with override_config("per_channel_cast_fused", INT_POW2=ip2, BLOCK_K=64 if is_gpu_run() else 256):
            outs.append(_launch(x, None, False, None, 128, True))
    assert_equal(outs[1][0], outs[0][0])
    assert_equal(outs[1][1], outs[0][1])
    ref_out, ref_sf = ref_fused(x, 128, None, True, None)
    assert_equal(outs[1][1], ref_sf)

