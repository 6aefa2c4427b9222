"""The grammar that holds a forced tool call (`tool_choice` "required" or a named function) to the tools'
schemas, in the format a tool-call parser reads (docs/structured-outputs.md, "Tool-call and reasoning
parsers"): llguidance's Lark, the engine's guide_type "lark_grammar".

The language is one call (or, with parallel calls, one or more) in the family's own format: hermes
`<tool_call>\\n{...}\\n</tool_call>` (calls on separate lines), llama3_json `{"name": ..., "parameters": ...}`
(calls separated by "; "), mistral `[TOOL_CALLS][{...}]` (one array). Each call object is a JSON schema:
"name" the const of one tool, its arguments that tool's `parameters`, anyOf across the tools. The JSON is
written compactly with ", " and ": " (engine/guide.py JSON_DEFAULTS), the form parse_tool_calls gives back.

Markers are matched as text (`<|python_tag|>` is left out: the bare JSON form is what llama3_json
templates ask for, and a grammar must compile for vocabularies without the special token).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from trtprompt.engine.guide import JSON_DEFAULTS, closed_objects
from trtprompt.error_codes import FieldError
from trtprompt.serve.openai.tool_parsers import check_parser

# Keywords that only mean something at a schema's root: kept out of a tool's parameters once they are nested.
_ROOT_ONLY = ("$schema", "$id", "x-guidance")


def tool_call_grammar(parser: str, tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool) -> str:
    """The Lark grammar of a forced call: any of `tools`, or exactly `name`; several when `parallel`."""
    check_parser(parser)
    specs = tool_specs(tools)
    if name is not None:
        if name not in specs:
            raise FieldError("tool_choice", f"names function {name!r}, which is not one of the tools "
                                            f"({', '.join(specs)})")
        specs = {name: specs[name]}
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    defs, call = _call_schema(specs, args_key)
    if parser == "mistral":
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return 'start: "[TOOL_CALLS]" calls\ncalls: %json ' + json.dumps(_rooted(array, defs))
    if parser == "hermes":
        # The markers as literals of their own: the engine lets each also be the vocabulary's one token
        # for it (engine/guide.py with_marker_tokens; Qwen and Hermes have <tool_call> as a token).
        head = 'call: "<tool_call>" "\\n" obj "\\n" "</tool_call>"\n'
        start = 'start: call ("\\n" call)*\n' if parallel else "start: call\n"
    else:
        head = "call: obj\n"
        start = 'start: call ("; " call)*\n' if parallel else "start: call\n"
    return start + head + "obj: %json " + json.dumps(_rooted(call, defs))


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each OpenAI tool's name and parameters schema ({"type": "object"} when absent), in order; FieldError
    naming the tool's field when one is not a function tool with a name."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise FieldError("tools", "must be a non-empty array of tools")
    specs: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" \
                or not isinstance(function, Mapping):
            raise FieldError(f"tools[{i}]", 'must be {"type": "function", "function": {...}}')
        fname = function.get("name")
        if not isinstance(fname, str) or not fname:
            raise FieldError(f"tools[{i}].function.name", "must be a non-empty string")
        if fname in specs:
            raise FieldError(f"tools[{i}].function.name", f"repeats {fname!r}: each tool needs its own name")
        params = function.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, Mapping):
            raise FieldError(f"tools[{i}].function.parameters", "must be a JSON schema object")
        specs[fname] = params
    return specs


def _call_schema(specs: Mapping[str, Mapping[str, Any]], args_key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """($defs, call schema): anyOf, one alternative a tool, {"name": const, args_key: a $ref to its
    parameters}. Each tool's parameters sit in $defs under their own key, so their own "#/..." references
    still resolve once moved."""
    alternatives = [{"type": "object",
                     "properties": {"name": {"const": tname}, args_key: {"$ref": f"#/$defs/tool_{i}"}},
                     "required": ["name", args_key], "additionalProperties": False}
                    for i, tname in enumerate(specs)]
    defs = {f"tool_{i}": _parameters(params, f"#/$defs/tool_{i}") for i, params in enumerate(specs.values())}
    return defs, {"anyOf": alternatives}


def _rooted(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The schema at the %json root, with the writing options and the tools' $defs, where the refs point."""
    # engine/guide.py's JSON_DEFAULTS: the separators parse_tool_calls writes arguments with, too.
    return {"x-guidance": dict(JSON_DEFAULTS), "$defs": defs, **schema}


def _parameters(params: Mapping[str, Any], base: str) -> Any:
    """A tool's parameters schema moved to `base`, less the keywords that only mean something at a root; its
    objects take no keys they do not list unless they say so (engine/guide.py closed_objects: a call with
    keys the tool never declared fails in the application)."""
    moved = closed_objects(_relocated(params, base))
    for key in _ROOT_ONLY:
        moved.pop(key, None)
    return moved


def _relocated(node: Any, base: str) -> Any:
    """A copy of a schema with each "#..." reference made to point under `base`."""
    if isinstance(node, Mapping):
        out = {k: _relocated(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_relocated(v, base) for v in node]
    return node
