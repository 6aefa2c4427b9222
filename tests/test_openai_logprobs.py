"""Log probabilities and the vocabulary controls on the OpenAI front end.

Parsing (no server): every bound is a 400 naming its field, and the fields land in SamplingParams as
the engine takes them. Against the real server (the tiny engine, fused layout): chat logprobs parsed
by the `openai` client, completions' echo + logprobs + max_tokens 0 (lm-evaluation-harness's
loglikelihood request) equal to transformers' log_softmax within 1e-4, streamed logprobs equal to
the whole answer's, logit_bias / allowed_token_ids / bad_words acting on what is generated, and the
Triton path refusing by name what it cannot carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from serve_fixtures import Oracle, Served
from serve_fixtures import openai_client as client
from serve_fixtures import openai_model as model
from serve_fixtures import openai_post as post

from trtprompt.serve.openai.answer_params import bad_word_ids
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.openai.to_triton import NOT_THROUGH_TRITON, _refuse_answer_fields

LIMITS = ModelLimits("tiny", 2048, vocab_size=256)


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello"} | extra


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]} | extra


# ---------------------------------------------------------------- parsing, without a server

@pytest.mark.parametrize("kind, body, param", [
    ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", chat(top_logprobs=2), "top_logprobs"),  # requires logprobs: true
    ("chat", chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("chat", chat(logprobs=1), "logprobs"),
    ("completion", completion(logprobs=21), "logprobs"),
    ("completion", completion(logprobs=True), "logprobs"),
    ("completion", completion(echo="yes"), "echo"),
    ("completion", completion(n=0), "n"),
    ("completion", completion(n=129), "n"),
    ("completion", completion(n=3, best_of=2), "best_of"),
    ("completion", completion(logit_bias={"5": 101}), "logit_bias"),
    ("completion", completion(logit_bias={"x": 1}), "logit_bias"),
    ("completion", completion(logit_bias={"256": 1}), "logit_bias"),  # outside the vocabulary
    ("completion", completion(logit_bias=[5]), "logit_bias"),
    ("completion", completion(allowed_token_ids=[]), "allowed_token_ids"),
    ("completion", completion(allowed_token_ids=[300]), "allowed_token_ids"),
    ("completion", completion(bad_words=[""]), "bad_words"),
    ("completion", completion(bad_words="word"), "bad_words"),
    ("completion", completion(prompt_logprobs=21), "prompt_logprobs"),
    ("completion", completion(include_stop_str_in_output=1), "include_stop_str_in_output"),
    ("completion", completion(max_tokens=0), "max_tokens"),  # 0 only with echo or prompt_logprobs
    ("chat", chat(max_tokens=0, logprobs=True), "max_tokens"),
])
def test_bounds_are_refused_naming_the_field(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_request(kind, body, LIMITS)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_fields_land_in_sampling_params() -> None:
    gen = parse_request("completion", completion(prompt=[1, 2, 3], echo=True, logprobs=2, max_tokens=0,
                                                 temperature=0), LIMITS)
    assert (gen.max_tokens, gen.sampling.logprobs, gen.sampling.prompt_logprobs) == (0, 2, 2)
    best = parse_request("completion", completion(best_of=3, logit_bias={"9": -100, "4": 5.5}, bad_words=["x"],
                                                  allowed_token_ids=[7, 3, 7], include_stop_str_in_output=True),
                         LIMITS)
    s = best.sampling
    assert (s.n, s.logprobs, best.shape.n, best.shape.logprobs) == (3, 0, 1, None)  # best_of needs the sums
    assert (s.logit_bias, s.allowed_token_ids, s.include_stop_in_output) == (((4, 5.5), (9, -100.0)), (3, 7), True)
    assert best.bad_words == ("x",)
    top = parse_request("chat", chat(logprobs=True, top_logprobs=5, n=2), LIMITS)
    assert (top.sampling.logprobs, top.sampling.n, top.sampling.prompt_logprobs) == (5, 2, None)
    assert parse_request("chat", chat(logprobs=True), LIMITS).sampling.logprobs == 0


def test_bad_words_are_encoded_as_vllm_encodes_them() -> None:
    """The word without leading spaces, and with one where that gives another first token, same length."""
    vocab = {"bad": [10], " bad": [11], "two words": [1, 2], " two words": [1, 2], "ab": [3, 4], " ab": [5]}
    encode: Callable[[str], list[int]] = lambda text: vocab[text]  # noqa: E731
    assert bad_word_ids(("  bad",), encode) == ((10,), (11,))
    assert bad_word_ids(("two words",), encode) == ((1, 2),)  # same first token: once
    assert bad_word_ids(("ab",), encode) == ((3, 4),)  # the spaced form has another length: not added


@pytest.mark.parametrize("body, param", [
    (completion(n=2), "n"), (completion(best_of=2), "best_of"), (completion(logprobs=0), "logprobs"),
    (completion(echo=True), "echo"), (completion(prompt_logprobs=1), "prompt_logprobs"),
    (completion(logit_bias={"3": 1}), "logit_bias"), (completion(allowed_token_ids=[3]), "allowed_token_ids"),
    (completion(bad_words=["x"]), "bad_words"), (completion(include_stop_str_in_output=True),
                                                 "include_stop_str_in_output"),
    (completion(use_beam_search=True, n=2, temperature=0), "n"),
])
def test_the_triton_path_refuses_what_it_cannot_carry(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        _refuse_answer_fields(parse_request("completion", body, LIMITS))
    assert (info.value.status, info.value.param) == (400, param)
    assert NOT_THROUGH_TRITON in info.value.message


# ---------------------------------------------------------------- against the real server

@pytest.fixture(scope="module")
def hf_logprobs(tiny_checkpoint_factory: Callable[..., Path]) -> Callable[[list[int]], torch.Tensor]:
    """transformers' log_softmax over the served checkpoint's logits (fp32, as the cpu-dev engine)."""
    import transformers

    path = tiny_checkpoint_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                           torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    return run


@pytest.mark.server
def test_chat_logprobs_parse_with_the_openai_client(served: Served) -> None:
    done = client(served).chat.completions.create(model=model(served), messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely
    plain = client(served).chat.completions.create(model=model(served), messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content


@pytest.mark.server
def test_echo_logprobs_max_tokens_0_equal_transformers(served: Served, oracle: Oracle,
                                                       hf_logprobs: Callable[[list[int]], torch.Tensor]) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs k, max_tokens 0, temperature 0."""
    ids = oracle.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": ids, "echo": True,
                                                    "logprobs": 2, "max_tokens": 0, "temperature": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    lp, want = choice["logprobs"], hf_logprobs(ids)
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    assert choice["text"] == oracle.tokenizer.decode(ids)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - want[i - 1, ids[i]].item()) < 1e-4
        assert abs(max(lp["top_logprobs"][i].values()) - want[i - 1].max().item()) < 1e-4
        assert 1 <= len(lp["top_logprobs"][i]) <= 3  # the top 2 and the chosen token (fewer: equal texts)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.server
