"""Read an engine directory into an EngineConfig, applying runtime overrides.

Runtime values may lower the engine's build-time bounds, never raise them
(TensorRT-LLM's rule), and chunked context or block reuse need an engine
built with paged context FMHA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from trtprompt import knobs, rules
from trtprompt.engine.compute_dtype import resolve_compute_dtype
from trtprompt.engine.config import (
    DEFAULT_ATTENTION_BACKEND,
    EngineConfig,
    KvCacheConfig,
    ModelConfig,
    SchedulerConfig,
)
from trtprompt.engine.engine_dir import EngineDir, read_engine_dir
from trtprompt.engine.lora.config import LoraConfig
from trtprompt.engine.speculation.config import SpeculationConfig
from trtprompt.errors import EngineDirError

log = logging.getLogger(__name__)

# Runtime policy the engine takes from the engine directory, then from overrides (the knob registry's).
RUNTIME_KEYS = tuple(k for k in knobs.ENGINE_KEYS if knobs.KNOBS[k].section == "runtime")
LOWERABLE_BOUNDS = tuple(k for k in knobs.ENGINE_KEYS if knobs.KNOBS[k].lowerable)
# Engine knobs only `serve` sets (not recorded in the engine directory).
SERVE_ENGINE_KEYS = tuple(k for k in knobs.ENGINE_KEYS if knobs.KNOBS[k].section == "serve")
# lora_modules: {name: PEFT adapter directory} loaded at start (serve --lora-modules), beside the engine's own.
OTHER_KEYS = ("linear_backend", "attention_backend", "device", "memory_budget_bytes", "lora_modules")


def read_engine_files(path: str | Path) -> EngineDir:
    """The validated engine directory (refuses unfinished builds and missing files)."""
    engine = read_engine_dir(path)
    if engine.target != "torch":
        raise EngineDirError(f"{engine.path} was built for target {engine.target!r}; "
                             "the embedded engine runs torch-target engines")
    return engine


def _check_overrides(overrides: Mapping[str, Any], build: Mapping[str, Any]) -> None:
    known = set(RUNTIME_KEYS) | set(LOWERABLE_BOUNDS) | set(SERVE_ENGINE_KEYS) | set(OTHER_KEYS)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown runtime option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    rules.check_not_raised(overrides, build, LOWERABLE_BOUNDS)
    paged_ctx = not rules.paged_context_missing(build)
    for flag in ("enable_chunked_context", "enable_kv_cache_reuse"):
        if overrides.get(flag) and not paged_ctx:
            raise ValueError(f"{flag} needs an engine built with use_paged_context_fmha and a paged KV cache; "
                             "this engine has it off")


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def engine_config(files: EngineDir, overrides: Mapping[str, Any]) -> EngineConfig:
    build = files.build_config
    _check_overrides(overrides, build)
    runtime = {k: knobs.KNOBS[k].default for k in RUNTIME_KEYS}
    runtime.update({k: v for k, v in dict(files.meta.get("runtime", {})).items() if k in RUNTIME_KEYS})
    runtime.update({k: v for k, v in overrides.items() if k in RUNTIME_KEYS and v is not None})
    # Without paged context FMHA on a paged KV cache the engine can neither chunk nor reuse.
    paged_ctx = not rules.paged_context_missing(build)
    device = overrides.get("device") or "cpu"
    compute = resolve_compute_dtype(files.pretrained_config.get("dtype", "float32"), overrides.get("compute_dtype"),
                                    device)
    if compute.fallback is not None:
        log.warning("dtype bfloat16: %s", compute.fallback)
    budget = overrides.get("memory_budget_bytes")
    if budget is None and runtime.get("max_tokens_in_paged_kv_cache") is None:
        budget = available_memory_bytes(device)
    kv = KvCacheConfig(
        tokens_per_block=build["plugin_config"]["tokens_per_block"],
        enable_block_reuse=bool(runtime["enable_kv_cache_reuse"]) and paged_ctx,
        max_tokens_in_paged_kv_cache=runtime["max_tokens_in_paged_kv_cache"],
        kv_cache_free_gpu_mem_fraction=runtime["kv_cache_free_gpu_mem_fraction"],
        memory_budget_bytes=budget,
        kv_cache_dtype=kv_cache_dtype_of(files.pretrained_config),
        eviction_policy=overrides.get("kv_cache_eviction_policy") or knobs.KNOBS["kv_cache_eviction_policy"].default,
    )
    sched = SchedulerConfig(
        max_batch_size=overrides.get("max_batch_size") or build["max_batch_size"],
        max_num_tokens=overrides.get("max_num_tokens") or build["max_num_tokens"],
        max_seq_len=build["max_seq_len"],
        enable_chunked_context=bool(runtime["enable_chunked_context"]) and paged_ctx,
        batch_scheduler_policy=runtime["batch_scheduler_policy"],
        max_queue_size=runtime["max_queue_size"],
    )
    return EngineConfig(
        model=ModelConfig.from_pretrained_config(files.pretrained_config),
        kv_cache=kv, scheduler=sched,
        dtype=compute.dtype, device=device,
        linear_backend=overrides.get("linear_backend") or "onednn",
        attention_backend=overrides.get("attention_backend") or DEFAULT_ATTENTION_BACKEND,
        guided_jump_forward=_chosen(overrides.get("guided_jump_forward"), knobs.KNOBS["guided_jump_forward"].default),
        speculation=SpeculationConfig.from_knobs(overrides),
        lora=LoraConfig.from_knobs(overrides, build),
    )


def _chosen(value: bool | None, default: bool) -> bool:
    """A boolean override where given (False is a choice, not unset)."""
    return default if value is None else bool(value)


def kv_cache_dtype_of(pretrained_config: Mapping[str, Any]) -> str:
    """The KV cache dtype config.json names (TensorRT-LLM's quantization.kv_cache_quant_algo)."""
    algo = (pretrained_config.get("quantization") or {}).get("kv_cache_quant_algo")
    by_algo = {a: dtype for dtype, a in knobs.KV_CACHE_QUANT_ALGOS.items()}
    if algo not in by_algo:
        raise ValueError(f"kv_cache_quant_algo {algo!r}: the torch engine reads INT8 or none")
    return by_algo[algo]
