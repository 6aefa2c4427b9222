"""Greedy parity with transformers across architectures and scheduling modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import VOCAB, count_cascade_groups, hf_greedy, make_engine, make_hf_model, run_to_completion
from trtprompt.engine.request import SamplingParams

MAX_TOKENS = 12


def prompt_set(seed: int) -> dict[str, list[int]]:
    """Mixed lengths: a 40-token shared prefix, a block-aligned prompt twice, short ones."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    prefix = rand(40)
    aligned = rand(24)
    return {
        "p1": prefix + rand(1), "p4": prefix + rand(4), "p7": prefix + rand(7),
        "a": aligned, "a-dup": list(aligned), "short": rand(3), "one": rand(1), "long": rand(45),
    }


def check_block_refs(engine) -> None:
    """Ref counts equal block-table references; free queue holds exactly the unreferenced blocks."""
    refs: dict[int, int] = {}
    for table in engine.kv.block_tables.values():
        for b in table:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    pool = engine.kv.pool
    for b in pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id}"
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    assert pool.num_cached_free == sum(1 for q in pool.free_blocks.queues() for b in q if b.block_hash is not None)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def arch_case(request, tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("hf"), request.param)
    prompts = prompt_set(seed=len(request.param))
    expected = {rid: hf_greedy(path, tuple(p), MAX_TOKENS) for rid, p in prompts.items()}
    return path, prompts, expected


MODES = [(chunked, mnt, reuse) for chunked, mnt in [(False, 48), (False, 512), (True, 16), (True, 512)]
         for reuse in (True, False)]


@pytest.mark.parametrize("chunked,max_num_tokens,reuse", MODES)
def test_greedy_matches_transformers(arch_case, chunked, max_num_tokens, reuse):
    path, prompts, expected = arch_case
    engine = make_engine(path, reuse=reuse, chunked=chunked, max_num_tokens=max_num_tokens)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    first = run_to_completion(engine, prompts, params, check=check_block_refs)
    assert first == expected
    # A second wave finds every full prompt block cached when reuse is on.
    again = {f"{rid}-2": p for rid, p in prompts.items()}
    second = run_to_completion(engine, again, params, check=check_block_refs)
    assert second == {f"{rid}-2": v for rid, v in expected.items()}
    stats = engine.stats()
    assert stats.used_num_blocks == 0 and stats.free_num_blocks == stats.max_num_blocks
    assert (stats.reused_blocks > 0) == reuse


def test_parity_under_preemption(arch_case):
    path, prompts, expected = arch_case
    # 12 blocks of 8 tokens: far less than the batch needs, so max_utilization preempts.
    engine = make_engine(path, policy="max_utilization", kv_tokens=96, max_num_tokens=64)
    out = run_to_completion(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS), check=check_block_refs)
    assert out == expected
    assert engine.stats().preemptions > 0


def test_guaranteed_no_evict_never_preempts(arch_case):
    path, prompts, expected = arch_case
    engine = make_engine(path, policy="guaranteed_no_evict", kv_tokens=96, max_num_tokens=64)
    out = run_to_completion(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS), check=check_block_refs)
    assert out == expected
    assert engine.stats().preemptions == 0


@pytest.mark.parametrize("attention_backend", ["compiled", "torch", "reference"])
def test_attention_backends_with_cascade_match_transformers(arch_case, attention_backend, monkeypatch):
    """Sequences decoding over shared prefix blocks: cascade (forced on) + in-place kernel stay exact."""
    groups = count_cascade_groups(monkeypatch)
    path, prompts, expected = arch_case
    engine = make_engine(path, chunked=True, max_num_tokens=512, attention_backend=attention_backend)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert run_to_completion(engine, prompts, params, check=check_block_refs) == expected
    # The second wave starts from cached prefixes: its decodes share blocks and run as a cascade.
    again = {f"{rid}-2": p for rid, p in prompts.items()}
    assert run_to_completion(engine, again, params) == {f"{rid}-2": v for rid, v in expected.items()}
    assert engine.runner.attention_backend == attention_backend
    assert (max(groups, default=0) > 0) == (attention_backend != "reference")


def test_onednn_backend_matches_reference(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("hf"), "llama")
    prompts = prompt_set(seed=7)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ref = run_to_completion(make_engine(path, linear_backend="reference"), prompts, params)
    fast = run_to_completion(make_engine(path, linear_backend="onednn"), prompts, params)
    assert fast == ref


def test_llama3_rope_and_tied_embeddings(tmp_path_factory):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    path = make_hf_model(tmp_path_factory.mktemp("hf"), "llama", seed=3, rope_parameters=rope,
                         tie_word_embeddings=True)
    prompts = prompt_set(seed=3)
    expected = {rid: hf_greedy(path, tuple(p), MAX_TOKENS) for rid, p in prompts.items()}
    engine = make_engine(path, chunked=True, max_num_tokens=16)
    assert run_to_completion(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS)) == expected