def test_output_and_prompt_logprobs_equal_transformers(served: Served, oracle: Oracle,
                                                       hf_logprobs: Callable[[list[int]], torch.Tensor]) -> None:
    ids = oracle.tokenizer.encode("Once upon a time")
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": ids, "logprobs": 1,
                                                    "prompt_logprobs": 1, "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    out = oracle.token_ids("Once upon a time", 6)
    want = hf_logprobs(ids + out)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(out)
    for j, t in enumerate(out):
        assert abs(got[j] - want[len(ids) - 1 + j, t].item()) < 1e-4
    prompt = choice["prompt_logprobs"]  # vLLM's form
    assert prompt[0] is None and len(prompt) == len(ids)
    for i in range(1, len(ids)):
        entry = prompt[i][str(ids[i])]
        assert abs(entry["logprob"] - want[i - 1, ids[i]].item()) < 1e-4
        assert entry["decoded_token"] == oracle.tokenizer.decode([ids[i]], skip_special_tokens=False)


@pytest.mark.server
def test_streamed_chat_logprobs_equal_the_whole_answer(served: Served) -> None:
    args = dict(model=model(served), messages=[{"role": "user", "content": "Tell me"}], max_tokens=12,
                temperature=0, logprobs=True, top_logprobs=2)
    whole = client(served).chat.completions.create(**args).choices[0]
    chunks = list(client(served).chat.completions.create(stream=True, **args))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
    # The second request reuses the first one's cached prompt blocks, so its steps have other row counts, and
    # a step's row count picks its GEMM (the few-rows kernel or oneDNN): float32 sums in another order, within
    # the 1e-4 this file holds every logprob to against transformers.
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-4)
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == whole.message.content


