"""bfloat16 on a CPU without bf16 instructions: said at build, and at load the engine computes in float32
unless compute_dtype says otherwise (engine/isa.py bf16_problem, engine/compute_dtype.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner
from engine_helpers import run_to_completion

from trtprompt.cli import main
from trtprompt.engine import isa
from trtprompt.engine.compute_dtype import ComputeDtype, resolve_compute_dtype
from trtprompt.engine.request import SamplingParams


def test_the_problem_names_the_flags_and_the_fallback() -> None:
    problem = isa.bf16_problem(frozenset({"avx2", "fma"}))
    assert problem is not None and "avx512_bf16, amx_bf16" in problem and "emulated" in problem
    assert isa.bf16_problem(frozenset({"avx2", "avx512_bf16"})) is None
    assert isa.bf16_problem(frozenset({"amx_bf16"})) is None


AVX2 = frozenset({"avx2", "fma"})
BF16 = frozenset({"avx2", "avx512_bf16"})


def test_a_bf16_engine_computes_in_float32_where_the_cpu_would_emulate_bf16() -> None:
    fallback = resolve_compute_dtype("bfloat16", None, "cpu", AVX2)
    assert fallback.dtype == "float32" and fallback.fallback is not None
    assert "avx512_bf16, amx_bf16" in fallback.fallback and "compute_dtype=bfloat16" in fallback.fallback
    assert resolve_compute_dtype("bfloat16", None, "cpu", BF16) == ComputeDtype("bfloat16")
    assert resolve_compute_dtype("bfloat16", None, "cuda:0", AVX2) == ComputeDtype("bfloat16")
    assert resolve_compute_dtype("float32", None, "cpu", AVX2) == ComputeDtype("float32")
    assert resolve_compute_dtype("bfloat16", "bfloat16", "cpu", AVX2) == ComputeDtype("bfloat16")  # asked: kept
    assert resolve_compute_dtype("bfloat16", "float32", "cpu", BF16) == ComputeDtype("float32")


@pytest.mark.parametrize("stored,requested", [("float32", "bfloat16"), ("bfloat16", "float16")])
def test_compute_dtype_is_the_engines_own_or_float32(stored: str, requested: str) -> None:
    with pytest.raises(ValueError, match=rf"compute_dtype must be float32 or the engine's own dtype \({stored}\), "
                                         rf"got '{requested}'"):
        resolve_compute_dtype(stored, requested, "cpu", AVX2)


def _bf16_rounded_copy(ckpt: Path, out: Path) -> Path:
    """The checkpoint with every float tensor rounded to bfloat16 and stored in float32 again."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in tensors.items()},
                  str(f), metadata={"format": "pt"})
    return out


def _greedy(engine: Any, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    out = run_to_completion(engine, {str(i): p for i, p in enumerate(prompts)},
                            SamplingParams(max_tokens=n, temperature=0.0, end_id=0))
    return [out[str(i)] for i in range(len(prompts))]


def test_build_warns_and_load_widens_where_this_cpu_emulates_bf16(
        tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.serve.engine_process.server import engine_overrides

    expected = isa.bf16_problem(isa.cpu_flags())  # None on a CPU with avx512_bf16 or amx_bf16: no fallback
    out = tmp_path / "bf16"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory()), "-o", str(out), "--profile",
                                       "cpu-dev", "--dtype", "bfloat16", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    warned = f"warning: --dtype bfloat16: {expected}; on such a CPU the engine computes in float32" in result.output
    assert warned == (expected is not None)
    with caplog.at_level(logging.WARNING, logger="trtprompt.engine"):
        engine = LLMEngine.from_engine_dir(out)
    said = [r.getMessage() for r in caplog.records if "dtype bfloat16" in r.getMessage()]
    fallback = resolve_compute_dtype("bfloat16", None, "cpu").fallback
    assert said == ([f"dtype bfloat16: {fallback}"] if expected is not None else [])
    assert engine.config.dtype == ("float32" if expected is not None else "bfloat16")
    assert engine.runner.kv_caches[0][0].dtype == (torch.float32 if expected is not None else torch.bfloat16)
    engine.close()
    caplog.clear()
    # Asked for, as serve's --compute-dtype reaches the engine process (its tensorrt_llm parameters): bf16
    # arithmetic, and a warning where it is slow.
    overrides = engine_overrides({"compute_dtype": "bfloat16", "max_tokens_in_paged_kv_cache": "4096"})
    with caplog.at_level(logging.WARNING, logger="trtprompt.engine"):
        forced = LLMEngine.from_engine_dir(out, **overrides)
    said = [r.getMessage() for r in caplog.records if "dtype bfloat16" in r.getMessage()]
    assert len(said) == (expected is not None) and forced.runner.kv_caches[0][0].dtype == torch.bfloat16
    forced.close()


def test_widened_bf16_engine_is_the_float32_engine_of_the_rounded_weights(
        tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    """compute_dtype float32 on a bf16 engine: bf16 -> fp32 is exact, so its tokens are those of a float32
    engine built from the same weights rounded to bf16 (tests/test_engine_dtypes.py holds that one to
    transformers through the float32 path)."""
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.engine.engine import LLMEngine

    ckpt = tiny_checkpoint_factory("llama")
    bf16 = run_build(BuildRequest(ckpt, tmp_path / "bf16", "cpu-dev", overrides={"dtype": "bfloat16"},
                                  progress=False))
    rounded = run_build(BuildRequest(_bf16_rounded_copy(ckpt, tmp_path / "rounded-ckpt"), tmp_path / "fp32",
                                     "cpu-dev", progress=False))
    assert bf16 is not None and rounded is not None
    prompts = [list(range(5, 45)), list(range(60, 71)), [7] * 30]
    widened = LLMEngine.from_engine_dir(bf16, compute_dtype="float32")
    reference = LLMEngine.from_engine_dir(rounded)
    assert widened.config.dtype == "float32" and widened.runner.kv_caches[0][0].dtype == torch.float32
    assert _greedy(widened, prompts) == _greedy(reference, prompts)
    widened.close()
    reference.close()
