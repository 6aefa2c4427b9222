#!/usr/bin/env python3
"""Attention paths side by side in one run: gather reference vs pure torch vs compiled in-place kernel.

    python -m trtprompt.bench.scenarios.attention ENGINE_DIR [--only prefix,long] [--threads 2]

prefix: 64 x (1,024 shared prompt tokens + 32 unique) -> 16 tokens, reuse on, the
        prefix new to the cache, per backend (wall time, mean TTFT, prefill tokens).
long:   16 sequences decoding over 8,192 cached tokens each: attention of one
        decode step (all layers) per backend, against one read of their KV at the
        machine's memory read bandwidth, measured in the same run.
gemm:   GFLOP/s of one layer's prefill attention against the linears' in the same run,
        rounds interleaved, best of each: a 4,096-token causal prompt (--context), a
        512-token chunk after 3,584 cached tokens, and a cascade group (64 x 32 rows
        against 1,024 shared tokens); per backend (compiled kernel, torch = flash SDPA
        by parts) and a pure-torch blocked variant (baddbmm tiles, online softmax), vs
        a oneDNN prepacked [context x hidden] x [hidden x 1536] linear (--hidden).
        FLOPs: 4 * d per visible (query head, key) pair. Needs no engine; --heads.
Prints Markdown and writes JSON to --out (default bench-results/attention.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trtprompt.bench import machine, offline
from trtprompt.bench.host_speed import read_bandwidth_gbs
from trtprompt.engine import attention_paged, kernels
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata, paged_attention
from trtprompt.engine.attention_common import gather_blocks
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.loader import engine_config, read_engine_files
from trtprompt.engine.request import SamplingParams

BACKENDS = ("reference", "torch", "compiled")


def prefix(engine_dir: Path, reps: int) -> dict[str, Any]:
    """The shared-prefix burst per backend: medians over reps of wall time, mean TTFT, prefill tokens."""
    out: dict[str, Any] = {}
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


def long_decode(engine_dir: Path, seqs: int = 16, context: int = 8192, reps: int = 5) -> dict[str, Any]:
    """One decode step's attention over all layers per backend, against one read of the KV at read bandwidth."""
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
    out: dict[str, Any] = {"kv_bytes_per_layer": kv_bytes, "layers": mc.num_hidden_layers,
                 "read_bandwidth_gbs": read_bandwidth_gbs(1 << 30)}
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


