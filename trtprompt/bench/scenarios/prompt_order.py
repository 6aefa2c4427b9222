"""Prompt order and KV-block reuse: a templated workload run in its original order and in the
order `trtprompt lint` suggests, side by side, through the embedded engine.

    python -m trtprompt.bench.scenarios.prompt_order engines/demo [--requests 200] [--docs 10] [--concurrency 4]

Workload: "question + request id, then instructions + document" (the variable part first);
each document is shared by requests/docs requests. lint's suggestion puts the shared text
first. For each order: lint's estimate, the engine's reused blocks, prefill tokens computed,
mean/p50 TTFT (arrival -> first token, engine clock) and wall time. Writes JSON to --out and
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from trtprompt.bench import machine
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams
from trtprompt.prompt.lint import analyze
from trtprompt.prompt.lint_input import LintPrompt
from trtprompt.tokenizer import Tokenizer

INSTRUCTIONS = (
    "You are an analyst. Read the document below and answer the question at the end.\n"
    "Quote the sentence that supports your answer, then give the answer in one line.\n"
    "If the document does not contain the answer, say so and do not guess.\n"
    "Write plain text without lists or headings, and keep the whole reply short.\n")
WORDS = tuple("market revenue region quarter growth stores online margin cost supplier contract team "
              "product launch customer retention price forecast budget risk audit policy review plan".split())


def document(rng: random.Random, lines: int, words: int) -> str:
    """`lines` numbered sections of `words` random words each."""
    return "".join(f"Section {i + 1}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"
                   for i in range(lines))


def workload(requests: int, docs: int, seed: int) -> list[str]:
    """The variable part first: question and request id, then the instructions and a shared document."""
    rng = random.Random(seed)
    documents = [document(rng, 12, 18) for _ in range(docs)]
    out = []
    for i in range(requests):
        question = f"Question {i}: what does the document say about {rng.choice(WORDS)} and {rng.choice(WORDS)}?"
        rid = uuid.UUID(int=rng.getrandbits(128), version=4)
        out.append(f"{question}\nRequest id: {rid}\n{INSTRUCTIONS}{documents[i % docs]}")
    return out


def run(engine_dir: Path, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Closed loop: `concurrency` requests in flight, in order; per-request stats from the engine."""
    engine = LLMEngine.from_engine_dir(engine_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    warm = [7 + i for i in range(40)]  # touch the kernels once; shares no block with the workload
    engine.add_request("warmup", warm, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    finals: list[Any] = []
    nxt, in_flight = 0, 0
    start = time.perf_counter()
    while nxt < len(prompts) or in_flight:
        while in_flight < concurrency and nxt < len(prompts):
            engine.add_request(f"r{nxt}", prompts[nxt], params)
            nxt, in_flight = nxt + 1, in_flight + 1
        for out in engine.step():
            if out.finished:
                finals.append(out)
                in_flight -= 1
    wall = time.perf_counter() - start
    ttft = [(o.stats.first_token_time_ns - o.stats.arrival_time_ns) / 1e6 for o in finals]
    return {"requests": len(finals), "prompt_tokens": sum(len(p) for p in prompts),
            "reused_blocks": sum(o.stats.kv_cache_reused_blocks for o in finals),
            "prefill_tokens_computed": sum(o.stats.prefill_tokens_computed for o in finals),
            "mean_ttft_ms": statistics.fmean(ttft), "p50_ttft_ms": statistics.median(ttft),
            "wall_s": wall}


def markdown(res: dict[str, Any]) -> str:
    rows = ["| order | lint estimate: reusable (blocks) | reused blocks | prefill tokens computed | "
            "mean TTFT ms | p50 TTFT ms | wall s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("original", "suggested"):
        r = res[name]
        rows.append(f"| {name} | {r['lint_reusable_fraction']:.1%} ({r['lint_reused_blocks']}) | "
                    f"{r['reused_blocks']} | {r['prefill_tokens_computed']} of {r['prompt_tokens']} | "
                    f"{r['mean_ttft_ms']:.1f} | {r['p50_ttft_ms']:.1f} | {r['wall_s']:.1f} |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--docs", type=int, default=10, help="distinct documents (each shared by requests/docs)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-results/prompt_order.json"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_dir(args.engine_dir / "tokenizer")
    tpb = json.loads((args.engine_dir / "config.json").read_text())["build_config"]["plugin_config"][
        "tokens_per_block"]
    texts = workload(args.requests, args.docs, args.seed)
    report = analyze([LintPrompt(i + 1, text=t) for i, t in enumerate(texts)], tok, tpb)
    res: dict[str, Any] = {"load_before": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
                           "machine": machine.describe(), "tokens_per_block": tpb,
                           "breaks": sorted({s.kind for s in report.spans})}
    for name, est, prompts in (("original", report.estimate, report.ids),
                               ("suggested", report.suggested_estimate,
                                [tok.encode(p.text or "") for p in report.suggested])):
        res[name] = {"lint_reusable_fraction": est.reusable_fraction, "lint_reused_blocks": est.reused_blocks,
                     **run(args.engine_dir, prompts, args.concurrency, args.max_tokens)}
    res["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2), encoding="utf-8")
    print(markdown(res))
    print(f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}")


if __name__ == "__main__":
    main()
