"""The engine process: one LLMEngine + EngineLoop behind a unix socket.

Started and watched by the launcher (`python -m trtprompt.serve.engine_process
--repository REPO --socket PATH`). Its runtime settings are the parameters
of REPO/tensorrt_llm/config.pbtxt, as the TensorRT-LLM backend reads its
own, so what the repository says is what runs.

Each Python-backend stub holds one connection and multiplexes its requests
over it; per connection one handler thread reads submits/aborts and one
writer thread sends the frames the engine loop queues, one per step. A
closed connection aborts every request it submitted. The protocol is in
docs/design.md ("Request path and engine process protocol").
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import queue
import signal
import socket
import socketserver
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Mapping

from trtprompt import knobs
from trtprompt.engine.request import RequestOutput, RequestStats
from trtprompt.error_codes import ErrorCode, RequestError, describe
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.serve.engine_process.counters import (
    AdapterCounters,
    RequestCounters,
    config_labels,
    drain_tier_loads,
    kv_event_counts,
    process_usage,
)
from trtprompt.serve.engine_process.lora_ops import LORA_OPS, lora_op
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.frames import StepEntry
from trtprompt.serve.wire.lora_modules import lora_modules_of
from trtprompt.serve.wire.model_config import read_parameters
from trtprompt.serve.wire.outputs import add_sequence_fields
from trtprompt.serve.wire.process import prefer_quick_thread_switches
from trtprompt.serve.wire.refusals import error_reason
from trtprompt.serve.wire.requests import retention_from_wire, sampling_from_wire

log = logging.getLogger("trtprompt.engine_server")

# RequestStats on the wire under the return_perf_metrics outputs' names (interface.PERF_OUTPUTS), which most
# fields already are; the speculative decoding counts travel under TensorRT-LLM's names (request_stats).
_SPEC_FIELDS = ("num_draft_tokens", "num_accepted_draft_tokens")
_STATS_FIELDS = tuple(f.name for f in fields(RequestStats) if f.name not in _SPEC_FIELDS)


def engine_overrides(params: Mapping[str, str]) -> dict[str, Any]:
    """LLMEngine.from_engine_dir keyword arguments from tensorrt_llm's parameters (serve --lora-modules'
    adapters as one JSON parameter, serve/wire/lora_modules.py)."""
    overrides = knobs.from_parameters(params, knobs.ENGINE_KEYS)
    modules = lora_modules_of(params)
    return overrides if modules is None else {**overrides, "lora_modules": modules}


def request_stats(stats: RequestStats) -> dict[str, Any]:
    """A request's stats as a frame carries them: the draft tokens it verified and accepted as TensorRT-LLM's
    total_draft_tokens / total_accepted_draft_tokens, with its acceptance_rate (accepted / verified; 0 with
    none), so the serving models return each under its output's name."""
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_draft_tokens
    return {**{name: getattr(stats, name) for name in _STATS_FIELDS}, "total_draft_tokens": drafted,
            "total_accepted_draft_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0}


def output_entry(out: RequestOutput, request_id: str, perf: bool) -> StepEntry:
    """One request's share of a step frame (docs/design.md, "Request path and engine process protocol").

    Request stats travel on the final output and, for a request that asked
    for perf metrics, on every output: they are the bulk of an entry.
    """
    if out.error:
        return {"id": request_id, "finished": True, "error": out.error,
                "code": out.error_code or ErrorCode.INTERNAL}
    entry: StepEntry = {"id": request_id, "new_token_ids": out.new_token_ids, "finished": out.finished,
                             "num_input_tokens": out.num_input_tokens,
                             "num_output_tokens": out.num_output_tokens}
    add_sequence_fields(entry, out)
    if out.sequence_finished or out.finished:
        entry["finish_reason"] = out.finish_reason.value if out.finish_reason else None
        entry["warning"] = out.warning
    if out.finished or perf:
        entry["stats"] = request_stats(out.stats)
    return entry


def set_engine_threads(params: Mapping[str, str]) -> None:
    """Apply the engine_threads serve option (unset: torch's default, one thread per core)."""
    threads = knobs.from_parameters(params, ("engine_threads",)).get("engine_threads")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def torch_threads() -> int:
    """Intra-op threads of this process (the engine must use the cores it is given)."""
    import torch

    return torch.get_num_threads()


class EngineService:
    """The engine plus what the socket handlers share."""

    def __init__(self, loop: Any, restarts: int = 0) -> None:  # loop: EngineLoop
        self.loop = loop
        self.engine = loop.engine
        self.restarts = restarts  # how often the launcher restarted this engine process before
        self.counters = RequestCounters(self.engine.kv.tokens_per_block)  # for /metrics
        self.adapter_counters = AdapterCounters()  # per LoRA adapter, for /metrics
        self.config_labels = config_labels(self.engine)  # fixed for the process's life
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
                "eos_token_ids": sorted(self.engine.eos_token_ids), "torch_threads": torch_threads(),
                "config_labels": self.config_labels}

    def stats(self, since: int) -> dict[str, Any]:
        self.counters.record_tier_loads(drain_tier_loads(self.engine))  # for trtprompt_kv_tier_load_seconds
        return {"type": "stats", **asdict(self.loop.stats()), **self.counters.snapshot(since),
                "in_flight": self.loop.num_in_flight(), "pid": os.getpid(), "restarts": self.restarts,
                **process_usage(), **kv_event_counts(self.engine), "lora": self.adapter_counters.snapshot(
                    self.engine.lora.names(), self.engine.lora.config.max_loras)}

    def record(self, out: RequestOutput) -> None:
        """Count a finished request and keep its timings for the histograms."""
        self.counters.record(out, out.error_code)


