"""Time the bare model forward: a decode step of batch 32 and a 2048-token prefill.

Usage: .venv/bin/python -m trtprompt.bench.scenarios.model [--threads 2] [--dtype float32] [--backends onednn,reference]

The "small" demo shape (hidden 512, 8 layers, 8 heads, 4 kv heads,
intermediate 1376, vocab 8000) with random weights built in-process.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any, Callable

import torch

from trtprompt.bench import machine
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.model import DecoderModel

TPB = 32
SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8000, hidden_size=512, intermediate_size=1376,
                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_size=64,
                    max_position_embeddings=4096)


def random_weights(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a Llama checkpoint of cfg's shape, seeded; norms at one."""
    gen = torch.Generator().manual_seed(0)
    h, d, i = cfg.hidden_size, cfg.head_size, cfg.intermediate_size

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    t = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=dtype),
         "lm_head.weight": rnd(cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        t[p + "self_attn.q_proj.weight"] = rnd(cfg.num_attention_heads * d, h)
        t[p + "self_attn.k_proj.weight"] = rnd(cfg.num_key_value_heads * d, h)
        t[p + "self_attn.v_proj.weight"] = rnd(cfg.num_key_value_heads * d, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, cfg.num_attention_heads * d)
        t[p + "mlp.gate_proj.weight"] = rnd(i, h)
        t[p + "mlp.up_proj.weight"] = rnd(i, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, i)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    return t


def decode_step(model: DecoderModel, kv: list[Any], batch: int, context: int) -> Callable[[], object]:
    """One decode step of `batch` sequences with about `context` cached tokens each."""
    gen = random.Random(0)
    blocks_per_seq = (context + 64) // TPB + 1
    contexts = [gen.randint(context - 32, context + 32) for _ in range(batch)]
    seqs = [SeqSlice(c, 1, list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))) for s, c in enumerate(contexts)]
    ids = torch.randint(0, model.cfg.vocab_size, (batch,))
    pos = torch.tensor(contexts)
    rows = torch.arange(batch)

    def run() -> object:
        meta = build_attention_metadata(seqs, TPB, model.device)
        return model(ids, pos, meta, kv, rows)

    return run


def prefill(model: DecoderModel, kv: list[Any], tokens: int, context: int = 0) -> Callable[[], object]:
    """One sequence's `tokens` new tokens after `context` cached ones, the last row's logits."""
    seq = SeqSlice(context, tokens, list(range(-(-(context + tokens) // TPB))))
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,))
    pos = torch.arange(context, context + tokens)
    last = torch.tensor([tokens - 1])

    def run() -> object:
        meta = build_attention_metadata([seq], TPB, model.device)
        return model(ids, pos, meta, kv, last)

    return run


def best_times(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best seconds per case; cases run interleaved so every one sees the same machine load."""
    for fn in cases.values():
        fn()  # warm-up
    best = {name: float("inf") for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def model_cases(backends: list[str], dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """decode, prefill and chunk per backend, each over its own model and KV cache."""
    weights = random_weights(SMALL, dtype)
    cases: dict[str, Callable[[], object]] = {}
    for backend in backends:
        model = DecoderModel(SMALL, dtype, torch.device("cpu"), backend)
        model.load_weights(weights)
        kv = allocate_kv_cache(SMALL, 256, TPB, dtype, torch.device("cpu"))
        cases[f"{backend}/decode"] = decode_step(model, kv, 32, 160)
        cases[f"{backend}/prefill"] = prefill(model, kv, 2048)
        cases[f"{backend}/chunk"] = prefill(model, kv, 512, context=1536)
        print(f"{backend}: runs {model.linear_backend}")
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backends", default="onednn,reference")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    best = best_times(model_cases(backends, getattr(torch, args.dtype)), args.rounds)
    print(f"small Llama, {args.dtype}, {args.threads} threads, tokens_per_block {TPB}, "
          f"best of {args.rounds}, load average {os.getloadavg()[0]:.2f}; {machine.one_line()}")
    for backend in backends:
        dec, pre, chunk = (best[f"{backend}/{c}"] for c in ("decode", "prefill", "chunk"))
        print(f"{backend:>9}: decode b32 ctx~160 {dec * 1e3:6.1f} ms = {32 / dec:5.0f} tok/s | "
              f"prefill 2048 {pre * 1e3:6.0f} ms = {2048 / pre:5.0f} tok/s | "
              f"chunk 512 after 1536 {chunk * 1e3:5.0f} ms = {512 / chunk:5.0f} tok/s")


if __name__ == "__main__":
    main()
