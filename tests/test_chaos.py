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
