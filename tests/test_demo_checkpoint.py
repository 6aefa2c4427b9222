"""The demo checkpoint is a real HF checkpoint: transformers loads it offline and it is deterministic."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from trtprompt.checkpoint_maker import DemoSpec, corpus_files, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Héllo wörld, 世界! 🚀 def f(x): return x**2  \n\tÇa va? こんにちは 👨‍👩‍👧"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corpus_is_multilingual_utf8() -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in corpus_files())
    assert len(text.encode("utf-8")) > 20_000
    for needle in ("é", "ß", "北京", "こんにちは", "안녕하세요", "🚀", "def ", "Москва"):
        assert needle in text, needle


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_loads_with_transformers_offline(tiny_checkpoint_factory, arch: str) -> None:
    path = tiny_checkpoint_factory(arch)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = model.config
    assert type(model).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    assert cfg.vocab_size == len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 3, 4, 2)
    assert cfg.initializer_range == 0.3
    assert not (path / "pytorch_model.bin").exists() and (path / "model.safetensors").exists()
    # AutoTokenizer (which may rebuild the pipeline per model type) agrees with tokenizer.json.
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok(TEXT).input_ids == raw.encode(TEXT).ids
    assert tok.decode(tok(TEXT).input_ids, skip_special_tokens=True) == TEXT
    assert tok(TEXT).input_ids[0] == tok.bos_token_id
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x too


def test_arch_specific_shapes(tiny_checkpoint_factory) -> None:
    q2 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint_factory("qwen2"), local_files_only=True)
    bias = q2.model.layers[0].self_attn.q_proj.bias
    assert bias is not None and bias.abs().sum() > 0
    assert q2.config.tie_word_embeddings
    q3 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint_factory("qwen3"), local_files_only=True)
    assert q3.config.head_dim == 32 != q3.config.hidden_size // q3.config.num_attention_heads
    assert q3.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert hasattr(q3.model.layers[0].self_attn, "q_norm")
    llama = AutoModelForCausalLM.from_pretrained(tiny_checkpoint_factory("llama"), local_files_only=True)
    assert not llama.config.tie_word_embeddings
    norm = llama.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, torch.ones_like(norm))


def test_llama3_rope_variant(tiny_checkpoint_factory) -> None:
    cfg = json.loads((tiny_checkpoint_factory("llama", rope="llama3") / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["rope_parameters"]["factor"] == 8.0


def test_chat_template_and_eos(tiny_checkpoint_factory) -> None:
    path = tiny_checkpoint_factory("llama")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi 👋<|end|>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1
    assert ids[1] == tok.convert_tokens_to_ids("<|system|>")
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


def test_deterministic_for_seed(tiny_checkpoint_factory, tmp_path: Path) -> None:
    from trtprompt.checkpoint_maker import make_demo_checkpoint

    again = make_demo_checkpoint(tmp_path / "again", DemoSpec(arch="llama", seed=0))
    first = tiny_checkpoint_factory("llama", seed=0)
    other = tiny_checkpoint_factory("llama", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(first / name) == _sha(again / name)
    assert _sha(first / "model.safetensors") != _sha(other / "model.safetensors")
    assert train_tokenizer(512).to_str() == train_tokenizer(512).to_str()


def test_greedy_tokens_vary(tiny_checkpoint_factory) -> None:
    path = tiny_checkpoint_factory("llama")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ids = torch.tensor([list(range(5, 25))])
    out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, 20:].tolist()
    assert len(set(out)) > 4


def _script_main():
    spec = importlib.util.spec_from_file_location("make_demo_checkpoint", ROOT / "scripts/make_demo_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_script_cli(tmp_path: Path) -> None:
    main = _script_main()
    out = tmp_path / "ck"
    res = CliRunner().invoke(main, [str(out), "--arch", "qwen3", "--seed", "3", "--no-tie", "--vocab-size", "600"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["vocab_size"] == 600 and cfg["tie_word_embeddings"] is False
    bad = CliRunner().invoke(main, [str(tmp_path / "x"), "--arch", "qwen2", "--rope", "llama3"])
    assert bad.exit_code != 0 and "rope 'llama3' is only made for arch 'llama'" in bad.output
    assert not (tmp_path / "x").exists()


def test_peer_size_is_the_vllm_side_by_side_shape() -> None:
    from trtprompt.checkpoint_maker import SPECIAL_TOKENS, model_config

    spec = DemoSpec(size="peer")
    assert spec.target_vocab_size == 4000 and not spec.tied
    cfg = model_config(spec, spec.target_vocab_size, {t: i for i, t in enumerate(SPECIAL_TOKENS)})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (512, 8, 8, 4, 1376, 4000)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # Embeddings + lm_head 2 x 4000 x 512, 8 layers of attention (512 x 1536) and MLP (3 x 512 x 1376), norms.
    assert sum(p.numel() for p in model.parameters()) == 27_304_448
