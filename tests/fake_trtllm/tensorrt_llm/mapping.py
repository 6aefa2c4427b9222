"""Fake of tensorrt_llm.Mapping: world_size must equal tp_size x pp_size."""

from __future__ import annotations

from typing import Any

from tensorrt_llm._record import record


class Mapping:
    def __init__(self, world_size: int = 1, rank: int = 0, gpus_per_node: int = 8, *, tp_size: int = 1,
                 pp_size: int = 1, **unexpected: Any) -> None:
        if unexpected:
            raise TypeError(f"Mapping got unexpected keyword arguments {sorted(unexpected)}")
        if world_size != tp_size * pp_size:
            raise ValueError(f"world_size must equal tp_size*pp_size, got {world_size} != {tp_size}*{pp_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.pp_size = tp_size, pp_size
        record("Mapping", world_size=world_size, rank=rank, tp_size=tp_size, pp_size=pp_size)

    def to_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, "gpus_per_node": self.gpus_per_node,
                "tp_size": self.tp_size, "pp_size": self.pp_size}
