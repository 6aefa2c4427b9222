"""Engine level: greedy tokens are the same under every eviction policy (and without reuse), on a scan
workload small enough to evict; transformers' greedy continuation is the oracle for a sample."""

from __future__ import annotations

import random

import pytest
from engine_helpers import VOCAB, hf_greedy, make_engine, make_hf_model

from trtprompt.engine.request import RetentionConfig, SamplingParams, TokenRangeRetention
from trtprompt.knobs import EVICTION_POLICIES

PARAMS = SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def workload() -> list[list[int]]:
    """A system prompt of 2 blocks (4 tokens each) with unique tails, and pairs of one-off prompts of
    17 blocks (with their output) between its requests, in a pool of 24: one one-off fits beside the
    system prompt, two do not (the pool-level twin: tests/test_eviction_scan.py)."""
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(8)]
    prompts = [system + [rng.randrange(3, VOCAB)]]
    for _ in range(4):
        prompts.append(system + [rng.randrange(3, VOCAB)])
        prompts += [[rng.randrange(3, VOCAB) for _ in range(65)] for _ in range(2)]
    return prompts[:-2]


HOT = [0, 1, 4, 7, 10]


def serve_in_order(engine, prompts: list[list[int]], retention=None) -> tuple[list[list[int]], list[int]]:
    """One request at a time (so the order of evictions is the workload's); tokens and reused blocks.
    retention: given to the system prompt's requests only."""
    tokens, reused = [], []
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, PARAMS, retention=retention if i in HOT else None)
        out_tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                out_tokens.extend(out.new_token_ids)
                if out.finished:
                    reused.append(out.stats.kv_cache_reused_blocks)
        tokens.append(out_tokens)
    return tokens, reused


def engine(llama, policy: str, reuse: bool = True):
    e = make_engine(llama, reuse=reuse, kv_tokens=96, tokens_per_block=4, max_batch_size=2, eviction_policy=policy)
    assert e.kv.pool.num_blocks == 24 and e.kv.pool.eviction_policy == policy
    return e


def test_greedy_tokens_equal_under_every_policy(llama) -> None:
    prompts = workload()
    reference, _ = serve_in_order(engine(llama, "lru", reuse=False), prompts)
    hits = {}
    for policy in EVICTION_POLICIES:
        e = engine(llama, policy)
        tokens, reused = serve_in_order(e, prompts)
        assert tokens == reference, policy
        assert e.kv.pool.evicted_blocks > 0
        hits[policy] = [reused[i] for i in HOT]
        assert sum(reused) == sum(hits[policy])  # one-off prompts never hit
    # Each pair of one-off prompts evicts the system prompt from lru, never from 2q / s3fifo.
    assert hits == {"lru": [0, 2, 0, 0, 0], "2q": [0, 2, 2, 2, 2], "s3fifo": [0, 2, 2, 2, 2]}
    for i in (0, 1, 2):
        assert reference[i] == hf_greedy(llama, tuple(prompts[i]), PARAMS.max_tokens)


def test_pinned_prefix_through_the_engine(llama) -> None:
    """A retention config on add_request reaches the pool: under lru, the system prompt pinned at
    priority 100 survives the one-off prompts that evicted it above."""
    prompts = workload()
    pin = RetentionConfig((TokenRangeRetention(0, 8, 100),))
    plain_tokens, _ = serve_in_order(engine(llama, "lru"), prompts)
    tokens, reused = serve_in_order(engine(llama, "lru"), prompts, retention=pin)
    assert tokens == plain_tokens
    assert [reused[i] for i in HOT] == [0, 2, 2, 2, 2]


def test_the_knob_reaches_the_pool_from_an_engine_directory(tiny_engine_dir) -> None:
    """serve writes kv_cache_eviction_policy into the tensorrt_llm parameters; the engine process reads
    them (engine_overrides) and LLMEngine.from_engine_dir hands the policy to the pool."""
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.serve.engine_process.server import engine_overrides

    overrides = engine_overrides({"kv_cache_eviction_policy": "2q", "max_tokens_in_paged_kv_cache": "4096"})
    assert overrides["kv_cache_eviction_policy"] == "2q"
    assert LLMEngine.from_engine_dir(tiny_engine_dir, **overrides).kv.pool.eviction_policy == "2q"
    default = LLMEngine.from_engine_dir(tiny_engine_dir, max_tokens_in_paged_kv_cache=4096)
    assert default.kv.pool.eviction_policy == "s3fifo"
    with pytest.raises(ValueError, match="kv_cache_eviction_policy must be one of lru, 2q, s3fifo, got 'arc'"):
        LLMEngine.from_engine_dir(tiny_engine_dir, kv_cache_eviction_policy="arc", max_tokens_in_paged_kv_cache=4096)
