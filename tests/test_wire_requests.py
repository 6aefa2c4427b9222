"""The serving edge's one request type (trtprompt/serve/wire/requests.py): built once, checked once,
through the submit frame and back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import BadRequestError, ErrorCode, FieldError, RequestError
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.prompt.edge import PromptEdge
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.requests import (
    Outputs,
    TextRequest,
    TokenRequest,
    prepare,
    sampling_from_wire,
    sampling_to_wire,
)
from trtprompt.tokenizer import Tokenizer


def test_the_submit_frame_carries_sampling_params_unchanged() -> None:
    sampling = SamplingParams(max_tokens=9, temperature=0.5, top_k=4, top_p=0.9, seed=2**63, min_tokens=3,
                              stop_token_ids=((5, 6), (7,)), n=3, logprobs=2, prompt_logprobs=0,
                              logit_bias=((4, -1.5), (9, 2.0)), bad_words=((3, 4), (8,)), allowed_token_ids=(1, 2),
                              include_stop_in_output=True)
    req = TokenRequest((1, 2, 3), sampling, stream=True, outputs=Outputs(return_perf_metrics=True), cache_salt="s")
    frame = json.loads(P.encode_frame(req.to_wire("42"))[4:])  # through the real encoding
    assert (frame["op"], frame["id"], frame["prompt_token_ids"], frame["cache_salt"], frame["perf"]) == \
        ("submit", "42", [1, 2, 3], "s", True)
    assert sampling_from_wire(frame["params"]) == sampling
    assert frame["params"]["stop_token_ids"] == [[5, 6], [7]]
    assert frame["params"]["logit_bias"] == [[4, -1.5], [9, 2.0]]
    assert sampling_to_wire(SamplingParams(max_tokens=3)) == {"max_tokens": 3}  # defaults stay off the frame


def test_a_frame_is_checked_again_where_it_arrives() -> None:
    with pytest.raises(BadRequestError, match=r"unknown field\(s\): bogus") as err:
        sampling_from_wire({"max_tokens": 3, "bogus": 1})
    assert err.value.field == "params" and err.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(FieldError, match="top_p must be a finite number"):
        sampling_from_wire({"max_tokens": 3, "top_p": float("nan")})


def test_requests_refuse_what_cannot_be_generated() -> None:
    with pytest.raises(BadRequestError, match="input 'text_input' is empty") as err:
        TextRequest("", SamplingParams(), stream=False)
    assert err.value.field == "text_input"
    chat = ({"role": "user", "content": "hi"},)
    assert TextRequest("", SamplingParams(), stream=False, messages=chat).messages == chat  # the chat is the prompt
    with pytest.raises(BadRequestError, match="input 'input_ids' is empty"):
        TokenRequest((), SamplingParams(), stream=False)
    assert not isinstance(BadRequestError("x"), ValueError)  # a ValueError from a bug stays internal
    assert issubclass(FieldError, RequestError)


def test_outputs_name_what_the_client_asked_for() -> None:
    frame = {"num_input_tokens": 7, "num_output_tokens": 3}
    assert Outputs(return_num_output_tokens=True).counts(frame) == {"num_output_tokens": 3}
    assert Outputs().counts(frame) == {}
    assert Outputs(return_perf_metrics=True).perf_every_step
    assert not Outputs(return_perf_metrics=True, perf_final_only=True).perf_every_step


def test_prepare_fits_the_prompt_and_turns_stop_words_into_ids(tiny_engine_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_engine_dir / "tokenizer")
    edge = PromptEdge(PromptPolicy("reject"), tok, True, lambda: (64, 128))
    req = TextRequest("hello there", SamplingParams(max_tokens=4), stream=True, stop_words=("there", "!"),
                      cache_salt="tenant")
    prepared = prepare(req, edge, tok)
    assert list(prepared.request.prompt_token_ids) == prepared.prompt.ids == tok.encode("hello there")
    assert prepared.request.sampling.stop_token_ids == tuple(
        tuple(tok.encode(w, add_special_tokens=False)) for w in ("there", "!"))
    assert (prepared.request.stream, prepared.request.cache_salt) == (True, "tenant")
    with pytest.raises(RequestError, match=r"exceeds maximum input length \(64\)") as err:
        prepare(TextRequest("word " * 100, SamplingParams(max_tokens=4), stream=False), edge, tok)
    assert err.value.code is ErrorCode.TOO_LONG
