"""`trtprompt build`: checkpoint + profile + overrides -> plan -> engine directory.

The CLI only parses options; this module does the work so tests and scripts
can call it directly.
"""

from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

from trtprompt import __version__
from trtprompt.checkpoint import Checkpoint, read_checkpoint
from trtprompt.engine.engine_dir import ENGINE_FORMAT, atomic_engine_dir, check_output_dir, write_json
from trtprompt.knobs import KV_CACHE_QUANT_ALGOS
from trtprompt.lora_build import LoraRequest, copy_adapters
from trtprompt.plan import BuildPlan, make_plan
from trtprompt.profile import Profile, load_profile

DEFAULT_PROFILES: dict[str, str] = {"torch": "cpu-dev", "trtllm": "chat"}
VERSIONED_PACKAGES: tuple[str, ...] = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "tensorrt_llm")
GIB = 1 << 30


@dataclass(frozen=True)
class BuildRequest:
    checkpoint: Path
    output: Path | None
    profile: str | Path | None = None  # None: the target's default profile
    target: str = "torch"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    kv_budget_gib: float | None = None
    force: bool = False
    progress: bool = True
    tp_size: int = 1  # tensor / pipeline parallel ranks (trtllm target only)
    pp_size: int = 1
    # trtllm target: "engine" (TensorRT-LLM 1.2 TensorRT engine) or "llmapi" (1.3+ LLM API, PyTorch
    # backend); None: llmapi where TensorRT-LLM >= 1.3 is installed, else engine (targets/llmapi_build.py).
    trtllm_api: str | None = None
    # build --lora-dir NAME=DIR / --lora-target-modules: adapters checked and copied into the engine's lora/.
    lora: LoraRequest = field(default_factory=LoraRequest)

    def __post_init__(self) -> None:
        if self.kv_budget_gib is not None and self.kv_budget_gib <= 0:
            raise ValueError(f"kv_budget_gib must be positive, got {self.kv_budget_gib}")
        if (self.tp_size, self.pp_size) != (1, 1) and self.target != "trtllm":
            raise ValueError(f"tp_size {self.tp_size} x pp_size {self.pp_size}: tensor/pipeline "
                             "parallelism needs --target trtllm")
        if self.trtllm_api is not None:
            from trtprompt.targets.llmapi_build import check_trtllm_api

            check_trtllm_api(self.trtllm_api, self.target)

    @property
    def api(self) -> str | None:
        """The trtllm target's API ("engine" or "llmapi"); None for other targets."""
        if self.target != "trtllm":
            return None
        from trtprompt.targets.llmapi_build import default_trtllm_api

        return self.trtllm_api or default_trtllm_api()


def host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_budget(req: BuildRequest, profile: Profile) -> tuple[int | None, str]:
    """(bytes the KV fraction applies to, where that number came from), as the engine will size it."""
    if req.kv_budget_gib is not None:
        return int(req.kv_budget_gib * GIB), f"--kv-budget-gib {req.kv_budget_gib:g}"
    if profile.max_tokens_in_paged_kv_cache is not None:
        return None, "max_tokens_in_paged_kv_cache"
    if req.target == "trtllm":
        return None, "GPU memory at runtime"
    available = host_available_bytes()
    return available, "host available memory" if available else "unknown"


def resolve_profile(req: BuildRequest) -> Profile:
    base = load_profile(req.profile or DEFAULT_PROFILES.get(req.target, "cpu-dev"))
    return base.with_overrides(**req.overrides)


def prepare(req: BuildRequest, checkpoint: Path | None = None) -> tuple[Checkpoint, Profile, BuildPlan]:
    """checkpoint: the directory to read instead of req.checkpoint (one converted from a GGUF file)."""
    ckpt = read_checkpoint(checkpoint or req.checkpoint)
    profile = resolve_profile(req)
    budget, source = kv_budget(req, profile)
    plan = make_plan(ckpt.pretrained_config, profile, req.target, ckpt.source_dtype, budget, source, req.lora)
    return ckpt, profile, plan


def engine_config(ckpt: Checkpoint, plan: BuildPlan) -> dict[str, Any]:
    """config.json in TensorRT-LLM's layout: version, pretrained_config, build_config."""
    b = plan.bounds
    pretrained = {**ckpt.pretrained_config, "dtype": plan.dtype,
                  "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
                  "quantization": {"quant_algo": plan.quant_algo,
                                   "kv_cache_quant_algo": KV_CACHE_QUANT_ALGOS[plan.kv_cache_dtype]}}
    plugin: dict[str, Any] = {"tokens_per_block": b.tokens_per_block, "use_paged_context_fmha": True,
                              "paged_kv_cache": True, "remove_input_padding": True, "context_fmha": True,
                              "gemm_plugin": None}
    if plan.lora.enabled:  # TensorRT-LLM records lora_plugin (the dtype `auto` resolves to) where LoRA is built in
        plugin["lora_plugin"] = plan.dtype
    build = {
        "max_batch_size": b.max_batch_size, "max_input_len": b.max_input_len, "max_seq_len": b.max_seq_len,
        "max_num_tokens": b.max_num_tokens, "opt_num_tokens": b.opt_num_tokens,
        "max_beam_width": b.max_beam_width, "kv_cache_type": "PAGED",
        "multiple_profiles": b.multiple_profiles, "gather_context_logits": False,
        "plugin_config": plugin,
        # As TensorRT-LLM, every engine records lora_config (max_lora_rank: the engine checks adapters against it).
        "lora_config": plan.lora.lora_config(plan.lora.engine_lora_dirs()),
    }
    return {"version": f"trtprompt {__version__}", "pretrained_config": pretrained, "build_config": build}


