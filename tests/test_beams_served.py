"""Beam search through each edge of a real server (`trtprompt serve --max-beam-width 4` over the tiny engine):
TensorRT-LLM's beam_width on the `tensorrt_llm` and `ensemble` models (every beam in one response, with a beam
dimension) and vLLM's use_beam_search on the OpenAI front end (one choice per beam, best first), each equal to
transformers' `generate(num_beams=W, do_sample=False, num_return_sequences=W)` on the served checkpoint; the
bound max_beam_width and the sampling controls beams do not take refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import openai
import pytest
import torch
from engine_helpers import _hf_model
from serve_fixtures import Oracle, Served, Stops, start_server
from serve_fixtures import openai_client as client
from serve_fixtures import openai_model as model

from trtprompt.client import LLMClient, StreamResult, text_inputs, token_inputs

pytestmark = pytest.mark.server
PROMPT = "The quick brown fox"
MAX_BEAM_WIDTH = 4


@pytest.fixture(scope="module")
def beamed(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, stops: Stops) -> Iterator[Served]:
    server = start_server(tiny_engine_dir, tmp_path_factory.mktemp("beams") / "run",
                          "--max-beam-width", str(MAX_BEAM_WIDTH))
    yield server
    stops.server(server)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")  # the checkpoint tiny_engine_dir is built from


def hf_beams(checkpoint: Path, oracle: Oracle, prompt: list[int], width: int, max_new: int,
             length_penalty: float = 1.0, early_stopping: bool | str = False) -> list[list[int]]:
    """transformers' W best beams, best first, each cut before its end token (the engine's end ids)."""
    eos = sorted(oracle.engine.end_ids)
    with torch.no_grad():
        out = _hf_model(str(checkpoint)).generate(
            torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=max_new,
            length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=width,
            eos_token_id=eos, pad_token_id=eos[0], attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    beams = [row[len(prompt):].tolist() for row in out]
    return [next((b[:i] for i, t in enumerate(b) if t in eos), b) for b in beams]


def hf_sum(checkpoint: Path, prompt: list[int], output: list[int]) -> float:
    """The summed log_softmax of output's tokens after prompt."""
    with torch.no_grad():
        logits = _hf_model(str(checkpoint))(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(output))


def text_of(oracle: Oracle, prompt: list[int], ids: list[int]) -> str:
    detok = oracle.tokenizer.stream(prompt)
    return detok.step(ids) + detok.flush()


def infer(served: Served, model: str, inputs: list[Any]) -> StreamResult:
    with LLMClient(served.url) as client:
        return client.infer(model, inputs, 120.0)


def test_token_model_returns_every_beam_in_one_response(beamed: Served, oracle: Oracle, checkpoint: Path) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    expected = hf_beams(checkpoint, oracle, prompt, 3, 10, 0.5, True)
    result = infer(beamed, "tensorrt_llm", token_inputs(prompt, 10, streaming=False, beam_width=3, len_penalty=0.5,
                                                        early_stopping=True, exclude_input_in_output=True,
                                                        return_log_probs=True))
    assert result.error is None and result.finished, result.error
    (response,) = result.responses
    ids, lengths = np.asarray(response["output_ids"]), np.asarray(response["sequence_length"])
    assert ids.shape[:2] == (1, 3) and lengths.shape == (1, 3)  # [batch, beam, tokens], [batch, beam]
    assert [ids[0, k, :lengths[0, k]].tolist() for k in range(3)] == expected
    cum = np.asarray(response["cum_log_probs"])
    assert cum.shape == (1, 3)
    sums = [hf_sum(checkpoint, prompt, beam) for beam in expected]
    assert np.allclose(cum[0], sums, atol=1e-3), (cum, sums)
    assert "output_log_probs" not in response  # no per-token values with beams (docs/triton-inputs.md)


def test_token_model_num_return_sequences_picks_the_best_beams(beamed: Served, oracle: Oracle,
                                                               checkpoint: Path) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    expected = hf_beams(checkpoint, oracle, prompt, 4, 8, early_stopping=False)
    result = infer(beamed, "tensorrt_llm", token_inputs(prompt, 8, streaming=True, beam_width=4,
                                                        early_stopping=False, num_return_sequences=2))
    assert result.error is None and result.finished, result.error
    (response,) = result.responses  # streamed too: the beams come whole, at the end
    ids, lengths = np.asarray(response["output_ids"]), np.asarray(response["sequence_length"])
    assert [ids[0, k, :lengths[0, k]].tolist() for k in range(2)] == expected[:2]


