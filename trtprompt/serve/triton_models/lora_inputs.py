"""tensorrtllm_backend's LoRA inputs on the torch target's Triton models (docs/triton-inputs.md, docs/lora.md).

`lora_task_id` (UINT64) names the adapter: task id N is the engine's adapter named "N". With it, the first
request sends `lora_weights` [N, D x Hi + Ho x D] and `lora_config` [N, 3] (engine/lora/trtllm_format.py),
which reach the engine process once (the `lora_weights` op) before the request is submitted; later requests
send the task id alone. The engine's adapter manager is the cache (TensorRT-LLM's task-id rule: an adapter
sent as weights is forgotten when evicted from host memory, max_cpu_loras), so the models keep no state.
Pure (numpy and the wire protocol): the models and their tests call it alike.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from trtprompt.error_codes import BadRequestError, ErrorCode
from trtprompt.serve.wire import protocol as P

TASK_INPUT, WEIGHTS_INPUT, CONFIG_INPUT = "lora_task_id", "lora_weights", "lora_config"
CONFIG_COLUMNS = 3  # [module_id, layer_idx, adapter_size]
# numpy dtype name -> the op's dtype (float16 as tensorrtllm_backend declares the input; the others for
# callers that hand arrays of their own).
OP_DTYPES: Mapping[str, str] = {"float16": "float16", "float32": "float32"}
FRAME_SLACK = 1 << 20  # the op's JSON around the weights' base64


@dataclass(frozen=True)
class LoraInput:
    """One row's LoRA inputs: the task id, and the adapter's tensors when this request sends them."""

    task_id: int
    weights: np.ndarray[Any, Any] | None = None
    config: np.ndarray[Any, Any] | None = None

    @property
    def name(self) -> str:
        """The engine's adapter name of this task id."""
        return str(self.task_id)


def _row(tensors: Mapping[str, Any], name: str, i: int) -> np.ndarray[Any, Any] | None:
    arr = tensors.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    return arr[i] if arr.ndim and arr.shape[0] > i else arr


def _task_id(tensors: Mapping[str, Any], i: int) -> int | None:
    row = _row(tensors, TASK_INPUT, i)
    if row is None:
        return None
    flat = row.reshape(-1)
    if flat.size != 1:
        raise BadRequestError(f"input '{TASK_INPUT}' must hold one value per request, got shape {tuple(row.shape)}",
                              TASK_INPUT)
    value = int(flat[0])
    if value < 0:
        raise BadRequestError(f"input '{TASK_INPUT}' must be an unsigned integer, got {value}", TASK_INPUT)
    return value


def _tensors(tensors: Mapping[str, Any], i: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
    """(weights [N, W], config [N, 3]) of row i, checked for shape; None when neither is sent."""
    weights, config = _row(tensors, WEIGHTS_INPUT, i), _row(tensors, CONFIG_INPUT, i)
    if weights is None and config is None:
        return None
    if weights is None or config is None:
        missing, given = (WEIGHTS_INPUT, CONFIG_INPUT) if weights is None else (CONFIG_INPUT, WEIGHTS_INPUT)
        raise BadRequestError(f"input '{missing}' is required with '{given}': an adapter is sent as both", missing)
    if weights.ndim != 2 or weights.shape[0] == 0 or weights.shape[1] == 0:
        raise BadRequestError(f"input '{WEIGHTS_INPUT}' must have shape [num_modules_layers, D x Hi + Ho x D] per "
                              f"request, got {tuple(weights.shape)}", WEIGHTS_INPUT)
    if config.ndim != 2 or config.shape[1] != CONFIG_COLUMNS:
        raise BadRequestError(f"input '{CONFIG_INPUT}' must have shape [num_modules_layers, 3] per request (module_id,"
                              f" layer_idx, adapter_size), got {tuple(config.shape)}", CONFIG_INPUT)
    if config.shape[0] != weights.shape[0]:
        raise BadRequestError(f"inputs '{WEIGHTS_INPUT}' ({weights.shape[0]} rows) and '{CONFIG_INPUT}' "
                              f"({config.shape[0]} rows) must have one row per module and layer each", CONFIG_INPUT)
    return weights, config


def lora_input(tensors: Mapping[str, Any], i: int) -> LoraInput | None:
    """Row i's LoRA inputs, None without lora_task_id; a refusal names the input."""
    task_id, sent = _task_id(tensors, i), _tensors(tensors, i)
    if task_id is None:
        if sent is not None:  # TensorRT-LLM's rule: the task id keys the cache the weights go to
            raise BadRequestError(f"input '{TASK_INPUT}' must be set for LoRA inference: '{WEIGHTS_INPUT}' and "
                                  f"'{CONFIG_INPUT}' are cached under it", TASK_INPUT)
        return None
    return LoraInput(task_id) if sent is None else LoraInput(task_id, *sent)


def upload_message(name: str, weights: np.ndarray[Any, Any], config: np.ndarray[Any, Any]) -> dict[str, Any]:
    """The engine process's `lora_weights` op that sends an adapter (serve/engine_process/lora_ops.py)."""
    dtype = OP_DTYPES.get(weights.dtype.name)
    if dtype is None:
        weights, dtype = weights.astype(np.float32), "float32"
    raw = np.ascontiguousarray(weights).tobytes()
    if len(raw) * 4 // 3 + FRAME_SLACK > P.MAX_FRAME:
        bound = (P.MAX_FRAME - FRAME_SLACK) * 3 // 4
        raise BadRequestError(f"input '{WEIGHTS_INPUT}' holds {len(raw)} bytes; at most {bound} fit the engine "
                              "protocol's message", WEIGHTS_INPUT)
    return {"op": "lora_weights", "name": name, "weights": base64.b64encode(raw).decode("ascii"),
            "dtype": dtype, "shape": list(weights.shape), "config": config.astype(np.int64).tolist()}


def send_adapter(socket_path: str, lora: LoraInput | None) -> None:
    """Hand the engine the adapter this request sends (nothing for a task id alone or no LoRA). The engine's
    refusal names the input (engine/lora/trtllm_format.py) and comes back as a BadRequestError."""
    if lora is None or lora.weights is None or lora.config is None:
        return
    try:
        P.call(socket_path, upload_message(lora.name, lora.weights, lora.config), timeout=60.0)
    except P.EngineError as exc:
        if exc.code != ErrorCode.INVALID_ARGUMENT:
            raise
        field = CONFIG_INPUT if f"'{CONFIG_INPUT}'" in exc.message else WEIGHTS_INPUT
        raise BadRequestError(exc.message, field) from None


def not_cached_message(task_id: int) -> str:
    """TensorRT-LLM's words for a task id that was never sent, or was evicted, naming the input."""
    return f"input '{TASK_INPUT}': LoRA task {task_id} not found in cache. Please send LoRA weights with request"


def task_error(exc: P.EngineError, lora: str | None) -> P.EngineError:
    """The engine's refusal of an unknown adapter (engine/lora/manager.UnknownLoraError) in TensorRT-LLM's words
    for a Triton request's task id; any other error as it is."""
    if lora is None or not lora.isdigit() or not exc.message.startswith(f"LoRA adapter {lora!r} is not loaded"):
        return exc
    return P.EngineError(exc.code, not_cached_message(int(lora)), TASK_INPUT)
