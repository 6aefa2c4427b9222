"""Checks of a TensorRT-LLM engine directory, after the build and before serving it.

The builder silently switches `use_paged_context_fmha` off in some cases (an
INT8 KV cache, an FP8 KV cache without FP8 weights, StreamingLLM, context FMHA
off), and both chunked context and KV-cache reuse need it: so the check reads
the engine's own config.json, never the build request. The serve-time checks
refuse what the tensorrtllm backend would otherwise fail on late or silently
degrade: a world size other than tp x pp, an engine from another TensorRT-LLM
version, runtime flags the engine cannot honour, and a missing server or backend.

Only the standard library is used: this runs on machines without TensorRT-LLM.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

from trtprompt.engine.engine_dir import check_rank_engines, load_engine_config
from trtprompt.errors import EngineDirError, TargetUnavailableError
from trtprompt.knobs import KNOBS
from trtprompt.rules import paged_kv_cache, raised_bounds

CONTAINER = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
PINNED_VERSION = "1.2.1"
BACKEND_DIR = Path("/opt/tritonserver/backends/tensorrtllm")
BACKEND_LIBRARY = "libtriton_tensorrtllm.so"
REUSE_FLAGS: tuple[str, ...] = ("enable_chunked_context", "enable_kv_cache_reuse")


@dataclass(frozen=True)
class TrtllmEngineConfig:
    """The parts of a TensorRT-LLM engine's config.json the checks read."""

    path: Path  # the engine directory
    version: str
    pretrained_config: Mapping[str, Any]
    build_config: Mapping[str, Any]

    @classmethod
    def from_dict(cls, path: Path, data: Mapping[str, Any]) -> "TrtllmEngineConfig":
        missing = [k for k in ("version", "pretrained_config", "build_config") if k not in data]
        if missing:
            raise EngineDirError(f"{path / 'config.json'} is not a TensorRT-LLM engine config: "
                                 f"missing {', '.join(missing)}")
        return cls(path, str(data["version"]), data["pretrained_config"], data["build_config"])

    @classmethod
    def read(cls, engine_dir: str | Path) -> "TrtllmEngineConfig":
        root = Path(engine_dir)
        return cls.from_dict(root, load_engine_config(root))

    @property
    def plugin(self) -> Mapping[str, Any]:
        return self.build_config.get("plugin_config") or {}

    @property
    def quantization(self) -> Mapping[str, Any]:
        return self.pretrained_config.get("quantization") or {}

    @property
    def paged_kv_cache(self) -> bool:
        return paged_kv_cache(self.build_config)

    def parallelism(self) -> tuple[int, int, int]:
        """(tp_size, pp_size, world_size), checked against each other."""
        mapping = self.pretrained_config.get("mapping") or {}
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        world = int(mapping.get("world_size", tp * pp))
        if world != tp * pp:
            raise EngineDirError(f"{self.path / 'config.json'}: mapping.world_size {world} != "
                                 f"tp_size {tp} x pp_size {pp}; the engine directory is inconsistent")
        return tp, pp, world


def _why_no_paged_context_fmha(engine: TrtllmEngineConfig) -> str:
    kv, weights = engine.quantization.get("kv_cache_quant_algo"), engine.quantization.get("quant_algo")
    if not engine.plugin.get("context_fmha", True):
        return "context_fmha is off"
    if kv == "INT8":
        return "the KV cache is INT8"
    if kv == "FP8" and weights != "FP8":
        return "the KV cache is FP8 without FP8 weights"
    if engine.plugin.get("streamingllm"):
        return "StreamingLLM is on"
    return "it was not requested, or the builder turned it off"


def flag_problems(engine: TrtllmEngineConfig, flags: Mapping[str, Any]) -> list[str]:
    """What keeps the engine from honouring the runtime flags (config.pbtxt parameter names)."""
    problems = []
    for flag in (f for f in REUSE_FLAGS if flags.get(f)):
        if not engine.plugin.get("use_paged_context_fmha"):
            problems.append(f"{flag} needs plugin_config.use_paged_context_fmha, which the engine has off "
                            f"({_why_no_paged_context_fmha(engine)})")
        if not engine.paged_kv_cache:
            problems.append(f"{flag} needs a paged KV cache (kv_cache_type PAGED)")
    if flags.get("enable_kv_cache_reuse") and engine.build_config.get("gather_context_logits"):
        problems.append("enable_kv_cache_reuse cannot work with gather_context_logits on: TensorRT-LLM "
                        "turns reuse off at runtime")
    return problems


def check_built_engine(engine_dir: str | Path, runtime: Mapping[str, Any]) -> TrtllmEngineConfig:
    """After a build: the profile's runtime policy must be possible with what was built."""
    engine = TrtllmEngineConfig.read(engine_dir)
    problems = flag_problems(engine, runtime)
    if problems:
        raise EngineDirError(f"the TensorRT-LLM build of {engine.path} cannot serve the profile: "
                             + "; ".join(problems) + ". Rebuild without an INT8/FP8 KV cache, or turn "
                             "the flag off in the profile.")
    engine.parallelism()
    return engine


