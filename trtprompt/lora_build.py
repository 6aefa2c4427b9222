"""Build-time LoRA: the adapters `trtprompt build --lora-dir NAME=DIR` puts in an engine directory, checked against
the base model before anything is written, and TensorRT-LLM's LoRA settings for them (BuildConfig.lora_config:
lora_dir, lora_ckpt_source, max_lora_rank, lora_target_modules; PluginConfig.lora_plugin; trtllm-build's flags
of the same names). Module names follow TensorRT-LLM (attn_q ... mlp_gate); engine/lora/modules.py maps them to
Hugging Face's. Reading the adapters imports torch, so it happens only when some are given."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from trtprompt.engine.lora.modules import MODULES, TRTLLM_NAMES
from trtprompt.errors import PlanError

LORA_CKPT_SOURCE = "hf"  # TensorRT-LLM's lora_ckpt_source for PEFT (Hugging Face) adapters
TRTLLM_MODULES: tuple[str, ...] = tuple(TRTLLM_NAMES[m] for m in MODULES)
HF_MODULES: dict[str, str] = {trt: hf for hf, trt in TRTLLM_NAMES.items()}
# What an engine directory keeps of an adapter: PEFT's config and its safetensors weights, nothing else.
ADAPTER_FILES: tuple[str, ...] = ("adapter_config.json", "adapter_model.safetensors")
# An adapter's name is a directory under lora/ and the `model` clients send: no path separators or dots first.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$")


def parse_lora_dir(value: str) -> tuple[str, Path]:
    """`NAME=DIR` (build --lora-dir) as (name, dir)."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ValueError(f"--lora-dir {value!r}: expected NAME=DIR (the adapter's name, then its PEFT directory)")
    return name, Path(path)


@dataclass(frozen=True)
class LoraRequest:
    """What the build was asked for: adapters by name, and TensorRT-LLM target modules (None: the adapters')."""

    adapters: tuple[tuple[str, Path], ...] = ()
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        names = [name for name, _ in self.adapters]
        for name in names:
            if not _NAME.match(name):
                raise ValueError(f"lora_dir: adapter name {name!r} must be 1-128 of letters, digits and _.@+- "
                                 "(not starting with . - @ +), as it names a directory and a served model")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lora_dir: adapter name(s) {', '.join(dup)} given more than once")
        unknown = [m for m in self.target_modules or () if m not in TRTLLM_MODULES]
        if unknown:
            raise ValueError(f"lora_target_modules: {', '.join(unknown)} not supported; choose from "
                             f"{' '.join(TRTLLM_MODULES)}")

    @property
    def enabled(self) -> bool:
        return bool(self.adapters) or self.target_modules is not None


@dataclass(frozen=True)
class AdapterPlan:
    """One checked adapter: its name, where it was read from, its largest rank, its modules (Hugging Face names)."""

    name: str
    source: str
    rank: int
    target_modules: tuple[str, ...]
    digest: str


@dataclass(frozen=True)
class LoraPlan:
    """The engine's LoRA settings. enabled: adapters or target modules were given (TensorRT-LLM's lora_plugin)."""

    max_lora_rank: int
    enabled: bool = False
    adapters: tuple[AdapterPlan, ...] = ()
    target_modules: tuple[str, ...] = ()  # TensorRT-LLM names, in engine order

    def lora_config(self, lora_dirs: Sequence[str]) -> dict[str, Any]:
        """config.json build_config.lora_config, TensorRT-LLM's layout (it records one in every engine)."""
        return {"lora_dir": list(lora_dirs), "lora_ckpt_source": LORA_CKPT_SOURCE,
                "max_lora_rank": self.max_lora_rank, "lora_target_modules": list(self.target_modules),
                "trtllm_modules_to_hf_modules": {m: HF_MODULES[m] for m in self.target_modules}}

    def engine_lora_dirs(self) -> list[str]:
        """The adapters' directories inside the engine directory, relative to it."""
        if not self.adapters:
            return []
        from trtprompt.engine.lora.engine_dir import LORA_SUBDIR  # imports torch: only with adapters

        return [f"{LORA_SUBDIR}/{a.name}" for a in self.adapters]


def _check_targets(adapter: AdapterPlan, given: tuple[str, ...] | None) -> None:
    if given is None:
        return
    left_out = [f"{TRTLLM_NAMES[m]} ({m})" for m in adapter.target_modules if TRTLLM_NAMES[m] not in given]
    if left_out:
        raise PlanError(f"adapter {adapter.name!r} targets {', '.join(left_out)}, which --lora-target-modules "
                        f"({' '.join(given)}) leaves out: add them, or leave --lora-target-modules unset")


def _read(name: str, path: Path, pretrained_config: Mapping[str, Any], max_lora_rank: int) -> AdapterPlan:
    from trtprompt.engine.config import ModelConfig
    from trtprompt.engine.lora.adapter import read_peft_dir

    try:
        adapter = read_peft_dir(name, path, ModelConfig.from_pretrained_config(pretrained_config), max_lora_rank)
    except ValueError as exc:  # LoraError names the adapter and the mismatch
        raise PlanError(f"--lora-dir {name}={path}: {exc}") from exc
    return AdapterPlan(name, str(Path(path).expanduser().absolute()), adapter.rank, adapter.target_modules,
                       adapter.digest)


def plan_lora(request: LoraRequest | None, pretrained_config: Mapping[str, Any], max_lora_rank: int) -> LoraPlan:
    """Read and check every adapter against the base (shapes, modules, rank <= max_lora_rank); the target modules
    are the ones given, else the union of the adapters'."""
    request = request or LoraRequest()
    adapters = tuple(_read(n, p, pretrained_config, max_lora_rank) for n, p in request.adapters)
    for adapter in adapters:
        _check_targets(adapter, request.target_modules)
    if request.target_modules is not None:
        wanted = set(request.target_modules)
    else:
        wanted = {TRTLLM_NAMES[m] for a in adapters for m in a.target_modules}
    return LoraPlan(max_lora_rank, request.enabled, adapters, tuple(m for m in TRTLLM_MODULES if m in wanted))


def copy_adapters(plan: LoraPlan, out_dir: Path) -> None:
    """Each adapter's PEFT files into out_dir/lora/NAME/ (engine/lora/engine_dir.py loads them at start)."""
    if not plan.adapters:
        return
    from trtprompt.engine.lora.engine_dir import LORA_SUBDIR

    for adapter in plan.adapters:
        dest = out_dir / LORA_SUBDIR / adapter.name
        dest.mkdir(parents=True)
        for file in ADAPTER_FILES:
            shutil.copy2(Path(adapter.source) / file, dest / file)


def trtllm_lora_config(plan: LoraPlan) -> dict[str, Any] | None:
    """TensorRT-LLM 1.2's LoraConfig kwargs for its engine build (the adapters' own directories, read at build
    time as trtllm-build --lora_dir reads them); None without LoRA."""
    if not plan.enabled:
        return None
    return {"lora_dir": [a.source for a in plan.adapters], "lora_ckpt_source": LORA_CKPT_SOURCE,
            "max_lora_rank": plan.max_lora_rank, "lora_target_modules": list(plan.target_modules)}


def inspect_rows(adapters: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """One row per adapter for `inspect`: name -> rank, target modules, source."""
    return [(str(a["name"]), f"rank {a.get('rank', '-')}  modules {' '.join(a.get('target_modules') or []) or '-'}"
             f"  source {a.get('source') or '-'}") for a in adapters]


def _from_config(name: str, path: Path) -> dict[str, Any]:
    """An adapter directory the build did not record (added by hand): rank and modules from its PEFT config."""
    import json

    try:
        config = json.loads((path / ADAPTER_FILES[0]).read_text())
    except (OSError, ValueError):
        config = {}
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    return {"name": name, "rank": max((int(r) for r in ranks if isinstance(r, int)), default=None),
            "target_modules": [m for m in MODULES if m in modules], "source": str(path)}


def engine_adapters(engine_path: Path, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The adapters an engine loads at start (its lora/NAME/ directories), with what the build recorded of each
    (rank, Hugging Face target modules, the directory it was copied from)."""
    if not (Path(engine_path) / "lora").is_dir():  # engine_dir.LORA_SUBDIR, without importing torch for it
        return []
    from trtprompt.engine.lora.engine_dir import lora_dirs  # the engine's own rule for which directories count

    recorded = {str(a["name"]): dict(a) for a in (meta.get("lora") or {}).get("adapters", [])}
    return [recorded.get(name) or _from_config(name, Path(path)) for name, path in lora_dirs(engine_path, None).items()]
