"""The trtllm repository against the real (CPU, bundled) tritonserver: Triton's own model-config
validator accepts the tensorrtllm `tensorrt_llm` config (it then stops only because the tensorrtllm
backend library is absent here), and the ensemble's wiring to that model's exact input/output
signature loads once the core's backend is swapped for a python stub."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main

pytestmark = pytest.mark.server
STUB = "class TritonPythonModel:\n    def execute(self, requests):\n        return None\n"


def _triton(repo: Path, run: Path, port: int, wait_ready: bool) -> tuple[subprocess.Popen, Path]:
    from trtprompt.serve.launcher import TritonInstall, child_env, make_backend_dir

    install = TritonInstall.find()
    cmd = [str(install.binary), f"--model-repository={repo}", "--http-address=127.0.0.1", f"--http-port={port}",
           "--allow-grpc=false", "--allow-metrics=false", "--exit-timeout-secs=5"]
    if install.bundled:
        cmd += [f"--backend-directory={make_backend_dir(run)}", "--disable-auto-complete-config",
                "--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]
    log = run / "triton.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(install, ""))
    if wait_ready:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
    return proc, log


@pytest.fixture(scope="module")
def trtllm_repo(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trtllm-triton")
    engine = make_engine_dir("good", root / "engine", tiny_checkpoint_factory("llama"))
    result = CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(root / "repo")])
    assert result.exit_code == 0, result.output
    return root / "repo"


def test_triton_validator_accepts_the_core_config(trtllm_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "tensorrt_llm" / "1").mkdir(parents=True)
    (repo / "tensorrt_llm" / "config.pbtxt").write_text((trtllm_repo / "tensorrt_llm" / "config.pbtxt").read_text())
    proc, log = _triton(repo, tmp_path, 18630, wait_ready=False)
    assert proc.wait(60) != 0
    text = log.read_text()
    # Validation (dims/reshape/types/batching) passed; loading stopped at the missing C++ backend.
    assert "Poll failed" not in text
    assert "unable to find backend library for backend 'tensorrtllm'" in text


def test_ensemble_loads_against_the_core_signature(trtllm_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["cp", "-r", str(trtllm_repo), str(repo)], check=True)
    core = repo / "tensorrt_llm" / "config.pbtxt"
    text = core.read_text()
    assert text.count('backend: "tensorrtllm"') == 1
    core.write_text(text.replace('backend: "tensorrtllm"', 'backend: "python"'))
    (repo / "tensorrt_llm" / "1" / "model.py").write_text(STUB)
    proc, log = _triton(repo, tmp_path, 18640, wait_ready=True)
    try:
        with urllib.request.urlopen("http://127.0.0.1:18640/v2/models/ensemble/ready", timeout=2) as r:
            assert r.status == 200
    except OSError as exc:
        pytest.fail(f"ensemble not ready ({exc}); log tail:\n{log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(30)
