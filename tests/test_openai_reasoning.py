"""Reasoning on the OpenAI front end (docs/structured-outputs.md, "Reasoning").

Without a server: a chat answer's reasoning is split into `reasoning_content` (whole and streamed alike),
include_reasoning false drops it, separate_reasoning false leaves it in the content; a guide under a
reasoning parser holds after "</think>" (guide_after); chat_template_kwargs reach the plan.

Against the session server's engine, through a front end in this process whose tokenizer copy carries a
Qwen3-like template (tool-aware, thinking switched by `enable_thinking`): "auto" picks hermes and qwen3
from it, chat_template_kwargs reach the template (the rendered prompt), and a prompt that already closed
the reasoning (enable_thinking false) gets its guide from the first token, with nothing split off.
"""

from __future__ import annotations

import json
import shutil
from typing import Any, Iterator

import openai
import pytest
from serve_fixtures import Served
from starlette.testclient import TestClient
from test_openai_tools import TOOLS, USER, accumulated, streamed

from trtprompt.serve.openai.app import create_app
from trtprompt.serve.openai.chat_answer import assembled
from trtprompt.serve.openai.config import FrontendConfig
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.http_limits import HttpLimits
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.openai.parser_options import ServedParsers
from trtprompt.serve.openai.tools import ChatPlan

THINKING = ModelLimits("tiny", 2048, vocab_size=256, parsers=ServedParsers("hermes", "qwen3"))
SCRIPTED = "<think>\nParis is in France.\nIts weather: mild.\n</think>\n\nIt is mild in Paris."
WANT = ("Paris is in France.\nIts weather: mild.", "It is mild in Paris.")


def plan(parser: str = "qwen3", **fields: Any) -> ChatPlan:
    return ChatPlan(reasoning_parser=parser, **fields)


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", SCRIPTED, WANT),
    ("qwen3", "It is mild in Paris.", (None, "It is mild in Paris.")),  # thinking off: all content
    ("deepseek_r1", SCRIPTED.removeprefix("<think>\n"), WANT),  # the prompt opened the think block
    ("deepseek_r1", "Still thinking about", ("Still thinking about", None)),  # cut off while thinking
])
def test_reasoning_is_split_whole_and_streamed(parser: str, text: str, want: tuple[str | None, str | None]) -> None:
    message = assembled(text, plan(parser)).message()
    assert (message["reasoning_content"], message["content"]) == want
    for step in (1, 4, 1000):
        deltas, called = streamed(plan(parser), text, step)
        content, calls, reasoning = accumulated(deltas)
        assert (reasoning, content, calls, called) == (*want, [], False)


def test_include_reasoning_false_drops_it_and_separate_reasoning_false_keeps_it_in_content() -> None:
    dropped = assembled(SCRIPTED, plan(include_reasoning=False))
    assert dropped.message() == {"role": "assistant", "content": WANT[1]}
    deltas, _ = streamed(plan(include_reasoning=False), SCRIPTED, 3)
    assert accumulated(deltas) == (WANT[1], [], None)
    kept = plan(separate_reasoning=False)
    assert not kept.changes_answer and assembled(SCRIPTED, kept).message()["content"] == SCRIPTED


def chat(**extra: Any) -> Any:
    return parse_request("chat", {"model": "tiny", "messages": USER} | extra, THINKING)


def test_a_guide_holds_after_the_reasoning_and_kwargs_reach_the_plan() -> None:
    assert chat(response_format={"type": "json_object"}).sampling.guide_after == "</think>"
    required = chat(tools=TOOLS, tool_choice="required").sampling
    assert (required.guide_type, required.guide_after) == ("lark_grammar", "</think>")
    assert chat().sampling.guide_after is None  # no guide: nothing to hold back
    plain = parse_request("chat", {"model": "tiny", "messages": USER, "response_format": {"type": "json_object"}},
                          ModelLimits("tiny", 2048))
    assert plain.sampling.guide_after is None  # no reasoning parser
    gen = chat(chat_template_kwargs={"enable_thinking": False}, include_reasoning=False, separate_reasoning=True)
    assert gen.chat.render.template_kwargs == {"enable_thinking": False} and not gen.chat.include_reasoning
    with pytest.raises(APIError) as info:
        chat(include_reasoning="no")
    assert (info.value.status, info.value.param) == (400, "include_reasoning")


# ---------------------------------------------------------------- through the engine

# A Qwen3-like template written for this test: tools in a system turn, thinking off renders an empty block.
TEMPLATE = """{%- if tools %}<|system|>{{ NL }}Call tools as <tool_call>{"name": ..., "arguments": ...}</tool_call>:
{{ tools | tojson }}<|end|>{{ NL }}{% endif %}
{%- for m in messages %}<|{{ m.role }}|>{{ NL }}{{ m.content }}<|end|>{{ NL }}{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{{ NL }}
{%- if enable_thinking is defined and enable_thinking is false %}<think>{{ NL }}{{ NL }}</think>{{ NL }}{{ NL }}
{%- endif %}{% endif %}""".replace("NL", "'\\n'")


ANSWER = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_front(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """A front end in this process on the session server's engine, its tokenizer carrying TEMPLATE."""
    folder = tmp_path_factory.mktemp("qwen3-like-tokenizer")
    for f in (served.engine_dir / "tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    cfg = FrontendConfig.for_engine(served.engine_dir, "127.0.0.1:1", engine_socket=served.socket_path,
                                    tokenizer_dir=str(folder))
    assert cfg.limits.parsers == ServedParsers("hermes", "qwen3")  # "auto", from the template
    with TestClient(create_app(cfg, HttpLimits(1 << 20))) as client:
        client.headers["X-Model"] = cfg.limits.name
        yield client


def rendered(front: TestClient, **extra: Any) -> str:
    body = {"model": front.headers["X-Model"], "messages": USER} | extra
    ids = front.post("/tokenize", json=body).json()["tokens"]
    return str(front.post("/detokenize", json={"tokens": ids}).json()["prompt"])


def test_chat_template_kwargs_and_tools_reach_the_template(thinking_front: TestClient) -> None:
    off = rendered(thinking_front, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert rendered(thinking_front, chat_template_kwargs={"enable_thinking": True}).endswith("<|assistant|>\n")
    with_tools = rendered(thinking_front, tools=TOOLS)
    assert with_tools.startswith("<|system|>\nCall tools as <tool_call>") and json.dumps(TOOLS) in with_tools


def test_a_prompt_that_closed_the_reasoning_is_guided_from_its_first_token(thinking_front: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=thinking_front,
                           max_retries=0)
    done = client.chat.completions.create(
        model=thinking_front.headers["X-Model"], messages=USER, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    # guide_after "</think>" would have left a random-weight model free (it never writes the tag): the
    # grammar held from the first token, and nothing was split off as reasoning
    assert set(json.loads(done.message.content or "")) == {"sunny"}, done.message.content
    assert done.finish_reason == "stop"
    assert done.model_extra is not None and getattr(done.message, "reasoning_content", None) is None
