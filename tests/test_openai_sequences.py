"""n, best_of and batches of prompts × n on the OpenAI front end, against the real server (the tiny
engine, fused layout), with the `openai` client: one choice per sequence with its index (prompt
index * n + sequence), reproducible with a seed, usage counting each prompt once; best_of returning
the sequence with the highest summed log probability; streamed sequences whose per-index text and
log probabilities equal the whole answer's."""

from __future__ import annotations

from typing import Any

import pytest
from serve_fixtures import Served
from test_openai_token_prompts import client, model, post  # the same client helpers

pytestmark = pytest.mark.server
PROMPT = "Once upon a time"

def sampled(served: Served, **extra: Any) -> Any:
    return client(served).completions.create(model=model(served), prompt=PROMPT, max_tokens=10, temperature=1,
                                             seed=11, **extra)


def test_n_gives_distinct_reproducible_choices_and_counts_the_prompt_once(served: Served) -> None:
    first, again = sampled(served, n=3), sampled(served, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)
    one = sampled(served)
    assert first.usage.prompt_tokens == one.usage.prompt_tokens  # counted once, not n times
    lengths = [len(c.logprobs.tokens) for c in sampled(served, n=3, logprobs=0).choices]
    assert first.usage.completion_tokens == sum(lengths)
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_best_of_returns_the_most_likely_sequence(served: Served) -> None:
    every = sampled(served, n=3, logprobs=0).choices  # the same three sequences best_of generates
    sums = [sum(c.logprobs.token_logprobs) for c in every]
    best = sampled(served, best_of=3)
    (choice,) = best.choices
    assert choice.index == 0 and choice.logprobs is None  # logprobs computed to choose, not shown
    assert choice.text == every[sums.index(max(sums))].text
    # Usage counts every sequence generated, the two best_of dropped too (OpenAI bills them).
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)
    two = sampled(served, n=2, best_of=3, logprobs=0)
    ranked = sorted(range(3), key=lambda i: sums[i], reverse=True)[:2]
    assert [c.text for c in two.choices] == [every[i].text for i in ranked]
    assert [c.index for c in two.choices] == [0, 1]


def test_streamed_sequences_equal_the_whole_answer(served: Served) -> None:
    whole = sampled(served, n=2, logprobs=1).choices
    chunks = list(sampled(served, n=2, logprobs=1, stream=True, stream_options={"include_usage": True}))
    texts, tokens, values, reasons = ["", ""], [[], []], [[], []], [None, None]
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        assert choice.index in (0, 1)
        texts[choice.index] += choice.text
        if choice.logprobs is not None:
            tokens[choice.index] += choice.logprobs.tokens
            values[choice.index] += choice.logprobs.token_logprobs
        if choice.finish_reason is not None:
            assert reasons[choice.index] is None
            reasons[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole]
    assert tokens == [c.logprobs.tokens for c in whole]
    for got, want in zip(values, whole):
        assert got == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
    assert reasons == [c.finish_reason for c in whole]
    assert chunks[-1].usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole)


def test_streamed_chat_with_n_opens_each_choice_with_the_role(served: Served) -> None:
    args = dict(model=model(served), messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=1,
                seed=5, n=2)
    whole = client(served).chat.completions.create(**args)
    chunks = list(client(served).chat.completions.create(stream=True, **args))
    roles, texts = [0, 0], ["", ""]
    for ch in chunks:
        (choice,) = ch.choices
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += choice.delta.content or ""
    assert roles == [1, 1]
    assert texts == [c.message.content for c in whole.choices]


def test_a_batch_times_n_orders_choices_prompt_then_sequence(served: Served) -> None:
    prompts = [PROMPT, "The quick brown fox"]
    status, body = post(served, {"model": model(served), "prompt": prompts, "n": 2, "max_tokens": 6,
                                 "temperature": 1, "seed": 4})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        _, alone = post(served, {"model": model(served), "prompt": prompt, "n": 2, "max_tokens": 6,
                                 "temperature": 1, "seed": 4})
        assert [c["text"] for c in body["choices"][2 * p:2 * p + 2]] == [c["text"] for c in alone["choices"]]


def test_echo_streams_the_prompt_first(served: Served) -> None:
    whole = client(served).completions.create(model=model(served), prompt=PROMPT, max_tokens=5, temperature=0,
                                              echo=True)
    assert whole.choices[0].text.startswith(PROMPT)
    chunks = list(client(served).completions.create(model=model(served), prompt=PROMPT, max_tokens=5,
                                                    temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
