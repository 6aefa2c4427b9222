"""Engine semantics: invariants under random load, salts, aborts, bounds, sampling controls."""

from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import EOS, VOCAB, hf_greedy, make_engine, make_hf_model, run_to_completion
from test_engine_parity import check_block_refs
from trtprompt.engine.errors import EngineRequestError, InputTooLongError, QueueFullError
from trtprompt.engine.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_invariants(llama, seed):
    """Arrivals between steps, shared prefixes, aborts, both policies, small pools."""
    rng = random.Random(seed)
    policy = ("guaranteed_no_evict", "max_utilization")[seed % 2]
    engine = make_engine(llama, policy=policy, kv_tokens=rng.choice([80, 96, 128, 1024]),
                         chunked=rng.random() < 0.7, reuse=rng.random() < 0.8,
                         max_num_tokens=rng.choice([64, 128]), max_batch_size=rng.choice([2, 4, 8]))
    prefixes = [rand_tokens(rng, rng.choice([8, 16, 30])) for _ in range(3)]
    pending = [(f"r{i}", rng.choice(prefixes) + rand_tokens(rng, rng.randint(1, 20)),
                rng.randint(1, 10)) for i in range(30)]
    finals: dict[str, int] = {}
    accepted: set[str] = set()
    for _ in range(5000):
        for _ in range(rng.randint(0, 3)):
            if pending:
                rid, prompt, n = pending.pop()
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n), rng.choice([None, "t"]))
                accepted.add(rid)
        if accepted and rng.random() < 0.05:
            engine.abort(rng.choice(sorted(accepted)))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = finals.get(out.request_id, 0) + 1
        check_block_refs(engine)
        if not pending and not engine.has_unfinished_requests():
            break
    assert finals == {rid: 1 for rid in accepted}
    stats = engine.stats()
    assert stats.used_num_blocks == 0 and stats.free_num_blocks == stats.max_num_blocks
    if policy == "guaranteed_no_evict":
        assert stats.preemptions == 0


def test_cache_salt_isolates_and_shares(llama):
    engine = make_engine(llama)
    prompt = list(range(3, 3 + 40))
    params = SamplingParams(max_tokens=2)
    run_to_completion(engine, {"a": prompt}, params, {"a": "tenant-a"})
    blocks_a = set()
    engine.add_request("b", prompt, params, "tenant-b")
    engine.step()
    b_stats = engine.requests["b"].stats
    assert b_stats.kv_cache_reused_blocks == 0
    blocks_b = set(engine.kv.block_ids("b"))
    run_to_completion(engine, {}, params)
    engine.add_request("a2", prompt, params, "tenant-a")
    engine.step()
    assert engine.requests["a2"].stats.kv_cache_reused_blocks == 4  # 39 reusable tokens -> 4 full blocks
    blocks_a = set(engine.kv.block_ids("a2")[:4])
    assert not blocks_a & blocks_b
    run_to_completion(engine, {}, params)


def _step_until(engine, cond, limit=200):
    for _ in range(limit):
        if cond():
            return
        engine.step()
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("phase", ["prefill", "decode", "waiting"])
def test_abort_frees_blocks_and_ends_once(llama, phase):
    engine = make_engine(llama, chunked=True, max_num_tokens=16, max_batch_size=1)
    engine.add_request("x", list(range(3, 63)), SamplingParams(max_tokens=50))
    engine.add_request("y", list(range(3, 13)), SamplingParams(max_tokens=5))
    victim = {"prefill": "x", "decode": "x", "waiting": "y"}[phase]
    if phase == "prefill":
        engine.step()
        assert 0 < engine.requests["x"].num_computed_tokens < 60
    elif phase == "decode":
        _step_until(engine, lambda: engine.requests["x"].num_output >= 2)
    assert engine.abort(victim)
    assert not engine.abort(victim)
    outs = engine.step()
    final = [o for o in outs if o.request_id == victim]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason is FinishReason.ABORTED
    assert victim not in engine.kv.block_tables
    run_to_completion(engine, {}, SamplingParams())
    assert engine.stats().used_num_blocks == 0


def test_input_bounds_follow_tensorrt_llm(llama):
    unchunked = make_engine(llama, chunked=False, max_num_tokens=48, max_seq_len=200)
    assert unchunked.max_input_len == 48
    with pytest.raises(InputTooLongError, match=r"Prompt length \(49\) exceeds maximum input length \(48\)"):
        unchunked.add_request("r", [5] * 49, SamplingParams())
    chunked = make_engine(llama, chunked=True, max_num_tokens=48, max_seq_len=200)
    assert chunked.max_input_len == 199
    with pytest.raises(InputTooLongError, match=r"Prompt length \(200\) exceeds maximum input length \(199\)"):
        chunked.add_request("r", [5] * 200, SamplingParams())
    with pytest.raises(EngineRequestError, match="empty"):
        chunked.add_request("e", [], SamplingParams())
    with pytest.raises(EngineRequestError, match=r"input token id 256 is outside the vocabulary \[0, 256\)"):
        chunked.add_request("v", [1, 256], SamplingParams())


