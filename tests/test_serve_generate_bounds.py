"""`serve` and `generate` decide the bounds of a request by one rule (engine/validation.py).

Over-long input gets the same outcome from both: the same refusal, or the
same output shortened to fit max_seq_len.
"""

from __future__ import annotations

import pytest

from serve_fixtures import Oracle, Served
from trtprompt.engine.errors import EngineRequestError
from trtprompt.prompt.budget import PromptError

pytestmark = pytest.mark.server


def _prompt_of(oracle: Oracle, tokens: int) -> tuple[str, int]:
    """A text prompt of at most `tokens` tokens (BOS included), and its exact token count."""
    words = "lorem ipsum dolor "
    k = tokens // 2
    while len(oracle.tokenizer.encode(words * k)) > tokens:
        k -= 1
    return words * k, len(oracle.tokenizer.encode(words * k))


def _generate_refusal(oracle: Oracle, prompt: str, max_tokens: int) -> str:
    with pytest.raises((EngineRequestError, PromptError)) as err:
        oracle.run(prompt, max_tokens)
    return str(err.value)


def test_max_tokens_no_prompt_leaves_room_for_is_refused_by_both(served: Served, oracle: Oracle) -> None:
    bound = served.engine_info()["max_seq_len"] - 1
    refused = _generate_refusal(oracle, "hi", bound + 1)
    assert f"max_tokens ({bound + 1}) exceeds the engine's maximum output length ({bound}" in refused
    served_error = served.text("hi", bound + 1).error
    assert served_error is not None and refused in served_error


def test_prompt_over_max_input_len_is_refused_by_both(served: Served, oracle: Oracle) -> None:
    limit = served.engine_info()["max_input_len"]
    prompt = "lorem ipsum dolor " * (limit // 2)  # over the limit in tokens, within the edge's byte bound
    refused = _generate_refusal(oracle, prompt, 4)
    assert "exceeds maximum input length" in refused
    served_error = served.text(prompt, 4).error
    assert served_error is not None and refused in served_error


def test_prompt_plus_output_past_max_seq_len_is_shortened_alike(served: Served, oracle: Oracle) -> None:
    info = served.engine_info()
    max_seq = info["max_seq_len"]
    prompt, n = _prompt_of(oracle, min(info["max_input_len"], max_seq - 8))
    generated = oracle.run(prompt, max_seq - 1)
    assert generated.final.num_output_tokens <= max_seq - n  # shortened (or stopped at EOS sooner)
    assert f"output shortened to {max_seq - n} tokens" in generated.final.warning
    result = served.text(prompt, max_seq - 1, temperature=0.0)
    assert result.error is None and result.finished
    assert result.text == generated.text
