#!/usr/bin/env python3
"""LangChain and Instructor, unchanged, against a running `trtprompt serve`: structured outputs and tool calls.

Each case is what an application writes with the PyPI client (no patches, no custom parsing), pointed at
the server's OpenAI-compatible API. A case passes when the client itself returns the parsed object:

  LangChain (langchain-openai ChatOpenAI, temperature 0, max_tokens 200, no client retries):
    with_structured_output(Person, method=...)   json_schema (openai's parse(): strict response_format),
                                                 json_schema strict=True, function_calling (tools +
                                                 tool_choice naming the function, parallel_tool_calls
                                                 false), json_mode (response_format json_object)
                                                 -> a Person instance, no parsing_error
    bind_tools([get_weather, get_time], tool_choice=...)
                                                 "required", "get_weather", "required" with
                                                 parallel_tool_calls=False, "required" streamed
                                                 -> an AIMessage whose .tool_calls are non-empty, name
                                                 an offered tool (the named one when named), have args
                                                 valid for that tool's args_schema with no key it does
                                                 not declare, no invalid_tool_calls, and no tool-call
                                                 markup left in .content; then the call's result sent
                                                 back (AIMessage with tool_calls + ToolMessage, auto)
                                                 -> an AIMessage
  Instructor (instructor.from_openai(OpenAI(...), mode=...).chat.completions.create(response_model=Person,
              max_retries=0: one attempt, so no retry hides a failure)):
    Mode.JSON_SCHEMA, Mode.TOOLS, Mode.TOOLS_STRICT, Mode.JSON (json_object) -> a Person instance

Person has a str, an int and an enum field (the enum becomes a $defs/$ref in the JSON schema). Each case
prints PASS or FAIL with what it got (the parsed object, or the error and the raw message); whether the
values match the prompt's text is shown but not judged (a 135M model may extract wrongly; the check is
that the clients get objects they can parse). Exit 0 when every case passes, 1 otherwise; the two
json_object cases (LangChain json_mode, Instructor Mode.JSON) are shown but not counted: there the server
holds the output to JSON only, the schema is in the prompt, and a Person comes out or not by the model.

Needs a venv with the clients (not the repo's .venv; kept out of `make test`):

  nice -n 19 /work/compat-venv/bin/pip install langchain-openai langchain-core instructor pydantic

Run, from the repo root (2-core machine: about 2 minutes):

  .venv/bin/trtprompt serve engines/smollm2 --host 127.0.0.1 --grpc-port 18001 --http-port 18000 \\
      --metrics-port 18002 --openai-port 18003 &
  /work/compat-venv/bin/python scripts/compat/structured_clients.py --base-url http://127.0.0.1:18003/v1
  kill -INT %1

`--model` defaults to the first id of /v1/models; `--only SUBSTRING` runs the cases whose name has it.
Results and versions: docs/structured-outputs.md, "Client compatibility".
"""
from __future__ import annotations

import argparse
import enum
import importlib.metadata
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

PROMPT = "Extract the person: Ann is 31 and lives in Paris."
EXPECTED = {"name": "Ann", "age": 31, "city": "Paris"}
WEATHER_PROMPT = "What is the weather in Paris, in celsius?"
MAX_TOKENS = 200
TIMEOUT_S = 300.0
PACKAGES = ("langchain-openai", "langchain-core", "instructor", "openai", "pydantic")


class City(str, enum.Enum):
    PARIS = "Paris"
    LONDON = "London"
    BERLIN = "Berlin"
    ROME = "Rome"


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="The person's first name")
    age: int = Field(description="Age in years")
    city: City = Field(description="The city the person lives in")


def say(msg: str) -> None:
    print(f"[structured_clients] {msg}", flush=True)


@dataclass(frozen=True)
class Outcome:
    ok: bool
    got: str


@dataclass(frozen=True)
class Server:
    base_url: str
    model: str


# ------------------------------------------------------------------------------------------ judging

def person_outcome(parsed: Any, raw: Any = None, error: Any = None) -> Outcome:
    """Pass when parsed is a Person (and no parsing error); say whether it matches the prompt's text."""
    if isinstance(parsed, Person) and error is None:
        values = {"name": parsed.name, "age": parsed.age, "city": parsed.city.value}
        note = "matches the text" if values == EXPECTED else f"differs from the text {EXPECTED}"
        return Outcome(True, f"{parsed!r} ({note})")
    return Outcome(False, f"parsed={parsed!r} parsing_error={error!r} raw={describe_message(raw)}")


