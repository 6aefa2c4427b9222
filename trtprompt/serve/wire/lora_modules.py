"""The `lora_modules` parameter of the `tensorrt_llm` model: the adapters the engine process loads when it
starts (serve --lora-modules), as one JSON object {name: absolute directory}. Written by the launcher
(serve/launch/lora_modules.py), read by the engine process (engine_overrides)."""

from __future__ import annotations

import json
from typing import Mapping

PARAMETER = "lora_modules"


def encode_lora_modules(modules: Mapping[str, str]) -> str | None:
    """The parameter's text (None: no adapters, the parameter is left out)."""
    return json.dumps(dict(modules)) if modules else None


def lora_modules_of(params: Mapping[str, str]) -> dict[str, str] | None:
    """{name: directory} from the parameters (None: none given); ValueError naming the parameter."""
    text = params.get(PARAMETER)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"parameter {PARAMETER} must be a JSON object of adapter name -> directory, got {text!r}")
    return value
