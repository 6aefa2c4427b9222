"""The engine process's adapter ops: load a PEFT directory, forget an adapter, list them (docs/lora.md).

Each is one request/reply on a connection of its own (protocol.call); a refusal is an error frame whose
message names the adapter and what is wrong, and nothing else in the engine changes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from trtprompt.error_codes import ErrorCode

if TYPE_CHECKING:
    from trtprompt.engine.engine import LLMEngine

LORA_OPS: tuple[str, ...] = ("lora_load", "lora_unload", "lora_list")


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
    path = _text(msg, "path")
    if path is None:
        return _error(f"{op}: 'path' must be a PEFT adapter directory")
    try:
        engine.lora.load_dir(name, path)
    except (LoraError, OSError) as exc:
        return _error(str(exc))
    return listing(engine)
