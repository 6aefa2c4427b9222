"""`build --target trtllm --trtllm-api llmapi`: an engine directory for TensorRT-LLM's LLM API (1.3+).

Nothing is compiled: from 1.3 the PyTorch backend loads a Hugging Face
checkpoint itself at serve time, so the build needs no TensorRT-LLM and no
GPU. It writes (into the hidden directory build.py renames into place):

  checkpoint/     the checkpoint's files, hard-linked where the file system allows
                  (no copy of the weights; the build survives the source being moved or
                  deleted, and the source cannot be edited behind it through a link)
                  and copied otherwise
  tokenizer/      as every engine directory (build.py copies it)
  model.yaml      the LLM API arguments: bounds, chunked prefill, kv_cache_config, scheduler
  config.json     trtprompt's bounds in TensorRT-LLM's layout (build.py), read by inspect,
                  serve and the prompt edge like any other engine directory's
  trtprompt.json  target "trtllm-llmapi"

model.yaml names the final output path (the LLM API resolves no relative
paths against the file); `serve` rewrites both paths to the directory's
location when it writes the repository, so a moved engine directory serves.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from trtprompt.checkpoint import Checkpoint
from trtprompt.plan import BuildPlan
from trtprompt.profile import Profile
from trtprompt.targets.llmapi_config import LlmapiPaths, llm_args, to_yaml, validate_llm_args

CHECKPOINT_DIR = "checkpoint"
MODEL_YAML = "model.yaml"
log = logging.getLogger("trtprompt.build")


def _link_or_copy(src: Path, dst: Path) -> str:
    """Hard link src at dst; copy where linking is impossible (another file system, no permission)."""
    try:
        os.link(src, dst)
        return "linked"
    except OSError:
        shutil.copy2(src, dst)
        return "copied"


def place_checkpoint(ckpt: Checkpoint, out_dir: Path) -> str:
    """checkpoint/ with every regular top-level file of the checkpoint; returns how ("linked", "copied")."""
    dest = out_dir / CHECKPOINT_DIR
    dest.mkdir()
    how = set()
    for file in sorted(Path(ckpt.path).iterdir()):
        if file.is_file() and not file.name.startswith("."):
            how.add(_link_or_copy(file, dest / file.name))
    return "copied" if "copied" in how else "linked"


def _validated(args: dict[str, Any], ckpt: Checkpoint) -> str | None:
    """Validate before writing: against the source checkpoint, which exists now (the output does not)."""
    probe = {**args, "model": str(Path(ckpt.path).resolve()), "tokenizer": str(Path(ckpt.path).resolve())}
    checked_by = validate_llm_args(probe)
    if checked_by is None:
        log.warning("TensorRT-LLM is not installed here: model.yaml was written without validation by its "
                    "TorchLlmArgs (the llmapi model validates it when tritonserver loads it)")
    return checked_by


def write_llmapi_engine(tmp: Path, final: Path, ckpt: Checkpoint, profile: Profile, plan: BuildPlan,
                        tp_size: int = 1, pp_size: int = 1) -> dict[str, str | None]:
    """Write checkpoint/ and model.yaml into tmp (to be renamed to final); returns what trtprompt.json records."""
    final = Path(final).expanduser().absolute()
    paths = LlmapiPaths(final / CHECKPOINT_DIR, final / "tokenizer")
    args = llm_args(plan, profile.section("runtime"), paths, tp_size, pp_size)
    checked_by = _validated(args, ckpt)
    how = place_checkpoint(ckpt, tmp)
    (tmp / MODEL_YAML).write_text(to_yaml(args), encoding="utf-8")
    return {"api": "llmapi", "model_yaml": MODEL_YAML, "checkpoint": how, "validated_with": checked_by}


TRTLLM_APIS: tuple[str, ...] = ("engine", "llmapi")
FIRST_LLMAPI_VERSION: tuple[int, int] = (1, 3)  # the first release whose served path is the LLM API


def check_trtllm_api(api: str, target: str) -> None:
    if api not in TRTLLM_APIS:
        raise ValueError(f"trtllm_api must be one of {', '.join(TRTLLM_APIS)}, got {api!r}")
    if target != "trtllm":
        raise ValueError(f"--trtllm-api {api} applies to --target trtllm only; the {target} target has one "
                         "engine format: leave --trtllm-api out")


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.strip().split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "0")
    except (IndexError, ValueError):
        return None


def default_trtllm_api(installed: str | None = None) -> str:
    """llmapi where TensorRT-LLM >= 1.3 is installed; engine otherwise (1.2.x, or none here, where the
    engine build then stops with the message naming the 1.2 container)."""
    if installed is None:
        from trtprompt.targets.trtllm_checks import installed_trtllm_version

        installed = installed_trtllm_version()
    version = _major_minor(installed) if installed else None
    return "llmapi" if version is not None and version >= FIRST_LLMAPI_VERSION else "engine"


def llmapi_meta(meta: dict[str, Any], llmapi: Mapping[str, Any]) -> dict[str, Any]:
    """trtprompt.json of an llmapi build: its own target kind, and how it was made."""
    from trtprompt.engine.engine_dir import LLMAPI_TARGET

    return {**meta, "target": LLMAPI_TARGET, "llmapi": dict(llmapi)}
