"""SmoothQuant at build (targets/smoothquant.py): factors per formula, smoothing exact in float, factors
recorded in the engine, and what smoothing is for: a smaller W8A8 error where a channel carries outliers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from trtprompt.build import BuildRequest, run_build
from trtprompt.checkpoint import iter_tensors, read_checkpoint
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.quant_w8a8 import BUILD_BITS, reference_w8a8
from trtprompt.targets import smoothquant as sq
from trtprompt.targets.torch_build import quantize_int8

PROMPT = [5, 17, 300, 42, 9, 128, 77, 3, 250, 61, 11, 400]


def _cfg(heads: int, kv_heads: int, head_size: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=heads * head_size,
                       intermediate_size=8, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_size=head_size, max_position_embeddings=64)


def test_factors_follow_the_formula() -> None:
    act = torch.tensor([4.0, 1.0, 0.0, 100.0])
    weight = torch.tensor([1.0, 0.25, 2.0, 0.01])
    s = sq.smoothing_factors(act, weight, 0.5)
    expected = torch.tensor([4.0 ** 0.5 / 1.0, 1.0 / 0.25 ** 0.5, 1e-5 ** 0.5 / 2.0 ** 0.5, 10.0 / 0.1])
    torch.testing.assert_close(s, expected)
    torch.testing.assert_close(sq.smoothing_factors(act, weight, 1.0), act.clamp(min=1e-5))
    torch.testing.assert_close(sq.smoothing_factors(act, weight, 0.0), 1.0 / weight)


def test_gqa_factors_are_shared_by_the_query_heads_of_a_kv_head() -> None:
    """6 query heads over 2 kv heads (groups of 3, as transformers' repeat_kv), head size 2."""
    cfg = _cfg(heads=6, kv_heads=2, head_size=2)
    per_head = torch.arange(12.0)  # query head h holds channels 2h, 2h + 1
    torch.testing.assert_close(sq.per_kv_channel(per_head, cfg), torch.tensor([4.0, 5.0, 10.0, 11.0]))
    expanded = sq.to_query_heads(torch.tensor([1.0, 2.0, 3.0, 4.0]), cfg)
    torch.testing.assert_close(expanded, torch.tensor([1.0, 2.0] * 3 + [3.0, 4.0] * 3))


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in iter_tensors(read_checkpoint(ckpt))}


def _logits(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    model = sq.calibration_model(tensors, cfg)
    caches = allocate_kv_cache(cfg, 1, 32, torch.float32, model.device)
    meta = build_attention_metadata([SeqSlice(0, len(PROMPT), [0])], 32, model.device, backend="reference")
    out: torch.Tensor = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta, caches,
                              torch.arange(len(PROMPT)))
    return out


