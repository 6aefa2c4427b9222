"""The trtllm target's request metrics arithmetic: TensorRT-LLM's per-request perf outputs -> one
observation of the torch target's histogram and counter families (no server needed)."""

from __future__ import annotations

import pytest

from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.triton_models.perf_observations import COUNTERS, TIMING_KEYS, FirstSeen, Observation, observation

PERF = {"kv_cache_alloc_new_blocks": 3, "kv_cache_reused_blocks": 2, "kv_cache_alloc_total_blocks": 5,
        "arrival_time_ns": 10_000_000_000, "first_scheduled_time_ns": 10_003_000_000,
        "first_token_time_ns": 10_045_000_000, "last_token_time_ns": 10_900_000_000}


def test_observation_of_a_request_at_its_first_token() -> None:
    obs = observation(PERF, tokens_per_block=32)
    assert obs is not None
    assert dict(obs.histograms) == {"queue_s": 3_000_000 / 1e9, "ttft_s": 45_000_000 / 1e9,
                                    "prefill_s": 42_000_000 / 1e9, "cached_tokens": 64.0}
    assert dict(obs.counters) == {C.PREFIX_HIT_BLOCKS: 2.0, C.PREFIX_QUERIED_BLOCKS: 5.0}


def test_no_observation_before_the_first_token_or_without_an_arrival_time() -> None:
    assert observation(PERF | {"first_token_time_ns": 0}, 32) is None
    assert observation(PERF | {"arrival_time_ns": 0}, 32) is None


def test_queue_and_prefill_need_the_first_scheduled_time() -> None:
    obs = observation(PERF | {"first_scheduled_time_ns": 0, "kv_cache_reused_blocks": 0}, 16)
    assert obs is not None
    assert dict(obs.histograms) == {"ttft_s": 0.045, "cached_tokens": 0.0}
    assert dict(obs.counters) == {C.PREFIX_HIT_BLOCKS: 0.0, C.PREFIX_QUERIED_BLOCKS: 5.0}


def test_keys_name_declared_families_and_bad_values_are_refused() -> None:
    assert set(TIMING_KEYS) <= set(C.HISTOGRAM_OF) and set(COUNTERS) <= {s.name for s in C.SERIES}
    with pytest.raises(ValueError, match="tokens_per_block must be >= 1, got 0"):
        observation(PERF, 0)
    with pytest.raises(ValueError, match="histograms must use the keys"):
        Observation({"e2e_s": 1.0}, {})
    with pytest.raises(ValueError, match="counters must use the families"):
        Observation({}, {C.PREEMPTIONS: 1.0})


def test_first_seen_is_a_bounded_lru() -> None:
    seen = FirstSeen(2)
    assert [seen.first(k) for k in (("a", 1), ("a", 1), ("", 7), ("", 8))] == [True, False, True, True]
    assert seen.first(("a", 1))  # forgotten: the least recently seen beyond capacity
    assert not seen.first(("", 8))  # seen again: now the most recent
    assert seen.first(("", 7))
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        FirstSeen(0)
