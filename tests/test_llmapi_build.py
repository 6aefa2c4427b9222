"""`build --target trtllm --trtllm-api llmapi`: an engine directory for TensorRT-LLM's LLM API (1.3+)
written without TensorRT-LLM (checkpoint/, tokenizer/, trtprompt.json, config.json and ONE model.yaml
carrying the bounds, chunked prefill, block reuse and the PyTorch backend); the option refused for the
torch target; validation by TensorRT-LLM's own argument class where it is importable (a stand-in
class here: TensorRT-LLM cannot be installed on this machine) and one note where it is not."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.plan import BuildPlan, make_plan
from trtprompt.profile import load_profile
from trtprompt.targets.llmapi_build import default_trtllm_api
from trtprompt.targets.llmapi_config import LlmapiPaths, llm_args, to_yaml, validate_llm_args

# A Llama-3-8B-like shape (as tests/test_trtllm_config.py), so the chat profile's 8k context fits.
LLAMA = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_size=128,
             max_position_embeddings=32768, rotary_scaling=None, tie_word_embeddings=False,
             attn_bias=False, qk_layernorm=False, hidden_act="silu")


def chat_plan() -> tuple[BuildPlan, dict[str, Any]]:
    profile = load_profile("chat")
    return make_plan(LLAMA, profile, "trtllm", "bfloat16"), dict(profile.section("runtime"))


def test_model_yaml_carries_bounds_reuse_and_chunked_prefill(tmp_path: Path) -> None:
    plan, runtime = chat_plan()
    args = llm_args(plan, runtime, LlmapiPaths(tmp_path / "checkpoint", tmp_path / "tokenizer"), 2, 1)
    assert args == {
        "model": str(tmp_path / "checkpoint"), "tokenizer": str(tmp_path / "tokenizer"), "backend": "pytorch",
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "dtype": "bfloat16",
        "guided_decoding_backend": "xgrammar",  # TensorRT-LLM leaves guided decoding off without it
        "max_batch_size": 64, "max_num_tokens": 8192, "max_seq_len": 8192, "max_input_len": 1024,
        "max_beam_width": 1,
        "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True, "free_gpu_memory_fraction": 0.9},
        "enable_chunked_prefill": True,
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
        "triton_config": {"max_batch_size": 0, "decoupled": True}}
    assert yaml.safe_load(to_yaml(args)) == args


def test_memory_knobs_under_their_llm_api_names(tmp_path: Path) -> None:
    plan, runtime = chat_plan()
    runtime |= {"max_tokens_in_paged_kv_cache": 65536, "kv_cache_free_gpu_mem_fraction": 0.5,
                "batch_scheduler_policy": "max_utilization", "kv_cache_host_memory_bytes": 1 << 30}
    args = llm_args(plan, runtime, LlmapiPaths(tmp_path / "c", tmp_path / "t"))
    assert args["kv_cache_config"] == {"tokens_per_block": 32, "enable_block_reuse": True,
                                       "free_gpu_memory_fraction": 0.5, "max_tokens": 65536,
                                       "host_cache_size": 1 << 30}
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}


def test_paths_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="model must be an absolute path"):
        LlmapiPaths(Path("checkpoint"), Path("/t"))


def test_default_api_follows_the_installed_version() -> None:
    assert default_trtllm_api("1.2.1") == "engine"
    assert default_trtllm_api("") == "engine"  # none installed: the engine build names the 1.2 container
    assert default_trtllm_api("1.3.0rc20") == "llmapi"
    assert default_trtllm_api("1.4.0") == "llmapi"


def _build(ckpt: Path, out: Path, *more: str) -> Any:
    return CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--target", "trtllm", "--trtllm-api",
                                     "llmapi", "--max-seq-len", "2048", "--no-progress", *more])


def test_build_writes_the_directory_without_tensorrt_llm(tiny_checkpoint_factory: Callable[..., Path],
                                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, out = tiny_checkpoint_factory("llama"), tmp_path / "engine"
    with caplog.at_level(logging.WARNING, logger="trtprompt.build"):
        result = _build(ckpt, out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "config.json", "model.yaml", "tokenizer",
                                                     "trtprompt.json"]
    assert {p.name for p in ckpt.iterdir() if p.is_file()} == {p.name for p in (out / "checkpoint").iterdir()}
    args = yaml.safe_load((out / "model.yaml").read_text())
    assert args["model"] == str(out / "checkpoint") and args["backend"] == "pytorch"
    assert args["max_seq_len"] == 2048 and args["enable_chunked_prefill"] is True
    assert args["kv_cache_config"]["enable_block_reuse"] is True
    assert args["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    meta = json.loads((out / "trtprompt.json").read_text())
    assert meta["target"] == "trtllm-llmapi" and meta["llmapi"]["validated_with"] is None
    assert meta["llmapi"]["checkpoint"] in ("linked", "copied")
    notes = [r.message for r in caplog.records if "not installed" in r.message]
    assert len(notes) == 1 and "TorchLlmArgs" in notes[0]  # said once
    inspect = CliRunner().invoke(main, ["inspect", str(out)])
    assert inspect.exit_code == 0 and "target trtllm-llmapi" in inspect.output


def test_the_option_is_refused_for_the_torch_target(tiny_checkpoint_factory: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(tmp_path / "e"),
                                       "--trtllm-api", "llmapi"])
    assert result.exit_code == 2
    assert "--trtllm-api llmapi applies to --target trtllm only" in result.output
    assert not (tmp_path / "e").exists()


class _StandInArgs:
    """Stands in for tensorrt_llm.llmapi.TorchLlmArgs (TensorRT-LLM cannot be installed here): refuses
    unknown keys, as the real pydantic model (extra="forbid") does."""

    FIELDS = {"model", "tokenizer", "backend", "tensor_parallel_size", "pipeline_parallel_size", "dtype",
              "max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len", "max_beam_width",
              "kv_cache_config", "enable_chunked_prefill", "scheduler_config", "guided_decoding_backend"}

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - self.FIELDS
        if unknown:
            raise ValueError(f"extra fields not permitted: {sorted(unknown)}")


def _install_stand_in(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    package, llmapi = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.llmapi")
    setattr(llmapi, "TorchLlmArgs", cls)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)


def test_validated_with_tensorrt_llms_own_class_where_installed(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    _install_stand_in(monkeypatch, _StandInArgs)
    plan, runtime = chat_plan()
    args = llm_args(plan, runtime, LlmapiPaths(tmp_path / "c", tmp_path / "t"))
    assert validate_llm_args(args) == "_StandInArgs"  # triton_config left out: not an LLM API argument
    with pytest.raises(ValueError, match="refuses the model.yaml arguments: extra fields not permitted"):
        validate_llm_args({**args, "enable_chunked_context": True})


def test_without_tensorrt_llm_nothing_validates() -> None:
    assert validate_llm_args({"model": "/m"}) is None


def test_print_commands_is_the_engine_builds(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "--target", "trtllm",
                                       "--trtllm-api", "llmapi", "--print-commands"])
    assert result.exit_code == 2 and "an llmapi build compiles nothing" in result.output
