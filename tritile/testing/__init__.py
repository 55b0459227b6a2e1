"""Test and benchmark helpers: bitwise/normalised comparisons, shape generators, poisoning, timers."""

from ..runtime import poison_, poison_outputs, set_poison_outputs
from .generator import (
    full_test,
    generate_hidden_sizes,
    generate_num_tokens,
    generate_rand_float,
    get_device,
    is_gpu_run,
    pick,
)
from .numeric import assert_equal, assert_tree_equal, calc_diff, check_bias, count_bytes
from .quant import clear_unused_sf

__all__ = ["poison_", "poison_outputs", "set_poison_outputs", "full_test", "generate_hidden_sizes",
           "generate_num_tokens", "generate_rand_float", "get_device", "is_gpu_run", "pick", "assert_equal",
           "assert_tree_equal", "calc_diff", "check_bias", "count_bytes", "clear_unused_sf"]
