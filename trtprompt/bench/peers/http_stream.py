"""Streamed POSTs to a peer's own endpoints that trtprompt's clients do not speak: llama-server's native
`/completion` with token-id prompts, and vLLM's `/v1/completions` with `return_token_ids` (bench/openai_client.py
returns text, not ids). Each `data:` event is timed at its arrival."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any, Iterator


def post_stream(port: int, path: str, body: dict[str, Any],
                timeout_s: float = 3600.0) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """The open connection and its 200 response; any other status raises with the start of its body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        detail = resp.read()[:300]
        conn.close()
        raise RuntimeError(f"POST {path} on port {port}: {resp.status} {detail!r}")
    return conn, resp


def sse_events(resp: http.client.HTTPResponse) -> Iterator[tuple[float, dict[str, Any]]]:
    """(perf_counter at arrival, the event's JSON) of each `data:` line, until [DONE] or the stream ends."""
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        yield time.perf_counter(), json.loads(line[6:])


def stream(port: int, path: str, body: dict[str, Any]) -> Iterator[tuple[float, dict[str, Any]]]:
    """The timed events of one streamed POST; the connection is closed when the stream ends or is left."""
    conn, resp = post_stream(port, path, body)
    try:
        yield from sse_events(resp)
    finally:
        conn.close()
