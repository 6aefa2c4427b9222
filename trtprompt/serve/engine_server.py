"""The engine process: one LLMEngine + EngineLoop behind a unix socket.

Started and watched by the launcher (`python -m trtprompt.serve.engine_server
--repository REPO --socket PATH`). Its runtime settings are the parameters
of REPO/tensorrt_llm/config.pbtxt, as the TensorRT-LLM backend reads its
own, so what the repository says is what runs.

One thread per connection: a submit streams the request's outputs back;
an abort frame or a closed connection aborts the request at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import socketserver
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from trtprompt.engine.errors import EngineRequestError, QueueFullError
from trtprompt.engine.request import RequestOutput, SamplingParams
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.serve import protocol as P
from trtprompt.serve.repository import read_parameters

log = logging.getLogger("trtprompt.engine_server")

_BOOL_KEYS = ("enable_kv_cache_reuse", "enable_chunked_context")
_INT_KEYS = ("max_tokens_in_paged_kv_cache", "max_queue_size", "max_num_tokens", "triton_max_batch_size")
_FLOAT_KEYS = ("kv_cache_free_gpu_mem_fraction",)
# Finished-request timings kept for the metrics model's histograms.
_TIMINGS_KEPT = 8192
SWITCH_INTERVAL_S = 0.0005


def engine_overrides(params: Mapping[str, str]) -> dict[str, Any]:
    """LLMEngine.from_engine_dir keyword arguments from tensorrt_llm's parameters."""
    out: dict[str, Any] = {}
    for key in _BOOL_KEYS:
        if key in params:
            out[key] = params[key].strip().lower() == "true"
    for key in _INT_KEYS:
        if params.get(key):
            out["max_batch_size" if key == "triton_max_batch_size" else key] = int(params[key])
    for key in _FLOAT_KEYS:
        if params.get(key):
            out[key] = float(params[key])
    if params.get("batch_scheduler_policy"):
        out["batch_scheduler_policy"] = params["batch_scheduler_policy"]
    return out


def sampling_params(raw: Mapping[str, Any]) -> SamplingParams:
    values = dict(raw)
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(tuple(s) for s in values["stop_token_ids"])
    return SamplingParams(**values)


def output_frame(out: RequestOutput) -> dict[str, Any]:
    return {
        "type": "output", "new_token_ids": list(out.new_token_ids), "finished": out.finished,
        "num_input_tokens": out.num_input_tokens, "num_output_tokens": out.num_output_tokens,
        "finish_reason": out.finish_reason.value if out.finish_reason else None,
        "warning": out.warning, "stats": asdict(out.stats),
    }


def error_code(message: str) -> str:
    """The code of an error the loop delivers as a finished output."""
    if message.startswith("queue full"):
        return P.QUEUE_FULL
    if message.startswith("engine error"):
        return P.INTERNAL
    if message.startswith("engine stopped") or "shutting down" in message:
        return P.UNAVAILABLE
    return P.INVALID_ARG


