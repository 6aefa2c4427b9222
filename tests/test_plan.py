"""Build-plan rules (TensorRT-LLM's) and memory plan, with exact expected numbers."""

from __future__ import annotations

from typing import Any

import pytest

from trtprompt.errors import PlanError
from trtprompt.plan import BuildBounds, make_plan, model_max_seq_len, rope_factor, weight_bytes
from trtprompt.profile import Profile, load_profile

GIB = 1 << 30


def _pc(**kw: Any) -> dict[str, Any]:
    """pretrained_config of the tiny llama demo checkpoint, with changes."""
    base = dict(architecture="LlamaForCausalLM", vocab_size=768, hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_size=16,
                max_position_embeddings=4096, rotary_scaling=None, tie_word_embeddings=False,
                attn_bias=False, qk_layernorm=False, hidden_act="silu")
    return base | kw


LLAMA3_8B = _pc(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_size=128, max_position_embeddings=8192)


def _bounds(plan: Any) -> tuple:
    b: BuildBounds = plan.bounds
    return (b.max_batch_size, b.max_input_len, b.max_seq_len, b.max_num_tokens, b.opt_num_tokens)


def test_tiny_llama_cpu_dev_exact() -> None:
    plan = make_plan(_pc(), load_profile("cpu-dev"), "torch", "float32")
    assert _bounds(plan) == (16, 1024, 2048, 512, 16)
    m = plan.memory
    # params: 2 x 768x64 (embed, lm_head) + 3 x 36992 (layers) + 64 (norm) = 209344; x 4 bytes
    assert m.weight_bytes == 837_376
    assert m.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4 == 768
    assert m.bytes_per_block == 768 * 32
    assert (m.kv_cache_tokens, m.num_blocks, m.blocks_per_sequence, m.full_length_sequences) == (32768, 1024, 64, 16)
    assert plan.runtime_max_input_len == 2047  # chunked context: max_seq_len - 1
    assert plan.quant_algo is None and plan.warnings == ()


def test_llama3_8b_trtllm_defaults_exact() -> None:
    plan = make_plan(LLAMA3_8B, Profile(), "trtllm", "bfloat16", kv_budget_bytes=40 * GIB, budget_source="test")
    assert _bounds(plan) == (2048, 1024, 8192, 8192, 2048)
    m = plan.memory
    assert m.weight_bytes == 8_030_261_248 * 2
    assert m.kv_bytes_per_token == 131_072
    # int(40 GiB x 0.9) // 131072 = 294912 tokens = 9216 blocks; 256 blocks per 8k sequence
    assert (m.kv_cache_tokens, m.num_blocks, m.blocks_per_sequence, m.full_length_sequences) == (294912, 9216, 256, 36)
    assert plan.runtime_max_input_len == 8191  # no chunking: min(max_seq_len - 1, max_num_tokens)


def test_max_tokens_and_budget_smaller_wins() -> None:
    profile = Profile(max_tokens_in_paged_kv_cache=100_000)
    plan = make_plan(LLAMA3_8B, profile, "trtllm", "bfloat16", kv_budget_bytes=40 * GIB)
    assert plan.memory.kv_cache_tokens == 100_000 and plan.memory.num_blocks == 3125
    unknown = make_plan(LLAMA3_8B, Profile(), "trtllm", "bfloat16")
    assert unknown.memory.num_blocks is None and unknown.memory.full_length_sequences is None


@pytest.mark.parametrize("scaling, max_pos, expected", [
    (None, 4096, 4096),
    ({"rope_type": "linear", "factor": 4.0}, 4096, 16384),
    ({"type": "dynamic", "factor": 2.0}, 2048, 4096),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),
    ({"rope_type": "yarn", "factor": 1.5}, 1001, 1502),  # ceil
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072, 131072),
    ({"rope_type": "longrope", "factor": 32.0}, 131072, 131072),
])
def test_max_seq_len_default_from_positions_and_rope(scaling: Any, max_pos: int, expected: int) -> None:
    pc = _pc(rotary_scaling=scaling, max_position_embeddings=max_pos)
    assert model_max_seq_len(pc) == expected
    plan = make_plan(pc, Profile(max_batch_size=8), "torch", "float32")
    assert plan.bounds.max_seq_len == expected
    assert plan.bounds.max_input_len == min(1024, expected)


