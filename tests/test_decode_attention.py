"""The fused decode attention (csrc/decode_attention.cpp): one call a layer for a pure decode step, equal bit for
bit to the op-by-op path it replaces (rotary, write_kv, paged_decode), and taken only where it applies."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch
from engine_helpers import model_config

from trtprompt.engine import kernels
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata, decode_attention
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.layer_ops import CompiledOps
from trtprompt.engine.model import load_model_from_safetensors

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0],
                                reason=f"compiled kernels unavailable: {kernels.compiled_kernel_status()[1]}")

TPB = 8


def rotary_tables(positions: torch.Tensor, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, d/2] as CompiledOps.rotary_tables passes them."""
    freqs = positions[:, None].float() / (10000 ** (torch.arange(0, d, 2).float() / d))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def decode_case(lens: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype):
    """(qkv, cos, sin, caches, metadata) of one decode step: sequences of lens[s] cached tokens on shuffled blocks,
    each adding one token; the cached rows random."""
    rng = random.Random(sum(lens) + heads)
    free = list(range(sum(-(-(n + 1) // TPB) for n in lens) + 2))
    rng.shuffle(free)
    seqs = [SeqSlice(n, 1, [free.pop() for _ in range(-(-(n + 1) // TPB))]) for n in lens]
    shape = (len(free) + sum(len(s.block_table) for s in seqs), kv_heads, TPB, d)
    caches = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d).to(dtype)
    cos, sin = rotary_tables(torch.tensor(lens), d, dtype)
    return qkv, cos, sin, caches, build_attention_metadata(seqs, TPB, torch.device("cpu"), "compiled", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,heads,kv_heads,d", [([0], 9, 3, 64), ([130], 9, 3, 64), ([5, 17, 8, 300], 4, 2, 32),
                                                   ([7, 63], 8, 8, 64)])
def test_fused_call_equals_the_op_by_op_path(dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int,
                                             d: int) -> None:
    """Output and both caches equal bit for bit: the same ops, called from C++."""
    qkv, cos, sin, caches, meta = decode_case(lens, heads, kv_heads, d, dtype)
    assert meta.decode_tables is not None
    fused_caches = (caches[0].clone(), caches[1].clone())
    got = decode_attention(qkv, cos, sin, fused_caches, meta, heads, d ** -0.5)
    ops, s = CompiledOps(), len(lens)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = ops.rotary(q.view(s, heads, d), cos, sin), ops.rotary(k.view(s, kv_heads, d), cos, sin)
    torch.ops.trtprompt.write_kv(caches[0], caches[1], k, v.view(s, kv_heads, d), meta.slot_blocks,
                                 meta.slot_offsets)
    tables, seq_lens = meta.decode_tables
    want, _ = kernels.paged_decode(q, caches[0], caches[1], tables, seq_lens, d ** -0.5)
    assert got is not None and got.shape == (s, heads * d) and got.dtype == dtype
    assert torch.equal(got, want.reshape(s, heads * d))
    assert torch.equal(fused_caches[0], caches[0]) and torch.equal(fused_caches[1], caches[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_call_norms_q_and_k_first_as_the_op_by_op_path(dtype: torch.dtype) -> None:
    """Qwen3's q/k norms (a weight of head_size each) inside the call: normed per head, then rotary."""
    heads, kv_heads, d, lens = 8, 2, 32, [4, 40]
    qkv, cos, sin, caches, meta = decode_case(lens, heads, kv_heads, d, dtype)
    wq, wk = (torch.randn(d) * 0.5 + 1).to(dtype), (torch.randn(d) * 0.5 + 1).to(dtype)
    fused_caches = (caches[0].clone(), caches[1].clone())
    got = decode_attention(qkv, cos, sin, fused_caches, meta, heads, d ** -0.5, (wq, wk, 1e-6))
    ops, s = CompiledOps(), len(lens)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = ops.rotary(ops.rms_norm(q.reshape(s, heads, d), wq, 1e-6), cos, sin)
    k = ops.rotary(ops.rms_norm(k.reshape(s, kv_heads, d), wk, 1e-6), cos, sin)
    torch.ops.trtprompt.write_kv(caches[0], caches[1], k, v.view(s, kv_heads, d), meta.slot_blocks,
                                 meta.slot_offsets)
    assert meta.decode_tables is not None
    want, _ = kernels.paged_decode(q, caches[0], caches[1], *meta.decode_tables, d ** -0.5)
    assert got is not None and torch.equal(got, want.reshape(s, heads * d))
    assert torch.equal(fused_caches[0], caches[0]) and torch.equal(fused_caches[1], caches[1])


def test_fused_call_names_a_misshapen_qkv() -> None:
    qkv, cos, sin, caches, meta = decode_case([3], 4, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="decode_attention: qkv must be"):
        decode_attention(qkv[:, :-32], cos, sin, caches, meta, 4, 1.0)


def test_only_a_pure_decode_step_on_the_kernel_takes_the_fused_path() -> None:
    """A prefill chunk in the step, a shared cached prefix (cascade), or another backend: op by op."""
    cpu = torch.device("cpu")
    decode = [SeqSlice(9, 1, [0, 1]), SeqSlice(3, 1, [2])]
    assert build_attention_metadata(decode, TPB, cpu, "compiled").decode_tables is not None
    mixed = [SeqSlice(9, 1, [0, 1]), SeqSlice(0, 5, [2])]
    assert build_attention_metadata(mixed, TPB, cpu, "compiled").decode_tables is None
    prefix = list(range(64))  # 512 tokens shared by both: enough for a cascade group (cascade.MIN_SAVED_TOKENS)
    shared = [SeqSlice(512, 1, [*prefix, 64]), SeqSlice(512, 1, [*prefix, 65])]
    assert build_attention_metadata(shared, TPB, cpu, "compiled").groups
    assert build_attention_metadata(shared, TPB, cpu, "compiled").decode_tables is None
    for backend in ("torch", "reference"):
        assert build_attention_metadata(decode, TPB, cpu, backend).decode_tables is None


def test_int8_caches_take_the_op_by_op_path() -> None:
    qkv, cos, sin, _, meta = decode_case([3], 4, 2, 32, torch.float32)
    cfg_caches = allocate_kv_cache(_cfg(4, 2, 32), 8, TPB, torch.float32, torch.device("cpu"), "int8")
    assert decode_attention(qkv, cos, sin, cfg_caches[0], meta, 4, 1.0) is None


def _cfg(heads: int, kv_heads: int, d: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=heads * d, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_size=d,
                       max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=10000.0, rotary_scaling=None,
                       tie_word_embeddings=False, attn_bias=False, qk_layernorm=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms inside the fused call
def test_model_decode_steps_equal_with_and_without_the_fused_call(
        tiny_checkpoint_factory: Callable[..., Path], arch: str) -> None:
    """The model's logits and KV caches over a prefill and decode steps, fused against op by op."""
    path = tiny_checkpoint_factory(arch)
    cfg = model_config(path)
    model = load_model_from_safetensors(path / "model.safetensors", cfg, torch.float32, torch.device("cpu"), "onednn")
    fused, plain = CompiledOps(), CompiledOps()
    plain.fuses_decode = False
    runs = {ops: allocate_kv_cache(cfg, 16, TPB, torch.float32, torch.device("cpu")) for ops in (fused, plain)}
    prompts = [[5, 9, 200, 31, 7, 7, 12, 40, 41, 3], [17, 4, 88]]
    tables = [[3, 7], [11]]
    lens = [0, 0]
    for step in range(6):
        new = [len(p) if step == 0 else 1 for p in prompts]
        for t, n in zip(tables, (a + b for a, b in zip(lens, new))):
            while len(t) * TPB < n:
                t.append(max(max(x) for x in tables) + 1)
        seqs = [SeqSlice(c, n, list(t)) for c, n, t in zip(lens, new, tables)]
        ids = torch.tensor([tok for p, c, n in zip(prompts, lens, new) for tok in p[c:c + n]])
        pos = torch.tensor([i for c, n in zip(lens, new) for i in range(c, c + n)])
        last = torch.tensor([sum(new[:i + 1]) - 1 for i in range(len(new))])
        meta = build_attention_metadata(seqs, TPB, torch.device("cpu"), "compiled")
        assert (meta.decode_tables is not None) == (step > 0)
        logits = {ops: model(ids, pos, meta, runs[ops], last, ops) for ops in (fused, plain)}
        assert torch.equal(logits[fused], logits[plain])
        for p, row in zip(prompts, logits[fused]):
            p.append(int(row.argmax()))
        lens = [c + n for c, n in zip(lens, new)]
    for (kf, vf), (kp, vp) in zip(runs[fused], runs[plain]):
        assert torch.equal(kf, kp) and torch.equal(vf, vp)


def test_step_overhead_compares_the_two_paths_and_restores_the_fused_one(tiny_engine_dir: Path) -> None:
    """`step_overhead --compare-fused`: decode steps on both paths, in one process; the engine's ops as before."""
    from trtprompt.bench.scenarios.step_overhead import fused_ab, start_batch
    from trtprompt.engine.engine import LLMEngine

    engine = LLMEngine.from_engine_dir(tiny_engine_dir, enable_kv_cache_reuse=False, speculative_decoding="none")
    try:
        start_batch(engine, 2, 16, "t")
        got = fused_ab(engine, rounds=2, block=2)
        assert engine.runner.ops.fuses_decode is (engine.attention_backend == "compiled")
        assert got["ratio_median"] == got["fused_ms_median"] / got["op_by_op_ms_median"] > 0
        assert all(r.num_output == 9 for r in engine.requests.values())  # the first token, then 2 rounds x 2 x 2
    finally:
        engine.close()
