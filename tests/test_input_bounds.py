"""The serving edge refuses what cannot work before any engine work (issue 11): pure parsing
(trtprompt.serve.triton_models.inputs) and the prompt edge's byte bound (trtprompt.prompt.edge)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from trtprompt.error_codes import RequestError
from trtprompt.prompt.budget import PromptError, PromptPolicy
from trtprompt.prompt.edge import PromptEdge
from trtprompt.serve.triton_models import inputs
from trtprompt.tokenizer import Tokenizer


def _text(**extra: object) -> dict[str, np.ndarray]:
    t = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32)}
    for name, value in extra.items():
        t[name] = np.array([[value]], dtype=np.float32 if isinstance(value, float) else np.int32)
    return t


def _tokens(ids: list[int], length: int, **extra: object) -> dict[str, np.ndarray]:
    t = {"input_ids": np.array([ids], dtype=np.int32).reshape(1, -1),
         "input_lengths": np.array([[length]], dtype=np.int32),
         "request_output_len": np.array([[4]], dtype=np.int32)}
    for name, value in extra.items():
        t[name] = np.array([[value]], dtype=np.float32)
    return t


@pytest.mark.parametrize("name, value, message", [
    ("temperature", math.nan, "input 'temperature' must be a finite number in [0, 100], got nan"),
    ("temperature", math.inf, "input 'temperature' must be a finite number in [0, 100], got inf"),
    ("temperature", -1.0, "input 'temperature' must be a finite number in [0, 100], got -1.0"),
    ("top_p", 1.5, "input 'top_p' must be a finite number in [0, 1], got 1.5"),
    ("repetition_penalty", math.nan, "input 'repetition_penalty' must be a finite number in (0, 100], got nan"),
    ("presence_penalty", -math.inf, "input 'presence_penalty' must be a finite number in [-100, 100], got -inf"),
    ("frequency_penalty", math.inf, "input 'frequency_penalty' must be a finite number in [-100, 100], got inf"),
    ("length_penalty", math.nan, "input 'length_penalty' must be a finite number in [-100, 100], got nan"),
    ("top_k", -2, "input 'top_k': top_k must be >= 0, got -2"),
    ("min_tokens", -1, "input 'min_tokens': min_tokens must be >= 0, got -1"),
])
def test_text_sampling_values_are_refused_naming_the_input(name, value, message):
    with pytest.raises(RequestError) as err:
        inputs.parse_text_item(_text(**{name: value}), 0, False)
    assert str(err.value) == message


def test_token_inputs_use_the_clients_names():
    with pytest.raises(RequestError, match=r"^input 'runtime_top_p' must be a finite number in \[0, 1\], got nan$"):
        inputs.parse_token_item(_tokens([1, 2], 2, runtime_top_p=math.nan), 0, False, 100)
    with pytest.raises(RequestError, match=r"^input 'len_penalty' must be a finite"):
        inputs.parse_token_item(_tokens([1, 2], 2, len_penalty=math.inf), 0, False, 100)


def test_missing_empty_and_too_many_input_ids():
    with pytest.raises(RequestError, match="^input 'text_input' is required$"):
        inputs.batch_size({"max_tokens": np.array([[4]])}, "text_input", "messages")
    with pytest.raises(RequestError, match="^input 'input_ids' is empty: at least one token id is required$"):
        inputs.parse_token_item(_tokens([], 0), 0, False, 100)
    with pytest.raises(RequestError) as err:
        inputs.parse_token_item(_tokens(list(range(101)), 101), 0, False, 100)
    assert str(err.value) == ("input 'input_ids': Prompt length (101) exceeds maximum input length "
                              "(100, the engine's max_input_len)")
    assert inputs.parse_token_item(_tokens(list(range(100)), 100), 0, False, 100).prompt_token_ids == tuple(range(100))


@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


def test_longest_token_bounds_every_token(tok: Tokenizer):
    lengths = [len(tok.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(tok.vocab_size)]
    assert tok.max_token_bytes == max(4, *lengths)


def test_text_past_the_byte_bound_is_refused_before_tokenizing(tok: Tokenizer):
    edge = PromptEdge(PromptPolicy("reject"), tok, True, lambda: (64, 128))
    bound = 64 * tok.max_token_bytes
    assert edge.text_byte_bound() == bound
    with pytest.raises(PromptError) as err:
        edge.fit_text("a" * (bound + 1), 4)
    assert str(err.value) == (f"input 'text_input' is {bound + 1} bytes, more than the {bound} bytes that "
                              f"max_input_len (64) tokens can hold (this tokenizer's longest token is "
                              f"{tok.max_token_bytes} bytes); it was not tokenized")
    # At the bound it is tokenized and the token rule speaks (with its own numbers).
    with pytest.raises(PromptError, match=r"^Prompt length \(\d+\) exceeds maximum input length \(64\)"):
        edge.fit_text("a b " * (bound // 4), 4)


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_middle"])
def test_truncating_policies_keep_the_same_tokens_from_a_precut_window(tok: Tokenizer, policy: str):
    edge = PromptEdge(PromptPolicy(policy, output_reserve=0), tok, True, lambda: (64, 128))
    words = " ".join(f"w{i % 97}" for i in range(40_000))  # far past the bound
    assert len(words.encode()) > 2 * edge.text_byte_bound()
    full = edge.budget().fit(tok.encode(words), 4)
    assert edge.fit_text(words, 4).ids == full.ids
