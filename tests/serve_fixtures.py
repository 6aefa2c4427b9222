"""Session fixtures for the serve tests: one real tritonserver (via `trtprompt serve`)
over the tiny engine, started once, plus the in-process greedy oracle.

Registered from conftest.py (pytest_plugins) so every test_serve_* module
shares the same server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

import pytest

from trtprompt.client import LLMClient, StreamResult, text_inputs, token_inputs
from trtprompt.serve.launch.process_group import descendants
from trtprompt.serve.ports import free_ports
from trtprompt.serve.wire import protocol as P

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0


@dataclass
class Served:
    """A running `trtprompt serve` and what the tests need to reach it."""

    proc: subprocess.Popen
    run_dir: Path
    log_path: Path
    grpc: int
    http: int
    metrics: int
    engine_dir: Path
    child_pids: list[int] = field(default_factory=list)
    openai: int | None = None  # the OpenAI-compatible front end's port

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai}/v1"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def socket_path(self) -> str:
        return str(self.run_dir / "engine.sock")

    def engine_stats(self) -> dict[str, Any]:
        return P.call(self.socket_path, {"op": "stats", "since": 1 << 62})

    def engine_info(self) -> dict[str, Any]:
        return P.call(self.socket_path, {"op": "info"})

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5) as resp:
            return resp.read().decode("utf-8")

    def metric(self, name: str, **labels: str) -> float | None:
        """Value of one series on /metrics (labels must match exactly those given)."""
        for line in self.metrics_text().splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(m.group(4))
        return None

    def text(self, prompt: str | bytes, max_tokens: int, stream: bool = True, model: str = "ensemble",
             timeout_s: float = 60.0, outputs: Sequence[str] | None = None, **optional: Any) -> StreamResult:
        with LLMClient(self.url) as client:
            return client.infer(model, text_inputs(prompt, max_tokens, stream, **optional), timeout_s,
                                outputs=outputs)

    def tokens(self, ids: list[int], max_tokens: int, streaming: bool = True,
               outputs: Sequence[str] | None = None, **optional: Any) -> StreamResult:
        with LLMClient(self.url) as client:
            return client.infer("tensorrt_llm", token_inputs(ids, max_tokens, streaming, **optional), 60.0,
                                outputs=outputs)

    def tritonserver_pid(self) -> int:
        """The one tritonserver under this serve (the launcher may have restarted it since it started)."""
        found = [pid for pid in descendants(self.proc.pid) if _program(pid).endswith("/tritonserver")]
        assert len(found) == 1, f"tritonserver processes under serve: {found}"
        return found[0]

    def assert_healthy(self) -> None:
        assert self.proc.poll() is None, "the server process exited"
        result = self.text("health check", 4, temperature=0.0)
        assert result.error is None, result.error
        assert result.finished


def _program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""  # exited meanwhile


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_server(engine_dir: Path, run_dir: Path, *extra: str, ports: Sequence[int] | None = None) -> Served:
    """ports: (grpc, http, metrics, openai) chosen by the caller; servers started side by side must be given
    ports from one free_ports call, or both may pick a port the other has released but not yet bound."""
    grpc, http, metrics, openai = ports if ports is not None else free_ports(4)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    cmd = [sys.executable, "-m", "trtprompt.cli", "serve", str(engine_dir), "--run-dir", str(run_dir),
           "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics),
           "--openai-port", str(openai),
           "--stats-check-period-ms", "50", "--cancellation-check-period-ms", "20", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    served = Served(proc, run_dir, log_path, grpc, http, metrics, engine_dir, openai=openai)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "trtprompt serve: ready" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(served)
            pytest.fail(f"trtprompt serve did not become ready:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.1)
    served.child_pids = descendants(proc.pid)
    return served


def stop_server(served: Served) -> int | None:
    """SIGINT, as Ctrl-C does; returns the exit code (None if it had to be killed)."""
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGINT)
        try:
            served.proc.wait(60)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait()
            return None
    return served.proc.returncode


def check_stopped_cleanly(served: Served) -> None:
    served.child_pids = descendants(served.proc.pid)  # the engine may have been restarted
    code = stop_server(served)
    leftovers = [pid for pid in served.child_pids if _alive(pid)]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert code == 0, f"serve exited with {code}:\n{served.log_path.read_text(errors='replace')[-3000:]}"
    assert not leftovers, f"child processes left after SIGINT: {leftovers}"


class Stops:
    """Module servers stopped while the next modules' tests run: a stop is seconds of Triton waiting out its
    unload polls, not work. Each is checked as its fixture checked it (check_stopped_cleanly and whatever else
    it passes); wait() fails naming every one that did not stop cleanly."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="stop")
        self._pending: list[tuple[str, Future[None]]] = []
        self._servers: list[Served] = []

    def later(self, what: str, stop: Callable[[], None]) -> None:
        self._pending.append((what, self._pool.submit(stop)))

    def server(self, served: Served) -> None:
        self._servers.append(served)
        self.later(str(served.run_dir), lambda: check_stopped_cleanly(served))

    def holds(self, served: Served) -> bool:
        return any(s is served for s in self._servers)

    def wait(self) -> None:
        failures = []
        for what, done in self._pending:
            try:
                done.result()
            except Exception as exc:  # each one is reported, naming what it stopped
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
        self._pool.shutdown()
        assert not failures, "not stopped cleanly:\n" + "\n\n".join(failures)


