"""Engine directory: write it atomically, read and validate it.

A build writes into a hidden temporary sibling (`.<name>.partial-<random>`)
that holds a marker file from its first moment; only a finished build is
renamed to its final name, and the marker is removed after the rename. So a
killed build leaves either nothing under the final name, or a directory that
still carries the marker, which `read_engine_dir` refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from trtprompt.checkpoint import safetensors_header
from trtprompt.engine.config import ModelConfig
from trtprompt.errors import CheckpointError, EngineDirError

ENGINE_FORMAT = 1
PARTIAL_MARKER = ".trtprompt-partial"
BUILD_KEYS: tuple[str, ...] = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                               "max_beam_width", "plugin_config")
META_KEYS: tuple[str, ...] = ("format", "target", "profile", "runtime", "prompt", "memory_plan", "source")


@dataclass(frozen=True)
class EngineDir:
    path: Path
    version: str
    pretrained_config: Mapping[str, Any]
    build_config: Mapping[str, Any]
    meta: Mapping[str, Any]  # trtprompt.json

    @property
    def target(self) -> str:
        return str(self.meta["target"])

    @property
    def tokens_per_block(self) -> int:
        return int(self.build_config["plugin_config"]["tokens_per_block"])

    @property
    def weights_path(self) -> Path:
        return self.path / ("rank0.safetensors" if self.target == "torch" else "rank0.engine")

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def runtime(self) -> Mapping[str, Any]:
        return self.meta["runtime"]

    @property
    def prompt(self) -> Mapping[str, Any]:
        return self.meta["prompt"]

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_pretrained_config(self.pretrained_config)


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise EngineDirError(f"{path.parent} is not an engine directory: {path.name} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineDirError(f"{path} is corrupt (not valid JSON): {exc}") from exc
    if not isinstance(data, dict):
        raise EngineDirError(f"{path} is corrupt: expected a JSON object")
    return data


def _require(data: Mapping[str, Any], keys: tuple[str, ...], where: Path) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise EngineDirError(f"{where} is corrupt: missing {', '.join(missing)}")


def _check_weights(root: Path, target: str) -> None:
    weights = root / ("rank0.safetensors" if target == "torch" else "rank0.engine")
    if not weights.is_file():
        raise EngineDirError(f"{root} is not a complete engine directory: {weights.name} is missing")
    if target == "torch":
        try:
            safetensors_header(weights)
        except CheckpointError as exc:
            raise EngineDirError(f"{weights} is corrupt: {exc}") from exc


def _check_tokenizer(root: Path) -> None:
    tok = root / "tokenizer"
    if not any((tok / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise EngineDirError(f"{root} is not a complete engine directory: tokenizer/ has no tokenizer files")


def read_engine_dir(path: str | Path) -> EngineDir:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise EngineDirError(f"engine directory {root} does not exist")
    if (root / PARTIAL_MARKER).exists():
        raise EngineDirError(f"{root} holds an unfinished build (interrupted?); rebuild it with --force")
    cfg, meta = _load_json(root / "config.json"), _load_json(root / "trtprompt.json")
    _require(cfg, ("version", "pretrained_config", "build_config"), root / "config.json")
    _require(cfg["build_config"], BUILD_KEYS, root / "config.json")
    _require(meta, META_KEYS, root / "trtprompt.json")
    if meta["format"] != ENGINE_FORMAT:
        raise EngineDirError(f"{root}/trtprompt.json has format {meta['format']!r}; "
                             f"this trtprompt reads format {ENGINE_FORMAT}")
    if meta["target"] not in ("torch", "trtllm"):
        raise EngineDirError(f"{root}/trtprompt.json names unknown target {meta['target']!r}")
    engine = EngineDir(root, str(cfg["version"]), cfg["pretrained_config"], cfg["build_config"], meta)
    try:
        engine.model_config()
    except (TypeError, ValueError) as exc:
        raise EngineDirError(f"{root}/config.json pretrained_config is invalid: {exc}") from exc
    _check_weights(root, engine.target)
    _check_tokenizer(root)
    return engine


def looks_like_engine(path: Path) -> bool:
    return (path / "trtprompt.json").is_file() or (path / PARTIAL_MARKER).is_file()


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse before any work: an existing output needs --force, and --force replaces only engines."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise EngineDirError(f"output directory {out} already exists; pass --force to replace it")
    if not out.is_dir() or out.is_symlink():
        raise EngineDirError(f"refusing to replace {out}: it is not a directory")
    if any(out.iterdir()) and not looks_like_engine(out):
        raise EngineDirError(f"refusing to replace {out} even with --force: it is not empty and "
                             "does not look like an engine directory")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(out: Path) -> None:
    """Leftovers of killed builds of the same output, whose builder is gone."""
    for sibling in out.parent.glob(f".{out.name}.partial-*"):
        marker = sibling / PARTIAL_MARKER
        try:
            pid = int(marker.read_text(encoding="utf-8").strip() or "0")
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(sibling, ignore_errors=True)


def _swap_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    (out / PARTIAL_MARKER).unlink()


@contextmanager
def atomic_engine_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty hidden directory to build in; rename it to `out` when the block succeeds."""
    out = Path(out).expanduser().absolute()
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; an engine dir is an ordinary output
    (tmp / PARTIAL_MARKER).write_text(str(os.getpid()), encoding="utf-8")
    try:
        yield tmp
        check_output_dir(out, force)  # someone may have created it meanwhile
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
