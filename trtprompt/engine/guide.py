"""What a guided request's output must match (docs/structured-outputs.md): the guide types, their
bounds, and the llguidance grammar each one becomes.

The types are tensorrtllm_backend's `guided_decoding_guide_type` values, plus the ones vLLM and SGLang
take (`choice`, `lark_grammar`, `structural_tag`). Checking a guide's form is pure and cheap
(SamplingParams calls it); turning it into a grammar imports llguidance, which only a guided request
pays for (engine/guided.py compiles it, off the step loop).
"""

from __future__ import annotations

import json
from typing import Any

from trtprompt.error_codes import FieldError

# json: any JSON object (OpenAI's json_object; the guide is unset). json_schema: a JSON schema (the inner
# schema, not OpenAI's {"name", "schema", "strict"} wrapper). regex: the whole output matches it. choice: a
# JSON array of strings, the output is one of them. ebnf_grammar: GBNF (llama.cpp's, what TensorRT-LLM and
# vLLM take as EBNF). lark_grammar: llguidance's Lark dialect. structural_tag: vLLM's / xgrammar's
# {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text, with each structure's body
# held to its schema once its trigger appears.
GUIDE_TYPES = ("json", "json_schema", "regex", "choice", "ebnf_grammar", "lark_grammar", "structural_tag")
# A guide's text beyond this is refused before anything compiles (a schema of this size is already
# several thousand rules; what applications send is a few KiB).
MAX_GUIDE_BYTES = 256 * 1024
# How JSON is written unless the schema's own "x-guidance" says otherwise: compact, no free whitespace.
# A model left free to add whitespace can fill max_tokens with it (vLLM and xgrammar default the same).
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# What `json` (any JSON object) compiles as.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


def check_guide(guide_type: str | None, guide: str | None, guide_after: str | None) -> None:
    """Raise FieldError naming the field when a guide's form is wrong (its grammar is checked when it compiles)."""
    if guide_type is None:
        if guide is not None or guide_after is not None:
            raise FieldError("guide_type", "must be set when a guide is given")
        return
    if guide_type not in GUIDE_TYPES:
        raise FieldError("guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {guide_type!r}")
    if guide_type != "json" and (not isinstance(guide, str) or not guide):
        raise FieldError("guide", f"must be a non-empty string for guide_type {guide_type!r}")
    if guide is not None and len(guide.encode()) > MAX_GUIDE_BYTES:
        raise FieldError("guide", f"is {len(guide.encode())} bytes, more than the {MAX_GUIDE_BYTES} a guide may be "
                                  "(MAX_GUIDE_BYTES)")
    if guide_after is not None and (not isinstance(guide_after, str) or not guide_after):
        raise FieldError("guide_after", "must be a non-empty string or unset")


def grammar_of(guide_type: str, guide: str | None, guide_after: str | None = None) -> str:
    """The llguidance grammar (its JSON form) of a checked guide; raise FieldError('guide') for a guide
    whose text is not of its type's form. Whether the grammar itself is valid is found when it compiles."""
    from llguidance import LLMatcher

    if guide_type in ("json", "json_schema"):
        text = ANY_OBJECT_SCHEMA if guide_type == "json" else guide or ""
        schema = closed_objects(_json_object(text, "a JSON schema (an object)"))
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    elif guide_type == "regex":
        grammar = LLMatcher.grammar_from_regex(guide or "")
    elif guide_type == "choice":
        grammar = LLMatcher.grammar_from_lark(_choice_lark(guide or ""))
    elif guide_type == "ebnf_grammar":
        grammar = LLMatcher.grammar_from_lark(_gbnf_lark(guide or ""))
    elif guide_type == "lark_grammar":
        grammar = LLMatcher.grammar_from_lark(guide or "")
    else:
        grammar = _structural_tag_grammar(guide or "")
    return grammar if guide_after is None else _after(grammar, guide_after)


# Where a schema keyword holds subschemas: one (a schema), a list of them, or a mapping of names to them.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that already say what properties beyond `properties` may be.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of schema in which an object that lists its `properties` and says nothing of others takes no
    others (additionalProperties false). JSON Schema allows any unlisted key there, and a small model given
    that freedom writes keys the application never declared (a tool's arguments with extra keys fail the
    call); xgrammar's default strict mode, which vLLM, SGLang and TensorRT-LLM use, closes them the same way.
    A schema that wants open objects says so (additionalProperties true or a schema)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError("guide", f"must be {what}: {exc}") from None
    if not isinstance(value, dict):
        raise FieldError("guide", f"must be {what}, got {type(value).__name__}")
    return value


def _choice_lark(text: str) -> str:
    """`start: "a" | "b"`: the output is exactly one of the strings."""
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError("guide", f"must be a JSON array of strings for guide_type 'choice': {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise FieldError("guide", "must be a non-empty JSON array of non-empty strings for guide_type 'choice'")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _gbnf_lark(text: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(text))
    except Exception as exc:  # noqa: BLE001 - the converter raises what its parser meets; all of it is bad input
        raise FieldError("guide", f"is not a valid GBNF grammar: {exc}") from None


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag as llguidance's StructTag grammar: free text; each structure's begin (which
    starts with one of the triggers) is followed by JSON of its schema and its end."""
    from llguidance import StructTag

    spec = _json_object(text, "a structural tag: {\"structures\": [...], \"triggers\": [...]}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise FieldError("guide", "a structural tag needs non-empty \"structures\" and \"triggers\" lists")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or not isinstance(s.get("schema"), dict):
            raise FieldError("guide", f"structures[{i}] must have a string begin and end and an object schema")
        trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise FieldError("guide", f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
    # Triggers are matched as text: a template's <...> tag is text in most vocabularies.
    return _as_grammar(StructTag.to_grammar(tags, assume_special=False))


def _as_grammar(lark_or_json: str) -> str:
    """StructTag gives Lark, or the JSON form when it needs side grammars: either as a grammar."""
    from llguidance import LLMatcher

    return lark_or_json if lark_or_json.lstrip().startswith("{") else LLMatcher.grammar_from_lark(lark_or_json)


def _after(grammar: str, marker: str) -> str:
    """grammar held only after `marker` (a reasoning model's end of thinking): any text up to and including
    its first occurrence, then the grammar. The grammar becomes a side grammar the outer one calls (its
    own side grammars keep their names: it refers to them by name)."""
    inner = json.loads(grammar)["grammars"]
    inner[0]["name"] = "guided"
    outer = ("%llguidance {}\nstart: reasoning @guided\nreasoning[lazy]: REASONING_TEXT "
             + json.dumps(marker) + "\nREASONING_TEXT: /(.|\\n)*/\n")
    return json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": outer}, *inner]})
