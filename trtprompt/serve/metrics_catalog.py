"""Every series trtprompt puts on Triton's /metrics, declared once.

The publisher (serve/triton_models/metrics_publisher.py) exports these, `trtprompt bench` reads them
back (bench/report.py), and docs/monitoring/ documents and charts them. Names
follow the TensorRT-LLM backend where it has the series (`nv_trt_llm_*`
gauges, kept exactly as the backend labels them) and Prometheus conventions
otherwise: `trtprompt_` prefix, base units, `_total` counters, `_seconds`
histograms. Pure data: no Triton import, so the bench and tests use it too.
Each value comes from one engine stats reply (engine_server.EngineService.stats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

Source = Callable[[Mapping[str, Any]], float]


def key(name: str) -> Source:
    return lambda stats: float(stats[name])


def _used_fraction(stats: Mapping[str, Any]) -> float:
    return stats["used_num_blocks"] / stats["max_num_blocks"] if stats["max_num_blocks"] else 0.0


# The TensorRT-LLM backend's gauge families: family -> (help, label name, {label value: source}). Routers
# read them by these names and labels (llm-d's endpoint picker: docs/monitoring/README.md, "What routers
# read"); every series also carries the backend's `model` and `version` labels (MODEL_LABELS).
BACKEND_GAUGES: dict[str, tuple[str, str, dict[str, Source]]] = {
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type", {
        "max": key("max_num_blocks"), "free": key("free_num_blocks"), "used": key("used_num_blocks"),
        "tokens_per": key("tokens_per_block"), "reused": key("reused_blocks"), "missed": key("missed_blocks"),
        "fraction": _used_fraction, "cache_hit_rate": key("cache_hit_rate"),
    }),
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type", {
        "active": key("active_requests"), "max": key("max_batch_size"), "scheduled": key("scheduled_requests"),
        "context": key("context_requests"), "waiting": key("waiting_requests"),
    }),
    "nv_trt_llm_inflight_batcher_metrics": ("TRT LLM inflight_batcher-specific metrics",
                                            "inflight_batcher_specific_metric", {
        "total_context_tokens": key("total_context_tokens"), "generation_requests": key("generation_requests"),
        "paused_requests": key("paused_requests"),
        # One micro batch per step (no pipeline parallelism), so its id is always 0, as on the backend at pp=1.
        "micro_batch_id": lambda s: 0.0,
    }),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type", {
        "timestamp": lambda s: float(s["timestamp_ns"] // 1000), "iteration_counter": key("iteration_counter"),
    }),
    # The backend's `cpu` is the runtime's host memory: here the engine process's resident bytes. Its `gpu`
    # and `pinned` have no counterpart the engine counts, so they are not exported.
    "nv_trt_llm_runtime_memory_metrics": ("TRT LLM runtime memory metrics", "memory_type", {
        "cpu": key("process_resident_memory_bytes"),
    }),
}
MODEL_LABELS = ("model", "version")  # values: the publishing Triton model's name and version
KV_FAMILY = "nv_trt_llm_kv_cache_block_metrics"
REQUEST_FAMILY = "nv_trt_llm_request_metrics"

# Why a request ended, as counted by trtprompt_requests_finished_total's `reason` label.
# end_id: the end token; stop: a stop word; invalid / rejected_queue_full: refused
# before running (by the serving models or the engine); error: failed while running.
FINISH_REASONS = ("length", "stop", "end_id", "aborted", "error", "rejected_queue_full", "invalid")


@dataclass(frozen=True)
class Series:
    """One trtprompt_* family: a counter or gauge read from the stats reply."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    source: Source


PREFIX_QUERIED_BLOCKS = "trtprompt_prefix_cache_queried_blocks_total"
PREFIX_HIT_BLOCKS = "trtprompt_prefix_cache_hit_blocks_total"
PREFIX_QUERIED_TOKENS = "trtprompt_prefix_cache_queried_tokens_total"
PREFIX_HIT_TOKENS = "trtprompt_prefix_cache_hit_tokens_total"
EVICTED_BLOCKS = "trtprompt_prefix_cache_evicted_blocks_total"
FRAGMENTATION = "trtprompt_kv_cache_fragmentation_ratio"
PREEMPTIONS = "trtprompt_preemptions_total"
PROMPT_TOKENS = "trtprompt_prompt_tokens_total"
GENERATION_TOKENS = "trtprompt_generation_tokens_total"
RESTARTS = "trtprompt_engine_restarts_total"
PROCESS_CPU = "trtprompt_engine_process_cpu_seconds_total"
PROCESS_RSS = "trtprompt_engine_process_resident_memory_bytes"

