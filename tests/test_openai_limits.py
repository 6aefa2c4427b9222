"""The OpenAI front end's 401 / 429 / 503 against a server of its own: an API key, one running
request and one waiting place (--max-batch-size 1 --max-queue-size 1), and an engine process
the test kills."""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from serve_fixtures import Served, Stops, _alive, start_server, wait_for
from trtprompt.serve.launch.process_group import descendants

pytestmark = pytest.mark.server
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def strict(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, stops: Stops) -> Iterator[Served]:
    # The key from the environment (never a command-line value): the server inherits it, and so do
    # this module's own Triton clients (LLMClient reads TRTPROMPT_API_KEY), which then need it too.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRTPROMPT_API_KEY", KEY)
        server = start_server(tiny_engine_dir, tmp_path_factory.mktemp("openai-strict") / "run",
                              "--max-batch-size", "1", "--max-queue-size", "1")
        yield server
        stops.server(server)


def send(served: Served, body: dict[str, Any], key: str | None = KEY) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    return conn


def answer(conn: http.client.HTTPConnection) -> tuple[int, dict[str, str], Any]:
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw)


def body(served: Served, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": served.engine_dir.name, "prompt": "hold the line " * 4, "max_tokens": max_tokens,
            "temperature": 0} | extra


def test_api_key_is_required(strict: Served) -> None:
    for key, message in ((None, "missing API key"), ("sk-wrong", "incorrect API key")):
        status, headers, data = answer(send(strict, body(strict), key))
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert data["error"]["code"] == "invalid_api_key" and message in data["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.openai_url, api_key="sk-wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=strict.openai_url, api_key=KEY, max_retries=0)
    assert ok.completions.create(**body(strict)).usage.completion_tokens == 4


def test_queue_full_is_429_with_retry_after(strict: Served) -> None:
    def metric(kind: str) -> float | None:
        return strict.metric("nv_trt_llm_request_metrics", request_type=kind)

    running = send(strict, body(strict, 1500, ignore_eos=True, stream=True))
    resp = running.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    waiting = send(strict, body(strict, 8))  # takes the one waiting place
    wait_for(lambda: metric("waiting") == 1, "the second request waiting")
    status, headers, data = answer(send(strict, body(strict)))
    assert status == 429 and headers["retry-after"] == "1"
    assert data["error"]["type"] == "rate_limit_error" and data["error"]["code"] == "queue_full"
    assert "max_queue_size=1" in data["error"]["message"]
    refused = strict.text("over gRPC", 4)  # the same refusal as Triton answers it: the code tagged
    assert refused.error is not None and "[queue_full] queue full:" in refused.error
    running.close()  # cancels the long request: the waiting one runs and answers
    status, _, data = answer(waiting)
    assert status == 200 and data["usage"]["completion_tokens"] <= 8
    wait_for(lambda: metric("active") == 0, "an idle engine")


def test_engine_restart_is_503_then_service_resumes(strict: Served) -> None:
    engines = [p for p in descendants(strict.proc.pid)
               if b"trtprompt.serve.engine_process" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(engines) == 1
    os.kill(engines[0], signal.SIGKILL)
    wait_for(lambda: not _alive(engines[0]), "the engine process gone")
    status, headers, data = answer(send(strict, body(strict)))
    # The launcher restarts the engine within a few seconds; a request in between is told to retry.
    assert status == 503 and headers["retry-after"] == "1", data
    assert data["error"]["code"] == "engine_unavailable" and "engine process" in data["error"]["message"]
    wait_for(lambda: answer(send(strict, body(strict)))[0] == 200, "service back after the restart", 120.0)
