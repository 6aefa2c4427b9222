"""Engine directory: write it atomically, read and validate it.

One reader (`read_engine_dir`) serves every consumer: the embedded engine,
`serve`, `inspect`, `lint`, the prompt edge and the bench. It reads both
what `trtprompt build` writes (config.json + trtprompt.json + weights +
tokenizer/) and a directory written by plain `trtllm-build` (TensorRT-LLM
1.2: config.json holding version, pretrained_config and build_config, plus
rank0.engine .. rank<world_size-1>.engine; no trtprompt.json). For the
latter the trtprompt metadata is derived from config.json (see
`_trtllm_build_meta`) and the tokenizer comes from `--tokenizer DIR`, a
`tokenizer/` subdirectory, or tokenizer files beside the engine.

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

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.safetensors_header import safetensors_header
from trtprompt.errors import CheckpointError, EngineDirError, UserError
from trtprompt.rules import paged_context_missing

ENGINE_FORMAT = 1
PARTIAL_MARKER = ".trtprompt-partial"
BUILD_KEYS: tuple[str, ...] = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                               "max_beam_width", "plugin_config")
META_KEYS: tuple[str, ...] = ("format", "target", "profile", "runtime", "prompt", "memory_plan", "source")
CONFIG_KEYS: tuple[str, ...] = ("version", "pretrained_config", "build_config")
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json")
BUILT_BY_TRTLLM = "trtllm-build"  # meta["source"]["built_by"] of a directory trtprompt did not write
# `build --target trtllm --trtllm-api llmapi`: checkpoint/ + model.yaml for TensorRT-LLM's LLM API (1.3+);
# config.json is trtprompt's (bounds in TensorRT-LLM's layout), there is no engine file (docs/gpu.md).
LLMAPI_TARGET = "trtllm-llmapi"
LLMAPI_FILES: tuple[str, ...] = ("model.yaml", "checkpoint/config.json")
TARGETS: tuple[str, ...] = ("torch", "trtllm", LLMAPI_TARGET)


@dataclass(frozen=True)
class EngineDir:
    path: Path
    version: str
    pretrained_config: Mapping[str, Any]
    build_config: Mapping[str, Any]
    meta: Mapping[str, Any]  # trtprompt.json, or what _trtllm_build_meta derives for a plain engine
    tokenizer_dir: Path

    @classmethod
    def read(cls, path: str | Path, tokenizer: str | Path | None = None) -> "EngineDir":
        """read_engine_dir for the serve layer: the weights must be there, but their contents are
        checked by the engine process that loads them (a failure there shows in its log)."""
        return read_engine_dir(path, tokenizer, verify_weights=False)

    @property
    def target(self) -> str:
        return str(self.meta["target"])

    @property
    def built_by_trtprompt(self) -> bool:
        built_by: object = self.meta["source"].get("built_by")  # JSON: anything
        return built_by != BUILT_BY_TRTLLM

    @property
    def plugin_config(self) -> Mapping[str, Any]:
        return self.build_config.get("plugin_config") or {}

    @property
    def tokens_per_block(self) -> int:
        return int(self.plugin_config["tokens_per_block"])

    @property
    def world_size(self) -> int:
        mapping = self.pretrained_config.get("mapping") or {}
        return int(mapping.get("world_size", 1))

    @property
    def weights_path(self) -> Path:
        return self.path / ("rank0.safetensors" if self.target == "torch" else "rank0.engine")

    @property
    def runtime(self) -> Mapping[str, Any]:
        runtime: Mapping[str, Any] = self.meta["runtime"]  # checked a mapping when read
        return runtime

    @property
    def prompt(self) -> Mapping[str, Any]:
        prompt: Mapping[str, Any] = self.meta["prompt"]  # checked a mapping when read
        return prompt

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_pretrained_config(self.pretrained_config)


def read_json_object(path: Path, error: type[UserError]) -> dict[str, Any]:
    """A JSON file that must hold an object (checkpoint and engine files); anything else raises error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path} is corrupt (not valid JSON): {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path} is corrupt: expected a JSON object")
    return data


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise EngineDirError(f"{path.parent} is not an engine directory: {path.name} is missing")
    return read_json_object(path, EngineDirError)


def _require(data: Mapping[str, Any], keys: tuple[str, ...], where: Path) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise EngineDirError(f"{where} is corrupt: missing {', '.join(missing)}")


def check_rank_engines(root: Path, world_size: int) -> None:
    """A TensorRT-LLM engine has one serialized engine per rank (tp_size x pp_size)."""
    missing = [f"rank{r}.engine" for r in range(world_size) if not (root / f"rank{r}.engine").is_file()]
    if missing:
        raise EngineDirError(f"{root} is incomplete for world size {world_size}: missing {', '.join(missing)}")


