"""The OpenAI front end's HTTP edge against hostile clients, with raw sockets and Hypothesis:
body and header limits answered before the bytes are read, read and keep-alive timeouts,
the connection cap, 415 for non-JSON bodies, 400 naming the field for bodies that parse
but break Python (deep nesting, huge integers, lone surrogates), and a fuzz over both
generation routes that must never get a 5xx.

A front end of its own (short timeouts, a small connection cap) is started by hand in front
of the session server's engine process (--engine-socket); `trtprompt serve`'s own front
end is checked for the defaults it passes through.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_fixtures import ROOT, Served, wait_for
from trtprompt.serve.launch.frontend import frontend_command
from trtprompt.serve.launch.options import OpenAIOptions
from trtprompt.serve.openai.http_limits import HttpLimits, engine_max_request_bytes
from trtprompt.serve.openai.params import CHAT_FIELDS, COMPLETION_FIELDS
from trtprompt.serve.ports import free_ports, http_ok

pytestmark = pytest.mark.server
READ_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 1
MAX_CONNECTIONS = 6
MiB = 1 << 20


@dataclass
class Frontend:
    proc: subprocess.Popen
    port: int
    log: Path
    engine_dir: Path

    @property
    def model(self) -> str:
        return self.engine_dir.name

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def healthy(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.port}/health", timeout_s=5.0)

    def connect(self, timeout_s: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)


@pytest.fixture(scope="module")
def guarded(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    """`python -m trtprompt.serve.openai` with short timeouts, on the session server's engine process."""
    (port,) = free_ports(1)
    log = tmp_path_factory.mktemp("openai-security") / "frontend.log"
    cmd = [sys.executable, "-m", "trtprompt.serve.openai", str(served.engine_dir), "--engine-socket",
           served.socket_path, "--port", str(port), "--read-timeout", str(READ_TIMEOUT_S),
           "--keep-alive-timeout", str(KEEP_ALIVE_S), "--max-connections", str(MAX_CONNECTIONS)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    front = Frontend(proc, port, log, served.engine_dir)
    try:
        wait_for(lambda: proc.poll() is not None or front.healthy(), "the front end answering /health")
        assert proc.poll() is None, front.log_text()
        yield front
    finally:
        proc.terminate()
        proc.wait(30)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that was (seconds)."""
    start, out = time.monotonic(), b""
    sock.settimeout(0.05)
    while time.monotonic() - start < timeout_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    else:
        pytest.fail(f"the server kept the connection open for {timeout_s:.0f}s (got {out[:200]!r})")
    return out, time.monotonic() - start


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def post(port: int, path: str, body: bytes, content_type: str | None = "application/json",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = ({"Content-Type": content_type} if content_type is not None else {}) | (headers or {})
    conn.request("POST", path, body, sent)
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def head(path: str, length: int | None = None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}{extra}\r\n").encode()


# ---------------------------------------------------------------- limits, and how they are passed


def test_body_limit_defaults_to_the_engines_input_length(served: Served) -> None:
    build = json.loads((served.engine_dir / "config.json").read_text())["build_config"]
    assert engine_max_request_bytes(served.engine_dir) == build["max_input_len"] * 16 + MiB
    opts = OpenAIOptions(8003, None, 4096)
    cmd = frontend_command(opts, served.engine_dir, "127.0.0.1:1", "127.0.0.1", None)
    assert cmd[cmd.index("--max-request-bytes") + 1] == "4096"
    assert "--max-request-bytes" not in frontend_command(OpenAIOptions(), served.engine_dir, "h:1", "h", None)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="max_request_bytes"):
            OpenAIOptions(8003, None, bad)
    with pytest.raises(ValueError, match="max_header_bytes"):
        HttpLimits(MiB, max_header_bytes=100)
    with pytest.raises(ValueError, match="read_timeout_s"):
        HttpLimits(MiB, read_timeout_s=0)


def test_serve_front_end_has_the_default_limits(served: Served) -> None:
    limit = engine_max_request_bytes(served.engine_dir)
    assert served.openai is not None
    with socket.create_connection(("127.0.0.1", served.openai), timeout=10) as sock:
        sock.sendall(head("/v1/completions", limit + 1))
        raw, _ = read_until_closed(sock, 10)
    assert status_of(raw) == 413 and str(limit).encode() in raw
    status, _, _ = post(served.openai, "/v1/completions", b"{}", "text/plain")
    assert status == 415


# ---------------------------------------------------------------- body size


def test_a_huge_content_length_is_413_at_once_and_never_read(guarded: Frontend) -> None:
    before, latencies = guarded.rss_kib(), []
    for _ in range(5):
        with guarded.connect() as sock:
            start = time.perf_counter()
            sock.sendall(head("/v1/completions", 100_000_000))
            first = sock.recv(65536)
            latencies.append(time.perf_counter() - start)
            assert status_of(first) == 413, first
            try:  # the body, which nobody reads: the server has closed the connection
                for _ in range(64):
                    sock.sendall(b" " * 65536)
            except OSError:
                pass
            read_until_closed(sock, 10)
    latencies.sort()
    assert latencies[2] < 0.1, latencies
    assert guarded.rss_kib() - before < 4 * 1024, (before, guarded.rss_kib())
    assert guarded.healthy()


def test_a_chunked_body_is_cut_at_the_limit(guarded: Frontend) -> None:
    limit = engine_max_request_bytes(guarded.engine_dir)
    with guarded.connect() as sock:
        sock.sendall(head("/v1/completions", None, "Transfer-Encoding: chunked\r\n"))
        try:
            for _ in range(limit // 65536 + 8):
                sock.sendall(b"10000\r\n" + b" " * 65536 + b"\r\n")
        except OSError:
            pass
        raw, _ = read_until_closed(sock, 10)
    assert status_of(raw) == 413 and b"request_too_large" in raw and b"connection: close" in raw.lower()


# ---------------------------------------------------------------- headers and timeouts


def test_an_8mb_authorization_header_is_refused_without_being_read(guarded: Frontend) -> None:
    before = guarded.rss_kib()
    with guarded.connect() as sock:
        start = time.perf_counter()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
        sent = 0
        try:
            while sent < 8 * MiB:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        raw, _ = read_until_closed(sock, 10)
        elapsed = time.perf_counter() - start
    assert sent < 8 * MiB, "the server read the whole 8 MB header"
    assert elapsed < 1.0, elapsed
    assert raw == b"" or status_of(raw) == 431, raw[:200]  # an RST may beat the 431 to the reader
    assert guarded.rss_kib() - before < 4 * 1024
    with guarded.connect() as sock:  # just over the limit, sent at once: the 431 itself
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * (64 * 1024) + b"\r\n\r\n")
        raw, _ = read_until_closed(sock, 10)
    assert status_of(raw) == 431 and b"headers_too_large" in raw
    assert guarded.healthy()


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  head("/v1/completions", 100) + b'{"model": '],
                         ids=["silent", "half-headers", "half-body"])
def test_a_half_open_connection_is_closed_after_the_read_timeout(guarded: Frontend, sent: bytes) -> None:
    with guarded.connect() as sock:
        sock.sendall(sent)
        raw, after = read_until_closed(sock, READ_TIMEOUT_S + 10)
    assert READ_TIMEOUT_S * 0.9 <= after, after
    assert status_of(raw) == 408, raw[:200]


def test_a_slowloris_drip_is_closed_after_the_read_timeout(guarded: Frontend) -> None:
    """A byte every 0.2 s keeps no connection open: the deadline is for the whole request."""
    request = head("/v1/completions", 2) + b"{}"
    with guarded.connect() as sock:
        start = time.monotonic()
        for byte in request:
            readable, _, _ = select.select([sock], [], [], 0.2)  # the pace, and whether it closed
            if readable:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
        else:
            pytest.fail("the whole request went through a byte at a time")
        raw, _ = read_until_closed(sock, 10)
        elapsed = time.monotonic() - start
    assert status_of(raw) == 408 and READ_TIMEOUT_S * 0.9 <= elapsed < READ_TIMEOUT_S + 5, (raw[:100], elapsed)


def test_an_idle_keep_alive_connection_is_closed(guarded: Frontend) -> None:
    with guarded.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw, after = read_until_closed(sock, KEEP_ALIVE_S + 10)
    assert status_of(raw) == 200 and after >= KEEP_ALIVE_S * 0.9, (raw[:100], after)


def test_connections_past_the_cap_get_503(guarded: Frontend) -> None:
    idle = [guarded.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        with guarded.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw, _ = read_until_closed(sock, 10)
        assert status_of(raw) == 503, raw[:200]
    finally:
        for sock in idle:
            sock.close()
    wait_for(guarded.healthy, "/health answering once the idle connections closed", 10)


def test_a_client_gone_mid_body_is_one_log_line(guarded: Frontend) -> None:
    sock = guarded.connect()
    client_port = sock.getsockname()[1]
    sock.sendall(head("/v1/completions", 1000) + b'{"model": "x", ')
    sock.close()

    def lines() -> list[str]:
        return [line for line in guarded.log_text().splitlines() if f":{client_port}" in line]

    wait_for(lambda: len(lines()) > 0, "the disconnect logged", 10)
    assert len(lines()) == 1 and "disconnected before its request body arrived" in lines()[0], lines()
    assert "Traceback" not in guarded.log_text()


# ---------------------------------------------------------------- content type, CORS


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None,
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                          "application/jsonx"])
def test_a_body_that_is_not_declared_json_is_415(guarded: Frontend, content_type: str | None) -> None:
    body = json.dumps({"model": guarded.model, "prompt": "hi", "max_tokens": 1}).encode()
    status, headers, raw = post(guarded.port, "/v1/completions", body, content_type,
                                {"Origin": "https://evil.example"})
    assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_media_type"
    assert not [h for h in headers if h.startswith("access-control-")]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_content_types_are_accepted(guarded: Frontend, content_type: str) -> None:
    body = json.dumps({"model": guarded.model, "prompt": "hi", "max_tokens": 1}).encode()
    status, _, raw = post(guarded.port, "/v1/completions", body, content_type)
    assert status == 200, raw


def test_no_cors_headers_even_for_a_preflight(guarded: Frontend) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    conn.request("OPTIONS", "/v1/completions", headers={"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "content-type"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 405 and not [h for h, _ in resp.getheaders() if h.lower().startswith("access-control-")]


# ---------------------------------------------------------------- bodies that parse but break Python

DEEP = 100_000


def _completion(model: str, **fields: str) -> bytes:
    """A body with fields given as raw JSON text (so the test need not build the values)."""
    parts = {"model": json.dumps(model), "prompt": '"hi"', "max_tokens": "2"} | fields
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in parts.items()) + "}").encode()


def _chat(model: str, content: str) -> bytes:
    return (f'{{"model": {json.dumps(model)}, "max_tokens": 2, "messages": [{{"role": "user", '
            f'"content": {content}}}]}}').encode()


BAD_BODIES: dict[str, tuple[str, Callable[[str], bytes], str]] = {
    "nested-100000-deep": ("/v1/completions", lambda m: _completion(m, prompt="[" * DEEP + "]" * DEEP), "prompt"),
    "int-of-5001-digits": ("/v1/completions", lambda m: _completion(m, max_tokens="9" * 5001), "max_tokens"),
    "surrogate-in-prompt": ("/v1/completions", lambda m: _completion(m, prompt='"a\\ud800b"'), "prompt"),
    "surrogate-in-stop": ("/v1/completions", lambda m: _completion(m, stop='["ok", "\\udc00"]'), "stop[1]"),
    "surrogate-in-chat-content": ("/v1/chat/completions", lambda m: _chat(m, '"\\udfff"'), "messages[0].content"),
    "surrogate-in-user": ("/v1/completions", lambda m: _completion(m, user='"\\ud83d"'), "user"),
    "deep-chat-content": ("/v1/chat/completions", lambda m: _chat(m, "[" * 80 + "]" * 80), "messages"),
    "nan": ("/v1/completions", lambda m: _completion(m, temperature="NaN"), "temperature"),
    "int-too-big-for-a-float": ("/v1/completions", lambda m: _completion(m, temperature="9" * 400),
                                "temperature"),
    "role-not-a-string": ("/v1/chat/completions",
                          lambda m: f'{{"model": "{m}", "messages": [{{"role": [], "content": "x"}}]}}'.encode(),
                          "messages[0].role"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_body_that_breaks_python_is_400_naming_the_field(guarded: Frontend, case: str) -> None:
    path, build, param = BAD_BODIES[case]
    status, _, raw = post(guarded.port, path, build(guarded.model))
    assert status == 400, raw[:300]
    err = json.loads(raw)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    for internal in ("Traceback", "RecursionError", "UnicodeEncodeError", "Exceeds the limit", "OverflowError"):
        assert internal not in err["message"], err


# ---------------------------------------------------------------- fuzz


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as is: what Python's json.dumps will not write."""

    text: str


RAW_VALUES = [Raw("9" * 5001), Raw("-" + "1" * 4301), Raw("[" * 2000 + "]" * 2000), Raw('{"a":' * 200 + "1" + "}" * 200),
              Raw('"\\ud800"'), Raw('"x\\udfffy"'), Raw('"\\ud83d\\ude00"'), Raw("NaN"), Raw("-Infinity"),
              Raw("1e999"), Raw("1" * 400), Raw("0.1e-999")]
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
TEXT = st.text(st.characters() | SURROGATES, max_size=12)
SMALL_INTS = st.integers(-3, 6) | st.sampled_from([2**31, 2**63, 2**64, -(2**63)])
LEAVES = (st.none() | st.booleans() | SMALL_INTS | st.floats(allow_nan=False, width=32) | TEXT
          | st.sampled_from(RAW_VALUES))


def _tree(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=3)
                        | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"])
                                          | TEXT, kids, max_size=3), max_leaves=6)


