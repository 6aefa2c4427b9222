"""Materialize the hand-written TensorRT-LLM engine fixtures (tests/fixtures/trtllm) as engine dirs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "trtllm"
NAMES: tuple[str, ...] = ("good", "no_paged_context_fmha", "gather_context_logits", "tp2")


def make_engine_dir(name: str, dest: Path, tokenizer_from: Path | None = None, *,
                    trtllm_build: bool = False, tokenizer_beside: bool = False) -> Path:
    """Copy a fixture to dest, add one placeholder rank<N>.engine per rank and, if given, a tokenizer.

    trtllm_build: leave out trtprompt.json, so dest is exactly what plain `trtllm-build` writes
    (config.json + rank<N>.engine). tokenizer_beside: put the tokenizer files next to the engine
    instead of in tokenizer/ (how many users keep them)."""
    shutil.copytree(FIXTURES / name, dest, ignore=shutil.ignore_patterns("trtprompt.json") if trtllm_build else None)
    mapping = json.loads((dest / "config.json").read_text(encoding="utf-8"))["pretrained_config"]["mapping"]
    for rank in range(mapping["world_size"]):
        (dest / f"rank{rank}.engine").write_bytes(b"placeholder: not a TensorRT engine\n")
    if tokenizer_from is not None:
        tok = dest if tokenizer_beside else dest / "tokenizer"
        tok.mkdir(exist_ok=True)
        for file in tokenizer_from.iterdir():
            if file.name.startswith("tokenizer") or file.suffix == ".jinja":
                shutil.copy2(file, tok / file.name)
    return dest


FAKE_TRTLLM = Path(__file__).parent / "fake_trtllm"


@pytest.fixture()
def fake_trtllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake tensorrt_llm (tests/fake_trtllm) importable; yields its JSON-lines call log."""
    log = tmp_path / "fake-trtllm-calls.jsonl"
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(log))
    monkeypatch.syspath_prepend(str(FAKE_TRTLLM))
    _forget_tensorrt_llm()
    yield log
    _forget_tensorrt_llm()


def _forget_tensorrt_llm() -> None:
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]


def calls(log: Path, kind: str) -> list[dict[str, Any]]:
    if not log.is_file():
        return []
    return [c for c in map(json.loads, log.read_text(encoding="utf-8").splitlines()) if c["call"] == kind]
