"""Shared ``@triton.jit`` helpers: exact number-format conversions and scale math.

Every narrowing conversion in tritile's kernels goes through these helpers, never a bare
``.to(tl.float8e4nv)`` / ``.to(tl.bfloat16)``: the CPU interpreter rounds those wrongly
(truncation, lost carries, no saturation).  Each helper has a software path (integer
arithmetic, exact everywhere) and, where the hardware cast is already round-to-nearest-even,
a hardware path used on GPUs.  Both give identical bits; ``tests/language`` proves it on
every finite bf16 pattern and a million random float32 values, on the CPU and the GPU.
"""

from .cast import (
    EMULATE,
    INTERPRET,
    bf16_bits_to_f32,
    ceil_pow2_exponent,
    e2m1_code_to_f32,
    e4m3_bits_to_f32,
    exp2_int,
    exp_f32,
    f32_to_bf16,
    f32_to_bf16_bits,
    f32_to_bf16_bits_sw,
    f32_to_e2m1_code,
    f32_to_e4m3_bits,
    f32_to_e4m3_bits_hw,
    f32_to_e4m3_bits_sw,
    f32_to_e5m6_code,
    f32_to_fp16_rtz_bits,
    pack_e2m1,
    quant_scale,
    round_scale_bits,
    sf_to_ue8m0,
    ue8m0_to_f32,
    unpack_e2m1,
)

__all__ = [
    "EMULATE",
    "INTERPRET",
    "bf16_bits_to_f32",
    "ceil_pow2_exponent",
    "e2m1_code_to_f32",
    "e4m3_bits_to_f32",
    "exp2_int",
    "exp_f32",
    "f32_to_bf16",
    "f32_to_bf16_bits",
    "f32_to_bf16_bits_sw",
    "f32_to_e2m1_code",
    "f32_to_e4m3_bits",
    "f32_to_e4m3_bits_hw",
    "f32_to_e4m3_bits_sw",
    "f32_to_e5m6_code",
    "f32_to_fp16_rtz_bits",
    "pack_e2m1",
    "quant_scale",
    "round_scale_bits",
    "sf_to_ue8m0",
    "ue8m0_to_f32",
    "unpack_e2m1",
]