VALUES = _tree(LEAVES)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | VALUES},
                                optional={"content": TEXT | VALUES})


def _body(fields: tuple[str, ...], main: str, main_value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    """The real fields with random values; model and the prompt often right, so the random values
    reach the checks past them; max_tokens always there and small when valid (a fuzz, not a load)."""
    base = st.fixed_dictionaries({"model": st.just("MODEL") | VALUES, main: main_value,
                                  "max_tokens": SMALL_INTS | VALUES})
    extra: st.SearchStrategy[dict[str, Any]] = st.just({}) | st.dictionaries(st.sampled_from(fields) | TEXT, VALUES, max_size=4)
    return st.tuples(base, extra).map(
        lambda pair: {k: v for k, v in pair[1].items() if k not in ("max_tokens", "max_completion_tokens")}
        | pair[0])


PLAIN_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
# Token-id prompts and batches (strings, id lists, both): ids inside the tiny vocabulary, past it, negative.
TOKEN_IDS = st.lists(st.integers(-2, 800) | SMALL_INTS, min_size=1, max_size=6)
PROMPTS = (PLAIN_TEXT | st.lists(TEXT, max_size=2) | TOKEN_IDS
           | st.lists(PLAIN_TEXT | st.lists(st.integers(0, 300), min_size=1, max_size=4), min_size=1, max_size=3)
           | VALUES)
# The extensions at values the front end acts on (the random VALUES of _body rarely are): honoured ones,
# and the router's defaults (tests/test_openai_extensions.py).
EXTENSION_VALUES = st.fixed_dictionaries({}, optional={
    "stop_token_ids": st.lists(st.integers(-1, 800), max_size=3), "min_p": st.floats(0, 1) | VALUES,
    "skip_special_tokens": st.booleans(), "ignore_eos": st.booleans(), "no_stop_trim": st.booleans(),
    "return_hidden_states": st.booleans(), "length_penalty": st.floats(-2, 2), "rid": TEXT})


def _with_extensions(bodies: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(EXTENSION_VALUES, bodies).map(lambda pair: pair[0] | pair[1])


COMPLETION_BODIES = _with_extensions(_body(COMPLETION_FIELDS, "prompt", PROMPTS))
CHAT_BODIES = _with_extensions(_body(CHAT_FIELDS, "messages",
                                     st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": PLAIN_TEXT}),
                                              min_size=1, max_size=2) | st.lists(MESSAGE, min_size=1, max_size=3)
                                     | VALUES))


def to_json(value: Any, model: str) -> str:
    if isinstance(value, Raw):
        return value.text
    if value == "MODEL":
        return json.dumps(model)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {to_json(v, model)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_json(v, model) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate goes out as its \\u escape


def _answer(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    status, _, raw = post(port, path, body)
    if status >= 400 and status != 415:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}, raw[:300]
    return status, raw


FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize(("path", "bodies"), [("/v1/completions", COMPLETION_BODIES),
                                              ("/v1/chat/completions", CHAT_BODIES)], ids=["completions", "chat"])
def test_fuzzed_bodies_never_get_a_5xx(guarded: Frontend, path: str, bodies: st.SearchStrategy[dict]) -> None:
    statuses: dict[int, int] = {}

    @FUZZ
    @given(bodies)
    def check(body: dict[str, Any]) -> None:
        raw = to_json(body, guarded.model).encode("utf-8")
        status, answer = _answer(guarded.port, path, raw)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (raw[:300], answer[:300])

    check()
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if s == 400) > 0, statuses
    assert guarded.healthy()


@FUZZ
@given(raw=st.binary(max_size=64) | TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzzed_bytes_never_get_a_5xx(guarded: Frontend, raw: bytes) -> None:
    status, answer = _answer(guarded.port, "/v1/completions", raw)
    assert status < 500, (raw, answer[:300])


def test_the_front_end_logged_no_traceback_and_still_answers(guarded: Frontend) -> None:
    assert guarded.healthy()
    assert "Traceback" not in guarded.log_text(), guarded.log_text()[-3000:]
