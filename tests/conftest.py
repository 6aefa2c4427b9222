"""Session-wide fixtures shared by every test module: tiny checkpoints and engines made offline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from trtprompt.checkpoint_maker import DemoSpec, make_demo_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """callable(arch='llama', seed=0, **DemoSpec fields) -> checkpoint dir, made once per arguments.

    Treat the returned directory as read-only: other tests share it.
    """
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[DemoSpec, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **kwargs: object) -> Path:
        spec = DemoSpec(arch=arch, seed=seed, **kwargs)  # type: ignore[arg-type]
        if spec not in made:
            name = "-".join(f"{k}={v}" for k, v in sorted(vars(spec).items()))
            made[spec] = make_demo_checkpoint(root / name, spec)
        return made[spec]

    return make


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_checkpoint_factory: Callable[..., Path],
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch-target engine built from the llama tiny checkpoint with profile cpu-dev. Read-only."""
    from trtprompt.build import BuildRequest, run_build

    out = tmp_path_factory.mktemp("engines") / "tiny-llama"
    path = run_build(BuildRequest(tiny_checkpoint_factory("llama"), out, "cpu-dev", progress=False))
    assert path is not None
    return path


@pytest.fixture(scope="session")
def llmapi_engine(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trtllm-target engine directory in the LLM API layout (`--trtllm-api llmapi`, TensorRT-LLM 1.3+), as
    this machine builds it without TensorRT-LLM. Shared by the llmapi repository and offload tests. Read-only."""
    from click.testing import CliRunner

    from trtprompt.cli import main

    out = tmp_path_factory.mktemp("llmapi") / "engine"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(out), "--target",
                                       "trtllm", "--trtllm-api", "llmapi", "--max-seq-len", "2048", "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def wide_checkpoint(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama checkpoint widened so that every layer linear has 128 or 256 input columns (the tiny
    one's 64 only take groups of 32 and 64): its tokenizer, random weights of the shapes config.json implies.
    The grouped quantizations' tests (int4_wo, int8_wo with int8_group_size) build it. Read-only."""
    import torch
    from safetensors.torch import save_file

    from trtprompt.checkpoint import expected_weight_shapes, read_checkpoint

    out = tmp_path_factory.mktemp("wide") / "wide"
    shutil.copytree(tiny_checkpoint_factory("llama"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(hidden_size=128, intermediate_size=256, head_dim=32)
    (out / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    shapes = expected_weight_shapes(read_checkpoint(out).pretrained_config)
    save_file({name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()},
              str(out / "model.safetensors"))
    return out


# The serve tests share one tritonserver per session and hand their own ones to `stops` (tests/serve_fixtures.py);
# the SmolLM2 tests share one engine build and one transformers model (tests/real_model_fixtures.py).
from real_model_fixtures import real_fp32_engine, real_hf  # noqa: E402,F401
from serve_fixtures import oracle, pytest_collection_modifyitems, pytest_runtest_teardown, served, stops  # noqa: E402,F401
