"""``deep_ep`` resolved to ``tritile.ep`` (the import shim of ``scripts/deepep_tests.sh``)."""

from tritile.ep import (Buffer, Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap,  # noqa: F401
                        get_logical_domain_size, get_physical_domain_size, topk_idx_t)
