"""Structured outputs on the OpenAI front end (docs/structured-outputs.md, "OpenAI front end").

Parsing (no server): each API's fields map to the one guide the engine takes (OpenAI's json_schema as
its INNER schema), malformed values and two guides are 400s naming the fields, the engine's errors about
"guide" are renamed to the client's field, and the Triton path sends tensorrtllm_backend's two inputs (a
choice list as a regex) or refuses by name what they cannot say. Against the real server (the tiny
engine, fused layout, greedy): the official `openai` client's `chat.completions.parse` returns a parsed
object, and each guide's output is in its language; invalid guides, a guide too large and two guides
are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Any

import pydantic
import pytest
from serve_fixtures import Served
from serve_fixtures import openai_client as client
from serve_fixtures import openai_model as model
from serve_fixtures import openai_post as post

from trtprompt.engine.guide import MAX_GUIDE_BYTES
from trtprompt.serve.openai.errors import APIError, bad_request
from trtprompt.serve.openai.guided import Guide, choice_regex, client_error, parse_guide
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.openai.to_triton import EnsembleInputs, _guide_inputs

LIMITS = ModelLimits("tiny", 2048, vocab_size=256)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
SCHEMA_TEXT = json.dumps(SCHEMA)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]} | extra


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello"} | extra


def refused(kind: str, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, body, LIMITS)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- mapping, without a server

WRAPPED = {"type": "json_schema", "json_schema": {"name": "N", "schema": SCHEMA, "strict": True,
                                                  "description": "a number"}}


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Guide("json", None, "response_format")),
    ({"response_format": WRAPPED}, Guide("json_schema", SCHEMA_TEXT, "response_format.json_schema.schema")),
    ({"guided_json": SCHEMA}, Guide("json_schema", SCHEMA_TEXT, "guided_json")),
    ({"guided_json": SCHEMA_TEXT}, Guide("json_schema", SCHEMA_TEXT, "guided_json")),
    ({"guided_regex": "[a-z]+"}, Guide("regex", "[a-z]+", "guided_regex")),
    ({"guided_choice": ["yes", "no"]}, Guide("choice", '["yes", "no"]', "guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, Guide("ebnf_grammar", 'root ::= "a"', "guided_grammar")),
    ({"guided_grammar": 'start: "a" | "b"\n'}, Guide("lark_grammar", 'start: "a" | "b"\n', "guided_grammar")),
    ({"guided_regex": "x", "guided_decoding_backend": "xgrammar"}, Guide("regex", "x", "guided_regex")),
    ({"structured_outputs": {"json": SCHEMA}}, Guide("json_schema", SCHEMA_TEXT, "structured_outputs.json")),
    ({"structured_outputs": {"regex": "x"}}, Guide("regex", "x", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a"]}}, Guide("choice", '["a"]', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     Guide("ebnf_grammar", 'root ::= "a"', "structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}}, Guide("json", None, "structured_outputs.json_object")),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"regex": r"\d+"}, Guide("regex", r"\d+", "regex")),
    ({"ebnf": 'root ::= "a"'}, Guide("ebnf_grammar", 'root ::= "a"', "ebnf")),
    ({"json_schema": SCHEMA_TEXT}, Guide("json_schema", SCHEMA_TEXT, "json_schema")),
    # what routers re-send for a field they do not use
    ({"guided_regex": None, "guided_choice": [], "regex": "", "structured_outputs": {},
      "guided_decoding_backend": None}, None),
])
def test_each_field_maps_to_its_guide(body: dict[str, Any], want: Guide | None) -> None:
    assert parse_guide(body) == want


def test_a_structural_tag_keeps_its_structures_and_triggers() -> None:
    tag = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f"]}
    want = json.dumps(tag)
    assert parse_guide({"response_format": {"type": "structural_tag"} | tag}) == \
        Guide("structural_tag", want, "response_format")
    assert parse_guide({"structural_tag": json.dumps(tag)}) == Guide("structural_tag", want, "structural_tag")
    assert parse_guide({"structured_outputs": {"structural_tag": tag}}) == \
        Guide("structural_tag", want, "structured_outputs.structural_tag")


def test_a_whitespace_pattern_goes_into_the_schema() -> None:
    guide = parse_guide({"guided_json": SCHEMA | {"x-guidance": {"lenient": True}},
                         "guided_whitespace_pattern": "[ ]?"})
    assert guide is not None and (guide.guide_type, guide.field) == ("json_schema", "guided_json")
    assert json.loads(guide.guide or "")["x-guidance"] == {"lenient": True, "whitespace_pattern": "[ ]?"}
    any_object = parse_guide({"structured_outputs": {"json_object": True, "whitespace_pattern": " *"}})
    assert any_object == Guide("json_schema", '{"type": "object", "x-guidance": {"whitespace_pattern": " *"}}',
                               "structured_outputs.json_object")


def test_the_guide_reaches_the_sampling_params_on_both_endpoints() -> None:
    for kind, body in (("chat", chat(response_format=WRAPPED)), ("completion", completion(response_format=WRAPPED))):
        gen = parse_request(kind, body, LIMITS)
        assert (gen.sampling.guide_type, gen.sampling.guide) == ("json_schema", SCHEMA_TEXT)
        assert gen.guide_field == "response_format.json_schema.schema"
    plain = parse_request("chat", chat(), LIMITS)
    assert (plain.sampling.guide_type, plain.guide_field) == (None, None)


@pytest.mark.parametrize("body, param, text", [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "response_format.json_schema.schema is required"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}),
     "response_format.json_schema.schema", "must be a JSON schema (an object)"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}),
     "response_format.json_schema.name", "must be a string"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}),
     "response_format.json_schema.strict", "must be true or false"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "extra": 1}}),
     "response_format.json_schema.extra", "unrecognized key(s) extra"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "must be an object"),
    (chat(response_format={"type": "xml"}), "response_format", "type is one of text, json_object"),
    (chat(response_format="json"), "response_format", "must be an object"),
    (completion(guided_json="{not json"), "guided_json", "guided_json must be a JSON schema's JSON text"),
    (completion(guided_json=[1]), "guided_json", "must be a JSON schema (an object)"),
    (completion(guided_regex=5), "guided_regex", "guided_regex must be a string"),
    (completion(guided_choice="yes"), "guided_choice", "must be a list of non-empty strings"),
    (completion(guided_choice=["a", ""]), "guided_choice", "must be a list of non-empty strings"),
    (completion(guided_decoding_backend="outlines"), "guided_decoding_backend", "served by llguidance"),
    (completion(guided_regex="x", guided_whitespace_pattern=" "), "guided_whitespace_pattern",
     "applies to a JSON guide only"),
    (completion(structured_outputs={"jsn": SCHEMA}), "structured_outputs.jsn", "unrecognized key(s) jsn"),
    (completion(structured_outputs={"json_object": 1}), "structured_outputs.json_object", "true or false"),
    (completion(structural_tag={"structures": []}), "structural_tag", "must have \"structures\""),
    (completion(guided_regex="x", guided_choice=["a"]), "guided_choice",
     "guided_regex and guided_choice both ask for a guide"),
    (chat(response_format={"type": "json_object"}, regex="x"), "regex", "response_format and regex both"),
    (completion(structured_outputs={"regex": "x", "grammar": 'root ::= "a"'}), "structured_outputs.grammar",
     "structured_outputs.regex and structured_outputs.grammar both"),
    (completion(guided_regex="x" * (MAX_GUIDE_BYTES + 1)), "guided_regex",
     f"guided_regex is {MAX_GUIDE_BYTES + 1} bytes, more than the {MAX_GUIDE_BYTES}"),
    (completion(guided_regex="x", use_beam_search=True, n=2, temperature=0), "guided_regex",
     "guided_regex is not supported with beam search"),
])
def test_bad_guides_are_400_naming_the_field(body: dict[str, Any], param: str, text: str) -> None:
    kind = "chat" if "messages" in body else "completion"
    err = refused(kind, body)
    assert err.param == param and text in err.message, err.message


def test_engine_errors_about_the_guide_name_the_clients_field() -> None:
    engine = bad_request("guide must be a JSON schema (an object): Invalid type: foo", "guide")
    named = client_error(engine, "response_format.json_schema.schema")
    assert (named.status, named.param, named.message) == (
        400, "response_format.json_schema.schema",
        "response_format.json_schema.schema must be a JSON schema (an object): Invalid type: foo")
    untagged = bad_request("guide_type is not supported with beam search")  # through Triton: no param
    assert client_error(untagged, "regex").message == "regex is not supported with beam search"
    triton = bad_request("input 'guided_decoding_guide' is not a valid GBNF grammar: x", "n")  # from_triton's param
    assert (client_error(triton, "ebnf").param, client_error(triton, "ebnf").message) == (
        "ebnf", "ebnf is not a valid GBNF grammar: x")
    other = bad_request("top_k must be >= 0", "top_k")
    assert client_error(other, "guided_regex") is other and client_error(engine, None) is engine


@pytest.mark.parametrize("choices", [["yes", "no"], ["a.b", "(x)", "1+1=2", "[z]", "{}", "a|b", "^$", "\\", "?*"]])
def test_a_choice_list_as_a_regex_matches_each_choice_only(choices: list[str]) -> None:
    from llguidance import LLMatcher

    from trtprompt.engine.guide import grammar_of

    pattern = choice_regex(choices)
    assert LLMatcher.validate_grammar(grammar_of("regex", pattern)) == ""  # llguidance's (Rust) regex takes it
    assert all(re.fullmatch(pattern, c) for c in choices)
    assert not any(re.fullmatch(pattern, c + "x") or re.fullmatch(pattern, "x" + c) for c in choices)


def _triton_inputs(body: dict[str, Any], declared: frozenset[str]) -> dict[str, str]:
    return _guide_inputs(parse_request("completion", completion(**body), LIMITS), declared, "ensemble")


GUIDED_ENSEMBLE = frozenset({"text_input", "max_tokens", "guided_decoding_guide_type", "guided_decoding_guide"})


def test_through_triton_the_guide_is_tensorrtllm_backends_two_inputs() -> None:
    assert _triton_inputs({"guided_json": SCHEMA}, GUIDED_ENSEMBLE) == {
        "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": SCHEMA_TEXT}
    assert _triton_inputs({"response_format": {"type": "json_object"}}, GUIDED_ENSEMBLE) == {
        "guided_decoding_guide_type": "json"}
    assert _triton_inputs({"guided_choice": ["a.b", "c"]}, GUIDED_ENSEMBLE) == {
        "guided_decoding_guide_type": "regex", "guided_decoding_guide": r"(a\.b|c)"}
    assert _triton_inputs({"ebnf": 'root ::= "a"'}, GUIDED_ENSEMBLE) == {
        "guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'root ::= "a"'}
    assert _triton_inputs({}, frozenset()) == {}
    assert EnsembleInputs([], "guided_regex").guide_field == "guided_regex"


@pytest.mark.parametrize("body, declared, param, text", [
    ({"guided_regex": "x"}, frozenset({"text_input"}), "guided_regex", "no 'guided_decoding_guide_type' input"),
    ({"guided_grammar": 'start: "a"'}, GUIDED_ENSEMBLE, "guided_grammar", "the engine path"),
    ({"structural_tag": {"structures": [], "triggers": []}}, GUIDED_ENSEMBLE, "structural_tag", "the engine path"),
])
def test_through_triton_what_the_inputs_cannot_say_is_refused(body: dict[str, Any], declared: frozenset[str],
                                                              param: str, text: str) -> None:
    with pytest.raises(APIError) as info:
        _triton_inputs(body, declared)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "unsupported_parameter")
    assert text in info.value.message


# ---------------------------------------------------------------- against the real server

class Colour(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Item(pydantic.BaseModel):
    count: int = pydantic.Field(ge=0, le=99)  # bounded: the tiny model's greedy digits end
    name: str = pydantic.Field(max_length=6)
    colour: Colour


# As `parse` sends it (strict): no properties beyond the model's, which the tiny model would go on writing.
ITEM_SCHEMA = Item.model_json_schema() | {"additionalProperties": False}


def complete(served: Served, max_tokens: int = 32, **guide: Any) -> tuple[str, str]:
    """A greedy completion's (text, finish_reason) under the guide (vLLM's and SGLang's fields)."""
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": "The answer:",
                                                    "max_tokens": max_tokens, "temperature": 0} | guide)
    assert status == 200, body
    choice = body["choices"][0]
    return choice["text"], choice["finish_reason"]


