"""The host-path helpers of tritile.runtime used by the latency-bound wrappers."""

from tritile.runtime import override_config, override_key


def test_override_key():
    assert override_key("tritile_test_op") is None
    with override_config("tritile_test_op", num_warps=8, BLOCK=64):
        k = override_key("tritile_test_op")
        assert k == (("BLOCK", 64), ("num_warps", 8))
        hash(k)
        with override_config("tritile_test_op", BLOCK=128):
            assert override_key("tritile_test_op") == (("BLOCK", 128), ("num_warps", 8))
        assert override_key("tritile_test_op") == k
    assert override_key("tritile_test_op") is None


def test_regs_per_thread():
    # the maxnreg that lets the warps fit one SM's 65536 registers, in steps of 8, within ptxas' 255 and 64 warps
    from tritile.runtime import regs_per_thread

    assert [regs_per_thread(w) for w in (1, 4, 16, 24, 32, 64, 128)] == [255, 255, 128, 80, 64, 32, 32]
    for w in range(1, 65):
        r = regs_per_thread(w)
        assert (r % 8 == 0 or r == 255) and r <= 255 and r * 32 * w <= 65536
