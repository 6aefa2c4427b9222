"""W8A8 linears (quantization int8_w8a8): the fbgemm int8 GEMM against the pure-torch reference,
on random shapes and through a built tiny engine (docs/quantization.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtprompt.build import BuildRequest, run_build
from trtprompt.engine import kernels, quant_w8a8
from trtprompt.engine.attention import SeqSlice, build_attention_metadata
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.quant_w8a8 import (
    BUILD_BITS,
    FBGEMM_MAX_ROWS,
    INT16_MAX,
    LEGACY_BITS,
    FbgemmW8A8Linear,
    OneDnnW8A8Linear,
    ReferenceW8A8Linear,
    W8A8Bits,
    bits_of,
    fbgemm_unavailable_reason,
    make_w8a8_linear,
    onednn_unavailable_reason,
    quantize_per_token,
    quantize_rows_u8,
    reference_w8a8,
    resolve_w8a8_backend,
)
from trtprompt.engine.request import SamplingParams
from trtprompt.targets.torch_build import quantize_int8

SPLITS = [LEGACY_BITS, W8A8Bits(weight_bits=7, activation_bits=8)]
needs_fbgemm = pytest.mark.skipif(any(fbgemm_unavailable_reason(b) is not None for b in SPLITS),
                                  reason=f"fbgemm int8 GEMM unavailable: {fbgemm_unavailable_reason()}")
needs_onednn = pytest.mark.skipif(any(onednn_unavailable_reason(b) is not None for b in SPLITS),
                                  reason=f"oneDNN int8 backend not chosen here: {onednn_unavailable_reason()}")
PROMPTS = [list(range(5, 45)), list(range(100, 117)), [7, 3, 9, 300, 2, 11] * 5]


def _random_linear(gen: torch.Generator, n: int, k: int, bits: W8A8Bits = LEGACY_BITS) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    return quantize_int8(torch.randn(n, k, generator=gen) * 0.05, bits.weight_qmax)


@needs_fbgemm
@pytest.mark.parametrize("bits", SPLITS, ids=["w8a7", "w7a8"])
@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 64, 48, False), (7, 96, 200, True), (33, 512, 136, False),
                                                    (130, 24, 8, True), (5, 1536, 40, False),
                                                    # SmolLM2's qkv, o_proj, gate_up and down_proj shapes
                                                    (1, 576, 960, True), (9, 576, 576, False),
                                                    (8, 576, 3072, False), (32, 1536, 576, False)])
def test_fbgemm_matches_reference(m: int, k: int, n: int, bias: bool, bits: W8A8Bits) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    qweight, scale = _random_linear(gen, n, k, bits)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    x[:, ::7] *= 30.0  # outlier channels: the largest |value| per token sets its scale
    fast = FbgemmW8A8Linear(qweight, scale, b, bits)(x)
    ref = reference_w8a8(x, qweight, scale, b, bits)
    # Same integer sums on both paths; only the fp32 rescale rounds differently.
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def _exact_sums(x: torch.Tensor, qweight: torch.Tensor, bits: W8A8Bits) -> torch.Tensor:
    """The integer sums, in int64: what fbgemm must return once the per-token scale is taken back out."""
    q, _ = quantize_per_token(x, bits.act_qmax)
    return q.long() @ qweight.long().t()


@needs_fbgemm
@pytest.mark.parametrize("bits", SPLITS, ids=["w8a7", "w7a8"])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (576, 576), (576, 3072), (1536, 576)])  # SmolLM2's linears
def test_fbgemm_sums_stay_exact_where_pairs_would_saturate(k: int, n: int, bits: W8A8Bits) -> None:
    """Every activation at +-act_qmax (uint8 1 or 255 after the zero point) against weights at +-weight_qmax of
    the same signs: each vpmaddubsw pair is as large as the split allows; 8 + 8 bits would pass INT16_MAX here."""
    gen = torch.Generator().manual_seed(k + n)
    signs = torch.randint(0, 2, (4, k), generator=gen) * 2 - 1
    x = signs.float() * 3.0
    qweight = (signs[torch.arange(n) % 4] * bits.weight_qmax).to(torch.int8)
    qweight[1::3] *= -1
    scale = torch.ones(n)
    y = FbgemmW8A8Linear(qweight, scale, None, bits)(x)
    sums = _exact_sums(x, qweight, bits)
    assert sums.abs().max() == k * bits.act_qmax * bits.weight_qmax  # the extreme case really is in there
    # The scale is 3 / act_qmax per token; undo it in float64 and compare integers exactly.
    got = (y.double() / (3.0 / bits.act_qmax)).round().long()
    assert torch.equal(got, sums)
    assert 2 * (2 * bits.act_qmax + 1) * bits.weight_qmax <= INT16_MAX


def test_bit_splits_that_would_saturate_are_refused() -> None:
    with pytest.raises(ValueError, match="reaches 64770 > 32767"):
        W8A8Bits(weight_bits=8, activation_bits=8)
    with pytest.raises(ValueError, match="weight_bits must be 7 or 8, got 4"):
        W8A8Bits(weight_bits=4, activation_bits=8)
    assert (W8A8Bits(7, 8).weight_qmax, W8A8Bits(7, 8).act_qmax, W8A8Bits(7, 8).act_zero_point) == (63, 127, 128)


def test_config_records_the_split_and_the_loader_checks_the_weights() -> None:
    assert bits_of({"quant_algo": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"}) == LEGACY_BITS  # older engines
    assert bits_of(BUILD_BITS.to_config()) == BUILD_BITS
    with pytest.raises(ValueError, match="activation_bits None"):
        bits_of({"weight_bits": 7})
    q8, scale = _random_linear(torch.Generator().manual_seed(4), 8, 16)
    with pytest.raises(ValueError, match=r"weights reach \|127\| but the engine records weight_bits 7"):
        make_w8a8_linear(q8, scale, None, "reference", W8A8Bits(7, 8))


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


@pytest.mark.parametrize("bits", SPLITS, ids=["w8a7", "w7a8"])
def test_per_token_quantization_bounds_and_error(bits: W8A8Bits) -> None:
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 9)[:, None]
    q, s = quantize_per_token(x, bits.act_qmax)
    assert torch.equal(q, q.round()) and q.abs().max() == bits.act_qmax
    assert torch.equal(q.abs().amax(dim=1), torch.full((9,), float(bits.act_qmax)))  # every token: the full range
    assert ((q * s - x).abs() <= s / 2 + 1e-6 * x.abs()).all()


def test_reference_against_float_math() -> None:
    """The reference is the dequantized product: (q_x * s_x) @ (q_w * s_w).T."""
    gen = torch.Generator().manual_seed(3)
    qweight, scale = _random_linear(gen, 24, 300)
    x = torch.randn(6, 300, generator=gen)
    q, s = quantize_per_token(x)
    expected = (q.double() * s.double()) @ (qweight.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(reference_w8a8(x, qweight, scale, None).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="compiled kernels unavailable")
@pytest.mark.parametrize("bits", SPLITS, ids=["w8a7", "w7a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_quantize_rows_equals_torch(bits: W8A8Bits, dtype: torch.dtype) -> None:
    """One compiled pass (csrc/quantize_rows.cpp) gives quantize_per_token's integers and scales bit for bit:
    vector body and tail (K 100), ties at .5, an all-zero token, values near the smallest scale."""
    gen = torch.Generator().manual_seed(3)
    for k in (576, 100):
        x = (torch.randn(37, k, generator=gen) * 4).to(dtype)
        x[0] = 0.0
        x[1, :4] = torch.tensor([1e-13, -1e-13, 0.0, 2e-13]).to(dtype)
        x[2, :] = 0.5
        x[2, 0] = bits.act_qmax  # scale 1: every other value lies on a .5 tie
        q, s = torch.ops.trtprompt.quantize_rows(x, bits.act_qmax, bits.act_zero_point, quant_w8a8.MIN_SCALE)
        want_q, want_s = quantize_per_token(x, bits.act_qmax)
        assert q.dtype == torch.uint8 and torch.equal(s, want_s)
        assert torch.equal(q.float() - bits.act_zero_point, want_q)
        q2, s2 = quantize_rows_u8(x, bits)
        assert torch.equal(q2, q) and torch.equal(s2, s)


@pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="compiled kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_scale_rows_equals_torch(dtype: torch.dtype) -> None:
    """The output's per-token rescale and cast in one pass: torch's mul_ then cast, bit for bit (vector body
    and tail, N 200); with a bias within an ulp of float32 before the cast."""
    gen = torch.Generator().manual_seed(5)
    y, s = torch.randn(37, 200, generator=gen) * 100, torch.rand(37, 1, generator=gen)
    b = torch.randn(200, generator=gen)
    assert torch.equal(torch.ops.trtprompt.scale_rows(y, s, None, dtype), (y * s).to(dtype))
    got = torch.ops.trtprompt.scale_rows(y, s, b, dtype)
    torch.testing.assert_close(got.float(), torch.addcmul(b, y, s).to(dtype).float(), rtol=1e-6,
                               atol=float(torch.finfo(dtype).eps) * 200)


@needs_onednn
@pytest.mark.parametrize("bits", SPLITS, ids=["w8a7", "w7a8"])
@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 64, 48, False), (FBGEMM_MAX_ROWS, 96, 200, True),
                                                    (FBGEMM_MAX_ROWS + 1, 576, 960, True), (40, 1536, 576, False),
                                                    (300, 576, 3072, False)])
def test_onednn_matches_reference(m: int, k: int, n: int, bias: bool, bits: W8A8Bits) -> None:
    """oneDNN's int8 GEMM above FBGEMM_MAX_ROWS rows, fbgemm at or below: the same integer sums as the
    reference, bfloat16 activations too."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    qweight, scale = _random_linear(gen, n, k, bits)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    x[:, ::7] *= 30.0
    linear = OneDnnW8A8Linear(qweight, scale, b, bits)
    torch.testing.assert_close(linear(x), reference_w8a8(x, qweight, scale, b, bits), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    got = linear(xb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_w8a8(xb, qweight, scale, b, bits).float(), rtol=8e-3, atol=0)


def test_onednn_backend_only_where_it_was_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """onednn where the CPU has AMX int8 and the probes pass; fbgemm elsewhere."""
    monkeypatch.setattr(quant_w8a8, "fbgemm_unavailable_reason", lambda bits: None)
    monkeypatch.setattr(quant_w8a8, "onednn_unavailable_reason", lambda bits: None)
    assert resolve_w8a8_backend("onednn") == "onednn"
    monkeypatch.setattr(quant_w8a8, "onednn_unavailable_reason", lambda bits: "the CPU lacks amx_int8")
    assert resolve_w8a8_backend("onednn") == "fbgemm"
    assert resolve_w8a8_backend("reference") == "reference"


def test_onednn_reason_names_the_missing_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtprompt.engine import isa

    quant_w8a8.onednn_unavailable_reason.cache_clear()
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    try:
        assert onednn_unavailable_reason(LEGACY_BITS) == "the CPU lacks amx_int8"
    finally:
        quant_w8a8.onednn_unavailable_reason.cache_clear()


def test_unavailable_kernel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_w8a8, "fbgemm_unavailable_reason", lambda bits: "torch's quantized engine is 'qnnpack'")
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
def test_engine_runs_int8_gemm_and_matches_reference_greedy(w8a8_engine_dir: Path) -> None:
    """The default backend (oneDNN with AMX: prompt rows on oneDNN, decode rows on fbgemm; else fbgemm) and the
    reference give the same greedy tokens."""
    fast = LLMEngine.from_engine_dir(w8a8_engine_dir)
    ref = LLMEngine.from_engine_dir(w8a8_engine_dir, linear_backend="reference")
    want = "onednn" if onednn_unavailable_reason(fast.runner.model.w8a8_bits) is None else "fbgemm"
    assert fast.runner.model.w8a8_backend == want and ref.runner.model.w8a8_backend == "reference"
    assert isinstance(fast.runner.model.layers[0].mlp.down, OneDnnW8A8Linear if want == "onednn" else FbgemmW8A8Linear)
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
