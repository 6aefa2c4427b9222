"""The engine process's adapter ops: load a PEFT directory, add one sent as TensorRT-LLM's request tensors,
forget an adapter, list them (docs/lora.md).

Each is one request/reply on a connection of its own (protocol.call); a refusal is an error frame whose
message names the adapter and what is wrong, and nothing else in the engine changes.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from trtprompt.error_codes import ErrorCode

if TYPE_CHECKING:
    from trtprompt.engine.engine import LLMEngine

LORA_OPS: tuple[str, ...] = ("lora_load", "lora_unload", "lora_list", "lora_weights")
# lora_weights' element types as the op carries them (the raw bytes, base64 in the JSON frame).
WEIGHT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")


def _error(message: str) -> dict[str, Any]:
    return {"type": "error", "code": ErrorCode.INVALID_ARGUMENT, "message": message}


def _text(msg: Mapping[str, Any], key: str) -> str | None:
    value = msg.get(key)
    return value if isinstance(value, str) and value else None


def listing(engine: LLMEngine) -> dict[str, Any]:
    return {"type": "lora", "adapters": [dataclasses.asdict(a) for a in engine.lora.known()]}


def lora_op(engine: LLMEngine, msg: Mapping[str, Any]) -> dict[str, Any]:
    """The reply to one adapter op."""
    from trtprompt.engine.lora.adapter import LoraError

    op, name = msg.get("op"), _text(msg, "name")
    if op == "lora_list":
        return listing(engine)
    if name is None:
        return _error(f"{op}: 'name' must be a non-empty string")
    if op == "lora_unload":
        return listing(engine) if engine.lora.remove(name) else _error(f"LoRA adapter {name!r} is not loaded")
    if op == "lora_weights":
        return add_weights(engine, name, msg)
    path = _text(msg, "path")
    if path is None:
        return _error(f"{op}: 'path' must be a PEFT adapter directory")
    try:
        engine.lora.load_dir(name, path)
    except (LoraError, OSError) as exc:
        return _error(str(exc))
    return listing(engine)


def _weights(msg: Mapping[str, Any]) -> Any:
    """The op's lora_weights as a torch tensor: base64 bytes of `dtype`, reshaped to `shape`."""
    import torch

    dtype, shape = msg.get("dtype"), msg.get("shape")
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"lora_weights: 'dtype' must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError("lora_weights: 'shape' must be a list of sizes")
    try:
        raw = bytearray(base64.b64decode(str(msg.get("weights") or ""), validate=True))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"lora_weights: 'weights' is not base64: {exc}") from None
    flat = torch.frombuffer(raw, dtype=getattr(torch, dtype)) if raw else torch.empty(0, dtype=getattr(torch, dtype))
    count = 1
    for d in shape:
        count *= d
    if flat.numel() != count:
        raise ValueError(f"lora_weights: {flat.numel()} values do not fill shape {shape}")
    return flat.reshape(shape).float()


def add_weights(engine: LLMEngine, name: str, msg: Mapping[str, Any]) -> dict[str, Any]:
    """Know `name` as the adapter of TensorRT-LLM's request tensors lora_weights / lora_config (the Triton
    stubs' lora_task_id; engine/lora/trtllm_format.py): it is forgotten when evicted from host memory."""
    import numpy as np

    from trtprompt.engine.lora.adapter import LoraError
    from trtprompt.engine.lora.trtllm_format import from_trtllm

    config = msg.get("config")
    if not (isinstance(config, list) and all(isinstance(r, list) and all(isinstance(v, int) for v in r)
                                             for r in config)):
        return _error("lora_weights: 'config' must be lora_config's rows, lists of integers")
    try:
        adapter = from_trtllm(name, _weights(msg), np.array(config, dtype=np.int64).reshape(len(config), -1),
                              engine.lora.cfg, engine.lora.config.max_lora_rank)
        engine.lora.add(adapter)
    except (LoraError, ValueError) as exc:
        return _error(str(exc))
    return listing(engine)
