"""TensorRT-LLM 1.2.x target: convert, build and save a TensorRT engine through the Python API.

TensorRT-LLM is imported lazily: it is never installed on CPU machines (the
PyPI package is a stub that fetches from NVIDIA's index), so importing this
module costs nothing and a missing TensorRT-LLM gives one clear message.

Per rank r of tp x pp: `<Arch>ForCausalLM.from_hugging_face(hf_dir, dtype,
mapping=Mapping(world_size, rank=r, tp_size, pp_size), quant_config=...)`
(fp8 / int4_awq: `<Arch>ForCausalLM.quantize(...)` once with ModelOpt
calibration, then `from_checkpoint(dir, rank=r)`), then
`tensorrt_llm.build(model, build_config)` and `engine.save(out_dir)`, which
writes config.json (rank 0) and rank<r>.engine. The caller writes into a
hidden directory renamed into place only when everything succeeded
(engine_dir.atomic_engine_dir); the tokenizer and trtprompt.json are added by
build.py. Before that, the engine's own config.json is checked: the builder
may have silently switched off what the profile's runtime policy needs.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from trtprompt.checkpoint import Checkpoint
from trtprompt.errors import TargetUnavailableError
from trtprompt.plan import BuildPlan
from trtprompt.profile import Profile
from trtprompt.targets.trtllm_checks import CONTAINER, PINNED_VERSION, check_built_engine
from trtprompt.targets.trtllm_config import Parallelism, TrtllmBuildArgs, trtllm_build_args

CALIBRATED_CHECKPOINT = ".trtllm-checkpoint"  # inside the hidden build directory, removed after use


def import_tensorrt_llm() -> ModuleType:
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise TargetUnavailableError(
            f"TensorRT-LLM is not installed, so --target trtllm cannot build here ({exc}). "
            f"Build inside the {CONTAINER} container (TensorRT-LLM {PINNED_VERSION}), "
            "build for TensorRT-LLM 1.3+'s LLM API with --trtllm-api llmapi (no TensorRT-LLM needed to build), "
            "or use --target torch.") from exc


def _kv_cache_type(name: str) -> Any:
    """TensorRT-LLM's KVCacheType member; the enum lives in the C++ bindings in 1.x."""
    for module in ("tensorrt_llm.bindings", "tensorrt_llm.llmapi.kv_cache_type"):
        try:
            # Attribute access works for pybind11 enums and Python enums alike.
            return getattr(getattr(importlib.import_module(module), "KVCacheType"), name)
        except (ImportError, AttributeError):
            continue
    raise TargetUnavailableError(f"this TensorRT-LLM has no KVCacheType; use TensorRT-LLM {PINNED_VERSION}")


def make_build_config(trtllm: ModuleType, args: TrtllmBuildArgs) -> Any:
    values = dict(args.build_config)
    values["kv_cache_type"] = _kv_cache_type(str(values["kv_cache_type"]))
    build_config = trtllm.BuildConfig(**values)
    for key, value in args.plugin_config.items():
        if value is not None:  # None: keep TensorRT-LLM's default (e.g. gemm plugin off for float32)
            setattr(build_config.plugin_config, key, value)
    if args.lora_config is not None:  # as trtllm-build does with --lora_plugin
        build_config.lora_config = _lora_config_class()(**args.lora_config)
    return build_config


def _lora_config_class() -> Any:
    """TensorRT-LLM's LoraConfig: tensorrt_llm.lora_helper in 1.1+, tensorrt_llm.lora_manager before."""
    for module in ("tensorrt_llm.lora_helper", "tensorrt_llm.lora_manager"):
        try:
            return getattr(importlib.import_module(module), "LoraConfig")
        except (ImportError, AttributeError):
            continue
    raise TargetUnavailableError(f"this TensorRT-LLM has no LoraConfig; use TensorRT-LLM {PINNED_VERSION}")


def make_quant_config(args: TrtllmBuildArgs) -> Any:
    if args.quant_config is None:
        return None
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    values = dict(args.quant_config)
    values["quant_algo"] = QuantAlgo(values["quant_algo"])
    if values.get("kv_cache_quant_algo") is not None:
        values["kv_cache_quant_algo"] = QuantAlgo(values["kv_cache_quant_algo"])
    return QuantConfig(**values)


def model_class(args: TrtllmBuildArgs) -> Any:
    models = importlib.import_module("tensorrt_llm.models")
    return getattr(models, args.model_class)


def load_rank(trtllm: ModuleType, args: TrtllmBuildArgs, hf_dir: Path, rank: int,
              calibrated: Path | None) -> Any:
    cls = model_class(args)
    if calibrated is not None:
        return cls.from_checkpoint(str(calibrated), rank=rank)
    return cls.from_hugging_face(str(hf_dir), dtype=args.dtype, mapping=trtllm.Mapping(**args.mapping_for_rank(rank)),
                                 quant_config=make_quant_config(args))


def calibrate(trtllm: ModuleType, args: TrtllmBuildArgs, hf_dir: Path, out: Path) -> Path:
    """fp8 / int4_awq: ModelOpt calibration writes a TensorRT-LLM checkpoint for all ranks."""
    model_class(args).quantize(str(hf_dir), str(out), dtype=args.dtype,
                               mapping=trtllm.Mapping(**args.mapping_for_rank(0)),
                               quant_config=make_quant_config(args))
    return out


def build_trtllm_engine(out_dir: Path, ckpt: Checkpoint, profile: Profile, plan: BuildPlan,
                        parallel: Parallelism = Parallelism()) -> Path:
    """Build every rank's engine into out_dir and check the result; returns out_dir."""
    trtllm = import_tensorrt_llm()
    args = trtllm_build_args(plan, ckpt.architecture, parallel)
    build_config = make_build_config(trtllm, args)
    scratch = out_dir / CALIBRATED_CHECKPOINT
    try:
        calibrated = calibrate(trtllm, args, ckpt.path, scratch) if args.needs_calibration else None
        for rank in range(args.world_size):
            model = load_rank(trtllm, args, ckpt.path, rank, calibrated)
            trtllm.build(model, build_config).save(str(out_dir))
            del model  # one rank's weights in memory at a time
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    check_built_engine(out_dir, profile.section("runtime"))
    return out_dir
