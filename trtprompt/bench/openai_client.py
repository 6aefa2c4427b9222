"""A minimal OpenAI-API streaming client for the load generator.

Speaks `/v1/completions` with `stream: true` over one keep-alive HTTP
connection (stdlib http.client, so the client costs the same against any
server), so `trtprompt bench --url http://...` measures trtprompt's OpenAI
front end and any other OpenAI-compatible server (vLLM, ...) alike. Every
request asks for `stream_options.include_usage`; `ignore_eos` is sent as
vLLM's extension of the same name, which trtprompt honours too.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.parse
from typing import Any

import numpy as np

from trtprompt.bench.workloads import BenchRequest
from trtprompt.client import StreamResult

API_KEY_ENVS = ("TRTPROMPT_API_KEY", "OPENAI_API_KEY")


def api_base(url: str) -> str:
    """'http://host:port' or 'http://host:port/v1' -> 'http://host:port/v1'."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"an OpenAI endpoint URL starts with http:// or https://, got {url!r}")
    return base if base.endswith("/v1") else base + "/v1"


def _auth_headers() -> dict[str, str]:
    key = next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model GET /v1/models lists (what to send when none is named)."""
    import urllib.request

    req = urllib.request.Request(api_base(url) + "/models", headers=_auth_headers())
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data = json.loads(resp.read())["data"]
    if not data:
        raise ValueError(f"{url} serves no model")
    return str(data[0]["id"])


def _no_delay(cls: type[http.client.HTTPConnection]) -> type[http.client.HTTPConnection]:
    """http.client sends the headers and the body in two writes; with Nagle's algorithm on, the
    body then waits for the server's delayed ACK (~40 ms on Linux) and every TTFT grows by it."""
    class NoDelay(cls):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            super().connect()
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    return NoDelay


class OpenAIClient:
    """One keep-alive connection; one request at a time (one per bench worker)."""

    def __init__(self, url: str, model: str, timeout_s: float = 300.0) -> None:
        parts = urllib.parse.urlsplit(api_base(url))
        self.path, self.model, self.timeout_s = parts.path + "/completions", model, timeout_s
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._conn = _no_delay(cls)(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"} | _auth_headers()

    def close(self, cancel: bool = False) -> None:
        self._conn.close()  # closing mid-stream is what cancels the request server-side

    def body(self, req: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def infer(self, req: BenchRequest, ignore_eos: bool) -> StreamResult:
        """Send one streamed completion; times are those of chunks that carry text."""
        result = StreamResult()
        t0 = time.perf_counter()
        self._conn.request("POST", self.path, json.dumps(self.body(req, ignore_eos)).encode("utf-8"), self._headers)
        resp = self._conn.getresponse()
        if resp.status != 200:
            result.error, result.finished = _http_error(resp), True
            return result
        while (line := resp.readline()) and not result.finished:
            _event(line, result, time.perf_counter() - t0)
        resp.read()  # drain, so the connection can carry the next request
        return result


def _http_error(resp: http.client.HTTPResponse) -> str:
    raw = resp.read()
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", errors="replace")[:500]
    return f"HTTP {resp.status}: {message}"


def _event(line: bytes, result: StreamResult, at: float) -> None:
    """Fold one SSE line into result (text chunks, the usage chunk, an error, [DONE])."""
    if not line.startswith(b"data:"):
        return
    data = line[5:].strip()
    if data == b"[DONE]":
        result.finished = True
        return
    event = json.loads(data)
    if "error" in event:
        result.error = str(event["error"].get("message", event["error"]))
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            result.responses.append({"text_output": np.array([text.encode("utf-8")], dtype=object)})
            result.times.append(at)
    usage = event.get("usage")
    if usage:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.responses.append({"num_input_tokens": np.array([usage["prompt_tokens"]]),
                                 "num_output_tokens": np.array([usage["completion_tokens"]]),
                                 "cached_tokens": np.array([cached or 0])})
