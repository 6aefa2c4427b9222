"""A bug is the server's fault, never the client's: a submit that fails on something other than a
RequestError is answered `internal`, logged with its traceback, and the connection and every other
request go on (the engine process, in this process, over its real socket)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Iterator

import pytest

from engine_helpers import make_hf_model
from test_engine_protocol import DEADLINE_S, Collector, Engine, _req
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.engine_client import EngineClient


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    llama = make_hf_model(tmp_path_factory.mktemp("hf"), "llama")
    e = Engine(llama, str(tmp_path_factory.mktemp("sock") / "engine.sock"))
    yield e
    e.stop()


def _reply(sock: socket.socket) -> dict[str, object]:
    sock.settimeout(DEADLINE_S)
    frame = P.recv_frame(sock)
    assert frame["type"] == "step"
    (entry,) = frame["outputs"]
    return entry


def test_a_malformed_submit_is_internal_and_logged_with_its_traceback(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    sock = P.connect(engine.path)
    with caplog.at_level(logging.ERROR, logger="trtprompt.engine_server"):
        P.send_frame(sock, {"op": "submit", "id": "x", "params": {"max_tokens": 2}})  # no prompt_token_ids
        entry = _reply(sock)
    assert (entry["id"], entry["finished"], entry["code"]) == ("x", True, "internal")
    assert entry["error"] == "internal error: KeyError: 'prompt_token_ids'"
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records), "no traceback logged"
    P.send_frame(sock, {"op": "submit", "id": "y", "prompt_token_ids": [5, 6], "params": {"max_tokens": 2,
                                                                                           "top_p": 7.0}})
    bad = _reply(sock)
    assert (bad["code"], bad["error"]) == ("invalid_argument", "top_p must be a finite number in [0, 1], got 7.0")
    sock.close()
    good = Collector()
    EngineClient(engine.path).submit(_req([5, 6, 7], 3), good)  # the engine serves on
    assert good.wait()["finish_reason"] == "length" and len(good.tokens()) == 3
