"""The trtllm target's model repository: `serve --repo-only` on the engine fixtures writes config.pbtxt
files that parse with tritonclient's ModelConfig schema and carry the expected values."""

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
from trtprompt.serve.launch.trtllm_model_config import TrtllmModelParams, config_text, parse_config_text

MODELS = ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]


def _repo_only(engine: Path, repo: Path, *extra: str) -> Any:
    return CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *extra])


def _parse(path: Path) -> mc.ModelConfig:
    text = path.read_text(encoding="utf-8")
    assert "${" not in text
    return text_format.Parse(text, mc.ModelConfig())


@pytest.fixture(scope="module")
def good_repo(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trtllm-repo")
    engine = make_engine_dir("good", root / "engine", tiny_checkpoint_factory("llama"))
    result = _repo_only(engine, root / "repo")
    assert result.exit_code == 0, result.output
    return root / "repo"


def test_repo_has_upstream_layout_and_every_file_parses(good_repo: Path) -> None:
    assert sorted(p.parent.name for p in good_repo.glob("*/config.pbtxt")) == MODELS
    for name in MODELS:
        assert _parse(good_repo / name / "config.pbtxt").name == name
    assert (good_repo / "tensorrt_llm" / "1").is_dir()
    assert not (good_repo / "tensorrt_llm" / "1" / "model.py").exists()  # C++ backend: no python file


def test_core_model_values(good_repo: Path) -> None:
    cfg = _parse(good_repo / "tensorrt_llm" / "config.pbtxt")
    assert cfg.backend == "tensorrtllm" and cfg.max_batch_size == 64
    assert cfg.model_transaction_policy.decoupled is True
    assert list(cfg.dynamic_batching.preferred_batch_size) == [64]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 256
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, mc.ModelInstanceGroup.KIND_CPU)]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    engine = str((good_repo.parent / "engine").resolve())
    assert params == {
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": engine,
        "enable_kv_cache_reuse": "true", "enable_chunked_context": "true",
        "batch_scheduler_policy": "guaranteed_no_evict", "kv_cache_free_gpu_mem_fraction": "0.9",
        "max_beam_width": "1", "max_attention_window_size": "4096", "exclude_input_in_output": "false",
        "cancellation_check_period_ms": "100", "stats_check_period_ms": "100",
        "iter_stats_max_iterations": "1000", "request_stats_max_iterations": "0", "normalize_log_probs": "true",
        "kv_cache_onboard_blocks": "true", "kv_cache_host_memory_bytes": "0", "decoding_mode": "top_k_top_p",
        "multi_block_mode": "true", "enable_context_fmha_fp32_acc": "false", "cuda_graph_mode": "false",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    }
    inputs = {t.name: t for t in cfg.input}
    assert not inputs["input_ids"].optional and inputs["input_ids"].allow_ragged_batch
    assert inputs["input_lengths"].HasField("reshape") and list(inputs["input_lengths"].reshape.shape) == []
    assert inputs["seed"].data_type == mc.TYPE_UINT64 and inputs["min_tokens"].optional
    assert inputs["prompt_embedding_table"].data_type == mc.TYPE_BF16  # the engine's dtype
    outputs = {t.name for t in cfg.output}
    assert {"output_ids", "sequence_length", "kv_cache_reused_blocks", "kv_cache_alloc_new_blocks",
            "kv_cache_alloc_total_blocks", "first_token_time_ns"} <= outputs


def test_ensemble_feeds_only_declared_core_tensors(good_repo: Path) -> None:
    core = _parse(good_repo / "tensorrt_llm" / "config.pbtxt")
    ensemble = _parse(good_repo / "ensemble" / "config.pbtxt")
    (step,) = [s for s in ensemble.ensemble_scheduling.step if s.model_name == "tensorrt_llm"]
    assert set(step.input_map) <= {t.name for t in core.input}
    assert set(step.output_map) <= {t.name for t in core.output}
    assert step.input_map["seed"] == "seed"


