"""`trtprompt serve --replicas 2` on the tiny engine: two complete servers on disjoint cores behind
sglang-router (docs/replicas.md). One group for the module: OpenAI calls through the router, the
same prefix kept on one replica, Triton gRPC on each replica's port, a killed engine process (no
hang, clear errors, the other replica serves, the dead one comes back), and the core split.
The group runs with an API key: the router checks it, each replica's front end checks it too."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from serve_fixtures import Served, Stops, start_server, wait_for

from trtprompt.client import LLMClient, text_inputs
from trtprompt.serve.launch import router as R
from trtprompt.serve.launch.cpu_sets import parse_cpulist, replica_cpu_sets
from trtprompt.serve.launch.process_group import descendants
from trtprompt.serve.launch.replicas import LAYOUT_FILE, replica_options
from trtprompt.serve.wire import protocol as P

PREFIX = "You are a careful assistant for the shipping desk. Answer in one short line. " * 6
KEY = "replicas-test-key-7f3a"  # given by file (--api-key-file), as a user would


def test_cpu_sets_split_nodes_and_refuse_too_many(tmp_path: Path) -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert replica_cpu_sets(2, [0, 1], tmp_path) == [frozenset({0}), frozenset({1})]
    assert replica_cpu_sets(2, [0, 1, 2, 3, 4], tmp_path) == [frozenset({0, 1, 2}), frozenset({3, 4})]
    for node, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    # One replica per node before two on any; a replica's cores never span nodes.
    assert replica_cpu_sets(2, range(8), tmp_path) == [frozenset(range(4)), frozenset(range(4, 8))]
    assert replica_cpu_sets(3, range(8), tmp_path) == [frozenset({0, 1}), frozenset({2, 3}), frozenset(range(4, 8))]
    with pytest.raises(ValueError, match="replicas 3 exceeds the 2 cores"):
        replica_cpu_sets(3, [0, 1], tmp_path)


def test_engine_threads_beyond_a_replicas_cores_refused(tiny_engine_dir: Path) -> None:
    from trtprompt.serve.launch.options import EngineInfo, resolve_options

    opts = resolve_options(EngineInfo.read(tiny_engine_dir), {"replicas": 2, "engine_threads": 3})
    with pytest.raises(ValueError, match="engine_threads 3 exceeds the 2 core"):
        replica_options(opts, frozenset({0, 1}))
    assert replica_options(resolve_options(EngineInfo.read(tiny_engine_dir), {"replicas": 2}),
                           frozenset({0, 1})).engine_threads == 2


def test_replicas_ports_are_all_distinct(tmp_path: Path) -> None:
    """Every replica's Triton and front-end ports come from one pick: none repeats another's, nor the user's."""
    from trtprompt.serve.launch.launcher import Ports
    from trtprompt.serve.launch.replicas import plan_replicas

    user = Ports(grpc=18001, http=18000, metrics=18002)
    specs = plan_replicas(4, user, tmp_path, [frozenset({i}) for i in range(4)])
    assert specs[0].ports == user
    taken = [p for s in specs for p in (s.ports.grpc, s.ports.http, s.ports.metrics, s.openai_port)]
    assert len(taken) == len(set(taken)) == 16


def test_inspect_shows_the_replicas_option(tiny_engine_dir: Path) -> None:
    from trtprompt.engine.engine_dir import read_engine_dir
    from trtprompt.report import inspect_data, inspect_text

    engine = read_engine_dir(tiny_engine_dir)
    cores = len(os.sched_getaffinity(0))
    shown = inspect_data(engine)["replicas"]
    assert (shown["replicas"], shown["cores_available"], shown["max_replicas"]) == (1, cores, cores)
    assert "replicas (serve option, default; docs/replicas.md)" in inspect_text(engine)


def test_each_replica_gets_its_own_kv_event_endpoints() -> None:
    from trtprompt.serve.launch.options import ServeOptions

    opts = ServeOptions(replicas=2, kv_events_endpoint="tcp://127.0.0.1:5557",
                        kv_events_replay_endpoint="ipc:///tmp/replay")
    second = replica_options(opts, frozenset({1}), 1)
    assert (second.kv_events_endpoint, second.kv_events_replay_endpoint) == ("tcp://127.0.0.1:5558",
                                                                             "ipc:///tmp/replay_1")
    assert replica_options(opts, frozenset({0}), 0).kv_events_endpoint == "tcp://127.0.0.1:5557"


@pytest.fixture(scope="module")
def group(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, stops: Stops) -> Iterator[Served]:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two replicas need two cores")
    root = tmp_path_factory.mktemp("replicas")
    key_file = root / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    server = start_server(tiny_engine_dir, root / "run", "--replicas", "2", "--api-key-file", str(key_file))
    yield server
    stops.server(server)


def layout(group: Served) -> dict[str, Any]:
    return json.loads((group.run_dir / LAYOUT_FILE).read_text())


def stats(replica: dict[str, Any]) -> dict[str, Any]:
    return P.call(replica["engine_socket"], {"op": "stats", "since": 1 << 62})


def client(group: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=group.openai_url, api_key=KEY, max_retries=0, timeout=60)


def chat(group: Served, system: str, user: str) -> str:
    c = client(group)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    reply = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages,  # type: ignore[arg-type]
                                      max_tokens=4, temperature=0)
    return reply.choices[0].message.content or ""


