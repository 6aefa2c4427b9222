"""TensorRT-LLM's return_context_logits / return_generation_logits on the torch target's Triton models
(`ensemble` and `tensorrt_llm`), against the real server (tests/serve_fixtures.py).

The logits are checked against transformers' logits of the served checkpoint: context_logits
[1, prompt tokens, vocab] are the prompt positions' rows, generation_logits [1, 1, tokens, vocab] the rows
that chose each output token (raw: before temperature, penalties or bias; docs/triton-inputs.md).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from engine_helpers import _hf_model
from serve_fixtures import Oracle, Served
from trtprompt.client import LLMClient, StreamResult, make_input, token_inputs
from trtprompt.error_codes import BadRequestError
from trtprompt.serve.triton_models.inputs import parse_token_item
from trtprompt.serve.wire.engine_client import coalesce
from trtprompt.serve.wire.outputs import logits_of

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox"
TOL = 1e-4
BOTH = {"return_context_logits": True, "return_generation_logits": True}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")  # the checkpoint tiny_engine_dir is built from


def _hf_logits(checkpoint: Path, ids: list[int]) -> np.ndarray[Any, Any]:
    """transformers' logits at every position of ids, [positions, vocab] float32."""
    with torch.no_grad():
        return _hf_model(str(checkpoint))(torch.tensor([ids])).logits[0].float().numpy()


def _context(responses: list[dict[str, Any]]) -> np.ndarray[Any, Any]:
    """The one context_logits a sequence's responses carry: on the first of them."""
    carrying = [i for i, r in enumerate(responses) if "context_logits" in r]
    assert carrying == [0], carrying
    return np.asarray(responses[0]["context_logits"])


def _generation(responses: list[dict[str, Any]]) -> np.ndarray[Any, Any]:
    """Every response's generation_logits [1, 1, tokens, vocab], concatenated along the tokens."""
    assert all("generation_logits" in r for r in responses)
    parts = [np.asarray(r["generation_logits"]) for r in responses]
    assert all(p.ndim == 4 and p.shape[:2] == (1, 1) and p.dtype == np.float32 for p in parts)
    return np.concatenate(parts, axis=2)


def _check(responses: list[dict[str, Any]], checkpoint: Path, prompt: list[int], output: list[int],
           context: bool = True) -> None:
    """The responses' logits equal transformers' for this prompt and output, shaped as TensorRT-LLM's."""
    expected = _hf_logits(checkpoint, prompt + output)
    if context:
        got = _context(responses)
        assert got.shape == (1, len(prompt), expected.shape[1]) and got.dtype == np.float32
        assert np.allclose(got[0], expected[:len(prompt)], atol=TOL), np.abs(got[0] - expected[:len(prompt)]).max()
    gen = _generation(responses)
    rows = expected[len(prompt) - 1:len(prompt) - 1 + len(output)]
    assert gen.shape == (1, 1, len(output), expected.shape[1])
    assert np.allclose(gen[0, 0], rows, atol=TOL), np.abs(gen[0, 0] - rows).max()


def _ok(result: StreamResult) -> StreamResult:
    assert result.error is None, result.error
    assert result.finished
    return result


def _by_sequence(result: StreamResult) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in result.responses:
        out.setdefault(int(np.asarray(r["sequence_index"]).reshape(-1)[0]), []).append(r)
    return out


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_ensemble_logits_match_transformers(served: Served, oracle: Oracle, checkpoint: Path, stream: bool) -> None:
    gen = oracle.run(PROMPT, 8)
    result = _ok(served.text(PROMPT, 8, stream=stream, temperature=0.0, **BOTH))
    assert result.text
    if not stream:
        assert len(result.responses) == 1  # everything at the end
    _check(result.responses, checkpoint, gen.prompt_ids, gen.output_ids)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_token_model_logits_match_transformers(served: Served, oracle: Oracle, checkpoint: Path,
                                               stream: bool) -> None:
    gen = oracle.run(PROMPT, 8)
    result = _ok(served.tokens(gen.prompt_ids, 8, streaming=stream, temperature=0.0,
                               exclude_input_in_output=True, **BOTH))
    assert result.output_ids == gen.output_ids
    if stream:  # each response's rows are its own tokens'
        assert [np.asarray(r["generation_logits"]).shape[2] for r in result.responses] == [
            np.asarray(r["output_ids"]).size for r in result.responses]
    _check(result.responses, checkpoint, gen.prompt_ids, gen.output_ids)


def _infer(served: Served, inputs: list[Any]) -> StreamResult:
    with LLMClient(served.url) as client:
        return _ok(client.infer("tensorrt_llm", inputs, 60.0))


