"""Token-id prompts and batches of prompts on /v1/completions, against the real server: a list of
ids answers as the same text's tokens do, a batch answers one choice per prompt with its index
(whole and streamed, usage summed exactly), and ids outside the vocabulary, over-long prompts
and malformed batches are 400s naming `prompt`, before anything is generated."""

from __future__ import annotations

import http.client
import json
from typing import Any

import openai
import pytest
from serve_fixtures import Oracle, Served, wait_for

from trtprompt.serve.launch.options import EngineInfo
from trtprompt.serve.openai.config import FrontendConfig
from trtprompt.serve.openai.params import MAX_BATCH_PROMPTS

pytestmark = pytest.mark.server
PROMPTS = ("The quick brown fox", "Once upon a time", "1 2 3 4")


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)


def model(served: Served) -> str:
    return FrontendConfig.for_engine(served.engine_dir, "127.0.0.1:1").limits.name


def post(served: Served, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_a_token_prompt_answers_as_its_text_does(served: Served, oracle: Oracle) -> None:
    c = client(served)
    for prompt in PROMPTS:
        ids = oracle.tokenizer.encode(prompt)
        by_ids = c.completions.create(model=model(served), prompt=ids, max_tokens=10, temperature=0)
        by_text = c.completions.create(model=model(served), prompt=prompt, max_tokens=10, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text == oracle.text(prompt, 10)
        assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
        assert by_ids.usage.completion_tokens == by_text.usage.completion_tokens
        streamed = c.completions.create(model=model(served), prompt=ids, max_tokens=10, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == oracle.text(prompt, 10)


def test_a_batch_answers_one_choice_per_prompt_in_order(served: Served, oracle: Oracle) -> None:
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    want = [oracle.text(p, 8) for p in PROMPTS]
    c = client(served)
    for batch in (ids, list(PROMPTS)):  # token-id lists, and strings (OpenAI takes both)
        done = c.completions.create(model=model(served), prompt=batch, max_tokens=8, temperature=0)
        assert [ch.index for ch in done.choices] == [0, 1, 2]
        assert [ch.text for ch in done.choices] == want
        assert done.usage.prompt_tokens == sum(len(i) for i in ids)
        singles = [c.completions.create(model=model(served), prompt=p, max_tokens=8, temperature=0).usage
                   for p in batch]
        assert done.usage.completion_tokens == sum(u.completion_tokens for u in singles)
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens


def test_a_streamed_batch_interleaves_choices_by_index(served: Served, oracle: Oracle) -> None:
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    chunks = list(client(served).completions.create(model=model(served), prompt=ids, max_tokens=8, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    texts, reasons = ["", "", ""], [None, None, None]
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            assert reasons[choice.index] is None  # one closing chunk per choice
            reasons[choice.index] = choice.finish_reason
    assert texts == [oracle.text(p, 8) for p in PROMPTS]
    assert None not in reasons
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == sum(len(i) for i in ids)


@pytest.mark.parametrize("prompt, text", [
    ([5, 10**6], "prompt[1]: token id 1000000 is outside the vocabulary [0, "),
    ([5, -3], "prompt[1]: token id -3 is outside the vocabulary"),
    ([[5, 6], [7, 10**6]], "prompt[1][1]: token id 1000000 is outside the vocabulary"),
    ([[5, 6], []], "prompt[1] must be a non-empty string or a non-empty list of token ids"),
    ([[5, 6], "text"], None),  # strings and id lists may be mixed in a batch, as vLLM allows
    ([5, "6"], "prompt[1] must be a token id (an integer), got \"6\""),
    ([5, True], "prompt[1] must be a token id (an integer), got true"),
    ([5, 6.0], "prompt[1] must be a token id (an integer), got 6.0"),
    ([], "'prompt' is required"),
    ([[1]] * (MAX_BATCH_PROMPTS + 1), f"more than the {MAX_BATCH_PROMPTS} one request may carry"),
])
def test_bad_token_prompts_are_400_naming_prompt(served: Served, prompt: Any, text: str | None) -> None:
    finished = served.engine_stats()["finished"]
    status, answer = post(served, {"model": model(served), "prompt": prompt, "max_tokens": 2})
    if text is None:
        assert status == 200 and len(answer["choices"]) == 2, answer
        return
    assert status == 400, answer
    assert answer["error"]["param"] == "prompt" and text in answer["error"]["message"], answer
    assert served.engine_stats()["finished"] == finished  # refused before any prompt of it ran


def test_an_over_long_token_prompt_is_refused_like_text(served: Served) -> None:
    info = EngineInfo.read(served.engine_dir).build_config
    too_long = [5] * (int(info["max_seq_len"]) + 1)
    for stream in (False, True):
        for prompt in (too_long, [[5, 6], too_long]):
            status, answer = post(served, {"model": model(served), "prompt": prompt, "max_tokens": 2,
                                           "stream": stream})
            assert status == 400, answer
            assert answer["error"]["param"] == "prompt"
            assert "exceeds maximum input length" in answer["error"]["message"]
    served.assert_healthy()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_mid_batch_aborts_every_choice(served: Served, stream: bool) -> None:
    def active() -> float | None:
        return served.metric("nv_trt_llm_request_metrics", request_type="active")

    def used() -> float | None:
        return served.metric("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")

    wait_for(lambda: used() == 0, "an idle engine to start with")
    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    body = {"model": model(served), "prompt": [[5, 6, 7] * 10, "go on and on " * 10], "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: {")
    wait_for(lambda: (active() or 0) == 2, "both choices generating")
    conn.close()
    wait_for(lambda: active() == 0 and used() == 0, "both engine requests aborted and their blocks freed")
    served.assert_healthy()
