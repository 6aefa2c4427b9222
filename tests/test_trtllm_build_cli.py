"""`trtprompt build --target trtllm` end to end: one clear message without TensorRT-LLM; with the fake
tensorrt_llm (tests/fake_trtllm, because the real one cannot be installed here) a complete engine
directory that `inspect` reads and `serve --repo-only` turns into a schema-valid repository; and the
post-build check refusing an engine whose paged context FMHA the builder switched off."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from trtllm_fixtures import calls, fake_trtllm  # noqa: F401  (fixture)

from trtprompt.cli import main
from trtprompt.serve.launch.trtllm_model_config import parse_config_text


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_without_tensorrt_llm_one_clear_message(tiny_checkpoint_factory: Callable[..., Path],
                                                tmp_path: Path) -> None:
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(out),
                                       "--target", "trtllm"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "Error: TensorRT-LLM is not installed, so --target trtllm cannot build here (No module named "
        "'tensorrt_llm'). Build inside the nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3 container "
        "(TensorRT-LLM 1.2.1), build for TensorRT-LLM 1.3+'s LLM API with --trtllm-api llmapi (no TensorRT-LLM "
        "needed to build), or use --target torch."]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_build_with_fake_then_inspect_and_repo_only(fake_trtllm: Path,  # noqa: F811
                                                    tiny_checkpoint_factory: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    out, runner = tmp_path / "engine", CliRunner()
    result = runner.invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(out), "--target",
                                  "trtllm", "--profile", "code-complete", "--dtype", "bfloat16", "--tp-size", "2",
                                  "--no-progress"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"engine written to {out}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.engine", "rank1.engine", "tokenizer",
                                                     "trtprompt.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["version"] == "1.2.1"  # TensorRT-LLM's own config.json, not overwritten
    assert config["build_config"]["plugin_config"]["use_paged_context_fmha"] is True
    meta = json.loads((out / "trtprompt.json").read_text())
    assert meta["target"] == "trtllm" and meta["runtime"]["enable_kv_cache_reuse"] is True
    assert [b["rank"] for b in calls(fake_trtllm, "build")] == [0, 1]

    inspected = runner.invoke(main, ["inspect", str(out), "--json"])
    assert inspected.exit_code == 0, inspected.output
    repo = tmp_path / "repo"
    served = runner.invoke(main, ["serve", str(out), "--repo-only", str(repo)])
    assert served.exit_code == 0, served.output
    core = parse_config_text((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert core.backend == "tensorrtllm" and core.max_batch_size == 32
    assert core.parameters["max_attention_window_size"].string_value == "4096"


def test_post_build_check_refuses_and_leaves_nothing(fake_trtllm: Path,  # noqa: F811
                                                     tiny_checkpoint_factory: Callable[..., Path],
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_KV_CACHE_QUANT_ALGO", "INT8")  # the builder then drops paged context FMHA
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(out),
                                       "--target", "trtllm", "--profile", "code-complete", "--no-progress"])
    assert result.exit_code == 1
    assert ("enable_chunked_context needs plugin_config.use_paged_context_fmha, which the engine has off "
            "(the KV cache is INT8)") in result.output
    assert not out.exists() and list(tmp_path.glob(".engine*")) == []
    assert len(calls(fake_trtllm, "save")) == 1  # it was built, then refused


def test_print_commands_builds_nothing(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(out), "--target",
                                       "trtllm", "--profile", "offline-batch", "--print-commands"])
    assert result.exit_code == 0, result.output
    assert "--multiple_profiles enable" in result.output and "--opt_num_tokens" not in result.output
    assert f"--output_dir {out}" in result.output
    assert not out.exists()
    torch = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "--print-commands"])
    assert torch.exit_code == 2 and "--print-commands needs --target trtllm" in torch.output
