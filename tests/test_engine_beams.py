"""Beam search (issue 37) equals transformers' `generate(num_beams=W, do_sample=False)` with the same
length_penalty and early_stopping: the search alone (engine/beam_search.py, end tokens made likely),
and the engine's beams over the paged KV (engine/beams.py: blocks shared, partial blocks copied),
batched, chunked, preempted and aborted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import EOS, _hf_model, make_engine, make_hf_model
from test_engine_logprobs import collect
from test_engine_parity import check_block_refs
from trtprompt.engine.beam_search import BeamSearch
from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import FieldError

# (width, length_penalty, early_stopping, max_new_tokens)
SETTINGS = [(4, 1.0, False, 12), (4, 1.0, True, 12), (3, 0.5, "never", 10), (4, 2.0, False, 16), (2, -1.0, True, 8)]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def path(request, tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), request.param)


def prompt_of(seed: int) -> list[int]:
    return torch.randint(3, 256, (5 + seed * 7,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_beams(path: Path, prompt: list[int], width: int, lp: float, es, max_new: int, eos: int = EOS) -> list[list[int]]:
    """transformers' W best beams, best first, each cut before its end token."""
    with torch.no_grad():
        out = _hf_model(str(path)).generate(
            torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=max_new, length_penalty=lp,
            early_stopping=es, num_return_sequences=width, eos_token_id=eos, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    beams = [row[len(prompt):].tolist() for row in out]
    return [b[:b.index(eos)] if eos in b else b for b in beams]


def test_the_search_alone_equals_transformers_with_end_tokens_likely(tmp_path_factory):
    """Full recompute of every running beam each step (one batch: they are all as long), every setting; the end
    token is one the model tends to produce early, so beams end on it."""
    path = make_hf_model(tmp_path_factory.mktemp("hf"), "llama")
    model = _hf_model(str(path))
    ended = 0
    for (width, lp, es, max_new), seed in [(setting, seed) for setting in SETTINGS for seed in range(3)]:
        prompt = prompt_of(seed)
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4, pad_token_id=0,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0].tolist()
        eos = greedy[len(prompt) + 1 + seed % 3]
        search = BeamSearch(width, max_new, frozenset([eos]), lp, es)
        done = False
        while not done:
            with torch.no_grad():
                rows = model(torch.tensor([prompt + beam for beam in search.running])).logits[:, -1]
            done = search.step(torch.log_softmax(rows.float(), dim=-1)).done
        best = search.best(width)
        ended += sum(h.ended_by_end_id for h in best)
        mine = [list(h.tokens[:-1] if h.ended_by_end_id else h.tokens) for h in best]
        assert mine == hf_beams(path, prompt, width, lp, es, max_new, eos), (width, lp, es, seed)
    assert ended > 0, "some beams ended on the end token"


@pytest.mark.parametrize("width,lp,es,max_new", SETTINGS[:4])
def test_engine_beams_equal_transformers_batched_and_chunked(path, width, lp, es, max_new):
    engine = make_engine(path, tokens_per_block=8, max_num_tokens=32)
    params = SamplingParams(max_tokens=max_new, beam_width=width, n=width, length_penalty=lp, early_stopping=es)
    prompts = {f"r{seed}": prompt_of(seed) for seed in range(4)}
    outs = collect(engine, {rid: (p, params) for rid, p in prompts.items()})
    for rid, prompt in prompts.items():
        ranked = sorted(outs[rid], key=lambda o: o.sequence_index)
        assert [o.new_token_ids for o in ranked] == hf_beams(path, prompt, width, lp, es, max_new)
        assert all(o.sequence_finished for o in ranked) and ranked[-1].finished
        sums = [o.cum_logprob for o in ranked]
        assert all(s is not None and s < 0 for s in sums)
    assert engine.kv.num_held_blocks == 0 and not engine.groups


def test_engine_beams_return_n_best_and_survive_preemption(path):
    # 24 blocks of 8: the 4 beams of 19 + 24 tokens fit alone (6 blocks each at most), but requests
    # admitted before them grow and preempt them (max_utilization preempts the newest first).
    engine = make_engine(path, policy="max_utilization", kv_tokens=192, max_seq_len=96, tokens_per_block=8)
    prompt = prompt_of(2)
    plain = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=24, beam_width=4, n=2)
    requests = {f"p{i}": (prompt_of(10 + i)[:30], plain) for i in range(3)}
    outs = collect(engine, {**requests, "b": (prompt, params)})["b"]
    assert engine.stats().preemptions > 0
    assert [o.new_token_ids for o in outs] == hf_beams(path, prompt, 4, 1.0, False, 24)[:2]
    assert [o.sequence_index for o in outs] == [0, 1]


def test_a_beam_search_the_cache_cannot_hold_is_refused(path):
    from trtprompt.engine.errors import EngineRequestError

    engine = make_engine(path, kv_tokens=64, max_seq_len=64, tokens_per_block=8)
    with pytest.raises(EngineRequestError, match=r"beam_width \(4\) x 6 KV blocks per beam .* \(8 blocks\)"):
        engine.add_request("b", prompt_of(2), SamplingParams(max_tokens=24, beam_width=4))


def test_abort_during_a_beam_search_releases_every_beam(path):
    engine = make_engine(path)
    engine.add_request("b", prompt_of(1), SamplingParams(max_tokens=30, beam_width=4, n=4))
    for _ in range(5):
        engine.step()
        check_block_refs(engine)
    assert engine.abort("b")
    outs = engine.step()
    assert sum(o.finished for o in outs) == 1 and all(o.finish_reason.value == "aborted" for o in outs)
    assert engine.kv.num_held_blocks == 0 and not engine.has_unfinished_requests()


def test_beam_search_refuses_what_it_does_not_combine_with():
    with pytest.raises(FieldError, match=r"n \(3\) must be at most beam_width \(2\)"):
        SamplingParams(beam_width=2, n=3)
    with pytest.raises(FieldError, match="logit_bias is not supported with beam search"):
        SamplingParams(beam_width=2, logit_bias=((3, 1.0),))
    with pytest.raises(FieldError, match="early_stopping must be true, false or \"never\""):
        SamplingParams(beam_width=2, early_stopping="sometimes")  # type: ignore[arg-type]


def test_an_aborted_beam_search_sends_one_empty_final_output(path):
    engine = make_engine(path)
    engine.add_request("b", prompt_of(1), SamplingParams(max_tokens=30, beam_width=3, n=3))
    for _ in range(4):
        engine.step()
    engine.abort("b")
    outs = engine.step()
    assert [(o.new_token_ids, o.finished, o.finish_reason.value) for o in outs] == [([], True, "aborted")]
