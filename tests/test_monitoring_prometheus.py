"""A real Prometheus scrapes two real `trtprompt serve`s (the default fused layout and
--layout upstream) while they serve a repeated prefix, bad requests and an engine
process killed (and restarted by the launcher); then every PromQL expression of
docs/monitoring/grafana-dashboard.json and docs/monitoring/alerts.yml is evaluated
through Prometheus' HTTP API. `promtool check rules` and `promtool check metrics`
run on the shipped rules and on what /metrics serves.

Needs Debian's `prometheus` package (`make install` installs it where apt exists).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from serve_fixtures import Served, Stops, start_server
from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.ports import free_ports

pytestmark = [pytest.mark.server, pytest.mark.slow]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "monitoring"
DEADLINE_S = 180.0
# What Grafana fills in; any window holding the whole test works.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h"}
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
if PROMETHEUS is None or PROMTOOL is None:
    pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus, done by `make install`)",
                allow_module_level=True)


def _wait(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=30) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(self, expr: str, seconds: float) -> list[float]:
        """Every value of every series over the last `seconds`, one step a second (how Grafana
        evaluates an annotation over its time range)."""
        now = time.time()
        data = self.api("query_range", query=expr, start=str(now - seconds), end=str(now), step="1")
        return [float(v) for series in data["result"] for _, v in series["values"]]

    def by_instance(self, expr: str) -> dict[str, float]:
        return {m.get("instance", ""): v for m, v in self.query(expr)}


@pytest.fixture(scope="module")
def servers(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            stops: Stops) -> Iterator[dict[str, Served]]:
    root = tmp_path_factory.mktemp("monitoring")
    with ThreadPoolExecutor(2) as pool:  # the two start up side by side
        fused = pool.submit(start_server, tiny_engine_dir, root / "fused")
        upstream = pool.submit(start_server, tiny_engine_dir, root / "upstream", "--layout", "upstream")
        started = {"fused": fused.result(), "upstream": upstream.result()}
    yield started
    for server in started.values():  # and stop side by side, with the next tests
        stops.server(server)


@pytest.fixture(scope="module")
def prometheus(servers: dict[str, Served], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    root = tmp_path_factory.mktemp("prometheus")
    (port,) = free_ports(1)
    targets = [f"127.0.0.1:{s.metrics}" for s in servers.values()]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(DOCS / "alerts.yml")],
              "scrape_configs": [{"job_name": "trtprompt", "static_configs": [{"targets": targets}]}]}
    (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = open(root / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
                             f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],  # never a public interface
                            stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        _wait("both targets scraped", lambda: _up(prom) == {1.0} and len(prom.query("up")) == 2)
        yield prom
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()


def _up(prom: Prometheus) -> set[float]:
    try:
        return {v for _, v in prom.query("up")}
    except OSError:
        return set()  # not listening yet


def _drive(server: Served) -> None:
    """A repeated prefix, two bad requests, then the engine process killed and restarted."""
    prefix = "the same system prompt for every request, long enough to fill blocks " * 6
    for i in range(3):
        result = server.text(f"{prefix} question {i}", 8, stream=False)
        assert result.error is None, result.error
    assert server.text("", 4).error is not None  # refused by the serving models
    assert server.text("hi", 100_000).error is not None  # refused by the engine process
    # The engine process holds the counts until the publisher's next poll: let it take them.
    _wait("both refusals on /metrics", lambda: server.metric(C.FINISHED, reason="invalid") == 2)
    old_pid = server.engine_info()["pid"]
    os.kill(old_pid, signal.SIGKILL)
    _wait("the launcher's restart", lambda: "engine process restarted" in server.log_path.read_text())
    result = server.text("after the restart", 8)
    assert result.error is None, result.error
    assert server.engine_info()["pid"] != old_pid


def _dashboard_exprs() -> dict[str, list[str]]:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}


def _annotation_exprs() -> list[str]:
    return [a["expr"] for a in json.loads((DOCS / "grafana-dashboard.json").read_text())["annotations"]["list"]]


def _grafana(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


@pytest.fixture(scope="module")
def driven(servers: dict[str, Served], prometheus: Prometheus) -> Prometheus:
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(_drive, s) for s in servers.values()]:
            done.result()
    # Prometheus has seen the whole workload once both restarts and the last requests are scraped.
    _wait("the restarts scraped", lambda: set(prometheus.by_instance(C.RESTARTS).values()) == {1.0})
    _wait("the last requests scraped", lambda: all(
        v >= 4 for v in prometheus.by_instance(f'sum by (instance) ({C.FINISHED}{{reason=~"length|stop|end_id"}})')
        .values()) and len(prometheus.query(C.FINISHED)) == 2 * len(C.FINISH_REASONS))
    return prometheus


def test_promtool_checks_the_rules_and_what_metrics_serves(servers: dict[str, Served]) -> None:
    rules = subprocess.run([PROMTOOL, "check", "rules", str(DOCS / "alerts.yml")], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    for layout, server in servers.items():
        ours = _our_families(server.metrics_text())
        assert set(C.trtprompt_families()) <= set(re.findall(r"^# TYPE (\S+)", ours, re.M)), layout
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=ours, capture_output=True, text=True)
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, ""), layout


def _our_families(text: str) -> str:
    """The exposition's trtprompt_* and nv_trt_llm_* families (Triton's own nv_inference_*
    counters break the lint's naming rules and are not ours to rename)."""
    keep = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("#") and len(line.split()) > 2 else line
        if name.startswith(("trtprompt_", "nv_trt_llm_")):
            keep.append(line)
    return "\n".join(keep) + "\n"


