"""Many machines, played here by ports (docs/multi-node.md): a router node (`trtprompt router`,
sglang-router with no worker) and two `trtprompt serve --join-router` servers that register
themselves through the router's worker API, which an admin key guards; clients need the API key,
which the router checks and the servers check again. Real processes only."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import openai
import pytest
from serve_fixtures import ROOT, Served, Stops, check_stopped_cleanly, start_server, wait_for

from trtprompt.serve.launch import router as R
from trtprompt.serve.launch.process_group import descendants
from trtprompt.serve.ports import free_ports

ADMIN_KEY = "multinode-admin-key-for-tests"
API_KEY = "multinode-api-key-for-tests"
LONG = "You answer questions about the warehouse inventory, briefly and exactly. " * 8


@dataclasses.dataclass
class Cluster:
    router: R.RouterAPI
    router_proc: subprocess.Popen[bytes]
    servers: list[Served]
    key_file: Path
    api_key_file: Path
    root: Path

    def join_args(self) -> tuple[str, ...]:
        return ("--join-router", self.router.base, "--router-admin-key-file", str(self.key_file),
                "--api-key-file", str(self.api_key_file))


def secret_file(path: Path, value: str) -> Path:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


def start_router_node(root: Path, key_file: Path, api_key_file: Path,
                      port: int | None = None) -> tuple[R.RouterAPI, subprocess.Popen[bytes]]:
    free, metrics = free_ports(2)
    port = port or free
    log = root / f"router-node-{port}-{len(list(root.glob('router-node-*.log')))}.log"
    cmd = [sys.executable, "-m", "trtprompt.cli", "router", "--port", str(port), "--metrics-port", str(metrics),
           "--admin-key-file", str(key_file), "--api-key-file", str(api_key_file), "--run-dir", str(root / "router")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_for(lambda: "trtprompt router: ready" in log.read_text(errors="replace") or proc.poll() is not None,
             "the router node ready", 90)
    assert proc.poll() is None, log.read_text(errors="replace")
    for pid in [proc.pid, *descendants(proc.pid)]:  # the router itself: its keys on no command line
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert ADMIN_KEY.encode() not in argv and API_KEY.encode() not in argv, argv
    return R.RouterAPI(f"http://127.0.0.1:{port}", ADMIN_KEY), proc


def stop_cluster(c: Cluster) -> None:
    with cf.ThreadPoolExecutor(2) as pool:  # side by side, before the router they deregister from
        list(pool.map(check_stopped_cleanly, [s for s in c.servers if s.proc.poll() is None]))
    c.router_proc.terminate()
    assert c.router_proc.wait(30) == 0, "the router node did not stop cleanly"


@pytest.fixture(scope="module")
def cluster(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, stops: Stops) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("multinode")
    key_file, api_key_file = secret_file(root / "admin.key", ADMIN_KEY), secret_file(root / "api.key", API_KEY)
    router, proc = start_router_node(root, key_file, api_key_file)
    c = Cluster(router, proc, [], key_file, api_key_file, root)
    try:
        ports = free_ports(8)  # one call: the two starts below must not pick the same released port
        with cf.ThreadPoolExecutor(2) as pool:  # the two "machines" start side by side
            starts = [pool.submit(start_server, tiny_engine_dir, root / f"machine-{i}", *c.join_args(),
                                  ports=ports[4 * i:4 * i + 4]) for i in range(2)]
            cf.wait(starts)
        # A server that started is stopped with the cluster even when the other failed to (it would be left running).
        c.servers = [f.result() for f in starts if f.exception() is None]
        for f in starts:
            f.result()  # the first failure, raised
    except BaseException:
        stop_cluster(c)
        raise
    yield c
    stops.later(f"the cluster in {root}", lambda: stop_cluster(c))


def url(server: Served) -> str:
    return f"http://127.0.0.1:{server.openai}"


def router_client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.router.base}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_both_servers_join_and_the_worker_api_needs_the_admin_key(cluster: Cluster) -> None:
    wait_for(lambda: R.healthy_workers(cluster.router) == {url(s) for s in cluster.servers},
             "both servers healthy in the router", 60)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{cluster.router.base}/workers", timeout=5)
    assert refused.value.code == 401
    with pytest.raises(openai.AuthenticationError):  # a client without the API key, through the router
        openai.OpenAI(base_url=f"{cluster.router.base}/v1", api_key="wrong", max_retries=0).completions.create(
            model="m", prompt="Hello", max_tokens=2)
    logs = list(cluster.root.rglob("*.log"))
    assert not any(k in log.read_text(errors="replace") for log in logs for k in (ADMIN_KEY, API_KEY))
    assert not list(cluster.root.rglob("router.secrets"))  # read and removed
    for s in cluster.servers:
        assert f"registered {url(s)} with the router" in s.log_path.read_text(errors="replace")


def test_chat_through_the_router_and_one_prefix_stays_on_one_server(cluster: Cluster) -> None:
    wait_for(lambda: len(R.healthy_workers(cluster.router)) == 2, "both servers healthy", 60)
    c = router_client(cluster)
    model = c.models.list().data[0].id
    before = [s.engine_stats() for s in cluster.servers]
    for question in ("Where are the bolts?", "Where are the nuts?"):
        reply = c.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": LONG}, {"role": "user", "content": question}])
        assert reply.choices[0].finish_reason in ("length", "stop")
    after = [s.engine_stats() for s in cluster.servers]
    queried = [a["queried_tokens"] - b["queried_tokens"] for a, b in zip(after, before)]
    hits = [a["hit_tokens"] - b["hit_tokens"] for a, b in zip(after, before)]
    assert sorted(q > 0 for q in queried) == [False, True], f"the prefix went to both servers: {queried}"
    assert hits[queried.index(max(queried))] >= 32  # the second request reused the first one's blocks


def test_a_restarted_router_gets_both_servers_back(cluster: Cluster) -> None:
    cluster.router_proc.terminate()
    assert cluster.router_proc.wait(30) == 0
    port = int(cluster.router.base.rsplit(":", 1)[1])
    cluster.router, cluster.router_proc = start_router_node(cluster.root, cluster.key_file, cluster.api_key_file,
                                                            port)
    # Its list starts empty; each server's keeper sees itself missing and registers again.
    wait_for(lambda: R.healthy_workers(cluster.router) == {url(s) for s in cluster.servers},
             "both servers back in the restarted router", 60)
    for s in cluster.servers:
        assert f"registered {url(s)} with the router {cluster.router.base} again" in s.log_path.read_text()


def test_a_stopped_server_leaves_and_rejoins(cluster: Cluster, tiny_engine_dir: Path) -> None:
    leaving = cluster.servers[1]
    check_stopped_cleanly(leaving)  # SIGINT: the server deregisters before it stops
    listed = {w["url"] for w in R.workers(cluster.router)}
    assert url(leaving) not in listed and url(cluster.servers[0]) in listed
    assert "removed" in leaving.log_path.read_text(errors="replace")
    # Started again on the same OpenAI port (a later flag wins): the same address rejoins.
    again = start_server(tiny_engine_dir, cluster.root / "machine-1-again", *cluster.join_args(),
                         "--openai-port", str(leaving.openai))
    again = dataclasses.replace(again, openai=leaving.openai)
    cluster.servers[1] = again
    wait_for(lambda: url(again) in R.healthy_workers(cluster.router), "the restarted server back in the router", 60)
    c = router_client(cluster)
    answer = c.completions.create(model=c.models.list().data[0].id, prompt="Hello", max_tokens=2)
    assert answer.choices[0].finish_reason == "length"


def test_a_server_with_a_key_refuses_a_router_without_one(cluster: Cluster) -> None:
    """An open router would call a keyed server with the server's own key for anyone."""
    from trtprompt.serve.launch.join import JoinOptions, RouterJoin
    from trtprompt.serve.launch.launcher import LaunchError

    port, metrics = free_ports(2)
    log = cluster.root / "open-router.log"
    with open(log, "wb") as out:
        open_router = subprocess.Popen([sys.executable, "-m", "trtprompt.cli", "router", "--port", str(port),
                                        "--metrics-port", str(metrics)], stdout=out, stderr=subprocess.STDOUT,
                                       cwd=ROOT, env={k: v for k, v in os.environ.items() if "KEY" not in k})
    try:
        wait_for(lambda: "trtprompt router: ready" in log.read_text(errors="replace"), "the open router", 90)
        server = cluster.servers[0]
        keeper = RouterJoin(JoinOptions(R.RouterAPI(f"http://127.0.0.1:{port}"), url(server), API_KEY),
                            f"{url(server)}/health", lambda _: None)
        with pytest.raises(LaunchError, match="takes requests without an API key"):
            keeper.start()
        assert R.workers(R.RouterAPI(f"http://127.0.0.1:{port}")) == []  # nothing registered
    finally:
        open_router.terminate()
        open_router.wait(30)


