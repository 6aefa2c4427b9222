"""Fake of tensorrt_llm.models.modeling_utils: only QuantConfig."""

from __future__ import annotations

from typing import Any

from tensorrt_llm.quantization import QuantAlgo

MODELOPT_ALGOS = (QuantAlgo.FP8, QuantAlgo.W4A16_AWQ, QuantAlgo.W4A8_AWQ, QuantAlgo.NVFP4)


class QuantConfig:
    def __init__(self, quant_algo: QuantAlgo | None = None, kv_cache_quant_algo: QuantAlgo | None = None,
                 group_size: int = 128, **unexpected: Any) -> None:
        if unexpected:
            raise TypeError(f"QuantConfig got unexpected keyword arguments {sorted(unexpected)}")
        for value in (quant_algo, kv_cache_quant_algo):
            if value is not None and not isinstance(value, QuantAlgo):
                raise TypeError(f"expected a QuantAlgo, got {value!r}")
        self.quant_algo, self.kv_cache_quant_algo, self.group_size = quant_algo, kv_cache_quant_algo, group_size

    @property
    def requires_modelopt_quantization(self) -> bool:
        return self.quant_algo in MODELOPT_ALGOS

    def to_dict(self) -> dict[str, Any]:
        return {"quant_algo": self.quant_algo.value if self.quant_algo else None,
                "kv_cache_quant_algo": self.kv_cache_quant_algo.value if self.kv_cache_quant_algo else None,
                "group_size": self.group_size}
