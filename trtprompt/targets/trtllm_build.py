"""TensorRT-LLM 1.2.x target. TensorRT-LLM is imported lazily: it is never installed on CPU
machines (the PyPI package is a stub that fetches from NVIDIA's index).

The real build (<Arch>ForCausalLM.from_hugging_face -> tensorrt_llm.build -> engine.save)
lands with a later issue; until then this target stops with a clear message.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from trtprompt.errors import TargetUnavailableError

CONTAINER = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
PINNED_VERSION = "1.2.1"


def import_tensorrt_llm() -> ModuleType:
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise TargetUnavailableError(
            f"TensorRT-LLM is not installed, so --target trtllm cannot build here ({exc}). "
            f"Build inside the {CONTAINER} container (TensorRT-LLM {PINNED_VERSION}), "
            "or use --target torch.") from exc


def build_trtllm_engine(out_dir: Path, *args: Any, **kwargs: Any) -> None:
    trtllm = import_tensorrt_llm()
    version = getattr(trtllm, "__version__", "unknown")
    raise TargetUnavailableError(
        f"TensorRT-LLM {version} is importable, but the trtllm build of this trtprompt version is not "
        "implemented yet; use --target torch.")
