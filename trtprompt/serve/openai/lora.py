"""LoRA adapters on the OpenAI API (docs/lora.md, docs/openai.md "LoRA adapters").

- A request's `model` may name an adapter the engine knows: it runs with that adapter, and its answer
  carries the adapter's name as `model`; the base model's name runs with none. SGLang's `lora_path`
  names a loaded adapter too (with the base model as `model`, or the same adapter).
- `/v1/models` lists the base model and then every adapter, with `parent` (the base model's id) and
  `root` (the adapter's directory), as vLLM lists them.
- vLLM's `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter`
  {"lora_name"}: 200 with a text message, 400 with the adapter's own error, 404 unloading an unknown name.

The engine process holds the adapters (engine/lora/manager.py); each call here is one engine op
(serve/engine_process/lora_ops.py) on a connection of its own. Only the fused layout's direct path has the
engine's socket: through Triton (the trtllm target, the upstream layout) there is none to ask, so no adapter
is listed and naming one is refused (lora_path: 400; a `model` that is not the base: 404 as before).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping

from trtprompt.serve.openai.errors import APIError, bad_request
from trtprompt.serve.openai.params import ModelLimits
from trtprompt.serve.wire import protocol as P

NO_ENGINE = ("LoRA adapters are served by the torch target's engine on the fused layout; this front end "
             "answers through Triton, which takes adapters as lora_task_id / lora_weights / lora_config inputs")
OP_TIMEOUT_S = 120.0  # a load reads and checks the adapter's weights


class Adapters:
    """The engine's adapters, asked for when needed (another front end or a load may change them)."""

    def __init__(self, socket_path: str | None) -> None:
        self.socket = socket_path  # None: answering through Triton, no engine to ask

    async def _op(self, msg: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The adapters after one op; APIError 400 with the engine's message when it refuses the op."""
        if self.socket is None:
            raise bad_request(NO_ENGINE, "model", "lora_unsupported")
        try:
            reply = await asyncio.to_thread(P.call, self.socket, dict(msg), OP_TIMEOUT_S)
        except P.EngineUnavailableError as exc:
            raise APIError(503, f"the engine is unavailable: {exc}", "server_error", None, "engine_unavailable",
                           {"Retry-After": "1"}) from None
        except P.EngineError as exc:
            raise bad_request(exc.message, "lora_name", "invalid_lora_adapter") from None
        adapters = reply.get("adapters")
        return list(adapters) if isinstance(adapters, list) else []

    async def listing(self) -> list[dict[str, Any]]:
        """Every adapter the engine knows ([] through Triton)."""
        return [] if self.socket is None else await self._op({"op": "lora_list"})

    async def names(self) -> set[str]:
        return {str(a.get("name")) for a in await self.listing()}

    async def load(self, name: str, path: str) -> None:
        await self._op({"op": "lora_load", "name": name, "path": path})

    async def unload(self, name: str) -> None:
        await self._op({"op": "lora_unload", "name": name})


def _lora_path(body: Mapping[str, Any]) -> str | None:
    """SGLang's lora_path: one adapter's name (a list, one per prompt, when all name the same adapter)."""
    value = body.get("lora_path")
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value) and len(set(value)) == 1:
        return str(value[0])
    if isinstance(value, str):
        return value
    raise bad_request("lora_path must be the name of a loaded LoRA adapter (a list only when every entry names "
                      f"the same one), got {type(value).__name__}", "lora_path")


async def request_adapter(body: Any, limits: ModelLimits, adapters: Adapters) -> str | None:
    """The adapter a completion or chat body asks for (None: the base model). A `model` that is neither
    the base model nor an adapter is left to params._check_model (404 model_not_found)."""
    if not isinstance(body, dict):
        return None
    model, by_path = body.get("model"), _lora_path(body)
    if by_path is not None:
        if adapters.socket is None:
            raise bad_request(NO_ENGINE, "lora_path", "lora_unsupported")
        if by_path not in await adapters.names():
            raise bad_request(f"lora_path {by_path!r} is not a loaded LoRA adapter (GET /v1/models lists them; "
                              "POST /v1/load_lora_adapter loads one)", "lora_path")
        if isinstance(model, str) and model != by_path and not limits.serves(model):
            raise bad_request(f"model {model!r} and lora_path {by_path!r} differ: name the adapter in one of them "
                              f"(model may stay {limits.name!r})", "lora_path")
        return by_path
    if not isinstance(model, str) or not model or limits.serves(model) or adapters.socket is None:
        return None
    return model if model in await adapters.names() else None


def model_cards(limits: ModelLimits, created: int, adapters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """/v1/models' data: the base model, then each adapter with its parent and source directory."""
    base = {"id": limits.name, "object": "model", "created": created, "owned_by": "trtprompt",
            "root": limits.name, "parent": None, "max_model_len": limits.max_model_len}
    return [base] + [{**base, "id": a["name"], "root": a.get("source"), "parent": limits.name}
                     for a in adapters]


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{name}' must be a non-empty string", name, "missing_required_parameter")
    return value.strip()


async def load_adapter(body: Any, limits: ModelLimits, adapters: Adapters) -> str:
    """POST /v1/load_lora_adapter: the success message; APIError 400 naming what is wrong."""
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    if adapters.socket is None:
        raise bad_request(NO_ENGINE, "lora_name", "lora_unsupported")
    if limits.serves(name):
        raise bad_request(f"lora_name {name!r} is the base model's name: an adapter needs a name of its own",
                          "lora_name")
    if not body.get("load_inplace") and name in await adapters.names():
        raise bad_request(f"LoRA adapter {name!r} is already loaded: unload it first, or send load_inplace true "
                          "to replace it", "lora_name")
    await adapters.load(name, os.path.abspath(path))  # the engine process may run in another directory
    return f"Success: LoRA adapter {name!r} loaded from {path}"


async def unload_adapter(body: Any, adapters: Adapters) -> str:
    """POST /v1/unload_lora_adapter: the success message; 404 for a name the engine does not know."""
    name = _field(body, "lora_name")
    if adapters.socket is None:
        raise bad_request(NO_ENGINE, "lora_name", "lora_unsupported")
    if name not in await adapters.names():
        raise APIError(404, f"LoRA adapter {name!r} is not loaded", "not_found_error", "lora_name",
                       "lora_not_found")
    await adapters.unload(name)
    return f"Success: LoRA adapter {name!r} unloaded"
