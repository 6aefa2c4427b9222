"""Tool calls on the OpenAI front end (docs/structured-outputs.md, "Tool calls").

Without a server: `tools`, `tool_choice`, `parallel_tool_calls` and tool messages are checked with 400s
naming the field; required and named choices become the tool-call grammar the engine takes, auto none;
a guide beside tools is refused unless tool_choice is none; `auto` answers are parsed from scripted
outputs of each family (random-weight checkpoints cannot write them), whole and streamed alike; the
fallback renders tools, calls and results for templates without tool support, and a tool-aware template
gets them as transformers passes them.

Against the session server (the tiny engine, whose template has no tool support: the fallback, hermes):
the official `openai` client's required and named calls carry arguments valid against the tool's schema
(jsonschema), finish_reason "tool_calls", streamed deltas accumulated by the SDK equal the whole answer,
parallel_tool_calls false gives one call, a history of calls and results renders, an unknown tool is 400.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from serve_fixtures import Served
from serve_fixtures import openai_client as client
from serve_fixtures import openai_model as model
from serve_fixtures import openai_post as post

from trtprompt.prompt.budget import PromptError
from trtprompt.prompt.chat import encode_messages, parse_messages
from trtprompt.prompt.chat_tools import ChatRender, calls_text, knows_tools, template_inputs
from trtprompt.serve.openai.chat_answer import ChoiceStream, assembled
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.openai.parser_options import ServedParsers, served_parsers
from trtprompt.serve.openai.tool_grammar import tool_call_grammar
from trtprompt.serve.openai.tools import ChatPlan

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},  # bounded: a random-weight model ends the string in time
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": WEATHER_PARAMS}}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
HERMES = ModelLimits("tiny", 2048, vocab_size=256, parsers=ServedParsers("hermes", None))
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]


def chat(limits: ModelLimits = HERMES, **extra: Any) -> Any:
    return parse_request("chat", {"model": "tiny", "messages": USER} | extra, limits)


def refused(limits: ModelLimits = HERMES, **extra: Any) -> APIError:
    with pytest.raises(APIError) as info:
        chat(limits, **extra)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- request fields, without a server


def test_tool_choice_defaults_and_the_engine_guide_each_asks_for() -> None:
    auto = chat(tools=TOOLS)
    assert (auto.chat.tool_choice, auto.chat.parallel, auto.sampling.guide_type) == ("auto", True, None)
    assert chat().chat.tool_choice == "none" and chat(tool_choice="auto").chat.tool_choice == "none"  # no tools
    none = chat(tools=TOOLS, tool_choice="none")
    assert none.sampling.guide_type is None and not none.chat.parses_tools and none.chat.render.tools
    required = chat(tools=TOOLS, tool_choice="required")
    assert (required.sampling.guide_type, required.sampling.guide) == \
        ("lark_grammar", tool_call_grammar("hermes", TOOLS, None, True))
    assert required.guide_field == "tools" and required.sampling.guide_after is None
    single = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single.sampling.guide == tool_call_grammar("hermes", TOOLS, None, False)
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.chat.tool_choice, named.chat.tool_name) == ("function", "get_time")
    assert named.sampling.guide == tool_call_grammar("hermes", TOOLS, "get_time", False)


@pytest.mark.parametrize("extra, param, text", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice",
     "names the function 'get_wether', which is not among the tools (get_weather, get_time)"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "the request has no tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice \"required\" needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "tool_choice must be \"none\", \"auto\""),
    ({"tools": WEATHER}, "tools", "tools must be a list of function tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be a function tool"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "names the function 'get_weather' more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools",
     "tools[0].function.parameters must be a JSON schema"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set messages"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
])
def test_bad_tool_fields_are_400_naming_the_field(extra: dict[str, Any], param: str, text: str) -> None:
    err = refused(**extra)
    assert err.param == param and text in err.message, err.message


def test_a_guide_beside_tools_is_refused_unless_tool_choice_is_none() -> None:
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        err = refused(tools=TOOLS, tool_choice=choice, response_format={"type": "json_object"})
        assert (err.param, err.code) == ("tool_choice", "unsupported_parameter")
        assert "the guide would hold the whole answer to its own form" in err.message
    both = chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    assert both.sampling.guide_type == "json" and both.chat.render.tools


def test_a_server_that_parses_no_tool_calls_serves_tool_choice_none_only() -> None:
    off = ModelLimits("tiny", 2048, parsers=ServedParsers(None, None))
    err = refused(off, tools=TOOLS)
    assert (err.param, err.code) == ("tool_choice", "unsupported_parameter")
    assert "--tool-call-parser none" in err.message
    assert chat(off, tools=TOOLS, tool_choice="none").chat.render.tool_format == "hermes"


def test_tool_messages_are_carried_as_objects() -> None:
    gen = chat(messages=HISTORY, tools=TOOLS)
    assert gen.messages[1] == {"role": "assistant", "content": None, "tool_calls": HISTORY[1]["tool_calls"]}
    assert gen.messages[2] == {"role": "tool", "content": "22 degrees, sunny", "tool_call_id": "call_1"}
    as_object = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]}]
    assert chat(messages=as_object).messages[1]["tool_calls"][0]["function"]["arguments"] == '{"zone": "UTC"}'
    assert parse_messages(json.dumps(HISTORY)) == list(gen.messages)  # the Triton `messages` input's parse


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
     "messages[1].tool_calls[0].id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     "messages[1].tool_calls[0].function"),
    ({"role": "assistant", "content": None}, "messages[1].content"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[1].tool_call_id"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}}, "messages[1].function_call"),
])
def test_bad_tool_messages_are_400_naming_the_field(message: dict[str, Any], param: str) -> None:
    assert refused(messages=[*USER, message]).param == param


# ---------------------------------------------------------------- auto: scripted outputs of each family

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
SCRIPTED = {
    "hermes": (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
               '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', "Let me check."),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', None),
}
WANT_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]


def plan(parser: str, **fields: Any) -> ChatPlan:
    return ChatPlan(tuple(TOOLS), "auto", tool_parser=parser, **fields)


def streamed(plan_: ChatPlan, text: str, step: int) -> tuple[list[dict[str, Any]], bool]:
    stream = ChoiceStream(plan_)
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])] + stream.finish()
    return deltas, stream.called


def accumulated(deltas: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], reasoning) as the openai SDK accumulates a stream's deltas."""
    content: str | None = None
    reasoning: str | None = None
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        if "reasoning_content" in d:
            reasoning = (reasoning or "") + d["reasoning_content"]
        for call in d.get("tool_calls", []):
            slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            slot["name"] += call.get("function", {}).get("name") or ""
            slot["arguments"] += call.get("function", {}).get("arguments") or ""
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], reasoning


