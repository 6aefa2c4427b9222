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
        "guided_decoding_backend": "xgrammar",  # no xgrammar_tokenizer_info_path: the engine has no such file
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
                                                       "SEQUENCE_INDEX": "sequence_index",
                                                       **{name.upper(): name for name in perf}}
    assert set(perf) <= {t.name for t in ensemble.output}  # they always come back to the client too
    pre = _parse(good_repo / "preprocessing" / "config.pbtxt")
    post = _parse(good_repo / "postprocessing" / "config.pbtxt")
    assert pre.parameters["force_perf_metrics"].string_value == "true"
    assert {(t.name, t.data_type, t.optional) for t in pre.input if t.name == "RETURN_PERF_METRICS"} == {
        ("RETURN_PERF_METRICS", mc.TYPE_BOOL, True)}
    assert {t.name: t.optional for t in post.input} == {"TOKENS_BATCH": False, "SEQUENCE_LENGTH": False,
                                                        "SEQUENCE_INDEX": True,
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


# Issue 37: the 1.2 templates' tensors for log probabilities, sequences, beams, bad words, embedding bias and
# logits, as tensorrtllm_backend's all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt declares them
# (read at NVIDIA/TensorRT-LLM 0c8de69a, triton_backend/; tests/fixtures/trtllm_names.json says which release).
CORE_TENSORS: dict[str, tuple[int, list[int], bool]] = {  # name -> (type, dims, reshaped to [])
    "return_log_probs": (mc.TYPE_BOOL, [1], True), "num_return_sequences": (mc.TYPE_INT32, [1], True),
    "beam_width": (mc.TYPE_INT32, [1], True), "len_penalty": (mc.TYPE_FP32, [1], True),
    "early_stopping": (mc.TYPE_BOOL, [1], True), "bad_words_list": (mc.TYPE_INT32, [2, -1], False),
    "embedding_bias": (mc.TYPE_FP32, [-1], False),
}
CORE_OUTPUT_TENSORS: dict[str, tuple[int, list[int]]] = {
    "cum_log_probs": (mc.TYPE_FP32, [-1]), "output_log_probs": (mc.TYPE_FP32, [-1, -1]),
    "batch_index": (mc.TYPE_INT32, [1]), "sequence_index": (mc.TYPE_INT32, [1]),
}


def test_core_declares_the_1_2_template_tensors(good_repo: Path) -> None:
    cfg = _parse(good_repo / "tensorrt_llm" / "config.pbtxt")
    inputs, outputs = {t.name: t for t in cfg.input}, {t.name: t for t in cfg.output}
    for name, (dtype, dims, reshaped) in CORE_TENSORS.items():
        t = inputs[name]
        assert (t.data_type, list(t.dims), t.HasField("reshape"), t.optional) == (dtype, dims, reshaped, True), name
        assert t.allow_ragged_batch is not reshaped, name  # the lists are ragged, the scalars reshaped
    for name, (dtype, dims) in CORE_OUTPUT_TENSORS.items():
        assert (outputs[name].data_type, list(outputs[name].dims)) == (dtype, dims), name


def test_logits_only_where_the_engine_gathers_them(good_repo: Path, tiny_checkpoint_factory: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    """A default build gathers no logits: neither flag nor output is declared (Triton refuses the flag by name)."""
    names = {t.name for t in _parse(good_repo / "tensorrt_llm" / "config.pbtxt").input}
    outputs = {t.name for t in _parse(good_repo / "tensorrt_llm" / "config.pbtxt").output}
    assert not names & {"return_context_logits", "return_generation_logits"}
    assert not outputs & {"context_logits", "generation_logits"}
    engine = make_engine_dir("gather_context_logits", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    assert _repo_only(engine, tmp_path / "repo", "--disable-kv-cache-reuse").exit_code == 0
    cfg = _parse(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    flag = {t.name: t for t in cfg.input}["return_context_logits"]
    assert (flag.data_type, list(flag.dims), flag.HasField("reshape"), flag.optional) == (mc.TYPE_BOOL, [1], True, True)
    out = {t.name: t for t in cfg.output}
    assert (out["context_logits"].data_type, list(out["context_logits"].dims)) == (mc.TYPE_FP32, [-1, -1])
    assert "generation_logits" not in out and "return_generation_logits" not in {t.name for t in cfg.input}


def test_generation_logits_take_the_engines_logits_dtype() -> None:
    p = TrtllmModelParams(Path("/e"), "float16", 2048, 16, gather_generation_logits=True, logits_dtype="float16")
    cfg = parse_config_text(config_text(p))
    out = {t.name: t for t in cfg.output}["generation_logits"]
    assert (out.data_type, list(out.dims)) == (mc.TYPE_FP16, [-1, -1, -1])
    assert "return_generation_logits" in {t.name for t in cfg.input} and "context_logits" not in {
        t.name for t in cfg.output}
    with pytest.raises(ValueError, match="logits_dtype must be one of"):
        TrtllmModelParams(Path("/e"), "float16", 2048, 16, logits_dtype="int8")


@pytest.mark.parametrize(("built", "served", "expected"), [(4, None, 4), (4, 1, 4), (4, 2, 2), (1, 1, 1)])
def test_max_beam_width_is_the_engines_unless_lowered(built: int, served: int | None, expected: int) -> None:
    build = {"max_batch_size": 8, "max_seq_len": 512, "max_beam_width": built}
    runtime = {} if served is None else {"max_beam_width": served}
    p = TrtllmModelParams.from_engine(Path("/e"), {"dtype": "float16"}, build, runtime)
    assert p.parameters()["max_beam_width"] == str(expected)
    assert p.parameters()["decoding_mode"] == ("beam_search" if expected > 1 else "top_k_top_p")


def test_trtllm_ensemble_routes_the_1_2_template_tensors(tiny_checkpoint_factory: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    """`serve --repo-only` writes the four models as the 1.2 templates chain them (names, types, dims, maps):
    trtllm_model_configs is what repository.model_configs writes for the trtllm target."""
    engine_dir = make_engine_dir("gather_context_logits", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    assert _repo_only(engine_dir, tmp_path / "repo", "--disable-kv-cache-reuse").exit_code == 0
    models = {name: _parse(tmp_path / "repo" / name / "config.pbtxt") for name in MODELS}
    for cfg in models.values():  # each parses back through Triton's schema
        assert parse_config_text(text_format.MessageToString(cfg)) == cfg
    pre, ens, core = models["preprocessing"], models["ensemble"], models["tensorrt_llm"]
    assert [(t.name, t.data_type, list(t.dims), t.optional) for t in pre.input if "BIAS" in t.name] == [
        ("EMBEDDING_BIAS_WORDS", mc.TYPE_STRING, [-1], True), ("EMBEDDING_BIAS_WEIGHTS", mc.TYPE_FP32, [-1], True)]
    assert [(t.name, t.data_type, list(t.dims)) for t in pre.output if "BIAS" in t.name] == [
        ("EMBEDDING_BIAS", mc.TYPE_FP32, [-1])]
    ins = {t.name: (t.data_type, list(t.dims), t.optional) for t in ens.input}
    assert {k: ins[k] for k in ("num_return_sequences", "embedding_bias_words", "embedding_bias_weights",
                                "return_context_logits", "return_log_probs", "beam_width", "bad_words")} == {
        "num_return_sequences": (mc.TYPE_INT32, [1], True), "embedding_bias_words": (mc.TYPE_STRING, [-1], True),
        "embedding_bias_weights": (mc.TYPE_FP32, [-1], True), "return_context_logits": (mc.TYPE_BOOL, [1], True),
        "return_log_probs": (mc.TYPE_BOOL, [1], True), "beam_width": (mc.TYPE_INT32, [1], True),
        "bad_words": (mc.TYPE_STRING, [-1], True)}
    assert "return_generation_logits" not in ins  # the fixture gathers context logits only
    outs = {t.name: (t.data_type, list(t.dims)) for t in ens.output}
    assert {k: outs[k] for k in ("cum_log_probs", "output_log_probs", "sequence_index", "batch_index",
                                 "context_logits")} == {
        "cum_log_probs": (mc.TYPE_FP32, [-1]), "output_log_probs": (mc.TYPE_FP32, [-1, -1]),
        "sequence_index": (mc.TYPE_INT32, [1]), "batch_index": (mc.TYPE_INT32, [1]),
        "context_logits": (mc.TYPE_FP32, [-1, -1])}
    steps = {s.model_name: s for s in ens.ensemble_scheduling.step}
    assert steps["preprocessing"].output_map["EMBEDDING_BIAS"] == steps["tensorrt_llm"].input_map["embedding_bias"]
    core_map = steps["tensorrt_llm"]
    assert (core_map.input_map["num_return_sequences"], core_map.input_map["return_context_logits"],
            core_map.input_map["bad_words_list"], core_map.input_map["len_penalty"]) == (
        "num_return_sequences", "return_context_logits", "_BAD_WORDS_IDS", "length_penalty")
    assert set(core_map.input_map) <= {t.name for t in core.input}
    assert set(core_map.output_map) <= {t.name for t in core.output}
    ensemble_out = {t.name for t in ens.output}
    assert {v for s in steps.values() for v in s.output_map.values() if not v.startswith("_")} == ensemble_out
    # As the 1.2 ensemble template maps them: the bias words into preprocessing, the log probabilities,
    # indices and logits straight from the core; postprocessing also reads sequence_index (ours keys its
    # detokenizers by it), which Triton allows of a tensor that is an ensemble output too.
    assert {k: steps["preprocessing"].input_map[k] for k in ("EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS")} == {
        "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights"}
    assert {k: core_map.output_map[k] for k in CORE_OUTPUT_TENSORS} == {k: k for k in CORE_OUTPUT_TENSORS}
    assert core_map.output_map["context_logits"] == "context_logits"
    post, post_map = models["postprocessing"], steps["postprocessing"]
    assert post_map.input_map["SEQUENCE_INDEX"] == "sequence_index"
    assert [(t.name, t.data_type, list(t.dims), t.optional) for t in post.input if t.name == "SEQUENCE_INDEX"] == [
        ("SEQUENCE_INDEX", mc.TYPE_INT32, [1], True)]
    assert set(post_map.input_map) <= {t.name for t in post.input}
    assert set(steps["preprocessing"].input_map) <= {t.name for t in pre.input}
    produced = {t.name for t in ens.input} | {v for s in steps.values() for v in s.output_map.values()}
    assert {v for s in steps.values() for v in s.input_map.values()} <= produced


def test_default_engine_repository_carries_the_1_2_request_tensors(good_repo: Path) -> None:
    """The repository serve writes for a default build (no logits gathered): sequences, bias words and
    log probabilities in the ensemble, preprocessing answering EMBEDDING_BIAS to the core."""
    ens = _parse(good_repo / "ensemble" / "config.pbtxt")
    assert {"num_return_sequences", "embedding_bias_words", "embedding_bias_weights", "return_log_probs"} <= {
        t.name for t in ens.input}
    assert not {"return_context_logits", "return_generation_logits"} & {t.name for t in ens.input}
    assert set(CORE_OUTPUT_TENSORS) <= {t.name for t in ens.output}
    steps = {s.model_name: s for s in ens.ensemble_scheduling.step}
    assert steps["preprocessing"].output_map["EMBEDDING_BIAS"] == "_EMBEDDING_BIAS"
    assert steps["tensorrt_llm"].input_map["embedding_bias"] == "_EMBEDDING_BIAS"
    pre = _parse(good_repo / "preprocessing" / "config.pbtxt")
    assert "EMBEDDING_BIAS" in {t.name for t in pre.output}
