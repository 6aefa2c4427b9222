"""scripts/gpu_smoke.sh: valid bash, shellcheck-clean where shellcheck exists, and a clear FAIL summary
where there is no GPU (the full run needs the tritonserver trtllm container on a GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_smoke.sh"


def test_bash_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_without_gpu_fails_with_summary(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WORK_DIR": str(tmp_path / "w")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    result = subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parent.parent, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert "nvidia-smi                   FAIL not found" in result.stdout
    assert result.stdout.rstrip().endswith("RESULT: FAIL (logs: {0}/serve.log, {0}/run)".format(tmp_path / "w"))


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WORK_DIR": str(tmp_path / "w"), **env}
    base["PATH"] = os.pathsep.join(p for p in base["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parent.parent, env=base, capture_output=True, text=True,
                          timeout=60)


def test_llmapi_path_without_gpu_fails_with_summary(tmp_path: Path) -> None:
    result = _run(tmp_path, TRTLLM_API="llmapi")
    assert result.returncode == 1
    assert "nvidia-smi                   FAIL not found" in result.stdout


def test_unknown_api_is_refused_before_anything(tmp_path: Path) -> None:
    result = _run(tmp_path, TRTLLM_API="tensorrt")
    assert result.returncode == 1
    assert "settings                     FAIL TRTLLM_API must be auto, engine or llmapi, got 'tensorrt'" in result.stdout
    assert "nvidia-smi" not in result.stdout


def test_both_paths_build_serve_and_check_reuse_and_chunking() -> None:
    """What the script runs on a GPU (it cannot run here): the API choice reaches the build, the llmapi
    build's model.yaml is checked, and the shared prompts exceed max_num_tokens (chunked prefill)."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert '--trtllm-api "$TRTLLM_API"' in text and '--max-num-tokens "$MAX_NUM_TOKENS"' in text
    assert "kv_cache_config.enable_block_reuse: true" in text and "enable_chunked_prefill: true" in text
    assert 'record "chunked prefill" "PASS"' in text and 'record "kv_cache_reused_blocks" "PASS"' in text
    assert "26.05-trtllm-python-py3" in text and "TensorRT-LLM >= 1.3" in text
