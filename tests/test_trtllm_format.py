"""TensorRT-LLM's lora_weights / lora_config <-> adapters (engine/lora/trtllm_format.py, docs/lora.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from lora_adapters import make_peft_adapter

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.lora.adapter import LoraError, read_peft_dir
from trtprompt.engine.lora.modules import module_shapes
from trtprompt.engine.lora.trtllm_format import MODULE_IDS, from_trtllm, to_trtllm

CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_size=4, max_position_embeddings=64)


def _row(a: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
    flat = np.concatenate([a.reshape(-1), b.reshape(-1)])
    return np.pad(flat, (0, width - flat.size))


def test_a_row_is_a_then_scaled_b_padded() -> None:
    """TensorRT-LLM's layout: A [r, in] flattened, B [out, r] flattened (already scaled), zero padding."""
    rng = np.random.default_rng(0)
    shapes = module_shapes(CFG)
    a_q, b_q = rng.standard_normal((2, 16)), rng.standard_normal((shapes["q_proj"].out_features, 2))
    a_d, b_d = rng.standard_normal((4, 24)), rng.standard_normal((16, 4))
    width = 4 * (24 + 16)
    weights = np.stack([_row(a_q, b_q, width), _row(a_d, b_d, width)]).astype(np.float32)
    config = np.array([[MODULE_IDS["attn_q"], 0, 2], [MODULE_IDS["mlp_4h_to_h"], 1, 4]], dtype=np.int32)
    adapter = from_trtllm("7", weights, config, CFG, max_lora_rank=8)
    assert sorted(adapter.pairs) == [(0, "q_proj"), (1, "down_proj")]
    assert torch.equal(adapter.pairs[(0, "q_proj")].a, torch.from_numpy(a_q.astype(np.float32)))
    assert torch.equal(adapter.pairs[(0, "q_proj")].b, torch.from_numpy(b_q.astype(np.float32)))  # scaling 1
    assert torch.equal(adapter.pairs[(1, "down_proj")].b, torch.from_numpy(b_d.astype(np.float32)))
    assert adapter.rank == 4 and adapter.target_modules == ("q_proj", "down_proj")


def test_fused_qkv_row_splits_b_over_q_k_v() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 16)).astype(np.float32), rng.standard_normal((16 + 8 + 8, 2)).astype(np.float32)
    adapter = from_trtllm("qkv", _row(a, b, 2 * 48)[None], np.array([[0, 1, 2]]), CFG, 8)
    assert torch.equal(adapter.pairs[(1, "k_proj")].b, torch.from_numpy(b[16:24]))
    assert all(torch.equal(adapter.pairs[(1, m)].a, torch.from_numpy(a)) for m in ("q_proj", "k_proj", "v_proj"))


def test_peft_round_trip(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    """A PEFT adapter (two ranks' worth of modules, rslora scaling) -> to_trtllm -> from_trtllm: the same pairs."""
    checkpoint = tiny_checkpoint_factory("llama")
    cfg = _config_of(checkpoint)
    peft = make_peft_adapter(checkpoint, tmp_path / "a", rank=4, modules=("q_proj", "v_proj", "o_proj", "up_proj",
                                                                           "down_proj"), seed=3, rslora=True)
    adapter = read_peft_dir("a", peft, cfg, 64)
    weights, config = to_trtllm(adapter)
    assert config.dtype == np.int32 and config.shape == (len(adapter.pairs), 3)
    back = from_trtllm("a", weights, config, cfg, 64)
    assert sorted(back.pairs) == sorted(adapter.pairs)
    for key, pair in adapter.pairs.items():
        assert torch.equal(back.pairs[key].a, pair.a) and torch.equal(back.pairs[key].b, pair.b), key
    assert back.digest == adapter.digest  # the same KV blocks either way it arrives
    again, config_again = to_trtllm(back)
    assert np.array_equal(again, weights) and np.array_equal(config_again, config)


def test_mixed_ranks_round_trip() -> None:
    rng = np.random.default_rng(2)
    width = 8 * (16 + 16)
    rows = [_row(rng.standard_normal((2, 16)), rng.standard_normal((16, 2)), width),
            _row(rng.standard_normal((8, 16)), rng.standard_normal((16, 8)), width)]
    config = np.array([[1, 0, 2], [1, 1, 8]])
    adapter = from_trtllm("m", np.stack(rows).astype(np.float32), config, CFG, 8)
    assert [adapter.pairs[(k, "q_proj")].rank for k in (0, 1)] == [2, 8]
    weights, back = to_trtllm(adapter)
    assert np.array_equal(back, config) and weights.shape == (2, width)


@pytest.mark.parametrize("config, weights_cols, needle", [
    ([[9, 0, 2]], 64, "input 'lora_config' row 0 has module_id 9"),
    ([[1, 2, 2]], 64, "input 'lora_config' row 0 has layer_idx 2, outside [0, 2)"),
    ([[1, 0, 0]], 64, "input 'lora_config' row 0 has adapter_size 0"),
    ([[1, 0, 16]], 1024, "adapter_size 16, outside [1, 8] (max_lora_rank)"),
    ([[1, 0, 2]], 63, "input 'lora_weights' row 0 has 63 values; adapter_size 2 needs 64"),
    ([[1, 0, 2], [1, 0, 2]], 64, "row 1 repeats layer 0 attn_q"),
    ([[1, 0, 2, 1]], 64, "is_dora: DoRA is not supported"),
])
def test_refusals_name_the_input(config: list[list[int]], weights_cols: int, needle: str) -> None:
    weights = np.zeros((len(config), weights_cols), dtype=np.float32)
    weights[:, 0] = 1.0
    with pytest.raises(LoraError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        from_trtllm("t", weights, np.array(config), CFG, 8)


def test_row_counts_must_agree() -> None:
    with pytest.raises(LoraError, match="'lora_weights' \\(2 rows\\) and 'lora_config' \\(1 rows\\)"):
        from_trtllm("t", np.zeros((2, 64), np.float32), np.array([[1, 0, 2]]), CFG, 8)


def _config_of(checkpoint: Path) -> ModelConfig:
    """The engine's ModelConfig of a Hugging Face checkpoint directory (its config.json)."""
    import json

    raw = json.loads((checkpoint / "config.json").read_text())
    heads = int(raw["num_attention_heads"])
    return ModelConfig(raw["architectures"][0], int(raw["vocab_size"]), int(raw["hidden_size"]),
                       int(raw["intermediate_size"]), int(raw["num_hidden_layers"]), heads,
                       int(raw.get("num_key_value_heads") or heads),
                       int(raw.get("head_dim") or raw["hidden_size"] // heads), int(raw["max_position_embeddings"]))
