"""A real `serve --replicas 2` group of the tiny engine (KV events on), shared by the module:

- `trtprompt bench --replicas-file`: per-replica rows that add up to what was sent, hit tokens equal
  to what the requests' own usage reported, the router overhead's requests seen by the engines;
- the KV event counters on /metrics: equal to the engine's counts and to what the replay socket
  resends (every batch published, decoded);
- Prometheus with docs/monitoring/prometheus-replicas.yml and the targets replica_group writes: the
  routers' series once per replica, told apart by the `replica` label, with their own labels intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from serve_fixtures import ROOT, Served, check_stopped_cleanly, start_server, wait_for

from trtprompt.bench.replica_group import ReplicaGroup, group_counts, read_group, scrape_targets
from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.ports import free_ports
from trtprompt.serve.wire import protocol as P

REQUESTS, OVERHEAD = 8, 3
DOCS = ROOT / "docs" / "monitoring"


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _spaced_ports() -> tuple[int, int]:
    """An events port and a replay port, each with its next port free too (replica 1 binds port + 1)."""
    for _ in range(50):
        a, b = free_ports(2)
        if abs(a - b) > 2 and _bindable(a + 1) and _bindable(b + 1):
            return a, b
    raise AssertionError("no two spaced free ports")


@pytest.fixture(scope="module")
def group(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two replicas need two cores")
    events, replay = _spaced_ports()
    server = start_server(tiny_engine_dir, tmp_path_factory.mktemp("bench-replicas") / "run", "--replicas", "2",
                          "--kv-events-endpoint", str(events), "--kv-events-replay-endpoint", str(replay))
    yield server
    check_stopped_cleanly(server)


def _layout(group: Served) -> ReplicaGroup:
    return read_group(group.run_dir / "replicas.json")


@pytest.fixture(scope="module")
def benched(group: Served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `trtprompt bench --replicas-file` run; the engines' counts before and after it."""
    layout, out = _layout(group), tmp_path_factory.mktemp("bench-out")
    before = group_counts(layout)
    cmd = [sys.executable, "-m", "trtprompt.cli", "bench", str(group.engine_dir), "--replicas-file",
           str(group.run_dir / "replicas.json"), "--workload", "shared-prefix", "--num-prefixes", "2",
           "--prefix-len", "96", "--suffix-len", "8", "--num-requests", str(REQUESTS), "--warmup", "0",
           "--output-len", "2", "--concurrency", "2", "--overhead-requests", str(OVERHEAD), "--no-plots",
           "--no-progress", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {"before": before, "after": group_counts(layout), "out": out, "stdout": done.stdout,
            "results": json.loads((out / "results.json").read_text())}


def test_bench_reports_each_replica_and_the_router_overhead(benched: dict[str, Any]) -> None:
    (level,) = benched["results"]["summaries"].values()
    (summary,) = level.values()
    rows = summary["replicas"]
    assert [r["replica"] for r in rows] == [0, 1]
    assert summary["ok"] == REQUESTS and sum(r["requests"] for r in rows) == REQUESTS
    for r in rows:
        assert r["hit_rate"] == (r["hit_tokens"] / r["queried_tokens"] if r["queried_tokens"] else None)
    # The engines' hit tokens are what the requests' own usage reported as cached (prompt_tokens_details).
    records = [rec for f in (benched["out"] / "records").glob("*.json") for rec in json.loads(f.read_text())]
    assert len(records) == REQUESTS
    assert sum(r["hit_tokens"] for r in rows) == sum(rec["perf"]["cached_tokens"] for rec in records) > 0
    # Everything the engines ended during the bench: the measured requests and the overhead's, each way.
    ended = [a["requests"] - b["requests"] for a, b in zip(benched["after"], benched["before"])]
    assert sum(ended) == REQUESTS + 2 * OVERHEAD
    overhead = summary["router_overhead"]
    assert overhead["requests"] == OVERHEAD
    for side in ("direct", "routed"):
        assert 0 < overhead[f"{side}_p50_ms"] <= overhead[f"{side}_p90_ms"]
    assert overhead["added_p50_ms"] == overhead["routed_p50_ms"] - overhead["direct_p50_ms"]
    report = (benched["out"] / "report.md").read_text()
    assert f"| all | {REQUESTS} |" in report and "Router added TTFT (3 short prompts" in report
    assert "| p90 |" in benched["stdout"]


def test_replicas_file_refuses_what_is_not_a_layout(tmp_path: Path) -> None:
    bad = tmp_path / "replicas.json"
    bad.write_text(json.dumps({"router": "http://127.0.0.1:1"}))
    with pytest.raises(ValueError, match="not a serve --replicas layout"):
        read_group(bad)


def test_replicas_file_needs_the_routers_openai_endpoint(tiny_engine_dir: Path) -> None:
    from trtprompt.bench.compare import BenchPlan
    from trtprompt.bench.runner import LoadSpec
    from trtprompt.bench.workloads import WorkloadSpec

    with pytest.raises(ValueError, match="url must be the router's OpenAI endpoint"):
        BenchPlan(tiny_engine_dir, WorkloadSpec("random"), [LoadSpec(concurrency=1)], url="127.0.0.1:8001",
                  replicas_file=Path("replicas.json"))
    with pytest.raises(ValueError, match="overhead_requests must be >= 1"):
        BenchPlan(tiny_engine_dir, WorkloadSpec("random"), [LoadSpec(concurrency=1)], overhead_requests=0)


def _replayed(endpoint: str) -> tuple[int, int]:
    """(batches, events) the replay socket resends from sequence 0: every batch it kept."""
    import msgpack  # type: ignore[import-untyped]
    import zmq

    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = events = 0
        while True:
            assert dealer.poll(10_000), "the replay socket answered"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return batches, events
            batches, events = batches + 1, events + len(msgpack.unpackb(payload)[1])
    finally:
        ctx.destroy(linger=0)


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_kv_event_counters_match_the_engine_and_the_replay(group: Served, benched: dict[str, Any]) -> None:
    for replica in _layout(group).replicas:
        stats = P.call(replica.engine_socket, {"op": "stats", "since": 1 << 62})
        batches, events = stats["kv_events_published_batches"], stats["kv_events_published_events"]
        assert (stats["kv_events_dropped_batches"], stats["kv_events_dropped_events"]) == (0, 0)
        assert _replayed(_replay_endpoint(group, replica.index)) == (batches, events)
        expected = {"published_batches": batches, "published_events": events, "dropped_batches": 0,
                    "dropped_events": 0, "replay_requests": stats["kv_events_replay_requests"] + 1}
        wait_for(lambda: all(_metric(replica.metrics_port, f"trtprompt_kv_events_{k}_total") == v
                             for k, v in expected.items()), f"replica {replica.index}'s KV event counters", 30)
    assert sum(e for e in (P.call(r.engine_socket, {"op": "stats", "since": 1 << 62})["kv_events_published_events"]
                           for r in _layout(group).replicas)) > 0


def _replay_endpoint(group: Served, index: int) -> str:
    """Replica index's replay socket: the group's replay endpoint + index (docs/kv-events.md)."""
    args = group.proc.args
    assert isinstance(args, list)
    base = int(args[args.index("--kv-events-replay-endpoint") + 1])
    return f"tcp://127.0.0.1:{base + index}"


PROMETHEUS = shutil.which("prometheus")


def test_prometheus_tells_the_replicas_apart(group: Served, benched: dict[str, Any],
                                             tmp_path: Path) -> None:
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus, done by `make install`)")
    layout = _layout(group)
    config = yaml.safe_load((DOCS / "prometheus-replicas.yml").read_text())
    (targets := tmp_path / "targets.json").write_text(json.dumps(scrape_targets(layout)))
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(targets)]
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    (port,) = free_ports(1)
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def query(expr: str) -> list[tuple[dict[str, str], float]]:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    return [(r["metric"], float(r["value"][1])) for r in json.load(resp)["data"]["result"]]
            except OSError:
                return []

        queried = {str(r.index): float(c["queried_tokens"]) for r, c in zip(layout.replicas, group_counts(layout))}
        wait_for(lambda: {m["replica"]: v for m, v in query(C.PREFIX_QUERIED_TOKENS)} == queried,
                 "each replica's queried tokens scraped under its replica label", 60)
        for family, label, value in ((C.REQUEST_FAMILY, "request_type", "waiting"),
                                     (C.KV_FAMILY, "kv_cache_block_type", "fraction")):
            rows = query(f'{family}{{{label}="{value}"}}')
            assert sorted(m["replica"] for m, _ in rows) == ["0", "1"], rows
            for m, v in rows:  # the backend's labels untouched; the scrape adds job, instance and replica
                assert m == {"__name__": family, "model": "tensorrt_llm", "version": "1", label: value,
                             "job": "trtprompt-replicas", "instance": layout.replicas[int(m["replica"])]
                             .metrics_target, "replica": m["replica"]}
                assert v == 0.0  # idle: nothing waiting, no block held
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
