"""TensorRT-LLM's request LoRA tensors (Triton `lora_weights` / `lora_config`) to and from an adapter.

The layout (docs/lora.md, "TensorRT-LLM's lora_weights"): `lora_config` is int32 [N, 3], one row per
(module, layer) of the adapter holding [module_id, layer_idx, adapter_size]; row i of `lora_weights`
[N, W] holds that module's A [adapter_size, in] flattened, then its B [out, adapter_size] flattened and
already multiplied by the adapter's scaling (alpha / r, or alpha / sqrt(r) with rslora), then zeros up to W.
A and B are PEFT's lora_A / lora_B as they are (neither is transposed), so an adapter converts both ways
without loss: B's scaling is applied once, here it is 1.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.lora.adapter import LoraAdapter, LoraError, build_adapter
from trtprompt.engine.lora.modules import MODULES, TRTLLM_NAMES, module_shapes

WEIGHTS_INPUT, CONFIG_INPUT = "lora_weights", "lora_config"
# TensorRT-LLM's LoraModule::ModuleType ids of the modules this engine serves; 0 is attn_qkv, one adapter
# for the fused q/k/v linear (its B spans q, k and v's outputs, its A is shared).
MODULE_IDS: Mapping[str, int] = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4,
                                 "mlp_h_to_4h": 5, "mlp_4h_to_h": 6, "mlp_gate": 7}
FUSED_QKV = "attn_qkv"
HF_OF_TRTLLM: Mapping[str, str] = {trt: hf for hf, trt in TRTLLM_NAMES.items()}
CONFIG_COLUMNS = 3  # TensorRT-LLM's DoRA layout adds a fourth, is_dora: accepted when 0


def _module_path(layer: int, module: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{block}.{module}"


def _key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.{_module_path(layer, module)}.lora_{which}.weight"


def _as_2d(name: str, value: Any, what: str) -> np.ndarray[Any, Any]:
    """A request tensor as [rows, columns]; TensorRT-LLM's converter saves them with a leading 1."""
    arr = value.detach().cpu().float().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise LoraError(f"adapter {name!r}: input '{what}' must have shape [num_modules_layers, ...] with at least "
                        f"one row, got {tuple(arr.shape)}")
    return arr


