"""bfloat16 on a CPU without bf16 instructions is said, at build and at load (engine/isa.py bf16_problem)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.engine import isa


def test_the_problem_names_the_flags_and_the_fallback() -> None:
    problem = isa.bf16_problem(frozenset({"avx2", "fma"}))
    assert problem is not None and "avx512_bf16, amx_bf16" in problem and "--dtype float32" in problem
    assert isa.bf16_problem(frozenset({"avx2", "avx512_bf16"})) is None
    assert isa.bf16_problem(frozenset({"amx_bf16"})) is None


def test_build_and_load_warn_where_this_cpu_emulates_bf16(tiny_checkpoint_factory: Callable[..., Path],
                                                          tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from trtprompt.engine.engine import LLMEngine

    expected = isa.bf16_problem(isa.cpu_flags())  # None on a CPU with avx512_bf16 or amx_bf16: no warning
    out = tmp_path / "bf16"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory()), "-o", str(out), "--profile",
                                       "cpu-dev", "--dtype", "bfloat16", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    warned = f"warning: --dtype bfloat16: {expected}" in result.output
    assert warned == (expected is not None)
    with caplog.at_level(logging.WARNING, logger="trtprompt.engine.engine"):
        LLMEngine.from_engine_dir(out).close()
    loaded = [r.getMessage() for r in caplog.records if "dtype bfloat16" in r.getMessage()]
    assert loaded == ([f"dtype bfloat16: {expected}"] if expected is not None else [])
