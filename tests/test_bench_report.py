"""Benchmark report: percentiles, throughput and KV-reuse figures on hand-made runs; --compare parsing."""

from __future__ import annotations

import pytest

from trtprompt.bench.compare import Variant, parse_compare
from trtprompt.bench.report import markdown_table, percentiles, summarize, tag_table
from trtprompt.bench.runner import LoadSpec, RequestRecord, RunResult

KV = 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="%s",model="tensorrt_llm",version="1"}'


def test_percentiles_interpolate_linearly() -> None:
    p = percentiles([float(x) for x in range(10, 0, -1)])  # order does not matter
    assert p["mean"] == 5.5
    assert p["p50"] == 5.5
    assert p["p90"] == pytest.approx(9.1, abs=1e-12)
    assert p["p99"] == pytest.approx(9.91, abs=1e-12)
    assert percentiles([2.0, 4.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.8, "p99": pytest.approx(3.98)}
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _rec(i: int, ttft: float, gaps: list[float], n_in: int, n_out: int, reused: int, tag: str = "short",
         error: str | None = None) -> RequestRecord:
    e2e = ttft + sum(gaps)
    perf = {"kv_cache_reused_blocks": reused, "kv_cache_alloc_new_blocks": 3, "kv_cache_alloc_total_blocks": 3 + reused}
    if error:
        return RequestRecord(i, tag, n_in, n_out, 0.0, error=error)
    return RequestRecord(i, tag, n_in, n_out, 0.0, ttft, gaps, e2e, n_in, n_out, perf)


def _run() -> RunResult:
    records = [
        _rec(0, 0.100, [0.010, 0.020, 0.030], 65, 4, 0),
        _rec(1, 0.200, [0.020, 0.020, 0.020], 97, 4, 2),
        _rec(2, 0.400, [0.030, 0.010, 0.020], 129, 4, 3, tag="long"),
        _rec(3, 0.0, [], 50, 4, 0, error="in ensemble 'ensemble': queue full"),
    ]
    before = {KV % "reused": 10.0, KV % "missed": 4.0, KV % "tokens_per": 32.0,
              "trtprompt_time_to_first_token_seconds_sum{model=\"tensorrt_llm\",version=\"1\"}": 1.0,
              "trtprompt_time_to_first_token_seconds_count{model=\"tensorrt_llm\",version=\"1\"}": 5.0}
    after = {KV % "reused": 15.0, KV % "missed": 7.0, KV % "tokens_per": 32.0,
             "trtprompt_time_to_first_token_seconds_sum{model=\"tensorrt_llm\",version=\"1\"}": 1.6,
             "trtprompt_time_to_first_token_seconds_count{model=\"tensorrt_llm\",version=\"1\"}": 8.0}
    return RunResult(LoadSpec(concurrency=2), {"kind": "random"}, records, 2.0, before, after)


def test_summary_of_a_hand_made_run() -> None:
    s = summarize(_run())
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["first_errors"] == ["in ensemble 'ensemble': queue full"]
    assert s["req_per_s"] == 1.5
    assert s["output_tok_s"] == 6.0  # 12 tokens in 2 s
    assert s["input_tok_s"] == (65 + 97 + 129) / 2
    assert s["ttft_s"]["p50"] == 0.2
    assert s["ttft_s"]["mean"] == pytest.approx(0.7 / 3)
    assert s["itl_s"]["p50"] == 0.02  # the nine gaps sorted: .01 .01 .02 .02 .02 .02 .02 .03 .03
    assert s["itl_s"]["p90"] == pytest.approx(0.03)
    assert s["e2e_s"]["p50"] == pytest.approx(0.26)
    assert s["tpot_s"]["p50"] == pytest.approx(0.02)
    kv = s["kv"]
    # Reusable prompt blocks: (65-1)//32 + (97-1)//32 + (129-1)//32 = 2 + 3 + 4 = 9; reused 0 + 2 + 3.
    assert (kv["reused_blocks"], kv["new_blocks"], kv["total_blocks"]) == (5, 9, 14)
    assert kv["hit_rate"] == 5 / 9
    assert kv["prompt_tokens"] == 291
    assert kv["prefill_tokens_computed"] == 291 - 5 * 32
    server = s["server"]
    assert (server["reused_blocks"], server["missed_blocks"], server["tokens_per_block"]) == (5.0, 3.0, 32.0)
    assert server["hit_rate"] == 5 / 8
    assert server["time_to_first_token_seconds_mean"] == pytest.approx(0.2)
    assert s["by_tag"]["long"]["requests"] == 1 and s["by_tag"]["short"]["requests"] == 2
    assert s["by_tag"]["long"]["ttft_s"]["p50"] == 0.4


def test_markdown_table_with_ratio_column() -> None:
    a = summarize(_run())
    b = summarize(_run())
    b["output_tok_s"] = 12.0
    b["ttft_s"]["p50"] = 0.05
    table = markdown_table({"reuse=on": a, "reuse=off": b})
    lines = table.splitlines()
    assert lines[0] == "| metric | reuse=on | reuse=off | reuse=off / reuse=on |"
    assert "| output tok/s | 6.0 | 12.0 | 2.00× |" in lines
    assert "| TTFT p50 (ms) | 200.0 | 50.0 | 0.25× |" in lines
    assert "| TPOT p50 (ms) | 20.0 | 20.0 | 1.00× |" in lines
    assert "| TTFT in the engine, mean (ms) | 200.0 | 200.0 |  |" in lines
    assert "| KV hit rate | 55.6% | 55.6% |  |" in lines
    assert "| requests ok / sent | 3 / 4 | 3 / 4 |  |" in lines
    long_row = [line for line in tag_table(a).splitlines() if line.startswith("| long")]
    assert long_row == ["| long | 1 | 400.0 | 400.0 | 460.0 | 460.0 |"]


def test_parse_compare() -> None:
    assert parse_compare(None) == [Variant("default")]
    assert parse_compare("reuse=on,off") == [Variant("reuse=on", (("enable_kv_cache_reuse", True),)),
                                             Variant("reuse=off", (("enable_kv_cache_reuse", False),))]
    pol = parse_compare("policy=guaranteed_no_evict,max_utilization")
    assert [v.serve_overrides for v in pol] == [{"batch_scheduler_policy": "guaranteed_no_evict"},
                                                {"batch_scheduler_policy": "max_utilization"}]
    both = parse_compare("reuse=on,off;chunked=on,off")
    assert [v.name for v in both] == ["reuse=on chunked=on", "reuse=on chunked=off",
                                      "reuse=off chunked=on", "reuse=off chunked=off"]
    prof = parse_compare("profile=cpu-dev,chat")
    assert [(v.name, v.profile, v.overrides) for v in prof] == [("profile=cpu-dev", "cpu-dev", ()),
                                                               ("profile=chat", "chat", ())]
    with pytest.raises(ValueError, match="--compare expects KEY=V1,V2 with KEY in reuse, chunked"):
        parse_compare("speed=fast")
    with pytest.raises(ValueError, match="--compare reuse: values must be on/off, got 'yes,no'"):
        parse_compare("reuse=yes,no")


def test_load_spec_bounds() -> None:
    with pytest.raises(ValueError, match="concurrency or rate is required"):
        LoadSpec(concurrency=None)
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        LoadSpec(concurrency=0)
    with pytest.raises(ValueError, match="rate must be > 0, got -1"):
        LoadSpec(rate=-1.0)
    assert LoadSpec(concurrency=None, rate=2.5).label == "rate=2.5/s"
