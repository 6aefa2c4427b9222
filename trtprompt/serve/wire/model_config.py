"""A model's config.pbtxt read with Triton's ModelConfig schema.

The launcher writes the repository and checks each file with it; the engine process reads its
runtime settings from `tensorrt_llm/config.pbtxt` with it, as the TensorRT-LLM backend reads its
own, so what the repository says is what runs.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc


def check_config_text(text: str) -> mc.ModelConfig:
    """Parse a config.pbtxt with Triton's ModelConfig schema (raises on any error)."""
    if "${" in text:
        raise ValueError("config.pbtxt holds an unfilled ${...} placeholder")
    return text_format.Parse(text, mc.ModelConfig())


def read_parameters(config_path: str | Path) -> dict[str, str]:
    """A model's parameters from its config.pbtxt (what the engine process reads)."""
    cfg = check_config_text(Path(config_path).read_text(encoding="utf-8"))
    return {k: v.string_value for k, v in cfg.parameters.items()}