def test_join_refuses_an_unspecified_advertise_host() -> None:
    from trtprompt.serve.launch.join import join_options

    with pytest.raises(ValueError, match="--advertise-url"):
        join_options("http://router:30000", None, "0.0.0.0", 8003, None, None)
    with pytest.raises(ValueError, match="names no host"):
        join_options("http://router:30000", "http://0.0.0.0:8003", "0.0.0.0", 8003, None, None)
    assert join_options("http://r:1/", None, "127.0.0.1", 8003, None, None).advertise_url == "http://127.0.0.1:8003"


def test_router_node_refuses_an_open_worker_api_off_loopback() -> None:
    from trtprompt.serve.launch.router_node import NodeOptions

    with pytest.raises(ValueError, match="admin key"):
        NodeOptions(R.RouterOptions("0.0.0.0", 30000, 29000))
    NodeOptions(R.RouterOptions("0.0.0.0", 30000, 29000, admin_key="k"))
    assert "k" not in repr(R.RouterOptions("0.0.0.0", 30000, 29000, api_key="k", admin_key="k"))


def test_env_key_variables_do_not_reach_the_router() -> None:
    from trtprompt.serve.launch.router_node import node_env

    env = node_env({"TRTPROMPT_API_KEY": "a", R.ADMIN_KEY_ENV: "b", "HOME": "/h"})
    assert "TRTPROMPT_API_KEY" not in env and R.ADMIN_KEY_ENV not in env and env["HOME"] == "/h"
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)  # router_main importable on any cwd
