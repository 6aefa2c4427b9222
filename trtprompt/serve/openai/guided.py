"""Structured outputs on the OpenAI front end: the one guide a request body asks for, as the engine's
SamplingParams.guide_type / guide (engine/guide.py), from whichever API's fields the client sent.

- OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}} (the guide is the INNER schema, never the wrapper), and vLLM's
  {"type": "structural_tag", "structures", "triggers"}.
- vLLM: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `guided_whitespace_pattern`,
  `guided_decoding_backend`, and the newer `structured_outputs` object.
- SGLang: `regex`, `ebnf`, `json_schema`.

Every backend name a client may send (guidance, llguidance, xgrammar, auto) is served by llguidance:
the output's language is the guide's either way. One guide per request: two are a 400 naming both
fields. The guide remembers the client's field it came from, so the engine's errors about "guide"
(an invalid schema, regex or grammar, found when it compiles) name what the client sent
(docs/structured-outputs.md, "OpenAI front end").
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.serve.openai.answer_params import shown
from trtprompt.serve.openai.errors import APIError, bad_request

# The request fields read here (beside response_format): vLLM's and SGLang's, honoured.
EXTENSION_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                    "guided_decoding_backend", "structured_outputs", "structural_tag", "regex", "ebnf",
                    "json_schema")
# guided_decoding_backend values accepted: llguidance serves each (the language is the guide's either way).
BACKENDS = ("guidance", "llguidance", "auto", "xgrammar")
# The keys each response_format type takes (OpenAI's, and vLLM's structural_tag).
RESPONSE_FORMATS: dict[str, tuple[str, ...]] = {
    "text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema"),
    "structural_tag": ("type", "structures", "triggers")}
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag",
                           "whitespace_pattern")
# The engine's names for the guide (its FieldError.field), which the client never sent, and the Triton
# models' (their refusals start "input '<name>' ..."): errors starting with one are renamed (client_error).
ENGINE_FIELDS = ("guide_type", "guide", "guide_after")
ENGINE_NAMES = ENGINE_FIELDS + ("input 'guided_decoding_guide_type'", "input 'guided_decoding_guide'")
# A Lark grammar (llguidance's dialect) rather than GBNF: a `start:` rule and no `::=`.
_LARK_START = re.compile(r"^\s*start\s*:", re.MULTILINE)
# What a regex must escape to match a choice literally (Rust's regex, llguidance's; xgrammar's alike).
_REGEX_SPECIAL = re.compile(r"([\\.^$|?*+()\[\]{}])")


@dataclass(frozen=True)
class Guide:
    """One request's guide as the engine takes it, and the client's field it came from."""

    guide_type: str
    guide: str | None  # None for "json" (any JSON object)
    field: str  # e.g. "response_format.json_schema.schema", "guided_regex": errors name it

    def sampling_fields(self) -> dict[str, str | None]:
        return {"guide_type": self.guide_type, "guide": self.guide}


def parse_guide(body: Mapping[str, Any]) -> Guide | None:
    """The one guide body asks for, or None; 400 naming the field for a malformed one or for two."""
    _check_backend(body.get("guided_decoding_backend"))
    found = [g for g in (_response_format(body.get("response_format")), *_vllm_fields(body),
                         *_structured_outputs(body.get("structured_outputs")), *_sglang_fields(body))
             if g is not None]
    if len(found) > 1:
        raise bad_request(f"{found[0].field} and {found[1].field} both ask for a guide (structured output): a "
                          "request takes one", found[1].field)
    guide = found[0] if found else None
    return _with_whitespace(guide, _whitespace_pattern(body))


def client_error(error: APIError, field: str | None) -> APIError:
    """error with the engine's guide fields named as the client's field they came from (the engine refuses
    an invalid schema, regex or grammar as FieldError("guide", ...): the client sent no `guide`)."""
    if field is None or error.status != 400 or not _about_guide(error):
        return error
    message = error.message
    for name in sorted(ENGINE_NAMES, key=len, reverse=True):
        if message.startswith(name + " "):
            message = field + message[len(name):]
            break
    else:
        message = f"{field}: {message}"
    return dataclasses.replace(error, message=message, param=field)


def _about_guide(error: APIError) -> bool:
    """The engine path names the field in param; through Triton only the message's start says it."""
    return error.param in ENGINE_FIELDS or error.message.startswith(tuple(name + " " for name in ENGINE_NAMES))


