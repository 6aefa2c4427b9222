"""Speculative decoding on the llmapi target (TensorRT-LLM 1.3+, docs/speculative-decoding.md, "Serving"): the
serve options become model.yaml's speculative_config under TensorRT-LLM's names (NGramDecodingConfig /
DraftTargetDecodingConfig, recorded in tests/fixtures/trtllm_names.json), none leaves it out, and the
per-request opt-out, which the llmapi model cannot carry, asks for no token of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.knobs import KNOBS, LLMAPI_DECODING_TYPES
from trtprompt.serve.launch.llmapi_repository import EDGE_INPUTS, draft_model, serve_model_yaml
from trtprompt.serve.launch.options import EngineInfo, resolve_options
from trtprompt.targets.llmapi_config import speculative_config

FIXTURE = Path(__file__).parent / "fixtures" / "trtllm_names.json"
LLMAPI = json.loads(FIXTURE.read_text(encoding="utf-8"))["releases"]["1.4.0rc4"]
# The knobs' defaults, under TensorRT-LLM's names.
NGRAM_DEFAULTS = {"decoding_type": "NGram", **{KNOBS[k].llmapi.split(".")[-1]: KNOBS[k].default for k in (
    "max_draft_len", "max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool",
    "speculation_max_concurrency")}}


def _model_yaml(engine: Path, repo: Path, *options: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *options])
    assert result.exit_code == 0, result.output
    return dict(yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text(encoding="utf-8")))


def test_speculative_config_of_each_mode() -> None:
    assert speculative_config({}) == NGRAM_DEFAULTS  # the torch target's default speculates here too
    assert speculative_config({"speculative_decoding": "none", "max_draft_len": 4}) is None
    assert speculative_config({"max_draft_len": 2, "is_public_pool": False, "speculation_max_concurrency": 1}) == \
        NGRAM_DEFAULTS | {"max_draft_len": 2, "is_public_pool": False, "max_concurrency": 1}
    assert speculative_config({"speculative_decoding": "draft_target", "speculative_model": "/d"}) == {
        "decoding_type": "DraftTarget", "max_draft_len": NGRAM_DEFAULTS["max_draft_len"], "speculative_model": "/d",
        "max_concurrency": NGRAM_DEFAULTS["max_concurrency"]}
    with pytest.raises(ValueError, match="draft_target needs speculative_model"):
        speculative_config({"speculative_decoding": "draft_target"})
    with pytest.raises(ValueError, match="max_draft_len"):
        speculative_config({"max_draft_len": 0})


def test_every_name_written_was_read_from_tensorrt_llm() -> None:
    """Each key of either mode's speculative_config, dotted under speculative_config, is a recorded LLM API
    name, and the decoding_type values are the recorded ones."""
    recorded = set(LLMAPI["llm_args"])
    written = {**NGRAM_DEFAULTS, **speculative_config({"speculative_decoding": "draft_target",
                                                       "speculative_model": "/d"})}
    assert "speculative_config" in recorded
    assert {f"speculative_config.{key}" for key in written} <= recorded
    assert LLMAPI["speculative_decoding_types"]["values"] == LLMAPI_DECODING_TYPES


def test_serve_writes_ngram_by_default_and_the_options_given(llmapi_engine: Path, tmp_path: Path) -> None:
    assert _model_yaml(llmapi_engine, tmp_path / "a")["speculative_config"] == NGRAM_DEFAULTS
    args = _model_yaml(llmapi_engine, tmp_path / "b", "--max-draft-len", "4", "--max-matching-ngram-size", "2",
                       "--no-is-keep-all", "--no-is-use-oldest", "--no-is-public-pool",
                       "--speculation-max-concurrency", "16")
    assert args["speculative_config"] == {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2,
                                          "is_keep_all": False, "is_use_oldest": False, "is_public_pool": False,
                                          "max_concurrency": 16}


def test_serve_with_none_writes_no_speculative_config(llmapi_engine: Path, tmp_path: Path) -> None:
    """Not even one the engine directory's model.yaml held (the serve options decide)."""
    engine = EngineInfo.read(llmapi_engine)
    assert "speculative_config" in serve_model_yaml(engine, resolve_options(engine, {}))
    off = resolve_options(engine, {"speculative_decoding": "none"})
    assert "speculative_config" not in serve_model_yaml(engine, off)
    assert "speculative_config" not in _model_yaml(llmapi_engine, tmp_path / "r", "--speculative-decoding", "none")


def test_draft_target_points_at_the_draft_checkpoint(llmapi_engine: Path, tmp_path: Path) -> None:
    """An llmapi engine directory as the draft: TensorRT-LLM loads its checkpoint/ (a Hugging Face one)."""
    args = _model_yaml(llmapi_engine, tmp_path / "r", "--speculative-decoding", "draft_target",
                       "--speculative-model", str(llmapi_engine), "--max-draft-len", "3")
    assert args["speculative_config"] == {"decoding_type": "DraftTarget", "max_draft_len": 3,
                                          "speculative_model": str(llmapi_engine.resolve() / "checkpoint"),
                                          "max_concurrency": 8}
    assert draft_model(str(llmapi_engine / "checkpoint")) == str((llmapi_engine / "checkpoint").resolve())
    assert draft_model("org/draft-model") == "org/draft-model"  # a Hugging Face Hub id, downloaded there


def test_the_llmapi_ensemble_does_not_declare_the_opt_out() -> None:
    """TensorRT-LLM's llmapi model has no such input: the OpenAI front end leaves the field out for it
    (openai/to_triton.py), since drafts change no token."""
    assert "speculative_decoding" not in EDGE_INPUTS