def _check_weights(engine: EngineDir, verify: bool) -> None:
    if engine.target == LLMAPI_TARGET:  # the checkpoint's weights are read by the LLM API, on the GPU
        missing = [name for name in LLMAPI_FILES if not (engine.path / name).is_file()]
        if missing:
            raise EngineDirError(f"{engine.path} is not a complete llmapi engine directory: missing "
                                 f"{', '.join(missing)}")
        return
    if engine.target == "trtllm":
        check_rank_engines(engine.path, engine.world_size)
        return
    if not engine.weights_path.is_file():
        raise EngineDirError(f"{engine.path} is not a complete engine directory: {engine.weights_path.name} "
                             "is missing")
    if not verify:
        return
    try:
        safetensors_header(engine.weights_path)
    except CheckpointError as exc:
        raise EngineDirError(f"{engine.weights_path} is corrupt: {exc}") from exc


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / n).is_file() for n in TOKENIZER_FILES)


def _find_tokenizer(root: Path, given: str | Path | None, built_by_trtprompt: bool) -> Path:
    """--tokenizer DIR, else tokenizer/, else (trtllm-build dirs only) the files beside the engine."""
    if given is not None:
        folder = Path(given).expanduser().resolve()
        if not _has_tokenizer(folder):
            raise EngineDirError(f"--tokenizer {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        return folder
    if _has_tokenizer(root / "tokenizer"):
        return root / "tokenizer"
    if built_by_trtprompt:
        raise EngineDirError(f"{root} is not a complete engine directory: tokenizer/ has no tokenizer files")
    if _has_tokenizer(root):
        return root
    raise EngineDirError(f"{root} (built by trtllm-build) has no tokenizer: pass --tokenizer DIR, or copy the "
                         f"checkpoint's tokenizer files into {root / 'tokenizer'}")


def _trtllm_build_meta(build_config: Mapping[str, Any]) -> dict[str, Any]:
    """trtprompt.json's content for an engine trtprompt did not build: TensorRT-LLM's defaults,
    with KV reuse on only where the engine can do it (paged context FMHA on a paged KV cache),
    so a plain `serve ENGINE` works and an explicit flag the engine cannot honour is refused."""
    return {"format": ENGINE_FORMAT, "target": "trtllm", "profile": {"name": None},
            "runtime": {"enable_kv_cache_reuse": not paged_context_missing(build_config),
                        "enable_chunked_context": False},
            "prompt": {}, "memory_plan": {}, "source": {"path": None, "sha256": None, "built_by": BUILT_BY_TRTLLM}}


def _read_meta(root: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    if not (root / "trtprompt.json").is_file() and (root / "rank0.engine").is_file():
        return _trtllm_build_meta(cfg["build_config"])
    meta = _load_json(root / "trtprompt.json")
    _require(meta, META_KEYS, root / "trtprompt.json")
    if meta["format"] != ENGINE_FORMAT:
        raise EngineDirError(f"{root}/trtprompt.json has format {meta['format']!r}; "
                             f"this trtprompt reads format {ENGINE_FORMAT}")
    if meta["target"] not in TARGETS:
        raise EngineDirError(f"{root}/trtprompt.json names unknown target {meta['target']!r}")
    return meta


def load_engine_config(root: Path) -> dict[str, Any]:
    """config.json with the keys every reader needs (TensorRT-LLM's EngineConfig layout)."""
    cfg = _load_json(root / "config.json")
    _require(cfg, CONFIG_KEYS, root / "config.json")
    if not isinstance(cfg["build_config"], dict) or not isinstance(cfg["pretrained_config"], dict):
        raise EngineDirError(f"{root / 'config.json'} is corrupt: pretrained_config and build_config "
                             "must be JSON objects")
    return cfg


def read_engine_dir(path: str | Path, tokenizer: str | Path | None = None, *,
                    verify_weights: bool = True) -> EngineDir:
    """The engine directory at path, validated; tokenizer overrides where its tokenizer is read from.
    verify_weights: also parse the torch target's safetensors header (not just its presence)."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise EngineDirError(f"engine directory {root} does not exist")
    if (root / PARTIAL_MARKER).exists():
        raise EngineDirError(f"{root} holds an unfinished build (interrupted?); rebuild it with --force")
    cfg = load_engine_config(root)
    _require(cfg["build_config"], BUILD_KEYS, root / "config.json")
    meta = _read_meta(root, cfg)
    built_by_trtprompt = meta["source"].get("built_by") != BUILT_BY_TRTLLM
    engine = EngineDir(root, str(cfg["version"]), cfg["pretrained_config"], cfg["build_config"], meta,
                       _find_tokenizer(root, tokenizer, built_by_trtprompt))
    if engine.target == "torch":  # only the torch engine instantiates the model from it
        try:
            engine.model_config()
        except (TypeError, ValueError) as exc:
            raise EngineDirError(f"{root}/config.json pretrained_config is invalid: {exc}") from exc
    _check_weights(engine, verify_weights)
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


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs (one owned by another user counts as running)."""
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
        if not pid_alive(pid):
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