def test_chat_completions_parse_returns_the_parsed_object(served: Served) -> None:
    done = client(served).chat.completions.parse(
        model=model(served), messages=[{"role": "user", "content": "An item, please."}], response_format=Item,
        max_tokens=200, temperature=0)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Item)
    assert Item.model_validate_json(message.content or "") == message.parsed


def test_json_object_output_is_a_json_object(served: Served) -> None:
    """The tiny model's greedy keys never end, so "}" is favoured: it cannot come first (the grammar wants "{"),
    and then ends the object and the request."""
    _, tokens = post(served, "/tokenize", {"model": model(served), "prompt": "}"})
    done = client(served).chat.completions.create(
        model=model(served), messages=[{"role": "user", "content": "JSON please."}],
        response_format={"type": "json_object"}, max_tokens=20, temperature=0,
        logit_bias={str(tokens["tokens"][-1]): 100})
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == ("{}", "stop")
    assert json.loads(done.choices[0].message.content or "") == {}


@pytest.mark.parametrize("guide, max_tokens, check", [
    ({"guided_regex": "[a-z]{1,4}-[0-9]{2}"}, 16, lambda t: re.fullmatch("[a-z]{1,4}-[0-9]{2}", t)),
    ({"regex": "(yes|no), [0-9]"}, 16, lambda t: re.fullmatch("(yes|no), [0-9]", t)),
    ({"guided_choice": ["alpha", "beta gamma", "delta"]}, 16, lambda t: t in ("alpha", "beta gamma", "delta")),
    ({"guided_grammar": 'root ::= "n=" [0-9] [0-9]? ";"'}, 16, lambda t: re.fullmatch("n=[0-9][0-9]?;", t)),
    ({"structured_outputs": {"json": ITEM_SCHEMA}}, 200, lambda t: Item.model_validate_json(t)),
])
def test_each_guide_holds_the_output_to_its_language(served: Served, guide: dict[str, Any], max_tokens: int,
                                                     check: Any) -> None:
    text, finish = complete(served, max_tokens, **guide)
    assert finish == "stop" and check(text), text


