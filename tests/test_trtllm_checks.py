"""Post-build and serve-time checks of TensorRT-LLM engines, driven by the hand-written fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trtllm_fixtures import make_engine_dir
from trtprompt.errors import EngineDirError, TargetUnavailableError
from trtprompt.targets.trtllm_checks import (
    BACKEND_LIBRARY,
    CONTAINER,
    TrtllmEngineConfig,
    check_built_engine,
    check_runtime_flags,
    check_version,
    find_tritonserver,
    preflight,
)

BOTH = {"enable_chunked_context": True, "enable_kv_cache_reuse": True}


@pytest.fixture()
def backend_dir(tmp_path: Path) -> Path:
    d = tmp_path / "backends" / "tensorrtllm"
    d.mkdir(parents=True)
    (d / BACKEND_LIBRARY).write_bytes(b"")
    return d


def _which(name: str) -> str | None:
    return "/opt/tritonserver/bin/tritonserver" if name == "tritonserver" else None


def _preflight(engine: Path, flags: dict[str, Any], backend_dir: Path, **kw: Any) -> Any:
    kw.setdefault("installed_version", lambda: "1.2.1")
    return preflight(engine, flags, which=_which, backend_dir=backend_dir, **kw)


def test_good_engine_passes_every_check(tmp_path: Path, backend_dir: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e")
    assert check_built_engine(engine, BOTH).version == "1.2.1"
    result = _preflight(engine, BOTH | {"max_batch_size": 64, "max_tokens_in_paged_kv_cache": 4096}, backend_dir)
    assert (result.tp_size, result.pp_size, result.world_size) == (1, 1, 1)
    assert str(result.tritonserver) == "/opt/tritonserver/bin/tritonserver"


@pytest.mark.parametrize("flag", ["enable_chunked_context", "enable_kv_cache_reuse"])
def test_paged_context_fmha_off_refused_with_reason(tmp_path: Path, flag: str) -> None:
    engine = make_engine_dir("no_paged_context_fmha", tmp_path / "e")
    with pytest.raises(EngineDirError, match=f"{flag} needs plugin_config.use_paged_context_fmha, which the "
                                             "engine has off \\(the KV cache is INT8\\)"):
        check_built_engine(engine, {flag: True})
    check_built_engine(engine, {"enable_chunked_context": False, "enable_kv_cache_reuse": False})


def test_fp8_kv_without_fp8_weights_is_named(tmp_path: Path) -> None:
    engine = make_engine_dir("no_paged_context_fmha", tmp_path / "e")
    cfg = json.loads((engine / "config.json").read_text())
    cfg["pretrained_config"]["quantization"]["kv_cache_quant_algo"] = "FP8"
    (engine / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineDirError, match="the KV cache is FP8 without FP8 weights"):
        check_built_engine(engine, BOTH)


def test_gather_context_logits_refused_with_reuse_only(tmp_path: Path) -> None:
    engine = make_engine_dir("gather_context_logits", tmp_path / "e")
    with pytest.raises(EngineDirError, match="enable_kv_cache_reuse cannot work with gather_context_logits on"):
        check_built_engine(engine, BOTH)
    check_built_engine(engine, {"enable_chunked_context": True, "enable_kv_cache_reuse": False})


def test_tp2_world_size_and_rank_files(tmp_path: Path, backend_dir: Path) -> None:
    engine = make_engine_dir("tp2", tmp_path / "e")
    assert _preflight(engine, BOTH, backend_dir).world_size == 2
    assert _preflight(engine, BOTH, backend_dir, world_size=2).tp_size == 2
    with pytest.raises(EngineDirError, match="world size 1 does not match the engine: it was built for "
                                             "tp_size 2 x pp_size 1 = 2 ranks"):
        _preflight(engine, BOTH, backend_dir, world_size=1)
    (engine / "rank1.engine").unlink()
    with pytest.raises(EngineDirError, match="incomplete for world size 2: missing rank1.engine"):
        _preflight(engine, BOTH, backend_dir)


def test_inconsistent_mapping_refused(tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e")
    cfg = json.loads((engine / "config.json").read_text())
    cfg["pretrained_config"]["mapping"]["world_size"] = 4
    (engine / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineDirError, match="mapping.world_size 4 != tp_size 1 x pp_size 1"):
        TrtllmEngineConfig.read(engine).parallelism()


def test_version_mismatch_and_missing(tmp_path: Path, backend_dir: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e")
    with pytest.raises(EngineDirError, match="built by TensorRT-LLM 1.2.1, but 1.3.0 is installed"):
        _preflight(engine, BOTH, backend_dir, installed_version=lambda: "1.3.0")
    check_version(TrtllmEngineConfig.read(engine), "1.2.1+cu130")
    with pytest.raises(EngineDirError, match="built by TensorRT-LLM 1.2.1, but 1.2.1rc1 is installed"):
        check_version(TrtllmEngineConfig.read(engine), "1.2.1rc1")
    with pytest.raises(TargetUnavailableError, match=f"Serve it inside the {CONTAINER} container"):
        check_version(TrtllmEngineConfig.read(engine), None)


def test_runtime_flags_engine_cannot_honour(tmp_path: Path) -> None:
    engine = TrtllmEngineConfig.read(make_engine_dir("good", tmp_path / "e"))
    with pytest.raises(EngineDirError, match="max_batch_size=65 exceeds the engine's build-time max_batch_size "
                                             "\\(64\\)"):
        check_runtime_flags(engine, {"max_batch_size": 65})
    with pytest.raises(EngineDirError, match="max_beam_width=2 exceeds"):
        check_runtime_flags(engine, {"max_beam_width": 2})
    # 4096-token sequences need 128 blocks of 32; 4064 tokens hold 127.
    with pytest.raises(EngineDirError, match="holds 127 blocks of 32 tokens, fewer than one max_seq_len 4096 "
                                             "sequence needs \\(128\\)"):
        check_runtime_flags(engine, {"max_tokens_in_paged_kv_cache": 4064})
    with pytest.raises(EngineDirError, match="max_num_tokens=4096: the tensorrtllm backend cannot change "
                                             "max_num_tokens at runtime; the engine was built with 8192"):
        check_runtime_flags(engine, {"max_num_tokens": 4096})
    check_runtime_flags(engine, {"max_tokens_in_paged_kv_cache": 4096, "max_num_tokens": 8192})


def test_missing_server_or_backend_names_container(tmp_path: Path, backend_dir: Path) -> None:
    with pytest.raises(TargetUnavailableError, match=f"tritonserver is not on PATH.*{CONTAINER}"):
        find_tritonserver(lambda name: None, backend_dir)
    with pytest.raises(TargetUnavailableError, match=f"tensorrtllm backend .* is missing.*{CONTAINER}"):
        find_tritonserver(_which, tmp_path / "nowhere")
    assert find_tritonserver(_which, backend_dir) == Path("/opt/tritonserver/bin/tritonserver")
