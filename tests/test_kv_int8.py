"""kv_cache_dtype int8: int8 K/V rows with a float16 scale each (trtprompt/engine/attention_int8.py).

The compiled backend reads the int8 rows in place in every step (paged_decode_int8,
paged_prefill_int8), the torch and reference backends through dequantized blocks; the values are the
same, so they agree as tightly as on a float pool. int8 against fp32 KV is measured (greedy agreement
on the demo engine).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import EOS, count_cascade_groups, make_engine, model_config, prefill_segments, run_to_completion
from tier_helpers import run_one

from trtprompt.checkpoint import read_checkpoint
from trtprompt.engine import cascade, kernels
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata, paged_attention
from trtprompt.engine.attention_int8 import Int8KvCache, dequantize_rows, quantize_rows
from trtprompt.engine.config import KvCacheConfig, ModelConfig
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams
from trtprompt.engine.tiers.config import TierConfig
from trtprompt.engine.tiers.disk_store import DiskStore
from trtprompt.engine.tiers.fingerprint import fingerprint_engine_files
from trtprompt.engine.tiers.open import kv_layout
from trtprompt.errors import PlanError
from trtprompt.plan import make_plan
from trtprompt.profile import Profile

TPB = 8
BACKENDS = ["reference", "torch"] + (["compiled"] if kernels.compiled_kernel_status()[0] else [])
needs_kernels = pytest.mark.skipif("compiled" not in BACKENDS, reason="no compiled kernels on this machine")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("llama")


def test_rows_round_trip_within_half_a_step() -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0] = 0.0  # an all-zero row stays zero
    packed = quantize_rows(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 3, 66)
    back = dequantize_rows(packed, torch.float32)
    stored = packed[..., 64:].contiguous().view(torch.float16).float()
    clamped = (x.abs().amax(-1, keepdim=True) - 127 * stored).clamp_min(0)  # a scale stored rounded down
    assert torch.all((back - x).abs() <= stored * 0.5 + clamped + 1e-12)
    assert torch.all(stored <= x.abs().amax(-1, keepdim=True) / 127 * 1.002 + 2.0 ** -24)
    assert torch.equal(back[0], torch.zeros(3, 64))


def _mixed_step(cfg: ModelConfig, caches: list, backend: str) -> torch.Tensor:
    """Write a 40-token context for three sequences (two share 24 tokens), then one step of two
    decodes and a 9-token chunk after its context; the attention output of that step."""
    torch.manual_seed(1)
    heads, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
    tables = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    warm = [SeqSlice(0, 40, t) if i != 1 else SeqSlice(24, 16, t) for i, t in enumerate(tables)]
    steps = [warm, [SeqSlice(40, 1, tables[0]), SeqSlice(40, 1, tables[1]), SeqSlice(40, 9, tables[2])]]
    out = torch.empty(0)
    for seqs in steps:
        n = sum(s.num_new_tokens for s in seqs)
        q, k, v = torch.randn(n, heads, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
        meta = build_attention_metadata(seqs, TPB, torch.device("cpu"), backend)
        out = paged_attention(q, k, v, caches[0], meta, d ** -0.5)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_on_int8_pool(ckpt: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, a chunk after its context, and the two sequences' shared blocks read once (cascade)."""
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)
    cfg = model_config(ckpt)
    ref = _mixed_step(cfg, allocate_kv_cache(cfg, 16, TPB, torch.float32, torch.device("cpu"), "int8"), "reference")
    caches = allocate_kv_cache(cfg, 16, TPB, torch.float32, torch.device("cpu"), "int8")
    got = _mixed_step(cfg, caches, backend)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    # The compiled kernels read the int8 rows in place in every part of the step: no float scratch.
    assert isinstance(caches[0], Int8KvCache)
    assert (caches[0].scratch.allocated_bytes == 0) == (backend == "compiled")
    fp32 = _mixed_step(cfg, allocate_kv_cache(cfg, 16, TPB, torch.float32, torch.device("cpu")), "reference")
    err = (got - fp32).abs().max().item()
    assert 0 < err < 0.05, f"int8 vs fp32 KV max abs difference {err}"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_reads_int8_in_place_as_the_reference_dequantizes(ckpt: Path, dtype: torch.dtype) -> None:
    """A pure decode step: kernels.paged_decode_int8 on the int8 rows against the reference path
    (blocks dequantized into the scratch, then SDPA), on the same int8 pool."""
    cfg = model_config(ckpt)
    torch.manual_seed(2)
    lens = [37, 8, 1, 64, 21]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    caches = allocate_kv_cache(cfg, 40, TPB, dtype, torch.device("cpu"), "int8")
    heads, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
    warm = [SeqSlice(0, n - 1, t) for n, t in zip(lens, tables) if n > 1]
    n = sum(s.num_new_tokens for s in warm)
    meta = build_attention_metadata(warm, TPB, torch.device("cpu"), "reference")
    paged_attention(torch.randn(n, heads, d, dtype=dtype), torch.randn(n, kvh, d, dtype=dtype) * 3,
                    torch.randn(n, kvh, d, dtype=dtype), caches[0], meta, d ** -0.5)
    step = [SeqSlice(n - 1, 1, t) for n, t in zip(lens, tables)]
    q, k, v = (torch.randn(len(lens), h, d, dtype=dtype) for h in (heads, kvh, kvh))
    outs = {}
    for backend in ("reference", "compiled"):
        meta = build_attention_metadata(step, TPB, torch.device("cpu"), backend)
        outs[backend] = paged_attention(q, k, v, caches[0], meta, d ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["compiled"].float(), outs["reference"].float(), atol=tol, rtol=tol)