# The engine's KV event publisher (engine/kv_events.py, docs/kv-events.md): name -> (help, stats key). 0 with
# KV events off. A dropped batch is one step's events the publisher thread was too far behind to take.
KV_EVENT_COUNTERS: dict[str, tuple[str, str]] = {
    "trtprompt_kv_events_published_batches_total": ("KV event batches sent on the ZMQ PUB socket",
                                                    "kv_events_published_batches"),
    "trtprompt_kv_events_published_events_total": ("KV events (stored, removed, cleared) in the batches sent",
                                                   "kv_events_published_events"),
    "trtprompt_kv_events_dropped_batches_total": ("KV event batches dropped: the publisher's queue was full",
                                                  "kv_events_dropped_batches"),
    "trtprompt_kv_events_dropped_events_total": ("KV events in the dropped batches", "kv_events_dropped_events"),
    "trtprompt_kv_events_replay_requests_total": ("Replay requests answered on the KV event replay socket",
                                                  "kv_events_replay_requests"),
}

# Speculative decoding (engine/speculation/, docs/speculative-decoding.md), from the engine's cumulative
# EngineStats.spec_* counts; 0 without speculation. Named after vLLM's spec_decode counters (vllm:spec_decode_num_*,
# exported with _total), two of which TensorRT-LLM's trtllm-serve exports under the same names
# (trtllm_spec_decode_num_draft_tokens_total, trtllm_spec_decode_num_accepted_tokens_total, from its iteration
# stats' specDecodingStats numDraftTokens / numAcceptedTokens). The Triton tensorrtllm backend exports none.
SPEC_DRAFTS = "trtprompt_spec_decode_num_drafts_total"  # vllm:spec_decode_num_drafts
SPEC_DRAFT_TOKENS = "trtprompt_spec_decode_num_draft_tokens_total"  # vllm:spec_decode_num_draft_tokens
SPEC_ACCEPTED_TOKENS = "trtprompt_spec_decode_num_accepted_tokens_total"  # vllm:spec_decode_num_accepted_tokens
# vllm:spec_decode_num_accepted_tokens_per_pos{position} (TensorRT-LLM: trtllm_spec_decode_accepted_tokens_total
# {token_position}): one series per draft position 0 .. max_draft_len - 1, the verifications whose draft token
# at that position was accepted (so position i's count over the drafts is the chance to get i + 1 drafts right).
SPEC_ACCEPTED_PER_POS = "trtprompt_spec_decode_num_accepted_tokens_per_pos_total"
SPEC_ACCEPTED_PER_POS_HELP = "Verifications whose draft token at `position` (0-based) was accepted"
SPEC_POSITION_LABEL = "position"
# Derived, since the engine process started (as the backend's cache_hit_rate): over a window, take the rate()
# of the counters instead (docs/monitoring/README.md, "Speculative decoding").
SPEC_ACCEPTANCE_RATE = "trtprompt_spec_decode_acceptance_rate"
SPEC_ACCEPTANCE_LENGTH = "trtprompt_spec_decode_acceptance_length"  # TensorRT-LLM's acceptanceLength


def spec_acceptance_rate(stats: Mapping[str, Any]) -> float:
    """Accepted / drafted tokens (what TensorRT-LLM's per-request acceptance_rate is for one request); 0
    before the first draft."""
    drafted = stats["spec_num_draft_tokens"]
    return stats["spec_num_accepted_tokens"] / drafted if drafted else 0.0


def spec_acceptance_length(stats: Mapping[str, Any]) -> float:
    """Tokens a verification yields on average: 1 + accepted / drafts (the token the target model adds after
    the accepted drafts counts, as vLLM's mean acceptance length and TensorRT-LLM's acceptanceLength count
    it); 0 before the first draft (a real value is >= 1)."""
    drafts = stats["spec_num_drafts"]
    return 1.0 + stats["spec_num_accepted_tokens"] / drafts if drafts else 0.0


