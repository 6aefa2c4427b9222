"""Model repository, serve options, input parsing and the local protocol (no server needed,
except the launcher-failure test, which starts and loses a real engine process)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from serve_fixtures import ROOT, _alive

from trtprompt.cli import main
from trtprompt.engine.speculation.config import SPECULATION_KNOBS
from trtprompt.knobs import KNOBS
from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import RequestError
from trtprompt.serve.triton_models import inputs
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.launch.options import EngineInfo, resolve_options
from trtprompt.serve.wire.model_config import check_config_text, read_parameters
from trtprompt.serve.launch.repository import (ENSEMBLE_INPUTS, RepoContext,
                                        write_repository)


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtprompt.cli", "serve", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def _repo_only(engine: Path, repo: Path, *flags: str) -> Result:
    """`serve ENGINE --repo-only REPO` in this process: it writes the repository (or refuses) and returns,
    starting nothing a child process would have to hold."""
    return CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *flags])


def _configs(repo: Path) -> dict[str, object]:
    return {p.parent.name: check_config_text(p.read_text(encoding="utf-8")) for p in repo.glob("*/config.pbtxt")}


@pytest.fixture()
def engine_copy(tiny_engine_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_engine_dir, tmp_path / "engine"))


def _patch_build(engine: Path, **plugin: object) -> None:
    cfg = json.loads((engine / "config.json").read_text())
    cfg["build_config"]["plugin_config"].update(plugin)
    (engine / "config.json").write_text(json.dumps(cfg))


def test_fused_repository_parameters_and_interface(tiny_engine_dir: Path, tmp_path: Path) -> None:
    out = _repo_only(tiny_engine_dir, tmp_path / "repo", "--max-queue-size", "8", "--disable-kv-cache-reuse",
                     "--engine-threads", "3", "--compute-dtype", "float32")
    assert out.exit_code == 0, out.stderr
    configs = _configs(tmp_path / "repo")
    assert set(configs) == {"ensemble", "tensorrt_llm"}
    for name, cfg in configs.items():
        assert cfg.model_transaction_policy.decoupled, name
        assert cfg.backend == "python" and cfg.max_batch_size == 16
        assert (tmp_path / "repo" / name / "1" / "model.py").is_file()
        assert "${" not in (tmp_path / "repo" / name / "config.pbtxt").read_text()
    params = read_parameters(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    assert params == {
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": str(tiny_engine_dir.resolve()),
        "enable_kv_cache_reuse": "false", "enable_chunked_context": "true",
        "batch_scheduler_policy": "guaranteed_no_evict", "kv_cache_free_gpu_mem_fraction": "0.9",
        "max_tokens_in_paged_kv_cache": "32768", "max_queue_size": "8", "max_beam_width": "1",
        "exclude_input_in_output": "false", "cancellation_check_period_ms": "100",
        "stats_check_period_ms": "100", "engine_threads": "3", "kv_cache_eviction_policy": "s3fifo", "guided_jump_forward": "true",
        # the speculation knobs' defaults (trtprompt/knobs.py), as config.pbtxt writes them
        **{name: str(KNOBS[name].default).lower() for name in SPECULATION_KNOBS if name != "speculative_model"},
        "compute_dtype": "float32", "engine_socket": str(tmp_path / "repo" / "engine.sock"),
        "triton_max_batch_size": "16", "guided_decoding_backend": "llguidance",
        "max_loras": "8", "max_cpu_loras": "32",  # the LoRA knobs' defaults; no --lora-modules: no list
    }
    ens = configs["ensemble"]
    declared = {t.name: (t.data_type, list(t.dims), t.optional) for t in ens.input}  # type: ignore[attr-defined]
    assert declared["text_input"] == (13, [1], False)  # TYPE_STRING
    assert declared["max_tokens"] == (8, [1], False)  # TYPE_INT32
    for name in ("bad_words", "stop_words", "end_id", "pad_id", "top_k", "top_p", "temperature",
                 "length_penalty", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "min_tokens", "seed", "beam_width", "stream", "exclude_input_in_output",
                 "return_log_probs", "return_perf_metrics", "return_num_input_tokens",
                 "return_num_output_tokens"):
        assert declared[name][2], name
    outputs = {t.name for t in ens.output}  # type: ignore[attr-defined]
    assert outputs >= {"text_output", "cum_log_probs", "output_log_probs", "batch_index", "sequence_index",
                       "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                       "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                       "last_token_time_ns", "num_input_tokens", "num_output_tokens"}
    assert len(declared) == len(ENSEMBLE_INPUTS)


def test_upstream_repository_is_a_consistent_triton_ensemble(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = EngineInfo.read(tiny_engine_dir)
    ctx = RepoContext(engine, resolve_options(engine, {"layout": "upstream"}), "/tmp/x.sock")
    configs = _configs(write_repository(tmp_path / "repo", ctx))
    assert set(configs) == {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble"}
    ens = configs["ensemble"]
    assert ens.platform == "ensemble"  # type: ignore[attr-defined]
    steps = ens.ensemble_scheduling.step  # type: ignore[attr-defined]
    assert [s.model_name for s in steps] == ["preprocessing", "tensorrt_llm", "postprocessing"]
    assert configs["postprocessing"].instance_group[0].count == 1  # type: ignore[attr-defined]
    ens_inputs = {t.name for t in ens.input}  # type: ignore[attr-defined]
    ens_outputs = {t.name for t in ens.output}  # type: ignore[attr-defined]
    produced: set[str] = set()
    for step in steps:
        model = configs[step.model_name]
        model_inputs = {t.name for t in model.input}  # type: ignore[attr-defined]
        model_outputs = {t.name for t in model.output}  # type: ignore[attr-defined]
        assert set(step.input_map) <= model_inputs and set(step.output_map) <= model_outputs
        assert set(step.input_map.values()) <= ens_inputs | produced, step.model_name
        produced |= set(step.output_map.values())
    consumed = {v for s in steps for v in s.input_map.values()}
    assert produced - consumed - ens_outputs == set()  # Triton refuses unused ensemble tensors
    assert ens_outputs <= produced
    # After the decoupled core, a step may only take the core's tensors (Triton's rule).
    core_out = set(steps[1].output_map.values())
    assert set(steps[2].input_map.values()) <= core_out
    # The fused ensemble's client interface (issue 13): prompt inputs, counts, salt to the core.
    assert {"messages", "overflow", "cache_salt", "return_num_input_tokens", "return_num_output_tokens"} <= ens_inputs
    assert {"prompt_truncated_tokens", "dropped_turns", "num_input_tokens", "num_output_tokens"} <= ens_outputs
    assert steps[1].input_map["cache_salt"] == "cache_salt"
    assert configs["preprocessing"].parameters["salt_reaches_core"].string_value == "true"  # type: ignore[attr-defined]
    # The engine process publishes the request metrics here: postprocessing does not (no double count),
    # and the client's return_perf_metrics still decides (the trtllm target's ensemble forces it).
    assert steps[1].input_map["return_perf_metrics"] == "return_perf_metrics"
    assert set(steps[2].input_map) == {"TOKENS_BATCH", "SEQUENCE_LENGTH"}
    for name in ("preprocessing", "postprocessing"):
        params = configs[name].parameters  # type: ignore[attr-defined]
        assert not {"force_perf_metrics", "publish_request_metrics"} & set(params), name
    assert "RETURN_PERF_METRICS" not in {t.name for t in configs["preprocessing"].output}  # type: ignore[attr-defined]


def test_refuses_flags_the_engine_was_not_built_for(engine_copy: Path, tmp_path: Path) -> None:
    _patch_build(engine_copy, use_paged_context_fmha=False)
    out = _repo_only(engine_copy, tmp_path / "repo")
    assert out.exit_code != 0
    assert "enable_chunked_context needs an engine built with plugin_config.use_paged_context_fmha" in out.stderr
    assert "--disable-chunked-context" in out.stderr
    out = _repo_only(engine_copy, tmp_path / "repo", "--disable-chunked-context")
    assert "enable_kv_cache_reuse needs an engine built with plugin_config.use_paged_context_fmha" in out.stderr
    out = _repo_only(engine_copy, tmp_path / "repo", "--disable-chunked-context", "--disable-kv-cache-reuse")
    assert out.exit_code == 0, out.stderr
    out = _repo_only(engine_copy, tmp_path / "repo2", "--max-batch-size", "17", "--disable-chunked-context",
                     "--disable-kv-cache-reuse")
    assert out.exit_code != 0 and "max_batch_size=17 exceeds the engine's build-time max_batch_size (16)" in out.stderr


def test_engine_threads_must_be_positive(tiny_engine_dir: Path, tmp_path: Path) -> None:
    out = _repo_only(tiny_engine_dir, tmp_path / "repo", "--engine-threads", "0")
    assert out.exit_code != 0 and "engine_threads must be an integer in [1, 4096] (or unset), got 0" in out.stderr


def test_compute_dtype_is_float32_or_the_engines_own(tiny_engine_dir: Path, tmp_path: Path) -> None:
    out = _repo_only(tiny_engine_dir, tmp_path / "repo", "--compute-dtype", "bfloat16")
    assert out.exit_code != 0
    assert "compute_dtype must be float32 or the engine's own dtype (float32), got 'bfloat16'" in out.stderr


def test_refuses_a_directory_that_is_not_an_engine(tmp_path: Path) -> None:
    out = _repo_only(tmp_path, tmp_path / "repo")
    assert out.exit_code != 0 and "is not an engine directory: config.json is missing" in out.stderr


def test_engine_that_cannot_start_prints_its_log_and_exits_nonzero(engine_copy: Path, tmp_path: Path) -> None:
    (engine_copy / "rank0.safetensors").write_bytes(b"not safetensors")
    ports = []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(str(s.getsockname()[1]))
        s.close()
    out = _serve(str(engine_copy), "--run-dir", str(tmp_path / "run"), "--grpc-port", ports[0],
                 "--http-port", ports[1], "--metrics-port", ports[2])
    assert out.returncode == 1
    assert "the engine process exited with code" in out.stderr
    assert "engine.log" in out.stderr and "Traceback" in out.stderr


def test_check_config_text_rejects_placeholders_and_bad_fields() -> None:
    with pytest.raises(ValueError, match="placeholder"):
        check_config_text('name: "x"\nmax_batch_size: ${triton_max_batch_size}\n')
    with pytest.raises(Exception, match="no_such_field"):
        check_config_text('name: "x"\nno_such_field: 1\n')


def test_words_list_and_token_item_parsing() -> None:
    words = np.array([[5, 6, 7, 0], [2, 3, -1, -1]], dtype=np.int32)
    assert inputs.words_list(words, "stop_words_list") == [[5, 6], [7]]
    with pytest.raises(RequestError, match=r"shape \[2, L\]"):
        inputs.words_list(np.zeros((3, 2), dtype=np.int32), "stop_words_list")
    tensors = {"input_ids": np.array([[4, 5, 6, 0]], dtype=np.int32),
               "input_lengths": np.array([[3]], dtype=np.int32),
               "request_output_len": np.array([[7]], dtype=np.int32),
               "runtime_top_k": np.array([[2]], dtype=np.int32),
               "stop_words_list": words[None], "streaming": np.array([[True]])}
    item = inputs.parse_token_item(tensors, 0, exclude_default=False)
    assert item.prompt_token_ids == (4, 5, 6) and item.stream
    assert item.sampling == SamplingParams(max_tokens=7, top_k=2, stop_token_ids=((5, 6), (7,)))
    with pytest.raises(RequestError, match="one value per request"):
        inputs.scalar({"x": np.array([[1, 2]])}, "x", 0, int)


def test_frame_reader_handles_split_and_coalesced_frames() -> None:
    a, b = socket.socketpair()
    data = P.encode_frame({"n": 1}) + P.encode_frame({"n": 2, "text": "é🚀"})
    reader = P.FrameReader()
    a.sendall(data[:3])
    assert reader.feed(b) == []
    a.sendall(data[3:])
    assert reader.feed(b) == [{"n": 1}, {"n": 2, "text": "é🚀"}]
    a.close()
    assert reader.feed(b) == [] and reader.closed
    with pytest.raises(P.EngineUnavailableError, match="not running or is restarting"):
        P.connect(str(Path("/nonexistent") / "engine.sock"))
    assert not _alive(2 ** 22 + 12345)
