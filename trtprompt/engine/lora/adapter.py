"""A PEFT LoRA adapter read from its directory and checked against the base model.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A is [rank, in],
B is [out, rank], and the product adds scaling * B (A x) to the module's output, scaling being
alpha / rank (alpha / sqrt(rank) with use_rslora). Everything PEFT can save that this engine would
compute differently is refused by name, never ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.lora.modules import MODULES, module_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Settings whose non-default values change what PEFT computes in ways this engine does not.
# Activated LoRA applies from its invocation tokens on, layer replication changes the layer structure, QALoRA
# pools its input and lora_bias adds a bias: each has plain lora_A / lora_B tensors, so only its config tells.
_REFUSED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "modules_to_save": (None, []), "bias": ("none",),
    "alora_invocation_tokens": (None,), "layer_replication": (None,), "use_qalora": (False, None),
    "lora_bias": (False, None)}


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the adapter and what is wrong."""


@dataclass(frozen=True, eq=False)
class ModuleLora:
    """One module's low-rank pair: A [rank, in] and B [out, rank] already multiplied by the scaling."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A checked adapter: its pairs by (layer, module), float32, on the CPU."""

    name: str
    digest: str  # of its weights and scalings: part of every KV block hash it computes
    rank: int  # the largest of its modules' ranks
    target_modules: tuple[str, ...]
    pairs: Mapping[tuple[int, str], ModuleLora] = field(repr=False)
    source: str | None = None  # its directory, when read from one

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")

    @property
    def cache_key(self) -> str:
        """What its KV blocks are keyed by: the name for people, the digest so a reloaded adapter with other
        weights under the same name never reads the old one's blocks."""
        return f"{self.name}@{self.digest}"

    def nbytes(self) -> int:
        return sum(p.a.numel() + p.b.numel() for p in self.pairs.values()) * 4


def _pattern_value(module_path: str, pattern: Mapping[str, Any], default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern rule: a key is a regex (grouped, so `q_proj|v_proj` is one key) that
    matches a module path it ends (dot-separated)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return float(value)
    return default


def _check_config(name: str, config: Mapping[str, Any]) -> None:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, allowed in _REFUSED.items():
        if config.get(key, allowed[0]) not in allowed:
            raise LoraError(f"adapter {name!r}: {key}={config[key]!r} is not supported (only {allowed[0]!r})")


def _pairs_by_key(name: str, tensors: Mapping[str, torch.Tensor], num_layers: int
                  ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B of a decoder layer's linear "
                            f"(supported modules: {', '.join(MODULES)}; embeddings and lm_head are not)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise LoraError(f"adapter {name!r}: target module {module!r} is not supported "
                            f"(supported: {', '.join(MODULES)})")
        if layer >= num_layers:
            raise LoraError(f"adapter {name!r}: layer {layer} is past the base model's {num_layers} layers")
        if not tensor.dtype.is_floating_point:
            raise LoraError(f"adapter {name!r}: {key} has dtype {tensor.dtype}, not a floating type")
        found.setdefault((layer, module), {})[which] = tensor
    return found


def build_adapter(name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  max_lora_rank: int, source: str | None = None) -> LoraAdapter:
    """Check PEFT's config and tensors against the base model; scale B once (float32)."""
    _check_config(name, config)
    shapes = module_shapes(cfg)
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], ModuleLora] = {}
    for (layer, module), ab in sorted(_pairs_by_key(name, tensors, cfg.num_hidden_layers).items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b, shape = ab["A"].float(), ab["B"].float(), shapes[module]
        rank = a.shape[0]
        if a.shape != (rank, shape.in_features) or b.shape != (shape.out_features, rank):
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)};"
                            f" the base model needs A [rank, {shape.in_features}] and B [{shape.out_features}, rank]")
        if not 0 < rank <= max_lora_rank:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has rank {rank}, above max_lora_rank "
                            f"{max_lora_rank}")
        path = f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}." \
               f"{module}"
        r = _pattern_value(path, config.get("rank_pattern") or {}, float(config.get("r", rank)))
        if int(r) != rank:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has rank {rank} but its config says {int(r)}")
        a_ = _pattern_value(path, config.get("alpha_pattern") or {}, alpha)
        scaling = a_ / math.sqrt(rank) if rslora else a_ / rank
        pairs[(layer, module)] = ModuleLora(a.contiguous(), (b * scaling).contiguous())
    if not pairs:
        raise LoraError(f"adapter {name!r} holds no LoRA weights")
    digest = _digest(pairs)
    modules = tuple(m for m in MODULES if any(k[1] == m for k in pairs))
    return LoraAdapter(name, digest, max(p.rank for p in pairs.values()), modules, pairs, source)


def _digest(pairs: Mapping[tuple[int, str], ModuleLora]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for (layer, module), pair in sorted(pairs.items()):
        h.update(f"{layer}.{module}".encode())
        h.update(pair.a.numpy().tobytes())
        h.update(pair.b.numpy().tobytes())
    return h.hexdigest()


def read_peft_dir(name: str, path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> LoraAdapter:
    """The adapter saved by PEFT's save_pretrained in `path` (safetensors only)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise LoraError(f"adapter {name!r}: {path} has no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    if not (path / WEIGHTS_FILE).is_file():
        other = " (adapter_model.bin is a pickle: convert it to safetensors)" if (path / "adapter_model.bin").exists() \
            else ""
        raise LoraError(f"adapter {name!r}: {path} has no {WEIGHTS_FILE}; only safetensors is read{other}")
    from safetensors.torch import load_file

    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: {path / CONFIG_FILE} is not readable JSON: {exc}") from exc
    return build_adapter(name, config, load_file(str(path / WEIGHTS_FILE)), cfg, max_lora_rank, str(path))