def router_opts(group: Served) -> R.RouterOptions:
    return R.RouterOptions("127.0.0.1", group.openai or 0, 1, api_key=KEY)


def test_layout_pins_each_replica_to_its_own_core(group: Served) -> None:
    replicas = layout(group)["replicas"]
    assert [r["cpus"] for r in replicas] == [[0], [1]]
    assert replicas[0]["grpc"] == group.grpc
    for r in replicas:  # the engine process runs on the replica's cores only
        pid = stats(r)["pid"]
        assert sorted(os.sched_getaffinity(pid)) == r["cpus"]


def test_openai_through_the_router(group: Served) -> None:
    c = client(group)
    model_ids = [m.id for m in c.models.list().data]
    direct = openai.OpenAI(base_url=f"{layout(group)['replicas'][0]['url']}/v1", api_key=KEY)
    assert model_ids == [m.id for m in direct.models.list().data]  # the replicas' own id, not "unknown"
    # Greedy text through the router equals a replica's own (which test_openai_api checks against generate()).
    done = c.completions.create(model=model_ids[0], prompt="Hello there", max_tokens=5, temperature=0)
    alone = direct.completions.create(model=model_ids[0], prompt="Hello there", max_tokens=5, temperature=0)
    assert done.choices[0].text == alone.choices[0].text and done.usage == alone.usage
    streamed = c.chat.completions.create(model=model_ids[0], messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0, stream=True)
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "length"


def test_same_prefix_stays_on_one_replica(group: Served) -> None:
    replicas = layout(group)["replicas"]
    before = [stats(r) for r in replicas]
    for i in range(6):
        chat(group, PREFIX, f"question {i}")
    after = [stats(r) for r in replicas]
    queried = [a["queried_tokens"] - b["queried_tokens"] for a, b in zip(after, before)]
    hits = [a["hit_tokens"] - b["hit_tokens"] for a, b in zip(after, before)]
    assert sorted(q > 0 for q in queried) == [False, True], f"prefix spread over replicas: {queried}"
    owner = queried.index(max(queried))
    # Five of six requests reuse the prefix's full blocks on the replica that holds them.
    assert hits[owner] >= 5 * 32 and hits[owner] / queried[owner] > 0.6


def test_triton_grpc_on_each_replica(group: Served) -> None:
    for r in layout(group)["replicas"]:
        with LLMClient(f"127.0.0.1:{r['grpc']}", api_key=KEY) as c:
            result = c.infer("ensemble", text_inputs("Hello", 3, True, temperature=0.0), 60.0)
        assert result.error is None and result.finished


def test_killed_engine_leaves_rotation_errors_clearly_and_rejoins(group: Served) -> None:
    replicas, c = layout(group)["replicas"], client(group)
    model = c.models.list().data[0].id
    stream = iter(c.completions.create(model=model, prompt="Once upon a time", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    for _ in range(3):
        next(stream)
    victim = next(r for r in replicas if stats(r)["in_flight"])  # the replica generating it
    os.kill(stats(victim)["pid"], signal.SIGKILL)
    # The running request ends with the engine's own words, not a hang or a silent cut.
    with pytest.raises(openai.APIError, match="engine process stopped while generating"):
        for _ in stream:
            pass

    def one(i: int) -> str:  # requests the dead engine never started: retried on the other replica
        return chat(group, PREFIX if i % 2 else f"Other prompt {i}. " * 8, f"during {i}")

    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(12), timeout=120))
    assert len(answers) == 12
    wait_for(lambda: (stats_or_none(victim) or {}).get("restarts") == 1, "the killed engine process restarted", 120)
    wait_for(lambda: victim["url"] in R.healthy_workers(router_opts(group)), "the router took the replica back", 60)
    back = openai.OpenAI(base_url=f"{victim['url']}/v1", api_key=KEY, max_retries=0)
    assert back.completions.create(model=model, prompt="Hello", max_tokens=2).choices[0].finish_reason == "length"
    assert "router exited" not in group.log_path.read_text(errors="replace")


def test_api_key_checked_by_the_router_and_every_replica(group: Served) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    fronts = [group.openai_url.removesuffix("/v1")] + [r["url"] for r in layout(group)["replicas"]]
    for base in fronts:  # the router's port, then each replica's own front end
        for auth in ({}, {"Authorization": "Bearer wrong-key"}):
            req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json",
                                                                              **auth})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=30)
            assert refused.value.code == 401, (base, auth)
        with urllib.request.urlopen(f"{base}/health", timeout=10) as resp:  # health checks need no key
            assert resp.status == 200
    assert chat(group, "Be brief.", "Hello") is not None  # and the key passes, through the router
    assert {r["url"] for r in layout(group)["replicas"]} <= R.healthy_workers(router_opts(group))
    # Not on any command line (tritonserver's aside: Triton 2.51 takes it only there, docs/security.md)
    # nor in any log.
    for pid in descendants(group.proc.pid) + [group.proc.pid]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv[0].endswith(b"tritonserver"):
            assert KEY.encode() not in b" ".join(argv), argv
    for log in [group.log_path, *group.run_dir.rglob("*.log")]:
        assert KEY not in log.read_text(errors="replace"), log
    assert not list(group.run_dir.rglob("router.secrets")) and not list(group.run_dir.rglob("openai.key"))


def stats_or_none(replica: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return stats(replica)
    except (P.EngineUnavailableError, P.EngineError):
        return None
