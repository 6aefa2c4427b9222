"""The OpenAI front end's request checks and error mapping (no server needed)."""

from __future__ import annotations

from typing import Any

import pytest

from trtprompt.error_codes import ErrorCode, tagged
from trtprompt.serve.openai.errors import APIError, from_triton
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.openai.to_triton import ensemble_sampling

LIMITS = ModelLimits("tiny", 2048)


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello"} | extra


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]} | extra


def refused(kind: str, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, body, LIMITS)
    return info.value


def test_greedy_and_openai_default_sampling() -> None:
    greedy = parse_request("completion", completion(temperature=0, max_tokens=5), LIMITS)
    assert ensemble_sampling(greedy.sampling) == {"temperature": 0.0}
    assert (greedy.prompts, greedy.max_tokens, greedy.stream) == (("Hello",), 5, False)
    # OpenAI's default temperature 1 samples from the whole distribution: top_p=1 says so to the engine.
    default = parse_request("completion", completion(), LIMITS)
    assert ensemble_sampling(default.sampling) == {"temperature": 1.0, "top_p": 1.0}
    assert default.max_tokens == 16
    top_k = parse_request("completion", completion(temperature=0.7, top_k=5, seed=3), LIMITS)
    assert ensemble_sampling(top_k.sampling) == {"temperature": 0.7, "top_k": 5, "seed": 3}


def test_extensions_and_ignore_eos() -> None:
    gen = parse_request("completion", completion(max_tokens=12, ignore_eos=True, repetition_penalty=1.2,
                                                 presence_penalty=0.5, stop=["\n", "END"], cache_salt="t1"),
                        LIMITS)
    assert gen.sampling.ignore_eos and gen.sampling.min_tokens == 0  # the engine's own ignore_eos
    sampling = ensemble_sampling(gen.sampling)  # the ensemble has none: EOS masked instead
    assert sampling["min_tokens"] == 12 and sampling["repetition_penalty"] == 1.2 and "ignore_eos" not in sampling
    assert sampling["presence_penalty"] == 0.5
    assert gen.stop == ("\n", "END") and gen.cache_salt == "t1"


