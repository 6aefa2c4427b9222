"""Speculative decoding in the engine (engine/speculation/, docs/speculative-decoding.md): drafts verified in one
step change no greedy token, logprob, stop or length; rejected drafts leave no KV behind; preemption, n > 1,
grammars and opt-outs stay right; a request drafts only from its own tokens and same-salt requests."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jsonschema
import pytest
import torch
from engine_helpers import make_engine, make_hf_model, run_to_completion

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import FinishReason, SamplingParams
from trtprompt.engine.speculation.config import SpeculationConfig

SPEC = SpeculationConfig(max_draft_len=5, max_concurrency=None)
# Prompts that repeat themselves: their continuations are drafted from their own tokens.
PROMPTS = {f"r{i}": [5 + (j * 7 + i) % 40 for j in range(24)] * 2 + [9] * i for i in range(4)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("spec"), "llama")


def sequences(engine: LLMEngine, params: SamplingParams, prompts: dict[str, list[int]] = PROMPTS,
              tag: str = "") -> dict[tuple[str, int], list[int]]:
    """Every sequence's output tokens, by (prompt name, sequence index); tag makes the request ids new."""
    got: dict[tuple[str, int], list[int]] = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid + tag, prompt, params)
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got.setdefault((out.request_id.removesuffix(tag) if tag else out.request_id, out.sequence_index),
                           []).extend(out.new_token_ids)
    assert not engine.has_unfinished_requests()
    return got


def twice(engine: LLMEngine, params: SamplingParams, prompts: dict[str, list[int]] = PROMPTS) -> dict[
        tuple[str, int], list[int]]:
    """The prompts run, then run again: the second time the public pool holds the first answers, so drafts are
    right for long runs (a random tiny model's answers do not repeat its prompt on their own)."""
    first = sequences(engine, params, prompts)
    assert sequences(engine, params, prompts, tag="-again") == first
    return first


def test_greedy_tokens_equal_those_without_speculation(llama: Path) -> None:
    for params in (SamplingParams(max_tokens=40, temperature=0.0),
                   SamplingParams(max_tokens=33, stop_token_ids=((12, 19),), min_tokens=3),
                   SamplingParams(max_tokens=25, repetition_penalty=1.3, presence_penalty=0.4)):
        base = sequences(make_engine(llama), params)
        spec_engine = make_engine(llama, speculation=SPEC)
        assert twice(spec_engine, params) == base
        stats = spec_engine.stats()
        assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0  # both paths ran
        assert stats.spec_num_drafts < stats.spec_num_draft_tokens
        assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
        assert spec_engine.kv.num_held_blocks == 0


def test_each_accepted_draft_saves_one_step(llama: Path) -> None:
    """One request at a time: the steps it takes are its tokens less the drafts accepted."""
    params = SamplingParams(max_tokens=60, temperature=0.0)
    base, spec = make_engine(llama), make_engine(llama, speculation=SPEC)
    one = {"c": [3, 4, 5, 6, 7, 8, 9, 10] * 12}
    assert twice(spec, params, one) == sequences(base, params, one)
    accepted = spec.stats().spec_num_accepted_tokens
    assert accepted > 30 and spec.iteration_counter == 2 * base.iteration_counter - accepted


def test_logprobs_and_generation_logits_equal_those_without_speculation(llama: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, return_generation_logits=True)
    prompt = PROMPTS["r1"]
    got = {}
    for name, spec in (("base", None), ("spec", SPEC)):
        engine = make_engine(llama, speculation=spec)
        sequences(engine, SamplingParams(max_tokens=30, temperature=0.0), {"warm": prompt})  # fills the pool
        engine.add_request("x", prompt, params)
        outs = [o for _ in range(200) if engine.has_unfinished_requests() for o in engine.step()]
        got[name] = ([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.logprobs or []],
                     torch.cat([o.generation_logits for o in outs if o.generation_logits is not None]))
        if spec is not None:
            assert engine.stats().spec_num_accepted_tokens > 0
    assert got["spec"][0] == got["base"][0]
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got["spec"][1]] == \
        [(lp.token_id, [t for t, _ in lp.top]) for lp in got["base"][1]]
    assert [lp.logprob for lp in got["spec"][1]] == pytest.approx([lp.logprob for lp in got["base"][1]], abs=1e-4)
    torch.testing.assert_close(got["spec"][2], got["base"][2], atol=1e-4, rtol=1e-4)