PREFILL_CASES = [  # heads, kv_heads, head_size, tokens_per_block, query dtype
    (2, 2, 64, 8, torch.float32),  # no GQA
    (9, 3, 64, 16, torch.float32),  # SmolLM2's heads
    (8, 2, 128, 8, torch.float32),  # GQA 4, the d = 128 build
    (6, 2, 128, 16, torch.bfloat16),  # GQA 3, bf16 queries over int8 rows
]


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_size,tpb,dtype", PREFILL_CASES)
def test_prefill_int8_in_place_equals_the_float_kernel_on_the_dequantized_pool(
        heads: int, kv_heads: int, head_size: int, tpb: int, dtype: torch.dtype) -> None:
    """kernels.paged_prefill_int8 on int8 rows against kernels.paged_prefill on the same rows dequantized:
    a prompt, chunks after their context (lengths not multiples of tokens_per_block, causal; one of three
    tokens), and a cascade-like segment (every row sees every key), in one call."""
    rng = random.Random(heads * 1000 + head_size + tpb)
    torch.manual_seed(rng.randrange(1 << 30))
    num_blocks = 300 // tpb + 30
    packed = [quantize_rows(torch.randn(num_blocks, kv_heads, tpb, head_size) * 2) for _ in "kv"]
    floats = [dequantize_rows(c, torch.float32) for c in packed]
    shapes = [(0, 101, True), (45, 37, True), (3 * tpb + 5, 3, True), (5 * tpb, 22, False)]  # (context, new, causal)
    segments, _, table_t, start = prefill_segments(shapes, num_blocks, tpb, rng)
    q = torch.randn(start, heads, head_size).to(dtype)
    got, got_lse = kernels.paged_prefill_int8(q, packed[0], packed[1], table_t, torch.tensor(segments),
                                              head_size ** -0.5)
    want, want_lse = kernels.paged_prefill(q.float(), floats[0], floats[1], table_t, torch.tensor(segments),
                                           head_size ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want.to(dtype), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-6)


@needs_kernels
def test_prefill_int8_refuses_rows_without_their_scale() -> None:
    q = torch.randn(4, 4, 64)
    rows = torch.zeros(2, 2, 8, 64, dtype=torch.int8)  # head_size bytes: no room for the scale
    with pytest.raises(RuntimeError, match="paged_prefill_int8: cache rows must be D \\+ 2 bytes"):
        kernels.paged_prefill_int8(q, rows, rows, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.tensor([[0, 4, 4, 1]]), 0.125)


def _engine(ckpt: Path, kv_dtype: str, backend: str = "auto", tiers: list | None = None,
            weights: Path | None = None, max_num_tokens: int = 256) -> LLMEngine:
    """weights: the safetensors file the tier fingerprint digests (its digest cache is written beside
    it, so tests pass a private copy rather than the shared checkpoint's)."""
    base = make_engine(ckpt, tokens_per_block=TPB, kv_tokens=2048, max_seq_len=512, attention_backend=backend,
                       max_num_tokens=max_num_tokens)
    kv = dataclasses.replace(base.config.kv_cache, kv_cache_dtype=kv_dtype)
    cfg = dataclasses.replace(base.config, kv_cache=kv, tiers=TierConfig())
    if tiers is None:
        return LLMEngine(cfg, base.runner.model, [EOS])
    layout = kv_layout(cfg.model, TPB, torch.float32, kv_dtype)
    fingerprint = fingerprint_engine_files(weights or ckpt / "model.safetensors", None, layout, "float32")
    return LLMEngine(cfg, base.runner.model, [EOS], fingerprint, tiers)


