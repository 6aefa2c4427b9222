"""W8A8 linears (quantization int8_w8a8): the fbgemm int8 GEMM against the pure-torch reference,
on random shapes and through a built tiny engine (docs/quantization.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtprompt.build import BuildRequest, run_build
from trtprompt.engine import quant_w8a8
from trtprompt.engine.attention import SeqSlice, build_attention_metadata
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.quant_w8a8 import (
    ACT_QMAX,
    FbgemmW8A8Linear,
    ReferenceW8A8Linear,
    fbgemm_unavailable_reason,
    quantize_per_token,
    reference_w8a8,
    resolve_w8a8_backend,
)
from trtprompt.engine.request import SamplingParams
from trtprompt.targets.torch_build import quantize_int8

needs_fbgemm = pytest.mark.skipif(fbgemm_unavailable_reason() is not None,
                                  reason=f"fbgemm int8 GEMM unavailable: {fbgemm_unavailable_reason()}")
PROMPTS = [list(range(5, 45)), list(range(100, 117)), [7, 3, 9, 300, 2, 11] * 5]


def _random_linear(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(torch.randn(n, k, generator=gen) * 0.05)


@needs_fbgemm
@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 64, 48, False), (7, 96, 200, True), (33, 512, 136, False),
                                                    (130, 24, 8, True), (5, 1536, 40, False),
                                                    # SmolLM2's qkv, gate_up and down_proj shapes
                                                    (1, 576, 960, True), (8, 576, 3072, False),
                                                    (32, 1536, 576, False)])
def test_fbgemm_matches_reference(m: int, k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    qweight, scale = _random_linear(gen, n, k)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    x[:, ::7] *= 30.0  # outlier channels: the largest |value| per token sets its scale
    fast = FbgemmW8A8Linear(qweight, scale, b)(x)
    ref = reference_w8a8(x, qweight, scale, b)
    # Same integer sums on both paths; only the fp32 rescale rounds differently.
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@needs_fbgemm
def test_fbgemm_keeps_leading_dims_and_zero_tokens() -> None:
    gen = torch.Generator().manual_seed(1)
    qweight, scale = _random_linear(gen, 16, 32)
    x = torch.randn(2, 3, 32, generator=gen)
    x[1, 2] = 0.0  # an all-zero token quantizes to zeros, not NaN
    y = FbgemmW8A8Linear(qweight, scale, None)(x)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y, ReferenceW8A8Linear(qweight, scale, None)(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1, 2], torch.zeros(16))


def test_per_token_quantization_bounds_and_error() -> None:
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 9)[:, None]
    q, s = quantize_per_token(x)
    assert torch.equal(q, q.round()) and q.abs().max() == ACT_QMAX
    assert torch.equal(q.abs().amax(dim=1), torch.full((9,), float(ACT_QMAX)))  # every token uses the full range
    assert ((q * s - x).abs() <= s / 2 + 1e-6 * x.abs()).all()


def test_reference_against_float_math() -> None:
    """The reference is the dequantized product: (q_x * s_x) @ (q_w * s_w).T."""
    gen = torch.Generator().manual_seed(3)
    qweight, scale = _random_linear(gen, 24, 300)
    x = torch.randn(6, 300, generator=gen)
    q, s = quantize_per_token(x)
    expected = (q.double() * s.double()) @ (qweight.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(reference_w8a8(x, qweight, scale, None).double(), expected, rtol=1e-6, atol=1e-6)


def test_unavailable_kernel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_w8a8, "fbgemm_unavailable_reason", lambda: "torch's quantized engine is 'qnnpack'")
    with pytest.raises(ValueError, match=r"need torch's fbgemm int8 GEMM.*'qnnpack'.*linear_backend='reference'"):
        resolve_w8a8_backend("onednn")
    assert resolve_w8a8_backend("reference") == "reference"


@pytest.fixture(scope="module")
def w8a8_engine_dir(tiny_checkpoint_factory, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w8a8") / "engine"
    path = run_build(BuildRequest(tiny_checkpoint_factory("llama"), out, "cpu-dev",
                                  overrides={"quantization": "int8_w8a8"}, progress=False))
    assert path is not None
    return path


def test_build_writes_int8_weights_and_scales(w8a8_engine_dir: Path) -> None:
    cfg = json.loads((w8a8_engine_dir / "config.json").read_text())
    assert cfg["pretrained_config"]["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    tensors = load_file(str(w8a8_engine_dir / "rank0.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert tensors[name].dtype == torch.int8 and tensors[f"{name}_scale"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32  # embeddings and lm_head stay fp32
    assert "lm_head.weight_scale" not in tensors


def _greedy(engine: LLMEngine, n: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


@needs_fbgemm
def test_engine_runs_fbgemm_and_matches_reference_greedy(w8a8_engine_dir: Path) -> None:
    fast = LLMEngine.from_engine_dir(w8a8_engine_dir)
    ref = LLMEngine.from_engine_dir(w8a8_engine_dir, linear_backend="reference")
    assert fast.runner.model.w8a8_backend == "fbgemm" and ref.runner.model.w8a8_backend == "reference"
    assert isinstance(fast.runner.model.layers[0].mlp.down, FbgemmW8A8Linear)
    assert isinstance(ref.runner.model.layers[0].mlp.down, ReferenceW8A8Linear)
    tokens = _greedy(fast)
    assert tokens == _greedy(ref)
    assert all(len(t) == 16 for t in tokens)


def _prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    tpb = engine.kv.tokens_per_block
    meta = build_attention_metadata([SeqSlice(0, len(prompt), list(range(-(-len(prompt) // tpb))))],
                                    tpb, engine.device)
    with torch.inference_mode():
        return engine.runner.model(torch.tensor(prompt), torch.arange(len(prompt)), meta,
                                   engine.runner.kv_caches, torch.tensor([len(prompt) - 1]))[0]


def test_engine_stays_close_to_fp32(w8a8_engine_dir: Path, tiny_engine_dir: Path) -> None:
    """Round trip build -> load -> generate: the int8 engine's logits stay near fp32's."""
    int8 = LLMEngine.from_engine_dir(w8a8_engine_dir, linear_backend="reference")
    fp32 = LLMEngine.from_engine_dir(tiny_engine_dir, linear_backend="reference")
    for prompt in PROMPTS:
        a, b = _prefill_logits(int8, prompt), _prefill_logits(fp32, prompt)
        # The tiny random model's top logits sit within ~0.02 of each other (docs/design.md, "Machines and
        # test models"): greedy argmax may flip under int8 noise, the logits themselves must stay close.
        assert (a - b).abs().max().item() < 0.1 * (b.max() - b.min()).item()
        assert int(b.argmax()) in torch.topk(a, 5).indices.tolist()
    assert all(len(t) == 16 for t in _greedy(int8))
