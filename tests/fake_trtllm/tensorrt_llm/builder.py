"""Fake of tensorrt_llm.builder: BuildConfig, build() and Engine.save(), with the documented adjustments."""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

from tensorrt_llm._record import record
from tensorrt_llm.bindings import KVCacheType
from tensorrt_llm.plugin import PluginConfig

FIELDS: dict[str, Any] = {
    "max_input_len": 1024, "max_seq_len": None, "opt_batch_size": 8, "max_batch_size": 2048,
    "max_beam_width": 1, "max_num_tokens": 8192, "opt_num_tokens": None, "max_prompt_embedding_table_size": 0,
    "kv_cache_type": None, "gather_context_logits": False, "gather_generation_logits": False,
    "strongly_typed": True, "use_refit": False, "weight_sparsity": False, "weight_streaming": False,
}


class BuildConfig:
    def __init__(self, plugin_config: PluginConfig | None = None, **values: Any) -> None:
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise TypeError(f"BuildConfig got unexpected keyword arguments {unknown}")
        if values.get("kv_cache_type") is not None and not isinstance(values["kv_cache_type"], KVCacheType):
            raise TypeError(f"kv_cache_type must be a KVCacheType, got {values['kv_cache_type']!r}")
        for key, default in FIELDS.items():
            setattr(self, key, values.get(key, default))
        self.plugin_config = plugin_config or PluginConfig()

    def to_dict(self) -> dict[str, Any]:
        out = {key: getattr(self, key) for key in FIELDS}
        out["kv_cache_type"] = self.kv_cache_type.name if self.kv_cache_type is not None else None
        out["plugin_config"] = self.plugin_config.to_dict()
        return out


def _rope_factor(scaling: dict[str, Any] | None) -> float:
    if not scaling or scaling.get("rope_type", scaling.get("type")) in ("su", "longrope", "llama3"):
        return 1.0
    return float(scaling.get("factor", 1.0))


def _bounds(cfg: BuildConfig, model_config: dict[str, Any]) -> None:
    if cfg.max_seq_len is None:
        cfg.max_seq_len = math.ceil(model_config["max_position_embeddings"]
                                    * _rope_factor(model_config.get("rotary_scaling")))
    cfg.max_input_len = min(cfg.max_input_len, cfg.max_seq_len)
    plugin = cfg.plugin_config
    cfg.max_num_tokens = max(min(cfg.max_num_tokens, cfg.max_seq_len * cfg.max_batch_size), plugin.tokens_per_block)
    if plugin.multiple_profiles:
        cfg.opt_num_tokens = None
    elif cfg.opt_num_tokens is None:
        cfg.opt_num_tokens = min(cfg.max_batch_size * cfg.max_beam_width, cfg.max_num_tokens)


def _paged_context_fmha(cfg: BuildConfig, quant: dict[str, Any]) -> None:
    plugin, kv = cfg.plugin_config, quant.get("kv_cache_quant_algo")
    if (not plugin.context_fmha or plugin.streamingllm or kv == "INT8"
            or (kv == "FP8" and quant.get("quant_algo") != "FP8")):
        plugin.use_paged_context_fmha = False


def build(model: Any, build_config: BuildConfig) -> "Engine":
    record("build", rank=model.config["mapping"]["rank"], model_class=type(model).__name__,
           architecture=model.config["architecture"], dtype=model.config["dtype"],
           build_config={k: v for k, v in build_config.to_dict().items() if k != "plugin_config"},
           plugin_config=build_config.plugin_config.to_dict())
    cfg = copy.deepcopy(build_config)
    cfg.plugin_config.dtype = model.config["dtype"]
    # BuildConfig.update_kv_cache_type: kv_cache_type and the deprecated paged_kv_cache agree afterwards.
    if cfg.kv_cache_type is None:
        cfg.kv_cache_type = KVCacheType.PAGED if cfg.plugin_config.paged_kv_cache is not False else KVCacheType.CONTINUOUS
    if cfg.plugin_config.paged_kv_cache is None:
        cfg.plugin_config.paged_kv_cache = cfg.kv_cache_type == KVCacheType.PAGED
    _bounds(cfg, model.config)
    _paged_context_fmha(cfg, model.config["quantization"])
    if cfg.plugin_config.gemm_plugin == "auto":
        cfg.plugin_config.gemm_plugin = model.config["dtype"]
    return Engine(copy.deepcopy(model.config), cfg)


class Engine:
    def __init__(self, pretrained_config: dict[str, Any], build_config: BuildConfig) -> None:
        self.pretrained_config, self.build_config = pretrained_config, build_config

    def save(self, engine_dir: str) -> None:
        from tensorrt_llm import __version__

        rank = self.pretrained_config["mapping"]["rank"]
        record("save", rank=rank, engine_dir=engine_dir)
        os.makedirs(engine_dir, exist_ok=True)
        if rank == 0:
            mapping = {k: v for k, v in self.pretrained_config["mapping"].items() if k != "rank"}
            config = {"version": __version__, "pretrained_config": {**self.pretrained_config, "mapping": mapping},
                      "build_config": self.build_config.to_dict()}
            with open(os.path.join(engine_dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=4)
        with open(os.path.join(engine_dir, f"rank{rank}.engine"), "wb") as f:
            f.write(f"FAKE TensorRT engine, rank {rank}\n".encode())