class Connection:
    """One stub's connection: the requests it submitted and the frames going back.

    The loop thread calls `deliver` once per step with this connection's
    outputs; they become ONE frame, queued for this connection's writer
    thread, so a stub that reads slowly delays only itself (never the loop,
    never another stub). The handler thread reads submits and aborts.
    """

    def __init__(self, sock: socket.socket, service: EngineService, number: int) -> None:
        self.sock, self.service = sock, service
        self._prefix = f"{number}/"  # engine request ids are unique across connections
        self._lock = threading.Lock()
        self._live: dict[str, bool] = {}  # engine request id -> return stats on every output
        self._closed = False
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name=f"engine-writer-{number}", daemon=True)
        self._writer.start()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Loop thread: this connection's outputs of one step -> one frame."""
        entries = []
        with self._lock:
            for out in outputs:
                perf = self._live.pop(out.request_id, False) if out.finished \
                    else self._live.get(out.request_id, False)
                entries.append(output_entry(out, out.request_id[len(self._prefix):], perf))
            closed = self._closed
        for out in outputs:
            if out.finished:
                self.service.record(out)
        self.service.adapter_counters.outputs(outputs)
        if not closed:  # "t": when it was made, so a reader can tell it is behind (engine_client.behind)
            for frame in self._step_frames(entries, time.monotonic()):
                self._outbox.put(frame)

    def _step_frames(self, entries: list[StepEntry], made: float) -> list[bytes]:
        """The step's entries as one frame; past the protocol's MAX_FRAME (raw logits are large) one frame
        per entry, and an entry too large alone fails its request (aborted here), not the step's others."""
        try:
            return [P.encode_frame({"type": "step", "t": made, "outputs": entries})]
        except P.EngineError:
            pass
        frames = []
        for entry in entries:
            try:
                frames.append(P.encode_frame({"type": "step", "t": made, "outputs": [entry]}))
            except P.EngineError as exc:
                self.service.loop.abort(self._prefix + entry["id"])
                failed = {"id": entry["id"], "finished": True, "error": exc.message, "code": P.INVALID_ARG}
                frames.append(P.encode_frame({"type": "step", "t": made, "outputs": [failed]}))
        return frames

    def send(self, message: Mapping[str, Any]) -> None:
        self._outbox.put(P.encode_frame(message))

    def submit(self, msg: Mapping[str, Any]) -> None:
        rid = str(msg.get("id"))
        engine_rid = self._prefix + rid
        service = self.service
        with self._lock:
            self._live[engine_rid] = bool(msg.get("perf"))
        lora = msg.get("lora")
        if lora is not None:  # counted per adapter from here (engine_process/counters.py, AdapterCounters)
            service.adapter_counters.submitted(engine_rid, str(lora))
        try:
            params = sampling_from_wire(msg.get("params") or {})
            service.prompt_policy.check_salt(msg.get("cache_salt"))
            retention = retention_from_wire(msg.get("retention"))  # docs/prefix-pool.md, "Retention"
            service.loop.add(engine_rid, list(msg["prompt_token_ids"]), params, self,
                             cache_salt=msg.get("cache_salt"), retention=retention, lora=lora)
        except Exception as exc:  # noqa: BLE001 - this request fails, the connection and the others go on
            with self._lock:
                self._live.pop(engine_rid, None)
            service.adapter_counters.withdrawn(engine_rid)
            code, message = describe(exc)
            if not isinstance(exc, RequestError):  # a frame our own client should never send: a bug
                log.exception("submit %s failed", rid)
            service.counters.refused(error_reason(code))
            self.send({"type": "step", "outputs": [{"id": rid, "finished": True, "error": message,
                                                   "code": code}]})

    def abort(self, ids: Any) -> None:
        self.service.loop.abort_many(self._prefix + str(rid) for rid in ids)

    def close(self) -> None:
        """The stub went away (or stopped reading): abort everything it had in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live)
        self.service.loop.abort_many(live)
        self._outbox.put(None)  # the writer flushes what is queued, then ends

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()
                try:  # wake the handler thread blocked in recv()
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return


class _Handler(socketserver.BaseRequestHandler):
    """Reads one connection's frames; its outputs go back through Connection's writer."""

    server: "_Server"

    def handle(self) -> None:
        conn = Connection(self.request, self.server.service, self.server.next_number())
        reader = P.FrameReader()
        try:
            while not reader.closed:
                for msg in reader.feed(self.request):
                    self._dispatch(conn, msg)
        except (OSError, ValueError):
            pass  # a broken or misbehaving peer: drop it, its requests are aborted
        finally:
            conn.close()

    def _dispatch(self, conn: Connection, msg: Mapping[str, Any]) -> None:
        op = msg.get("op")
        service = self.server.service
        if op == "submit":
            conn.submit(msg)
        elif op == "abort":
            conn.abort(msg.get("ids") or ())
        elif op == "info":
            conn.send(service.info())
        elif op == "stats":
            conn.send(service.stats(int(msg.get("since", 0))))
        elif op == "refused":  # a serving model refused a request (metrics_engine.report_refused)
            service.counters.refused(str(msg.get("reason")))
        elif op in LORA_OPS:  # adapters known to the engine (engine_process/lora_ops.py)
            conn.send(lora_op(service.loop.engine, msg))
        else:
            conn.send({"type": "error", "code": ErrorCode.INVALID_ARGUMENT, "message": f"unknown op {op!r}"})


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, path: str, service: EngineService) -> None:
        self.service = service
        self._numbers = itertools.count(1)
        super().__init__(path, _Handler)

    def next_number(self) -> int:
        return next(self._numbers)  # itertools.count is atomic under the GIL


def serve(repository: Path, socket_path: str, restarts: int = 0) -> None:
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.loop import EngineLoop

    params = read_parameters(repository / "tensorrt_llm" / "config.pbtxt")
    # The engine thread holds the GIL between torch calls; with the default
    # 5 ms switch interval a step's frame waited up to that long for its
    # writer thread.
    prefer_quick_thread_switches()
    set_engine_threads(params)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_dir(params["gpt_model_path"], **engine_overrides(params))
    loop = EngineLoop(engine).start()
    log.info("engine loaded from %s in %.2fs: %s; %d torch threads", params["gpt_model_path"],
             time.perf_counter() - t0, engine_overrides(params), torch_threads())
    if os.path.exists(socket_path):
        os.unlink(socket_path)  # a stale socket of a crashed predecessor
    server = _Server(socket_path, EngineService(loop, restarts))
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
    ap.add_argument("--restarts", type=int, default=0, help="times the launcher restarted the engine before")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    serve(args.repository, args.socket, args.restarts)


if __name__ == "__main__":
    main()
