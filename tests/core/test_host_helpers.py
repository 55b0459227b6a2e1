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
