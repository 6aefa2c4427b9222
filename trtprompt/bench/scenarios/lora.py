"""Issue 41's throughput targets: many LoRA adapters in one batch against the base model alone.

    python -m trtprompt.bench.scenarios.lora ENGINE_DIR CHECKPOINT [--requests 32] [--prompt 128] [--output 64]
        [--adapters 8] [--rank 16] [--reps 2] [--out FILE]

One engine (speculative decoding off, the peers' conditions), three workloads of --requests requests of
--prompt random tokens and --output greedy tokens each, all submitted at once: the base model alone, every
request with the same adapter, and the requests spread round-robin over --adapters adapters (each of rank
--rank on all seven linears, made with PEFT on CHECKPOINT). The workloads are interleaved rep by rep so
drift on the machine hits each alike; output tokens per second is the median of --reps. The ratios to the
base model, the targets' (>= 0.8x with 8 adapters, >= 0.9x with one), are the median of each rep's ratio to
that rep's base run, measured a few seconds apart: on a shared VM the base rate itself drifts by a third
between reps. Prints JSON with the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from trtprompt.bench import machine
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams


def make_adapters(checkpoint: Path, out: Path, count: int, rank: int) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    made = {}
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                          init_lora_weights=False))
        model.save_pretrained(out / f"adapter{i}")
        made[f"adapter{i}"] = str(out / f"adapter{i}")
    return made


def run(engine: LLMEngine, prompts: list[list[int]], output: int, loras: list[str | None], tag: str) -> float:
    """Output tokens per second of all prompts submitted at once."""
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{tag}-{i}", prompt, params, lora=lora)
    started, tokens = time.perf_counter(), 0
    while engine.requests:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path, help="a torch-target engine directory")
    ap.add_argument("checkpoint", type=Path, help="its Hugging Face checkpoint (the adapters are made on it)")
    ap.add_argument("--requests", type=int, default=32, help="requests per workload")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--adapters", type=int, default=8, help="adapters in the mixed workload")
    ap.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each workload, interleaved")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.prompt)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(args.checkpoint, Path(tmp), args.adapters, args.rank)
        engine = LLMEngine.from_engine_dir(args.engine, lora_modules=adapters, speculative_decoding="none",
                                           enable_kv_cache_reuse=False, max_loras=max(8, args.adapters))
        names = sorted(adapters)
        workloads: dict[str, list[str | None]] = {
            "base": [None] * args.requests, "one_adapter": [names[0]] * args.requests,
            f"{args.adapters}_adapters": [names[i % len(names)] for i in range(args.requests)]}
        run(engine, prompts[:4], 8, [None] * 4, "warm")
        rates: dict[str, list[float]] = {w: [] for w in workloads}
        for rep in range(args.reps):
            for name, loras in workloads.items():
                rates[name].append(run(engine, prompts, args.output, loras, f"{name}-{rep}"))
    medians = {w: statistics.median(r) for w, r in rates.items()}
    per_rep = {w: [r / b for r, b in zip(rates[w], rates["base"])] for w in rates if w != "base"}
    result: dict[str, Any] = {"tok_s": medians, "reps": rates, "ratio_per_rep": per_rep,
                              "ratio_to_base": {w: statistics.median(r) for w, r in per_rep.items()},
                              "args": {k: str(v) for k, v in vars(args).items()}}
    machine.print_and_write(result, args.out)


if __name__ == "__main__":
    main()