def test_runtime_overrides_land_in_core_config(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    result = _repo_only(engine, tmp_path / "repo", "--disable-chunked-context", "--max-tokens-in-paged-kv-cache",
                        "65536", "--batch-scheduler-policy", "max_utilization", "--max-batch-size", "8",
                        "--kv-cache-free-gpu-mem-fraction", "0.5")
    assert result.exit_code == 0, result.output
    cfg = _parse(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert (params["enable_chunked_context"], params["max_tokens_in_paged_kv_cache"],
            params["batch_scheduler_policy"], params["kv_cache_free_gpu_mem_fraction"]) == (
        "false", "65536", "max_utilization", "0.5")
    assert cfg.max_batch_size == 8


@pytest.mark.parametrize(("fixture", "message"), [
    ("no_paged_context_fmha", "enable_chunked_context needs an engine built with plugin_config.use_paged_context_fmha"),
    ("gather_context_logits", "gather_context_logits"),
])
def test_repo_only_refuses_engines_that_cannot_honour_the_profile(
        fixture: str, message: str, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir(fixture, tmp_path / "engine", tiny_checkpoint_factory("llama"))
    result = _repo_only(engine, tmp_path / "repo")
    assert result.exit_code != 0 and message in result.output
    assert not (tmp_path / "repo" / "tensorrt_llm").exists()


def test_tp2_fixture_repository(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir("tp2", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    assert _repo_only(engine, tmp_path / "repo").exit_code == 0
    params = _parse(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").parameters
    assert params["gpt_model_path"].string_value == str(engine.resolve())


def test_params_bounds_and_unset_cap() -> None:
    p = TrtllmModelParams(Path("/e"), "float16", 2048, 16, max_beam_width=4)
    assert "max_tokens_in_paged_kv_cache" not in p.parameters()  # unset: no cap, no placeholder
    assert p.parameters()["decoding_mode"] == "beam_search"
    assert parse_config_text(config_text(p)).input[-1].data_type == mc.TYPE_FP16
    with pytest.raises(ValueError, match="kv_cache_free_gpu_mem_fraction must be a number in \\(0, 1\\], got 1.5"):
        TrtllmModelParams(Path("/e"), "float16", 2048, 16, kv_cache_free_gpu_mem_fraction=1.5)
    with pytest.raises(ValueError, match="batch_scheduler_policy must be one of"):
        TrtllmModelParams(Path("/e"), "float16", 2048, 16, batch_scheduler_policy="fifo")
    with pytest.raises(ValueError, match="placeholder"):
        parse_config_text('name: "x"\nmax_batch_size: ${triton_max_batch_size}\n')


def test_ensemble_client_interface_on_the_trtllm_target(good_repo: Path) -> None:
    """The same prompt inputs and token counts as the torch target's ensemble; the salt stops at
    preprocessing (the tensorrtllm backend has no salt input), and the prompt-edge counts, which
    only the torch core can hand back through an ensemble, are not declared."""
    ensemble = _parse(good_repo / "ensemble" / "config.pbtxt")
    assert {"messages", "overflow", "cache_salt", "return_num_input_tokens"} <= {t.name for t in ensemble.input}
    outputs = {t.name for t in ensemble.output}
    assert {"num_input_tokens", "num_output_tokens"} <= outputs
    assert not outputs & {"prompt_truncated_tokens", "dropped_turns"}
    steps = {s.model_name: s for s in ensemble.ensemble_scheduling.step}
    assert steps["preprocessing"].input_map["CACHE_SALT"] == "cache_salt"
    assert "cache_salt" not in steps["tensorrt_llm"].input_map
    pre = {k: v.string_value for k, v in _parse(good_repo / "preprocessing" / "config.pbtxt").parameters.items()}
    assert pre["salt_reaches_core"] == "false"


def test_trtllm_ensemble_always_asks_for_perf_outputs_and_feeds_them_to_postprocessing(good_repo: Path) -> None:
    """Issue 13: the C++ backend exports no hit rate or latency histograms, so postprocessing publishes
    them from the core's perf outputs; preprocessing forces return_perf_metrics (the client's goes there,
    since Triton refuses an ensemble input no step consumes)."""
    from trtprompt.interface import PERF_OUTPUTS

    ensemble = _parse(good_repo / "ensemble" / "config.pbtxt")
    steps = {s.model_name: s for s in ensemble.ensemble_scheduling.step}
    assert steps["preprocessing"].input_map["RETURN_PERF_METRICS"] == "return_perf_metrics"
    assert steps["preprocessing"].output_map["RETURN_PERF_METRICS"] == "_RETURN_PERF_METRICS"
    assert steps["tensorrt_llm"].input_map["return_perf_metrics"] == "_RETURN_PERF_METRICS"
    perf = [name for name, *_ in PERF_OUTPUTS]
    assert all(steps["tensorrt_llm"].output_map[name] == name for name in perf)
    assert dict(steps["postprocessing"].input_map) == {"TOKENS_BATCH": "_TOKENS_BATCH",
                                                       "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH",
                                                       **{name.upper(): name for name in perf}}
    assert set(perf) <= {t.name for t in ensemble.output}  # they always come back to the client too
    pre = _parse(good_repo / "preprocessing" / "config.pbtxt")
    post = _parse(good_repo / "postprocessing" / "config.pbtxt")
    assert pre.parameters["force_perf_metrics"].string_value == "true"
    assert {(t.name, t.data_type, t.optional) for t in pre.input if t.name == "RETURN_PERF_METRICS"} == {
        ("RETURN_PERF_METRICS", mc.TYPE_BOOL, True)}
    assert {t.name: t.optional for t in post.input} == {"TOKENS_BATCH": False, "SEQUENCE_LENGTH": False,
                                                        **{name.upper(): True for name in perf}}
    params = {k: v.string_value for k, v in post.parameters.items()}
    assert (params["publish_request_metrics"], params["gpt_model_path"]) == (
        "true", str((good_repo.parent / "engine").resolve()))
    assert [(g.count, g.kind) for g in post.instance_group] == [(1, mc.ModelInstanceGroup.KIND_CPU)]


def test_engine_threads_is_refused_on_the_trtllm_target(
        tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    result = _repo_only(engine, tmp_path / "repo", "--engine-threads", "2")
    assert result.exit_code != 0
    assert "engine_threads sets the torch target's engine process threads" in result.output


def test_compute_dtype_is_refused_on_the_trtllm_target(
        tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    result = _repo_only(engine, tmp_path / "repo", "--compute-dtype", "float32")
    assert result.exit_code != 0 and "compute_dtype sets the torch engine's arithmetic" in result.output


def test_require_cache_salt_cannot_be_served_on_the_trtllm_target(
        tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    meta = json.loads((engine / "trtprompt.json").read_text(encoding="utf-8"))
    meta["prompt"]["require_cache_salt"] = True
    (engine / "trtprompt.json").write_text(json.dumps(meta), encoding="utf-8")
    result = _repo_only(engine, tmp_path / "repo")
    assert result.exit_code != 0
    assert "require_cache_salt = true cannot be served on the trtllm target" in result.output
