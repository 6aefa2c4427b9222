"""SmolLM2-135M-Instruct (the real checkpoint) with issue 37's request features, against transformers:
log probabilities (output top-k and prompt) within 1e-4 of torch.log_softmax of its logits, and beam
search equal to `generate(num_beams=4, do_sample=False)`. Skipped without the model (`make real-model`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_helpers import run_to_completion
from test_engine_logprobs import collect
from test_real_model import EOS, PROMPTS, chat, needs_model
from trtprompt.engine.request import SamplingParams

TOL = 1e-4
pytestmark = [needs_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def loaded(real_fp32_engine: Path, real_hf: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    """(engine, tokenizer, transformers model): this module's own engine, on the session's fp32 build."""
    from trtprompt.generate import load

    engine, tok = load(real_fp32_engine)
    return engine, tok, real_hf[0]


def test_log_probabilities_equal_transformers(loaded: tuple[Any, Any, Any]) -> None:
    engine, tok, model = loaded
    prompt = tok.encode_chat(chat(PROMPTS[0]))
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, prompt_logprobs=2)
    outs = collect(engine, {"r": (prompt, params)})["r"]
    tokens = [t for o in outs for t in o.new_token_ids]
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    for j, lp in enumerate(lp for o in outs for lp in o.logprobs or []):
        row = expected[len(prompt) - 1 + j]
        assert abs(lp.logprob - row[lp.token_id].item()) < TOL
        assert [t for t, _ in lp.top] == torch.topk(row, 5).indices.tolist()
    scored = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    err = max(abs(scored[p].logprob - expected[p - 1, prompt[p]].item()) for p in range(1, len(prompt)))
    assert err < TOL


@pytest.mark.parametrize("question", PROMPTS[:1])  # one: each search is ~10 s of a 30-layer model
def test_beam_search_equals_transformers(loaded: tuple[Any, Any, Any], question: str) -> None:
    engine, tok, model = loaded
    prompt = tok.encode_chat(chat(question))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=4, num_return_sequences=4, do_sample=False, max_new_tokens=16,
                             length_penalty=1.0, early_stopping=True)
    beams = [row[len(prompt):].tolist() for row in out]
    expected = [b[:b.index(EOS)] if EOS in b else b for b in beams]
    params = SamplingParams(max_tokens=16, beam_width=4, n=4, early_stopping=True)
    got = collect(engine, {"b": (prompt, params)})["b"]
    assert [o.new_token_ids for o in sorted(got, key=lambda o: o.sequence_index)] == expected
    greedy = run_to_completion(engine, {"g": prompt}, SamplingParams(max_tokens=16, temperature=0.0))["g"]
    assert greedy  # the engine still serves plain requests after the search
