"""One request's metric observations from TensorRT-LLM's per-request perf outputs.

Triton's tensorrtllm C++ backend exports gauges only: no prefix-cache hit
counters and no latency histograms. With return_perf_metrics it attaches the
request's KV-cache block counts and timestamps to every response, so the trtllm
target's `postprocessing` turns them into the families the torch target's
engine process feeds (metrics_catalog; docs/monitoring/README.md, "trtllm
target"). A request is observed once, at the first response that carries its
first-token time, so only what is known by then is observed: queue time, TTFT,
prefill time and the reused blocks (no end-to-end or inter-token latency).
Pure: no Triton import, so the arithmetic is unit-tested.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Mapping

from trtprompt.serve import metrics_catalog as C

NS_PER_S = 1e9
# The HISTOGRAMS (by timing key) and counters an observation feeds.
TIMING_KEYS: tuple[str, ...] = ("queue_s", "ttft_s", "prefill_s", "cached_tokens")
COUNTERS: tuple[str, ...] = (C.PREFIX_HIT_BLOCKS, C.PREFIX_QUERIED_BLOCKS)
# The perf outputs a response must carry to be observed (TensorRT-LLM's KV-cache and timing ones). The speculative
# decoding ones are not among them: their totals are final only at the request's last response, and a
# request is observed at its first token, so the trtllm target publishes no spec_decode series.
OBSERVED_OUTPUTS: tuple[str, ...] = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                                     "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
                                     "first_token_time_ns", "last_token_time_ns")


@dataclass(frozen=True)
class Observation:
    """One request's histogram values (timing key -> value) and counter increments (family -> amount)."""

    histograms: Mapping[str, float]
    counters: Mapping[str, float]

    def __post_init__(self) -> None:
        if set(self.histograms) - set(TIMING_KEYS):
            raise ValueError(f"histograms must use the keys {TIMING_KEYS}, got {sorted(self.histograms)}")
        if set(self.counters) - set(COUNTERS):
            raise ValueError(f"counters must use the families {COUNTERS}, got {sorted(self.counters)}")


def observation(perf: Mapping[str, int], tokens_per_block: int) -> Observation | None:
    """The observation of one response's perf outputs (TensorRT-LLM's names, ns and blocks).

    None before the request's first token (first_token_time_ns 0) or without an arrival time.
    Queue and prefill time need the first-scheduled time, which is 0 when the backend has none.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    arrival, scheduled, first = (perf["arrival_time_ns"], perf["first_scheduled_time_ns"],
                                 perf["first_token_time_ns"])
    if first <= 0 or arrival <= 0:
        return None
    reused = perf["kv_cache_reused_blocks"]
    histograms = {"ttft_s": (first - arrival) / NS_PER_S, "cached_tokens": float(reused * tokens_per_block)}
    if scheduled > 0:
        histograms["queue_s"] = (scheduled - arrival) / NS_PER_S
        histograms["prefill_s"] = (first - scheduled) / NS_PER_S
    return Observation(histograms, {C.PREFIX_HIT_BLOCKS: float(reused),
                                    C.PREFIX_QUERIED_BLOCKS: float(perf["kv_cache_alloc_total_blocks"])})


class FirstSeen:
    """Keys seen before, the least recently seen forgotten beyond `capacity` (a bounded LRU).

    Keyed by (request id, arrival_time_ns): every response of a request repeats both, and a
    request without a client request id still has its own arrival time.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()

    def first(self, key: Hashable) -> bool:
        """True the first time key is seen (while remembered), False after."""
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True