def test_rope_factor() -> None:
    assert rope_factor(None) == 1.0
    assert rope_factor({"rope_type": "linear", "factor": 4.0}) == 4.0
    assert rope_factor({"type": "dynamic", "factor": 2.0}) == 2.0
    # These types' max_position_embeddings already is the extended length (TensorRT-LLM skips the factor).
    assert rope_factor({"rope_type": "llama3", "factor": 8.0}) == 1.0
    assert rope_factor({"rope_type": "su", "factor": 4.0}) == 1.0


def test_sliding_window_bounds_max_seq_len() -> None:
    pc = _pc(architecture="MistralForCausalLM", max_position_embeddings=32768, sliding_window=4096)
    assert make_plan(pc, Profile(), "torch", "float32").bounds.max_seq_len == 4096
    with pytest.raises(PlanError, match="max_seq_len 8192 exceeds what the model's positions allow: 4096 "
                                        r"\(sliding_window 4096\)"):
        make_plan(pc, Profile(max_seq_len=8192), "torch", "float32")


def test_max_seq_len_beyond_positions_is_an_error() -> None:
    with pytest.raises(PlanError) as err:
        make_plan(_pc(), Profile(max_seq_len=8192), "torch", "float32")
    assert str(err.value) == ("max_seq_len 8192 exceeds what the model's positions allow: 4096 "
                              "(max_position_embeddings 4096 x rope factor 1)")


def test_max_input_len_rules() -> None:
    plan = make_plan(_pc(), Profile(max_seq_len=512), "torch", "float32")
    assert plan.bounds.max_input_len == 512  # default 1024 clipped to max_seq_len
    assert make_plan(_pc(), Profile(max_input_len=300), "torch", "float32").bounds.max_input_len == 300
    with pytest.raises(PlanError, match="max_input_len 4096 is larger than max_seq_len 2048"):
        make_plan(_pc(), Profile(max_seq_len=2048, max_input_len=4096), "torch", "float32")


def test_max_num_tokens_capped_and_raised() -> None:
    capped = make_plan(_pc(), Profile(max_batch_size=2, max_seq_len=100), "torch", "float32")
    assert _bounds(capped) == (2, 100, 100, 200, 2)  # 8192 capped at 100 x 2
    raised = make_plan(_pc(), Profile(max_batch_size=1, max_seq_len=16, tokens_per_block=64), "torch", "float32",
                       kv_budget_bytes=GIB)
    assert raised.bounds.max_num_tokens == 64  # min(8192, 16) raised to tokens_per_block
    assert raised.bounds.opt_num_tokens == 1
    big = make_plan(LLAMA3_8B, Profile(max_num_tokens=20000), "trtllm", "bfloat16")
    assert big.bounds.max_num_tokens == 20000 and "16384" in big.warnings[0]


def test_opt_num_tokens_rules() -> None:
    assert make_plan(_pc(), Profile(max_batch_size=64, max_num_tokens=40), "torch", "float32",
                     kv_budget_bytes=GIB).bounds.opt_num_tokens == 40
    clamped = make_plan(_pc(), Profile(max_num_tokens=256, opt_num_tokens=1000), "torch", "float32",
                        kv_budget_bytes=GIB)
    assert clamped.bounds.opt_num_tokens == 256
    multi = make_plan(_pc(), Profile(multiple_profiles=True), "torch", "float32", kv_budget_bytes=GIB)
    assert multi.bounds.opt_num_tokens is None
    with pytest.raises(PlanError, match=r"opt_num_tokens \(64\) must be unset with multiple_profiles"):
        make_plan(_pc(), Profile(multiple_profiles=True, opt_num_tokens=64), "torch", "float32")


def test_qwen3_head_dim_and_tied_and_bias_bytes() -> None:
    pc = _pc(architecture="Qwen3ForCausalLM", head_size=32, qk_layernorm=True, tie_word_embeddings=True)
    plan = make_plan(pc, load_profile("cpu-dev"), "torch", "float32")
    assert plan.memory.kv_bytes_per_token == 2 * 3 * 2 * 32 * 4
    # embed 49152; per layer q 128x64 + k,v 64x64 + o 64x128 + mlp 24576 + norms 128 + qk norms 64
    assert plan.memory.weight_bytes == 4 * (49152 + 3 * (8192 + 4096 + 4096 + 8192 + 24576 + 128 + 64) + 64)
    q2 = _pc(architecture="Qwen2ForCausalLM", attn_bias=True, tie_word_embeddings=True)
    assert weight_bytes(q2, "bfloat16", "none") == 2 * (49152 + 3 * (36992 + 64 + 32 + 32) + 64)


