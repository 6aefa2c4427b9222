"""Speculative decoding seen by users: the spec_decode series on a real server's /metrics after a greedy
request that repeats its prompt, the request's own draft totals in its perf outputs, and what
`trtprompt bench` reports from a window's metric deltas."""

from __future__ import annotations

import pytest
from serve_fixtures import Served, wait_for

from trtprompt.bench.report import markdown_table, server_summary, spec_rows
from trtprompt.bench.runner import LoadSpec, RunResult
from trtprompt.serve import metrics_catalog as C

POS = C.SPEC_ACCEPTED_PER_POS + '{position="%d"}'
# One window of a served run as `trtprompt bench` scrapes it (runner.scrape_metrics: 'name{labels}' -> value):
# 40 verifications of 148 draft tokens, 61 accepted, 3 draft positions counted.
BEFORE = {C.SPEC_DRAFTS: 12.0, C.SPEC_DRAFT_TOKENS: 52.0, C.SPEC_ACCEPTED_TOKENS: 20.0,
          POS % 0: 9.0, POS % 1: 7.0, POS % 2: 4.0}
AFTER = {C.SPEC_DRAFTS: 52.0, C.SPEC_DRAFT_TOKENS: 200.0, C.SPEC_ACCEPTED_TOKENS: 81.0,
         POS % 0: 39.0, POS % 1: 27.0, POS % 2: 15.0}


def _window(before: dict[str, float], after: dict[str, float]) -> RunResult:
    return RunResult(LoadSpec(concurrency=1), {}, [], 1.0, before, after)


def test_bench_reports_a_windows_speculation_from_the_counter_deltas() -> None:
    spec = server_summary(_window(BEFORE, AFTER))["speculation"]
    assert spec == {"drafts": 40.0, "draft_tokens": 148.0, "accepted_tokens": 61.0,
                    "acceptance_rate": pytest.approx(61 / 148), "acceptance_length": pytest.approx(1 + 61 / 40),
                    "accepted_per_position": pytest.approx([30 / 40, 20 / 40, 11 / 40])}
    summary = {"server": {"speculation": spec}}
    assert [label for label, _ in spec_rows([summary])] == [
        "draft tokens", "accepted draft tokens", "draft acceptance rate",
        "mean accepted length (tokens / verification)", "accepted by draft position"]
    cells = {label: cell(summary) for label, cell in spec_rows([summary])}
    assert cells == {"draft tokens": "148", "accepted draft tokens": "61", "draft acceptance rate": "41.2%",
                     "mean accepted length (tokens / verification)": "2.52",
                     "accepted by draft position": "75% / 50% / 28%"}


def test_bench_shows_no_speculation_rows_where_nothing_was_drafted() -> None:
    idle = server_summary(_window(AFTER, AFTER))["speculation"]
    assert idle == {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "acceptance_rate": None,
                    "acceptance_length": None, "accepted_per_position": None}
    assert server_summary(_window({}, {}))["speculation"] is None  # a server without the series
    assert spec_rows([{"server": {"speculation": idle}}, {"server": {"speculation": None}}]) == []


def test_the_markdown_table_adds_the_rows_for_a_run_that_speculated() -> None:
    from trtprompt.bench.report import summarize

    table = markdown_table({"ngram": summarize(_window(BEFORE, AFTER)), "none": summarize(_window(AFTER, AFTER))})
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines()}
    assert rows["draft acceptance rate"] == "| draft acceptance rate | 41.2% | – |  |"
    assert rows["accepted by draft position"] == "| accepted by draft position | 75% / 50% / 28% | – |  |"


WORDS = ("apple river stone cloud maple tiger lemon violet copper harbor winter candle meadow falcon pepper "
         "silver garden rocket basket thunder orange pillow forest marble dragon velvet anchor piano saddle comet")


@pytest.mark.server
def test_a_repeating_answer_drafts_and_the_server_counts_it(served: Served) -> None:
    """A greedy answer that repeats its prompt is drafted from it: /metrics counts the drafts, and the
    request's perf outputs carry its own totals under TensorRT-LLM's names."""
    before = {name: served.metric(name) for name in (C.SPEC_DRAFTS, C.SPEC_DRAFT_TOKENS, C.SPEC_ACCEPTED_TOKENS)}
    assert None not in before.values(), "the spec_decode counters are not on /metrics"
    prompt = f"Repeat these 30 words exactly, in order: {WORDS}. Again: {WORDS}. Again:"
    result = served.text(prompt, 64, stream=False, temperature=0.0, return_perf_metrics=True)
    assert result.error is None, result.error
    drafted, accepted = result.last("total_draft_tokens"), result.last("total_accepted_draft_tokens")
    assert drafted > 0, "the request verified no draft token (is speculative_decoding on?)"
    assert 0 <= accepted <= drafted
    assert result.last("acceptance_rate") == pytest.approx(accepted / drafted, rel=1e-6)  # FP32

    def grown(name: str) -> float:
        return (served.metric(name) or 0.0) - (before[name] or 0.0)

    wait_for(lambda: grown(C.SPEC_DRAFT_TOKENS) >= drafted,
             lambda: f"{C.SPEC_DRAFT_TOKENS} grew by {grown(C.SPEC_DRAFT_TOKENS)}, not {drafted}")
    assert grown(C.SPEC_DRAFTS) >= 1
    assert 0 <= grown(C.SPEC_ACCEPTED_TOKENS) <= grown(C.SPEC_DRAFT_TOKENS)
    max_draft_len = len(served.engine_stats()["spec_accepted_per_pos"])  # one counter per draft position
    positions = [served.metric(C.SPEC_ACCEPTED_PER_POS, position=str(i)) for i in range(max_draft_len)]
    assert max_draft_len > 0 and None not in positions
    assert positions == sorted(positions, reverse=True)  # accepted drafts are a prefix
    # The gauges are since the engine process started, which has drafted by now (this request).
    assert 0 <= served.metric(C.SPEC_ACCEPTANCE_RATE) <= 1 and served.metric(C.SPEC_ACCEPTANCE_LENGTH) >= 1
