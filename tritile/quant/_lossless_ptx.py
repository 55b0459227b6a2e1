"""Byte permute (PTX ``prmt.b32``, generic mode) for the lossless FP4 -> FP8 word kernel.

``prmt(a, b, c)``: result byte ``i`` is byte ``s & 7`` of the 8-byte value ``{b, a}`` (bytes 0..3 of ``a``, 4..7 of
``b``), ``s = (c >> 4i) & 0xF`` (only ``c``'s low 16 bits count); when bit 3 of ``s`` is set the byte is replaced by
the replicated sign (bit 7) of the selected byte (0x00 or 0xFF).  One ``PRMT`` on the GPU (ptxas folds constant
operands); under the interpreter an integer stand-in computes the same bits (tests/quant/
test_per_block_cast_lossless_prmt.py checks it against a Python model of the PTX ISA definition; the PTX itself is
checked on the GPU only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.cast import EMULATE


@triton.jit
def _prmt_byte(a, b, s):
    """One result byte (0..255, int32) of ``prmt`` for the 4-bit selector ``s``."""
    k = s & 7
    src = tl.where(k < 4, a, b)
    v = (src >> ((k & 3) * 8)) & 0xFF
    return tl.where((s & 8) != 0, tl.where((v & 0x80) != 0, 0xFF, 0), v)


@triton.jit
def prmt(a, b, c):
    """``prmt.b32 d, a, b, c`` on int32 tensors (broadcast together): see the module docstring."""
    if EMULATE:
        r = _prmt_byte(a, b, c & 0xF)
        r |= _prmt_byte(a, b, (c >> 4) & 0xF) << 8
        r |= _prmt_byte(a, b, (c >> 8) & 0xF) << 16
        return r | (_prmt_byte(a, b, (c >> 12) & 0xF) << 24)
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