def test_chat_messages_and_stream_options() -> None:
    body = chat(messages=[{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
                max_completion_tokens=7, stream=True, stream_options={"include_usage": True})
    gen = parse_request("chat", body, LIMITS)
    assert gen.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"})
    assert (gen.max_tokens, gen.stream, gen.include_usage, gen.prompts, gen.inputs) == (7, True, True, (), (None,))


@pytest.mark.parametrize("kind, body, param", [
    ("completion", completion(best_of=3, stream=True), "best_of"),
    ("chat", chat(best_of=3), "best_of"),
    ("completion", completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("completion", completion(suffix="x"), "suffix"),
    ("chat", chat(functions=[{"name": "f"}]), "functions"),  # tools are served (test_openai_tools.py)
    ("completion", completion(stream=True, stream_options={"continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats"),
])
def test_unsupported_parameters_are_refused(kind: str, body: dict[str, Any], param: str) -> None:
    err = refused(kind, body)
    assert (err.status, err.param, err.code) == (400, param, "unsupported_parameter")
    assert "not supported" in err.message


@pytest.mark.parametrize("body, param, text", [
    (completion(max_tokens=0), "max_tokens", "max_tokens must be in [1, 2047] (the model's max_model_len 2048 - 1), got 0"),
    (completion(max_tokens=2048), "max_tokens", "max_tokens must be in [1, 2047]"),
    (completion(temperature=2.5), "temperature", "temperature must be in [0, 2], got 2.5"),
    (completion(top_p=1.5), "top_p", "top_p must be in [0, 1], got 1.5"),
    (completion(presence_penalty=-3), "presence_penalty", "presence_penalty must be in [-2, 2], got -3"),
    (completion(max_tokens=4, min_tokens=5), "min_tokens", "min_tokens must be in [0, max_tokens=4], got 5"),
    (completion(top_k=-5), "top_k", "top_k must be -1, 0 or a positive integer, got -5"),
    (completion(seed=-1), "seed", "seed must be in [0, 2**64), got -1"),
    (completion(max_tokens="8"), "max_tokens", 'max_tokens must be an integer, got "8"'),
    (completion(stream=False, stream_options={"include_usage": True}), "stream_options", "only allowed when stream"),
    (completion(prompt=""), "prompt", "'prompt' is required"),
    (completion(prompt=[["a"]]), "prompt", "prompt[0][0] must be a token id (an integer), got \"a\""),
    (completion(stop=[""]), "stop", "stop must be"),
    (completion(frobnicate=1), "frobnicate", "unrecognized request argument(s): frobnicate"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "messages[0].role must be one of"),
])
def test_bounds_name_the_field(body: dict[str, Any], param: str, text: str) -> None:
    err = refused("chat" if "messages" in body else "completion", body)
    assert (err.status, err.param) == (400, param)
    assert text in err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": err.code}}


def test_unknown_model_is_404() -> None:
    err = refused("completion", completion(model="gpt-4"))
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")


@pytest.mark.parametrize("code, text, status, openai_code", [
    (ErrorCode.QUEUE_FULL, "queue full: 64 requests already waiting (max_queue_size=64)", 429, "queue_full"),
    (ErrorCode.UNAVAILABLE, "engine process unavailable (it is not running or is restarting): [Errno 111]", 503,
     "engine_unavailable"),
    (ErrorCode.UNAVAILABLE, "the engine process stopped while generating (it is being restarted); retry the request",
     503, "engine_unavailable"),
    (ErrorCode.TOO_LONG, "Prompt length (3000) exceeds maximum input length (2047)", 400, None),
    (ErrorCode.INVALID_ARGUMENT, "input 'top_k': top_k must be >= 0, got -1", 400, None),
    (ErrorCode.CANCELLED, "request cancelled by the client", 499, "cancelled"),
    (ErrorCode.INTERNAL, "engine error: the model step failed: RuntimeError: boom", 500, "internal_error"),
])
def test_triton_errors_map_to_statuses(code: ErrorCode, text: str, status: int, openai_code: str | None) -> None:
    # As the stub sends it (the code as a tag), and as Triton's ensemble relays it (with its prefix).
    for message, shown in ((tagged(code, text), text),
                           (f"in ensemble 'ensemble', {tagged(code, text)}", f"in ensemble 'ensemble', {text}")):
        err = from_triton(message)
        assert (err.status, err.code, err.message) == (status, openai_code, shown)
        assert ("Retry-After" in err.headers) == (status in (429, 503))
        assert err.param == {ErrorCode.TOO_LONG: "prompt", ErrorCode.INVALID_ARGUMENT: "top_k"}.get(code)


@pytest.mark.parametrize("message, status", [
    ("Exceeds maximum queue size", 429),  # tritonserver's own request queue
    ("Prompt length (3000) exceeds maximum input length (2047)", 400),  # the tensorrtllm backend
    ("unexpected shape for input 'stop_words'", 400),
])
def test_untagged_triton_errors(message: str, status: int) -> None:
    assert (from_triton(message).status, from_triton(message).message) == (status, message)


def test_bench_picks_the_client_from_the_url() -> None:
    from trtprompt.bench.command import bench_api
    from trtprompt.bench.openai_client import api_base

    assert bench_api(None, None) == "triton"
    assert bench_api(None, "127.0.0.1:8001") == "triton"
    assert bench_api(None, "http://127.0.0.1:8003") == "openai"
    assert bench_api("openai", None) == "openai"  # bench starts a server with the front end
    with pytest.raises(ValueError, match="--api openai takes an http"):
        bench_api("openai", "127.0.0.1:8001")
    with pytest.raises(ValueError, match="--api triton takes a gRPC"):
        bench_api("triton", "http://127.0.0.1:8003/v1")
    assert api_base("http://h:1") == api_base("http://h:1/v1/") == "http://h:1/v1"


def test_bench_client_folds_sse_events() -> None:
    from trtprompt.bench.openai_client import _event
    from trtprompt.client import StreamResult

    result = StreamResult()
    lines = [b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n', b"\n", b": keep-alive comment\n",
             b'data: {"choices": [{"index": 0, "delta": {"content": "lo"}}]}\n',
             b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n',
             b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, '
             b'"prompt_tokens_details": {"cached_tokens": 32}}}\n', b"data: [DONE]\n"]
    for at, line in enumerate(lines):
        _event(line, result, float(at))
    assert result.finished and result.error is None
    assert result.text == "Hello" and result.times == [0.0, 3.0]
    assert (result.last("num_input_tokens"), result.last("num_output_tokens"), result.last("cached_tokens")) == (7, 2, 32)
    failed = StreamResult()
    _event(b'data: {"error": {"message": "queue full", "type": "rate_limit_error"}}\n', failed, 0.0)
    assert failed.error == "queue full"