def test_max_tokens_is_never_passed_and_drafts_leave_no_block_behind(llama: Path) -> None:
    engine = make_engine(llama, speculation=SPEC)
    for i, n in enumerate((1, 2, 3, 7)):
        engine.add_request(f"m{i}", [3, 4, 5, 6] * 10, SamplingParams(max_tokens=n, temperature=0.0, end_id=255))
    lengths: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[out.request_id] = lengths.get(out.request_id, 0) + len(out.new_token_ids)
        for req in engine.requests.values():  # after each step: no block held for a rejected draft's KV
            assert len(engine.kv.block_tables.get(req.request_id, ())) <= engine.kv.blocks_for(req.num_tokens)
    assert lengths == {"m0": 1, "m1": 2, "m2": 3, "m3": 7}
    assert engine.kv.num_held_blocks == 0


def test_preempted_and_forked_requests_keep_their_tokens(llama: Path) -> None:
    """max_utilization on a small pool preempts; n > 1 forks sequences that each speculate."""
    params = SamplingParams(max_tokens=40, temperature=0.0, n=2)
    small = dict(policy="max_utilization", kv_tokens=160, tokens_per_block=8)
    base = make_engine(llama, **small)
    spec = make_engine(llama, speculation=SPEC, **small)
    assert twice(spec, params) == sequences(base, params)
    assert spec.scheduler.num_preemptions > 0 and spec.stats().spec_num_accepted_tokens > 0


def test_a_request_may_opt_out_and_speculation_pauses_above_its_concurrency(llama: Path) -> None:
    engine = make_engine(llama, speculation=SPEC)
    engine.add_request("out", PROMPTS["r0"], SamplingParams(max_tokens=20, temperature=0.0,
                                                             speculative_decoding=False))
    req = engine.requests["out"]
    run_to_completion(engine, {}, SamplingParams())
    assert req.stats.num_draft_tokens == 0 and engine.stats().spec_num_drafts == 0
    paused = make_engine(llama, speculation=dataclasses.replace(SPEC, max_concurrency=1))
    sequences(paused, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              {"a": PROMPTS["r0"], "b": PROMPTS["r0"]})
    both = paused.stats().spec_num_drafts
    sequences(paused, SamplingParams(max_tokens=20, temperature=0.0), {"c": PROMPTS["r0"]})
    assert both == 0 and paused.stats().spec_num_drafts > 0


def test_guided_requests_hold_to_their_grammar_with_speculation(
        tiny_checkpoint_factory: Callable[..., Path]) -> None:
    checkpoint = tiny_checkpoint_factory("llama")
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["xy", "zw"]}}}
    params = SamplingParams(max_tokens=40, temperature=0.0, guide_type="json_schema", guide=json.dumps(schema))
    prompt = {"g": [5, 17, 33, 120, 64, 9] * 6}
    texts = {}
    for name, spec in (("base", None), ("spec", SPEC)):
        engine = make_engine(checkpoint, end_ids=(eos,), tokenizer_dir=checkpoint, speculation=spec,
                             jump_forward=False)
        texts[name] = twice(engine, params, prompt) if spec else sequences(engine, params, prompt)
        if spec:
            assert engine.stats().spec_num_accepted_tokens > 0
    assert texts["spec"] == texts["base"]
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(checkpoint).decode(texts["spec"]["g", 0])
    jsonschema.validate(json.loads(text), schema)


# --- temperature 1: the distribution is unchanged ------------------------------------------------------------