def describe_message(msg: Any) -> str:
    """A LangChain message's content, tool calls and invalid tool calls (what a failure shows)."""
    if msg is None:
        return "None"
    parts = [f"content={getattr(msg, 'content', None)!r}"]
    for attr in ("tool_calls", "invalid_tool_calls"):
        if getattr(msg, attr, None):
            parts.append(f"{attr}={getattr(msg, attr)!r}")
    meta = getattr(msg, "response_metadata", None) or {}
    if "finish_reason" in meta:
        parts.append(f"finish_reason={meta['finish_reason']!r}")
    return " ".join(parts)


# The markup of the server's tool-call formats (hermes, mistral): never part of an answer's content.
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]")


def call_problems(call: dict[str, Any], tools: dict[str, Any], named: str | None) -> list[str]:
    """What is wrong with one parsed call: an unknown (or not the named) tool, args its schema refuses,
    or keys the tool does not declare (pydantic ignores them, but an application calling the function
    with **args fails on them)."""
    name, args = call.get("name"), call.get("args")
    if name not in tools or (named is not None and name != named):
        return [f"call names {name!r}"]
    schema = tools[name].args_schema
    try:
        schema.model_validate(args)
    except Exception as exc:  # pydantic's ValidationError: the args do not fit the tool
        return [f"args of {name} invalid: {exc}"]
    extra = sorted(set(args) - set(schema.model_fields))
    return [f"args of {name} have keys it does not declare: {extra}"] if extra else []


def tool_calls_outcome(msg: Any, tools: dict[str, Any], named: str | None = None,
                       max_calls: int | None = None) -> Outcome:
    """Pass when msg's tool calls are there, valid for their tools (and the named one), none invalid."""
    calls = list(getattr(msg, "tool_calls", None) or [])
    problems = []
    if not calls:
        problems.append("no tool_calls")
    if getattr(msg, "invalid_tool_calls", None):
        problems.append("invalid_tool_calls present")
    if max_calls is not None and len(calls) > max_calls:
        problems.append(f"{len(calls)} tool calls, at most {max_calls} expected")
    content = str(getattr(msg, "content", "") or "")
    if any(marker in content for marker in CALL_MARKERS):
        problems.append("tool-call markup left in content")
    for call in calls:
        problems.extend(call_problems(call, tools, named))
    calls_shown = [(c.get("name"), c.get("args")) for c in calls]
    if problems:
        return Outcome(False, f"{'; '.join(problems)}: {describe_message(msg)}")
    return Outcome(True, f"{len(calls)} call(s) {calls_shown}")


# ------------------------------------------------------------------------------------------ LangChain

def chat_model(server: Server) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.base_url, api_key="none", model=server.model, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=TIMEOUT_S)


def make_tools() -> dict[str, Any]:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        return f"18 degrees {unit} and sunny in {city}"

    @tool
    def get_time(timezone: str) -> str:
        """Current local time in an IANA timezone such as Europe/Paris."""
        return f"12:00 in {timezone}"

    return {t.name: t for t in (get_weather, get_time)}


def lc_structured(method: str, prompt: str = PROMPT, **kwargs: Any) -> Callable[[Server], Outcome]:
    def case(server: Server) -> Outcome:
        runnable = chat_model(server).with_structured_output(Person, method=method, include_raw=True,
                                                             **kwargs)
        out = runnable.invoke(prompt)
        return person_outcome(out["parsed"], out["raw"], out["parsing_error"])
    return case


# json_mode sends only response_format json_object: LangChain's docs say the prompt must describe the
# keys, as an application does.
JSON_MODE_PROMPT = (PROMPT + ' Answer with a JSON object with the keys "name" (a string), "age" (an '
                    'integer) and "city" (one of "Paris", "London", "Berlin", "Rome").')


def lc_bind_tools(tool_choice: str, stream: bool = False, **kwargs: Any) -> Callable[[Server], Outcome]:
    def case(server: Server) -> Outcome:
        tools = make_tools()
        llm = chat_model(server).bind_tools(list(tools.values()), tool_choice=tool_choice, **kwargs)
        if stream:
            msg = None
            for chunk in llm.stream(WEATHER_PROMPT):
                msg = chunk if msg is None else msg + chunk
        else:
            msg = llm.invoke(WEATHER_PROMPT)
        named = tool_choice if tool_choice in tools else None
        max_calls = 1 if kwargs.get("parallel_tool_calls") is False else None
        return tool_calls_outcome(msg, tools, named, max_calls)
    return case


