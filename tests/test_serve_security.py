"""A server with an API key (docs/security.md): every Triton API group but health refuses a call
without the key, over HTTP and gRPC, with the real tritonclient; every one answers with it; health
and /metrics stay open; trtprompt's own clients (infer, the bench channel, the OpenAI front end's
Triton path) send it; the key is on no command line of ours and on disk only until the front end
has read it; the python backend's /dev/shm regions are the server user's alone."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from click.testing import CliRunner
from tritonclient.utils import InferenceServerException

from serve_fixtures import ROOT, Served, Stops, check_stopped_cleanly, start_server
from trtllm_fixtures import make_engine_dir
from trtprompt.bench.triton_client import SharedTritonChannel
from trtprompt.cli import main
from trtprompt.client import API_KEY_ENV, GRPC_AUTH_HEADER, LLMClient, text_inputs, token_inputs
from trtprompt.serve.launch.launcher import RESTRICTED_APIS
from trtprompt.serve.launch.options import ApiKey
from trtprompt.serve.launch.process_group import SHM_DIR, descendants
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.to_triton import TritonEnsemble
from trtprompt.serve.ports import free_ports, http_ok

pytestmark = pytest.mark.server
KEY = "sk-secure-0123456789abcdef"
# Triton 2.51's refusal, on both protocols (HTTP 403; gRPC UNAVAILABLE, not UNAUTHENTICATED).
REFUSED = "is restricted, expecting header"
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def secure(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, stops: Stops) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("secure")
    key_file = root / "api.key"
    key_file.write_text(KEY + "\n", encoding="utf-8")
    key_file.chmod(0o600)
    server = start_server(tiny_engine_dir, root / "run", "--api-key-file", str(key_file))
    yield server

    def stop() -> None:
        check_stopped_cleanly(server)
        assert not list(SHM_DIR.glob(f"{shm_prefix(server)}*")), "shared memory left after shutdown"
        assert not (server.run_dir / "openai.key").exists()

    stops.later(str(server.run_dir), stop)


def shm_prefix(served: Served) -> str:
    return f"trtprompt_{served.proc.pid}_{served.run_dir.name}_"  # Server.shm_prefix


def http_headers(key: str | None) -> dict[str, str] | None:
    return {"authorization": f"Bearer {key}"} if key else None


def grpc_headers(key: str | None) -> dict[str, str] | None:
    return {GRPC_AUTH_HEADER: f"Bearer {key}"} if key else None


def post(served: Served, path: str, body: dict[str, Any], headers: dict[str, str] | None) -> bytes:
    """One HTTP POST to Triton (tritonclient has no generate endpoint); a non-200 raises as tritonclient does."""
    conn = http.client.HTTPConnection("127.0.0.1", served.http, timeout=DEADLINE_S)
    try:
        conn.request("POST", path, json.dumps(body), headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise InferenceServerException(f"[{resp.status}] {data.decode(errors='replace')}")
    return data


def stream(served: Served, model: str, inputs: list[Any], key: str | None) -> Any:
    """One ModelStreamInfer request through LLMClient (tritonclient's stream) with key or none."""
    with LLMClient(served.url, api_key=key or "") as client:
        result = client.infer(model, inputs, DEADLINE_S)
    if result.error:
        raise InferenceServerException(result.error)
    assert result.responses and result.finished
    return result


# A call with a client's headers (None: no key); a refusal raises InferenceServerException.
Call = Callable[[Served, Any], Any]
TOKENS = {"input_ids": [1, 2, 3, 4], "input_lengths": 4, "request_output_len": 3}


@dataclass(frozen=True)
class Case:
    group: str  # Triton's API group (RESTRICTED_APIS)
    name: str
    call: Call
    # With the key, what Triton answers for its own reason, past the key check (None: success).
    keyed_error: str | None = None


def _http(fn: Callable[[httpclient.InferenceServerClient, Any], Any]) -> Call:
    def call(served: Served, key: str | None) -> Any:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{served.http}")
        try:
            return fn(client, http_headers(key))
        finally:
            client.close()
    return call


def _grpc(fn: Callable[[grpcclient.InferenceServerClient, Any], Any]) -> Call:
    def call(served: Served, key: str | None) -> Any:
        client = grpcclient.InferenceServerClient(served.url)
        try:
            return fn(client, grpc_headers(key))
        finally:
            client.close()
    return call


def _generate(model: str, path: str, body: dict[str, Any]) -> Call:
    return lambda served, key: post(served, f"/v2/models/{model}/{path}", body, http_headers(key))


UNLOAD_REFUSED = "explicit model load / unload is not allowed"
HTTP_CASES = [
    Case("inference", "ensemble generate", _generate("ensemble", "generate", {"text_input": "hi", "max_tokens": 3})),
    Case("inference", "ensemble generate_stream",
         _generate("ensemble", "generate_stream", {"text_input": "hi", "max_tokens": 3})),
    Case("inference", "tensorrt_llm generate", _generate("tensorrt_llm", "generate", TOKENS)),
    Case("inference", "tensorrt_llm generate_stream", _generate("tensorrt_llm", "generate_stream", TOKENS)),
    Case("metadata", "server metadata", _http(lambda c, h: c.get_server_metadata(headers=h))),
    Case("metadata", "model metadata", _http(lambda c, h: c.get_model_metadata("ensemble", headers=h))),
    Case("model-config", "model config", _http(lambda c, h: c.get_model_config("tensorrt_llm", headers=h))),
    Case("model-repository", "repository index", _http(lambda c, h: c.get_model_repository_index(headers=h))),
    Case("model-repository", "unload", _http(lambda c, h: c.unload_model("no-such-model", headers=h)), UNLOAD_REFUSED),
    Case("statistics", "statistics", _http(lambda c, h: c.get_inference_statistics(headers=h))),
    Case("shared-memory", "system shm status", _http(lambda c, h: c.get_system_shared_memory_status(headers=h))),
    Case("shared-memory", "system shm unregister all",
         _http(lambda c, h: c.unregister_system_shared_memory(headers=h))),
    Case("trace", "trace settings", _http(lambda c, h: c.get_trace_settings(headers=h))),
    Case("trace", "trace update", _http(lambda c, h: c.update_trace_settings(settings={"trace_rate": "1000"},
                                                                               headers=h))),
    Case("logging", "log settings", _http(lambda c, h: c.get_log_settings(headers=h))),
    Case("logging", "POST /v2/logging", _http(lambda c, h: c.update_log_settings({"log_verbose_level": 0},
                                                                                  headers=h))),
]
GRPC_CASES = [
    Case("inference", "ensemble ModelStreamInfer",
         lambda served, key: stream(served, "ensemble", text_inputs("hi", 3), key)),
    Case("inference", "tensorrt_llm ModelStreamInfer",
         lambda served, key: stream(served, "tensorrt_llm", token_inputs([1, 2, 3, 4], 3), key)),
    Case("metadata", "server metadata", _grpc(lambda c, h: c.get_server_metadata(headers=h))),
    Case("metadata", "model metadata", _grpc(lambda c, h: c.get_model_metadata("ensemble", headers=h))),
    Case("model-config", "model config", _grpc(lambda c, h: c.get_model_config("tensorrt_llm", headers=h))),
    Case("model-repository", "repository index", _grpc(lambda c, h: c.get_model_repository_index(headers=h))),
    Case("model-repository", "unload", _grpc(lambda c, h: c.unload_model("no-such-model", headers=h)), UNLOAD_REFUSED),
    Case("statistics", "statistics", _grpc(lambda c, h: c.get_inference_statistics(headers=h))),
    Case("shared-memory", "system shm status", _grpc(lambda c, h: c.get_system_shared_memory_status(headers=h))),
    Case("shared-memory", "system shm unregister all",
         _grpc(lambda c, h: c.unregister_system_shared_memory(headers=h))),
    Case("trace", "trace settings", _grpc(lambda c, h: c.get_trace_settings(headers=h))),
    Case("trace", "trace update", _grpc(lambda c, h: c.update_trace_settings(settings={"trace_rate": "1000"},
                                                                               headers=h))),
    Case("logging", "log settings", _grpc(lambda c, h: c.get_log_settings(headers=h))),
    Case("logging", "update log settings", _grpc(lambda c, h: c.update_log_settings({"log_verbose_level": 0},
                                                                                     headers=h))),
]
CASES = [("http", c) for c in HTTP_CASES] + [("grpc", c) for c in GRPC_CASES]
IDS = [f"{proto}-{case.group}-{case.name}" for proto, case in CASES]


def refusal(call: Callable[[], Any]) -> str | None:
    """The error a call raised (None: it answered)."""
    try:
        call()
    except InferenceServerException as exc:
        return str(exc)
    return None


def test_every_restricted_group_is_covered_on_both_protocols() -> None:
    for proto in ("http", "grpc"):
        assert {c.group for p, c in CASES if p == proto} == set(RESTRICTED_APIS), proto
    assert "health" not in RESTRICTED_APIS


@pytest.mark.parametrize(("proto", "case"), CASES, ids=IDS)
@pytest.mark.parametrize("key", [None, "sk-wrong"], ids=["no-key", "wrong-key"])
def test_a_call_without_the_key_is_refused(secure: Served, proto: str, case: Case, key: str | None) -> None:
    error = refusal(lambda: case.call(secure, key))
    assert error is not None and REFUSED in error, error


@pytest.mark.parametrize(("proto", "case"), CASES, ids=IDS)
def test_the_same_call_with_the_key_answers(secure: Served, proto: str, case: Case) -> None:
    error = refusal(lambda: case.call(secure, KEY))
    if case.keyed_error is None:
        assert error is None, error
    else:  # past the key check: Triton's own refusal (this server polls no repository)
        assert error is not None and case.keyed_error in error and REFUSED not in error, error


def test_the_header_is_exact_bearer_key(secure: Served) -> None:
    # HTTP wants `authorization: Bearer KEY` exactly; gRPC wants it under Triton's prefix.
    index = "/v2/repository/index"
    assert REFUSED in (refusal(lambda: post(secure, index, {}, {"authorization": KEY})) or "")
    assert refusal(lambda: post(secure, index, {}, {"Authorization": f"Bearer {KEY}"})) is None
    grpc_plain = _grpc(lambda c, h: c.get_model_repository_index(headers={"authorization": f"Bearer {KEY}"}))
    assert REFUSED in (refusal(lambda: grpc_plain(secure, None)) or "")


def test_health_and_metrics_stay_open(secure: Served) -> None:
    base = f"http://127.0.0.1:{secure.http}/v2"
    for path in ("/health/live", "/health/ready", "/models/ensemble/ready", "/models/tensorrt_llm/ready"):
        assert http_ok(base + path), path
    client = grpcclient.InferenceServerClient(secure.url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("ensemble") and client.is_model_ready("tensorrt_llm")
    finally:
        client.close()
    assert "nv_inference_count" in secure.metrics_text()  # the metrics port has no API groups


def test_infer_command_reads_the_key_from_env_or_file(secure: Served, tmp_path: Path) -> None:
    def infer(env_key: str | None, *extra: str) -> Any:
        """The command in this process, its environment holding env_key as the only key (None: none); the infer
        command run as a process is tests/test_serve_e2e.py's."""
        return CliRunner(env={API_KEY_ENV: env_key}).invoke(
            main, ["infer", "Hello", "--url", secure.url, "--max-tokens", "3", *extra])

    assert infer(KEY).exit_code == 0
    key_file = tmp_path / "key"
    key_file.write_text(KEY, encoding="utf-8")
    assert infer(None, "--api-key-file", str(key_file)).exit_code == 0
    refused = infer(None)
    assert refused.exit_code == 1 and REFUSED in refused.stderr and "set TRTPROMPT_API_KEY" in refused.stderr
    wrong = infer("sk-wrong")
    assert wrong.exit_code == 1 and "refused this API key" in wrong.stderr


def test_bench_channel_sends_the_key(secure: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    def one(channel: SharedTritonChannel) -> Any:
        try:
            return channel.infer("ensemble", text_inputs("hi", 3), DEADLINE_S, "bench-1")
        finally:
            channel.close()

    assert REFUSED in (one(SharedTritonChannel(secure.url, api_key="")).error or "")
    # The fallback that names the refusal when it raced the stream's write (then only INTERNAL came):
    for key, said in (("", REFUSED), (KEY, None)):
        channel = SharedTritonChannel(secure.url, api_key=key)
        try:
            refusal = channel._run(channel._refusal("ensemble"))
        finally:
            channel.close()
        assert (REFUSED in refusal) if said else refusal is None, refusal
    assert one(SharedTritonChannel(secure.url, api_key=KEY)).error is None
    monkeypatch.setenv(API_KEY_ENV, KEY)
    result = one(SharedTritonChannel(secure.url))
    assert result.error is None and result.responses


def test_llm_client_reads_the_environment(secure: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    with LLMClient(secure.url) as client:
        assert "text_input" in client.input_names("ensemble")
        assert client.infer("ensemble", text_inputs("hi", 3)).error is None


def test_front_end_triton_path_sends_the_key(secure: Served) -> None:
    async def generate(key: str) -> str:
        ensemble = TritonEnsemble(secure.url, api_key=key)
        try:
            assert await ensemble.ready()  # ModelReady is health: open either way
            await ensemble.declared_inputs()
            return "".join([p.text async for p in ensemble.generate(text_inputs("hi", 3, True))])
        finally:
            await ensemble.close()

    with pytest.raises(APIError, match=REFUSED):
        asyncio.run(generate(""))
    assert asyncio.run(generate(KEY))


def test_front_end_by_hand_in_front_of_a_keyed_triton(secure: Served, tmp_path: Path) -> None:
    # Not fused: every request takes the Triton path, whose channel reads the key from the environment.
    (port,) = free_ports(1)
    env = os.environ | {API_KEY_ENV: KEY}
    log = tmp_path / "openai.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trtprompt.serve.openai", str(secure.engine_dir),
                                 "--grpc-url", secure.url, "--port", str(port)], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not http_ok(f"http://127.0.0.1:{port}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
        conn.request("POST", "/v1/completions", json.dumps({"model": secure.engine_dir.name, "prompt": "hi",
                                                             "max_tokens": 3, "temperature": 0}),
                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200 and body["usage"]["completion_tokens"] == 3, body
    finally:
        proc.terminate()
        proc.wait(DEADLINE_S)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode(errors="replace")


def test_key_is_on_no_command_line_of_ours_and_not_left_on_disk(secure: Served) -> None:
    pids = [secure.proc.pid, *descendants(secure.proc.pid)]
    cmdlines = {pid: _cmdline(pid) for pid in pids}
    triton = secure.tritonserver_pid()  # exactly one
    front = [pid for pid, cmd in cmdlines.items() if "trtprompt.serve.openai" in cmd]
    assert len(front) == 1
    # Documented residual risk (docs/security.md): Triton takes the key only as an argument.
    assert f"authorization=Bearer {KEY}" in cmdlines[triton]
    assert [pid for pid, cmd in cmdlines.items() if KEY in cmd and pid != triton] == []
    # The key reaches only the front end (its Triton channel); nothing in tritonserver's group has it.
    assert [pid for pid in pids if pid != front[0] and f"{API_KEY_ENV}=" in _environ(pid)] == []
    assert f"{API_KEY_ENV}={KEY}" in _environ(front[0])
    assert not (secure.run_dir / "openai.key").exists()  # read by the front end, then removed
    assert KEY not in (secure.run_dir / "tritonserver.log").read_text(errors="replace")


def test_python_backend_shared_memory_is_private(secure: Served) -> None:
    stream(secure, "ensemble", text_inputs("a prompt for the stub's region", 3), KEY)  # a region holds it now
    regions = sorted(SHM_DIR.glob(f"{shm_prefix(secure)}*"))
    assert len(regions) >= 2  # one per stub: ensemble, tensorrt_llm
    modes = {r.name: stat.S_IMODE(r.stat().st_mode) for r in regions}
    assert set(modes.values()) == {0o600}, {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE((secure.run_dir / "engine.sock").stat().st_mode) & 0o077 == 0  # umask 077


def test_key_value_option_is_refused_with_what_to_use() -> None:
    for argv in (["serve", "ENGINE", "--api-key", KEY], ["serve", "ENGINE", "--api-key"],
                 ["infer", "Hello", f"--api-key={KEY}"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2, result.output
        assert "/proc/PID/cmdline" in result.output and "TRTPROMPT_API_KEY" in result.output
        assert "--api-key-file" in result.output


def test_api_key_read_from_file_then_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n", encoding="utf-8")
    assert ApiKey.read(key_file, {API_KEY_ENV: "sk-other"}) == ApiKey(KEY)  # the file wins
    assert ApiKey.read(None, {API_KEY_ENV: KEY}) == ApiKey(KEY)
    assert ApiKey.read(None, {API_KEY_ENV: ""}) is None and ApiKey.read(None, {}) is None
    assert KEY not in repr(ApiKey(KEY))
    key_file.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        ApiKey.read(key_file, {})
    with pytest.raises(ValueError, match="cannot read"):
        ApiKey.read(tmp_path / "missing", {})
    for bad in ("two words", "tab\there", "kéy", "x" * 4097):
        with pytest.raises(ValueError):
            ApiKey(bad)


def test_trtllm_target_with_a_key_is_refused(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Fail closed: the trtllm launch sets no restricted APIs yet.
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    monkeypatch.setenv(API_KEY_ENV, KEY)
    result = CliRunner().invoke(main, ["serve", str(engine), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1 and "not applied to the trtllm target" in result.output, result.output
    assert not (tmp_path / "run").exists()
