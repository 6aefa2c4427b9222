"""tensorrtllm_backend's guided decoding inputs on the Triton models (docs/structured-outputs.md, "Triton").

`guided_decoding_guide_type` / `guided_decoding_guide` (BYTES) become SamplingParams.guide_type / guide;
the `guided_decoding_backend` model parameter is checked when the model loads. Pure (no Triton import):
the Python-backend models (inputs.py reads the tensors) and their tests call it alike.
"""

from __future__ import annotations

from typing import Any, Mapping

from trtprompt.error_codes import BadRequestError
from trtprompt.interface import GUIDE_INPUT as GUIDE_INPUT
from trtprompt.interface import GUIDE_TYPE_INPUT as GUIDE_TYPE_INPUT
from trtprompt.interface import TRITON_GUIDE_TYPES as TRITON_GUIDE_TYPES
from trtprompt.serve.wire.protocol import EngineError

# SamplingParams field -> the input that sets it (the engine's refusals name the field).
INPUT_OF_FIELD: Mapping[str, str] = {"guide_type": GUIDE_TYPE_INPUT, "guide": GUIDE_INPUT}
# The torch target serves every guide with llguidance; xgrammar (TensorRT-LLM's name) is taken as a synonym.
TORCH_BACKENDS: tuple[str, ...] = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"

Guide = tuple[str | None, str | None]  # (guide_type, guide) as SamplingParams takes them


def guide_of(guide_type: str | None, guide: str | None, types: tuple[str, ...] = TRITON_GUIDE_TYPES,
             type_name: str = GUIDE_TYPE_INPUT, guide_name: str = GUIDE_INPUT) -> Guide:
    """The (guide_type, guide) of a request's two inputs; an empty string is the same as absent.

    `json` without a guide is any JSON object; `json` with one is a JSON schema (TensorRT-LLM's executor
    ignores a guide under `json`: here it is honoured, not dropped). Refusals name the input.
    """
    kind, text = guide_type or None, guide or None
    if kind is None:
        if text is not None:
            raise BadRequestError(f"input '{guide_name}' needs input '{type_name}' (one of "
                                  f"{', '.join(types)}) to say what it is", type_name)
        return None, None
    if kind not in types:
        raise BadRequestError(f"input '{type_name}' must be one of {', '.join(types)}, got {kind!r}", type_name)
    if kind == "json":
        return ("json", None) if text is None else ("json_schema", text)
    if text is None:
        raise BadRequestError(f"input '{guide_name}' is required with {type_name} {kind!r}", guide_name)
    return kind, text


def guide_fields(guide: Guide) -> dict[str, tuple[Any, str]]:
    """SamplingParams fields (value, the input that set it) of a guide; empty without one."""
    kind, text = guide
    if kind is None:
        return {}
    return {"guide_type": (kind, GUIDE_TYPE_INPUT), "guide": (text, GUIDE_INPUT)}


def client_error(exc: EngineError) -> EngineError:
    """An engine refusal of a guide field ("guide <rule>", the FieldError's message), named as the Triton
    input that set it; any other error as it is."""
    for field in sorted(INPUT_OF_FIELD, key=len, reverse=True):  # guide_type before guide
        if exc.field == field or exc.message.startswith(field + " "):
            rule = exc.message[len(field) + 1:] if exc.message.startswith(field + " ") else exc.message
            return EngineError(exc.code, f"input '{INPUT_OF_FIELD[field]}' {rule}", INPUT_OF_FIELD[field])
    return exc


def check_backend(params: Mapping[str, str]) -> str:
    """The tensorrt_llm model's `guided_decoding_backend` parameter on the torch target: llguidance (also when
    unset or empty) or xgrammar (served by llguidance); anything else stops the model from loading."""
    value = (params.get("guided_decoding_backend") or "").strip() or DEFAULT_BACKEND
    if value not in TORCH_BACKENDS:
        raise ValueError(f"parameter 'guided_decoding_backend' must be one of {', '.join(TORCH_BACKENDS)} on the "
                         f"torch target (llguidance serves both), got {value!r}")
    return value


XGRAMMAR_NOTE = ("guided_decoding_backend xgrammar: the torch target serves guides with llguidance (the same guide "
                 "types and forms; docs/structured-outputs.md)")
