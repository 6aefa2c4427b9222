"""`trtprompt bench --compare start=restart` on the tiny engine: the restart scenario (a server primed
over a disk tier, stopped, a new one over the same directory measured) and the report's per-tier
rows, read from the server's per-tier counters on /metrics (bench/starts.py, bench/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtprompt.bench.compare import parse_compare
from trtprompt.bench.report import server_summary, tier_rows
from trtprompt.bench.runner import LoadSpec, RunResult
from trtprompt.cli import main
from trtprompt.serve import metrics_catalog as C


def test_restart_reads_the_primed_prefixes_from_the_disk_tier(tiny_engine_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # Two distinct prompts of 72 tokens: 2 full blocks of 32 each can be reused ((72 - 1) // 32).
    args = ["bench", str(tiny_engine_dir), "--workload", "random", "--input-len", "72", "--num-requests", "2",
            "--warmup", "0", "--output-len", "2", "--concurrency", "2", "--compare", "start=restart",
            "--out", str(out), "--no-progress", "--no-plots"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summaries = json.loads((out / "results.json").read_text())["summaries"]["concurrency=2"]
    assert list(summaries) == ["start=restart"]
    s = summaries["start=restart"]
    assert (s["requests"], s["ok"], s["output_tokens"]) == (2, 2, 4)
    assert (s["kv"]["reused_blocks"], s["kv"]["hit_rate"]) == (4, 1.0)  # from the per-request perf outputs
    server = s["server"]  # from /metrics: every reused block came from the disk tier, none from the pool
    assert server["pool_hit_blocks"] == 0 and list(server["tiers"]) == ["disk"]
    disk = server["tiers"]["disk"]
    assert (disk["hit_blocks"], disk["misses"], disk["errors"], disk["dropped_writes"]) == (4, 0, 0, 0)
    assert disk["read_bytes"] > 0
    report = (out / "report.md").read_text()
    for row in ("| KV blocks hit in the pool | 0 |", "| KV blocks hit on disk | 4 |", "| disk misses | 0 |",
                "| disk errors | 0 |"):
        assert row in report, row
    assert not list(out.glob("restart-disk-tier-*"))  # the tier's directory is removed after the run


def _tier_run(after: dict[str, float]) -> RunResult:
    return RunResult(LoadSpec(concurrency=1), {"kind": "random"}, [], 1.0, {}, after)


def test_tier_rows_only_for_tiers_that_moved_and_where_hits_came_from() -> None:
    hit = 'trtprompt_kv_tier_hit_blocks_total{tier="%s"}'
    tiered = _tier_run({hit % "disk": 3.0, hit % "redis": 0.0, 'trtprompt_kv_tier_misses_total{tier="redis"}': 2.0,
                        'trtprompt_kv_tier_read_bytes_total{tier="disk"}': 3e6, C.PREFIX_HIT_BLOCKS: 10.0})
    plain = _tier_run({hit % "disk": 0.0, hit % "redis": 0.0, C.PREFIX_HIT_BLOCKS: 5.0})
    s_tiered, s_plain = server_summary(tiered), server_summary(plain)
    assert list(s_tiered["tiers"]) == ["disk", "redis"] and s_plain["tiers"] == {}
    assert s_tiered["tiers"]["disk"]["hit_blocks"] == 3 and s_tiered["tiers"]["redis"]["misses"] == 2
    assert (s_tiered["pool_hit_blocks"], s_plain["pool_hit_blocks"]) == (7, 5)
    labels = [label for label, _ in tier_rows([{"server": s_tiered}])]
    assert labels[:3] == ["KV blocks hit in the pool", "KV blocks hit on disk", "disk misses"]
    assert "KV blocks hit on redis" in labels and tier_rows([{"server": s_plain}]) == []
    cells = {label: fn({"server": s_plain}) for label, fn in tier_rows([{"server": s_tiered}])}
    assert (cells["KV blocks hit in the pool"], cells["KV blocks hit on disk"]) == ("5", "–")
    assert dict(tier_rows([{"server": s_tiered}]))["disk MB read"]({"server": s_tiered}) == "3.0"


def test_start_axis_parses_and_refuses_other_values() -> None:
    variants = parse_compare("start=cold,warm,restart;reuse=on")
    assert [(v.name, v.start, v.overrides) for v in variants] == [
        ("start=cold reuse=on", "cold", (("enable_kv_cache_reuse", True),)),
        ("start=warm reuse=on", "warm", (("enable_kv_cache_reuse", True),)),
        ("start=restart reuse=on", "restart", (("enable_kv_cache_reuse", True),))]
    with pytest.raises(ValueError, match="--compare start: values must be cold, warm or restart, got 'hot'"):
        parse_compare("start=hot")
