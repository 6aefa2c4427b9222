"""Engine configuration: KV pool sizing and bounds checked with the field's name."""

from __future__ import annotations

import pytest

from trtprompt.engine.config import KvCacheConfig, ModelConfig, SchedulerConfig
from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import FieldError


def test_kv_pool_from_tokens_from_fraction_of_budget_and_the_smaller_of_both():
    assert KvCacheConfig(tokens_per_block=32, max_tokens_in_paged_kv_cache=1000).num_blocks(1024) == 31
    by_fraction = KvCacheConfig(tokens_per_block=32, memory_budget_bytes=1 << 20,
                                kv_cache_free_gpu_mem_fraction=0.5)
    assert by_fraction.num_blocks(1024) == 16  # 512 KiB / 1 KiB per token = 512 tokens
    both = KvCacheConfig(tokens_per_block=32, max_tokens_in_paged_kv_cache=320, memory_budget_bytes=1 << 20,
                         kv_cache_free_gpu_mem_fraction=0.5)
    assert both.num_blocks(1024) == 10


@pytest.mark.parametrize("kwargs,field", [
    ({"tokens_per_block": 24, "max_tokens_in_paged_kv_cache": 64}, "tokens_per_block must be a power of two"),
    ({"max_tokens_in_paged_kv_cache": 0}, "max_tokens_in_paged_kv_cache must be a positive integer"),
    ({"max_tokens_in_paged_kv_cache": 64, "kv_cache_free_gpu_mem_fraction": 1.5}, "kv_cache_free_gpu_mem_fraction"),
    ({}, "set max_tokens_in_paged_kv_cache or memory_budget_bytes"),
])
def test_kv_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KvCacheConfig(**kwargs)


def test_max_input_len_rule():
    assert SchedulerConfig(max_batch_size=4, max_num_tokens=512, max_seq_len=2048).max_input_len == 512
    assert SchedulerConfig(max_batch_size=4, max_num_tokens=512, max_seq_len=2048,
                           enable_chunked_context=True).max_input_len == 2047
    assert SchedulerConfig(max_batch_size=4, max_num_tokens=4096, max_seq_len=2048).max_input_len == 2047
    with pytest.raises(ValueError, match="batch_scheduler_policy must be one of"):
        SchedulerConfig(max_batch_size=4, max_num_tokens=8, max_seq_len=16, batch_scheduler_policy="fifo")


def test_model_config_refuses_unknown_architecture_and_bad_gqa():
    base = dict(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_size=2,
                max_position_embeddings=16)
    assert ModelConfig(**base).kv_bytes_per_token(4) == 2 * 1 * 2 * 2 * 4
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        ModelConfig(**{**base, "architecture": "GPT2LMHeadModel"})
    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads"):
        ModelConfig(**{**base, "num_key_value_heads": 3})


@pytest.mark.parametrize("kwargs,msg", [
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"top_p": 1.5}, r"top_p must be a finite number in \[0, 1\], got 1.5"),
    ({"temperature": -1.0}, r"temperature must be a finite number in \[0, 100\], got -1.0"),
    ({"seed": -1}, "seed must be in"),
    ({"stop_token_ids": ((),)}, "empty sequence"),
])
def test_sampling_params_errors(kwargs, msg):
    with pytest.raises(FieldError, match=msg):
        SamplingParams(**kwargs)


def test_greedy_unless_sampling_is_asked_for():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.7).greedy  # TensorRT-LLM: temperature alone does not sample
    assert not SamplingParams(top_k=40).greedy
    assert not SamplingParams(top_p=0.9).greedy
    assert SamplingParams(top_k=40, temperature=0.0).greedy