def test_every_dashboard_expression_returns_plausible_data(driven: Prometheus) -> None:
    results = {}
    for title, exprs in _dashboard_exprs().items():
        for expr in exprs:
            rows = driven.query(_grafana(expr))
            assert rows, f"{title}: {expr} returned no data"
            results[expr] = rows
    value = {expr: rows[0][1] for expr, rows in results.items()}
    by_title = _dashboard_exprs()
    throughput, _, completed = (value[e] for e in by_title["Throughput"])
    assert throughput > 0 and completed > 0
    for title in ("Time to first token p50 / p99", "Inter-token latency p50 / p99"):
        assert all(0 < value[e] < 60 for e in by_title[title]), title
    hit_blocks, hit_tokens, cached_mean, backend_hit_blocks = (value[e] for e in by_title["KV prefix-cache hit rate"])
    assert 0 < hit_blocks <= 1 and 0 < hit_tokens < 1 and cached_mean > 0 and 0 < backend_hit_blocks <= 1
    fragmentation, used, evictions, preemptions = (value[e] for e in by_title[
        "KV fragmentation, use, evictions and preemptions"])
    assert 0 <= fragmentation <= 1 and 0 <= used <= 1 and evictions >= 0 and preemptions >= 0
    (failures,) = by_title["Failures by reason"]
    assert {m["reason"] for m, v in results[failures] if v > 0} == {"invalid"}
    assert value[by_title["Engine restarts"][0]] >= 1.9  # one restart on each server (increase extrapolates)
    cpu, rss = (value[e] for e in by_title["Engine process CPU and memory"])
    assert cpu > 0 and rss > 10e6
    info = results[by_title["Engine configuration"][0]]
    assert sorted((m["profile"], m["tokens_per_block"], m["max_seq_len"]) for m, _ in info) == \
        [("cpu-dev", "32", "2048")] * 2
    for expr in _annotation_exprs():  # the restarts are marked somewhere in the last 10 minutes
        assert any(v > 0 for v in driven.query_range(_grafana(expr), 600)), expr


def test_each_layout_publishes_its_own_series(driven: Prometheus, servers: dict[str, Served]) -> None:
    instances = {f"127.0.0.1:{s.metrics}": layout for layout, s in servers.items()}
    hit_rate = driven.by_instance(f"{C.PREFIX_HIT_BLOCKS} / {C.PREFIX_QUERIED_BLOCKS}")
    invalid = driven.by_instance(f'{C.FINISHED}{{reason="invalid"}}')
    ttft = driven.by_instance(f"{C.TTFT}_count")
    for instance, layout in instances.items():
        assert 0 < hit_rate[instance] <= 1, layout
        # Counted across the restart: the serving models' refusal and the engine's.
        assert invalid[instance] == 2, layout
        assert ttft[instance] >= 4, layout


def test_every_rule_evaluates_and_the_alerts_match_the_workload(driven: Prometheus) -> None:
    import yaml

    groups = yaml.safe_load((DOCS / "alerts.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    n_instances = len(driven.query("up"))
    for rule in rules:
        rows = driven.query(rule["expr"])  # an alert's expression is empty while it does not fire
        if "record" in rule:
            assert len(rows) == n_instances, f"{rule['record']}: {rows}"
            assert all(not math.isinf(v) for _, v in rows), rule["record"]
    # Recorded series lag the scrape by up to one evaluation interval: poll until they show the workload.
    expected = {"trtprompt:prefix_cache_hit_rate:ratio_rate5m": lambda v: 0 < v <= 1,
                "trtprompt:requests_failed:ratio_rate5m": lambda v: v > 0.1,  # 2 invalid of about 6
                "trtprompt:engine_restarts:increase15m": lambda v: v >= 0.9}
    for record, plausible in expected.items():
        _wait(f"{record} plausible on every instance", lambda: len(
            [v for _, v in driven.query(record) if plausible(v)]) == n_instances)
    # Prometheus itself evaluates every rule without error and holds the failure alert for both.
    _wait("every rule evaluated", lambda: all(
        r["health"] == "ok" and r.get("lastError", "") == "" for g in driven.api("rules")["groups"]
        for r in g["rules"]))
    active = _wait("the failure-rate alert on both", lambda: _alerts(driven, "TrtpromptFailureRateSpike", n_instances))
    assert {a["state"] for a in active} <= {"pending", "firing"}
    names = {a["labels"]["alertname"] for a in driven.api("alerts")["alerts"]}
    assert "TrtpromptEngineRestartLoop" not in names  # one restart is no loop


def _alerts(prom: Prometheus, name: str, expected: int) -> list[dict[str, Any]] | None:
    """The active (pending or firing) alerts of that name, once there are `expected` of them."""
    found = [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == name]
    return found if len(found) == expected else None
