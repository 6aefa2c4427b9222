"""The served side by side of guided decoding (docs/structured-outputs.md, "Measuring"): the schema suite's
prompts at concurrency C against any OpenAI-compatible server (`trtprompt serve`'s OpenAI port, vLLM's
api_server), through the official openai client in threads, each request `chat.completions.create` with
`response_format` json_schema, greedy, against the same requests unconstrained; output tok/s (the usage's
completion tokens over the run's wall time) of each, in pairs of alternating order, medians.

    python -m trtprompt.bench.guided_served --base-url http://127.0.0.1:8003/v1 --label trtprompt
    python -m trtprompt.bench.guided_served --base-url http://127.0.0.1:8010/v1 --label vllm

Run the two servers one after the other on the same quiet machine (same checkpoint, same cores) and compare
the two JSON files' `json_schema.median_output_tok_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench.guided import markdown, summary
from trtprompt.bench.openai_client import API_KEY_ENVS
from trtprompt.bench.schemas import SUITE, SchemaCase

VARIANTS = ("json_schema", "unconstrained")


def api_key() -> str:
    """The key the servers check ($TRTPROMPT_API_KEY for trtprompt serve, $OPENAI_API_KEY), else a placeholder."""
    return next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), "unused")


def response_format(case: SchemaCase) -> dict[str, Any]:
    """OpenAI's json_schema response format: the case's schema inside the {"name", "schema", "strict"} wrapper."""
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}


def one(client: Any, model: str, case: SchemaCase, variant: str, max_tokens: int) -> dict[str, Any]:
    extra = {"response_format": response_format(case)} if variant == "json_schema" else {}
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": case.prompt}],
                                           max_tokens=max_tokens, temperature=0.0, seed=0, **extra)
    choice = reply.choices[0]
    return {"latency_s": time.perf_counter() - t0, "finish_reason": choice.finish_reason,
            "completion_tokens": reply.usage.completion_tokens if reply.usage else 0,
            "content": choice.message.content or ""}


def run_variant(client: Any, model: str, cases: Sequence[SchemaCase], variant: str, concurrency: int,
                max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda c: one(client, model, c, variant, max_tokens), cases))
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in replies)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "mean_output_tokens": tokens / len(cases),
            "median_latency_s": statistics.median(r["latency_s"] for r in replies),
            "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in replies)), "replies": replies}


def valid_share(cases: Sequence[SchemaCase], replies: Sequence[dict[str, Any]]) -> float | None:
    """Of the guided replies that finished ("stop"), the share that parses and validates."""
    import jsonschema

    finished = [(c, r) for c, r in zip(cases, replies) if r["finish_reason"] == "stop"]
    good = 0
    for case, reply in finished:
        try:
            good += jsonschema.Draft202012Validator(case.schema).is_valid(json.loads(reply["content"]))
        except ValueError:
            pass
    return good / len(finished) if finished else None


def served(base_url: str, model: str | None = None, requests: int = 64, concurrency: int = 16,
           max_tokens: int = 128, reps: int = 3) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key(), max_retries=0, timeout=600)
    model = model or client.models.list().data[0].id
    cases = [SUITE[i % len(SUITE)] for i in range(requests)]
    # Warm-up, outside the pairs: every schema compiles on the server (each server caches its grammars).
    cold = run_variant(client, model, cases, "json_schema", concurrency, max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for variant in VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS)):
            runs[variant].append(run_variant(client, model, cases, variant, concurrency, max_tokens))
    ratios = sorted(g["output_tok_s"] / u["output_tok_s"] for g, u in zip(runs["json_schema"], runs["unconstrained"]))
    result: dict[str, Any] = {"setup": {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
                                        "reps": reps}, "base_url": base_url, "model": model}
    for variant, rs in runs.items():
        result[variant] = summary(rs)
    result["json_schema"]["cold_output_tok_s"] = cold["output_tok_s"]
    result["json_schema"]["finished_valid"] = valid_share(cases, runs["json_schema"][-1]["replies"])
    result["ratio"] = {"median": statistics.median(ratios), "all": ratios}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8003/v1")
    ap.add_argument("--model", help="default: the first model GET /v1/models lists")
    ap.add_argument("--label", default="server", help="names the output file: bench-results/guided-served-LABEL.json")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="pairs of (json_schema, unconstrained) runs")
    ap.add_argument("--out", type=Path, help="default: bench-results/guided-served-LABEL.json")
    args = ap.parse_args()
    result = served(args.base_url, args.model, args.requests, args.concurrency, args.max_tokens, args.reps)
    result["label"] = args.label
    out = args.out or Path(f"bench-results/guided-served-{args.label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    print(markdown({k: v for k, v in result.items() if k in (*VARIANTS, "ratio", "setup")}))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