def _bound_problems(engine: TrtllmEngineConfig, flags: Mapping[str, Any]) -> list[str]:
    build = engine.build_config
    problems = raised_bounds(flags, build)
    cap, seq = flags.get("max_tokens_in_paged_kv_cache"), build.get("max_seq_len")
    tpb = int(engine.plugin.get("tokens_per_block", 32))
    if cap is not None and seq is not None and cap // tpb < math.ceil(seq / tpb):
        problems.append(f"max_tokens_in_paged_kv_cache={cap} holds {cap // tpb} blocks of {tpb} tokens, "
                        f"fewer than one max_seq_len {seq} sequence needs ({math.ceil(seq / tpb)}); "
                        "TensorRT-LLM would silently shrink the attention window")
    fraction = KNOBS["kv_cache_free_gpu_mem_fraction"]
    problem = fraction.problem(flags.get(fraction.name))
    if flags.get(fraction.name) is not None and problem:
        problems.append(f"{fraction.name} {problem}")
    return problems


def _backend_problems(engine: TrtllmEngineConfig, flags: Mapping[str, Any]) -> list[str]:
    """Values the tensorrtllm backend has no parameter for: silently ignoring them would be worse."""
    value, built = flags.get("max_num_tokens"), engine.build_config.get("max_num_tokens")
    if value is not None and value != built:
        return [f"max_num_tokens={value}: the tensorrtllm backend cannot change max_num_tokens at runtime; "
                f"the engine was built with {built} (rebuild with --max-num-tokens {value})"]
    return []


def check_runtime_flags(engine: TrtllmEngineConfig, flags: Mapping[str, Any]) -> None:
    problems = flag_problems(engine, flags) + _bound_problems(engine, flags) + _backend_problems(engine, flags)
    if problems:
        raise EngineDirError(f"{engine.path} cannot be served with these runtime flags: " + "; ".join(problems))


def check_rank_files(engine: TrtllmEngineConfig) -> None:
    check_rank_engines(engine.path, engine.parallelism()[2])


def check_world_size(engine: TrtllmEngineConfig, world_size: int | None) -> int:
    """The launcher's world size must be the engine's tp x pp; returns it."""
    tp, pp, world = engine.parallelism()
    if world_size is not None and world_size != world:
        raise EngineDirError(f"world size {world_size} does not match the engine: it was built for "
                             f"tp_size {tp} x pp_size {pp} = {world} ranks")
    return world


def installed_trtllm_version() -> str | None:
    """The installed TensorRT-LLM's version, read from package metadata (no heavy import)."""
    for name in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(engine: TrtllmEngineConfig, installed: str | None) -> None:
    if installed is None:
        raise TargetUnavailableError(
            f"TensorRT-LLM is not installed here, so the engine in {engine.path} (built by TensorRT-LLM "
            f"{engine.version}) cannot be served. Serve it inside the {CONTAINER} container.")
    # A local build tag ("+cu130") names the same release; anything else must match exactly.
    if engine.version.strip().split("+")[0] != installed.strip().split("+")[0]:
        raise EngineDirError(
            f"{engine.path} was built by TensorRT-LLM {engine.version}, but {installed} is installed; "
            "TensorRT engines only load with the version that built them. Rebuild it here with "
            f"`trtprompt build --target trtllm`, or serve it in the container that built it ({CONTAINER} "
            f"ships {PINNED_VERSION}).")


def find_tritonserver(which: Callable[[str], str | None] = shutil.which,
                      backend_dir: Path = BACKEND_DIR) -> Path:
    """The tritonserver binary and its tensorrtllm backend, or an error naming the container."""
    found = which("tritonserver")
    if found is None:
        raise TargetUnavailableError(f"tritonserver is not on PATH; trtllm engines are served by Triton's "
                                     f"tensorrtllm backend: run inside {CONTAINER}")
    if not (backend_dir / BACKEND_LIBRARY).is_file():
        raise TargetUnavailableError(f"the tensorrtllm backend ({backend_dir / BACKEND_LIBRARY}) is missing, "
                                     f"so {found} cannot serve a trtllm engine: run inside {CONTAINER}")
    return Path(found)


@dataclass(frozen=True)
class Preflight:
    tritonserver: Path
    tp_size: int
    pp_size: int
    world_size: int


def preflight(engine_dir: str | Path, flags: Mapping[str, Any], world_size: int | None = None,
              installed_version: Callable[[], str | None] = installed_trtllm_version,
              which: Callable[[str], str | None] = shutil.which, backend_dir: Path = BACKEND_DIR) -> Preflight:
    """Every serve-time check, cheapest and most fundamental first."""
    engine = TrtllmEngineConfig.read(engine_dir)
    world = check_world_size(engine, world_size)
    check_rank_files(engine)
    check_runtime_flags(engine, flags)
    server = find_tritonserver(which, backend_dir)
    check_version(engine, installed_version())
    tp, pp, _ = engine.parallelism()
    return Preflight(server, tp, pp, world)
