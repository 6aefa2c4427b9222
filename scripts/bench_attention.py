#!/usr/bin/env python3
"""Attention paths side by side in one run: gather reference vs pure torch vs compiled in-place kernel.

    python scripts/bench_attention.py ENGINE_DIR [--only prefix,long] [--threads 2]

prefix: 64 x (1,024 shared prompt tokens + 32 unique) -> 16 tokens, reuse on, the
        prefix new to the cache, per backend (wall time, mean TTFT, prefill tokens).
long:   16 sequences decoding over 8,192 cached tokens each: attention of one
        decode step (all layers) per backend, against one read of their KV at the
        machine's memory read bandwidth, measured in the same run.
Prints Markdown and writes JSON to --out (default bench-results/attention.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trtprompt.bench import offline
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata, paged_attention
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.loader import engine_config, read_engine_files
from trtprompt.engine.request import SamplingParams

BACKENDS = ("reference", "torch", "compiled")


def prefix(engine_dir: Path, reps: int) -> dict:
    out: dict = {}
    for backend in BACKENDS:
        engine = LLMEngine.from_engine_dir(engine_dir, max_num_tokens=2048, attention_backend=backend)
        vocab = engine.model_config.vocab_size
        offline.warm(engine, vocab)
        runs = []
        for r in range(reps):  # a new prefix each rep: never in the cache yet
            pre = offline.token_workload(100 + r, vocab, [1024])[0]
            res = offline.drive(engine, offline.token_workload(200 + r, vocab, [32] * 64, pre),
                                SamplingParams(max_tokens=16))
            res.pop("outputs")
            runs.append(res)
        out[backend] = {k: statistics.median(x[k] for x in runs) for k in ("wall_s", "mean_ttft_s", "prefill_tokens")}
    return out


def read_bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    """Memory read bandwidth: sum over a buffer far larger than the caches (median of reps)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def long_decode(engine_dir: Path, seqs: int = 16, context: int = 8192, reps: int = 5) -> dict:
    cfg = engine_config(read_engine_files(engine_dir), {"max_tokens_in_paged_kv_cache": 1 << 20})
    mc, tpb = cfg.model, cfg.kv_cache.tokens_per_block
    blocks = -(-(context + 1) // tpb)
    (kc, vc), = allocate_kv_cache(mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1}),
                                  seqs * blocks, tpb, torch.float32, torch.device("cpu"))
    kc.normal_(), vc.normal_()
    order = torch.randperm(seqs * blocks).tolist()  # scattered blocks, as after a while of serving
    slices = [SeqSlice(context, 1, order[s * blocks:(s + 1) * blocks]) for s in range(seqs)]
    q = torch.randn(seqs, mc.num_attention_heads, mc.head_size)
    k = torch.randn(seqs, mc.num_key_value_heads, mc.head_size)
    kv_bytes = 2 * seqs * (context + 1) * mc.num_key_value_heads * mc.head_size * 4
    out: dict = {"kv_bytes_per_layer": kv_bytes, "layers": mc.num_hidden_layers,
                 "read_bandwidth_gbs": read_bandwidth_gbs()}
    for backend in BACKENDS:
        meta = build_attention_metadata(slices, tpb, torch.device("cpu"), backend=backend)
        paged_attention(q, k, k, (kc, vc), meta, mc.head_size ** -0.5)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            paged_attention(q, k, k, (kc, vc), meta, mc.head_size ** -0.5)
            times.append(time.perf_counter() - t)
        out[backend] = {"step_attention_ms": statistics.median(times) * 1e3 * mc.num_hidden_layers}
    one_read_ms = kv_bytes * mc.num_hidden_layers / (out["read_bandwidth_gbs"] * 1e9) * 1e3
    out["one_kv_read_ms"] = one_read_ms
    for backend in BACKENDS:
        out[backend]["x_one_read"] = out[backend]["step_attention_ms"] / one_read_ms
    return out


def markdown(results: dict) -> str:
    lines = []
    if "prefix" in results:
        p = results["prefix"]
        lines += ["| backend | wall s | mean TTFT s | prefill tokens | vs reference |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {b} | {p[b]['wall_s']:.2f} | {p[b]['mean_ttft_s']:.2f} | {p[b]['prefill_tokens']:.0f} | "
                  f"{p['reference']['wall_s'] / p[b]['wall_s']:.2f}x |" for b in BACKENDS]
    if "long" in results:
        lg = results["long"]
        lines += ["", f"read bandwidth {lg['read_bandwidth_gbs']:.1f} GB/s; one read of the KV "
                  f"({lg['kv_bytes_per_layer'] * lg['layers'] / 1e9:.2f} GB) {lg['one_kv_read_ms']:.1f} ms",
                  "| backend | attention per decode step ms | x one KV read |", "| --- | --- | --- |"]
        lines += [f"| {b} | {lg[b]['step_attention_ms']:.1f} | {lg[b]['x_one_read']:.2f} |" for b in BACKENDS]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--only", default="prefix,long", help="comma-separated: prefix, long")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (medians reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=Path("bench-results/attention.json"), help="JSON results file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wanted = args.only.split(",")
    results: dict = {}
    if "prefix" in wanted:
        results["prefix"] = prefix(args.engine_dir, args.reps)
    if "long" in wanted:
        results["long"] = long_decode(args.engine_dir, reps=args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(markdown(results))


if __name__ == "__main__":
    main()
