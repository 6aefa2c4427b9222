"""Session fixtures for the SmolLM2-135M-Instruct tests (tests/test_real_model*.py): one fp32 engine build and
one transformers model for every module that compares the engine with it (each build is seconds, each load of
the 30-layer model too). Registered from conftest.py; requested only by tests that run (the model is there)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL_CKPT = ROOT / "build" / "smollm2"  # Makefile: REAL_CKPT
# Test engines hold a small KV pool: each engine of the cpu-dev profile would otherwise take 1.5 GB.
SMALL_KV = {"max_tokens_in_paged_kv_cache": 4096}


def build_engine(out: Path, checkpoint: Path = REAL_CKPT, **overrides: Any) -> Path:
    from trtprompt.build import BuildRequest, run_build

    req = BuildRequest(checkpoint, out, "cpu-dev", overrides={**SMALL_KV, **overrides}, progress=False)
    return Path(run_build(req) or out)


@pytest.fixture(scope="session")
def real_fp32_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 engine of the checkpoint (cpu-dev, SMALL_KV). Read-only: every module loads its own engine."""
    started = time.monotonic()
    path = build_engine(tmp_path_factory.mktemp("real") / "smollm2")
    print(f"\nfp32 engine built in {time.monotonic() - started:.1f} s")
    return path


@pytest.fixture(scope="session")
def real_hf() -> tuple[Any, Any]:
    """transformers' model (float32, eval) and tokenizer of the checkpoint. Read-only: no test changes them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return (AutoModelForCausalLM.from_pretrained(REAL_CKPT, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(REAL_CKPT))
