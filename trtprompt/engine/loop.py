"""Thread-safe front of an LLMEngine: one background loop, outputs delivered per step.

Every accepted request has an owner, an `OutputSink`; after each engine step
the loop hands every sink the step's outputs for its requests in ONE call
(`deliver`). A `RequestStream` is the sink of one request (a queue an
in-process caller iterates); the engine process's connections are sinks of
many (one frame per step, docs/design.md "Request path and engine process
protocol").

Every accepted request ends with exactly one finished output: done, aborted,
or an error (also when a step fails or the loop stops).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

from trtprompt.engine.engine import EngineStats, LLMEngine
from trtprompt.engine.errors import DuplicateRequestError, EngineRequestError, EngineStoppingError, QueueFullError
from trtprompt.engine.request import FinishReason, RequestOutput, RetentionConfig, SamplingParams
from trtprompt.engine.validation import ValidatedRequest
from trtprompt.error_codes import ErrorCode

log = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Receives, on the loop thread, one step's outputs for the requests it owns.

    Must not block (the loop and every other request wait on it); it must
    not raise either, and a raise is logged and ignored.
    """

    def deliver(self, outputs: list[RequestOutput]) -> None: ...


class RequestStream:
    """Outputs of one request, in order; iteration ends after the finished one."""

    def __init__(self, request_id: str, loop: "EngineLoop") -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._queue.put(out)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; raises queue.Empty after timeout seconds."""
        return self._queue.get(timeout=timeout)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._queue.get()
            yield out
            if out.finished:
                return

    def abort(self) -> None:
        self._loop.abort(self.request_id)


@dataclass(frozen=True)
class _Add:
    """A request add() accepted (and validated), for the loop to admit."""

    request_id: str
    checked: ValidatedRequest
    cache_salt: str | None
    arrival_ns: int
    retention: RetentionConfig | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


def error_output(request_id: str, message: str, code: ErrorCode) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[], finished=True,
                         num_input_tokens=0, num_output_tokens=0,
                         finish_reason=FinishReason.ERROR, error=message, error_code=code)


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque[_Add | _Abort] = deque()
        self._pending_adds = 0
        self._owners: dict[str, OutputSink] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="trtprompt-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()
        self._fail_owned("engine stopped before the request finished", ErrorCode.UNAVAILABLE)

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               cache_salt: str | None = None, retention: RetentionConfig | None = None,
               lora: str | None = None) -> RequestStream:
        """Accept a request or raise EngineRequestError; its outputs arrive on the stream."""
        stream = RequestStream(request_id, self)
        self.add(request_id, prompt_token_ids, params, stream, cache_salt, retention, lora)
        return stream

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
            sink: OutputSink, cache_salt: str | None = None, retention: RetentionConfig | None = None,
            lora: str | None = None) -> None:
        """Accept a request whose outputs go to sink, or raise EngineRequestError (client-ready); `lora`: the
        name of an adapter the engine knows."""
        # Validated here, once: the caller hears a refusal now, and the loop admits the result as it is.
        checked = self.engine.check_request(prompt_token_ids, params, lora)
        limit = self.engine.scheduler_config.max_queue_size
        with self._lock:
            if self._stopping:
                raise EngineStoppingError("engine is shutting down")
            if request_id in self._owners:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            if limit is not None and self._pending_adds + self.engine.scheduler.num_waiting >= limit:
                raise QueueFullError(limit)
            self._owners[request_id] = sink
            self._pending_adds += 1
            # Arrival is stamped here, not when the loop next drains the inbox,
            # so time spent waiting for a running step counts toward TTFT.
            self._inbox.append(_Add(request_id, checked, cache_salt, time.time_ns(), retention))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.abort_many((request_id,))

    def abort_many(self, request_ids: Iterable[str]) -> None:
        """Abort several requests with one wake-up (a closed connection's)."""
        with self._lock:
            self._inbox.extend(_Abort(rid) for rid in request_ids)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._owners)

    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, deque()
            self._pending_adds = 0
        rejected = []
        for item in items:
            if isinstance(item, _Add):
                try:
                    self.engine.add_validated(item.request_id, item.checked, item.cache_salt, item.arrival_ns,
                                              item.retention)
                except EngineRequestError as exc:
                    rejected.append(error_output(item.request_id, str(exc), exc.code))
            elif not self.engine.abort(item.request_id):
                log.debug("abort of unknown or finished request %s", item.request_id)
        if rejected:
            self._deliver(rejected)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each sink its share of one step's outputs, in one call per sink."""
        batches: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                rid = out.request_id
                sink = self._owners.pop(rid, None) if out.finished else self._owners.get(rid)
                if sink is not None:
                    batches.setdefault(id(sink), (sink, []))[1].append(out)
        for sink, outs in batches.values():
            try:
                sink.deliver(outs)
            except Exception:  # noqa: BLE001 - one broken sink must not stop the loop
                log.exception("an output sink failed; its outputs of this step are lost")

    def _fail_owned(self, message: str, code: ErrorCode) -> None:
        """End every request that still has an owner with an error output."""
        with self._lock:
            rids = list(self._owners)
        self._deliver([error_output(rid, message, code) for rid in rids])

    def _fail_all(self, exc: BaseException) -> None:
        log.exception("engine step failed; failing all in-flight requests")
        for rid in {r.group_id for r in self.engine.requests.values()}:  # by request: n > 1 has several sequences
            self.engine.abort(rid)
        self.engine.step()  # flush the aborts so the blocks are released
        self._fail_owned(f"engine error: {exc}", ErrorCode.INTERNAL)

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.stats()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                self._deliver(self.engine.step())
            except Exception as exc:  # noqa: BLE001 - no request may be lost
                self._fail_all(exc)
            self._stats = self.engine.stats()