def blocked_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_limit: int,
                  tile: int = 512) -> torch.Tensor:
    """Pure-torch blocked attention: q [n, H, d] tiles against k/v [kv_heads, L, d] tiles by baddbmm,
    online softmax, blocks past the causal limit skipped (row i sees keys < first_limit + i)."""
    n, heads, d = q.shape
    kv_heads, total, _ = k.shape
    g = heads // kv_heads
    out = torch.empty_like(q)
    for t0 in range(0, n, tile):
        nt = min(tile, n - t0)
        qt = q[t0:t0 + nt].view(nt, kv_heads, g, d).permute(1, 0, 2, 3).reshape(kv_heads, nt * g, d) * scale
        limit = min(total, first_limit + t0 + nt - 1)
        m = torch.full((kv_heads, nt * g, 1), float("-inf"))
        lsum = torch.zeros(kv_heads, nt * g, 1)
        acc = torch.zeros(kv_heads, nt * g, d)
        pos = (first_limit + t0 + torch.arange(nt)).repeat_interleave(g)[:, None]
        for k0 in range(0, limit, tile):
            kt, vt = k[:, k0:min(limit, k0 + tile)], v[:, k0:min(limit, k0 + tile)]
            s = torch.bmm(qt, kt.transpose(1, 2))
            if k0 + kt.shape[1] > first_limit + t0:
                s.masked_fill_((k0 + torch.arange(kt.shape[1]))[None, :] >= pos, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = (s - m_new).exp_()
            alpha = (m - m_new).exp_()
            lsum = lsum * alpha + p.sum(-1, keepdim=True)
            acc = torch.baddbmm(acc * alpha, p, vt)
            m = m_new
        out[t0:t0 + nt] = (acc / lsum).view(kv_heads, nt, g, d).permute(1, 0, 2, 3).reshape(nt, heads, d)
    return out


def _best(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _case(context: int, new: int, heads: int, kv_heads: int, d: int, tpb: int) -> dict[str, Any]:
    """One sequence with `context` cached tokens and `new` tokens in this step, scattered blocks."""
    blocks = -(-(context + new) // tpb)
    kc, vc = torch.randn(blocks + 4, kv_heads, tpb, d), torch.randn(blocks + 4, kv_heads, tpb, d)
    seqs = [SeqSlice(context, new, torch.randperm(blocks + 4)[:blocks].tolist())]
    q = torch.randn(new, heads, d)
    k, v = torch.randn(new, kv_heads, d), torch.randn(new, kv_heads, d)
    flops = 4 * d * heads * sum(min(context + i + 1, context + new) for i in range(new))
    return {"seqs": seqs, "cache": (kc, vc), "q": q, "k": k, "v": v, "flops": flops, "first": context + 1}


Timers = dict[str, dict[str, Callable[[], Any]]]


def gemm_cases(context: int, heads: int, kv_heads: int, d: int,
               tpb: int) -> tuple[Timers, dict[str, int]]:
    """Per case and path, the call to time, and each case's FLOPs."""
    cases = {"causal prompt": _case(0, context, heads, kv_heads, d, tpb),
             "chunk after context": _case(context - 512, 512, heads, kv_heads, d, tpb)}
    prefix, members, own = 1024, 64, 32
    # The cascade group: every member's rows attend to the shared blocks (the prefix part alone).
    cascade = _case(prefix, members * own, heads, kv_heads, d, tpb)
    cascade["flops"] = 4 * d * heads * prefix * members * own
    scale = d ** -0.5
    timers: Timers = {name: {} for name in [*cases, "cascade group"]}
    for name, c in cases.items():
        for backend in ("compiled", "torch"):
            meta = build_attention_metadata(c["seqs"], tpb, torch.device("cpu"), backend=backend)
            timers[name][backend] = functools.partial(paged_attention, c["q"], c["k"], c["v"], c["cache"], meta,
                                                      scale)
        kg = gather_blocks(c["cache"][0], torch.tensor(c["seqs"][0].block_table))
        vg = gather_blocks(c["cache"][1], torch.tensor(c["seqs"][0].block_table))
        timers[name]["torch blocked"] = functools.partial(blocked_torch, c["q"], kg, vg, scale, c["first"])
    timers["cascade group"] = cascade_timers(cascade, prefix, tpb, scale)
    return timers, {**{n: c["flops"] for n, c in cases.items()}, "cascade group": cascade["flops"]}


def cascade_timers(cascade: dict[str, Any], prefix: int, tpb: int, scale: float) -> dict[str, Callable[[], Any]]:
    cq, (ck, cv) = cascade["q"], cascade["cache"]
    ids = cascade["seqs"][0].block_table[:prefix // tpb]
    table, segs = torch.tensor([ids], dtype=torch.int32), torch.tensor([[0, len(cq), prefix, prefix]])
    kg, vg = gather_blocks(ck, torch.tensor(ids)), gather_blocks(cv, torch.tensor(ids))
    return {
        "compiled": lambda: kernels.paged_prefill(cq, ck, cv, table, segs, scale),
        "torch": lambda: attention_paged.attend_unmasked(cq, gather_blocks(ck, torch.tensor(ids)),
                                                         gather_blocks(cv, torch.tensor(ids)), scale),
        "torch blocked": lambda: blocked_torch(cq, kg, vg, scale, prefix + 1),
    }


def gemm(context: int, heads: int, kv_heads: int, d: int, hidden: int, tpb: int, rounds: int) -> dict[str, Any]:
    """GFLOP/s of prefill attention per path vs a oneDNN linear, best of interleaved rounds."""
    torch.manual_seed(0)
    x, w = torch.randn(context, hidden), torch.randn(1536, hidden)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    timers, flops = gemm_cases(context, heads, kv_heads, d, tpb)
    best: dict[str, float] = {}
    for _ in range(rounds):
        t = _best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 3)
        best["linear"] = min(best.get("linear", t), t)
        for name, paths in timers.items():
            for path, fn in paths.items():
                t = _best(fn, 2)
                best[f"{name}/{path}"] = min(best.get(f"{name}/{path}", t), t)
    linear_gflops = 2 * context * hidden * 1536 / best["linear"] / 1e9
    out: dict[str, Any] = {"linear_gflops": linear_gflops, "shape": [context, heads, kv_heads, d, hidden, tpb]}
    for name, paths in timers.items():
        out[name] = {p: {"ms": best[f"{name}/{p}"] * 1e3, "gflops": flops[name] / best[f"{name}/{p}"] / 1e9,
                         "x_linear": flops[name] / best[f"{name}/{p}"] / 1e9 / linear_gflops} for p in paths}
    return out


def markdown(results: dict[str, Any]) -> str:
    lines: list[str] = []
    if "prefix" in results:
        p = results["prefix"]
        lines += ["| backend | wall s | mean TTFT s | prefill tokens | vs reference |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {b} | {p[b]['wall_s']:.2f} | {p[b]['mean_ttft_s']:.2f} | {p[b]['prefill_tokens']:.0f} | "
                  f"{p['reference']['wall_s'] / p[b]['wall_s']:.2f}x |" for b in BACKENDS]
    if "long" in results:
        lg = results["long"]
        lines += ["", f"read bandwidth {lg['read_bandwidth_gbs']:.1f} GB/s; one read of the KV "
                  f"({lg['kv_bytes_per_layer'] * lg['layers'] / 1e9:.2f} GB) {lg['one_kv_read_ms']:.1f} ms",
                  "| backend | attention per decode step ms | x one KV read |", "| --- | --- | --- |"]
        lines += [f"| {b} | {lg[b]['step_attention_ms']:.1f} | {lg[b]['x_one_read']:.2f} |" for b in BACKENDS]
    if "gemm" in results:
        gm = results["gemm"]
        lines += ["", f"oneDNN linear {gm['linear_gflops']:.1f} GFLOP/s (shape: context, heads, kv heads, d, hidden, "
                  f"tpb = {gm['shape']})", "| case | path | ms | GFLOP/s | x linear |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {p} | {r['ms']:.1f} | {r['gflops']:.1f} | {r['x_linear']:.2f} |"
                  for name, paths in gm.items() if isinstance(paths, dict) for p, r in paths.items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path, nargs="?", help="engine directory (prefix and long need one)")
    ap.add_argument("--only", default="prefix,long", help="comma-separated: prefix, long, gemm")
    ap.add_argument("--context", type=int, default=4096, help="gemm: prompt tokens (and the linear's rows)")
    ap.add_argument("--heads", default="9,3,64", help="gemm: heads,kv_heads,head_size (default SmolLM2-135M's)")
    ap.add_argument("--hidden", type=int, default=576, help="gemm: the linear's input features")
    ap.add_argument("--tokens-per-block", type=int, default=32, help="gemm: KV block size")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (medians reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=Path("bench-results/attention.json"), help="JSON results file")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    wanted = args.only.split(",")
    results: dict[str, Any] = {"machine": machine.describe()}
    if "prefix" in wanted:
        results["prefix"] = prefix(args.engine_dir, args.reps)
    if "long" in wanted:
        results["long"] = long_decode(args.engine_dir, reps=args.reps)
    if "gemm" in wanted:
        if not kernels.compiled_kernel_status()[0]:
            raise SystemExit(f"gemm needs the compiled kernels: {kernels.compiled_kernel_status()[1]}")
        heads, kv_heads, d = (int(x) for x in args.heads.split(","))
        results["gemm"] = gemm(args.context, heads, kv_heads, d, args.hidden, args.tokens_per_block, args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(markdown(results))


if __name__ == "__main__":
    main()