class EngineService:
    """The engine plus what the socket handlers share."""

    def __init__(self, loop: Any) -> None:  # loop: EngineLoop
        self.loop = loop
        self.engine = loop.engine
        self._lock = threading.Lock()
        self._timings: deque[dict[str, float]] = deque(maxlen=_TIMINGS_KEPT)
        self._seq = 0
        self._finished: dict[str, int] = {}
        files = getattr(self.engine, "files", None)
        self.prompt_policy = PromptPolicy.from_mapping(files.prompt if files is not None else {})

    def info(self) -> dict[str, Any]:
        sched = self.engine.scheduler_config
        return {"type": "info", "pid": os.getpid(), "max_input_len": self.engine.max_input_len,
                "max_seq_len": sched.max_seq_len, "max_batch_size": sched.max_batch_size,
                "max_num_tokens": sched.max_num_tokens, "max_queue_size": sched.max_queue_size,
                "enable_chunked_context": sched.enable_chunked_context,
                "enable_kv_cache_reuse": self.engine.config.kv_cache.enable_block_reuse,
                "vocab_size": self.engine.model_config.vocab_size,
                "eos_token_ids": sorted(self.engine.eos_token_ids)}

    def stats(self, since: int) -> dict[str, Any]:
        with self._lock:
            timings = [t for t in self._timings if t["seq"] > since]
            seq, finished = self._seq, dict(self._finished)
        return {"type": "stats", **asdict(self.loop.stats()), "seq": seq, "timings": timings,
                "in_flight": self.loop.num_in_flight(), "finished": finished}

    def record(self, out: RequestOutput) -> None:
        """Count a finished request and keep its timings for the histograms."""
        s = out.stats
        reason = out.finish_reason.value if out.finish_reason else "unknown"
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            if s.first_token_time_ns is None or s.first_scheduled_time_ns is None:
                return
            self._seq += 1
            self._timings.append({
                "seq": self._seq,
                "ttft_s": (s.first_token_time_ns - s.arrival_time_ns) / 1e9,
                "prefill_s": (s.first_token_time_ns - s.first_scheduled_time_ns) / 1e9,
            })

    def check_bounds(self, params: SamplingParams) -> None:
        bound = self.engine.scheduler_config.max_seq_len - 1
        if params.max_tokens > bound:
            raise EngineRequestError(
                f"max_tokens ({params.max_tokens}) exceeds the engine's maximum output length "
                f"({bound} = max_seq_len - 1)")


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock: socket.socket = self.request
        reader = P.FrameReader()
        try:
            msg = P.recv_frame(sock, reader)
        except (P.EngineUnavailableError, OSError, ValueError):
            return
        service = self.server.service
        op = msg.get("op")
        try:
            if op == "info":
                P.send_frame(sock, service.info())
            elif op == "stats":
                P.send_frame(sock, service.stats(int(msg.get("since", 0))))
            elif op == "submit":
                self._submit(sock, reader, msg)
            else:
                P.send_frame(sock, {"type": "error", "code": P.INVALID_ARG, "message": f"unknown op {op!r}"})
        except OSError:
            pass  # the client went away; its request (if any) was aborted

    def _submit(self, sock: socket.socket, reader: P.FrameReader, msg: Mapping[str, Any]) -> None:
        service = self.server.service
        rid = str(msg.get("request_id") or uuid.uuid4().hex)
        try:
            params = sampling_params(msg.get("params") or {})
            service.check_bounds(params)
            service.prompt_policy.check_salt(msg.get("cache_salt"))
            stream = service.loop.submit(rid, list(msg["prompt_token_ids"]), params,
                                         cache_salt=msg.get("cache_salt"))
        except QueueFullError as exc:
            P.send_frame(sock, {"type": "error", "code": P.QUEUE_FULL, "message": str(exc)})
            return
        except (EngineRequestError, ValueError, TypeError, KeyError) as exc:
            P.send_frame(sock, {"type": "error", "code": P.INVALID_ARG, "message": str(exc)})
            return
        threading.Thread(target=self._watch, args=(sock, reader, service, rid),
                         name=f"watch-{rid[:8]}", daemon=True).start()
        self._relay(sock, service, stream)

    @staticmethod
    def _watch(sock: socket.socket, reader: P.FrameReader, service: EngineService, rid: str) -> None:
        """Abort the request on an abort frame or when the client disconnects."""
        try:
            frames = reader.drain()
            while not any(f.get("op") == "abort" for f in frames) and not reader.closed:
                frames = reader.feed(sock)
        except (OSError, ValueError):
            pass
        service.loop.abort(rid)

    @staticmethod
    def _relay(sock: socket.socket, service: EngineService, stream: Any) -> None:
        connected = True
        for out in stream:
            if out.finished:
                service.record(out)
            if not connected:
                continue  # drain to the final output; the watcher already aborted
            try:
                if out.error:
                    P.send_frame(sock, {"type": "error", "code": error_code(out.error), "message": out.error})
                else:
                    P.send_frame(sock, output_frame(out))
            except OSError:
                connected = False
                service.loop.abort(stream.request_id)
        if connected:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, path: str, service: EngineService) -> None:
        self.service = service
        super().__init__(path, _Handler)


def serve(repository: Path, socket_path: str) -> None:
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.loop import EngineLoop

    params = read_parameters(repository / "tensorrt_llm" / "config.pbtxt")
    # The engine thread holds the GIL between torch calls; with the default
    # 5 ms switch interval each output waited that long for its socket thread.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_dir(params["gpt_model_path"], **engine_overrides(params))
    loop = EngineLoop(engine).start()
    log.info("engine loaded from %s in %.2fs: %s", params["gpt_model_path"],
             time.perf_counter() - t0, engine_overrides(params))
    if os.path.exists(socket_path):
        os.unlink(socket_path)  # a stale socket of a crashed predecessor
    server = _Server(socket_path, EngineService(loop))
    os.chmod(socket_path, 0o600)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    log.info("engine process %d serving on %s", os.getpid(), socket_path)
    stop.wait()
    server.shutdown()
    loop.stop()
    server.server_close()
    if os.path.exists(socket_path):
        os.unlink(socket_path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", required=True, type=Path)
    ap.add_argument("--socket", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    serve(args.repository, args.socket)


if __name__ == "__main__":
    main()