def test_a_streamed_json_schema_answer_is_the_whole_answer(served: Served) -> None:
    args: dict[str, Any] = dict(model=model(served), messages=[{"role": "user", "content": "Another item."}],
                                max_tokens=200, temperature=0,
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "Item", "schema": ITEM_SCHEMA}})
    whole = client(served).chat.completions.create(**args).choices[0].message.content
    chunks = list(client(served).chat.completions.create(stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    Item.model_validate_json(whole or "")


@pytest.mark.parametrize("guide, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "["}, "guided_regex"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar"),
    ({"guided_regex": "a" * (MAX_GUIDE_BYTES + 1)}, "guided_regex"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_json and guided_regex"),
])
def test_bad_guides_are_400_from_the_server(served: Served, guide: dict[str, Any], param: str) -> None:
    status, body = post(served, "/v1/chat/completions", {"model": model(served), "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "Hi"}]} | guide)
    assert status == 400, body
    error = body["error"]
    assert param.endswith(error["param"]) and error["message"].startswith(param), error


def _through_triton(served: Served, body: dict[str, Any]) -> str:
    """The text the session server's `ensemble` answers body with, through the OpenAI front end's Triton path."""
    from trtprompt.serve.openai.to_triton import TritonEnsemble

    async def run() -> str:
        ensemble = TritonEnsemble(served.url, api_key="")
        try:
            gen = parse_request("completion", completion(max_tokens=16, temperature=0, **body), LIMITS)
            inputs = await ensemble.inputs_for(gen, gen.prompts[0])
            return "".join([piece.text async for piece in ensemble.generate(inputs)])
        finally:
            await ensemble.close()

    return asyncio.run(run())


def test_through_triton_the_guide_holds_and_its_errors_name_the_field(served: Served) -> None:
    assert _through_triton(served, {"guided_choice": ["alpha", "beta.gamma"]}) in ("alpha", "beta.gamma")
    assert re.fullmatch("[a-z]{2}-[0-9]", _through_triton(served, {"regex": "[a-z]{2}-[0-9]"}))
    with pytest.raises(APIError) as info:
        _through_triton(served, {"guided_regex": "["})
    assert (info.value.status, info.value.param) == (400, "guided_regex")
    assert info.value.message.startswith("guided_regex "), info.value.message
