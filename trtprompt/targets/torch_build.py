"""Torch target: convert a checkpoint's weights into rank0.safetensors in the engine dtype.

Weights keep their Hugging Face names. With int8 weight-only quantization
(quant_algo "W8A16") or W8A8 (int8_w8a8: the same weights; the engine quantizes
activations per token at run time, docs/quantization.md) each linear inside the
layers becomes int8 [out, in] plus `<name>_scale` float32 [out], symmetric per
output channel; embeddings, norms and lm_head stay in the engine dtype. int8_w8a8 smooths the
float weights first (targets/smoothquant.py) and writes weights of quant_w8a8.BUILD_BITS' width.
int4_wo (quant_algo "W4A16" + group_size) writes each layer linear as packed int4 uint8 [out, in / 2]
plus `<name>_scale` float32 [out, in / group, 2], (scale, minimum) per group (engine/quant_int4.py has the
layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from trtprompt.checkpoint import Checkpoint, expected_weight_shapes, is_layer_linear, iter_tensors
from trtprompt.engine.quant_int4 import quantize_int4
from trtprompt.engine.quant_w8a8 import BUILD_BITS, WEIGHT_QMAX, quantize_int8, quantize_int8_groups
from trtprompt.errors import CheckpointError
from trtprompt.plan import INT4_WEIGHT_QUANTIZATIONS, INT8_WEIGHT_QUANTIZATIONS
from trtprompt.targets.smoothquant import SmoothQuantRecord, smooth

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
WEIGHTS_FILE = "rank0.safetensors"
# A layer linear's float weight [out, in] -> (quantized weight, its `<name>_scale`).
Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _ignorable(name: str, pc: Mapping[str, Any]) -> bool:
    # Tied checkpoints sometimes store lm_head anyway; rotary tables are recomputed.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and pc["tie_word_embeddings"])


def _convert_one(name: str, tensor: torch.Tensor, dtype: torch.dtype,
                 quantize: Quantizer | None) -> dict[str, torch.Tensor]:
    """quantize: what layer linears become (None: not quantized)."""
    if quantize is not None and is_layer_linear(name):
        q, scale = quantize(tensor)
        return {name: q, f"{name}_scale": scale}
    return {name: tensor.to(dtype).contiguous()}


def _quantizer(quantization: str, group_size: int | None) -> Quantizer | None:
    """group_size: int4_wo's int4_group_size, or int8_wo's int8_group_size (None: int8 scales per row)."""
    if quantization in INT4_WEIGHT_QUANTIZATIONS:
        if group_size is None:
            raise ValueError(f"quantization {quantization} needs int4_group_size")
        group = group_size
        return lambda w: quantize_int4(w, group)
    if quantization == "int8_wo" and group_size is not None:
        int8_group = group_size
        return lambda w: quantize_int8_groups(w, int8_group)
    qmax = _weight_qmax(quantization)
    return None if qmax is None else lambda w: quantize_int8(w, qmax)


def check_groups(ckpt: Checkpoint, pc: Mapping[str, Any], group: int, knob: str) -> None:
    """Refuse, before reading any weight, a layer linear whose input columns the group (the value of `knob`) does
    not divide."""
    for name, shape in expected_weight_shapes(pc).items():
        if is_layer_linear(name) and shape[1] % group:
            raise CheckpointError(f"{ckpt.path}: tensor {name!r} has in_features {shape[1]}, which {knob} "
                                  f"{group} does not divide; choose an {knob} that divides every layer "
                                  "linear's input columns")


def _weight_qmax(quantization: str) -> int | None:
    if quantization not in INT8_WEIGHT_QUANTIZATIONS:
        return None
    return BUILD_BITS.weight_qmax if quantization == "int8_w8a8" else WEIGHT_QMAX  # int8_wo: always 8 bits


def _tokenizer_json(ckpt: Checkpoint) -> Path:
    found = [p for p in ckpt.tokenizer_files if p.name == "tokenizer.json"]
    if not found:
        raise CheckpointError(f"{ckpt.path}: SmoothQuant calibration (quantization int8_w8a8) encodes its text with "
                              "tokenizer.json, which this checkpoint lacks; build with --quantization int8_wo")
    return found[0]


def convert_weights(ckpt: Checkpoint, pc: Mapping[str, Any], dtype: str, quantization: str,
                    progress: bool = True, smoothquant_alpha: float | None = None,
                    group_size: int | None = None,
                    quantize_lm_head: bool = False) -> tuple[dict[str, torch.Tensor], SmoothQuantRecord | None]:
    """Every expected tensor, shape-checked and cast (unknown tensors are an error, not dropped), and how
    int8_w8a8's weights were smoothed (smoothquant_alpha None: searched per linear; other quantizations: None).
    group_size: int4_wo's or int8_wo's group (the plan's; None for int8 scales per row and the other
    quantizations). quantize_lm_head (int8_wo): lm_head as int8 + `lm_head.weight_scale` too, from the embedding
    where the checkpoint ties them, grouped as the layer linears are."""
    quantize = _quantizer(quantization, group_size)
    if group_size is not None:
        check_groups(ckpt, pc, group_size, "int4_group_size" if quantization in INT4_WEIGHT_QUANTIZATIONS
                     else "int8_group_size")
    tensors = _read_tensors(ckpt, pc, progress)
    record = None
    if quantization == "int8_w8a8":
        tensors, record = smooth(tensors, pc, smoothquant_alpha, _tokenizer_json(ckpt), progress, BUILD_BITS)
    target = TORCH_DTYPES[dtype]
    out: dict[str, torch.Tensor] = {}
    if quantize_lm_head:
        out.update(_quantized_head(tensors, quantization, group_size))
    for name in list(tensors):  # popped as converted: the read copy of each tensor goes as its output comes
        out.update(_convert_one(name, tensors.pop(name), target, quantize))
    return out, record


def _quantized_head(tensors: dict[str, torch.Tensor], quantization: str,
                    group_size: int | None) -> dict[str, torch.Tensor]:
    """lm_head.weight (taken out of tensors; a tied checkpoint's embedding stays) as int8 + its scales, as
    int8_wo quantizes a layer linear (the plan allows no other quantization)."""
    quantize = _quantizer(quantization, group_size)
    if quantization != "int8_wo" or quantize is None:
        raise ValueError(f"quantize_lm_head needs quantization int8_wo, got {quantization}")
    head = tensors.pop("lm_head.weight", None)
    q, scale = quantize(tensors["model.embed_tokens.weight"] if head is None else head)
    return {"lm_head.weight": q, "lm_head.weight_scale": scale}


def _read_tensors(ckpt: Checkpoint, pc: Mapping[str, Any], progress: bool) -> dict[str, torch.Tensor]:
    expected = expected_weight_shapes(pc)
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(expected), desc="reading weights", unit="tensor", disable=not progress)
    with bar:
        for name, tensor in iter_tensors(ckpt):
            if name not in expected:
                if _ignorable(name, pc):
                    continue
                raise CheckpointError(f"{ckpt.path}: unexpected tensor {name!r} for "
                                      f"{pc['architecture']} with this config; refusing to drop it")
            if tuple(tensor.shape) != expected[name]:
                raise CheckpointError(f"{ckpt.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {expected[name]}")
            out[name] = tensor
            bar.update(1)
    missing = [n for n in expected if n not in out]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{ckpt.path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    return out


def w8a8_config_entries(record: SmoothQuantRecord | None) -> dict[str, Any]:
    """What an int8_w8a8 engine's pretrained_config.quantization adds: its bit split (the loader checks the
    weights against it) and, when smoothed, TensorRT-LLM's smoothquant_val."""
    return {**BUILD_BITS.to_config(), **(record.config_entries() if record is not None else {})}


def group_config_entries(group: int) -> dict[str, Any]:
    """What an int4_wo engine's (or a grouped int8_wo one's) pretrained_config.quantization adds: TensorRT-LLM's
    group_size."""
    return {"group_size": group}


def write_weights(out_dir: Path, ckpt: Checkpoint, pc: Mapping[str, Any], dtype: str,
                  quantization: str, progress: bool = True, smoothquant_alpha: float | None = None,
                  group_size: int | None = None, quantize_lm_head: bool = False) -> SmoothQuantRecord | None:
    """Write rank0.safetensors; returns how its int8_w8a8 weights were smoothed (None: not smoothed)."""
    tensors, record = convert_weights(ckpt, pc, dtype, quantization, progress, smoothquant_alpha, group_size,
                                      quantize_lm_head)
    save_file(tensors, str(out_dir / WEIGHTS_FILE),
              metadata={"format": "pt", "dtype": dtype, "quantization": quantization})
    return record
