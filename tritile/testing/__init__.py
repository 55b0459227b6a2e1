"""Test and benchmark helpers: bitwise/normalised comparisons, shape generators, poisoning, timers."""

from ..runtime import poison_, poison_outputs, set_poison_outputs  # noqa: F401
from .generator import (  # noqa: F401
    full_test,
    generate_hidden_sizes,
    generate_num_tokens,
    generate_rand_float,
    get_device,
    is_gpu_run,
    pick,
)
from .numeric import assert_equal, calc_diff, check_bias, count_bytes  # noqa: F401
from .quant import clear_unused_sf  # noqa: F401