@pytest.mark.server
def test_logit_bias_forces_a_token_under_greedy(served: Served, oracle: Oracle) -> None:
    token = oracle.tokenizer.encode("zebra", add_special_tokens=False)[0]
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": "Hello", "max_tokens": 5,
                                                    "temperature": 0, "logprobs": 0,
                                                    "logit_bias": {str(token): 100}})
    assert status == 200, body
    name = oracle.tokenizer.decode([token], skip_special_tokens=False)
    assert body["choices"][0]["logprobs"]["tokens"] == [name] * 5
    assert body["choices"][0]["text"] == name * 5


@pytest.mark.server
def test_allowed_token_ids_restrict_the_output(served: Served, oracle: Oracle) -> None:
    allowed = oracle.tokenizer.encode("cat dog", add_special_tokens=False)
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": "Hello", "max_tokens": 8,
                                                    "temperature": 1, "seed": 3, "logprobs": 0,
                                                    "allowed_token_ids": allowed})
    assert status == 200, body
    names = {oracle.tokenizer.decode([t], skip_special_tokens=False) for t in allowed}
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and set(tokens) <= names


@pytest.mark.server
def test_bad_words_never_appear(served: Served, oracle: Oracle) -> None:
    prompt = "Once upon a time"
    greedy = oracle.token_ids(prompt, 8)
    word = oracle.tokenizer.decode([greedy[0]])
    banned = bad_word_ids((word,), lambda w: oracle.tokenizer.encode(w, add_special_tokens=False))
    assert (greedy[0],) in banned  # the greedy answer's first token is one of the banned sequences
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0, "logprobs": 0, "bad_words": [word]})
    assert status == 200, body
    tokens = body["choices"][0]["logprobs"]["tokens"]
    singles = {oracle.tokenizer.decode([s[0]], skip_special_tokens=False) for s in banned if len(s) == 1}
    assert not singles & set(tokens)
    assert body["choices"][0]["text"] != oracle.text(prompt, 8)


@pytest.mark.server
def test_include_stop_str_in_output_keeps_the_matched_stop(served: Served, oracle: Oracle) -> None:
    prompt = "Once upon a time"
    greedy, tok = oracle.token_ids(prompt, 8), oracle.tokenizer
    # A stop inside the greedy answer that the engine can match: one token whose text encodes back to it.
    at = next(i for i in range(1, len(greedy)) if tok.encode(tok.decode([greedy[i]]), add_special_tokens=False)
              == [greedy[i]] and tok.decode([greedy[i]]) not in tok.decode(greedy[:i]))
    stop, head = tok.decode([greedy[at]]), tok.decode(greedy[:at])
    base = {"model": model(served), "prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [stop]}
    _, trimmed = post(served, "/v1/completions", base)
    _, kept = post(served, "/v1/completions", base | {"include_stop_str_in_output": True})
    assert trimmed["choices"][0]["text"] == head
    assert kept["choices"][0]["text"] == head + stop
    assert kept["choices"][0]["finish_reason"] == trimmed["choices"][0]["finish_reason"] == "stop"


@pytest.mark.server
def test_an_end_token_lists_its_log_probability_last(served: Served, oracle: Oracle,
                                                     hf_logprobs: Callable[[list[int]], torch.Tensor]) -> None:
    """lm-evaluation-harness's request (echo, logprobs 1, max_tokens 1) where the model's next token
    ends the request: the end token is no text, but its entry comes last, as vLLM lists it, so
    `token_logprobs[ctxlen:-1]` drops it and not the continuation's last token."""
    ids = oracle.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    nxt = oracle.token_ids("The quick brown fox jumps over the lazy dog", 1)[0]
    status, body = post(served, "/v1/completions", {"model": model(served), "prompt": ids, "echo": True,
                                                    "logprobs": 1, "max_tokens": 1, "temperature": 0,
                                                    "stop_token_ids": [nxt]})
    assert status == 200, body
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 0
    assert choice["text"] == oracle.tokenizer.decode(ids)
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert abs(lp["token_logprobs"][-1] - hf_logprobs(ids)[-1, nxt].item()) < 1e-4
