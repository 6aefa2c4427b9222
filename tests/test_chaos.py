"""The seconds-long parts of the chaos scenario (trtprompt/bench/scenarios/chaos.py), against the real
server (issue 11).

Each part records failures instead of raising, so a test sees every broken check at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from serve_fixtures import Served

from trtprompt.bench.scenarios import chaos, chaos_cancel

pytestmark = pytest.mark.server


def _server(served: Served) -> chaos.Server:
    return chaos.Server(served.proc, served.run_dir, served.log_path, served.grpc, served.http, served.engine_dir)


def test_poisoned_requests_are_refused_and_innocents_keep_their_tokens(served: Served):
    report = chaos.Report()
    chaos.part_poison(_server(served), report, rounds=1)
    assert report.failures == []


def test_millions_of_input_ids_are_refused_before_the_engine(served: Served):
    report = chaos.Report()
    chaos.part_big_ids(_server(served), report, n=2_000_000)
    assert report.failures == []


def test_long_prompts_do_not_break_other_streams(served: Served):
    report = chaos.Report()
    chaos.part_hol(_server(served), report)
    assert report.failures == [], report.notes


def test_stop_after_streams_cancelled_at_their_end_leaves_nothing(tiny_engine_dir: Path, tmp_path: Path):
    report = chaos.Report()
    chaos.part_shutdown(tiny_engine_dir, tmp_path, report, stops=1)
    assert report.failures == [], report.notes


def test_cancelled_dropped_and_killed_clients_are_all_aborted(served: Served):
    """Issue 37, item 7, one short round of the chaos_cancel scenario: streams cancelled, closed under,
    and whose client process is SIGKILLed mid-stream; none runs on to its max_tokens (LONG), each
    is aborted, and the engine holds no block afterwards."""
    before = chaos_cancel.idle_stats(served.engine_stats)
    tally = asyncio.run(chaos_cancel.one_round(served.url, 20))  # kills: streams 1 and 17, drop: 9
    after = chaos_cancel.idle_stats(served.engine_stats)
    line, ok = chaos_cancel.round_line(1, tally, before, after)
    assert ok, line
    assert tally.left.get("kill") == 2 and tally.left.get("drop") == 1, line
    aborted = after["finished"]["aborted"] - before["finished"]["aborted"]
    # Every client that went away after its request was issued: all but those that left before
    # Triton passed it on (stop_after 0), which the engine may never see.
    early = sum(chaos_cancel.kind_of(i) != "normal" and chaos_cancel.stop_after_of(i) == 0 for i in range(20))
    assert aborted >= sum(tally.left.values()) - early, line
