"""`serve` of an llmapi engine directory: `--repo-only` writes the repository around TensorRT-LLM's
llmapi `tensorrt_llm` model (model.py from the installed TensorRT-LLM models, or a note saying where it
comes from) with this project's prompt edge in front as `ensemble`; plain `serve` refuses to start
without that model.py and names the container. The edge's request mapping is tested as plain functions.

TensorRT-LLM's model.py cannot be installed here: where a test needs one, a stand-in file is put in a
temporary "installed models" folder (named by TRTPROMPT_LLMAPI_MODEL_DIR) to check it is copied, not ours."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.error_codes import BadRequestError
from trtprompt.prompt.edge import EdgePrompt
from trtprompt.serve.launch.llmapi_repository import MODEL_DIR_ENV, PLACEHOLDER, find_llmapi_model
from trtprompt.serve.launch.trtllm_model_config import parse_config_text
from trtprompt.serve.triton_models.llmapi_edge import (
    SALT_REFUSAL,
    core_outputs,
    edge_request,
    ensemble_outputs,
    llmapi_inputs,
)


def _repo_only(engine: Path, repo: Path, *more: str) -> Any:
    return CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *more])


def test_repo_only_without_tensorrt_llm(llmapi_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    result = _repo_only(llmapi_engine, tmp_path / "repo", "--max-batch-size", "8")
    assert result.exit_code == 0, result.output
    repo = tmp_path / "repo"
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()) == [
        "ensemble/1/model.py", "ensemble/config.pbtxt", f"tensorrt_llm/1/{PLACEHOLDER}", "tensorrt_llm/1/model.yaml",
        "tensorrt_llm/config.pbtxt"]
    assert "not installed here" in result.output
    note = (repo / "tensorrt_llm" / "1" / PLACEHOLDER).read_text()
    assert "all_models/llmapi/tensorrt_llm/1/model.py" in note and MODEL_DIR_ENV in note
    args = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert args["model"] == str(llmapi_engine / "checkpoint") and args["backend"] == "pytorch"
    assert (args["max_seq_len"], args["max_batch_size"]) == (2048, 8)  # the serve option lowers the bound
    assert args["enable_chunked_prefill"] is True and args["kv_cache_config"]["enable_block_reuse"] is True
    assert args["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    core = parse_config_text((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert (core.backend, core.max_batch_size, core.model_transaction_policy.decoupled) == ("python", 0, True)
    ensemble = parse_config_text((repo / "ensemble" / "config.pbtxt").read_text())
    assert ensemble.model_transaction_policy.decoupled and ensemble.backend == "python"
    names = {t.name for t in ensemble.input}
    assert {"text_input", "max_tokens", "stream", "stop_words", "messages", "overflow", "cache_salt"} <= names
    assert [t.name for t in ensemble.output][0] == "text_output"
    assert "llmapi_edge" in (repo / "ensemble" / "1" / "model.py").read_text()  # this project's edge model


def test_installed_model_py_is_copied_not_ours(llmapi_engine: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    installed = tmp_path / "installed" / "tensorrt_llm"
    (installed / "1").mkdir(parents=True)
    (installed / "1" / "model.py").write_text("# stand-in for TensorRT-LLM's llmapi model.py\n")
    (installed / "1" / "helpers.py").write_text("# stand-in helpers\n")
    (installed / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n'
                                            'input [ { name: "text_input" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
                                            'output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]\n')
    monkeypatch.setenv(MODEL_DIR_ENV, str(installed))
    assert find_llmapi_model() == installed
    result = _repo_only(llmapi_engine, tmp_path / "repo")
    assert result.exit_code == 0, result.output
    version = tmp_path / "repo" / "tensorrt_llm" / "1"
    assert (version / "model.py").read_text().startswith("# stand-in for TensorRT-LLM's")
    assert (version / "helpers.py").is_file() and not (version / PLACEHOLDER).exists()
    core = parse_config_text((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text())
    assert [t.name for t in core.input] == ["text_input"]  # TensorRT-LLM's own signature, kept
    assert (core.max_batch_size, core.model_transaction_policy.decoupled) == (0, True)


def test_serve_without_the_model_names_the_container(llmapi_engine: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    result = CliRunner().invoke(main, ["serve", str(llmapi_engine), "--run-dir", str(tmp_path / "run"), "--no-openai"])
    assert result.exit_code == 1
    assert "llmapi Triton model (all_models/llmapi/tensorrt_llm/1/model.py) is not installed here" in result.output
    assert "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3" in result.output
    assert not (tmp_path / "run").exists()  # refused before writing anything


class _Edge:
    """PromptEdge.prepare stand-in: records the call, keeps or cuts the prompt."""

    def __init__(self, cut: int = 0) -> None:
        self.cut, self.calls = cut, []

    def prepare(self, text: str, messages: Any, overflow: Any, salt: Any, max_tokens: int) -> EdgePrompt:
        self.calls.append((text, messages, overflow, salt, max_tokens))
        return EdgePrompt([1, 2, 3], self.cut, 0)


def _tensors(**values: Any) -> dict[str, np.ndarray]:
    out = {}
    for name, value in values.items():
        dtype = object if isinstance(value, (str, bytes)) else None
        out[name] = np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)
    return out


def test_edge_maps_client_inputs_to_llmapi_names() -> None:
    edge = _Edge()
    tensors = _tensors(text_input="Hello", max_tokens=np.int32(16), stream=True, temperature=np.float32(0.5),
                       top_k=np.int32(4), seed=np.uint64(7))
    tensors["stop_words"] = np.array([[b"END", b"STOP"]], dtype=object)
    result = edge_request(tensors, edge.prepare, lambda ids: "decoded")
    assert edge.calls == [("Hello", None, None, None, 16)]
    inputs = llmapi_inputs(result)
    assert inputs["text_input"].tolist() == [b"Hello"]  # untouched prompt: handed on unchanged
    assert inputs["sampling_param_max_tokens"].tolist() == [16] and inputs["streaming"].tolist() == [True]
    assert inputs["sampling_param_stop"].tolist() == [b"END", b"STOP"]
    assert inputs["sampling_param_temperature"].dtype == np.float32 and inputs["sampling_param_top_k"].tolist() == [4]
    assert inputs["sampling_param_seed"].dtype == np.uint64


def test_edge_hands_on_the_kept_text_of_a_cut_prompt() -> None:
    result = edge_request(_tensors(text_input="long prompt", max_tokens=np.int32(4)), _Edge(cut=5).prepare,
                          lambda ids: f"ids {ids}")
    assert result.text == "ids [1, 2, 3]"


def test_edge_refuses_a_salt_and_a_missing_max_tokens() -> None:
    with pytest.raises(BadRequestError, match="cache_salt' cannot be honoured"):
        edge_request(_tensors(text_input="x", max_tokens=np.int32(4), cache_salt="tenant"), _Edge().prepare, str)
    assert "llmapi Triton model has no per-request cache salt input" in SALT_REFUSAL
    with pytest.raises(BadRequestError, match="input 'max_tokens' is required"):
        edge_request(_tensors(text_input="x"), _Edge().prepare, str)


def test_outputs_under_the_ensemble_names() -> None:
    core = {"text_output": np.array([b"hi"], dtype=object), "kv_cache_reused_block": np.array([3], dtype=np.int32)}
    assert set(ensemble_outputs(core, frozenset())) == {"text_output"}
    out = ensemble_outputs(core, frozenset({"kv_cache_reused_blocks"}))
    assert out["kv_cache_reused_blocks"].tolist() == [[3]] and out["text_output"].shape == (1, 1)


def test_return_log_probs_asks_for_the_cumulative_logprob() -> None:
    """Issue 37: return_log_probs -> the llmapi model's return_cumulative_logprob; its cumulative_logprob
    (one per CompletionOutput, sent as text by model.py) comes back as FP32 cum_log_probs."""
    result = edge_request(_tensors(text_input="x", max_tokens=np.int32(4), return_log_probs=True), _Edge().prepare, str)
    inputs = llmapi_inputs(result)
    assert inputs["return_cumulative_logprob"].tolist() == [True] and inputs["return_cumulative_logprob"].dtype == bool
    assert core_outputs(frozenset({"cum_log_probs"})) == ["text_output", "cumulative_logprob"]
    core = {"text_output": np.array([b"hi"], dtype=object), "cumulative_logprob": np.array([b"-1.25"], dtype=object)}
    out = ensemble_outputs(core, frozenset({"cum_log_probs"}))
    assert out["cum_log_probs"].dtype == np.float32 and out["cum_log_probs"].tolist() == [[-1.25]]
    none = ensemble_outputs({"cumulative_logprob": np.array([b"None"], dtype=object)}, frozenset({"cum_log_probs"}))
    assert np.isnan(none["cum_log_probs"][0, 0])  # not computed: NaN, never a made-up number


@pytest.mark.parametrize(("name", "value", "field"), [
    ("num_return_sequences", np.int32(2), "'n'"), ("beam_width", np.int32(4), "'use_beam_search'"),
    ("bad_words", "no", "'bad'"), ("embedding_bias_words", "x", "'embedding_bias'"),
    ("return_context_logits", True, "'return_context_logits'"),
    ("return_generation_logits", True, "'return_generation_logits'"),
])
def test_edge_refuses_what_the_llmapi_model_cannot_carry(name: str, value: object, field: str) -> None:
    with pytest.raises(BadRequestError, match=f"input '{name}' cannot be honoured: .*SamplingParams {field}"):
        edge_request(_tensors(text_input="x", max_tokens=np.int32(4), **{name: value}), _Edge().prepare, str)


def test_edge_accepts_the_defaults_of_what_it_cannot_carry() -> None:
    """n 1, beam width 1 and false logits switches ask for nothing more: accepted, as every layout does."""
    tensors = _tensors(text_input="x", max_tokens=np.int32(4), num_return_sequences=np.int32(1),
                       beam_width=np.int32(1), return_context_logits=False, return_generation_logits=False)
    assert edge_request(tensors, _Edge().prepare, str).max_tokens == 4


def test_llmapi_ensemble_declares_the_uncarried_inputs_and_cum_log_probs(llmapi_engine: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    from trtprompt.serve.launch.llmapi_repository import UNCARRIED_INPUTS
    from trtprompt.serve.triton_models.llmapi_edge import UNCARRIED

    assert UNCARRIED_INPUTS == tuple(UNCARRIED)  # repeated in launch/, which may not import triton_models/
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    assert _repo_only(llmapi_engine, tmp_path / "repo").exit_code == 0
    ensemble = parse_config_text((tmp_path / "repo" / "ensemble" / "config.pbtxt").read_text(encoding="utf-8"))
    assert set(UNCARRIED) | {"return_log_probs"} <= {t.name for t in ensemble.input}
    assert [(t.name, t.data_type, list(t.dims)) for t in ensemble.output if t.name == "cum_log_probs"] == [
        ("cum_log_probs", mc.TYPE_FP32, [-1])]
    assert "output_log_probs" not in {t.name for t in ensemble.output}  # the llmapi model has no per-token values
    core = parse_config_text((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text(encoding="utf-8"))
    assert "return_cumulative_logprob" in {t.name for t in core.input}
    assert "cumulative_logprob" in {t.name for t in core.output}
