"""Tensor declarations shared by the model-config writers of both targets.

Its own module so that repository.py (the torch target's layouts) and
trtllm_model_config.py (the tensorrtllm backend's config) both import it
instead of each other.
"""

from __future__ import annotations

from typing import Sequence

# (name, Triton data type, dims, optional)
Tensor = tuple[str, str, Sequence[int], bool]

# The return_perf_metrics outputs, with TensorRT-LLM's names and types.
PERF_OUTPUTS: tuple[Tensor, ...] = (
    ("kv_cache_alloc_new_blocks", "INT32", [1], False),
    ("kv_cache_reused_blocks", "INT32", [1], False),
    ("kv_cache_alloc_total_blocks", "INT32", [1], False),
    ("arrival_time_ns", "INT64", [1], False),
    ("first_scheduled_time_ns", "INT64", [1], False),
    ("first_token_time_ns", "INT64", [1], False),
    ("last_token_time_ns", "INT64", [1], False),
)
