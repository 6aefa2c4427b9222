#!/usr/bin/env python3
"""kv_cache_dtype int8 against the fp32 KV cache on SmolLM2-135M-Instruct, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.kv_int8 [--parts memory,speed,quality]
        [--prompts 32] [--tokens 64] [--reps 2] [--engines build/bench-int8]

memory: the float scratch an int8 engine holds (the float copy of one layer's pool the torch and
reference backends read the int8 rows through; before every compiled step read int8 in place, every
engine allocated it at start), its bytes after a prefill + decode run on the default backend, and
the pools' bytes.
speed: output tok/s of 32 x (128 in, 64 out) greedy prompts cut from the held-out text, and the wall
time of a chunked workload (16 x (512 cached shared + 200 unique) -> 16 out, 256 tokens a step: chunked
context, mixed prefill + decode steps, cascade over the shared prefix), reps alternating fp32 / int8.
quality: greedy agreement over the chat prompts (position match, common prefix, teacher-forced
top-1: the int8 engine fed fp32's own sequence) and perplexity on the int8 scenario's held-out text.
Both engines are fp32 weights; only the KV cache differs. Reuses the int8 scenario's pieces (_quality.py). Writes
<engines>/kv-int8.json (or --json) and prints it. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench import machine
from trtprompt.bench.machine import ROOT
from trtprompt.bench.scenarios import _quality as shared

KV_DTYPES = ("auto", "int8")
PARTS = ("memory", "speed", "quality")
# The chunked workload: a shared prefix the pool holds (warmed once), unique tails new every rep.
SHARED, UNIQUE, CHUNKED_REQUESTS, CHUNKED_OUT, CHUNK_TOKENS = 512, 200, 16, 16, 256


def _load(args: argparse.Namespace, kv: str, **overrides: Any) -> Any:
    """The SmolLM2 engine with this KV cache dtype (built under --engines when absent), opened."""
    from trtprompt.engine.engine import LLMEngine

    build = {"max_seq_len": 2048, "max_num_tokens": 2048, "max_batch_size": 32, "kv_cache_dtype": kv}
    return LLMEngine.from_engine_dir(shared.built(args.checkpoint, args.engines / f"smollm2-kv-{kv}", "none", build),
                                     **overrides)


def memory(args: argparse.Namespace, engine: Any, text: list[int]) -> dict[str, Any]:
    """The int8 engine's scratch: its size, and what it holds after a prefill + decode run."""
    caches = engine.runner.kv_caches
    scratch = caches[0].scratch
    pool = sum(t.nbytes for layer in caches for t in layer)
    shared.run_greedy(engine, [text[i * 128:(i + 1) * 128] for i in range(8)], 8)  # prefill and decode steps
    fp32_pool = sum(t.numel() // (t.shape[-1]) * (t.shape[-1] - 2) * 4 for layer in caches for t in layer)
    return {"attention_backend": engine.attention_backend, "int8_pool_bytes": pool,
            "fp32_pool_bytes_same_blocks": fp32_pool, "scratch_bytes_if_allocated": scratch.nbytes,
            "scratch_share_of_int8_pool": scratch.nbytes / pool,
            "scratch_bytes_allocated_after_run": scratch.allocated_bytes}


def _chunked_prompts(text: list[int], rep: int) -> list[list[int]]:
    """The shared prefix, then tails of the held-out text starting where no other rep's start (37 tokens
    apart: their first blocks differ, so only the prefix is reused)."""
    prefix = text[:SHARED]
    tails = [text[SHARED + ((rep * CHUNKED_REQUESTS + i) * 37) % (len(text) - SHARED - UNIQUE):][:UNIQUE]
             for i in range(CHUNKED_REQUESTS)]
    return [prefix + t for t in tails]


def _rep(engine: Any, workload: str, text: list[int], rep: int, tokens: int) -> float:
    """Output tok/s of the offline batch, or wall seconds of the chunked workload."""
    if workload == "offline":
        toks, wall = shared.run_greedy(engine, [text[i * 128:(i + 1) * 128] for i in range(32)], tokens)
        return sum(map(len, toks)) / wall
    t0 = time.perf_counter()
    shared.run_greedy(engine, _chunked_prompts(text, rep), CHUNKED_OUT)
    return time.perf_counter() - t0


def speed(args: argparse.Namespace, engines: dict[str, dict[str, Any]], text: list[int]) -> dict[str, Any]:
    res: dict[str, Any] = {"offline": "32 x (128 in, 64 out), greedy, prompts cut from the held-out text",
                           "chunked": f"{CHUNKED_REQUESTS} x ({SHARED} cached shared + {UNIQUE} unique) -> "
                                      f"{CHUNKED_OUT} out, max_num_tokens {CHUNK_TOKENS}"}
    for workload, unit in (("offline", "output_tok_s"), ("chunked", "wall_s")):
        for kv in KV_DTYPES:  # warm-up at full size; the chunked one also caches the shared prefix
            _rep(engines[workload][kv], workload, text, -1, args.tokens)
        runs: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
        for i in range(args.reps):
            for kv in (KV_DTYPES if i % 2 == 0 else KV_DTYPES[::-1]):
                runs[kv].append(_rep(engines[workload][kv], workload, text, i, args.tokens))
                print(f"{workload} rep {i} kv {kv}: {runs[kv][-1]:.2f} {unit} (load {os.getloadavg()[0]:.2f})",
                      flush=True)
        med = {kv: statistics.median(v) for kv, v in runs.items()}
        res[f"{workload}_{unit}"] = runs
        res[f"{workload}_int8_over_fp32"] = med["int8"] / med["auto"]
    return res


def quality(args: argparse.Namespace, engines: dict[str, Any], tok: Any, text: list[int]) -> dict[str, Any]:
    prompts = [tok.encode(shared.CHAT.format(topic=t), add_special_tokens=False).ids
               for t in shared.TOPICS[:args.prompts]]
    ref, _ = shared.run_greedy(engines["auto"], prompts, args.tokens)
    got, _ = shared.run_greedy(engines["int8"], prompts, args.tokens)
    forced = shared.teacher_forced(engines["int8"], prompts, ref)
    ppl = {kv: shared.perplexity(e, text) for kv, e in engines.items()}
    return {"held_out": f"{shared.HELD_OUT} (first {len(text)} tokens)",
            "agreement": {**shared.agreement(ref, got), "teacher_forced_top1": forced},
            "ppl": ppl, "ppl_increase": ppl["int8"] / ppl["auto"] - 1}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "build/smollm2")
    ap.add_argument("--engines", type=Path, default=shared.OUT, help="where the two engines are (built if absent)")
    ap.add_argument("--json", type=Path, default=None, help="where the results go (default <engines>/kv-int8.json)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    args.parts = args.parts.split(",")
    if not set(args.parts) <= set(PARTS):
        ap.error(f"--parts takes {', '.join(PARTS)}, got {','.join(args.parts)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from tokenizers import Tokenizer

    args = _args(argv)
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    text = tok.encode(shared.HELD_OUT.read_text(encoding="utf-8"), add_special_tokens=False).ids[:shared.PPL_TOKENS]
    engines = {kv: _load(args, kv) for kv in KV_DTYPES}
    res: dict[str, Any] = {"cpu": shared.cpu_line(), "machine": machine.describe(),
                           "utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_at_start": os.getloadavg(),
                           "pool_blocks": {kv: e.kv.pool.num_blocks for kv, e in engines.items()}}
    if "memory" in args.parts:
        res["memory"] = memory(args, engines["int8"], text)
    if "speed" in args.parts:
        chunked = {kv: _load(args, kv, max_num_tokens=CHUNK_TOKENS) for kv in KV_DTYPES}
        res["speed"] = speed(args, {"offline": engines, "chunked": chunked}, text)
    if "quality" in args.parts:
        res["quality"] = quality(args, engines, tok, text)
    res["load_at_end"] = os.getloadavg()
    out = args.json or args.engines / "kv-int8.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
