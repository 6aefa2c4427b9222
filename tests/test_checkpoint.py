"""Reading HF checkpoints: config mapping to pretrained_config, sharding, hashing and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trtprompt.checkpoint import (checkpoint_sha256, expected_weight_shapes, pretrained_config_from_hf,
                                  read_checkpoint, tensor_shapes)
from trtprompt.errors import CheckpointError

OLD_STYLE = {  # transformers 4.x layout: rope_scaling + top-level rope_theta, no head_dim
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "rope_scaling": {"type": "linear", "factor": 2.0},
}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_old_style_config_mapping() -> None:
    pc = pretrained_config_from_hf(OLD_STYLE, {}, "LlamaForCausalLM")
    assert pc["head_size"] == 32 and pc["rotary_base"] == 500000.0 and pc["norm_epsilon"] == 1e-5
    assert pc["rotary_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert pc["eos_token_id"] == [2] and pc["num_key_value_heads"] == 2
    assert not pc["tie_word_embeddings"] and not pc["attn_bias"] and not pc["qk_layernorm"]
    gen = pretrained_config_from_hf(OLD_STYLE, {"eos_token_id": [2, 7]}, "LlamaForCausalLM")
    assert gen["eos_token_id"] == [2, 7]  # generation_config.json wins


def test_new_style_rope_parameters() -> None:
    cfg = {**OLD_STYLE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}}
    del cfg["rope_scaling"], cfg["rope_theta"]
    pc = pretrained_config_from_hf(cfg, {}, "LlamaForCausalLM")
    assert pc["rotary_base"] == 10000.0 and pc["rotary_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    plain = pretrained_config_from_hf({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                                      {}, "LlamaForCausalLM")
    assert plain["rotary_scaling"] is None and plain["rotary_base"] == 1e6


@pytest.mark.parametrize("arch, head, bias, qk, tie", [
    ("llama", 16, False, False, False), ("mistral", 16, False, False, False),
    ("qwen2", 16, True, False, True), ("qwen3", 32, False, True, True),
])
def test_demo_checkpoints_read(tiny_checkpoint_factory, arch: str, head: int, bias: bool, qk: bool,
                               tie: bool) -> None:
    ckpt = read_checkpoint(tiny_checkpoint_factory(arch))
    pc = ckpt.pretrained_config
    assert (pc["head_size"], pc["attn_bias"], pc["qk_layernorm"], pc["tie_word_embeddings"]) == (head, bias, qk, tie)
    assert pc["eos_token_id"] == [1, 3] and ckpt.source_dtype == "float32"
    assert expected_weight_shapes(pc) == tensor_shapes(ckpt)
    assert {p.name for p in ckpt.tokenizer_files} >= {"tokenizer.json", "tokenizer_config.json"}


def test_sharded_checkpoint(tiny_checkpoint_factory, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint_factory("llama")
    dst = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, max_shard_size="300KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    ckpt = read_checkpoint(dst)
    assert len(ckpt.weight_files) > 1 and (dst / "model.safetensors.index.json").is_file()
    assert tensor_shapes(ckpt) == tensor_shapes(read_checkpoint(src))
    ckpt.weight_files[-1].unlink()
    with pytest.raises(CheckpointError, match="names missing shard"):
        read_checkpoint(dst)


def test_sha256_covers_every_file(tiny_checkpoint_factory, tmp_path: Path) -> None:
    src = tiny_checkpoint_factory("llama")
    copy = _copy(src, tmp_path / "c")
    assert checkpoint_sha256(copy) == checkpoint_sha256(src)
    (copy / ".cache").mkdir()
    (copy / ".cache" / "lock").write_text("x")  # tooling state is not the model
    assert checkpoint_sha256(copy) == checkpoint_sha256(src)
    (copy / "tokenizer_config.json").write_text("{}")
    assert checkpoint_sha256(copy) != checkpoint_sha256(src)


def test_refusals(tiny_checkpoint_factory, tmp_path: Path) -> None:
    src = tiny_checkpoint_factory("llama")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is empty"):
        read_checkpoint(tmp_path / "empty")
    no_cfg = _copy(src, tmp_path / "nocfg")
    (no_cfg / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json: not a Hugging Face checkpoint"):
        read_checkpoint(no_cfg)
    gpt2 = _copy(src, tmp_path / "gpt2")
    _edit_config(gpt2, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match="architecture GPT2LMHeadModel is not supported; supported: "
                                              "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        read_checkpoint(gpt2)
    remote = _copy(src, tmp_path / "remote")
    _edit_config(remote, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(CheckpointError, match="asks for remote code"):
        read_checkpoint(remote)
    pickle_only = _copy(src, tmp_path / "bin")
    (pickle_only / "model.safetensors").rename(pickle_only / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"weights only as pickle files \(.bin/.pt\): refused, safetensors only"):
        read_checkpoint(pickle_only)
    no_tok = _copy(src, tmp_path / "notok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        read_checkpoint(no_tok)
    broken = _copy(src, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"is corrupt \(not valid JSON\)"):
        read_checkpoint(broken)
