"""How many adapters an engine holds, and how large they may be: the LoRA knobs as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.knobs import KNOBS

LORA_KNOBS: tuple[str, ...] = ("max_loras", "max_cpu_loras")


@dataclass(frozen=True)
class LoraConfig:
    max_loras: int = KNOBS["max_loras"].default
    max_cpu_loras: int = KNOBS["max_cpu_loras"].default
    max_lora_rank: int = KNOBS["max_lora_rank"].default  # the build's (config.json lora_config)

    def __post_init__(self) -> None:
        for name in (*LORA_KNOBS, "max_lora_rank"):
            KNOBS[name].check(getattr(self, name))
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             "an adapter laid out for steps is also held in host memory")

    @classmethod
    def from_knobs(cls, overrides: Mapping[str, Any], build: Mapping[str, Any]) -> "LoraConfig":
        given = {k: overrides[k] for k in LORA_KNOBS if overrides.get(k) is not None}
        rank = (build.get("lora_config") or {}).get("max_lora_rank")
        return cls(**given, **({} if rank is None else {"max_lora_rank": int(rank)}))
