"""Monitoring without a server: the engine's new counts, the reason labels, the timings,
and that the dashboard, the alert rules and the README name only declared series."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trtprompt.engine.block_pool import BlockPool
from trtprompt.engine.engine import kv_fragmentation
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.request import FinishReason, Request, RequestOutput, RequestStats, SamplingParams
from trtprompt.error_codes import ErrorCode
from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.engine_process.counters import RequestCounters, finish_label, timing_entry

DOCS = Path(__file__).resolve().parent.parent / "docs" / "monitoring"


def _req(rid: str, n_tokens: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n_tokens + 1)), SamplingParams(max_tokens=max_tokens), max_tokens,
                   frozenset(), None, 0)


def test_fragmentation_counts_unwritten_slots_and_reservations() -> None:
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=False)
    assert kv_fragmentation(kv, [], reserving=False) == 0.0
    req = _req("a", 5)
    assert kv.allocate(req, 5)  # two blocks: 4 + 1 tokens
    req.num_computed_tokens = 5
    assert kv_fragmentation(kv, [req], reserving=False) == 3 / 8
    # guaranteed_no_evict reserved four blocks for the whole output: two more, all empty.
    req.reserved_blocks = 4
    assert kv_fragmentation(kv, [req], reserving=True) == (3 + 8) / 16


def test_lookups_in_tokens_and_evictions_of_reusable_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, tokens_per_block=4, enable_block_reuse=True)
    req = _req("a", 9)
    assert kv.allocate(req, 9, kv.find_prefix(req))
    kv.record_lookup(req, 0)
    req.num_computed_tokens = 9
    kv.cache_computed(req)
    kv.free(req)
    assert (kv.missed_blocks, kv.queried_tokens) == (2, 9)
    again = _req("b", 9)
    hits = kv.find_prefix(again)
    assert kv.allocate(again, 1, hits)
    kv.record_lookup(again, len(hits))
    assert (kv.reused_blocks, kv.missed_blocks, kv.queried_tokens) == (2, 2, 18)
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, b"x" * 16)
    pool.free([a, b])
    pool.allocate(2)  # b held no hash: handing it out evicts nothing; a did
    assert pool.evicted_blocks == 1


def _out(reason: FinishReason | None, error: str | None = None, by_end_id: bool = False,
         n_out: int = 3, stats: RequestStats | None = None) -> RequestOutput:
    return RequestOutput("r", [], True, 10, n_out, reason, error, stats=stats or RequestStats(),
                         stopped_by_end_id=by_end_id)


@pytest.mark.parametrize("out, code, label", [
    (_out(FinishReason.LENGTH), None, "length"),
    (_out(FinishReason.STOP, by_end_id=True), None, "end_id"),
    (_out(FinishReason.STOP), None, "stop"),
    (_out(FinishReason.ABORTED), None, "aborted"),
    (_out(FinishReason.ERROR, "engine error: x"), ErrorCode.INTERNAL, "error"),
    (_out(FinishReason.ERROR, "queue full"), ErrorCode.QUEUE_FULL, "rejected_queue_full"),
    (_out(FinishReason.ERROR, "too long"), ErrorCode.TOO_LONG, "invalid"),
    (_out(FinishReason.ERROR, "bad"), ErrorCode.INVALID_ARGUMENT, "invalid"),
])
def test_finish_reason_labels(out: RequestOutput, code: ErrorCode | None, label: str) -> None:
    assert label in C.FINISH_REASONS
    assert finish_label(out, code) == label


def test_timings_of_a_finished_request() -> None:
    ms = 1_000_000
    stats = RequestStats(arrival_time_ns=100 * ms, first_scheduled_time_ns=130 * ms, first_token_time_ns=180 * ms,
                         last_token_time_ns=280 * ms, kv_cache_reused_blocks=2)
    entry = timing_entry(_out(FinishReason.LENGTH, n_out=5, stats=stats), tokens_per_block=32)
    assert entry == pytest.approx({"queue_s": 0.03, "ttft_s": 0.08, "prefill_s": 0.05, "e2e_s": 0.18,
                                   "itl_s": 0.025, "cached_tokens": 64.0})
    assert {h.timing_key for h in C.HISTOGRAMS} == set(entry)
    assert timing_entry(_out(FinishReason.ABORTED), 32) is None  # never scheduled: nothing to observe


def test_counters_count_refusals_and_tokens() -> None:
    counters = RequestCounters(tokens_per_block=32)
    counters.record(_out(FinishReason.LENGTH, n_out=4))
    counters.refused("invalid")
    with pytest.raises(ValueError, match="reason must be one of"):
        counters.refused("bogus")
    snap = counters.snapshot(0)
    assert snap["finished"] == {**dict.fromkeys(C.FINISH_REASONS, 0), "length": 1, "invalid": 1}
    assert (snap["prompt_tokens"], snap["generation_tokens"], snap["timings"]) == (10, 4, [])


def _declared() -> set[str]:
    names = set(C.trtprompt_families()) | set(C.BACKEND_GAUGES)
    names |= {f"{h.name}_{suffix}" for h in (*C.HISTOGRAMS, C.TIER_LOAD) for suffix in ("bucket", "sum", "count")}
    return names


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:trtprompt|nv_trt_llm)_[a-z_]+)\b", expr))


def test_dashboard_and_rules_use_only_declared_series() -> None:
    import yaml

    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    rules = [r for g in yaml.safe_load((DOCS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    exprs += [r["expr"] for r in rules]
    used = set().union(*map(_names_in, exprs))
    assert used - _declared() == set()
    # Every declared series is charted or alerted on (the info and process ones included).
    assert {n for n in C.trtprompt_families() if not any(n in e for e in exprs)} == set()


def test_readme_documents_every_series_and_fragmentation() -> None:
    readme = (DOCS / "README.md").read_text()
    assert [n for n in list(C.trtprompt_families()) + list(C.BACKEND_GAUGES) if n not in readme] == []
    assert "## KV fragmentation" in readme


def test_bench_reads_the_served_series_by_their_declared_names() -> None:
    from trtprompt.bench.report import server_summary
    from trtprompt.bench.runner import LoadSpec, RunResult

    before = {f"{C.PREFILL_TIME}_sum": 1.0, f"{C.PREFILL_TIME}_count": 4.0, f'{C.FINISHED}{{reason="invalid"}}': 1.0,
              C.RESTARTS: 0.0}
    after = {f"{C.PREFILL_TIME}_sum": 1.5, f"{C.PREFILL_TIME}_count": 9.0, f'{C.FINISHED}{{reason="invalid"}}': 3.0,
             C.RESTARTS: 1.0}
    server = server_summary(RunResult(LoadSpec(concurrency=1), {}, [], 1.0, before, after))
    assert server["prefill_time_seconds_mean"] == pytest.approx(0.1)
    assert server["time_to_first_token_seconds_mean"] is None  # not scraped
    assert server["finished"]["invalid"] == 2.0 and server["finished"]["length"] is None
    assert server["engine_restarts"] == 1.0


def test_perf_outputs_are_declared_once_and_read_from_the_request_stats() -> None:
    from trtprompt.client import PERF_OUTPUTS
    from trtprompt.interface import PERF_OUTPUTS as DECLARED
    from trtprompt.serve.engine_process.server import request_stats
    from trtprompt.serve.triton_models.inputs import perf_values

    assert PERF_OUTPUTS == tuple(name for name, *_ in DECLARED)
    assert set(PERF_OUTPUTS) <= set(request_stats(RequestStats()))  # the frame's stats carry every one
    values = perf_values({"kv_cache_reused_blocks": 3, "first_token_time_ns": None, "acceptance_rate": 0.75})
    assert values["kv_cache_reused_blocks"] == (3, "int32") and values["first_token_time_ns"] == (0, "int64")
    assert values["acceptance_rate"] == (0.75, "float32") and values["total_draft_tokens"] == (0, "int32")


def test_a_requests_draft_tokens_travel_under_tensorrt_llms_names() -> None:
    from trtprompt.serve.engine_process.server import request_stats

    wire = request_stats(RequestStats(num_draft_tokens=12, num_accepted_draft_tokens=9))
    assert (wire["total_draft_tokens"], wire["total_accepted_draft_tokens"], wire["acceptance_rate"]) == (12, 9, 0.75)
    assert request_stats(RequestStats())["acceptance_rate"] == 0.0  # no drafts: 0, as TensorRT-LLM reports it
    assert "num_draft_tokens" not in wire  # one name per figure on the wire


SPEC = {"spec_num_drafts": 10, "spec_num_draft_tokens": 40, "spec_num_accepted_tokens": 25,
        "spec_accepted_per_pos": (8, 7, 6, 4)}


def test_spec_decode_series_from_the_engines_counts() -> None:
    values = {s.name: (s.kind, s.source(SPEC)) for s in C.SERIES if s.name.startswith("trtprompt_spec_decode_")}
    assert values == {C.SPEC_DRAFTS: ("counter", 10.0), C.SPEC_DRAFT_TOKENS: ("counter", 40.0),
                      C.SPEC_ACCEPTED_TOKENS: ("counter", 25.0), C.SPEC_ACCEPTANCE_RATE: ("gauge", 0.625),
                      C.SPEC_ACCEPTANCE_LENGTH: ("gauge", 3.5)}
    assert C.spec_position_values(SPEC) == {(C.SPEC_ACCEPTED_PER_POS, "0"): 8.0, (C.SPEC_ACCEPTED_PER_POS, "1"): 7.0,
                                            (C.SPEC_ACCEPTED_PER_POS, "2"): 6.0, (C.SPEC_ACCEPTED_PER_POS, "3"): 4.0}
    # Accepted drafts are a prefix: the per-position counts add up to the accepted tokens.
    assert sum(SPEC["spec_accepted_per_pos"]) == SPEC["spec_num_accepted_tokens"]
    none = {"spec_num_drafts": 0, "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0,
            "spec_accepted_per_pos": ()}  # speculative_decoding none
    assert C.spec_acceptance_rate(none) == C.spec_acceptance_length(none) == 0.0
    assert C.spec_position_values(none) == {}
    assert C.SPEC_ACCEPTED_PER_POS in C.trtprompt_families()


def test_the_publisher_counts_every_spec_series_from_one_stats_reply() -> None:
    from trtprompt.serve.triton_models.metrics_publisher import counter_values

    stats = {**SPEC, "reused_blocks": 0, "missed_blocks": 0, "queried_tokens": 0, "hit_tokens": 0,
             "evicted_blocks": 0, "preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0, "restarts": 0,
             "process_cpu_seconds": 0.0, "finished": {}, **{field: 0 for _h, field in C.KV_EVENT_COUNTERS.values()}}
    counts = counter_values(stats)
    assert {k: v for k, v in counts.items() if k[0].startswith("trtprompt_spec_decode_")} == {
        (C.SPEC_DRAFTS, ""): 10.0, (C.SPEC_DRAFT_TOKENS, ""): 40.0, (C.SPEC_ACCEPTED_TOKENS, ""): 25.0,
        **C.spec_position_values(SPEC)}