@pytest.mark.parametrize("parser", sorted(SCRIPTED))
def test_auto_parses_each_familys_calls_whole_and_streamed(parser: str) -> None:
    text, content = SCRIPTED[parser]
    answer = assembled(text, plan(parser))
    message = answer.message()
    assert message["content"] == content and answer.finish_reason("stop") == "tool_calls"
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == WANT_CALLS
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    assert "reasoning_content" not in message  # no reasoning parser: not a field of the answer
    for step in (1, 3, 1000):  # however the text is split into deltas
        deltas, called = streamed(plan(parser), text, step)
        assert called and accumulated(deltas) == (content, [(n, c["function"]["arguments"]) for (n, _), c
                                                            in zip(WANT_CALLS, message["tool_calls"])], None)
        starts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        assert [(s["index"], s["type"], s["function"]["arguments"]) for s in starts] == \
            [(0, "function", ""), (1, "function", "")]


def test_auto_answer_without_calls_is_content_and_none_never_parses() -> None:
    answer = assembled("Paris is sunny.", plan("hermes"))
    assert answer.message() == {"role": "assistant", "content": "Paris is sunny."}
    assert answer.finish_reason("stop") == "stop"
    text = SCRIPTED["hermes"][0]
    ignored = ChatPlan(tuple(TOOLS), "none", tool_parser="hermes")
    assert not ignored.changes_answer and assembled(text, ignored).message()["content"] == text


def test_a_forced_call_cut_short_is_length_with_no_content() -> None:
    """tool_choice required: the answer is calls only; max_tokens cutting the last call leaves no markup in
    content, and finish_reason stays "length" as OpenAI reports it (Instructor raises on it)."""
    text = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_weather\","
    forced = ChatPlan(tuple(TOOLS), "required", tool_parser="hermes")
    answer = assembled(text, forced)
    assert answer.message()["content"] is None and len(answer.message()["tool_calls"]) == 1
    assert answer.finish_reason("length") == "length" and answer.finish_reason("stop") == "tool_calls"
    deltas, called = streamed(forced, text, 3)
    content, calls, _ = accumulated(deltas)
    assert called and content is None and [name for name, _ in calls] == ["get_weather"]