SERIES: tuple[Series, ...] = (
    Series(PREFIX_QUERIED_BLOCKS, "counter", "Full prompt blocks looked up in the prefix cache",
           lambda s: float(s["reused_blocks"] + s["missed_blocks"])),
    Series(PREFIX_HIT_BLOCKS, "counter", "Prompt blocks found in the prefix cache and reused", key("reused_blocks")),
    Series(PREFIX_QUERIED_TOKENS, "counter", "Prompt tokens of requests looked up in the prefix cache",
           key("queried_tokens")),
    Series(PREFIX_HIT_TOKENS, "counter", "Prompt tokens served from reused prefix-cache blocks", key("hit_tokens")),
    Series(EVICTED_BLOCKS, "counter", "Reusable KV blocks evicted from the prefix cache to be handed out again",
           key("evicted_blocks")),
    Series(FRAGMENTATION, "gauge", "Share of the KV slots held for requests that hold no token "
           "(docs/monitoring/README.md)", key("fragmentation")),
    Series(PREEMPTIONS, "counter", "Requests preempted (their KV blocks freed, recomputed later)",
           key("preemptions")),
    Series(PROMPT_TOKENS, "counter", "Prompt tokens of finished requests (counted when a request ends)",
           key("prompt_tokens")),
    Series(GENERATION_TOKENS, "counter", "Output tokens of finished requests (counted when a request ends)",
           key("generation_tokens")),
    Series(RESTARTS, "counter", "Times the launcher restarted a dead engine process", key("restarts")),
    Series(PROCESS_CPU, "counter", "User and system CPU time of the engine process", key("process_cpu_seconds")),
    Series(PROCESS_RSS, "gauge", "Resident memory of the engine process", key("process_resident_memory_bytes")),
    *(Series(name, "counter", help_text, key(field)) for name, (help_text, field) in KV_EVENT_COUNTERS.items()),
    Series(SPEC_DRAFTS, "counter", "Speculative decoding verifications of at least one draft token (one per "
           "request and step)", key("spec_num_drafts")),
    Series(SPEC_DRAFT_TOKENS, "counter", "Draft tokens verified by speculative decoding",
           key("spec_num_draft_tokens")),
    Series(SPEC_ACCEPTED_TOKENS, "counter", "Draft tokens the model accepted", key("spec_num_accepted_tokens")),
    Series(SPEC_ACCEPTANCE_RATE, "gauge", "Accepted / verified draft tokens since the engine process started "
           "(0 before the first draft)", spec_acceptance_rate),
    Series(SPEC_ACCEPTANCE_LENGTH, "gauge", "Mean tokens per verification, 1 + accepted tokens / drafts, since the "
           "engine process started (0 before the first draft)", spec_acceptance_length),
)

# Tiers below the KV pool (docs/prefix-pool.md), one counter family per figure with a `tier` label
# (disk, redis): family -> (help, key of the engine's per-tier stats, EngineStats.kv_tiers).
TIERS = ("disk", "redis")
TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "trtprompt_kv_tier_hit_blocks_total": ("KV blocks loaded from a tier into the pool and reused", "hit_blocks"),
    "trtprompt_kv_tier_misses_total": ("Block lookups a tier could not answer", "misses"),
    "trtprompt_kv_tier_read_bytes_total": ("Bytes read from a tier", "bytes_read"),
    "trtprompt_kv_tier_written_bytes_total": ("Bytes written to a tier", "bytes_written"),
    "trtprompt_kv_tier_dropped_writes_total": ("Block writes a tier did not take (queue full, store full or down)",
                                               "drops"),
    "trtprompt_kv_tier_evictions_total": ("Entries a tier removed to stay within its budget", "evictions"),
    "trtprompt_kv_tier_errors_total": ("Faults a tier saw (I/O errors, timeouts, entries failing verification)",
                                       "errors"),
}


