"""Log probabilities (issue 37): the chosen token's and the top-k, of outputs and of prompts, equal
torch.log_softmax of transformers' logits for the same prefix, greedy and sampled, chunked and with
reuse on."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from engine_helpers import _hf_model, make_engine, make_hf_model, run_to_completion
from test_engine_parity import check_block_refs
from trtprompt.engine.request import RequestOutput, SamplingParams

TOL = 1e-4
PROMPT = list(range(5, 42))  # 37 tokens: four full blocks of 8 and a partial one


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_path(request, tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), request.param)


@lru_cache(maxsize=None)
def _oracle(path: str, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def oracle(path: Path, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row p scores token p + 1."""
    return _oracle(str(path), tuple(tokens))


def collect(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        check_block_refs(engine)
    assert not engine.has_unfinished_requests()
    for rid, seen in outs.items():
        assert sum(o.finished for o in seen) == 1, f"{rid} ends exactly once"
    return outs


def check_output_logprobs(path: Path, prompt: list[int], outs: list[RequestOutput], k: int) -> list[int]:
    tokens = [t for o in outs for t in o.new_token_ids]
    entries = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in entries] == tokens
    expected = oracle(path, prompt + tokens)
    for j, lp in enumerate(entries):
        row = expected[len(prompt) - 1 + j]
        assert abs(lp.logprob - row[lp.token_id].item()) < TOL
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == torch.topk(row, k).indices.tolist()
        assert all(abs(v - row[t].item()) < TOL for t, v in lp.top)
    assert abs(outs[-1].cum_logprob - sum(lp.logprob for lp in entries)) < 1e-9
    return tokens


@pytest.mark.parametrize("chunked,max_num_tokens", [(True, 16), (False, 256)])
def test_output_logprobs_match_transformers_greedy_and_sampled(model_path, chunked, max_num_tokens):
    engine = make_engine(model_path, chunked=chunked, max_num_tokens=max_num_tokens)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    sampled = SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=3, logprobs=2, repetition_penalty=1.3)
    outs = collect(engine, {"g": (PROMPT, greedy), "s": (PROMPT[:20], sampled), "plain": (PROMPT[3:], greedy)})
    check_output_logprobs(model_path, PROMPT, outs["g"], 5)
    # Sampled with temperature and a penalty: the values are still the raw model's (docs/logprobs.md).
    check_output_logprobs(model_path, PROMPT[:20], outs["s"], 2)


def test_prompt_logprobs_match_transformers_with_a_warm_cache_and_chunks(model_path):
    engine = make_engine(model_path, chunked=True, max_num_tokens=16)
    run_to_completion(engine, {"warm": PROMPT}, SamplingParams(max_tokens=2))  # PROMPT's blocks now cached
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3, logprobs=0)
    outs = collect(engine, {"p": (PROMPT, params)})["p"]
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1, "prompt log probabilities come once"
    scored = firsts[0]
    assert len(scored) == len(PROMPT) and scored[0] is None
    expected = oracle(model_path, PROMPT)
    for p in range(1, len(PROMPT)):
        entry = scored[p]
        assert entry is not None and entry.token_id == PROMPT[p]
        assert abs(entry.logprob - expected[p - 1, PROMPT[p]].item()) < TOL
        assert [t for t, _ in entry.top] == torch.topk(expected[p - 1], 3).indices.tolist()
    # Every prompt position was computed (a request scoring its prompt cannot take cached blocks).
    assert outs[-1].stats.prefill_tokens_computed == len(PROMPT)
    assert outs[-1].stats.kv_cache_reused_blocks == 0


def test_max_tokens_zero_scores_the_prompt_only(model_path):
    engine = make_engine(model_path)
    outs = collect(engine, {"score": (PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))})["score"]
    assert [o.new_token_ids for o in outs] == [[]]
    assert outs[0].finished and outs[0].finish_reason.value == "length"
    scored = outs[0].prompt_logprobs
    expected = oracle(model_path, PROMPT)
    total = sum(expected[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT)))
    assert abs(sum(e.logprob for e in scored[1:]) - total) < 1e-3
    assert all(e.top == () for e in scored[1:])


def test_logprobs_are_refused_past_their_bound():
    from trtprompt.error_codes import FieldError

    with pytest.raises(FieldError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(FieldError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=0)


def test_the_end_token_that_finishes_a_sequence_keeps_its_log_probability(model_path):
    """Not in the output (TensorRT-LLM's rule), but reported: a client scoring a continuation needs it."""
    engine = make_engine(model_path)
    plain = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    first = collect(engine, {"a": (PROMPT, plain)})["a"]
    end = [t for o in first for t in o.new_token_ids][2]  # make the third greedy token the end token
    outs = collect(engine, {"b": (PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, end_id=end))})["b"]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 2 and outs[-1].finish_reason.value == "stop"
    last = outs[-1].end_logprob
    expected = oracle(model_path, PROMPT + tokens)[-1]
    assert last is not None and last.token_id == end and abs(last.logprob - expected[end].item()) < TOL
    assert [o.end_logprob for o in first] == [None] * len(first)  # finished by length: none


def test_context_and_generation_logits_are_the_raw_logits(model_path):
    """TensorRT-LLM's return_context_logits / return_generation_logits: float32, before any processing."""
    engine = make_engine(model_path, chunked=True, max_num_tokens=16)
    run_to_completion(engine, {"warm": PROMPT}, SamplingParams(max_tokens=2))  # cached blocks must not be taken
    params = SamplingParams(max_tokens=5, temperature=0.8, top_k=5, seed=1, repetition_penalty=1.5,
                            return_context_logits=True, return_generation_logits=True)
    outs = collect(engine, {"r": (PROMPT, params)})["r"]
    tokens = [t for o in outs for t in o.new_token_ids]
    with torch.no_grad():
        expected = _hf_model(str(model_path))(torch.tensor([PROMPT + tokens])).logits[0].float()
    context = [o.context_logits for o in outs if o.context_logits is not None]
    assert len(context) == 1 and context[0].shape == (len(PROMPT), expected.shape[1])
    assert torch.allclose(context[0], expected[:len(PROMPT)], atol=1e-4)
    generation = torch.cat([o.generation_logits for o in outs if o.generation_logits is not None])
    assert generation.shape == (len(tokens), expected.shape[1])
    assert torch.allclose(generation, expected[len(PROMPT) - 1:len(PROMPT) - 1 + len(tokens)], atol=1e-4)


def test_logits_past_their_bound_are_refused(model_path, monkeypatch):
    from trtprompt.engine import validation
    from trtprompt.error_codes import FieldError

    monkeypatch.setattr(validation, "MAX_LOGITS_BYTES", 10 * 256 * 4)  # ten rows of this vocabulary
    engine = make_engine(model_path)
    with pytest.raises(FieldError, match=r"return_context_logits asks for 37 x 256 float32 logits \(37888 bytes\)"):
        engine.add_request("c", PROMPT, SamplingParams(max_tokens=2, return_context_logits=True))
    with pytest.raises(FieldError, match="return_generation_logits asks for 11 x 256 .* a shorter max_tokens"):
        engine.add_request("g", PROMPT, SamplingParams(max_tokens=11, return_generation_logits=True))
    engine.add_request("ok", PROMPT, SamplingParams(max_tokens=10, return_generation_logits=True))
