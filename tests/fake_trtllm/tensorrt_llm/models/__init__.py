"""Fake of tensorrt_llm.models: LLaMAForCausalLM and QWenForCausalLM (convert / quantize / load)."""

from __future__ import annotations

import json
import os
from typing import Any

from tensorrt_llm._record import record
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.models.modeling_utils import QuantConfig

HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "max_position_embeddings", "hidden_act")
DTYPES = ("float32", "float16", "bfloat16")


def _read(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


class _DecoderForCausalLM:
    ARCHITECTURES: tuple[str, ...] = ()

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @classmethod
    def _config(cls, hf_dir: str, dtype: str, mapping: Mapping, quant: QuantConfig | None) -> dict[str, Any]:
        hf = _read(hf_dir)
        arch = hf["architectures"][0]
        if arch not in cls.ARCHITECTURES:
            raise ValueError(f"{cls.__name__} cannot convert {arch}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        quantization = quant.to_dict() if quant else {"quant_algo": None, "kv_cache_quant_algo": None}
        forced_kv = os.environ.get("FAKE_TRTLLM_KV_CACHE_QUANT_ALGO")
        if forced_kv:
            quantization["kv_cache_quant_algo"] = forced_kv
        rope = hf.get("rope_parameters") or {}
        heads = hf["num_attention_heads"]
        return {"architecture": arch, "dtype": dtype, **{k: hf.get(k) for k in HF_KEYS},
                "head_size": hf.get("head_dim") or hf["hidden_size"] // heads,
                "norm_epsilon": hf.get("rms_norm_eps", 1e-6), "position_embedding_type": "rope_gpt_neox",
                "rotary_base": hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
                "rotary_scaling": hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                                             else None),
                "qk_layernorm": arch == "Qwen3ForCausalLM",
                "mapping": {**mapping.to_dict(), "rank": mapping.rank}, "quantization": quantization}

    @classmethod
    def from_hugging_face(cls, hf_model_or_dir: str, dtype: str = "auto", mapping: Mapping | None = None,
                          quant_config: QuantConfig | None = None, **kwargs: Any) -> "_DecoderForCausalLM":
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        if quant_config is not None and quant_config.requires_modelopt_quantization:
            raise ValueError(f"{quant_config.quant_algo} needs ModelOpt calibration: use quantize()")
        mapping = mapping or Mapping()
        record("from_hugging_face", model_class=cls.__name__, hf_dir=hf_model_or_dir, dtype=dtype,
               mapping={**mapping.to_dict(), "rank": mapping.rank},
               quant_config=quant_config.to_dict() if quant_config else None)
        return cls(cls._config(hf_model_or_dir, dtype, mapping, quant_config))

    @classmethod
    def quantize(cls, hf_model_dir: str, output_dir: str, dtype: str = "auto", mapping: Mapping | None = None,
                 quant_config: QuantConfig | None = None, **kwargs: Any) -> None:
        mapping = mapping or Mapping()
        record("quantize", model_class=cls.__name__, hf_dir=hf_model_dir, output_dir=output_dir, dtype=dtype,
               mapping=mapping.to_dict(), quant_config=quant_config.to_dict() if quant_config else None)
        config = cls._config(hf_model_dir, dtype, mapping, quant_config)
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str, rank: int | None = None, **kwargs: Any) -> "_DecoderForCausalLM":
        config = _read(ckpt_dir)
        config["mapping"]["rank"] = rank or 0
        record("from_checkpoint", model_class=cls.__name__, ckpt_dir=ckpt_dir, rank=rank)
        return cls(config)


class LLaMAForCausalLM(_DecoderForCausalLM):
    ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class QWenForCausalLM(_DecoderForCausalLM):
    ARCHITECTURES = ("QWenLMHeadModel", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
