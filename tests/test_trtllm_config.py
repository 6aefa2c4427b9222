"""trtllm target: the exact TensorRT-LLM build values derived from each shipped profile, as seen by
the API (through the fake tensorrt_llm, tests/fake_trtllm: the real one cannot be installed here),
and the equivalent convert_checkpoint.py + trtllm-build command lines."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from trtllm_fixtures import calls, fake_trtllm  # noqa: F401  (fixture)

from trtprompt.plan import BuildPlan, make_plan
from trtprompt.profile import load_profile, shipped_profiles
from trtprompt.targets.trtllm_config import (
    Parallelism,
    format_commands,
    trtllm_build_args,
    trtllm_build_command,
)

# A Llama-3-8B-like model with 32k positions, so every shipped profile's max_seq_len fits.
LLAMA = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_size=128,
             max_position_embeddings=32768, rotary_scaling=None, tie_word_embeddings=False,
             attn_bias=False, qk_layernorm=False, hidden_act="silu")

# profile -> (BuildConfig values, PluginConfig values); checkpoint dtype bfloat16 unless the profile sets one.
EXPECTED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "chat": (dict(max_batch_size=64, max_input_len=1024, max_seq_len=8192, max_num_tokens=8192,
                  opt_num_tokens=64), dict(tokens_per_block=32, multiple_profiles=False, gemm_plugin="auto")),
    "code-complete": (dict(max_batch_size=32, max_input_len=1024, max_seq_len=4096, max_num_tokens=2048,
                           opt_num_tokens=32), dict(tokens_per_block=16, multiple_profiles=False, gemm_plugin="auto")),
    "cpu-dev": (dict(max_batch_size=16, max_input_len=1024, max_seq_len=2048, max_num_tokens=512,
                     opt_num_tokens=16), dict(tokens_per_block=32, multiple_profiles=False, gemm_plugin=None)),
    "offline-batch": (dict(max_batch_size=256, max_input_len=1024, max_seq_len=4096, max_num_tokens=16384,
                           opt_num_tokens=None), dict(tokens_per_block=32, multiple_profiles=True, gemm_plugin="auto")),
    "rag-long": (dict(max_batch_size=16, max_input_len=1024, max_seq_len=32768, max_num_tokens=8192,
                      opt_num_tokens=16), dict(tokens_per_block=64, multiple_profiles=False, gemm_plugin="auto")),
}
FIXED_BUILD = dict(max_beam_width=1, kv_cache_type="PAGED", gather_context_logits=False)
FIXED_PLUGIN = dict(use_paged_context_fmha=True, context_fmha=True, remove_input_padding=True)


def _plan(profile: str, **overrides: Any) -> BuildPlan:
    return make_plan(LLAMA, load_profile(profile).with_overrides(**overrides), "trtllm", "bfloat16")


def test_every_shipped_profile_has_expected_values() -> None:
    assert sorted(EXPECTED) == shipped_profiles()


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_build_args_per_profile(profile: str) -> None:
    args = trtllm_build_args(_plan(profile), "LlamaForCausalLM")
    build, plugin = EXPECTED[profile]
    assert dict(args.build_config) == build | FIXED_BUILD
    assert dict(args.plugin_config) == plugin | FIXED_PLUGIN
    assert dict(args.mapping) == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert args.quant_config is None and not args.needs_calibration
    assert args.model_class == "LLaMAForCausalLM"
    assert args.dtype == ("float32" if profile == "cpu-dev" else "bfloat16")


@pytest.fixture(scope="module")
def llama_8b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF config.json of the LLAMA shape (the fake converter reads only config.json)."""
    d = tmp_path_factory.mktemp("llama-8b-shape")
    hf = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          **{k: LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}}
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_api_receives_profile_values(profile: str, fake_trtllm: Path, llama_8b_dir: Path,  # noqa: F811
                                     tmp_path: Path) -> None:
    """The recorded tensorrt_llm calls of a whole build, per shipped profile: Mapping and QuantConfig at
    conversion, BuildConfig and PluginConfig at tensorrt_llm.build."""
    from trtprompt.checkpoint import Checkpoint
    from trtprompt.targets.trtllm_build import build_trtllm_engine

    plan = _plan(profile)
    ckpt = Checkpoint(llama_8b_dir, {}, LLAMA, (), (), "bfloat16")
    build_trtllm_engine(tmp_path, ckpt, load_profile(profile), plan)
    (convert,) = calls(fake_trtllm, "from_hugging_face")
    assert (convert["model_class"], convert["dtype"], convert["quant_config"]) == (
        "LLaMAForCausalLM", plan.dtype, None)
    assert convert["mapping"] == {"world_size": 1, "rank": 0, "tp_size": 1, "pp_size": 1, "gpus_per_node": 8}
    (built,) = calls(fake_trtllm, "build")
    build, plugin = EXPECTED[profile]
    assert {k: built["build_config"][k] for k in build | FIXED_BUILD} == build | FIXED_BUILD
    assert {k: built["plugin_config"][k] for k in plugin | FIXED_PLUGIN} == plugin | FIXED_PLUGIN
    assert json.loads((tmp_path / "config.json").read_text())["build_config"]["max_seq_len"] == build["max_seq_len"]