def spec_position_values(stats: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(SPEC_ACCEPTED_PER_POS, position) -> count, for every draft position the engine counts (none without
    speculation)."""
    return {(SPEC_ACCEPTED_PER_POS, str(i)): float(n) for i, n in enumerate(stats["spec_accepted_per_pos"])}


def tier_counter_values(stats: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(family, tier) -> count, for every tier family and tier (0 for a tier not configured)."""
    by_tier = {t["name"]: t for t in stats.get("kv_tiers", ())}
    return {(family, tier): float(by_tier.get(tier, {}).get(field, 0))
            for family, (_help, field) in TIER_COUNTERS.items() for tier in TIERS}


FINISHED = "trtprompt_requests_finished_total"
FINISHED_HELP = "Requests ended, by reason (length, stop, end_id, aborted, error, rejected_queue_full, invalid)"

# Per LoRA adapter (engine/lora/, docs/lora.md), from the stats reply's `lora` (engine_process/counters.py,
# AdapterCounters), labelled `lora_name` (vLLM's word for an adapter's name, as in its KV events). Base-model
# requests carry no series here: the unlabelled families above count every request, adapters' included.
# A series exists while the engine knows its adapter (or runs a request of it): unloading an adapter drops
# its series once its last request ends, so the label's values stay bounded by the adapters loaded.
LORA_LABEL = "lora_name"
LORA_FINISHED = "trtprompt_lora_requests_finished_total"
LORA_FINISHED_HELP = "Requests of a LoRA adapter ended, by reason (as trtprompt_requests_finished_total)"
LORA_TOKENS: dict[str, tuple[str, str]] = {  # family -> (help, key of the adapter's counts)
    "trtprompt_lora_prompt_tokens_total": ("Prompt tokens of a LoRA adapter's finished requests", "prompt_tokens"),
    "trtprompt_lora_generation_tokens_total": ("Output tokens of a LoRA adapter's finished requests",
                                               "generation_tokens"),
}
# vLLM's vllm:lora_requests_info, under its label names: one series whose labels are the adapters with
# requests running (here: started, i.e. past their first output) and waiting (not yet started), each a
# comma-separated sorted list, and max_lora (the max_loras knob). Its value is the Unix time of the poll
# that set it, as vLLM sets it; the series of the previous label values is removed, so only one exists.
LORA_INFO = "trtprompt_lora_requests_info"
LORA_INFO_HELP = ("LoRA adapters with requests running and waiting (labels, comma-separated) and max_lora; "
                  "value: when it was last set (Unix seconds)")
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


def lora_counter_values(stats: Mapping[str, Any]) -> dict[tuple[str, str, str], float]:
    """(family, adapter, reason or "") -> cumulative count, for every adapter in the stats reply."""
    out: dict[tuple[str, str, str], float] = {}
    for name, counts in stats.get("lora", {}).get("adapters", {}).items():
        out.update({(LORA_FINISHED, name, reason): float(counts["finished"].get(reason, 0))
                    for reason in FINISH_REASONS})
        out.update({(family, name, ""): float(counts[field]) for family, (_help, field) in LORA_TOKENS.items()})
    return out


def lora_info_labels(stats: Mapping[str, Any]) -> dict[str, str]:
    """trtprompt_lora_requests_info's label values from one stats reply."""
    lora = stats.get("lora", {})
    return {"max_lora": str(lora.get("max_lora", 0)), "waiting_lora_adapters": ",".join(lora.get("waiting", ())),
            "running_lora_adapters": ",".join(lora.get("running", ()))}


def lora_families() -> list[str]:
    """The per-adapter families: apart from trtprompt_families(), since an engine without adapters has none
    of their series (the info gauge aside) for a dashboard to chart."""
    return [LORA_FINISHED, *LORA_TOKENS, LORA_INFO]


INFO = "trtprompt_engine_info"
INFO_HELP = "The running engine's build and runtime configuration (value 1; a change is a reconfiguration)"
INFO_LABELS = ("engine_id", "profile", "policy", "max_seq_len", "max_num_tokens", "tokens_per_block")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0)


@dataclass(frozen=True)
class Histogram:
    """A histogram fed with one observation per finished request (a key of its timing entry)."""

    name: str
    help: str
    timing_key: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS


HISTOGRAMS: tuple[Histogram, ...] = (
    Histogram("trtprompt_request_queue_time_seconds",
              "Time from a request's arrival at the engine to its first scheduling", "queue_s"),
    Histogram("trtprompt_time_to_first_token_seconds",
              "Time from a request's arrival at the engine to its first output token", "ttft_s"),
    Histogram("trtprompt_prefill_time_seconds",
              "Time from a request's first scheduling to its first output token", "prefill_s"),
    Histogram("trtprompt_inter_token_latency_seconds",
              "Mean time between a request's output tokens (one observation per request with two or more)",
              "itl_s"),
    Histogram("trtprompt_e2e_request_latency_seconds",
              "Time from a request's arrival at the engine to its last output token", "e2e_s"),
    Histogram("trtprompt_request_prefix_cache_hit_tokens", "Prompt tokens a request took from the prefix cache",
              "cached_tokens", TOKEN_BUCKETS),
)
HISTOGRAM_OF = {h.timing_key: h.name for h in HISTOGRAMS}  # timing key -> family name
TTFT, PREFILL_TIME = HISTOGRAM_OF["ttft_s"], HISTOGRAM_OF["prefill_s"]

# One observation per KV block a tier returned (engine/tiers/latency.py), with a `tier` label (TIERS):
# a block is a few MB at most, read from the page cache or a LAN, hence buckets from 0.1 ms.
TIER_LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIER_LOAD = Histogram("trtprompt_kv_tier_load_seconds",
                      "Time to read one KV block from a tier and verify it (each block the tier returned)",
                      "tier_load_s", TIER_LOAD_BUCKETS)


def trtprompt_families() -> list[str]:
    """Every trtprompt_* family name (what `promtool check metrics` is run on)."""
    return ([s.name for s in SERIES] + [FINISHED, INFO] + [h.name for h in HISTOGRAMS] + list(TIER_COUNTERS)
            + [TIER_LOAD.name, SPEC_ACCEPTED_PER_POS])
