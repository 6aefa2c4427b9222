"""The compiled prefill kernel (kernels.paged_prefill: blocked GEMMs over KV blocks in place, online
softmax) equals plain softmax attention, and greedy tokens through it equal transformers'.

Segments long enough to span several query tiles and key tiles, causal and unmasked, GQA and MHA,
head sizes with and without a compiled-in constant, float32 and bfloat16; then a tiny engine with
chunked prompts of several hundred tokens sharing a prefix (cascade forced on). Design:
docs/attention.md.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine_helpers import (VOCAB, count_cascade_groups, hf_greedy, make_engine, make_hf_model,
                                  prefill_segments, run_to_completion)
from trtprompt.engine import cascade, kernels
from trtprompt.engine.attention import SeqSlice, build_attention_metadata, paged_attention
from trtprompt.engine.request import SamplingParams

COMPILED, WHY = kernels.compiled_kernel_status()
pytestmark = pytest.mark.skipif(not COMPILED, reason=f"compiled kernel unavailable here: {WHY}")


def softmax_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limits: torch.Tensor):
    """(out [n, H, d], lse [n, H]) of q [n, H, d] against keys/values [kv_heads, L, d]; row i sees keys < limits[i]."""
    heads, kv_heads, d = q.shape[1], keys.shape[0], q.shape[2]
    k = keys.float().repeat_interleave(heads // kv_heads, 0)
    v = values.float().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hkd->hnk", q.float(), k) * d ** -0.5
    hidden = torch.arange(keys.shape[1])[None, :] >= limits[:, None]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1), torch.logsumexp(scores, -1).transpose(0, 1)


CASES = [  # heads, kv_heads, head_size, tokens_per_block, dtype
    (9, 3, 64, 32, torch.float32),  # SmolLM2's shape: the d = 64 build
    (8, 4, 128, 16, torch.float32),  # the d = 128 build
    (4, 4, 48, 8, torch.float32),  # MHA, head size from the run-time path
    (16, 2, 80, 128, torch.float32),
    (8, 2, 64, 32, torch.bfloat16),  # bf16 dot products where the CPU has avx512_bf16 (head sizes of 32s)
    (9, 3, 64, 32, torch.bfloat16),
    (8, 4, 128, 16, torch.bfloat16),
    (4, 4, 48, 8, torch.bfloat16),  # off the bf16 dot path: the float32 one
]


@pytest.mark.parametrize("heads,kv_heads,head_size,tpb,dtype", CASES)
def test_prefill_kernel_fast_paths_equal_reference(heads, kv_heads, head_size, tpb, dtype) -> None:
    """Each segment's rows (several query and key tiles: 96 columns, 128 keys) against their blocks."""
    rng = random.Random(heads * 100 + head_size + tpb)
    torch.manual_seed(rng.randrange(1 << 30))
    num_blocks = 800 // tpb + 40
    kc = torch.randn(num_blocks, kv_heads, tpb, head_size).to(dtype)
    vc = torch.randn(num_blocks, kv_heads, tpb, head_size).to(dtype)
    # (context, new tokens, causal): a prompt, a chunk after context, a short chunk, a cascade-like group
    shapes = [(0, 230, True), (150, 97, True), (37, 5, True), (3 * tpb, 70, False)]
    segments, tables, table_t, start = prefill_segments(shapes, num_blocks, tpb, rng)
    q = torch.randn(start, heads, head_size).to(dtype)
    out, lse = kernels.paged_prefill(q, kc, vc, table_t, torch.tensor(segments), head_size ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for (row, n, keys, first), table in zip(segments, tables):
        ks = kc[table].transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :keys]
        vs = vc[table].transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :keys]
        want, want_lse = softmax_attention(q[row:row + n], ks, vs, torch.clamp(first + torch.arange(n), max=keys))
        assert (out[row:row + n].float() - want).abs().max().item() < tol
        assert (lse[row:row + n] - want_lse).abs().max().item() < 1e-4


def test_long_chunks_and_cascade_equal_the_gather_reference(monkeypatch) -> None:
    """Through the engine's metadata: long chunks after shared prefix blocks, decodes beside them."""
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)
    torch.manual_seed(3)
    tpb, kv_heads, heads, d = 16, 3, 9, 64
    kc, vc = torch.randn(120, kv_heads, tpb, d), torch.randn(120, kv_heads, tpb, d)
    ids = torch.randperm(120).tolist()
    shared = ids[:10]
    seqs = [SeqSlice(160, 140, shared + ids[10:29]), SeqSlice(170, 1, shared + ids[29:40]),
            SeqSlice(165, 33, shared + ids[40:53]), SeqSlice(0, 200, ids[53:66])]
    t = sum(s.num_new_tokens for s in seqs)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)

    def run(backend: str) -> torch.Tensor:
        meta = build_attention_metadata(seqs, tpb, torch.device("cpu"), backend=backend)
        return paged_attention(q, k, v, (kc.clone(), vc.clone()), meta, d ** -0.5)

    fast = build_attention_metadata(seqs, tpb, torch.device("cpu"), backend="compiled")
    assert fast.chunks is not None and len(fast.groups) == 1 and fast.groups[0].table is not None
    assert (run("compiled") - run("reference")).abs().max().item() < 1e-5


def test_long_shared_prompts_keep_transformers_greedy_tokens(tmp_path_factory, monkeypatch) -> None:
    """Chunked prompts of 300-420 tokens, three sharing 300: the kernel's chunks and cascade stay exact."""
    groups = count_cascade_groups(monkeypatch)
    path = make_hf_model(tmp_path_factory.mktemp("hf"), "llama")
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, VOCAB, (300,), generator=g).tolist()
    prompts = {"a": prefix + torch.randint(3, VOCAB, (120,), generator=g).tolist(),
               "b": prefix + torch.randint(3, VOCAB, (45,), generator=g).tolist(),
               "c": torch.randint(3, VOCAB, (310,), generator=g).tolist()}
    expected = {rid: hf_greedy(path, tuple(p), 8) for rid, p in prompts.items()}
    engine = make_engine(path, chunked=True, max_num_tokens=128, tokens_per_block=16, max_seq_len=512,
                         attention_backend="compiled")
    params = SamplingParams(max_tokens=8)
    assert run_to_completion(engine, {"a": prompts["a"]}, params) == {"a": expected["a"]}
    # Then a again, b and c together: a's and b's rows attend to the cached shared blocks as a cascade.
    rest = {"a-again": prompts["a"], "b": prompts["b"], "c": prompts["c"]}
    assert run_to_completion(engine, rest, params) == {"a-again": expected["a"], "b": expected["b"],
                                                       "c": expected["c"]}
    assert max(groups) > 0