def choice_regex(choices: list[str]) -> str:
    """A regex the output matches when it is exactly one of choices (for tensorrtllm_backend's inputs,
    which have no choice type)."""
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\1", c) for c in choices) + ")"


# ---------------------------------------------------------------- OpenAI's response_format

def _response_format(fmt: Any) -> Guide | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:
        raise bad_request(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}, "
                          f"got {shown(fmt)}", "response_format")
    _known_keys(fmt, RESPONSE_FORMATS[kind], "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json", None, "response_format")
    if kind == "structural_tag":
        spec = {k: fmt.get(k) for k in ("structures", "triggers")}
        return Guide("structural_tag", _structural_tag(spec, "response_format"), "response_format")
    return _json_schema_format(fmt.get("json_schema"))


def _json_schema_format(spec: Any) -> Guide:
    """OpenAI's {"name", "schema", "strict", "description"}: the guide is the inner schema. strict asks
    nothing more here: the output always follows the schema."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object {{\"name\", \"schema\", \"strict\", \"description\"}}, got "
                          f"{shown(spec)}", where)
    _known_keys(spec, JSON_SCHEMA_KEYS, where)
    for key, kind, what in (("name", str, "a string"), ("description", str, "a string"),
                            ("strict", bool, "true or false")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise bad_request(f"{where}.{key} must be {what}, got {shown(spec[key])}", f"{where}.{key}")
    field = f"{where}.schema"
    if spec.get("schema") is None:
        raise bad_request(f"{field} is required: the JSON schema the output must follow", field)
    return Guide("json_schema", _schema(spec["schema"], field, text_ok=False), field)


# ---------------------------------------------------------------- vLLM's and SGLang's fields

def _vllm_fields(body: Mapping[str, Any]) -> list[Guide | None]:
    return [_json_guide(body.get("guided_json"), "guided_json"),
            _text_guide("regex", body.get("guided_regex"), "guided_regex"),
            _choice_guide(body.get("guided_choice"), "guided_choice"),
            _grammar_guide(body.get("guided_grammar"), "guided_grammar"),
            _structural_tag_guide(body.get("structural_tag"), "structural_tag")]


def _sglang_fields(body: Mapping[str, Any]) -> list[Guide | None]:
    return [_text_guide("regex", body.get("regex"), "regex"),
            _text_guide("ebnf_grammar", body.get("ebnf"), "ebnf"),
            _json_guide(body.get("json_schema"), "json_schema")]


def _structured_outputs(spec: Any) -> list[Guide | None]:
    """vLLM's structured_outputs {"json", "regex", "choice", "grammar", "json_object", "structural_tag",
    "whitespace_pattern"} (whitespace_pattern is read with guided_whitespace_pattern)."""
    if _unset(spec):
        return []
    where = "structured_outputs"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got "
                          f"{shown(spec)}", where)
    _known_keys(spec, STRUCTURED_OUTPUTS_KEYS, where)
    json_object = spec.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise bad_request(f"{where}.json_object must be true or false, got {shown(json_object)}",
                          f"{where}.json_object")
    return [_json_guide(spec.get("json"), f"{where}.json"),
            _text_guide("regex", spec.get("regex"), f"{where}.regex"),
            _choice_guide(spec.get("choice"), f"{where}.choice"),
            _grammar_guide(spec.get("grammar"), f"{where}.grammar"),
            Guide("json", None, f"{where}.json_object") if json_object else None,
            _structural_tag_guide(spec.get("structural_tag"), f"{where}.structural_tag")]


def _json_guide(value: Any, field: str) -> Guide | None:
    return None if _unset(value) else Guide("json_schema", _schema(value, field, text_ok=True), field)


def _text_guide(guide_type: str, value: Any, field: str) -> Guide | None:
    if _unset(value):
        return None
    if not isinstance(value, str):
        raise bad_request(f"{field} must be a string, got {shown(value)}", field)
    return Guide(guide_type, value, field)


def _choice_guide(value: Any, field: str) -> Guide | None:
    if _unset(value):
        return None
    if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{field} must be a list of non-empty strings, got {shown(value)}", field)
    return Guide("choice", json.dumps(value, ensure_ascii=False), field)


def _grammar_guide(value: Any, field: str) -> Guide | None:
    """GBNF (llama.cpp's EBNF, as vLLM and TensorRT-LLM take it), or llguidance's Lark where the text is Lark
    (vLLM's guidance backend takes Lark in the same field)."""
    guide = _text_guide("ebnf_grammar", value, field)
    if guide is not None and guide.guide is not None and _LARK_START.search(guide.guide) and "::=" not in guide.guide:
        return Guide("lark_grammar", guide.guide, field)
    return guide


def _structural_tag_guide(value: Any, field: str) -> Guide | None:
    if _unset(value):
        return None
    if isinstance(value, str):
        value = _json_value(value, field, "a structural tag's JSON text")
    return Guide("structural_tag", _structural_tag(value, field), field)


def _structural_tag(spec: Any, field: str) -> str:
    """vLLM's {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, as JSON text (the engine checks
    each structure when it compiles)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) \
            or not isinstance(spec.get("triggers"), list):
        raise bad_request(f"{field} must have \"structures\" (a list of {{\"begin\", \"schema\", \"end\"}}) and "
                          f"\"triggers\" (a list of strings), got {shown(spec)}", field)
    _known_keys(spec, ("type", "structures", "triggers"), field)
    return json.dumps({"structures": spec["structures"], "triggers": spec["triggers"]}, ensure_ascii=False)


# ---------------------------------------------------------------- whitespace and backend

def _whitespace_pattern(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, pattern) from guided_whitespace_pattern or structured_outputs.whitespace_pattern."""
    nested = body.get("structured_outputs")
    given = [(field, value) for field, value in (
        ("guided_whitespace_pattern", body.get("guided_whitespace_pattern")),
        ("structured_outputs.whitespace_pattern", nested.get("whitespace_pattern") if isinstance(nested, dict)
         else None)) if not _unset(value)]
    for field, value in given:
        if not isinstance(value, str):
            raise bad_request(f"{field} must be a string (a regex), got {shown(value)}", field)
    if len(given) > 1:
        raise bad_request("guided_whitespace_pattern and structured_outputs.whitespace_pattern are both given: send "
                          "one", given[1][0])
    return (given[0][0], str(given[0][1])) if given else None


def _with_whitespace(guide: Guide | None, pattern: tuple[str, str] | None) -> Guide | None:
    """A JSON guide whose whitespace follows the pattern (the schema's "x-guidance", llguidance's option)."""
    if pattern is None:
        return guide
    field, value = pattern
    if guide is None or guide.guide_type not in ("json", "json_schema"):
        raise bad_request(f"{field} applies to a JSON guide only (response_format json_object or json_schema, "
                          "guided_json, json_schema)", field)
    schema = json.loads(guide.guide) if guide.guide is not None else {"type": "object"}
    options = schema.get("x-guidance")
    schema["x-guidance"] = (options if isinstance(options, dict) else {}) | {"whitespace_pattern": value}
    return Guide("json_schema", json.dumps(schema, ensure_ascii=False), guide.field)


def _check_backend(value: Any) -> None:
    if _unset(value) or value in BACKENDS:
        return
    raise bad_request(f"guided_decoding_backend={shown(value)} is not supported: one of {', '.join(BACKENDS)} "
                      "(each is served by llguidance here)", "guided_decoding_backend", "unsupported_parameter")


# ---------------------------------------------------------------- helpers

def _unset(value: Any) -> bool:
    """null or empty: what routers re-send for a field they do not use."""
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def _known_keys(spec: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise bad_request(f"{where}: unrecognized key(s) {', '.join(unknown)}; it takes {', '.join(known)}",
                          f"{where}.{unknown[0]}")


def _schema(value: Any, field: str, text_ok: bool) -> str:
    """A JSON schema (an object; its JSON text too where text_ok) as the guide's JSON text."""
    if isinstance(value, str) and text_ok:
        value = _json_value(value, field, "a JSON schema's JSON text")
    if not isinstance(value, dict):
        raise bad_request(f"{field} must be a JSON schema (an object), got {shown(value)}", field)
    return json.dumps(value, ensure_ascii=False)


def _json_value(text: str, field: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{field} must be {what}: {exc}", field) from None
    except RecursionError:  # JSON text nested past the interpreter's stack
        raise bad_request(f"{field} must be {what}: it is nested too deeply", field) from None
