"""What a guided request's output must match (docs/structured-outputs.md): the guide types, their
bounds, and the llguidance grammar each one becomes.

The types are tensorrtllm_backend's `guided_decoding_guide_type` values, plus the ones vLLM and SGLang
take (`choice`, `lark_grammar`, `structural_tag`). Checking a guide's form is pure and cheap
(SamplingParams calls it); turning it into a grammar imports llguidance, which only a guided request
pays for (engine/guided.py compiles it, off the step loop).
"""

from __future__ import annotations

import json
import re
from types import MappingProxyType
from typing import Any, Mapping

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
JSON_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
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


def grammar_of(guide_type: str, guide: str | None, guide_after: str | None = None,
               marker_tokens: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar (its JSON form) of a checked guide; raise FieldError('guide') for a guide
    whose text is not of its type's form. Whether the grammar itself is valid is found when it compiles.

    marker_tokens: the vocabulary's added tokens (text -> id). llguidance matches an added token only as
    itself, never as its text, so a Lark literal equal to one (`"<tool_call>"`, `"</think>"`) also takes the
    token: Qwen and Hermes write those markers as one token each."""
    try:
        grammar = _as_json(_grammar_of(guide_type, guide))
    except RecursionError:
        raise FieldError("guide", "is nested too deeply") from None
    markers = marker_tokens or {}
    if guide_after is not None:
        grammar = _after(grammar, guide_after, markers.get(guide_after))
    return with_marker_tokens(grammar, markers)


def _grammar_of(guide_type: str, guide: str | None) -> str:
    from llguidance import LLMatcher

    if guide_type in ("json", "json_schema"):
        text = ANY_OBJECT_SCHEMA if guide_type == "json" else guide or ""
        schema = closed_objects(_json_object(text, "a JSON schema (an object)"))
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_DEFAULTS))  # type: ignore[arg-type]
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
    return grammar


# Where a schema keyword holds subschemas: one (a schema), a list of them, or a mapping of names to them.
# Not into not / if / then / else / contains / propertyNames (closing an object there changes what they mean).
_ONE = ("items", "additionalItems", "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that already say what properties beyond `properties` may be.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of schema in which an object that lists its `properties` and says nothing of others takes no
    others (additionalProperties false). JSON Schema allows any unlisted key there, and a small model given
    that freedom writes keys the application never declared (a tool's arguments with extra keys fail the
    call); xgrammar's default strict mode, which vLLM, SGLang and TensorRT-LLM use, closes them the same way.
    A schema that wants open objects says so (additionalProperties true or a schema). A schema that uses
    allOf anywhere is left as it is: its parts each list some of one object's properties, and closing
    each would make the whole unsatisfiable."""
    if _uses_all_of(schema):
        return schema
    return _closed(schema)


def _uses_all_of(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "allOf" in schema or any(_uses_all_of(v) for v in schema.values())
    return isinstance(schema, list) and any(_uses_all_of(v) for v in schema)


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
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
    return str(StructTag.to_grammar(tags, assume_special=False))  # Lark, or the JSON form with side grammars


def _as_json(grammar: str) -> str:
    """llguidance's grammar_from_lark gives Lark text, its other builders the JSON form: always the JSON form."""
    if grammar.lstrip().startswith("{"):
        return grammar
    return json.dumps({"grammars": [{"lark_grammar": grammar}]})


def _after(grammar: str, marker: str, marker_id: int | None) -> str:
    """grammar held only after `marker` (a reasoning model's end of thinking): any text up to and including
    its first occurrence, then the grammar, which becomes a side grammar the outer one calls (its own side
    grammars keep their names: it refers to them by name). Where the marker is one token of the vocabulary,
    the token ends the reasoning as the spelled text does."""
    inner = json.loads(grammar)["grammars"]
    inner[0]["name"] = "guided"
    spelled = "REASONING_TEXT " + json.dumps(marker)
    if marker_id is None:
        rules = "reasoning[lazy]: " + spelled
    else:  # a special token cannot sit in a lazy rule: the token's way is an ordinary one
        rules = f"reasoning: REASONING_TEXT <[{marker_id}]> | spelled\nspelled[lazy]: {spelled}"
    outer = f"%llguidance {{}}\nstart: reasoning @guided\n{rules}\nREASONING_TEXT: /(.|\\n)*/\n"
    return json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": outer}, *inner]})


# A Lark string literal, and a line that starts a definition: its name and attributes ("[lazy]").
_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_DEFINITION = re.compile(r"^\s*([A-Za-z_][A-Za-z_0-9]*)\s*(\[[^\]]*\])?\s*:")


def with_marker_tokens(grammar: str, markers: Mapping[str, int]) -> str:
    """The grammar with each Lark literal that is exactly an added token's text also taking that token:
    `"<tool_call>"` becomes `(<[id]> | "<tool_call>")`, in rules only (a token cannot sit in a terminal or a
    lazy rule)."""
    if not markers:
        return grammar
    spec = json.loads(grammar)
    for g in spec["grammars"]:
        if isinstance(g.get("lark_grammar"), str) and g.get("name") != "reasoned":
            g["lark_grammar"] = "\n".join(_marked(line, markers, state) for state in [{"rule": True}]
                                           for line in g["lark_grammar"].split("\n"))
    return json.dumps(spec)


def _marked(line: str, markers: Mapping[str, int], state: dict[str, bool]) -> str:
    """One line of Lark, its literals marked where it belongs to a rule (state carries that over the
    continuation lines of a definition)."""
    head = _DEFINITION.match(line)
    if head is not None:
        name, attrs = head.group(1), head.group(2) or ""
        state["rule"] = name[0].islower() and "lazy" not in attrs
    if not state["rule"] or line.lstrip().startswith("%"):
        return line

    def mark(m: re.Match[str]) -> str:
        try:
            text = json.loads(m.group(0))
        except json.JSONDecodeError:
            return m.group(0)
        token = markers.get(text) if isinstance(text, str) else None
        return m.group(0) if token is None else f"(<[{token}]> | {m.group(0)})"

    start = head.end() if head is not None else 0
    end = line.find("%json", start)  # an inline JSON schema's strings are JSON, not Lark literals
    end = len(line) if end < 0 else end
    return line[:start] + _LITERAL.sub(mark, line[start:end]) + line[end:]
