"""Python-backend glue shared by the model files in serve/models/.

Imports triton_python_backend_utils, so it is importable only inside
Triton's Python stub. Errors are sent together with the final flag in one
call (FACTS.md: a separate final send leaves ensemble requests in flight).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Iterable, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

from trtprompt.serve import protocol as P
from trtprompt.serve.inputs import InputError
from trtprompt.serve.relay import Cancelled

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SOCKET_ENV = "TRTPROMPT_ENGINE_SOCKET"


def model_parameters(args: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(model config dict, its parameters as plain strings)."""
    cfg = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
    return cfg, params


def engine_socket(params: Mapping[str, str]) -> str:
    return os.environ.get(SOCKET_ENV) or params["engine_socket"]


def param_bool(params: Mapping[str, str], key: str, default: bool) -> bool:
    value = params.get(key, "").strip().lower()
    return default if not value else value in ("true", "1", "yes")


def read_inputs(request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
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


def error_for(exc: BaseException) -> Any:
    """The TritonError a failure is reported with."""
    E = pb_utils.TritonError
    if isinstance(exc, Cancelled):
        return E("request cancelled by the client", E.CANCELLED)
    if isinstance(exc, InputError):
        return E(str(exc), E.INVALID_ARG)
    if isinstance(exc, P.EngineUnavailableError):
        return E(str(exc), E.UNAVAILABLE)
    if isinstance(exc, P.EngineError):
        codes = {P.INVALID_ARG: E.INVALID_ARG, P.QUEUE_FULL: E.UNAVAILABLE,
                 P.UNAVAILABLE: E.UNAVAILABLE}
        return E(str(exc), codes.get(exc.code, E.INTERNAL))
    return E(f"internal error: {type(exc).__name__}: {exc}", E.INTERNAL)


def send_error(sender: Any, exc: BaseException) -> None:
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error_for(exc)), flags=FINAL)


def send(sender: Any, tensors: list[Any], final: bool) -> None:
    sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)


class Workers:
    """Tracks the per-request threads so finalize() can wait for them."""

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


def logger() -> Any:
    return pb_utils.Logger
