"""TensorRT-LLM's return_log_probs, num_return_sequences, bad words and embedding bias on the torch target's
Triton models (`ensemble` and `tensorrt_llm`), against the real server (tests/serve_fixtures.py).

Log probabilities are checked against transformers' logits of the served checkpoint (raw log_softmax
of the chosen tokens, docs/triton-inputs.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from engine_helpers import _hf_model
from serve_fixtures import Oracle, Served
from trtprompt.client import LLMClient, StreamResult, make_input, text_inputs, token_inputs

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox"
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 11}


def _hf_logprobs(checkpoint: Path, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log_softmax of transformers' logits at each output position, for the token chosen there."""
    model = _hf_model(str(checkpoint))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    start = len(prompt_ids) - 1
    return [lp[start + j, t].item() for j, t in enumerate(output_ids)]


def _logprobs(result: StreamResult) -> list[float]:
    return [float(v) for r in result.responses if "output_log_probs" in r
            for v in np.asarray(r["output_log_probs"]).reshape(-1)]


def _by_sequence(result: StreamResult) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in result.responses:
        out.setdefault(int(np.asarray(r["sequence_index"]).reshape(-1)[0]), []).append(r)
    return out


def _text_of(responses: list[dict[str, Any]]) -> str:
    return "".join(np.asarray(r["text_output"]).reshape(-1)[0].decode("utf-8") for r in responses)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")  # the checkpoint tiny_engine_dir is built from


def _infer(served: Served, model: str, inputs: list[Any]) -> StreamResult:
    with LLMClient(served.url) as client:
        result = client.infer(model, inputs, 60.0)
    assert result.error is None, result.error
    assert result.finished
    return result


def test_ensemble_streamed_log_probs_match_transformers(served: Served, oracle: Oracle, checkpoint: Path) -> None:
    gen = oracle.run(PROMPT, 12)
    result = served.text(PROMPT, 12, temperature=0.0, return_log_probs=True)
    assert result.error is None, result.error
    assert result.text == gen.text
    expected = _hf_logprobs(checkpoint, gen.prompt_ids, gen.output_ids)
    got = _logprobs(result)
    assert len(got) == len(gen.output_ids)
    assert np.allclose(got, expected, atol=1e-4), (got, expected)
    # Each response's cum_log_probs is the sum over the output so far; the last one over all of it.
    assert abs(result.last("cum_log_probs") - sum(expected)) < 1e-4 * len(expected)
    assert np.asarray(result.responses[0]["output_log_probs"]).ndim == 3  # [batch, beam, tokens]


def test_ensemble_non_streamed_log_probs_cover_the_whole_output(served: Served, oracle: Oracle,
                                                                checkpoint: Path) -> None:
    gen = oracle.run(PROMPT, 8)
    result = served.text(PROMPT, 8, stream=False, temperature=0.0, return_log_probs=True)
    assert result.error is None, result.error
    assert len(result.responses) == 1
    expected = _hf_logprobs(checkpoint, gen.prompt_ids, gen.output_ids)
    assert np.allclose(_logprobs(result), expected, atol=1e-4)
    assert abs(result.last("cum_log_probs") - sum(expected)) < 1e-3


def test_no_log_probs_unless_asked(served: Served) -> None:
    result = served.text(PROMPT, 4, temperature=0.0)
    assert result.error is None, result.error
    assert not any("output_log_probs" in r or "cum_log_probs" in r for r in result.responses)


def test_token_model_log_probs_match_transformers(served: Served, oracle: Oracle, checkpoint: Path) -> None:
    gen = oracle.run(PROMPT, 10)
    result = served.tokens(gen.prompt_ids, 10, temperature=0.0, return_log_probs=True)
    assert result.error is None, result.error
    assert result.output_ids == gen.output_ids
    expected = _hf_logprobs(checkpoint, gen.prompt_ids, gen.output_ids)
    assert np.allclose(_logprobs(result), expected, atol=1e-4)
    assert abs(result.last("cum_log_probs") - sum(expected)) < 1e-3


def test_ensemble_num_return_sequences_each_in_its_own_responses(served: Served, oracle: Oracle) -> None:
    with LLMClient(served.url) as client:
        whole = client.infer("ensemble", text_inputs(PROMPT, 12, stream=False, num_return_sequences=3,
                                                      return_log_probs=True, **SAMPLED), 60.0)
        assert whole.error is None and whole.finished, whole.error
        # Not streamed: one response per sequence, when it ends, with its own sequence_index.
        seqs = _by_sequence(whole)
        assert sorted(seqs) == [0, 1, 2] and all(len(r) == 1 for r in seqs.values())
        assert len({_text_of(r) for r in seqs.values()}) > 1  # sampled apart
        assert all(int(np.asarray(r["batch_index"]).reshape(-1)[0]) == 0 for r in whole.responses)
        # Exactly one final response: nothing of the last request reaches the next on this stream.
        after = client.infer("ensemble", text_inputs(PROMPT, 6, temperature=0.0), 60.0)
    assert after.error is None, after.error
    assert sorted(_by_sequence(after)) == [0]
    assert after.text == oracle.text(PROMPT, 6)