def test_logits_are_raw_whatever_the_sampling(served: Served, oracle: Oracle, checkpoint: Path) -> None:
    """Temperature, penalties and bias change the choice, never the logits returned (TensorRT-LLM's rule)."""
    prompt = oracle.run(PROMPT, 1).prompt_ids
    bias = np.zeros((1, oracle.tokenizer.vocab_size), dtype=np.float32)
    bias[0, 7] = 5.0
    result = _infer(served, token_inputs(prompt, 6, temperature=0.7, runtime_top_k=5, repetition_penalty=1.5,
                                         exclude_input_in_output=True, return_generation_logits=True)
                    + [make_input("random_seed", 3, np.uint64), make_input("embedding_bias", bias, np.float32)])
    assert not any("context_logits" in r for r in result.responses)  # not asked for
    _check(result.responses, checkpoint, prompt, result.output_ids, context=False)


def test_each_sequence_carries_its_own_generation_logits(served: Served, oracle: Oracle, checkpoint: Path) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    result = _infer(served, token_inputs(prompt, 6, num_return_sequences=3, exclude_input_in_output=True,
                                         temperature=1.0, runtime_top_p=0.95, **BOTH)
                    + [make_input("random_seed", 5, np.uint64)])
    seqs = _by_sequence(result)
    assert sorted(seqs) == [0, 1, 2]
    outputs = {k: [int(t) for r in rs for t in np.asarray(r["output_ids"]).reshape(-1)] for k, rs in seqs.items()}
    assert len({tuple(o) for o in outputs.values()}) > 1  # sampled apart: the rows must be each one's own
    for k, responses in seqs.items():  # the prompt's logits once, with sequence 0
        _check(responses, checkpoint, prompt, outputs[k], context=k == 0)
        assert k == 0 or not any("context_logits" in r for r in responses)


def test_no_logits_unless_asked(served: Served) -> None:
    result = _ok(served.text(PROMPT, 4, temperature=0.0, return_log_probs=True))
    assert not any(name in r for r in result.responses for name in ("context_logits", "generation_logits"))


def test_only_the_outputs_the_client_names(served: Served, oracle: Oracle) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    result = _ok(served.tokens(prompt, 4, outputs=["output_ids", "generation_logits"], **BOTH))
    assert all(set(r) == {"output_ids", "generation_logits"} for r in result.responses)


def test_beam_search_refuses_the_logits_naming_the_input() -> None:
    """The engine computes no per-token rows for beams (TensorRT-LLM returns [beams, tokens, vocab]): refused
    where the request is read, naming the client's input."""
    tensors = {"input_ids": np.array([[1, 2, 3]], np.int32), "input_lengths": np.array([[3]], np.int32),
               "request_output_len": np.array([[4]], np.int32), "beam_width": np.array([[2]], np.int32)}
    for name in ("return_context_logits", "return_generation_logits"):
        with pytest.raises(BadRequestError, match=f"input '{name}': {name} is not supported with beam search"):
            parse_token_item(tensors | {name: np.array([[True]])}, 0, False, max_beam_width=2)


def _wire(rows: np.ndarray[Any, Any]) -> dict[str, Any]:
    """Logits in the engine protocol's form (serve/wire/outputs.py)."""
    data = base64.b64encode(rows.astype("<f4").tobytes()).decode("ascii")
    return {"rows": rows.shape[0], "cols": rows.shape[1], "f32": data}


def _rows(entry: dict[str, Any], name: str) -> np.ndarray[Any, Any]:
    got = logits_of(entry, name)
    assert got is not None
    return np.frombuffer(got.data, "<f4").reshape(got.rows, got.cols)


def test_a_behind_reader_joins_each_sequences_generation_logits() -> None:
    """coalesce (the stub's reader, behind the engine) merges a sequence's entries: its rows stay whole, in order,
    apart from the other sequence's, and the prompt's logits are kept."""
    rows = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) - 7.5
    context = -rows[:2]

    def entry(seq: int, ids: list[int], part: np.ndarray[Any, Any], **extra: Any) -> dict[str, Any]:
        fields = {"id": "7", "seq": seq, "new_token_ids": ids, "finished": False, "generation_logits": _wire(part)}
        return fields | extra

    steps = [{"outputs": [entry(0, [1], rows[:1], context_logits=_wire(context)), entry(1, [9], rows[4:])]},
             {"outputs": [entry(0, [2, 3], rows[1:3])]}, {"outputs": [entry(0, [4], rows[3:4], finished=True)]}]
    first, second = sorted(coalesce(steps), key=lambda e: e["seq"])
    assert first["new_token_ids"] == [1, 2, 3, 4] and first["finished"]
    assert np.array_equal(_rows(first, "generation_logits"), rows[:4])
    assert np.array_equal(_rows(first, "context_logits"), context)
    assert np.array_equal(_rows(second, "generation_logits"), rows[4:]) and "context_logits" not in second
