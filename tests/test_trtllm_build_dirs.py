"""Engine directories written by plain `trtllm-build` (no trtprompt.json): read, inspected and turned
into a model repository by `serve --repo-only`, with the tokenizer from --tokenizer or beside the engine.

The directories are the hand-written TensorRT-LLM 1.2 fixtures (tests/fixtures/trtllm, config.json as
trtllm-build writes it) with placeholder rank<N>.engine files and no trtprompt.json; TensorRT-LLM
itself does not run here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main
from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.errors import EngineDirError


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def _params(repo: Path, model: str) -> dict[str, str]:
    cfg = text_format.Parse((repo / model / "config.pbtxt").read_text(encoding="utf-8"), mc.ModelConfig())
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_tp1_with_tokenizer_beside_the_engine(tmp_path: Path, checkpoint: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e", checkpoint, trtllm_build=True, tokenizer_beside=True)
    assert not (engine / "trtprompt.json").exists()
    info = read_engine_dir(engine)
    assert (info.target, info.world_size, info.built_by_trtprompt) == ("trtllm", 1, False)
    assert info.tokenizer_dir == engine.resolve()
    assert info.build_config["max_seq_len"] == 4096 and info.tokens_per_block == 32
    # Nothing recorded: TensorRT-LLM's defaults, reuse on because the engine can do it.
    assert dict(info.runtime) == {"enable_kv_cache_reuse": True, "enable_chunked_context": False}
    assert dict(info.prompt) == {}


def test_tp2_needs_every_rank_file(tmp_path: Path, checkpoint: Path) -> None:
    engine = make_engine_dir("tp2", tmp_path / "e", checkpoint, trtllm_build=True)
    info = read_engine_dir(engine)
    assert (info.world_size, info.tokenizer_dir) == (2, engine.resolve() / "tokenizer")
    (engine / "rank1.engine").unlink()
    with pytest.raises(EngineDirError, match="incomplete for world size 2: missing rank1.engine"):
        read_engine_dir(engine)


def test_tokenizer_from_option_or_a_clear_error(tmp_path: Path, checkpoint: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e", trtllm_build=True)
    with pytest.raises(EngineDirError, match="has no tokenizer: pass --tokenizer DIR"):
        read_engine_dir(engine)
    assert read_engine_dir(engine, checkpoint).tokenizer_dir == checkpoint.resolve()
    with pytest.raises(EngineDirError, match=f"--tokenizer {tmp_path} has no tokenizer files"):
        read_engine_dir(engine, tmp_path)


@pytest.mark.parametrize("fixture,world", [("good", 1), ("tp2", 2)])
def test_serve_repo_only(tmp_path: Path, checkpoint: Path, fixture: str, world: int) -> None:
    engine = make_engine_dir(fixture, tmp_path / "e", trtllm_build=True)
    result = _cli("serve", str(engine), "--repo-only", str(tmp_path / "repo"), "--tokenizer", str(checkpoint))
    assert result.exit_code == 0, result.output
    repo = tmp_path / "repo"
    assert sorted(p.parent.name for p in repo.glob("*/config.pbtxt")) == [
        "ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    core = _params(repo, "tensorrt_llm")
    assert core["gpt_model_path"] == str(engine.resolve())
    assert (core["enable_kv_cache_reuse"], core["enable_chunked_context"]) == ("true", "false")
    for model in ("preprocessing", "postprocessing"):
        assert _params(repo, model)["tokenizer_dir"] == str(checkpoint.resolve())
    assert read_engine_dir(engine, checkpoint).world_size == world


@pytest.mark.parametrize("flag", ["--enable-kv-cache-reuse", "--enable-chunked-context"])
def test_flags_the_engine_cannot_honour_are_refused(tmp_path: Path, checkpoint: Path, flag: str) -> None:
    engine = make_engine_dir("no_paged_context_fmha", tmp_path / "e", checkpoint, trtllm_build=True)
    plain = _cli("serve", str(engine), "--repo-only", str(tmp_path / "repo"))
    assert plain.exit_code == 0, plain.output  # reuse is off by default on such an engine
    assert _params(tmp_path / "repo", "tensorrt_llm")["enable_kv_cache_reuse"] == "false"
    refused = _cli("serve", str(engine), "--repo-only", str(tmp_path / "repo2"), flag)
    assert refused.exit_code != 0
    assert "plugin_config.use_paged_context_fmha" in refused.output and "has it off" in refused.output


def test_inspect_plain_engine(tmp_path: Path, checkpoint: Path) -> None:
    engine = make_engine_dir("tp2", tmp_path / "e", checkpoint, trtllm_build=True)
    text = _cli("inspect", str(engine))
    assert text.exit_code == 0, text.output
    assert "not recorded (engine built by trtllm-build, not trtprompt)" in text.output
    raw = _cli("inspect", str(engine), "--json")
    data = json.loads(raw.output)
    assert data["target"] == "trtllm" and data["provenance"]["built_by"] == "trtllm-build"
    assert data["bounds"]["max_seq_len"] == 4096 and "lora_config" not in data["bounds"]
    assert data["plugin_config"]["use_paged_context_fmha"] is True
    no_tok = make_engine_dir("good", tmp_path / "bare", trtllm_build=True)
    assert _cli("inspect", str(no_tok)).exit_code != 0
    assert _cli("inspect", str(no_tok), "--tokenizer", str(checkpoint)).exit_code == 0


def test_openai_front_end_reads_only_config_json(tmp_path: Path) -> None:
    from trtprompt.serve.openai.config import FrontendConfig

    engine = make_engine_dir("tp2", tmp_path / "e", trtllm_build=True)  # no tokenizer anywhere
    cfg = FrontendConfig.for_engine(engine, "127.0.0.1:8001")
    assert (cfg.limits.name, cfg.limits.max_model_len, cfg.tokens_per_block) == ("e", 4096, 32)
