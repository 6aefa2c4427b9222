"""Parity of the paged, packed decoder with transformers on tiny random checkpoints.

Each architecture's checkpoint is made here with its transformers config
class (large init so argmax is well separated, docs/design.md), saved with
save_pretrained and read back from model.safetensors. transformers' logits
over the whole sequence are the oracle for every position our model computes,
whether in one prefill, in chunks across steps, or as decodes.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.linear import onednn_available
from trtprompt.engine.model import DecoderModel, load_model_from_safetensors
from trtprompt.engine.quant_int4 import dequantize_int4, quantize_int4
from trtprompt.engine.rope import rope_parameters

TPB = 8  # tokens_per_block in these tests
VOCAB = 256
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.3, rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

SPECS: dict[str, tuple[type, type, str, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, "LlamaForCausalLM", {}),
    "llama3_tied": (LlamaConfig, LlamaForCausalLM, "LlamaForCausalLM",
                    {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "mistral": (MistralConfig, MistralForCausalLM, "MistralForCausalLM", {"rope_theta": 500.0}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, "Qwen2ForCausalLM", {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, "Qwen3ForCausalLM", {"head_dim": 32}),
}
BACKENDS = ["reference", "onednn"]


@dataclass
class Checkpoint:
    cfg: ModelConfig
    hf: torch.nn.Module
    path: Path
    tensors: dict[str, torch.Tensor]
    ref_cache: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        """transformers' float32 logits at every position of `tokens`."""
        key = tuple(tokens)
        if key not in self.ref_cache:
            with torch.no_grad():
                self.ref_cache[key] = self.hf(torch.tensor([tokens])).logits[0].float()
        return self.ref_cache[key]


def model_config(hf_cfg: Any, architecture: str) -> ModelConfig:
    rope = dict(hf_cfg.rope_parameters)
    return ModelConfig(
        architecture=architecture, vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size,
        intermediate_size=hf_cfg.intermediate_size, num_hidden_layers=hf_cfg.num_hidden_layers,
        num_attention_heads=hf_cfg.num_attention_heads, num_key_value_heads=hf_cfg.num_key_value_heads,
        head_size=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        max_position_embeddings=hf_cfg.max_position_embeddings, norm_epsilon=hf_cfg.rms_norm_eps,
        rotary_base=rope["rope_theta"], rotary_scaling=None if rope["rope_type"] == "default" else rope,
        tie_word_embeddings=hf_cfg.tie_word_embeddings, attn_bias=architecture == "Qwen2ForCausalLM",
        qk_layernorm=architecture == "Qwen3ForCausalLM",
    )


def randomize_norms_and_biases(hf: torch.nn.Module) -> None:
    """transformers initialises norms to 1 and biases to 0, which would hide a skipped weight."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.3 * torch.randn_like(param))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for i, (name, (cfg_cls, model_cls, arch, extra)) in enumerate(SPECS.items()):
        torch.manual_seed(1000 + i)
        hf_cfg = cfg_cls(**COMMON, **extra)
        hf = model_cls(hf_cfg).eval()
        randomize_norms_and_biases(hf)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        st = path / "model.safetensors"
        out[name] = Checkpoint(model_config(hf.config, arch), hf, st, load_file(str(st)))
    return out


class PagedRun:
    """A minimal runner: block tables from a shuffled pool, one forward per `step`."""

    def __init__(self, model: DecoderModel, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.kv = allocate_kv_cache(model.cfg, num_blocks, TPB, model.dtype, model.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.tables: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, work: list[tuple[str, list[int], int]], backend: str = "auto") -> list[torch.Tensor]:
        """work: (seq id, all its tokens, number of new tokens); returns each seq's last-row logits."""
        seqs, ids, pos, last = [], [], [], []
        for sid, tokens, n in work:
            ctx = self.done.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * TPB < ctx + n:
                table.append(self.free.pop())
            seqs.append(SeqSlice(ctx, n, list(table)))
            ids += tokens[ctx:ctx + n]
            pos += list(range(ctx, ctx + n))
            last.append(len(ids) - 1)
            self.done[sid] = ctx + n
        meta = build_attention_metadata(seqs, TPB, self.model.device, backend)
        logits = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.kv, torch.tensor(last))
        assert logits.dtype == torch.float32 and logits.shape == (len(work), self.model.cfg.vocab_size)
        return list(logits)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = random.Random(seed)
    return [[gen.randrange(VOCAB) for _ in range(n)] for n in lengths]


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 2e-4) -> None:
    diff = (got - want).abs().max().item()
    assert diff < atol, f"max abs diff {diff}"
    assert got.argmax().item() == want.argmax().item()