def lc_tool_round_trip(server: Server) -> Outcome:
    """An agent's second turn: the tool call and its result in the history, tool_choice auto."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    tools = make_tools()
    llm = chat_model(server).bind_tools(list(tools.values()))
    call = {"name": "get_weather", "args": {"city": "Paris", "unit": "celsius"}, "id": "call_1",
            "type": "tool_call"}
    history = [HumanMessage(WEATHER_PROMPT), AIMessage(content="", tool_calls=[call]),
               ToolMessage(tools["get_weather"].invoke(call["args"]), tool_call_id="call_1")]
    msg = llm.invoke(history)
    if not isinstance(msg, AIMessage) or getattr(msg, "invalid_tool_calls", None):
        return Outcome(False, describe_message(msg))
    if msg.tool_calls:
        return tool_calls_outcome(msg, tools)
    return Outcome(bool(msg.content), f"answer {msg.content!r}")


# ------------------------------------------------------------------------------------------ Instructor

def instructor_case(mode_name: str) -> Callable[[Server], Outcome]:
    def case(server: Server) -> Outcome:
        import instructor
        from openai import OpenAI

        client = instructor.from_openai(OpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                                               timeout=TIMEOUT_S), mode=getattr(instructor.Mode, mode_name))
        try:
            person = client.chat.completions.create(
                model=server.model, response_model=Person, max_retries=0, temperature=0,
                max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}])
        except Exception as exc:  # instructor wraps the failed attempt; show its error and the answer it got
            cause = getattr(exc, "__cause__", None) or exc
            error = " ".join(str(cause).split())[:400]
            return Outcome(False, f"{type(exc).__name__} ({error}) answer: "
                                  f"{describe_completion(getattr(exc, 'last_completion', None))}")
        return person_outcome(person)
    return case


def describe_completion(completion: Any) -> str:
    """An openai ChatCompletion's first message (content, tool calls) and finish_reason."""
    choices = getattr(completion, "choices", None)
    if not choices:
        return repr(completion)
    msg = choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in (msg.tool_calls or [])]
    return f"content={msg.content!r} tool_calls={calls} finish_reason={choices[0].finish_reason!r}"


# ------------------------------------------------------------------------------------------ running

@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Server], Outcome]
    # False for json_object modes: the server holds the output to JSON, the schema is only in the prompt,
    # so whether it parses as a Person is the model's doing; shown, not counted in the exit status.
    enforced: bool = True


CASES = [
    Case("langchain with_structured_output json_schema", lc_structured("json_schema")),
    Case("langchain with_structured_output json_schema strict=True", lc_structured("json_schema", strict=True)),
    Case("langchain with_structured_output function_calling", lc_structured("function_calling")),
    Case("langchain with_structured_output json_mode", lc_structured("json_mode", JSON_MODE_PROMPT), False),
    Case("langchain bind_tools tool_choice=required", lc_bind_tools("required")),
    Case("langchain bind_tools tool_choice=get_weather", lc_bind_tools("get_weather")),
    Case("langchain bind_tools tool_choice=required parallel_tool_calls=False",
         lc_bind_tools("required", parallel_tool_calls=False)),
    Case("langchain bind_tools tool_choice=required streamed", lc_bind_tools("required", stream=True)),
    Case("langchain bind_tools tool result round trip (auto)", lc_tool_round_trip),
    Case("instructor Mode.JSON_SCHEMA", instructor_case("JSON_SCHEMA")),
    Case("instructor Mode.TOOLS", instructor_case("TOOLS")),
    Case("instructor Mode.TOOLS_STRICT", instructor_case("TOOLS_STRICT")),
    Case("instructor Mode.JSON", instructor_case("JSON"), False),
]


def run_case(case: Case, server: Server) -> bool:
    try:
        outcome = case.run(server)
    except Exception as exc:  # a client or HTTP error is this case's failure, not the script's
        last = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = Outcome(False, f"{type(exc).__name__}: {exc} (at {last.filename}:{last.lineno})")
    tag = "" if case.enforced else " [json_object: schema in the prompt only, not counted]"
    print(f"{'PASS' if outcome.ok else 'FAIL'}  {case.name}{tag}: {outcome.got}", flush=True)
    return outcome.ok


def first_model(base_url: str) -> str:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="none", max_retries=0).models.list().data[0].id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="the server's OpenAI API, e.g. http://127.0.0.1:8003/v1")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
    args = ap.parse_args()
    say("versions: " + ", ".join(f"{p} {importlib.metadata.version(p)}" for p in PACKAGES))
    server = Server(args.base_url.rstrip("/"), args.model or first_model(args.base_url))
    say(f"server {server.base_url}, model {server.model!r}")
    chosen = [c for c in CASES if args.only is None or args.only in c.name]
    results = [(case, run_case(case, server)) for case in chosen]
    counted = [ok for case, ok in results if case.enforced]
    shown = [ok for case, ok in results if not case.enforced]
    say(f"{sum(counted)}/{len(counted)} passed; json_object cases (not counted): {sum(shown)}/{len(shown)}")
    return 0 if all(counted) else 1


if __name__ == "__main__":
    sys.exit(main())