def test_parallel_tool_calls_false_keeps_the_first_of_auto_calls() -> None:
    text, _ = SCRIPTED["hermes"]
    single = plan("hermes", parallel=False)
    calls = assembled(text, single).message()["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    deltas, called = streamed(single, text, 4)
    assert called and [name for name, _ in accumulated(deltas)[1]] == ["get_weather"]


def test_tool_calls_after_reasoning_are_parsed_from_the_answer_only() -> None:
    thinking = plan("hermes", reasoning_parser="qwen3")
    text = f"<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
    message = assembled(text, thinking).message()
    assert message["reasoning_content"] == "The user wants weather." and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    deltas, called = streamed(thinking, text, 2)
    content, calls, reasoning = accumulated(deltas)
    assert called and (content, reasoning) == (None, "The user wants weather.") and calls[0][0] == "get_weather"


# ---------------------------------------------------------------- rendering


def test_the_fallback_renders_tools_calls_and_results(served: Served) -> None:
    from trtprompt.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(served.engine_dir / "tokenizer")
    assert not knows_tools(tok.chat_template)
    text = tok.decode(encode_messages(tok, parse_messages(json.dumps(HISTORY)), ChatRender(tuple(TOOLS))),
                      skip_special_tokens=False)
    assert json.dumps(WEATHER) in text and "<tool_call></tool_call> block" in text  # the preamble
    assert f"<tool_call>\n{CALL}\n</tool_call>" in text  # the call, as the model would write it
    assert '<tool_response tool_call_id="call_1">\n22 degrees, sunny\n</tool_response>' in text
    for fmt, marker in (("llama3_json", '"parameters": {"city"'), ("mistral", "[TOOL_CALLS][{")):
        assert calls_text(fmt, HISTORY[1]["tool_calls"]).startswith(("{", "[TOOL_CALLS]")) and \
            marker in calls_text(fmt, HISTORY[1]["tool_calls"])


def test_smollm2s_template_gets_the_fallback() -> None:
    """SmolLM2's ChatML template renders any role but knows no tools: auto parsers hermes and none, the
    tools in its system turn (replacing its default system prompt), results as a user turn."""
    from test_real_model import REAL_CKPT

    from trtprompt.tokenizer import Tokenizer, read_chat_template

    if not (REAL_CKPT / "tokenizer.json").is_file():
        pytest.skip(f"the real model is not there ({REAL_CKPT}): run `make real-model`")
    template = read_chat_template(REAL_CKPT)
    assert not knows_tools(template) and served_parsers("auto", "auto", template) == ServedParsers("hermes", None)
    tok = Tokenizer.from_dir(REAL_CKPT)
    text = tok.decode(encode_messages(tok, parse_messages(json.dumps(HISTORY)), ChatRender((WEATHER,))),
                      skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou can call functions") and "SmolLM" not in text
    assert f"<|im_start|>assistant\n<tool_call>\n{CALL}\n</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response" in text and "<|im_start|>tool" not in text
    assert text.endswith("<|im_start|>assistant\n")


TOOL_TEMPLATE = (  # a tool-aware template of the Qwen kind, written for this test (NL: trim_blocks keeps it)
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ NL }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}({{ c.function.arguments.city }})"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ NL }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>{{ NL }}{{ NL }}</think>{{ NL }}{{ NL }}{% endif %}{% endif %}").replace("NL", "'\\n'")


