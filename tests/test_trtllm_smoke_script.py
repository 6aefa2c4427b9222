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