VOCAB = 12  # every token is in the prompt: n-gram drafts on almost every step
SAMPLES = 1200
STEPS = 4
# The chi-square test's bound for VOCAB - 1 = 11 degrees of freedom at p = 0.0005 (tables): a correct sampler
# passes with these fixed seeds; one that drops the rejection step (always accepting drafts) is far above it.
CHI2_BOUND = 33.1


def exact_marginals(path: Path, prompt: list[int], steps: int) -> torch.Tensor:
    """P(token at output position i = v) for i < steps, summed exactly over every earlier output (transformers)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prefixes, weights = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64)
    marginals = []
    with torch.no_grad():
        for _ in range(steps):
            probs = torch.softmax(model(prefixes).logits[:, -1].double(), dim=-1)  # [prefixes, vocab]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            weights = joint.reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                                  torch.arange(VOCAB).repeat(len(prefixes))[:, None]], dim=1)
    return torch.stack(marginals)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_one_keeps_the_token_distribution(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path, "llama", seed=3, vocab_size=VOCAB, eos_token_id=VOCAB + 5, initializer_range=0.08)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0] * 2
    exact = exact_marginals(path, prompt, STEPS)
    counts = torch.zeros(STEPS, VOCAB, dtype=torch.float64)
    engine = make_engine(path, speculation=SpeculationConfig(max_draft_len=3, max_concurrency=None,
                                                             is_public_pool=False),
                         max_batch_size=64, max_num_tokens=512, kv_tokens=8192, end_ids=())
    params = [SamplingParams(max_tokens=STEPS, temperature=1.0, top_p=1.0, seed=s) for s in range(SAMPLES)]
    outs = sample_all(engine, prompt, params)
    for tokens in outs:
        assert len(tokens) == STEPS
        for i, t in enumerate(tokens):
            counts[i, t] += 1
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > SAMPLES  # drafts were verified on most steps
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # accepted and rejected both
    for i in range(STEPS):
        assert chi_square(counts[i], exact[i]) < CHI2_BOUND, (i, counts[i].tolist(), (exact[i] * SAMPLES).tolist())


def test_seeded_sampling_gives_the_tokens_of_a_run_without_drafts(llama: Path) -> None:
    """Each row draws once from the request's generator, as a one-token step does: seeded outputs are equal."""
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.95, seed=s) for s in range(6)]
    prompt = PROMPTS["r2"]
    spec = make_engine(llama, speculation=SPEC)
    sample_all(spec, prompt, [SamplingParams(max_tokens=30, temperature=0.0)])  # its answer drafts for the others
    before = spec.stats().spec_num_accepted_tokens
    assert sample_all(spec, prompt, params) == sample_all(make_engine(llama), prompt, params)
    assert spec.stats().spec_num_accepted_tokens > before  # sampled rows accepted drafts


def sample_all(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    got: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", prompt, p)
        got[f"s{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[f"s{i}"] for i in range(len(params))]


def test_a_grammar_completed_by_an_accepted_draft_ends_the_request(
        tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """Drafts running past the end of a grammar (here: a longer answer under a longer guide, from the pool) stop
    where the grammar completes, even with ignore_eos (no token would be allowed after it)."""
    checkpoint = tiny_checkpoint_factory("llama")
    prompt = {"g": [5, 17, 33, 120, 64, 9] * 4}
    got = {}
    for name, spec in (("base", None), ("spec", SPEC)):
        engine = make_engine(checkpoint, tokenizer_dir=checkpoint, speculation=spec, jump_forward=False)
        sequences(engine, SamplingParams(max_tokens=60, temperature=0.0, guide_type="regex", guide="(ab|cd){12}"),
                  prompt, tag="-long")  # its answer joins the pool
        short = SamplingParams(max_tokens=60, temperature=0.0, guide_type="regex", guide="(ab|cd){3}",
                               ignore_eos=True)
        engine.add_request("short", prompt["g"], short)
        outs = [o for _ in range(100) if engine.has_unfinished_requests() for o in engine.step()]
        assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].error is None
        got[name] = [t for o in outs for t in o.new_token_ids]
        if spec is not None:
            assert engine.stats().spec_num_accepted_tokens > 0
    assert got["spec"] == got["base"]