@pytest.fixture(scope="session")
def stops() -> Iterator[Stops]:
    """Where module fixtures hand what they started when their tests are done; the session's end waits."""
    pending = Stops()
    yield pending
    pending.wait()


# The session's server goes to `stops` once the module of the last test that uses it is torn down: the tests
# after that module run while it stops (conftest.py registers these two hooks).
SESSION_SERVER = pytest.StashKey[tuple[Served, Stops]]()
HAND_OFF_AFTER = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after -k, -m and any reordering: the order the tests run in
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    users = [i for i, item in enumerate(items) if "served" in getattr(item, "fixturenames", ())]
    if users:
        last = users[-1]
        while last + 1 < len(items) and items[last + 1].path == items[users[-1]].path:
            last += 1
        config.stash[HAND_OFF_AFTER] = items[last].nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    result = yield  # the item's teardown, its module's too when the next test is in another module
    held = item.config.stash.get(SESSION_SERVER, None)
    if held is not None and nextitem is not None and item.nodeid == item.config.stash.get(HAND_OFF_AFTER, None):
        server, stops = held
        stops.server(server)
    return result


@pytest.fixture(scope="session")
def served(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
           stops: Stops) -> Iterator[Served]:
    """`trtprompt serve` of the tiny engine (fused layout), shared by all serve tests."""
    server = start_server(tiny_engine_dir, tmp_path_factory.mktemp("serve") / "run")
    request.config.stash[SESSION_SERVER] = (server, stops)
    yield server
    del request.config.stash[SESSION_SERVER]
    if not stops.holds(server):  # no test after its last user's module: stopped here
        check_stopped_cleanly(server)


class Oracle:
    """`trtprompt generate`'s greedy output for the same engine, in process."""

    def __init__(self, engine_dir: Path) -> None:
        from trtprompt.generate import load

        self.engine, self.tokenizer = load(engine_dir)

    def run(self, prompt: str, max_tokens: int) -> Any:
        from trtprompt.engine.request import SamplingParams
        from trtprompt.generate import generate

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return generate(self.engine, self.tokenizer, [prompt], params)[0]

    def text(self, prompt: str, max_tokens: int) -> str:
        return self.run(prompt, max_tokens).text

    def token_ids(self, prompt: str, max_tokens: int) -> list[int]:
        return self.run(prompt, max_tokens).output_ids


@pytest.fixture(scope="session")
def oracle(tiny_engine_dir: Path) -> Oracle:
    return Oracle(tiny_engine_dir)


def wait_for(predicate: Callable[[], object], what: str | Callable[[], str], timeout_s: float = 60.0) -> None:
    """Poll predicate until it is true; fail naming `what` past the deadline (tests poll, never sleep).

    `what` may be a callable so that the message shows what the last poll saw, not what was known before it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what() if callable(what) else what} within {timeout_s:.0f}s"
        time.sleep(0.05)


# ---------------------------------------------------------------- the OpenAI front end, as the tests call it

def openai_client(served: Served) -> Any:
    """The official openai client on served's OpenAI port (no retries: a failure is the test's)."""
    import openai

    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)


def openai_model(served: Served) -> str:
    """The model name served's front end answers to."""
    from trtprompt.serve.openai.config import FrontendConfig

    return FrontendConfig.for_engine(served.engine_dir, "127.0.0.1:1").limits.name


def openai_post(served: Served, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a JSON body to served's OpenAI port: (status, JSON answer), whatever the status."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()