def _prompts(n: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {f"r{i}": torch.randint(3, 250, (int(torch.randint(10, 60, (1,), generator=g)),), generator=g).tolist()
            for i in range(n)}


def test_greedy_tokens_int8_vs_fp32_kv(ckpt: Path) -> None:
    """Measured on this random-weight demo model (near-tied logits, the worst case for greedy): of
    8 x 16 greedy tokens, 63 (49 %) come before each sequence's first difference (after it the two
    contexts differ, so later tokens say nothing); one prompt differs at its first token. The real
    model's figures are in docs/quantization.md. On the int8 pool the compiled/torch paths and the
    reference give the same tokens exactly."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(8)
    fp32 = run_to_completion(_engine(ckpt, "auto"), prompts, params)
    int8 = run_to_completion(_engine(ckpt, "int8"), prompts, params)
    before = sum(next((i for i, (x, y) in enumerate(zip(fp32[r], int8[r])) if x != y), 16) for r in prompts)
    assert before / (16 * len(prompts)) >= 0.4, f"{before} of {16 * len(prompts)} tokens before a difference"
    assert int8 != fp32  # the quantization is really there
    ref = run_to_completion(_engine(ckpt, "int8", "reference"), prompts, params)
    assert ref == int8


@needs_kernels
def test_chunked_prompts_over_a_shared_prefix_int8_compiled_equals_reference(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts chunked 24 tokens a step (a chunk's context read from the int8 pool), four sharing a
    52-token prefix the pool holds (cascade forced on): the same greedy tokens on the compiled backend,
    which reads int8 in place (no scratch), as on the reference, which dequantizes."""
    groups = count_cascade_groups(monkeypatch)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 250, (52,), generator=g).tolist()
    first = {"p0": prefix + torch.randint(3, 250, (9,), generator=g).tolist()}
    rest = {f"p{i}": prefix + torch.randint(3, 250, (3 + 11 * i,), generator=g).tolist() for i in range(1, 4)}
    rest["solo"] = torch.randint(3, 250, (61,), generator=g).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("compiled", "reference"):
        engine = _engine(ckpt, "int8", backend, max_num_tokens=24)
        outs[backend] = {**run_to_completion(engine, first, params), **run_to_completion(engine, rest, params)}
        cache = engine.runner.kv_caches[0]
        assert isinstance(cache, Int8KvCache)
        assert (cache.scratch.allocated_bytes == 0) == (backend == "compiled")
        if backend == "compiled":
            assert max(groups) > 0  # the cached prefix was read once for its sharers
    assert outs["compiled"] == outs["reference"]


def test_pool_holds_more_tokens_in_one_budget(ckpt: Path) -> None:
    cfg = model_config(ckpt)
    budget = 64 << 20
    blocks = {}
    for dtype, bytes_, kv in (("fp32", 4, "auto"), ("bf16", 2, "auto"), ("int8", 4, "int8")):
        kvc = KvCacheConfig(tokens_per_block=TPB, memory_budget_bytes=budget, kv_cache_free_gpu_mem_fraction=1.0,
                            kv_cache_dtype=kv)
        blocks[dtype] = kvc.num_blocks(cfg.kv_bytes_per_token(bytes_, kv))
    d = cfg.head_size
    assert blocks["int8"] / blocks["fp32"] == pytest.approx(4 * d / (d + 2), rel=0.01)
    assert blocks["int8"] / blocks["bf16"] == pytest.approx(2 * d / (d + 2), rel=0.01)
    caches = allocate_kv_cache(cfg, 4, TPB, torch.float32, torch.device("cpu"), "int8")
    assert isinstance(caches[0], Int8KvCache) and caches[0][0].dtype == torch.int8


def test_disk_tier_round_trip_int8_blocks(ckpt: Path, tmp_path: Path) -> None:
    """Blocks written by an int8 engine come back (values and scales) with the same tokens; a fp32
    engine over the same store never reads them (its fingerprint names another layout)."""
    prompt = list(range(5, 5 + 8 * TPB + 3))
    weights = tmp_path / "weights" / "model.safetensors"
    weights.parent.mkdir()
    shutil.copyfile(ckpt / "model.safetensors", weights)
    store = tmp_path / "store"
    first = _engine(ckpt, "int8", tiers=[DiskStore(store, 1 << 26)], weights=weights)
    out, _ = run_one(first, "a", prompt)
    first.close()
    again = _engine(ckpt, "int8", tiers=[DiskStore(store, 1 << 26)], weights=weights)
    out2, reused = run_one(again, "b", prompt)
    again.close()
    assert reused == 8 and out2 == out
    other = _engine(ckpt, "auto", tiers=[DiskStore(store, 1 << 26)], weights=weights)
    _, reused_fp32 = run_one(other, "c", prompt)
    other.close()
    assert reused_fp32 == 0


def test_plan_refuses_int8_kv_off_torch_and_sizes_the_pool(ckpt: Path) -> None:
    pc = read_checkpoint(ckpt).pretrained_config
    with pytest.raises(PlanError, match="kv_cache_dtype int8"):
        make_plan(pc, Profile(kv_cache_dtype="int8"), "trtllm", "float32")
    auto = make_plan(pc, Profile(), "torch", "float32", kv_budget_bytes=1 << 26, budget_source="test")
    int8 = make_plan(pc, Profile(kv_cache_dtype="int8"), "torch", "float32", kv_budget_bytes=1 << 26,
                     budget_source="test")
    assert int8.kv_cache_dtype == "int8"
    d = model_config(ckpt).head_size
    assert int8.memory.kv_bytes_per_token * 4 * d == auto.memory.kv_bytes_per_token * (d + 2)
    assert int8.memory.kv_cache_tokens is not None and auto.memory.kv_cache_tokens is not None
    assert int8.memory.kv_cache_tokens > 3 * auto.memory.kv_cache_tokens