def package_versions() -> dict[str, str]:
    versions = {"trtprompt": __version__, "python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def engine_meta(ckpt: Checkpoint, profile: Profile, plan: BuildPlan) -> dict[str, Any]:
    """trtprompt.json: the resolved profile, runtime and prompt policy, memory plan, provenance."""
    resolved = {**profile.to_dict(), **vars(plan.bounds), "dtype": plan.dtype}
    meta: dict[str, Any] = {
        "format": ENGINE_FORMAT, "target": plan.target, "profile": resolved,
        "runtime": profile.section("runtime"), "prompt": profile.section("prompt"),
        "memory_plan": vars(plan.memory) | {"runtime_max_input_len": plan.runtime_max_input_len},
        "source": ckpt.source_record(),
        "versions": package_versions(),
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if plan.lora.adapters:  # where each came from, for `inspect` (the engine reads lora/NAME/ itself)
        meta["lora"] = {"adapters": [vars(a) | {"target_modules": list(a.target_modules)}
                                     for a in plan.lora.adapters]}
    return meta


def _copy_tokenizer(ckpt: Checkpoint, out_dir: Path) -> None:
    tok = out_dir / "tokenizer"
    tok.mkdir()
    for file in ckpt.tokenizer_files:
        shutil.copy2(file, tok / file.name)


def write_engine(req: BuildRequest, ckpt: Checkpoint, profile: Profile, plan: BuildPlan) -> Path:
    if req.output is None:
        raise ValueError("write_engine needs an output directory")
    llmapi = smoothing = None
    with atomic_engine_dir(req.output, req.force) as tmp:
        if req.api == "llmapi":  # nothing compiled: the LLM API loads the checkpoint at serve time
            from trtprompt.targets.llmapi_build import write_llmapi_engine

            llmapi = write_llmapi_engine(tmp, Path(req.output), ckpt, profile, plan, req.tp_size, req.pp_size)
        elif plan.target == "trtllm":
            from trtprompt.targets.trtllm_build import build_trtllm_engine
            from trtprompt.targets.trtllm_config import Parallelism

            build_trtllm_engine(tmp, ckpt, profile, plan, Parallelism(req.tp_size, req.pp_size))
        else:
            from trtprompt.targets.torch_build import write_weights

            smoothing = write_weights(tmp, ckpt, ckpt.pretrained_config, plan.dtype, plan.quantization,
                                      req.progress, profile.smoothquant_alpha, plan.group_size,
                                      plan.quantize_lm_head)
        _copy_tokenizer(ckpt, tmp)
        copy_adapters(plan.lora, tmp)
        meta = engine_meta(ckpt, profile, plan)
        if llmapi is not None:
            from trtprompt.targets.llmapi_build import llmapi_meta

            meta = llmapi_meta(meta, llmapi)
        if smoothing is not None:
            meta["smoothquant"] = smoothing.to_json()
        write_json(tmp / "trtprompt.json", meta)
        # Last, so a half-written directory never has a config.json. The trtllm engine build
        # already holds TensorRT-LLM's own config.json (engine.save), which must stay.
        if plan.target != "trtllm" or llmapi is not None:
            config = engine_config(ckpt, plan)
            config["pretrained_config"]["mapping"] = {"world_size": req.tp_size * req.pp_size,
                                                      "tp_size": req.tp_size, "pp_size": req.pp_size}
            if plan.quantization == "int8_w8a8":  # torch target only (the plan refuses it elsewhere)
                from trtprompt.targets.torch_build import w8a8_config_entries

                config["pretrained_config"]["quantization"].update(w8a8_config_entries(smoothing))
            if plan.group_size is not None:  # int4_wo / int8_wo, torch target only (the plan refuses it elsewhere)
                from trtprompt.targets.torch_build import group_config_entries

                config["pretrained_config"]["quantization"].update(group_config_entries(plan.group_size))
            if plan.quantize_lm_head:  # int8_wo, torch target only (the plan refuses it elsewhere)
                config["pretrained_config"]["quantization"]["quantize_lm_head"] = True
            write_json(tmp / "config.json", config)
    return Path(req.output)


def run_build(req: BuildRequest, dry_run: bool = False,
              on_plan: Callable[[Checkpoint, Profile, BuildPlan], None] | None = None) -> Path | None:
    """Plan (and report it through on_plan), then write the engine unless dry_run."""
    if not dry_run:
        if req.output is None:
            raise ValueError("an output directory is required unless dry_run")
        check_output_dir(Path(req.output).expanduser(), req.force)
        if req.api == "engine":
            from trtprompt.targets.trtllm_build import import_tensorrt_llm

            import_tensorrt_llm()  # fail before planning or creating anything
    from trtprompt.gguf import checkpoint_dir

    with checkpoint_dir(req.checkpoint) as path:  # a .gguf file: converted into a temporary checkpoint
        ckpt, profile, plan = prepare(req, path)
        if on_plan is not None:
            on_plan(ckpt, profile, plan)
        if dry_run:
            return None
        return write_engine(req, ckpt, profile, plan)
