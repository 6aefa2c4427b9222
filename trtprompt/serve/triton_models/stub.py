"""Python-backend glue shared by the model files in serve/triton_models/models/.

Imports triton_python_backend_utils, so it is importable only inside
Triton's Python stub. Errors are sent together with the final flag in one
call (docs/design.md, "Triton facts": a separate final send leaves ensemble
requests in flight), their message tagged with their code (error_codes.py).
"""

from __future__ import annotations

# Imported here, while the model loads, for the stub's sake: Triton 2.51's Python stub imports asyncio
# on the first execute() (to tell a coroutine from None), in its main thread, and a per-request thread
# sending a response during that import crashed the stub with SIGSEGV ("Stub process ... is not
# healthy" for every later request; docs/design.md, "Triton facts"). Loaded now, that import finds it.
import asyncio  # noqa: F401
import faulthandler
import functools
import json
import os
import threading
import traceback
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from trtprompt.error_codes import STATUSES, CancelledRequestError, code_of, describe, tagged
from trtprompt.knobs import KNOBS
from trtprompt.serve.triton_models.cancel_watch import CancelWatcher, watch_client
from trtprompt.serve.triton_models.guided import client_error
from trtprompt.serve.triton_models.lora_inputs import task_error
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.engine_client import EngineClient
from trtprompt.serve.wire.frames import StepEntry
from trtprompt.serve.wire.process import SOCKET_ENV
from trtprompt.serve.wire.refusals import refusal_reason, report_refused
from trtprompt.serve.wire.requests import TokenRequest

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
def model_parameters(args: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(model config dict, its parameters as plain strings). Every model's initialize() calls it first.

    It also enables faulthandler. tritonserver does not log how a stub ended, so without it a crash
    of the stub (SIGSEGV, SIGABRT) leaves only a kernel log line that may not be readable. With it,
    "Fatal Python error" and every thread's stack go to tritonserver.log (the stub's stderr;
    docs/design.md, "Stopping"). tests/test_clean_stop.py and test_trtllm_triton_validation.py look
    for it.
    """
    faulthandler.enable(all_threads=True)
    cfg = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
    return cfg, params


def engine_socket(params: Mapping[str, str]) -> str:
    return os.environ.get(SOCKET_ENV) or params["engine_socket"]


def param_bool(params: Mapping[str, str], key: str, default: bool) -> bool:
    value = params.get(key, "").strip().lower()
    return default if not value else value in ("true", "1", "yes")


def read_inputs(request: Any, names: Iterable[str]) -> dict[str, np.ndarray[Any, Any]]:
    """Copy the request's present inputs out as numpy arrays."""
    tensors = {}
    for name in names:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is not None:
            tensors[name] = t.as_numpy()
    return tensors


def tensor(name: str, value: Any, dtype: str) -> Any:
    return pb_utils.Tensor(name, np.asarray(value, dtype=dtype))


def text_tensor(name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([[text.encode("utf-8")]], dtype=object))


CANCELLED_MESSAGE = "request cancelled by the client"


def error_for(exc: BaseException) -> Any:
    """The TritonError a failure is reported with: its code's Triton status, the code as a tag.
    A failure that is no RequestError is the server's fault: logged here with its traceback."""
    code, message = describe(exc)
    if code_of(exc, None) is None:
        pb_utils.Logger.log_error(f"internal error: {''.join(traceback.format_exception(exc))}")
    E = pb_utils.TritonError
    return E(tagged(code, message), getattr(E, STATUSES[code].triton))


def send_error(sender: Any, exc: BaseException) -> None:
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error_for(exc)), flags=FINAL)


def scalar_tensors(values: Mapping[str, tuple[int, str]], wanted: frozenset[str]) -> list[Any]:
    """[[value]] tensors (name -> (value, numpy dtype)) for the outputs the client asked for only:
    building and relaying tensors is most of a streamed response's cost (docs/design.md, "Serving path")."""
    return [tensor(name, [[value]], dtype) for name, (value, dtype) in values.items() if name in wanted]


def send(sender: Any, tensors: list[Any], final: bool) -> None:
    sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)


class Row(Protocol):
    """One batch row of a request: what it submits, and its output entries turned into tensors."""

    def engine_request(self) -> TokenRequest: ...

    def response(self, frame: StepEntry) -> list[Any] | None: ...