def load(ck: Checkpoint, backend: str, dtype: torch.dtype = torch.float32) -> DecoderModel:
    return load_model_from_safetensors(ck.path, ck.cfg, dtype, torch.device("cpu"), backend)


@pytest.fixture(scope="session")
def models(checkpoints: dict[str, Checkpoint]) -> Callable[[str, str], DecoderModel]:
    cache: dict[tuple[str, str], DecoderModel] = {}

    def get(name: str, backend: str) -> DecoderModel:
        if (name, backend) not in cache:
            cache[name, backend] = load(checkpoints[name], backend)
        return cache[name, backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SPECS))
def test_packed_prefill_matches_transformers(checkpoints, models, name: str, backend: str) -> None:
    ck, run = checkpoints[name], PagedRun(models(name, backend))
    batch = prompts(1, [5, 17, 1, 33, 64])  # the 1-token prompt takes the decode path
    got = run.step([(f"s{i}", p, len(p)) for i, p in enumerate(batch)])
    for g, p in zip(got, batch):
        assert_close(g, ck.hf_logits(p)[-1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SPECS))
def test_chunked_prefill_then_decode_matches_transformers(checkpoints, models, name: str, backend: str) -> None:
    ck, run = checkpoints[name], PagedRun(models(name, backend), seed=3)
    (p,) = prompts(2, [61])
    want = ck.hf_logits(p)
    # Chunks are multiples of tokens_per_block except the last; the rest decodes one token a step.
    done = 0
    for n in (8, 24, 16, 3, 1, 1):
        (got,) = run.step([("a", p, n)])
        done += n
        assert_close(got, want[done - 1])
    assert done == len(p) - 8
    for n in range(8):
        (got,) = run.step([("a", p, 1)])
        assert_close(got, want[done + n])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SPECS))
def test_mixed_decodes_and_prefill_chunk(checkpoints, models, name: str, backend: str) -> None:
    ck, run = checkpoints[name], PagedRun(models(name, backend), seed=5)
    a, b, c, d = prompts(3, [40, 23, 90, 12])
    run.step([("a", a, 30), ("b", b, 9), ("c", c, 16)])  # c has a cached context afterwards
    # Decodes of mixed context lengths around a prefill chunk with cached context, then a fresh prompt.
    got = run.step([("a", a, 1), ("c", c, 32), ("b", b, 1), ("d", d, 12)])
    assert_close(got[0], ck.hf_logits(a)[30])
    assert_close(got[1], ck.hf_logits(c)[47])
    assert_close(got[2], ck.hf_logits(b)[9])
    assert_close(got[3], ck.hf_logits(d)[11])
    got = run.step([("b", b, 1), ("a", a, 1), ("c", c, 1)])  # decodes only
    assert_close(got[0], ck.hf_logits(b)[10])
    assert_close(got[1], ck.hf_logits(a)[31])
    assert_close(got[2], ck.hf_logits(c)[48])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_reused_prefix_blocks_match_transformers(checkpoints, models, name: str) -> None:
    """A second sequence reads the first one's full blocks instead of recomputing its prefix."""
    ck, run = checkpoints[name], PagedRun(models(name, "onednn"), seed=7)
    a, tail = prompts(8, [40, 21])
    b = a[:32] + tail
    run.step([("a", a, 40)])
    run.tables["b"], run.done["b"] = run.tables["a"][:4], 32  # 4 shared blocks of 8 tokens
    got = run.step([("b", b, 16), ("a", a + [7], 1)])
    assert_close(got[0], ck.hf_logits(b)[47])
    assert_close(got[1], ck.hf_logits(a + [7])[40])
    (got,) = run.step([("b", b, 5)])
    assert_close(got, ck.hf_logits(b)[52])
    assert run.tables["b"][:4] == run.tables["a"][:4]


