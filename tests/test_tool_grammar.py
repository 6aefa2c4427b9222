"""Forced tool-call grammars (serve/openai/tool_grammar.py), compiled by llguidance against SmolLM2's real
tokenizer: a valid call in each family's format is accepted token by token and parses back to the same
call; arguments off their schema, a name not among the tools, and a second call where only one may be
are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trtprompt.error_codes import FieldError
from trtprompt.serve.openai.tool_grammar import tool_call_grammar, tool_specs
from trtprompt.serve.openai.tool_parsers import TOOL_PARSERS, parse_tool_calls

CHECKPOINT = Path(__file__).resolve().parents[1] / "build" / "smollm2"

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                       "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "unit"], "additionalProperties": False,
                       "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time"}},
]
WEATHER = {"city": "Paris", "unit": "celsius", "days": 3}


class Tok:
    """SmolLM2's tokenizer as transformers and llguidance see it (built once per module)."""

    def __init__(self) -> None:
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        # The fast tokenizer AutoTokenizer would pick, loaded without importing torch.
        self.hf = PreTrainedTokenizerFast.from_pretrained(str(CHECKPOINT), local_files_only=True)
        self.ll = llguidance.hf.from_tokenizer(self.hf)

    def accepts(self, grammar: str, text: str) -> bool:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert matcher.get_error() == ""
        return bool(matcher.consume_tokens(self.hf.encode(text, add_special_tokens=False))) \
            and matcher.is_accepting()


@pytest.fixture(scope="module")
def tok() -> Tok:
    if not (CHECKPOINT / "tokenizer.json").exists():
        pytest.skip("build/smollm2 is not built (make smollm2)")
    return Tok()


def call_text(parser: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls written as each family writes them, in the grammar's compact JSON."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    objs = [json.dumps({"name": n, key: a}, ensure_ascii=False) for n, a in calls]
    if parser == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if parser == "llama3_json":
        return "; ".join(objs)
    return "[TOOL_CALLS][" + ", ".join(objs) + "]"


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_valid_calls_accepted_and_parsed_back(tok: Tok, parser: str) -> None:
    one = [("get_weather", WEATHER)]
    two = [("get_weather", {"city": "Zürich", "unit": "fahrenheit"}), ("get_time", {})]
    single, parallel = tool_call_grammar(parser, TOOLS, None, False), tool_call_grammar(parser, TOOLS, None, True)
    for calls in (one, two):
        text = call_text(parser, calls)
        assert tok.accepts(parallel, text), text
        assert tok.accepts(single, text) == (len(calls) == 1), text
        content, parsed = parse_tool_calls(parser, text)
        assert content is None
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        assert [c.arguments for c in parsed] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    assert tok.accepts(tool_call_grammar(parser, TOOLS, "get_time", False), call_text(parser, [("get_time", {})]))


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_off_schema_calls_refused(tok: Tok, parser: str) -> None:
    grammar = tool_call_grammar(parser, TOOLS, None, True)
    for name, args in [("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the $ref'd enum
                       ("get_weather", {"city": "Paris"}),  # a required property missing
                       ("get_weather", {"city": "Paris", "unit": "celsius", "days": 9}),  # over maximum
                       ("get_weather", {"city": 7, "unit": "celsius"}),  # wrong type
                       ("get_weather", {"city": "Paris", "unit": "celsius", "wind": 1}),  # not allowed
                       ("get_news", {})]:  # not a tool
        assert not tok.accepts(grammar, call_text(parser, [(name, args)])), (name, args)
    named = tool_call_grammar(parser, TOOLS, "get_time", True)
    assert not tok.accepts(named, call_text(parser, [("get_weather", WEATHER)]))
    loose = call_text(parser, [("get_weather", WEATHER)]).replace('": ', '":')  # not the compact form
    assert not tok.accepts(grammar, loose)


def test_grammar_form() -> None:
    hermes = tool_call_grammar("hermes", TOOLS, "get_weather", False)
    assert hermes.startswith('start: call\ncall: "<tool_call>" "\\n" obj "\\n" "</tool_call>"\nobj: %json {')
    schema = json.loads(hermes.split("%json ", 1)[1])
    assert schema["x-guidance"] == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    assert schema["anyOf"] == [{"type": "object", "properties": {"name": {"const": "get_weather"},
                                                                 "arguments": {"$ref": "#/$defs/tool_0"}},
                                "required": ["name", "arguments"], "additionalProperties": False}]
    params = schema["$defs"]["tool_0"]
    assert "$schema" not in params
    assert params["properties"]["unit"] == {"$ref": "#/$defs/tool_0/$defs/Unit"}
    mistral = json.loads(tool_call_grammar("mistral", TOOLS, None, False).split("%json ", 1)[1])
    assert (mistral["type"], mistral["minItems"], mistral["maxItems"]) == ("array", 1, 1)
    assert [a["properties"]["name"] for a in mistral["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "get_time"}]
    assert mistral["$defs"]["tool_1"] == {"type": "object"}  # no parameters: any object
    assert "maxItems" not in json.loads(tool_call_grammar("mistral", TOOLS, None, True).split("%json ", 1)[1])


def test_bad_tools_name_their_field() -> None:
    cases = [([], "tools"), ([{"type": "retrieval"}], "tools[0]"),
             ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
             ([TOOLS[1], TOOLS[1]], "tools[1].function.name"),
             ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters")]
    for tools, field in cases:
        with pytest.raises(FieldError) as info:
            tool_specs(tools)
        assert info.value.field == field
    with pytest.raises(FieldError) as info:
        tool_call_grammar("hermes", TOOLS, "get_news", False)
    assert info.value.field == "tool_choice"
    assert "get_weather, get_time" in str(info.value)
    with pytest.raises(ValueError, match="tool call parser must be one of"):
        tool_call_grammar("pythonic", TOOLS, None, False)
