"""Launch command lines for a TensorRT-LLM engine, and refusals before anything starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main
from trtprompt.serve.launch.trtllm_launch import TrtllmLaunchSpec, launch_command, rank_args

COMMON = ["--http-address=127.0.0.1", "--http-port=8000", "--grpc-address=127.0.0.1", "--grpc-port=8001",
          "--metrics-address=127.0.0.1", "--metrics-port=8002", "--allow-metrics=true",
          "--disable-auto-complete-config"]


def test_world_size_one_runs_tritonserver_directly() -> None:
    spec = TrtllmLaunchSpec(Path("/repo"), 1, "/opt/tritonserver/bin/tritonserver")
    assert launch_command(spec) == ["/opt/tritonserver/bin/tritonserver", "--model-repository=/repo", *COMMON,
                                    "--backend-config=python,shm-region-prefix-name=prefix0_"]


def test_two_ranks_under_mpirun_with_per_rank_args() -> None:
    spec = TrtllmLaunchSpec(Path("/repo"), 2)
    assert launch_command(spec) == [
        "mpirun", "--allow-run-as-root",
        "-n", "1", "tritonserver", "--model-repository=/repo", *COMMON,
        "--backend-config=python,shm-region-prefix-name=prefix0_",
        ":", "-n", "1", "tritonserver", "--model-repository=/repo",
        "--model-control-mode=explicit", "--load-model=tensorrt_llm", *COMMON,
        "--backend-config=python,shm-region-prefix-name=prefix1_"]


def test_four_ranks_count_and_verbose() -> None:
    cmd = launch_command(TrtllmLaunchSpec(Path("/r"), 4, log_verbose=1))
    assert cmd.count("tritonserver") == 4 and cmd.count(":") == 3
    assert cmd.count("--load-model=tensorrt_llm") == 3  # every rank but 0
    assert cmd.count("--log-verbose=1") == 4
    assert rank_args(TrtllmLaunchSpec(Path("/r"), 4), 3)[-1] == "--backend-config=python,shm-region-prefix-name=prefix3_"


def test_spec_bounds() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        TrtllmLaunchSpec(Path("/r"), 0)
    with pytest.raises(ValueError, match="must differ"):
        TrtllmLaunchSpec(Path("/r"), 1, http_port=8001)
    with pytest.raises(ValueError, match="rank must be in \\[0, 1\\], got 2"):
        rank_args(TrtllmLaunchSpec(Path("/r"), 2), 2)


def test_serve_without_the_container_names_it(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    monkeypatch.setenv("PATH", os.path.dirname(os.__file__))  # no tritonserver here
    result = CliRunner().invoke(main, ["serve", str(engine), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert "tritonserver is not on PATH" in result.output
    assert "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3" in result.output
    assert not (tmp_path / "run").exists()  # refused before writing anything