def test_split_decode_groups_and_query_chunks_match(checkpoints, models, monkeypatch) -> None:
    """The memory bounds (decode groups, masked-prefill query chunks) must not change results."""
    import trtprompt.engine.attention_reference as attention

    monkeypatch.setattr(attention, "MAX_DECODE_GROUP_BLOCKS", 6)
    monkeypatch.setattr(attention, "PREFILL_QUERY_CHUNK", 8)
    seqs = [SeqSlice(20, 1, [0, 1, 2]), SeqSlice(3, 1, [3]), SeqSlice(9, 1, [4, 5]), SeqSlice(16, 20, [6, 7, 8, 9, 10])]
    meta = build_attention_metadata(seqs, TPB, torch.device("cpu"), backend="reference")
    assert [d.block_tables.shape for d in meta.decodes] == [(2, 3), (1, 1)]
    test_mixed_decodes_and_prefill_chunk(checkpoints, models, "llama", "reference")


def test_greedy_generation_matches_transformers(checkpoints, models) -> None:
    ck = checkpoints["qwen3"]
    run = PagedRun(models("qwen3", "onednn"))
    batch = prompts(4, [7, 20])
    with torch.no_grad():
        want = [ck.hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0].tolist() for p in batch]
    seqs = [list(p) for p in batch]
    logits = run.step([(f"s{i}", s, len(s)) for i, s in enumerate(seqs)])
    for _ in range(12):
        for s, lg in zip(seqs, logits):
            s.append(int(lg.argmax()))
        logits = run.step([(f"s{i}", s, 1) for i, s in enumerate(seqs)])
    assert seqs == want


def _bf16_steps(ck: Checkpoint, batch: list[list[int]], backend: str) -> list[torch.Tensor]:
    run = PagedRun(load(ck, "onednn", torch.bfloat16))
    work = [[("s0", batch[0], 9), ("s1", batch[1], 30), ("s2", batch[2], 32)],
            [("s0", batch[0], 1), ("s1", batch[1], 1), ("s2", batch[2], 18)]]
    got: list[torch.Tensor] = []
    for step in work:
        got += run.step(step, backend)
    return got


def test_bfloat16_runs_and_mostly_agrees(checkpoints) -> None:
    ck = checkpoints["llama"]
    batch = prompts(6, [12, 33, 50])
    got = _bf16_steps(ck, batch, "auto")  # the compiled kernels where they build
    reference = _bf16_steps(ck, batch, "reference")  # the same bf16 model, attention in plain torch ops
    want = [ck.hf_logits(batch[0])[8], ck.hf_logits(batch[1])[29], ck.hf_logits(batch[2])[31],
            ck.hf_logits(batch[0])[9], ck.hf_logits(batch[1])[30], ck.hf_logits(batch[2])[49]]
    agree = 0
    for g, r, w in zip(got, reference, want):
        # bf16 against transformers in fp32: the reference path itself is 9.5 % of the largest logit off on
        # this seed's first row (the bound was 10 % when only it ran here); the fast path differs from it
        # by 0.7-1.5 %, so it is held to the reference's rounding, tightly, and to fp32 loosely.
        assert (g - r).abs().max().item() < 0.03 * r.abs().max().item()
        assert (g - w).abs().max().item() < 0.15 * w.abs().max().item()
        agree += int(g.argmax() == w.argmax())
    assert agree >= 5