@pytest.mark.parametrize(("quantization", "algo", "group"), [
    ("int8_wo", "W8A16", None), ("fp8", "FP8", None), ("int4_awq", "W4A16_AWQ", 128)])
def test_quant_config(quantization: str, algo: str, group: int | None) -> None:
    args = trtllm_build_args(_plan("chat", quantization=quantization), "LlamaForCausalLM")
    expected: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if group:
        expected["group_size"] = group
    assert dict(args.quant_config or {}) == expected
    assert args.needs_calibration == (quantization != "int8_wo")


def test_parallelism_and_model_classes() -> None:
    plan = _plan("chat")
    args = trtllm_build_args(plan, "Qwen3ForCausalLM", Parallelism(tp_size=2, pp_size=2))
    assert dict(args.mapping) == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    assert args.mapping_for_rank(3) == {"world_size": 4, "tp_size": 2, "pp_size": 2, "rank": 3}
    assert args.model_class == "QWenForCausalLM"
    assert trtllm_build_args(plan, "MistralForCausalLM").model_class == "LLaMAForCausalLM"
    with pytest.raises(ValueError, match="rank must be in \\[0, 3\\], got 4"):
        args.mapping_for_rank(4)
    with pytest.raises(ValueError, match="tp_size must be an integer in \\[1, 64\\], got 0"):
        Parallelism(tp_size=0)
    with pytest.raises(ValueError, match="not trtllm"):
        trtllm_build_args(make_plan(LLAMA, load_profile("chat"), "torch", "bfloat16"), "LlamaForCausalLM")


def test_build_through_fake_records_every_rank(fake_trtllm: Path, tiny_checkpoint_factory: Any,
                                               tmp_path: Path) -> None:
    """tp=2: one Mapping per rank, one build + save per rank, rank files and config.json written."""
    from trtprompt.checkpoint import read_checkpoint
    from trtprompt.targets.trtllm_build import build_trtllm_engine

    ckpt = read_checkpoint(tiny_checkpoint_factory("llama"))
    profile = load_profile("code-complete")
    plan = make_plan(ckpt.pretrained_config, profile, "trtllm", "bfloat16")
    out = tmp_path / "engine"
    out.mkdir()
    build_trtllm_engine(out, ckpt, profile, plan, Parallelism(tp_size=2))
    converts = calls(fake_trtllm, "from_hugging_face")
    assert [c["mapping"] for c in converts] == [
        {"world_size": 2, "tp_size": 2, "pp_size": 1, "rank": r, "gpus_per_node": 8} for r in (0, 1)]
    assert {c["dtype"] for c in converts} == {"bfloat16"}
    builds = calls(fake_trtllm, "build")
    assert [b["rank"] for b in builds] == [0, 1]
    assert builds[0]["build_config"]["max_num_tokens"] == 2048
    assert builds[0]["plugin_config"]["tokens_per_block"] == 16
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.engine", "rank1.engine"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["version"] == "1.2.1"
    assert saved["pretrained_config"]["mapping"]["tp_size"] == 2


