"""Several sequences from one prompt (issue 37): prefilled once, the prompt's blocks shared and the
last one copied, each sequence its own seeded stream; and the vocabulary controls (logit_bias,
bad_words, allowed_token_ids, include_stop_in_output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_helpers import EOS, hf_greedy, make_engine, make_hf_model, run_to_completion
from test_engine_logprobs import collect
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.errors import EngineRequestError
from trtprompt.engine.request import RequestOutput, SamplingParams
from trtprompt.error_codes import FieldError

PROMPT = list(range(5, 42))  # 37 tokens: four full blocks of 8, the fifth partial


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def sequences(outs: list[RequestOutput]) -> dict[int, list[int]]:
    by_seq: dict[int, list[int]] = {}
    for out in outs:
        by_seq.setdefault(out.sequence_index, []).extend(out.new_token_ids)
    return by_seq


def sampled(n: int = 1, seed: int = 11, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, top_p=1.0, seed=seed, n=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("reuse", [True, False])
def test_n_sequences_prefill_once_and_each_draws_its_own_seeded_stream(path, reuse):
    engine = make_engine(path, reuse=reuse)
    outs = collect(engine, {"r": (PROMPT, sampled(n=4))})["r"]
    seqs = sequences(outs)
    assert sorted(seqs) == [0, 1, 2, 3]
    assert len({tuple(s) for s in seqs.values()}) == 4
    finals = {o.sequence_index: o for o in outs if o.sequence_finished}
    assert sorted(finals) == [0, 1, 2, 3], "each sequence ends once"
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    computed = {i: o.stats.prefill_tokens_computed for i, o in finals.items()}
    assert computed == {0: len(PROMPT), 1: 1, 2: 1, 3: 1}, "the prompt is computed once; a fork computes its last token"
    # Sequence i draws from seed + i: the same tokens as a request of its own with that seed.
    for i in range(4):
        alone = run_to_completion(make_engine(path, reuse=reuse), {"a": PROMPT}, sampled(seed=11 + i))["a"]
        assert seqs[i] == alone


def test_greedy_sequences_equal_transformers_and_leave_no_block_behind(path):
    engine = make_engine(path, tokens_per_block=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, n=3)
    outs = collect(engine, {"g": (PROMPT, params), "other": (PROMPT[:8], SamplingParams(max_tokens=4))})
    expected = hf_greedy(path, tuple(PROMPT), 12)
    assert sequences(outs["g"]) == {0: expected, 1: expected, 2: expected}
    assert engine.kv.num_held_blocks == 0 and not engine.groups


def test_a_request_of_n_sequences_survives_preemption(path):
    # A cache of 12 blocks for 3 sequences of 37 + 40 tokens each: they preempt one another.
    engine = make_engine(path, policy="max_utilization", kv_tokens=96, max_seq_len=96)
    params = SamplingParams(max_tokens=40, temperature=0.0, n=3, ignore_eos=True)
    outs = collect(engine, {"p": (PROMPT, params)})["p"]
    assert engine.stats().preemptions > 0
    expected = run_to_completion(make_engine(path), {"a": PROMPT}, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                                 temperature=0.0))["a"]
    assert sequences(outs) == {0: expected, 1: expected, 2: expected}


def test_abort_ends_every_sequence_with_one_final_output(path):
    engine = make_engine(path)
    engine.add_request("r", PROMPT, sampled(n=3))
    engine.step()  # sequence 0 computes the prompt; 1 and 2 are queued on its blocks
    assert engine.abort("r")
    outs = engine.step()
    assert [o.finished for o in outs if o.request_id == "r"] == [False, False, True]
    assert all(o.sequence_finished and o.finish_reason.value == "aborted" for o in outs)
    assert not engine.has_unfinished_requests() and engine.kv.num_held_blocks == 0


def test_n_is_bounded_by_max_batch_size(path):
    engine = make_engine(path, max_batch_size=4)
    with pytest.raises(FieldError, match=r"n \(5\) exceeds the engine's max_batch_size \(4\)"):
        engine.add_request("r", PROMPT, sampled(n=5))
    with pytest.raises(FieldError, match=r"n must be an integer in \[1, 128\]"):
        SamplingParams(n=0)


def greedy_with(engine: LLMEngine, **kw) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **kw)
    return run_to_completion(engine, {"x": PROMPT}, params)["x"]


def test_logit_bias_forces_and_forbids_tokens(path):
    engine = make_engine(path)
    plain = greedy_with(engine)
    assert greedy_with(engine, logit_bias=((77, 100.0),)) == [77] * 12
    assert plain[0] not in greedy_with(engine, logit_bias=((plain[0], -100.0),))[:1]


def test_allowed_token_ids_and_bad_words(path):
    engine = make_engine(path)
    plain = greedy_with(engine)
    allowed = (9, 10, 11)
    assert set(greedy_with(engine, allowed_token_ids=allowed)) <= set(allowed)
    # A two-token bad word: its second token may follow anything but its first.
    pair = (plain[0], plain[1])
    out = greedy_with(engine, bad_words=(pair,))
    assert out[0] == plain[0] and out[1] != plain[1]
    assert all((a, b) != pair for a, b in zip(out, out[1:]))
    assert plain[0] not in greedy_with(engine, bad_words=((plain[0],),))


def test_token_ids_outside_the_vocabulary_are_refused(path):
    engine = make_engine(path)
    with pytest.raises(EngineRequestError, match="token id 999 in the sampling parameters is outside the vocabulary"):
        engine.add_request("r", PROMPT, SamplingParams(logit_bias=((999, 1.0),)))


def test_include_stop_in_output_keeps_the_stop_word(path):
    engine = make_engine(path)
    plain = greedy_with(engine)
    stop = (plain[2], plain[3])
    trimmed = greedy_with(engine, stop_token_ids=(stop,))
    kept = greedy_with(engine, stop_token_ids=(stop,), include_stop_in_output=True)
    assert trimmed == plain[:2] and kept == plain[:4]
    assert EOS not in kept


def test_a_sequence_failing_beside_its_sibling_ends_the_request_once(path, monkeypatch):
    """Sequence 0 fails sampling in the step its fork samples too: the request ends once, with the
    error, and the fork's token of that step is dropped (it ran on, or ended twice, before)."""
    from trtprompt.engine import engine as engine_mod
    from trtprompt.engine.sampler import SampleFailure

    real = engine_mod.sample

    def failing(logits, reqs):
        tokens = real(logits, reqs)
        return [SampleFailure("forced") if r.request_id == "r" and r.num_output == 1 else t
                for r, t in zip(reqs, tokens)]

    monkeypatch.setattr(engine_mod, "sample", failing)
    engine = make_engine(path)
    engine.add_request("r", PROMPT, sampled(n=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    finals = [o for o in outs if o.finished]
    assert len(finals) == 1 and finals[0].error is not None and "forced" in finals[0].error
    assert outs[-1] is finals[0] and engine.kv.num_held_blocks == 0 and not engine.groups


def test_forks_are_not_counted_as_prefix_cache_hits(path):
    engine = make_engine(path, reuse=True)
    outs = collect(engine, {"r": (PROMPT, sampled(n=3))})["r"]
    assert sum(o.stats.kv_cache_reused_blocks for o in outs if o.sequence_finished) == 0
    assert engine.stats().reused_blocks == 0  # a cold prompt: nothing came from the cache


def test_beam_width_is_bounded_by_max_batch_size(path):
    engine = make_engine(path, max_batch_size=2)
    with pytest.raises(FieldError, match=r"beam_width \(3\) exceeds the engine's max_batch_size \(2\)"):
        engine.add_request("b", PROMPT, SamplingParams(max_tokens=4, beam_width=3))
