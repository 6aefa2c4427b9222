"""The engine process protocol without Triton: one connection per stub, one frame per step.

The server side (engine_server's socket server over an EngineLoop) and the
stub side (relay.EngineClient) run here on a real tiny engine and a real
unix socket; docs/design.md "Request path and engine process protocol".
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from engine_helpers import hf_greedy, make_engine, make_hf_model
from trtprompt.engine.loop import EngineLoop
from trtprompt.engine.request import SamplingParams
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.engine_process.server import EngineService, _Server
from trtprompt.serve.triton_models.cancel_watch import CancelWatcher
from trtprompt.serve.wire.engine_client import EngineClient
from trtprompt.serve.wire.requests import TokenRequest

DEADLINE_S = 60.0
ROOT = Path(__file__).resolve().parent.parent


def _req(ids: list[int], max_tokens: int) -> TokenRequest:
    return TokenRequest(tuple(ids), SamplingParams(max_tokens=max_tokens), stream=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


class Engine:
    """An engine process's socket server, in this process."""

    def __init__(self, llama: Path, path: str, start: bool = True) -> None:
        self.loop = EngineLoop(make_engine(llama, max_batch_size=8))
        if start:
            self.loop.start()
        self.path = path
        self.server = _Server(path, EngineService(self.loop))
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.loop.stop()
        self.server.server_close()

    def wait_idle(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.loop.num_in_flight() or self.loop.engine.stats().used_num_blocks:
            assert time.monotonic() < deadline, "requests were not released"
            time.sleep(0.02)


@pytest.fixture()
def engine(llama: Path, tmp_path: Path) -> Iterator[Engine]:
    e = Engine(llama, str(tmp_path / "engine.sock"))
    yield e
    e.stop()


class Collector:
    """A handler: every entry of one request, and an event when it is final."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.done = threading.Event()

    def __call__(self, entry: dict[str, Any]) -> None:
        assert not self.done.is_set(), f"an entry after the final one: {entry}"
        self.entries.append(entry)
        if entry["finished"]:
            self.done.set()

    def tokens(self) -> list[int]:
        return [t for e in self.entries for t in e.get("new_token_ids", [])]

    def wait(self) -> dict[str, Any]:
        assert self.done.wait(DEADLINE_S), "no final entry"
        return self.entries[-1]


def test_one_connection_multiplexes_concurrent_requests(engine: Engine, llama: Path) -> None:
    client = EngineClient(engine.path)
    prompts = [list(range(3 + i, 17 + 2 * i)) for i in range(6)]
    handlers = [Collector() for _ in prompts]
    threads = [threading.Thread(target=client.submit, args=(_req(p, 7), h))
               for p, h in zip(prompts, handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finals = [h.wait() for h in handlers]
    assert [h.tokens() for h in handlers] == [hf_greedy(llama, tuple(p), 7) for p in prompts]
    assert [f["finish_reason"] for f in finals] == ["length"] * 6
    assert all("stats" in h.entries[-1] and "stats" not in h.entries[0] for h in handlers)
    assert engine.server.next_number() == 2  # every request went over the one connection
    client.close()


def _raw_frames(sock: socket.socket, reader: P.FrameReader, finals: int) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    while sum(e["finished"] for f in frames for e in f["outputs"]) < finals:
        frames += reader.feed(sock)
        assert not reader.closed
    return frames


def test_one_frame_per_step_carries_every_request(llama: Path, tmp_path: Path) -> None:
    engine = Engine(llama, str(tmp_path / "engine.sock"), start=False)
    sock, reader = P.connect(engine.path), P.FrameReader()
    for i in range(4):
        P.send_frame(sock, {"op": "submit", "id": f"q{i}", "prompt_token_ids": [5 + i, 6, 7, 8],
                            "params": {"max_tokens": 5}, "cache_salt": None, "perf": i == 0})
    deadline = time.monotonic() + DEADLINE_S
    while engine.loop.num_in_flight() < 4:  # all four queued before the first step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.loop.start()
    frames = _raw_frames(sock, reader, 4)
    sock.close()
    engine.stop()
    assert len(frames) == 5  # prefill (first token) + 4 decode steps
    assert all(f["type"] == "step" and sorted(e["id"] for e in f["outputs"]) == ["q0", "q1", "q2", "q3"]
               for f in frames)
    for i in range(4):
        mine = [e for f in frames for e in f["outputs"] if e["id"] == f"q{i}"]
        assert [t for e in mine for t in e["new_token_ids"]] == hf_greedy(llama, (5 + i, 6, 7, 8), 5)
        assert [e["finished"] for e in mine] == [False] * 4 + [True]
        assert [e["num_output_tokens"] for e in mine] == [1, 2, 3, 4, 5]
        # stats: on every entry of the request that asked for perf metrics, else on the final only
        assert ["stats" in e for e in mine] == ([True] * 5 if i == 0 else [False] * 4 + [True])


def test_rejected_submit_fails_only_that_request(engine: Engine) -> None:
    client = EngineClient(engine.path)
    good, bad = Collector(), Collector()
    client.submit(_req([5, 6, 7], 4), good)
    client.submit(_req([5, 10**6], 4), bad)
    assert bad.wait()["code"] == P.INVALID_ARG
    assert "outside the vocabulary" in bad.wait()["error"]
    assert good.wait()["finish_reason"] == "length" and len(good.tokens()) == 4
    with pytest.raises(P.EngineError, match="over the engine protocol's limit"):
        client.submit(_req([5] * (P.MAX_FRAME // 2), 4), Collector())
    again = Collector()
    client.submit(_req([5, 6], 2), again)  # the connection survived both
    assert again.wait()["finish_reason"] == "length"
    client.close()


def test_abort_and_disconnect_free_the_engine(engine: Engine) -> None:
    client = EngineClient(engine.path)
    handler = Collector()
    rid = client.submit(_req([5, 6, 7], 200), handler)
    while not handler.entries:
        time.sleep(0.01)
    client.abort([rid])
    assert handler.wait()["finish_reason"] == "aborted"
    engine.wait_idle()
    # A stub that goes away: everything it had in flight is aborted.
    lost = [Collector() for _ in range(3)]
    for h in lost:
        client.submit(_req([5, 6, 7], 200), h)
    while not all(h.entries for h in lost):
        time.sleep(0.01)
    client.close()
    assert [h.wait()["code"] for h in lost] == [P.UNAVAILABLE] * 3
    engine.wait_idle()
    assert engine.loop.engine.stats().used_num_blocks == 0


def _engine_process(engine_dir: Path, tmp_path: Path, path: str) -> subprocess.Popen:
    """The real engine process (python -m trtprompt.serve.engine_process), as the launcher starts it."""
    repo = tmp_path / "repository"
    (repo / "tensorrt_llm").mkdir(parents=True, exist_ok=True)
    (repo / "tensorrt_llm" / "config.pbtxt").write_text(
        'name: "tensorrt_llm"\nbackend: "python"\n'
        f'parameters {{ key: "gpt_model_path" value {{ string_value: "{engine_dir}" }} }}\n')
    proc = subprocess.Popen([sys.executable, "-m", "trtprompt.serve.engine_process", "--repository", str(repo),
                             "--socket", path], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            P.call(path, {"op": "info"}, timeout=1.0)
            return proc
        except P.EngineUnavailableError:
            assert proc.poll() is None and time.monotonic() < deadline, "the engine process did not start"
            time.sleep(0.1)


def test_killed_engine_ends_every_request_then_reconnects(tiny_engine_dir: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    first = _engine_process(tiny_engine_dir, tmp_path, path)
    client = EngineClient(path)
    handlers = [Collector() for _ in range(3)]
    for h in handlers:
        client.submit(_req([5, 6, 7], 1000), h)
    try:
        while not all(h.entries for h in handlers):
            time.sleep(0.01)
        first.kill()
        assert [h.wait()["error"] for h in handlers] == [P.LOST_MESSAGE] * 3
        assert [h.wait()["code"] for h in handlers] == [P.UNAVAILABLE] * 3
        first.wait()
        with pytest.raises(P.EngineUnavailableError, match="engine process unavailable"):
            client.submit(_req([5, 6], 3), Collector())
        second = _engine_process(tiny_engine_dir, tmp_path, path)  # the launcher's restart
        after = Collector()
        client.submit(_req([5, 6], 3), after)  # a new connection
        assert after.wait()["finish_reason"] == "length" and len(after.tokens()) == 3
    finally:
        client.close()
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def test_no_engine_is_unavailable_at_submit(tmp_path: Path) -> None:
    client = EngineClient(str(tmp_path / "nobody.sock"))
    with pytest.raises(P.EngineUnavailableError, match="engine process unavailable"):
        client.submit(_req([5], 1), Collector())


class _Flag:
    def __init__(self, cancelled: bool) -> None:
        self.cancelled, self.calls = cancelled, threading.Event()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.calls.set()


def test_one_watcher_cancels_only_the_cancelled() -> None:
    steps = [0]
    watcher = CancelWatcher(0.01, lambda: steps[0])
    yes, no = _Flag(True), _Flag(False)
    watcher.add(yes)
    watcher.add(no)
    steps[0] += 1  # a step frame arrived: the next sweep checks everyone
    assert yes.calls.wait(DEADLINE_S)
    watcher.discard(yes)
    time.sleep(0.05)
    watcher.stop()
    assert not no.calls.is_set()


class _Counting(_Flag):
    def __init__(self) -> None:
        super().__init__(False)
        self.checks = 0

    def is_cancelled(self) -> bool:
        self.checks += 1
        return False


def test_watcher_checks_at_most_once_per_step() -> None:
    steps, read = [0], threading.Event()

    def count_steps() -> int:
        read.set()
        return steps[0]

    watcher = CancelWatcher(0.01, count_steps, idle_s=3600.0)
    assert read.wait(DEADLINE_S)  # the watcher took its starting count before the first step
    item = _Counting()
    watcher.add(item)
    deadline = time.monotonic() + DEADLINE_S
    for step in range(1, 4):  # three steps, each followed by several periods
        steps[0] += 1
        while item.checks < step:
            assert time.monotonic() < deadline, f"no sweep after step {step}"
            time.sleep(0.01)
        time.sleep(0.05)  # room for extra sweeps, which must not happen
    watcher.stop()
    assert item.checks == 3


def test_watcher_sweeps_without_steps_after_the_idle_bound() -> None:
    watcher = CancelWatcher(0.01, lambda: 0, idle_s=0.05)
    item = _Counting()
    watcher.add(item)
    deadline = time.monotonic() + DEADLINE_S
    while item.checks < 2:
        assert time.monotonic() < deadline, "no idle sweep"
        time.sleep(0.02)
    watcher.stop()



def test_a_step_past_the_frame_limit_goes_out_entry_by_entry(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw logits are large: a step whose entries pass MAX_FRAME together is sent one entry per frame, and
    an entry past it alone fails its own request (aborted in the engine), never the step's others."""
    monkeypatch.setattr(P, "MAX_FRAME", 6000)  # about three rows of this model's 256 logits each, as base64
    client = EngineClient(engine.path)
    small, small_too, huge = Collector(), Collector(), Collector()
    logits = SamplingParams(max_tokens=4, temperature=0.0, return_generation_logits=True)
    client.submit(TokenRequest((5, 6, 7), logits, stream=True), small)
    client.submit(TokenRequest((8, 9, 10), logits, stream=True), small_too)
    client.submit(TokenRequest(tuple(range(5, 25)), SamplingParams(max_tokens=4, return_context_logits=True),
                               stream=True), huge)
    for done in (small, small_too):
        assert done.wait()["finish_reason"] == "length" and len(done.tokens()) == 4
    failed = huge.wait()
    assert failed["code"] == P.INVALID_ARG and "over the engine protocol's limit" in failed["error"]
    engine.wait_idle()  # the failed request was aborted in the engine too
    client.close()