@pytest.mark.parametrize("stream", [False, True])
def test_ensemble_text_output_has_one_text_per_beam(beamed: Served, oracle: Oracle, checkpoint: Path,
                                                    stream: bool) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    expected = hf_beams(checkpoint, oracle, prompt, 3, 12, 1.0, True)
    result = infer(beamed, "ensemble", text_inputs(PROMPT, 12, stream, beam_width=3, exclude_input_in_output=True,
                                                   return_num_output_tokens=True))
    assert result.error is None and result.finished, result.error
    (response,) = result.responses
    texts = np.asarray(response["text_output"])
    assert texts.shape == (1, 3)
    assert [t.decode("utf-8") for t in texts[0]] == [text_of(oracle, prompt, b) for b in expected]
    assert int(np.asarray(response["num_output_tokens"]).reshape(-1)[0]) == sum(len(b) for b in expected)


def test_ensemble_default_returns_prompt_and_output(beamed: Served, oracle: Oracle, checkpoint: Path) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    expected = hf_beams(checkpoint, oracle, prompt, 2, 6, 1.0, True)
    result = infer(beamed, "ensemble", text_inputs(PROMPT, 6, False, beam_width=2))
    assert result.error is None, result.error
    texts = [t.decode("utf-8") for t in np.asarray(result.responses[0]["text_output"])[0]]
    assert texts == [oracle.tokenizer.decode(prompt + b, skip_special_tokens=True) for b in expected]


def test_beam_width_past_max_beam_width_names_both(beamed: Served, oracle: Oracle) -> None:
    result = infer(beamed, "ensemble", text_inputs(PROMPT, 4, beam_width=MAX_BEAM_WIDTH + 1))
    assert result.error is not None
    assert f"input 'beam_width' ({MAX_BEAM_WIDTH + 1}) exceeds max_beam_width ({MAX_BEAM_WIDTH})" in result.error
    prompt = oracle.run(PROMPT, 1).prompt_ids
    tokens = infer(beamed, "tensorrt_llm", token_inputs(prompt, 4, beam_width=MAX_BEAM_WIDTH + 1))
    assert tokens.error is not None and f"exceeds max_beam_width ({MAX_BEAM_WIDTH})" in tokens.error


@pytest.mark.parametrize("name,value,model", [("top_p", 0.9, "ensemble"), ("runtime_top_k", 5, "tensorrt_llm"),
                                              ("stop_words", ["fox"], "ensemble"),
                                              ("num_return_sequences", 3, "ensemble")])
def test_beams_refuse_what_they_do_not_take(beamed: Served, oracle: Oracle, name: str, value: Any,
                                            model: str) -> None:
    if model == "ensemble":
        inputs = text_inputs(PROMPT, 4, beam_width=2, **{name: value})
    else:
        inputs = token_inputs(oracle.run(PROMPT, 1).prompt_ids, 4, beam_width=2, **{name: value})
    result = infer(beamed, model, inputs)
    assert result.error is not None and f"input '{name}'" in result.error, result.error
    beamed.assert_healthy()


def test_openai_use_beam_search_equals_transformers(beamed: Served, oracle: Oracle, checkpoint: Path) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    expected = hf_beams(checkpoint, oracle, prompt, 3, 10, 0.5, "never")
    answer = client(beamed).completions.create(model=model(beamed), prompt=PROMPT, max_tokens=10, n=3,
                                               extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                           "early_stopping": "never"})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [text_of(oracle, prompt, b) for b in expected]
    assert answer.usage.completion_tokens == sum(len(b) for b in expected)


def test_openai_best_of_is_the_beam_width_and_streams(beamed: Served, oracle: Oracle, checkpoint: Path) -> None:
    prompt = oracle.run(PROMPT, 1).prompt_ids
    expected = hf_beams(checkpoint, oracle, prompt, 4, 8)
    chunks = list(client(beamed).completions.create(model=model(beamed), prompt=PROMPT, max_tokens=8, n=2,
                                                    best_of=4, stream=True, extra_body={"use_beam_search": True}))
    texts = ["", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [text_of(oracle, prompt, b) for b in expected[:2]]


def test_openai_beams_refuse_sampling_controls_by_name(beamed: Served) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(beamed).completions.create(model=model(beamed), prompt=PROMPT, max_tokens=4, n=2, top_p=0.5,
                                          extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as err:
        client(beamed).chat.completions.create(model=model(beamed), max_tokens=4, n=2, logprobs=True,
                                               messages=[{"role": "user", "content": "hi"}],
                                               extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "logprobs"