def test_int8_weight_only_bytes() -> None:
    plan = make_plan(_pc(), load_profile("cpu-dev").with_overrides(quantization="int8_wo"), "torch", "float32")
    # linears 1 byte + 4-byte scale per output row; embed, lm_head and norms stay float32
    per_layer = 36864 + 4 * (64 + 32 + 32 + 64 + 128 + 128 + 64) + 4 * 128
    assert plan.memory.weight_bytes == 4 * 2 * 49152 + 3 * per_layer + 4 * 64 == 511_744
    assert plan.quant_algo == "W8A16"


def test_kv_budget_too_small_names_the_numbers() -> None:
    with pytest.raises(PlanError) as err:
        make_plan(_pc(), Profile(max_seq_len=2048, max_tokens_in_paged_kv_cache=1000), "torch", "float32")
    msg = str(err.value)
    assert "holds 31 blocks (1000 tokens at 768 bytes per token" in msg
    assert "one max_seq_len 2048 sequence needs 64 blocks of 32 tokens" in msg
    with pytest.raises(PlanError, match="holds 7 blocks"):
        # int(0.9 x 200000) // 768 = 234 tokens = 7 blocks
        make_plan(_pc(), Profile(max_seq_len=2048), "torch", "float32", kv_budget_bytes=200_000, budget_source="x")


def test_target_limits() -> None:
    with pytest.raises(PlanError, match="dtype float64 \\(the checkpoint's dtype\\) cannot run on the torch target; "
                                        "choose one of float32, bfloat16, float16"):
        make_plan(_pc(), Profile(max_tokens_in_paged_kv_cache=4096), "torch", "float64")
    with pytest.raises(PlanError, match="quantization fp8 is not available on the torch target"):
        make_plan(_pc(), Profile(quantization="fp8"), "torch", "float32")
    with pytest.raises(PlanError, match="max_beam_width 4: .* must be 1"):
        make_plan(_pc(), Profile(max_beam_width=4), "torch", "float32")
    fp16 = make_plan(_pc(), load_profile("cpu-dev").with_overrides(dtype="float16"), "torch", "float32")
    assert fp16.dtype == "float16" and fp16.memory.kv_bytes_per_token == 384
    assert any("float16 runs slowly on CPU" in w for w in fp16.warnings)
    assert make_plan(_pc(), Profile(quantization="fp8"), "trtllm", "bfloat16").quant_algo == "FP8"
    auto = load_profile("cpu-dev").with_overrides(dtype="auto")
    assert make_plan(_pc(), auto, "torch", "bfloat16").dtype == "bfloat16"


def test_bad_model_config_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="hidden_act 'gelu' is not supported"):
        make_plan(_pc(hidden_act="gelu"), Profile(), "torch", "float32")


def test_plan_inspect_and_engine_size_the_same_kv_pool(tiny_checkpoint_factory: Any, tmp_path: Any) -> None:
    """One rule (rules.kv_pool): cpu-dev's 32768-token cap would be 1024 blocks, but 2 sequences of
    128 tokens can use 2 x 4 blocks, and plan, `inspect` and the running engine all say 8."""
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.engine_dir import read_engine_dir
    from trtprompt.report import inspect_data

    req = BuildRequest(tiny_checkpoint_factory("llama"), tmp_path / "engine", "cpu-dev",
                       overrides={"max_batch_size": 2, "max_seq_len": 128}, progress=False)
    plans: list[Any] = []
    path = run_build(req, on_plan=lambda _c, _p, plan: plans.append(plan))
    assert path is not None and plans[0].memory.num_blocks == 8 and plans[0].memory.kv_cache_tokens == 256
    shown = inspect_data(read_engine_dir(path))["memory_plan"]
    engine = LLMEngine.from_engine_dir(path)
    assert shown["num_blocks"] == engine.stats().max_num_blocks == 8
    assert shown["runtime_max_input_len"] == engine.max_input_len == 127
