#!/usr/bin/env python3
"""kv_cache_dtype int8 against the fp32 KV cache on SmolLM2-135M-Instruct, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_kv_int8.py [--prompts 32] [--tokens 64] [--reps 2]

Quality: greedy agreement over the prompts (position match, common prefix, teacher-forced top-1:
the int8 engine fed fp32's own sequence) and perplexity on bench_int8.py's held-out text.
Speed: the same greedy batch, reps alternating fp32 / int8, output tok/s each (load average printed).
Both engines are fp32 weights; only the KV cache differs. Reuses bench_int8.py's pieces.
Writes build/bench-int8/kv-int8.json and prints Markdown. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_int8 as b  # noqa: E402


def main(argv: Sequence[str] | None = None) -> None:
    from tokenizers import Tokenizer

    from trtprompt.engine.engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "build/smollm2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    overrides = {"max_seq_len": 2048, "max_num_tokens": 2048, "max_batch_size": 32}
    engines = {kv: LLMEngine.from_engine_dir(b.built(args.checkpoint, b.OUT / f"smollm2-kv-{kv}", "none",
                                                     {**overrides, "kv_cache_dtype": kv}))
               for kv in ("auto", "int8")}
    prompts = [tok.encode(b.CHAT.format(topic=t), add_special_tokens=False).ids for t in b.TOPICS[:args.prompts]]
    text = tok.encode(b.HELD_OUT.read_text(encoding="utf-8"), add_special_tokens=False).ids[:b.PPL_TOKENS]
    res: dict[str, Any] = {"cpu": b.cpu_line(), "held_out": f"{b.HELD_OUT} (first {len(text)} tokens)",
                           "pool_blocks": {kv: e.kv.pool.num_blocks for kv, e in engines.items()}}
    ref, _ = b.run_greedy(engines["auto"], prompts, args.tokens)
    got, _ = b.run_greedy(engines["int8"], prompts, args.tokens)
    forced = b._teacher_forced(engines["int8"], prompts, ref)
    res["agreement"] = {**b._agreement(ref, got), "teacher_forced_top1": forced}
    res["ppl"] = {kv: b.perplexity(e, text) for kv, e in engines.items()}
    res["ppl_increase"] = res["ppl"]["int8"] / res["ppl"]["auto"] - 1
    speed: dict[str, list[float]] = {kv: [] for kv in engines}
    for i in range(args.reps):
        for kv in (("auto", "int8") if i % 2 == 0 else ("int8", "auto")):
            toks, wall = b.run_greedy(engines[kv], prompts, args.tokens)
            speed[kv].append(sum(map(len, toks)) / wall)
            print(f"rep {i} kv {kv}: {speed[kv][-1]:.1f} output tok/s (load {os.getloadavg()[0]:.2f})", flush=True)
    res["output_tok_s"] = speed
    res["ratio_int8_over_fp32"] = statistics.median(speed["int8"]) / statistics.median(speed["auto"])
    b.OUT.mkdir(parents=True, exist_ok=True)
    (b.OUT / "kv-int8.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
