"""Torch target: convert a checkpoint's weights into rank0.safetensors in the engine dtype.

Weights keep their Hugging Face names. With int8 weight-only quantization
(quant_algo "W8A16") or W8A8 (int8_w8a8: the same weights; the engine quantizes
activations per token at run time, docs/quantization.md) each linear inside the
layers becomes int8 [out, in] plus `<name>_scale` float32 [out], symmetric per
output channel; embeddings, norms and lm_head stay in the engine dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from trtprompt.checkpoint import Checkpoint, expected_weight_shapes, is_layer_linear, iter_tensors
from trtprompt.errors import CheckpointError
from trtprompt.plan import INT8_WEIGHT_QUANTIZATIONS

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
WEIGHTS_FILE = "rank0.safetensors"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~= q * scale[:, None], |error| <= scale / 2 per row."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _ignorable(name: str, pc: Mapping[str, Any]) -> bool:
    # Tied checkpoints sometimes store lm_head anyway; rotary tables are recomputed.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and pc["tie_word_embeddings"])


def _convert_one(name: str, tensor: torch.Tensor, dtype: torch.dtype,
                 quantize: bool) -> dict[str, torch.Tensor]:
    if quantize and is_layer_linear(name):
        q, scale = quantize_int8(tensor)
        return {name: q, f"{name}_scale": scale}
    return {name: tensor.to(dtype).contiguous()}


def convert_weights(ckpt: Checkpoint, pc: Mapping[str, Any], dtype: str, quantization: str,
                    progress: bool = True) -> dict[str, torch.Tensor]:
    """Every expected tensor, shape-checked and cast; unknown tensors are an error, not dropped."""
    expected = expected_weight_shapes(pc)
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(expected), desc="converting weights", unit="tensor", disable=not progress)
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
            out.update(_convert_one(name, tensor, TORCH_DTYPES[dtype], quantization in INT8_WEIGHT_QUANTIZATIONS))
            bar.update(1)
    missing = [n for n in expected if n not in out]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{ckpt.path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    return out


def write_weights(out_dir: Path, ckpt: Checkpoint, pc: Mapping[str, Any], dtype: str,
                  quantization: str, progress: bool = True) -> Path:
    tensors = convert_weights(ckpt, pc, dtype, quantization, progress)
    path = out_dir / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt", "dtype": dtype, "quantization": quantization})
    return path
