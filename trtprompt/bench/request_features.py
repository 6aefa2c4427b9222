"""In-process benchmarks of issue 37's request features, each measured against its plain variant
side by side in one run (scripts/bench_engine.py --only sequences,logprobs; BENCHMARKS.md):

- `sequences`: one request of n sequences on a long prompt (prefilled once, its blocks forked)
  against n separate requests with KV reuse off;
- `logprobs`: a batch asking for the top-k log probabilities of every token against the same
  batch without them.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from trtprompt.bench.offline import drive, token_workload, warm
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams


def sequences(engine_dir: Path, n: int = 4, prompt_len: int = 1000, out_len: int = 16,
              reps: int = 3) -> dict[str, Any]:
    """Best wall time of `reps` runs per variant, variants interleaved so drift hits both alike."""
    forked = LLMEngine.from_engine_dir(engine_dir)
    separate = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=False)
    vocab = forked.model_config.vocab_size
    for engine in (forked, separate):
        warm(engine, vocab)
    results: dict[str, Any] = {"n": n, "prompt_len": prompt_len, "out_len": out_len}
    best: dict[str, dict[str, Any]] = {}
    for rep in range(reps):
        prompt = token_workload(10 + rep, vocab, [prompt_len])[0]  # a new prompt each rep: nothing cached
        params = SamplingParams(max_tokens=out_len, temperature=1.0, top_p=1.0, seed=rep, ignore_eos=True)
        runs = {"n_sequences": _one_request(forked, prompt, params, n),
                "separate_reuse_off": drive(separate, [prompt] * n, params)}
        for name, r in runs.items():
            r.pop("outputs", None)
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    results.update(best)
    results["wall_ratio"] = best["n_sequences"]["wall_s"] / best["separate_reuse_off"]["wall_s"]
    return results


def _one_request(engine: LLMEngine, prompt: list[int], params: SamplingParams, n: int) -> dict[str, Any]:
    import dataclasses

    t0 = time.perf_counter()
    engine.add_request("n", prompt, dataclasses.replace(params, n=n))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.sequence_finished]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(o.num_output_tokens for o in finals),
            "prefill_tokens": sum(o.stats.prefill_tokens_computed for o in finals if o.sequence_index == 0)
            + sum(1 for o in finals if o.sequence_index > 0)}


def logprobs(engine_dir: Path, batch: int = 32, prompt_len: int = 128, out_len: int = 64, top: int = 5,
             reps: int = 7) -> dict[str, Any]:
    """Output tokens per second with and without top-`top` log probabilities: `reps` pairs run back to
    back, their order alternating, and the median of the pairs' ratios (whole runs on these 2-core VMs
    vary by +-15 %, more than the difference measured; a profile puts it at ~1.5 % of a step)."""
    engine = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=False)
    vocab = engine.model_config.vocab_size
    warm(engine, vocab)
    prompts = token_workload(3, vocab, [prompt_len] * batch)
    plain = SamplingParams(max_tokens=out_len, end_id=0)  # end_id 0 is never drawn: exact lengths
    asked = SamplingParams(max_tokens=out_len, end_id=0, logprobs=top)
    runs: dict[str, list[float]] = {"without": [], f"top_{top}": []}
    for rep in range(reps):
        order = [("without", plain), (f"top_{top}", asked)]
        for name, params in order if rep % 2 == 0 else reversed(order):
            runs[name].append(drive(engine, prompts, params)["output_tok_s"])
    ratios = sorted(w / wo for w, wo in zip(runs[f"top_{top}"], runs["without"]))
    return {"output_tok_s": runs, "median_ratio": statistics.median(ratios), "ratios": ratios}