class Job:
    """One Triton request in flight: its rows' engine requests and its response sender.

    Output entries arrive on the EngineClient's reader thread; errors, the
    client's cancellation (CancelWatcher thread) and submit failures may
    race with them, so one lock and a done flag make sure exactly one
    response carries the final flag and nothing is sent after it.
    """

    def __init__(self, rows: Sequence[Row], sender: Any, client: EngineClient, watcher: CancelWatcher) -> None:
        self.rows, self.sender, self.client, self.watcher = rows, sender, client, watcher
        self._lock = threading.Lock()
        self._done = False
        self._rids: list[str | None] = [None] * len(rows)
        self._finished = [False] * len(rows)

    def start(self) -> None:
        self.watcher.add(self)
        try:
            for i, row in enumerate(self.rows):
                rid = self.client.submit(row.engine_request(), functools.partial(self.on_entry, i))
                with self._lock:
                    self._rids[i] = rid
                    if self._done:  # an earlier row failed while this one was being submitted
                        self.client.abort([rid])
                        return
        except BaseException as exc:  # noqa: BLE001 - every request ends with a final response
            self.fail(exc)

    def on_entry(self, i: int, entry: StepEntry) -> None:
        with self._lock:
            if self._done:
                return
            try:
                self._on_entry(i, entry)
            except BaseException as exc:  # noqa: BLE001 - reported to the client
                self._fail_locked(exc)

    def _on_entry(self, i: int, entry: StepEntry) -> None:
        error = P.entry_error(entry)
        if error is not None:
            self._finished[i] = True
            # A guide's refusal names the client's input, not the engine's field; an unknown adapter, lora_task_id.
            raise task_error(client_error(error), self.rows[i].engine_request().lora)
        if entry["finished"]:
            self._finished[i] = True
            if entry.get("warning"):
                pb_utils.Logger.log_warn(entry["warning"])
        last = all(self._finished)
        out = self.rows[i].response(entry)
        if out is not None and (out or last):  # no output the client named: nothing to send yet
            send(self.sender, out, final=last)
        if last:
            self._done = True
            self.watcher.discard(self)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self._done:
                self._fail_locked(exc)

    def _fail_locked(self, exc: BaseException) -> None:
        """Abort the rows still running and end the request with one error response."""
        self._done = True
        self.watcher.discard(self)
        self.client.abort([rid for rid, fin in zip(self._rids, self._finished) if rid is not None and not fin])
        send_error(self.sender, exc)

    def is_cancelled(self) -> bool:
        # Under the lock and never after the final response: Triton frees the
        # response factory with it, and asking then crashes tritonserver
        # (TRITONBACKEND_ResponseFactoryIsCancelled on a freed factory).
        with self._lock:
            return not self._done and self.sender.is_cancelled()

    def cancel(self) -> None:
        self.fail(CancelledRequestError(CANCELLED_MESSAGE))


class Workers:
    """Tracks the per-request intake threads (parse, tokenize, submit) so finalize() can wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def start(self, target: Any, *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def join(self, timeout_s: float) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout_s / max(1, len(threads)))


class RowModel:
    """execute/finalize shared by the decoupled models that relay rows to the engine.

    A short-lived intake thread per request turns its tensors into rows
    (`make_rows`: parse, tokenize) and submits them, so one slow request does
    not hold up execute(); after that the request costs no thread: its
    outputs come on the EngineClient's reader thread and one CancelWatcher,
    paced by the engine's steps, covers every request. Subclasses call `start_relay(socket, params)` and set
    input_names in initialize().
    """

    input_names: list[str]
    workers: Workers
    client: EngineClient
    watcher: CancelWatcher

    def start_relay(self, socket_path: str, params: Mapping[str, str]) -> None:
        self.client = EngineClient(socket_path)
        period_ms = params.get("cancellation_check_period_ms") or KNOBS["cancellation_check_period_ms"].default
        self.watcher = watch_client(int(period_ms) / 1000, self.client)
        self.workers = Workers()

    def make_rows(self, tensors: dict[str, Any], wanted: frozenset[str]) -> Sequence[Row]:
        """The request's rows; `wanted` is the outputs the client asked for (all when it named none)."""
        raise NotImplementedError

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            tensors = read_inputs(request, self.input_names)
            wanted = frozenset(request.requested_output_names())
            self.workers.start(self._handle, tensors, wanted, request.get_response_sender())
        return None

    def _handle(self, tensors: dict[str, Any], wanted: frozenset[str], sender: Any) -> None:
        try:
            rows = self.make_rows(tensors, wanted)
        except Exception as exc:  # noqa: BLE001 - reported to the client
            send_error(sender, exc)
            report_refused(refusal_reason(exc), self.client.path)
            return
        Job(rows, sender, self.client, self.watcher).start()

    def finalize(self) -> None:
        self.workers.join(5.0)
        self.watcher.stop()
        self.client.close()
        return None


def logger() -> Any:
    return pb_utils.Logger
