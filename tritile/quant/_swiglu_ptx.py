"""PTX pieces shared by the fused SwiGLU blocks of the swiglu kernels (forward per-channel, forward per-token and
backward).  Each returns PTX text with the caller's register names; the scratch registers ``s, j, k, f, e`` (expf)
and ``z, e`` (division) must be declared by the caller's block.  The three exact rewrites of libdevice ``expf`` and
of the fast division are explained in ``_swiglu_channel_words_kernel``'s docstring."""

ONE = "0f3F800000"


def ptx_unpack_bf16_words(words, dst: str) -> str:
    """``dst{2i}`` / ``dst{2i+1}`` = the float32 of the low / high bf16 half of ``words[i]``."""
    return "".join(f"shl.b32 {dst}{2 * i}, {w}, 16; and.b32 {dst}{2 * i + 1}, {w}, 0xFFFF0000; "
                   for i, w in enumerate(words))


def ptx_one_plus_exp_neg(src: str, dst: str) -> str:
    """``dst = 1 + expf(-src)``: libdevice ``expf`` of ``-src`` with the sign flip folded into its constants, its
    ``cvt.sat`` into the first fma and its last multiply into ``1 + e * 2^n`` (one fma, an exact product)."""
    return (f"fma.rn.ftz.sat.f32 s, {src}, 0fBBBB989D, 0f3F000000; "   # sat(0.5 + (-src) * c1)
            "fma.rm.ftz.f32 j, s, 0f437C0000, 0f4B400001; "
            "add.rn.f32 k, j, 0fCB40007F; neg.f32 k, k; "
            f"fma.rn.ftz.f32 f, {src}, 0fBFB8AA3B, k; "              # (-src) * log2e - k
            f"fma.rn.ftz.f32 f, {src}, 0fB2A57060, f; "              # + (-src) * log2e_lo
            "ex2.approx.ftz.f32 e, f; shl.b32 j, j, 23; "
            f"fma.rn.f32 {dst}, e, j, {ONE}; ")                      # 1 + e * 2^n (exact product)


def ptx_abs_max(srcs) -> str:
    """``m = max |src|`` over ``srcs`` (float32; scratch ``a``)."""
    return f"abs.f32 m, {srcs[0]}; " + "".join(f"abs.f32 a, {x}; max.f32 m, m, a; " for x in srcs[1:])


def ptx_div_fast(num: str, den: str, q: str, rcp0: str, rcp: str, neg: str) -> str:
    """``q = num / den`` on the fast path (``_div_neg_fast``'s sequence, signed zeros kept): ``rcp0`` the approximate
    reciprocal, ``rcp`` the refined one (kept by callers that need ``1 / den``), ``neg`` a register for ``-rcp``."""
    return (f"rcp.approx.ftz.f32 {rcp0}, {den}; neg.f32 z, {den}; fma.rn.f32 e, z, {rcp0}, {ONE}; "
            f"fma.rn.f32 {rcp}, {rcp0}, e, {rcp0}; "
            f"mul.rn.f32 {q}, {num}, {rcp}; neg.f32 z, {num}; fma.rn.f32 e, {den}, {q}, z; neg.f32 {neg}, {rcp}; "
            f"fma.rn.f32 {q}, {neg}, e, {q}; ")
