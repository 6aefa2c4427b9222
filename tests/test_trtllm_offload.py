"""Contract: host / disk offload and per-request retention on the TensorRT-LLM targets (issue 24, items 6 and 8).

TensorRT-LLM cannot be installed here (its PyPI package is a stub), so these tests check what trtprompt
writes against the names read from TensorRT-LLM's source and versioned API reference, recorded with file
and release in tests/fixtures/trtllm_names.json: the tensorrt_llm model's config.pbtxt for a 1.2 engine,
and model.yaml's kv_cache_config for each LLM API release. Nothing is mocked: repositories are written by
`trtprompt serve --repo-only` (the real CLI, options and writers) and parsed with Triton's ModelConfig schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from tritonclient.grpc import model_config_pb2 as mc
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main
from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.error_codes import BadRequestError
from trtprompt.interface import RETENTION_INPUTS
from trtprompt.serve.launch.llmapi_repository import serve_model_yaml
from trtprompt.serve.launch.options import ServeOptions, resolve_options
from trtprompt.serve.launch.trtllm_model_config import parse_config_text
from trtprompt.serve.triton_models.llmapi_edge import edge_request
from trtprompt.targets.kv_offload import target_problem

RELEASES = json.loads((Path(__file__).parent / "fixtures" / "trtllm_names.json").read_text())["releases"]
ENGINE_1_2 = RELEASES["1.2.1"]
GIB = 1 << 30
# kv_cache_config fields every LLM API release has, and the llmapi build writes (not offload fields).
BASE_KV_FIELDS = {"enable_block_reuse", "free_gpu_memory_fraction", "max_tokens", "tokens_per_block"}


def _repo_only(engine: Path, repo: Path, *extra: str) -> Any:
    return CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *extra])


@pytest.fixture(scope="module")
def trtllm_engine(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_engine_dir("good", tmp_path_factory.mktemp("offload") / "engine", tiny_checkpoint_factory("llama"))


def _core(repo: Path) -> mc.ModelConfig:
    return parse_config_text((repo / "tensorrt_llm" / "config.pbtxt").read_text(encoding="utf-8"))


def test_trtllm_config_pbtxt_carries_the_host_tier(trtllm_engine: Path, tmp_path: Path) -> None:
    result = _repo_only(trtllm_engine, tmp_path / "on", "--kv-cache-host-memory-bytes", str(4 * GIB),
                        "--no-kv-cache-onboard-blocks")
    assert result.exit_code == 0, result.output
    params = {k: v.string_value for k, v in _core(tmp_path / "on").parameters.items()}
    assert (params["kv_cache_host_memory_bytes"], params["kv_cache_onboard_blocks"]) == (str(4 * GIB), "false")
    defaults = _repo_only(trtllm_engine, tmp_path / "off")
    assert defaults.exit_code == 0, defaults.output
    params = {k: v.string_value for k, v in _core(tmp_path / "off").parameters.items()}
    assert (params["kv_cache_host_memory_bytes"], params["kv_cache_onboard_blocks"]) == ("0", "true")
    # Both are parameters of 1.2's template and read by its C++ backend; no priority parameter is written.
    read = set(ENGINE_1_2["backend_parameters"]["names"]) & set(ENGINE_1_2["config_pbtxt_parameters"]["names"])
    assert {"kv_cache_host_memory_bytes", "kv_cache_onboard_blocks"} <= read
    assert not set(params) & set(ENGINE_1_2["backend_parameters"]["absent"])


@pytest.mark.parametrize(("flags", "words"), [
    (["--disk-cache-path", "/tmp/x"], "disk KV tier, which TensorRT-LLM 1.2"),
    (["--kv-cache-host-memory-bytes", "1073741824", "--secondary-offload-min-priority", "50"],
     "secondary_offload_min_priority is not read by TensorRT-LLM 1.2"),
    (["--cold-tier-offload-min-priority", "50"], "cold_tier_offload_min_priority set a disk KV tier"),
    (["--no-kv-cache-onboard-blocks"], "kv_cache_onboard_blocks applies to the host tier"),
])
def test_trtllm_refuses_what_1_2_lacks(trtllm_engine: Path, tmp_path: Path, flags: list[str], words: str) -> None:
    result = _repo_only(trtllm_engine, tmp_path / "repo", *flags)
    assert result.exit_code != 0 and words in result.output, result.output
    assert not (tmp_path / "repo").exists()


def test_trtllm_core_declares_the_retention_inputs_as_the_backend_does(trtllm_engine: Path, tmp_path: Path) -> None:
    assert _repo_only(trtllm_engine, tmp_path / "repo").exit_code == 0
    declared = {t.name: t for t in _core(tmp_path / "repo").input}
    assert [name for name, *_ in RETENTION_INPUTS] == ENGINE_1_2["tensorrt_llm_retention_inputs"]["names"]
    for name, _, dims, _ in RETENTION_INPUTS:
        t = declared[name]
        assert (t.data_type, list(t.dims), t.optional, t.allow_ragged_batch) == (mc.TYPE_INT32, list(dims), True, True)
        assert not t.HasField("reshape")
    ends = ("retention_token_range_starts", "retention_decode_priority")
    assert [list(declared[n].dims) for n in ends] == [[-1], [1]]


def test_trtllm_ensemble_forwards_the_retention_inputs_to_the_core(trtllm_engine: Path, tmp_path: Path) -> None:
    """The client interface takes them, and the ensemble's core step hands each on under its own name (the
    ensemble loading against the core's signature in a real tritonserver: test_trtllm_triton_validation.py)."""
    assert _repo_only(trtllm_engine, tmp_path / "repo").exit_code == 0
    ensemble = parse_config_text((tmp_path / "repo" / "ensemble" / "config.pbtxt").read_text(encoding="utf-8"))
    declared = {t.name: (t.data_type, list(t.dims), t.optional) for t in ensemble.input}
    core_step = next(s for s in ensemble.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    for name, _, dims, _ in RETENTION_INPUTS:
        assert declared[name] == (mc.TYPE_INT32, list(dims), True)
        assert core_step.input_map[name] == name
    pre_step = next(s for s in ensemble.ensemble_scheduling.step if s.model_name == "preprocessing")
    assert not {name for name, *_ in RETENTION_INPUTS} & set(pre_step.input_map.values())


def _llmapi_opts(engine: Path, **overrides: Any) -> ServeOptions:
    return resolve_options(read_engine_dir(engine, None, verify_weights=False), overrides)


def _offload_fields(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in args["kv_cache_config"].items() if k not in BASE_KV_FIELDS}


def _documented(release: str) -> set[str]:
    if release == "1.4.0rc4":
        return {k.split(".", 1)[1] for k in RELEASES[release]["llm_args"] if k.startswith("kv_cache_config.")}
    return set(RELEASES[release]["kv_cache_config_fields"]["names"])


@pytest.mark.parametrize(("release", "policy", "extra"), [
    ("1.4.0rc4", "write_through", {"cold_tier_offload_min_priority": 80}),
    ("1.3.0rc27", "write_back", {}),
])
def test_llmapi_model_yaml_fields_exist_in_the_release(llmapi_engine: Path, tmp_path: Path, release: str,
                                                       policy: str, extra: dict[str, Any]) -> None:
    opts = _llmapi_opts(llmapi_engine, kv_cache_host_memory_bytes=2 * GIB, secondary_offload_min_priority=60,
                        disk_cache_path=str(tmp_path / "disk"), disk_cache_size=8 * GIB, kv_tier_write_policy=policy,
                        **extra)
    fields = _offload_fields(serve_model_yaml(read_engine_dir(llmapi_engine, None, verify_weights=False), opts,
                                              release))
    assert set(fields) <= _documented(release), sorted(set(fields) - _documented(release))
    assert fields["host_cache_size"] == 2 * GIB and fields["secondary_offload_min_priority"] == 60
    assert (fields["disk_cache_path"], fields["disk_cache_size"]) == (str(tmp_path / "disk"), 8 * GIB)
    assert fields["use_kv_cache_manager_v2"] is True  # TensorRT-LLM's disk tier is KV cache manager v2's
    if release == "1.4.0rc4":
        assert (fields["disk_write_through"], fields["cold_tier_offload_min_priority"]) == (True, 80)
    else:
        assert not set(fields) & set(RELEASES[release]["kv_cache_config_fields_absent"]["names"])


@pytest.mark.parametrize(("release", "overrides", "words"), [
    ("1.3.0rc27", {"kv_tier_write_policy": "write_through"},
     "kv_tier_write_policy = write_through needs KvCacheConfig.disk_write_through, which TensorRT-LLM 1.3.0rc27"),
    ("1.3.0rc27", {"kv_tier_write_policy": "write_back", "cold_tier_offload_min_priority": 80},
     "cold_tier_offload_min_priority needs KvCacheConfig.cold_tier_offload_min_priority, which TensorRT-LLM "
     "1.3.0rc27"),
    ("1.3.0rc20", {"kv_tier_write_policy": "write_back"},
     "disk_cache_path needs KvCacheConfig.disk_cache_path, which TensorRT-LLM 1.3.0rc20"),
])
def test_llmapi_refuses_a_field_the_release_lacks(llmapi_engine: Path, tmp_path: Path, release: str,
                                                  overrides: dict[str, Any], words: str) -> None:
    opts = _llmapi_opts(llmapi_engine, disk_cache_path=str(tmp_path / "disk"), **overrides)
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        serve_model_yaml(read_engine_dir(llmapi_engine, None, verify_weights=False), opts, release)
    if release == "1.3.0rc27":  # refused exactly where the 1.3.0rc27 reference lacks the field
        absent = RELEASES[release]["kv_cache_config_fields_absent"]["names"]
        assert any(f"KvCacheConfig.{field}" in words for field in absent)


def test_llmapi_refuses_onboard_off_and_a_selective_disk_policy(llmapi_engine: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KvCacheConfig has no onboard_blocks field"):
        _llmapi_opts(llmapi_engine, kv_cache_host_memory_bytes=GIB, kv_cache_onboard_blocks=False)
    assert "onboard_blocks" in RELEASES["1.3.0rc27"]["kv_cache_config_fields_absent"]["names"]
    with pytest.raises(ValueError, match="selective has no TensorRT-LLM equivalent"):
        _llmapi_opts(llmapi_engine, disk_cache_path=str(tmp_path), kv_tier_write_policy="selective")


def test_llmapi_repo_only_writes_the_tiers(llmapi_engine: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv-disk"
    result = _repo_only(llmapi_engine, tmp_path / "repo", "--kv-cache-host-memory-bytes", str(GIB),
                        "--secondary-offload-min-priority", "40", "--disk-cache-path", str(disk))
    assert result.exit_code == 0, result.output
    assert "model.yaml for TensorRT-LLM 1.4.0rc4 (not installed here" in result.output
    args = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert _offload_fields(args) == {"host_cache_size": GIB, "secondary_offload_min_priority": 40,
                                     "disk_cache_path": str(disk), "disk_cache_size": 4 * GIB,
                                     "use_kv_cache_manager_v2": True, "disk_write_through": True}
    assert disk.is_dir()  # TensorRT-LLM's validator requires an existing directory
    ensemble = parse_config_text((tmp_path / "repo" / "ensemble" / "config.pbtxt").read_text())
    declared = {t.name: (t.data_type, list(t.dims)) for t in ensemble.input}
    for name, _, dims, _ in RETENTION_INPUTS:  # declared, so the edge can refuse them by name
        assert declared[name] == (mc.TYPE_INT32, list(dims))


def test_llmapi_edge_refuses_retention_inputs() -> None:
    def prepare(*_: Any) -> Any:
        raise AssertionError("the edge must refuse before preparing the prompt")

    tensors = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32),
               "retention_token_range_starts": np.array([[0]], dtype=np.int32)}
    with pytest.raises(BadRequestError, match="'retention_token_range_starts' cannot be honoured") as err:
        edge_request(tensors, prepare, str)
    assert err.value.field == "retention_token_range_starts"
    assert "passes no KvCacheRetentionConfig" in str(err.value)


def test_torch_target_refuses_a_host_tier() -> None:
    problem = target_problem("torch", ServeOptions(kv_cache_host_memory_bytes=GIB))
    assert problem is not None and "already lives in host memory" in problem
    assert "torch target has no such tier" in str(target_problem("torch", ServeOptions(kv_cache_onboard_blocks=False)))
    assert target_problem("torch", ServeOptions()) is None


def test_serve_help_and_inspect_show_the_knobs(trtllm_engine: Path) -> None:
    shown = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    for flag in ("--kv-cache-host-memory-bytes", "--kv-cache-onboard-blocks / --no-kv-cache-onboard-blocks",
                 "--secondary-offload-min-priority", "--cold-tier-offload-min-priority"):
        assert flag in shown
    inspected = CliRunner().invoke(main, ["inspect", str(trtllm_engine), "--json"])
    assert inspected.exit_code == 0, inspected.output
    rows = json.loads(inspected.output)["kv_host_offload"]
    assert rows["kv_cache_host_memory_bytes"] == "0 -> tensorrt_llm parameter kv_cache_host_memory_bytes"
    assert rows["secondary_offload_min_priority"].startswith("None -> refused")
