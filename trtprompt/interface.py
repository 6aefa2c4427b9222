"""Tensor names of the Triton interface that clients and the serving models share.

Declared once: the model-config writers of both targets (serve/launch/repository.py,
serve/launch/trtllm_model_config.py), the serving models and the client (trtprompt/client.py)
all read them here.
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
    # Speculative decoding (TensorRT-LLM's speculative_decoding perf metrics): accepted / verified draft tokens
    # (0 with none), and the two totals; 0 for a request that took no drafts.
    ("acceptance_rate", "FP32", [1], False),
    ("total_accepted_draft_tokens", "INT32", [1], False),
    ("total_draft_tokens", "INT32", [1], False),
)

# preprocessing's BOOL output the trtllm target's ensemble maps to the core's return_perf_metrics.
PERF_FLAG = "RETURN_PERF_METRICS"

# Where servers listen unless told otherwise and clients look first: loopback only (a safe
# default), Triton's own port numbers, the OpenAI-compatible front end next to them.
DEFAULT_HOST = "127.0.0.1"
HTTP_PORT = 8000
GRPC_PORT = 8001
METRICS_PORT = 8002
OPENAI_PORT = 8003
DEFAULT_GRPC_URL = f"{DEFAULT_HOST}:{GRPC_PORT}"

# TensorRT-LLM's KvCacheRetentionConfig inputs (tensorrtllm_backend's tensorrt_llm model, 1.2), optional, with
# its names, types and meaning: token ranges [start, end) of the prompt (end -1: to the prompt's end) each with a
# priority 0-100 and a duration in ms, then one priority and duration for the blocks decoding fills.
# docs/prefix-pool.md "Retention" maps them, and the OpenAI endpoint's cache_control / retention, to the engine.
# tensorrtllm_backend's guided decoding inputs (docs/structured-outputs.md, "Triton"), on both targets' models,
# and the guide types the torch target takes on them: tensorrtllm_backend 1.2 maps the first four; TensorRT-LLM's
# executor also has structural_tag, taken in vLLM's / xgrammar's form (engine/guide.py).
GUIDE_TYPE_INPUT, GUIDE_INPUT = "guided_decoding_guide_type", "guided_decoding_guide"
GUIDE_INPUTS: tuple[Tensor, ...] = ((GUIDE_TYPE_INPUT, "STRING", [1], True), (GUIDE_INPUT, "STRING", [1], True))
TRITON_GUIDE_TYPES: tuple[str, ...] = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
# trtprompt's per-request speculative decoding opt-out (docs/speculative-decoding.md), on the torch target's
# ensemble and token model (absent: true): false, this request takes no drafts (its greedy tokens are the same,
# its sampled ones drawn from the same distribution). TensorRT-LLM's models have no such input.
SPECULATION_INPUT = "speculative_decoding"
SPECULATION_INPUTS: tuple[Tensor, ...] = ((SPECULATION_INPUT, "BOOL", [1], True),)

RETENTION_INPUTS: tuple[Tensor, ...] = (
    ("retention_token_range_starts", "INT32", [-1], True),
    ("retention_token_range_ends", "INT32", [-1], True),
    ("retention_token_range_priorities", "INT32", [-1], True),
    ("retention_token_range_durations_ms", "INT32", [-1], True),
    ("retention_decode_priority", "INT32", [1], True),
    ("retention_decode_duration_ms", "INT32", [1], True),
)