def quantize_w8a16(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(int8 + scale tensors, the same weights dequantized) per the engine-dir format."""
    quant, deq = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            quant[name], quant[name + "_scale"] = q, scale.float()
            deq[name] = q.float() * scale[:, None]
    return quant, deq


@pytest.mark.parametrize("backend", BACKENDS)
def test_w8a16_matches_dequantized_reference(checkpoints, backend: str) -> None:
    ck = checkpoints["qwen2"]
    quant, deq = quantize_w8a16(ck.tensors)
    q_model = DecoderModel(ck.cfg, torch.float32, torch.device("cpu"), backend)
    q_model.load_weights(quant, quant_algo="W8A16")
    d_model = DecoderModel(ck.cfg, torch.float32, torch.device("cpu"), "reference")
    d_model.load_weights(deq)
    batch = prompts(7, [11, 26])
    work = [(f"s{i}", p, len(p)) for i, p in enumerate(batch)]
    for g, w in zip(PagedRun(q_model).step(work), PagedRun(d_model).step(work)):
        assert_close(g, w, atol=1e-3)


def quantize_w4a16(tensors: dict[str, torch.Tensor], group: int) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, torch.Tensor]]:
    """(packed int4 + group scale tensors, the same weights dequantized) per the engine-dir format."""
    quant, deq = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            quant[name], quant[name + "_scale"] = quantize_int4(w, group)
            deq[name] = dequantize_int4(quant[name], quant[name + "_scale"], torch.float32)
    return quant, deq


@pytest.mark.parametrize("algo", ["W8A16", "W4A16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_only_prefill_and_decode_match_dequantized_reference(checkpoints, backend: str, algo: str) -> None:
    """Prefill rows run the dense path, the decode steps (2 rows) the few-rows kernel on onednn."""
    ck = checkpoints["llama"]
    quant, deq = quantize_w8a16(ck.tensors) if algo == "W8A16" else quantize_w4a16(ck.tensors, 32)
    q_model = DecoderModel(ck.cfg, torch.float32, torch.device("cpu"), backend)
    q_model.load_weights(quant, quant_algo=algo, group_size=32 if algo == "W4A16" else None)
    d_model = DecoderModel(ck.cfg, torch.float32, torch.device("cpu"), "reference")
    d_model.load_weights(deq)
    seqs = prompts(9, [13, 21])
    q_run, d_run = PagedRun(q_model), PagedRun(d_model)
    work = [(f"s{i}", p, len(p)) for i, p in enumerate(seqs)]
    for _ in range(4):
        got, want = q_run.step(work), d_run.step(work)
        for g, w in zip(got, want):
            assert_close(g, w, atol=1e-3)
        for (sid, tokens, _), w in zip(work, want):
            tokens.append(int(w.argmax()))
        work = [(sid, tokens, 1) for sid, tokens, _ in work]


def test_w4a16_needs_its_group_size(checkpoints) -> None:
    ck = checkpoints["llama"]
    quant, _ = quantize_w4a16(ck.tensors, 32)
    model = DecoderModel(ck.cfg, torch.float32, torch.device("cpu"), "reference")
    with pytest.raises(ValueError, match="W4A16 needs a group_size"):
        model.load_weights(quant, quant_algo="W4A16")
    with pytest.raises(ValueError, match="must be uint8, got torch.int8"):
        model.load_weights(quantize_w8a16(ck.tensors)[0], quant_algo="W4A16", group_size=32)
    with pytest.raises(ValueError, match=r"has shape .*, expected"):
        model.load_weights(quant, quant_algo="W4A16", group_size=64)


def test_w8a16_rejects_unquantized_weights(checkpoints) -> None:
    ck = checkpoints["llama"]
    model = DecoderModel(ck.cfg, torch.float32, torch.device("cpu"), "reference")
    with pytest.raises(ValueError, match="must be int8"):
        model.load_weights(ck.tensors, quant_algo="W8A16")


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16,
     "mscale": 0.707, "mscale_all_dim": 1.0},
])
def test_rope_scaling_matches_transformers(rope: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 50000.0, **rope}
    hf_cfg = LlamaConfig(**COMMON, rope_parameters=params)
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, torch.device("cpu"))
    # Our config keeps the dict as written (transformers fills in defaults on its own copy).
    cfg = dataclasses.replace(model_config(hf_cfg, "LlamaForCausalLM"), rotary_scaling=dict(params))
    got_inv, got_scale = rope_parameters(cfg)
    torch.testing.assert_close(got_inv, want_inv.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)


def test_unsupported_rope_type_fails_clearly(checkpoints) -> None:
    cfg = checkpoints["llama"].cfg
    bad = ModelConfig(**{**cfg.__dict__, "rotary_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        DecoderModel(bad, torch.float32, torch.device("cpu"), "reference")


def test_block_table_too_short_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"seqs\[1\].block_table has 1 blocks"):
        build_attention_metadata([SeqSlice(0, 3, [0]), SeqSlice(5, 4, [1])], TPB, torch.device("cpu"))


def test_onednn_backend_is_really_used_for_float32(checkpoints, models) -> None:
    model = models("llama", "onednn")
    assert model.linear_backend == ("onednn" if onednn_available(torch.float32, torch.device("cpu")) else "reference")
    assert models("llama", "reference").linear_backend == "reference"