# Plain, and with q/k/v biases (v's bias takes o_proj's factors). qwen3's q/k norms act after qkv, on no folded
# tensor; its checkpoint would add ~6 s.
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothing_keeps_the_float_model(arch: str, tiny_checkpoint_factory: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint_factory(arch)
    pc = read_checkpoint(ckpt).pretrained_config
    cfg = ModelConfig.from_pretrained_config(pc)
    tensors = _tensors(ckpt)
    smoothed, record = sq.smooth(tensors, pc, 0.5, ckpt / "tokenizer.json", progress=False)
    assert record.sequences == len(sq.CALIBRATION_FILES) and record.tokens > 4 * 100
    for name in ("input_layernorm.weight", "mlp.up_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight"):  # every fold really moved something
        assert not torch.allclose(smoothed[f"model.layers.1.{name}"], tensors[f"model.layers.1.{name}"])
    ref = _logits(tensors, cfg)
    torch.testing.assert_close(_logits(smoothed, cfg), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _outlier_model(tiny_checkpoint_factory: Callable[..., Path]) -> tuple[dict[str, torch.Tensor], ModelConfig,
                                                                             dict[str, torch.Tensor]]:
    ckpt = tiny_checkpoint_factory("llama")
    pc = read_checkpoint(ckpt).pretrained_config
    tensors = _tensors(ckpt)
    # Two channels of every layer's qkv input 40x larger (in its norm), as real models' outlier channels are.
    for i in range(3):
        norm = tensors[f"model.layers.{i}.input_layernorm.weight"].clone()
        norm[[3, 50]] *= 40.0
        tensors[f"model.layers.{i}.input_layernorm.weight"] = norm
    smoothed, _ = sq.smooth(tensors, pc, 0.5, ckpt / "tokenizer.json", progress=False)
    return tensors, ModelConfig.from_pretrained_config(pc), smoothed


def _qkv_error(tensors: dict[str, torch.Tensor], cfg: ModelConfig, x: torch.Tensor) -> float:
    """Relative W8A8 error of layer 0's qkv on its float input x (the norm's output)."""
    p = "model.layers.0."
    w = torch.cat([tensors[f"{p}self_attn.{k}_proj.weight"] for k in "qkv"])
    xs = x * tensors[p + "input_layernorm.weight"]
    q, s = quantize_int8(w, BUILD_BITS.weight_qmax)
    exact = xs @ w.t()
    return float((reference_w8a8(xs, q, s, None, BUILD_BITS) - exact).norm() / exact.norm())


def test_smoothing_lowers_the_w8a8_error_of_outlier_channels(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    tensors, cfg, smoothed = _outlier_model(tiny_checkpoint_factory)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, cfg.hidden_size, generator=gen)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # what an RMSNorm hands its weight
    plain, smooth = _qkv_error(tensors, cfg, x), _qkv_error(smoothed, cfg, x)
    assert smooth < 0.5 * plain, (plain, smooth)


@pytest.fixture(scope="module")
def smoothed_engine(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sq") / "engine"
    path = run_build(BuildRequest(tiny_checkpoint_factory("llama"), out, "cpu-dev",
                                  overrides={"quantization": "int8_w8a8", "smoothquant_alpha": 0.75},
                                  progress=False))
    assert path is not None
    return path


def test_engine_records_how_it_was_smoothed(smoothed_engine: Path) -> None:
    quant = json.loads((smoothed_engine / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant["smoothquant_val"] == 0.75
    assert (quant["weight_bits"], quant["activation_bits"]) == (BUILD_BITS.weight_bits, BUILD_BITS.activation_bits)
    meta = json.loads((smoothed_engine / "trtprompt.json").read_text())
    assert meta["smoothquant"]["alpha"] == 0.75 and meta["profile"]["smoothquant_alpha"] == 0.75
    calib = meta["smoothquant"]["calibration"]
    assert calib["sequences"] == len(sq.CALIBRATION_FILES) and calib["tokens"] > 400
    assert "corpus_en.txt" in calib["source"]
    tensors = load_file(str(smoothed_engine / "rank0.safetensors"))
    assert int(tensors["model.layers.0.mlp.down_proj.weight"].abs().max()) == BUILD_BITS.weight_qmax


def test_other_quantizations_are_not_smoothed(tiny_engine_dir: Path) -> None:
    meta = json.loads((tiny_engine_dir / "trtprompt.json").read_text())
    assert "smoothquant" not in meta
    quant = json.loads((tiny_engine_dir / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant == {"quant_algo": None, "kv_cache_quant_algo": None}


def test_alpha_out_of_bounds_is_refused(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    from trtprompt.errors import ProfileError

    with pytest.raises(ProfileError, match=r"smoothquant_alpha must be a number in \[0, 1\] \(or unset\), got 1.5"):
        run_build(BuildRequest(tiny_checkpoint_factory("llama"), tmp_path / "e", "cpu-dev",
                               overrides={"quantization": "int8_w8a8", "smoothquant_alpha": 1.5}, progress=False))


def test_calibration_is_not_the_held_out_text() -> None:
    held_out = Path("/usr/share/common-licenses/GPL-3")
    text = "".join((sq.DATA_DIR / n).read_text(encoding="utf-8") for n in sq.CALIBRATION_FILES)
    if held_out.is_file():
        assert "GNU" not in text and held_out.read_text(encoding="utf-8")[:2000] not in text
    assert len(text) > 20_000


def test_maxima_skip_each_sequences_first_tokens_when_asked() -> None:
    store: dict[str, torch.Tensor] = {}
    x = torch.tensor([[100.0, -1.0], [2.0, -3.0], [-4.0, 1.0]])
    sq._recorder(store, "down", 1)(x)
    torch.testing.assert_close(store["down"], torch.tensor([4.0, 3.0]))
    sq._recorder(store, "down", 0)(x * 0.5)  # a second sequence: the running max
    torch.testing.assert_close(store["down"], torch.tensor([50.0, 3.0]))


def test_calibration_sees_every_linears_input_and_puts_the_linears_back(
        tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """The model calls its linears' forward directly, so calibration wraps them (no forward hooks) for the
    prefill and restores them after; layer 0's qkv input is its input norm of the embeddings."""
    ckpt = tiny_checkpoint_factory("llama")
    cfg = ModelConfig.from_pretrained_config(read_checkpoint(ckpt).pretrained_config)
    tensors = {k: t.float() for k, t in _tensors(ckpt).items()}
    model = sq.calibration_model(tensors, cfg)
    linears = [(la.attn.qkv, la.attn.o_proj, la.mlp.gate_up, la.mlp.down) for la in model.layers]
    samples: list[dict[str, list[torch.Tensor]]] = [{} for _ in model.layers]
    maxima = sq.collect_input_maxima(model, [PROMPT], progress=False, samples=samples)
    assert [(la.attn.qkv, la.attn.o_proj, la.mlp.gate_up, la.mlp.down) for la in model.layers] == linears
    assert all(set(m) == set(sq.KINDS) and set(s) == set(sq.KINDS) for m, s in zip(maxima, samples))
    emb = tensors["model.embed_tokens.weight"][PROMPT]
    normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) \
        * tensors["model.layers.0.input_layernorm.weight"]
    torch.testing.assert_close(maxima[0]["qkv"], normed.abs().amax(dim=0))


def test_alpha_search_keeps_the_float_model_and_records_its_choices(
        tiny_checkpoint_factory: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint_factory("llama")
    pc = read_checkpoint(ckpt).pretrained_config
    cfg = ModelConfig.from_pretrained_config(pc)
    tensors = _tensors(ckpt)
    smoothed, record = sq.smooth(tensors, pc, None, ckpt / "tokenizer.json", progress=False, bits=BUILD_BITS)
    assert record.alpha is None and record.per_layer is not None and len(record.per_layer) == cfg.num_hidden_layers
    assert all(a in sq.ALPHA_GRID for row in record.per_layer for a in row)
    searched = record.to_json()["searched"]
    assert searched["per_layer"][0].keys() == set(sq.KINDS) and record.config_entries() == {}
    ref = _logits(tensors, cfg)
    torch.testing.assert_close(_logits(smoothed, cfg), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
