#!/usr/bin/env python3
"""Engine benchmarks of the embedded torch target, each A/B measured side by side in one run.

    python -m trtprompt.bench.scenarios.engine ENGINE_DIR --hf-dir CHECKPOINT \
        [--only prefix,throughput,chunked,overhead,sequences,logprobs,guided]

Writes JSON to --out (default bench-results/engine.json) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from trtprompt.bench import guided, machine, offline, request_features

SCENARIOS = ("prefix", "throughput", "chunked", "overhead", "sequences", "logprobs", "guided")


def markdown(results: dict[str, Any]) -> str:
    """Every number of every scenario as a row: scenario, variant, metric, value."""
    lines = ["| scenario | variant | metric | value |", "| --- | --- | --- | --- |"]
    for scenario, res in results.items():
        for variant, val in res.items():
            if isinstance(val, dict):
                for k, v in val.items():
                    if isinstance(v, (int, float)):
                        lines.append(f"| {scenario} | {variant} | {k} | {v:.4g} |")
            elif isinstance(val, (int, float)):
                lines.append(f"| {scenario} | — | {variant} | {val:.4g} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--hf-dir", type=Path, help="source checkpoint, for the transformers baselines")
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-sequential", action="store_true", help="skip the slow sequential generate baseline")
    ap.add_argument("--out", type=Path, default=Path("bench-results/engine.json"))
    return ap.parse_args()


def run(args: argparse.Namespace, wanted: list[str]) -> dict[str, Any]:
    """The scenarios asked for, in SCENARIOS' order."""
    results: dict[str, Any] = {}
    if "prefix" in wanted:
        results["prefix"] = offline.prefix_reuse(args.engine_dir)
    if "throughput" in wanted:
        results["throughput"] = offline.throughput(args.engine_dir, args.hf_dir,
                                                   with_sequential=not args.no_sequential)
    if "chunked" in wanted:
        results["chunked"] = offline.chunked_context(args.engine_dir)
    if "overhead" in wanted:
        results["overhead"] = {"decode": offline.step_overhead(args.engine_dir)}
    if "sequences" in wanted:
        results["sequences"] = request_features.sequences(args.engine_dir)
    if "logprobs" in wanted:
        results["logprobs"] = request_features.logprobs(args.engine_dir)
    if "guided" in wanted:  # issue 38's targets; sizes and families: python -m trtprompt.bench.guided --help
        results["guided"] = guided.run(args.engine_dir)
    return results


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    results = run(args, args.only.split(","))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**results, "machine": machine.describe()}, indent=2, default=str),
                        encoding="utf-8")
    print(markdown(results))


if __name__ == "__main__":
    main()
