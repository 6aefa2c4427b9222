"""The seconds-long parts of scripts/chaos.py, against the real server (issue 11).

Each part records failures instead of raising, so a test sees every broken check at once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from serve_fixtures import Served

pytestmark = pytest.mark.server
_SPEC = importlib.util.spec_from_file_location("chaos", Path(__file__).resolve().parent.parent / "scripts" / "chaos.py")
chaos = importlib.util.module_from_spec(_SPEC)
sys.modules["chaos"] = chaos  # dataclasses look their module up there
_SPEC.loader.exec_module(chaos)


def _server(served: Served):
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


_CANCEL_SPEC = importlib.util.spec_from_file_location(
    "chaos_cancel", Path(__file__).resolve().parent.parent / "scripts" / "chaos_cancel.py")
chaos_cancel = importlib.util.module_from_spec(_CANCEL_SPEC)
sys.modules["chaos_cancel"] = chaos_cancel
_CANCEL_SPEC.loader.exec_module(chaos_cancel)


def test_cancelled_dropped_and_killed_clients_are_all_aborted(served: Served):
    """Issue 37, item 7, one short round of scripts/chaos_cancel.py: streams cancelled, closed under,
    and whose client process is SIGKILLed mid-stream; none runs on to its max_tokens (LONG), each
    is aborted, and the engine holds no block afterwards."""
    import asyncio

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
