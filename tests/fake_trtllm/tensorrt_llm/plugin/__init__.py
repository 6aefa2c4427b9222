"""Fake of tensorrt_llm.plugin.PluginConfig with the 1.x defaults; unknown fields raise."""

from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, Any] = {
    "dtype": "float16",
    "bert_attention_plugin": "auto",
    "gpt_attention_plugin": "auto",
    "gemm_plugin": None,
    "nccl_plugin": "auto",
    "context_fmha": True,
    "context_fmha_fp32_acc": False,
    "paged_kv_cache": None,
    "remove_input_padding": True,
    "tokens_per_block": 32,
    "use_paged_context_fmha": True,
    "use_fp8_context_fmha": False,
    "multiple_profiles": False,
    "paged_state": True,
    "streamingllm": False,
    "use_fused_mlp": True,
}
GEMM_CHOICES = (None, "auto", "float16", "bfloat16", "float32", "fp8")


class PluginConfig:
    def __init__(self) -> None:
        for key, value in DEFAULTS.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        if key not in DEFAULTS:
            raise AttributeError(f"PluginConfig has no field {key!r}")
        if key == "gemm_plugin" and value not in GEMM_CHOICES:
            raise ValueError(f"gemm_plugin must be one of {GEMM_CHOICES}, got {value!r}")
        if key == "tokens_per_block" and (not isinstance(value, int) or value & (value - 1)):
            raise ValueError(f"tokens_per_block must be a power of two, got {value!r}")
        object.__setattr__(self, key, value)

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in DEFAULTS}