def _rows(name: str, config: Any, weights: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    cfg, w = _as_2d(name, config, CONFIG_INPUT), _as_2d(name, weights, WEIGHTS_INPUT)
    if cfg.shape[1] not in (CONFIG_COLUMNS, CONFIG_COLUMNS + 1):
        raise LoraError(f"adapter {name!r}: input '{CONFIG_INPUT}' rows must be [module_id, layer_idx, adapter_size]"
                        f", got {cfg.shape[1]} columns")
    if cfg.shape[1] > CONFIG_COLUMNS and np.any(cfg[:, CONFIG_COLUMNS] != 0):
        raise LoraError(f"adapter {name!r}: input '{CONFIG_INPUT}' marks a row is_dora: DoRA is not supported")
    if cfg.shape[0] != w.shape[0]:
        raise LoraError(f"adapter {name!r}: inputs '{WEIGHTS_INPUT}' ({w.shape[0]} rows) and '{CONFIG_INPUT}' "
                        f"({cfg.shape[0]} rows) must have one row per module and layer each")
    if not np.issubdtype(w.dtype, np.floating):
        raise LoraError(f"adapter {name!r}: input '{WEIGHTS_INPUT}' must be floating point, got {w.dtype}")
    return cfg.astype(np.int64), w.astype(np.float32)


def _row_modules(name: str, i: int, module_id: int) -> tuple[str, ...]:
    """The Hugging Face modules a config row's module id covers (three for attn_qkv)."""
    trt = next((t for t, m in MODULE_IDS.items() if m == module_id), None)
    if trt is None:
        served = ", ".join(f"{m} ({t})" for t, m in MODULE_IDS.items())
        raise LoraError(f"adapter {name!r}: input '{CONFIG_INPUT}' row {i} has module_id {module_id}, not one this "
                        f"engine serves ({served})")
    return ("q_proj", "k_proj", "v_proj") if trt == FUSED_QKV else (HF_OF_TRTLLM[trt],)


def _split_row(name: str, i: int, row: np.ndarray[Any, Any], rank: int, dims: tuple[int, int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, in] and B [out, rank] of one lora_weights row (the rest of the row is padding)."""
    size_in, size_out = rank * dims[0], rank * dims[1]
    if row.shape[0] < size_in + size_out:
        raise LoraError(f"adapter {name!r}: input '{WEIGHTS_INPUT}' row {i} has {row.shape[0]} values; adapter_size "
                        f"{rank} needs {size_in + size_out} ({rank} x {dims[0]} in + {dims[1]} x {rank} out)")
    a = torch.from_numpy(np.ascontiguousarray(row[:size_in])).reshape(rank, dims[0])
    b = torch.from_numpy(np.ascontiguousarray(row[size_in:size_in + size_out])).reshape(dims[1], rank)
    return a, b


def _check_row(name: str, i: int, layer: int, rank: int, cfg: ModelConfig, max_lora_rank: int) -> None:
    if not 0 <= layer < cfg.num_hidden_layers:
        raise LoraError(f"adapter {name!r}: input '{CONFIG_INPUT}' row {i} has layer_idx {layer}, outside "
                        f"[0, {cfg.num_hidden_layers}) (the base model's layers)")
    if not 0 < rank <= max_lora_rank:
        raise LoraError(f"adapter {name!r}: input '{CONFIG_INPUT}' row {i} has adapter_size {rank}, outside "
                        f"[1, {max_lora_rank}] (max_lora_rank)")


def from_trtllm(name: str, weights: np.ndarray[Any, Any] | torch.Tensor, config: np.ndarray[Any, Any],
                cfg: ModelConfig, max_lora_rank: int) -> LoraAdapter:
    """The adapter `name` of TensorRT-LLM's request tensors, checked by build_adapter as a PEFT adapter is;
    every refusal names the input and the row."""
    rows, w = _rows(name, config, weights)
    shapes = module_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for i, (module_id, layer, rank) in enumerate(rows[:, :CONFIG_COLUMNS].tolist()):
        _check_row(name, i, layer, rank, cfg, max_lora_rank)
        modules = _row_modules(name, i, module_id)
        dims_in = shapes[modules[0]].in_features
        dims_out = sum(shapes[m].out_features for m in modules)
        a, b = _split_row(name, i, w[i], rank, (dims_in, dims_out))
        start = 0
        for module in modules:
            if _key(layer, module, "A") in tensors:
                raise LoraError(f"adapter {name!r}: input '{CONFIG_INPUT}' row {i} repeats layer {layer} "
                                f"{TRTLLM_NAMES[module]} (each module and layer once)")
            out = shapes[module].out_features
            tensors[_key(layer, module, "A")] = a
            tensors[_key(layer, module, "B")] = b[start:start + out]
            ranks[_module_path(layer, module)] = rank
            start += out
    return build_adapter(name, _unit_scaling(ranks), tensors, cfg, max_lora_rank)


def _unit_scaling(ranks: Mapping[str, int]) -> dict[str, Any]:
    """A PEFT config whose scaling is 1 for every module (lora_alpha = r): B came scaled already."""
    first = next(iter(ranks.values()))
    if all(r == first for r in ranks.values()):
        return {"r": first, "lora_alpha": first}
    # Anchored module paths: PEFT's pattern rule matches a key that ends the path.
    pattern = {path.replace(".", r"\."): r for path, r in ranks.items()}
    return {"r": first, "lora_alpha": first, "rank_pattern": pattern, "alpha_pattern": pattern}


def to_trtllm(adapter: LoraAdapter, dtype: Any = np.float32) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(lora_weights [N, W] of `dtype`, lora_config int32 [N, 3]) of an adapter, one row per (layer, module)
    in layer then MODULES order, each row zero-padded to the longest."""
    order = {m: k for k, m in enumerate(MODULES)}
    keys = sorted(adapter.pairs, key=lambda k: (k[0], order[k[1]]))
    flat = [torch.cat([adapter.pairs[k].a.reshape(-1), adapter.pairs[k].b.reshape(-1)]).numpy() for k in keys]
    width = max(len(f) for f in flat)
    weights = np.zeros((len(flat), width), dtype=np.float32)
    for i, f in enumerate(flat):
        weights[i, :len(f)] = f
    config = np.array([[MODULE_IDS[TRTLLM_NAMES[m]], layer, adapter.pairs[(layer, m)].rank] for layer, m in keys],
                      dtype=np.int32)
    return weights.astype(dtype), config