def test_ensemble_num_return_sequences_streamed(served: Served) -> None:
    result = served.text(PROMPT, 10, num_return_sequences=3, return_log_probs=True,
                         return_num_output_tokens=True, **SAMPLED)
    assert result.error is None and result.finished, result.error
    seqs = _by_sequence(result)
    assert sorted(seqs) == [0, 1, 2]
    for responses in seqs.values():
        assert _text_of(responses)
        n_lp = sum(np.asarray(r["output_log_probs"]).size for r in responses)
        assert n_lp == int(np.asarray(responses[-1]["num_output_tokens"]).reshape(-1)[0])


def test_token_model_num_return_sequences(served: Served, oracle: Oracle) -> None:
    gen = oracle.run(PROMPT, 8)
    result = _infer(served, "tensorrt_llm", token_inputs(gen.prompt_ids, 8, streaming=False,
                                                         num_return_sequences=3, exclude_input_in_output=True,
                                                         temperature=1.0, runtime_top_p=0.95)
                    + [make_input("random_seed", 4, np.uint64)])
    seqs = _by_sequence(result)
    assert sorted(seqs) == [0, 1, 2] and all(len(r) == 1 for r in seqs.values())
    outs = {tuple(np.asarray(r[0]["output_ids"]).reshape(-1).tolist()) for r in seqs.values()}
    assert len(outs) > 1 and all(len(o) > 0 for o in outs)


def _first_word(oracle: Oracle, max_tokens: int) -> tuple[str, list[int], list[int]]:
    """The greedy output's first word (with its leading space, as generated), its ids and the output ids."""
    gen = oracle.run(PROMPT, max_tokens)
    word = gen.text.split()[0]
    word = gen.text[:gen.text.index(word) + len(word)]
    ids = oracle.tokenizer.encode(word, add_special_tokens=False)
    assert gen.output_ids[:len(ids)] == ids, "the greedy output starts with its first word's tokens"
    return word, ids, gen.output_ids


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_are_never_generated(served: Served, oracle: Oracle) -> None:
    word, ids, greedy = _first_word(oracle, 12)
    prompt_ids = oracle.run(PROMPT, 1).prompt_ids
    flat = np.array([[ids, [len(ids)] + [-1] * (len(ids) - 1)]], dtype=np.int32)  # [1, 2, L]
    tokens = served.tokens(prompt_ids, 12, temperature=0.0, bad_words_list=flat)
    assert tokens.error is None, tokens.error
    assert not _contains(tokens.output_ids, ids) and tokens.output_ids != greedy
    text = served.text(PROMPT, 12, temperature=0.0, bad_words=[word])
    assert text.error is None, text.error
    detok = oracle.tokenizer.stream(prompt_ids)
    assert text.text == detok.step(tokens.output_ids) + detok.flush()
    assert not text.text.startswith(word)


def test_embedding_bias_forces_a_token(served: Served, oracle: Oracle) -> None:
    tok = oracle.tokenizer
    forced = tok.encode("x", add_special_tokens=False)
    assert len(forced) == 1
    gen = oracle.run(PROMPT, 6)
    bias = np.zeros((1, tok.vocab_size), dtype=np.float32)
    bias[0, forced[0]] = 1000.0
    tokens = _infer(served, "tensorrt_llm", token_inputs(gen.prompt_ids, 6, temperature=0.0)
                    + [make_input("embedding_bias", bias, np.float32)])
    assert tokens.output_ids == forced * 6
    inputs = text_inputs(PROMPT, 6, temperature=0.0) + [
        make_input("embedding_bias_words", ["x", "quick"]),
        make_input("embedding_bias_weights", np.array([[1000.0, -5.0]]), np.float32)]
    text = _infer(served, "ensemble", inputs)
    detok = tok.stream(gen.prompt_ids)
    assert text.text == detok.step(forced * 6) + detok.flush()


def test_mismatched_embedding_bias_names_both_inputs(served: Served) -> None:
    inputs = text_inputs(PROMPT, 4) + [make_input("embedding_bias_words", ["a", "b"]),
                                       make_input("embedding_bias_weights", np.array([[1.0]]), np.float32)]
    with LLMClient(served.url) as client:
        result = client.infer("ensemble", inputs, 60.0)
    assert result.error is not None
    assert "'embedding_bias_words' (2 words)" in result.error and "'embedding_bias_weights' (1 weights)" in result.error
    with LLMClient(served.url) as client:
        bad = client.infer("tensorrt_llm", token_inputs([1, 2, 3], 4)
                           + [make_input("embedding_bias", np.ones((1, 5)), np.float32)], 60.0)
    assert bad.error is not None and "input 'embedding_bias' must hold one bias per vocabulary entry" in bad.error