def test_calibrated_quantization_goes_through_quantize(fake_trtllm: Path, tiny_checkpoint_factory: Any,
                                                       tmp_path: Path) -> None:
    from trtprompt.checkpoint import read_checkpoint
    from trtprompt.targets.trtllm_build import build_trtllm_engine

    ckpt = read_checkpoint(tiny_checkpoint_factory("llama"))
    profile = load_profile("code-complete").with_overrides(quantization="fp8")
    plan = make_plan(ckpt.pretrained_config, profile, "trtllm", "bfloat16")
    out = tmp_path / "engine"
    out.mkdir()
    build_trtllm_engine(out, ckpt, profile, plan)
    (quantize,) = calls(fake_trtllm, "quantize")
    assert quantize["quant_config"] == {"quant_algo": "FP8", "kv_cache_quant_algo": None, "group_size": 128}
    assert [c["rank"] for c in calls(fake_trtllm, "from_checkpoint")] == [0]
    assert not calls(fake_trtllm, "from_hugging_face")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.engine"]  # scratch removed


def test_print_commands_chat_exact() -> None:
    args = trtllm_build_args(_plan("chat", quantization="int8_wo"), "LlamaForCausalLM", Parallelism(tp_size=2))
    assert trtllm_build_command(args, Path("/c"), Path("/e")) == [
        "trtllm-build", "--checkpoint_dir", "/c", "--output_dir", "/e", "--max_batch_size", "64",
        "--max_input_len", "1024", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--opt_num_tokens", "64",
        "--max_beam_width", "1", "--kv_cache_type", "paged", "--tokens_per_block", "32",
        "--use_paged_context_fmha", "enable", "--context_fmha", "enable", "--remove_input_padding", "enable",
        "--multiple_profiles", "disable", "--gemm_plugin", "auto"]
    text = format_commands(args, Path("/ck"), Path("/out/eng"), [Path("/ck/tokenizer.json")])
    lines = [line for line in text.replace("\\\n", "").splitlines() if not line.startswith("#")]
    convert = shlex.split(lines[0].replace('"$TRTLLM_EXAMPLES', '"X'))
    assert convert == ["python3", "X/models/core/llama/convert_checkpoint.py", "--model_dir", "/ck", "--output_dir",
                       "/out/eng.trtllm-checkpoint", "--dtype", "bfloat16", "--tp_size", "2", "--pp_size", "1",
                       "--use_weight_only", "--weight_only_precision", "int8"]
    assert shlex.split(lines[1])[:5] == ["trtllm-build", "--checkpoint_dir", "/out/eng.trtllm-checkpoint",
                                         "--output_dir", "/out/eng"]
    assert lines[2] == "mkdir -p /out/eng/tokenizer && cp /ck/tokenizer.json /out/eng/tokenizer/"


def test_print_commands_offline_batch_awq() -> None:
    args = trtllm_build_args(_plan("offline-batch", quantization="int4_awq"), "Qwen2ForCausalLM")
    cmd = trtllm_build_command(args, Path("/c"), Path("/e"))
    assert "--opt_num_tokens" not in cmd  # must stay unset with multiple_profiles
    assert cmd[cmd.index("--multiple_profiles") + 1] == "enable"
    text = format_commands(args, Path("/ck"), Path("/e"))
    assert '"$TRTLLM_EXAMPLES/quantization/quantize.py"' in text
    assert "--qformat int4_awq" in text and "--awq_block_size 128" in text


def test_every_engine_architecture_has_a_trtllm_class_and_converter() -> None:
    from trtprompt.engine.config import SUPPORTED_ARCHITECTURES
    from trtprompt.targets.trtllm_config import CONVERT_SCRIPTS, MODEL_CLASSES

    assert set(MODEL_CLASSES) == set(CONVERT_SCRIPTS) == set(SUPPORTED_ARCHITECTURES)
