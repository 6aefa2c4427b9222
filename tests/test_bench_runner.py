"""The load generator against the real tritonserver (the session's `served` fixture, tiny engine)."""

from __future__ import annotations

from pathlib import Path

from trtprompt.bench.report import summarize
from trtprompt.bench.runner import LoadSpec, run_load
from trtprompt.bench.workloads import WorkloadSpec, make_workload
from trtprompt.tokenizer import Tokenizer


def _tok(served) -> Tokenizer:  # type: ignore[no-untyped-def]
    return Tokenizer.from_dir(Path(served.engine_dir) / "tokenizer")


def test_shared_prefix_run_records_every_request_and_reuses_the_prefix(served) -> None:  # type: ignore[no-untyped-def]
    # One system prompt of 3 full blocks (96 tokens, tokens_per_block 32) + 16 unique tokens: the
    # warm-up request caches the prefix, so every measured request reuses exactly those 3 blocks
    # ((112 - 1) // 32 = 3 reusable blocks per prompt).
    spec = WorkloadSpec("shared-prefix", num_requests=7, num_prefixes=1, prefix_len=96, suffix_len=16, output_len=5)
    wl = make_workload(spec, _tok(served))
    result = run_load(served.url, wl, LoadSpec(concurrency=3, warmup=1), served_metrics(served), progress=False)
    assert [r.index for r in result.records] == list(range(1, 7))
    for r in result.records:
        assert r.error is None, r.error
        assert r.ttft_s is not None and r.ttft_s > 0
        assert r.itl_s and all(g >= 0 for g in r.itl_s)
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-9
        assert r.num_input_tokens == r.prompt_len == 112  # exact lengths, by the server's own count
        assert r.num_output_tokens == 5  # min_tokens = max_tokens
        assert r.perf["kv_cache_reused_blocks"] == 3
        assert r.perf["first_token_time_ns"] >= r.perf["arrival_time_ns"] > 0
    s = summarize(result)
    assert s["kv"]["hit_rate"] == 1.0
    assert s["kv"]["prefill_tokens_computed"] == 6 * (112 - 96)
    assert s["server"]["tokens_per_block"] == 32.0
    # /metrics moved by at least these requests' reuse (other tests may share the server).
    assert s["server"]["reused_blocks"] >= 18


def served_metrics(served) -> str:  # type: ignore[no-untyped-def]
    return f"http://127.0.0.1:{served.metrics}/metrics"


def test_poisson_arrivals_and_duration_bound(served) -> None:  # type: ignore[no-untyped-def]
    wl = make_workload(WorkloadSpec("random", num_requests=6, input_len=20, output_len=3, seed=5), _tok(served))
    result = run_load(served.url, wl, LoadSpec(concurrency=None, rate=50.0, warmup=0, max_inflight=4), None,
                      progress=False)
    assert len(result.records) == 6 and all(r.ok and r.num_output_tokens == 3 for r in result.records)
    starts = [r.start_s for r in result.records]
    assert len(set(starts)) == 6  # released one by one at seeded exponential gaps
    # A duration bound: the seeded arrivals (0.5/s, seed 2) fall at about 1.1 s, 1.7 s, 5.0 s, ...,
    # so with a 3 s bound the last four arrive after it and are never sent, whatever the machine's
    # speed, and only the first two can have been sent.
    wl8 = make_workload(WorkloadSpec("random", num_requests=6, input_len=20, output_len=8, seed=6), _tok(served))
    bounded = run_load(served.url, wl8, LoadSpec(concurrency=None, rate=0.5, seed=2, warmup=0, max_inflight=6,
                                                 duration_s=3.0), None, progress=False)
    first_two = {r.index for r in wl8.requests[:2]}
    assert bounded.not_sent >= 4 and len(bounded.records) + bounded.not_sent == 6
    assert {r.index for r in bounded.records} <= first_two
    assert all(r.ok and r.num_output_tokens == 8 for r in bounded.records)


def test_multi_turn_waits_for_the_previous_turn(served) -> None:  # type: ignore[no-untyped-def]
    spec = WorkloadSpec("multi-turn", num_requests=4, turns=2, user_len=40, answer_len=8, output_len=2)
    wl = make_workload(spec, _tok(served))
    result = run_load(served.url, wl, LoadSpec(concurrency=4, warmup=0), None, progress=False)
    by_index = {r.index: r for r in result.records}
    for req in wl.requests:
        rec = by_index[req.index]
        assert rec.ok, rec.error
        if req.after is not None:
            prev = by_index[req.after]
            assert rec.start_s >= prev.start_s + prev.e2e_s
            # The second turn starts with the first turn's prompt (41 tokens: one full block).
            assert rec.perf["kv_cache_reused_blocks"] >= 1