def test_a_tool_aware_template_gets_tools_objects_and_template_kwargs() -> None:
    from trtprompt.tokenizer import render_chat_template

    assert knows_tools(TOOL_TEMPLATE)
    messages, kwargs = template_inputs(parse_messages(json.dumps(HISTORY)), TOOL_TEMPLATE,
                                       ChatRender(tuple(TOOLS), {"enable_thinking": False}))
    assert kwargs == {"enable_thinking": False, "tools": TOOLS}
    text = render_chat_template(TOOL_TEMPLATE, messages, **kwargs)
    assert text == ("TOOLS:get_weather;get_time;\n<user>What is the weather in Paris?\n"
                    "<assistant><tool_call>get_weather(Paris)</tool_call>\n<tool>22 degrees, sunny[call_1]\n"
                    "<assistant><think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="template_kwargs may not set tools"):
        ChatRender((), {"tools": []})


def test_a_template_that_fails_on_a_kwarg_is_an_input_error(served: Served) -> None:
    from trtprompt.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(served.engine_dir / "tokenizer")
    broken = Tokenizer(**{**vars(tok), "chat_template": "{{ messages[0].content + depth }}"})
    with pytest.raises(PromptError, match="chat_template_kwargs"):
        encode_messages(broken, USER, ChatRender((), {"depth": 3}))


def test_auto_parsers_come_from_the_template(served: Served) -> None:
    from trtprompt.tokenizer import read_chat_template

    demo = read_chat_template(served.engine_dir / "tokenizer")
    assert served_parsers("auto", "auto", demo) == ServedParsers("hermes", None)  # the fallback's format
    assert served_parsers("none", "none", demo) == ServedParsers(None, None)
    assert served_parsers("mistral", "qwen3", demo) == ServedParsers("mistral", "qwen3")
    hermes_like = "{% if tools %}<tool_call>{% endif %}<think></think>{{ enable_thinking }}"
    assert served_parsers("auto", "auto", hermes_like) == ServedParsers("hermes", "qwen3")
    with pytest.raises(ValueError, match="--tool-call-parser must be one of auto, hermes"):
        served_parsers("json", "auto", demo)


def test_serve_hands_the_parser_options_to_the_front_end() -> None:
    from pathlib import Path

    from trtprompt.serve.launch.frontend import frontend_command
    from trtprompt.serve.launch.options import OpenAIOptions
    from trtprompt.serve.openai.server import parse_args

    cmd = frontend_command(OpenAIOptions(8003, None, None, "mistral", "none"), Path("e"), "h:1", "h", None)
    args = parse_args(cmd[cmd.index("e"):])
    assert (args.tool_call_parser, args.reasoning_parser) == ("mistral", "none")
    assert (parse_args(["e"]).tool_call_parser, parse_args(["e"]).reasoning_parser) == ("auto", "auto")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of auto, deepseek_r1, qwen3, none"):
        OpenAIOptions(reasoning_parser="r1")


# ---------------------------------------------------------------- against the session server


def call_args(served: Served, **extra: Any) -> dict[str, Any]:
    return dict(model=model(served), messages=USER, tools=TOOLS, max_tokens=96, temperature=0) | extra


def valid_calls(calls: Any) -> list[tuple[str, str]]:
    """Each call's (name, arguments), asserting the arguments parse and validate against its tool's schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


def test_required_gives_valid_calls_streamed_as_the_whole(served: Served) -> None:
    args = call_args(served, tools=[WEATHER], tool_choice="required")
    whole = client(served).chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    calls = valid_calls(whole.message.tool_calls)
    assert {name for name, _ in calls} == {"get_weather"}
    with client(served).chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == calls
    assert final.message.content == whole.message.content


def test_a_named_function_is_the_one_call(served: Served) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    done = client(served).chat.completions.create(**call_args(served, tool_choice=named)).choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content is None
    assert [name for name, _ in valid_calls(done.message.tool_calls)] == ["get_time"]


def test_parallel_tool_calls_false_gives_exactly_one_call(served: Served) -> None:
    args = call_args(served, tool_choice="required", parallel_tool_calls=False, n=2, temperature=1.0, seed=7)
    for choice in client(served).chat.completions.create(**args).choices:  # each choice: its own parse
        assert choice.finish_reason == "tool_calls" and len(valid_calls(choice.message.tool_calls)) == 1


def test_a_history_of_calls_and_results_renders_and_is_answered(served: Served) -> None:
    status, ids = post(served, "/tokenize", {"model": model(served), "messages": HISTORY, "tools": TOOLS})
    assert status == 200, ids
    status, out = post(served, "/detokenize", {"model": model(served), "tokens": ids["tokens"]})
    rendered = out["prompt"]
    assert json.dumps(TIME) in rendered and f"<tool_call>\n{CALL}\n</tool_call>" in rendered
    assert "<tool_response tool_call_id=\"call_1\">\n22 degrees, sunny\n</tool_response>" in rendered
    done = client(served).chat.completions.create(**call_args(served, messages=HISTORY, max_tokens=4))
    assert done.usage is not None and done.usage.prompt_tokens == ids["count"]


def test_an_unknown_tool_is_400_from_the_server(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(served).chat.completions.create(**call_args(
            served, tool_choice={"type": "function", "function": {"name": "get_wether"}}))
    assert info.value.status_code == 400 and info.value.body["param"] == "tool_choice"  # type: ignore[index]
