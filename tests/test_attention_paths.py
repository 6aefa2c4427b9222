"""The fast attention paths (compiled in-place kernel, pure torch, cascade) equal the gather reference.

Random block tables over a shuffled pool, decodes and prefill chunks mixed,
with and without shared prefix blocks, GQA and MHA, head sizes 48-256,
tokens_per_block 8-128, float32 and bfloat16.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from trtprompt.engine import cascade, kernels
from trtprompt.engine.attention import (
    SeqSlice,
    build_attention_metadata,
    paged_attention,
    resolve_attention_backend,
)
from trtprompt.engine.attention_int8 import dequantize_rows, quantize_rows
from trtprompt.engine.cascade import SharedPrefix, find_shared_prefixes

COMPILED, WHY = kernels.compiled_kernel_status()
needs_kernel = pytest.mark.skipif(not COMPILED, reason=f"compiled kernel unavailable here: {WHY}")


def make_step(rng: random.Random, tpb: int, num_blocks: int, shared_blocks: int,
              shapes: list[tuple[int, int]]) -> list[SeqSlice]:
    """Sequences (context_len, new tokens) over a shuffled pool; the first shared_blocks are common."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared_blocks)]
    seqs = []
    for ctx, n in shapes:
        own = -(-(ctx + n) // tpb) - (len(prefix) if ctx >= len(prefix) * tpb else 0)
        table = (prefix if ctx >= len(prefix) * tpb else []) + [free.pop() for _ in range(own)]
        seqs.append(SeqSlice(ctx, n, table))
    return seqs


def random_step(rng: random.Random, tpb: int, shared: int, shapes: list[tuple[int, int]],
                heads: tuple[int, int, int], dtype: torch.dtype):
    """(seqs, caches, q, k, v) of one random step; heads = (heads, kv_heads, head_size)."""
    num_heads, kv_heads, head_size = heads
    num_blocks = 64 + 8 * (128 // tpb)
    seqs = make_step(rng, tpb, num_blocks, shared, shapes)
    shape = (num_blocks, kv_heads, tpb, head_size)
    caches = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    t = sum(s.num_new_tokens for s in seqs)
    q = torch.randn(t, num_heads, head_size).to(dtype)
    k, v = torch.randn(t, kv_heads, head_size).to(dtype), torch.randn(t, kv_heads, head_size).to(dtype)
    return seqs, caches, q, k, v


def run_backend(backend: str, seqs: list[SeqSlice], tpb: int, caches, q, k, v, dtype) -> torch.Tensor:
    kc, vc = caches[0].clone(), caches[1].clone()
    meta = build_attention_metadata(seqs, tpb, torch.device("cpu"), backend=backend, dtype=dtype)
    return paged_attention(q, k, v, (kc, vc), meta, q.shape[-1] ** -0.5)


CASES = [  # heads, kv_heads, head_size, tokens_per_block, dtype
    (8, 4, 64, 16, torch.float32),
    (8, 8, 64, 8, torch.float32),
    (12, 4, 48, 32, torch.float32),
    (4, 1, 256, 8, torch.float32),
    (16, 2, 128, 128, torch.float32),
    (8, 4, 64, 16, torch.bfloat16),  # bf16 dot products where the CPU has avx512_bf16 (head sizes of 32s)
    (8, 2, 128, 32, torch.bfloat16),
    (12, 4, 48, 32, torch.bfloat16),  # a head size off the bf16 dot path: the float32 one
]


@pytest.mark.parametrize("heads,kv_heads,head_size,tpb,dtype", CASES)
@pytest.mark.parametrize("shared", [0, 3])
def test_fast_paths_equal_reference(monkeypatch, heads, kv_heads, head_size, tpb, dtype, shared) -> None:
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)  # cascade on whenever blocks are shared
    rng = random.Random(heads * 1000 + tpb + shared)
    torch.manual_seed(rng.randrange(1 << 30))
    p = shared * tpb
    shapes = [(p + 5, 1), (p + tpb, 1), (p + 3 * tpb - 1, 1), (2, 1), (0, 7), (p + 1, 9), (p + 2, 1), (tpb + 3, 2 * tpb)]
    seqs, caches, q, k, v = random_step(rng, tpb, shared, shapes, (heads, kv_heads, head_size), dtype)
    want = run_backend("reference", seqs, tpb, caches, q, k, v, dtype).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    backends = ["torch"] + (["compiled"] if COMPILED else [])
    for backend in backends:
        meta = build_attention_metadata(seqs, tpb, torch.device("cpu"), backend=backend, dtype=dtype)
        assert len(meta.groups) == (1 if shared else 0), backend  # the cascade really ran when blocks are shared
        got = run_backend(backend, seqs, tpb, caches, q, k, v, dtype).float()
        assert (got - want).abs().max().item() < tol, backend


@pytest.mark.parametrize("heads,kv_heads,head_size,tpb,dtype", [CASES[0], CASES[2], CASES[5]])
@pytest.mark.parametrize("shapes,back_to_back", [
    ([(0, 9), (0, 9), (0, 9), (5, 1), (40, 1)], True),  # same-length prompts, then decodes
    ([(0, 9), (37, 1), (0, 9), (3, 9)], False),  # equal chunks with a decode between
])
def test_equal_short_chunks_need_no_padding(heads, kv_heads, head_size, tpb, dtype, shapes, back_to_back) -> None:
    rng = random.Random(len(shapes) * 31 + tpb)
    torch.manual_seed(rng.randrange(1 << 30))
    seqs, caches, q, k, v = random_step(rng, tpb, 0, shapes, (heads, kv_heads, head_size), dtype)
    want = run_backend("reference", seqs, tpb, caches, q, k, v, dtype).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for backend in ["torch"] + (["compiled"] if COMPILED else []):
        meta = build_attention_metadata(seqs, tpb, torch.device("cpu"), backend=backend, dtype=dtype)
        if backend == "torch":  # the compiled kernel takes every chunk in one call, padding none
            small = meta.small
            assert small is not None and small.mask is None and small.valid is None
            assert (small.rows_start is not None) == back_to_back
        got = run_backend(backend, seqs, tpb, caches, q, k, v, dtype).float()
        assert (got - want).abs().max().item() < tol, backend


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_log_sum_exp_is_exact(dtype) -> None:
    torch.manual_seed(0)
    tpb, kv_heads, heads, d = 16, 2, 4, 64
    kc, vc = torch.randn(10, kv_heads, tpb, d).to(dtype), torch.randn(10, kv_heads, tpb, d).to(dtype)
    q = torch.randn(2, heads, d).to(dtype)
    tables = torch.tensor([[3, 7, 1], [9, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([37, 5], dtype=torch.int32)
    out, lse = kernels.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    for s in range(2):
        keys = kc[tables[s].long()].transpose(0, 1).reshape(kv_heads, -1, d)[:, :lens[s]].float()
        vals = vc[tables[s].long()].transpose(0, 1).reshape(kv_heads, -1, d)[:, :lens[s]].float()
        for h in range(heads):
            scores = keys[h // 2] @ q[s, h].float() * d ** -0.5
            assert lse[s, h].item() == pytest.approx(torch.logsumexp(scores, 0).item(), abs=1e-4)
            want = torch.softmax(scores, 0) @ vals[h // 2]
            assert (out[s, h].float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


# Group sizes 1-8 (query heads per kv head), head sizes 64 and 128, blocks of 8-32 tokens (12: not a multiple of 8).
DECODE_SHAPES = [(1, 4, 64, 16), (2, 4, 64, 32), (3, 3, 64, 32), (4, 2, 128, 16), (8, 1, 64, 8), (3, 2, 128, 12)]


def _paged_decode_case(g: int, kv_heads: int, d: int, tpb: int, cache: str, lens: torch.Tensor):
    """(q, k_cache, v_cache, tables, lens, keys, values) on scattered blocks; every cache slot past a sequence's
    length holds NaN (int8: bytes of 127, a NaN scale), which must never reach a result. keys/values: each
    sequence's rows [kv_heads, len, d] as the kernel reads them."""
    width = -(-int(lens.max()) // tpb)
    blocks = len(lens) * width + 3
    tables = torch.randperm(blocks, dtype=torch.int32)[:len(lens) * width].view(len(lens), width).contiguous()
    rows = torch.randn(2, blocks, kv_heads, tpb, d) * torch.tensor([2.0, 1.0]).view(2, 1, 1, 1, 1)
    if cache == "int8":
        stored = quantize_rows(rows)
        seen = dequantize_rows(stored, torch.float32)
        stored = stored.clone()
    else:
        stored = rows.to(getattr(torch, cache))
        seen = stored.float()
    for s, n in enumerate(lens.tolist()):  # poison the slots no sequence has filled
        for b in range(width):
            stored[:, tables[s, b], :, max(0, min(tpb, n - b * tpb)):] = 127 if cache == "int8" else float("nan")
    keys, values = [], []
    for s, n in enumerate(lens.tolist()):
        got = seen[:, tables[s].long()].transpose(1, 2).reshape(2, kv_heads, -1, d)[:, :, :n]
        keys.append(got[0]), values.append(got[1])
    q = torch.randn(len(lens), g * kv_heads, d).to(torch.float32 if cache == "int8" else getattr(torch, cache))
    return q, stored[0].contiguous(), stored[1].contiguous(), tables, lens, keys, values


def _check_decode(g: int, kv_heads: int, d: int, tpb: int, cache: str, lens: torch.Tensor) -> None:
    q, kc, vc, tables, lens, keys, values = _paged_decode_case(g, kv_heads, d, tpb, cache, lens)
    op = kernels.paged_decode_int8 if cache == "int8" else kernels.paged_decode
    out, lse = op(q, kc, vc, tables, lens, d ** -0.5)
    tol = 2e-2 if cache in ("bfloat16", "float16") else 1e-5
    for s, n in enumerate(lens.tolist()):
        for h in range(g * kv_heads):
            if n == 0:  # nothing to attend to: zeros, and a log-sum-exp that merges as weight 0
                assert lse[s, h].item() == float("-inf") and not out[s, h].float().abs().max().item()
                continue
            scores = keys[s][h // g] @ q[s, h].float() * d ** -0.5
            assert lse[s, h].item() == pytest.approx(torch.logsumexp(scores, 0).item(), abs=1e-4)
            want = torch.softmax(scores, 0) @ values[s][h // g]
            assert (out[s, h].float() - want).abs().max().item() < tol, (s, h)


@needs_kernel
@pytest.mark.parametrize("g,kv_heads,d,tpb", DECODE_SHAPES)
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
def test_decode_kernel_per_group_size_equals_reference_with_log_sum_exp(g, kv_heads, d, tpb, cache) -> None:
    """paged_decode (paged_decode_int8 on int8 rows) against softmax(q K^T) V per head in torch; lengths 0 to 3
    blocks + 7, differing per sequence."""
    torch.manual_seed(g * 100 + d + tpb)
    lens = torch.tensor([1, 5, tpb - 1, tpb, tpb + 1, 0, 3 * tpb + 7, 97], dtype=torch.int32)
    _check_decode(g, kv_heads, d, tpb, cache, lens)


@needs_kernel
@pytest.mark.parametrize("g,kv_heads", [(3, 1), (2, 2)])
@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_decode_kernel_parts_of_few_long_sequences_merge_by_log_sum_exp(g, kv_heads, cache) -> None:
    """Under 8 (sequence, kv head) items the kernel cuts sequences of 16 blocks or more into parts, one item
    each (csrc/paged_attention.cpp, parts_per_sequence): here 3 or 2 parts, a short and an empty sequence
    among them leaving parts empty."""
    torch.manual_seed(g)
    _check_decode(g, kv_heads, 64, 16, cache, torch.tensor([1000, 5, 0], dtype=torch.int32))


def test_shared_prefixes_found_from_block_tables_alone() -> None:
    tables = [[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 8, 3], [9, 4], [5, 6, 7, 11]]
    cached = [3, 3, 3, 1, 2]
    # Four members sharing 2 blocks save more reads (3 x 2) than two sharing 3 (1 x 3).
    assert find_shared_prefixes(tables, cached, 256) == [SharedPrefix((0, 1, 2, 4), 2)]
    # With sequence 4 caching 3 blocks too, three members share 3 (2 x 3 reads saved).
    assert find_shared_prefixes(tables, [3, 3, 3, 1, 3], 256) == [SharedPrefix((0, 1, 4), 3)]
    # Only cached blocks may be shared; a sequence alone shares nothing.
    assert find_shared_prefixes(tables, [0, 0, 0, 1, 0], 256) == []
    # Too little saved: no cascade.
    assert find_shared_prefixes([[1, 2], [1, 3]], [1, 1], 8) == []


def test_resolution_falls_back_to_torch_and_names_why(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "compiled_kernel_status", lambda: (False, "no C++ compiler"))
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, 64, 16) == "torch"
    with pytest.raises(ValueError, match="attention_backend 'compiled' is unavailable: no C\\+\\+ compiler"):
        resolve_attention_backend("compiled", cpu, 64, 16)
    assert resolve_attention_backend("auto", cpu, 60, 16) == "torch"  # head size the kernel can't tile
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", cpu)


def test_build_without_a_compiler_reports_unavailable(tmp_path) -> None:
    """A machine without a C++ compiler gets a clear status, not a crash (checked in a fresh process)."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = "from trtprompt.engine import kernels; print(kernels.compiled_kernel_status())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("(False, "), out.stdout