def test_output_shortened_to_max_seq_len(llama):
    engine = make_engine(llama, chunked=True, max_seq_len=64)
    engine.add_request("r", [7] * 60, SamplingParams(max_tokens=10, end_id=VOCAB - 1))
    outs = [o for _ in range(20) for o in engine.step()]
    final = outs[-1]
    assert final.finished and final.num_output_tokens == 4
    assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert "prompt length (60) + max_tokens (10) exceeds max_seq_len (64); output shortened to 4" in final.warning


def test_queue_full(llama):
    engine = make_engine(llama, max_queue_size=2)
    engine.add_request("a", [5, 6], SamplingParams())
    engine.add_request("b", [5, 6], SamplingParams())
    with pytest.raises(QueueFullError, match="queue full"):
        engine.add_request("c", [5, 6], SamplingParams())
    engine.step()  # both admitted: the queue has room again
    engine.add_request("c", [5, 6], SamplingParams())


def test_sampling_is_reproducible_per_seed_and_top_k_1_is_greedy(llama):
    prompt = list(range(10, 30))
    sampled = SamplingParams(max_tokens=16, top_k=50, top_p=0.9, temperature=1.5, seed=1234)
    runs = [run_to_completion(make_engine(llama), {"r": prompt, "other": [9, 9, 9]}, sampled)["r"]
            for _ in range(2)]
    assert runs[0] == runs[1]
    other_seed = run_to_completion(make_engine(llama), {"r": prompt},
                                   SamplingParams(max_tokens=16, top_k=50, temperature=1.5, seed=99))["r"]
    assert other_seed != runs[0]
    greedy = hf_greedy(llama, tuple(prompt), 16)
    top1 = run_to_completion(make_engine(llama), {"r": prompt},
                             SamplingParams(max_tokens=16, top_k=1, temperature=0.7, seed=5))["r"]
    assert top1 == greedy


def test_stop_words_are_trimmed_and_end_id_ends(llama):
    prompt = list(range(10, 30))
    greedy = hf_greedy(llama, tuple(prompt), 12)
    stop = tuple(greedy[4:6])
    out = run_to_completion(make_engine(llama), {"r": prompt},
                            SamplingParams(max_tokens=12, stop_token_ids=(stop,)))["r"]
    first = next(i for i in range(len(greedy) - 1) if tuple(greedy[i:i + 2]) == stop)
    assert out == greedy[:first]
    out = run_to_completion(make_engine(llama), {"r": prompt},
                            SamplingParams(max_tokens=12, end_id=greedy[3]))["r"]
    assert out == greedy[:greedy.index(greedy[3])]


def test_min_tokens_masks_the_end_token(llama):
    prompt = list(range(10, 30))
    greedy = hf_greedy(llama, tuple(prompt), 12)
    end = greedy[0]
    out = run_to_completion(make_engine(llama), {"r": prompt},
                            SamplingParams(max_tokens=6, end_id=end, min_tokens=3))["r"]
    assert len(out) >= 3 and end not in out[:3]


def test_penalties_change_output_and_repetition_penalty_matches_transformers(llama):
    import transformers
    prompt = list(range(10, 30))
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):].tolist()
    ref = ref[:ref.index(EOS)] if EOS in ref else ref
    out = run_to_completion(make_engine(llama), {"r": prompt},
                            SamplingParams(max_tokens=10, repetition_penalty=1.8))["r"]
    assert out == ref
    plain = hf_greedy(llama, tuple(prompt), 10)
    freq = run_to_completion(make_engine(llama), {"r": prompt},
                             SamplingParams(max_tokens=10, frequency_penalty=5.0, presence_penalty=1.0))["r"]
    assert len(set(freq)) == len(freq) and freq != plain


def test_same_prefix_admitted_together_is_computed_once(llama):
    """A request whose prefix another request is computing waits a step and reuses it (FCFS kept)."""
    rng = random.Random(5)
    prefix = rand_tokens(rng, 40)  # 5 full blocks of 8
    prompts = {"a": prefix + rand_tokens(rng, 3), "b": prefix + rand_tokens(rng, 3),
               "c": rand_tokens(rng, 6)}  # c arrives after b: it must not overtake it
    expected = {rid: hf_greedy(llama, tuple(p), 4) for rid, p in prompts.items()}
    engine = make_engine(llama, max_num_tokens=256)
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=4))
    first = engine.step()  # a alone: b waits for a's blocks, c waits behind b
    assert [o.request_id for o in first] == ["a"]
    outputs = {rid: [] for rid in prompts}
    finals = {}
    for o in first:
        outputs[o.request_id] += o.new_token_ids
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
    assert outputs == expected
    assert finals["b"].stats.kv_cache_reused_blocks == 5
    assert finals["b"].stats.prefill_tokens_computed == 3
    assert finals["b"].stats.first_scheduled_time_ns > finals["a"].stats.first_scheduled_time_ns
    stats = engine.stats()
    assert stats.used_num_blocks == 0 and stats.free_num_blocks == stats.max_num_blocks
