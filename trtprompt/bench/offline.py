"""In-process engine benchmarks: prefix reuse, throughput vs transformers, chunked context, overhead.

Each scenario runs its variants side by side in one process, on the same
seeded token workload, and returns plain dicts for the report.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams

Workload = list[list[int]]


def token_workload(seed: int, vocab: int, lengths: list[int], prefix: list[int] | None = None) -> Workload:
    rng = random.Random(seed)
    return [list(prefix or []) + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def drive(engine: LLMEngine, prompts: Workload, params: SamplingParams,
          on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Submit everything at once and step to completion; per-request timing from the engine's stats."""
    t0 = time.perf_counter()
    t0_ns = time.time_ns()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, arrival_time_ns=t0_ns)
    finals = []
    step = 0
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
        step += 1
        if on_step is not None:
            on_step(step)
    wall = time.perf_counter() - t0
    ttft = [(o.stats.first_token_time_ns - o.stats.arrival_time_ns) / 1e9 for o in finals]
    return {
        "wall_s": wall,
        "output_tokens": sum(o.num_output_tokens for o in finals),
        "output_tok_s": sum(o.num_output_tokens for o in finals) / wall,
        "prefill_tokens": sum(o.stats.prefill_tokens_computed for o in finals),
        "reused_blocks": sum(o.stats.kv_cache_reused_blocks for o in finals),
        "mean_ttft_s": statistics.fmean(ttft),
        "outputs": {o.request_id: o for o in finals},
    }


def warm(engine: LLMEngine, vocab: int) -> None:
    """One short request so lazy initialisation stays out of the timings."""
    drive(engine, token_workload(0, vocab, [64]), SamplingParams(max_tokens=4))


def prefix_reuse(engine_dir: Path, n: int = 64, prefix_len: int = 1024, suffix_len: int = 32,
                 out_len: int = 16, max_num_tokens: int = 2048) -> dict[str, Any]:
    results: dict[str, Any] = {"max_num_tokens": max_num_tokens}
    for reuse in (True, False):
        engine = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=reuse,
                                           max_num_tokens=max_num_tokens)
        vocab = engine.model_config.vocab_size
        warm(engine, vocab)
        prefix = token_workload(1, vocab, [prefix_len])[0]
        prompts = token_workload(2, vocab, [suffix_len] * n, prefix)
        r = drive(engine, prompts, SamplingParams(max_tokens=out_len))
        r.pop("outputs")
        results["reuse=on" if reuse else "reuse=off"] = r
    on, off = results["reuse=on"], results["reuse=off"]
    results["prefill_tokens_drop"] = 1 - on["prefill_tokens"] / off["prefill_tokens"]
    results["ttft_speedup"] = off["mean_ttft_s"] / on["mean_ttft_s"]
    return results


def throughput(engine_dir: Path, hf_dir: Path | None, n: int = 32, prompt_len: int = 128,
               out_len: int = 64, with_sequential: bool = True) -> dict[str, Any]:
    engine = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=False)
    vocab = engine.model_config.vocab_size
    warm(engine, vocab)
    prompts = token_workload(3, vocab, [prompt_len] * n)
    # end_id outside the prompt distribution: every request produces exactly out_len tokens.
    params = SamplingParams(max_tokens=out_len, end_id=0)
    r = drive(engine, prompts, params)
    r.pop("outputs")
    results: dict[str, Any] = {"trtprompt": r}
    if hf_dir is not None:
        results.update(transformers_baselines(hf_dir, prompts, out_len, with_sequential))
        for key in ("transformers_sequential", "transformers_generate_batch"):
            if key in results:
                results[f"speedup_vs_{key}"] = r["output_tok_s"] / results[key]["output_tok_s"]
    return results


def transformers_baselines(hf_dir: Path, prompts: Workload, out_len: int,
                           with_sequential: bool) -> dict[str, Any]:
    import transformers

    from trtprompt.bench.baselines import continuous_batching_config

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                              dtype=torch.float32).eval()
    gen = transformers.GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    out: dict[str, Any] = {}
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), generation_config=gen)  # warm-up
        if with_sequential:
            t0 = time.perf_counter()
            toks = sum(model.generate(torch.tensor([p]), generation_config=gen).shape[1] - len(p)
                       for p in prompts)
            wall = time.perf_counter() - t0
            out["transformers_sequential"] = {"wall_s": wall, "output_tokens": toks, "output_tok_s": toks / wall}
        cb = continuous_batching_config(prompts, out_len, max_batch_tokens=2048)
        t0 = time.perf_counter()
        res = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        wall = time.perf_counter() - t0
        toks = sum(len(g.generated_tokens) for g in res.values())
        out["transformers_generate_batch"] = {"wall_s": wall, "output_tokens": toks, "output_tok_s": toks / wall}
    return out


def chunked_context(engine_dir: Path, n_decoders: int = 8, long_len: int = 2048,
                    chunk_budget: int = 256, out_len: int = 48) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for chunked in (True, False):
        budget = chunk_budget if chunked else long_len + 64
        engine = LLMEngine.from_engine_dir(engine_dir, enable_chunked_context=chunked, max_num_tokens=budget,
                                           enable_kv_cache_reuse=False)
        vocab = engine.model_config.vocab_size
        warm(engine, vocab)
        results["chunked=on" if chunked else "chunked=off"] = _itl_under_long_prompt(
            engine, vocab, n_decoders, long_len, out_len) | {"max_num_tokens": budget}
    on, off = results["chunked=on"], results["chunked=off"]
    results["p99_itl_ratio"] = off["p99_itl_s"] / on["p99_itl_s"]
    return results


def _itl_under_long_prompt(engine: LLMEngine, vocab: int, n: int, long_len: int,
                           out_len: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=out_len, end_id=0)
    for i, p in enumerate(token_workload(4, vocab, [32] * n)):
        engine.add_request(f"d{i}", p, params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    long_added = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id.startswith("d") and o.new_token_ids:
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
        if not long_added and len(last) == n:
            # The decoders are all generating: now the long prompt arrives.
            engine.add_request("long", token_workload(5, vocab, [long_len])[0], SamplingParams(max_tokens=4))
            long_added = True
    gaps.sort()
    return {"itl_samples": len(gaps), "p50_itl_s": gaps[len(gaps) // 2],
            "p99_itl_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], "max_itl_s": gaps[-1]}


def step_overhead(engine_dir: Path, batch: int = 32, context: int = 128, steps: int = 30) -> dict[str, Any]:
    """Pure decode step of the engine vs the bare model forward on identical inputs."""
    engine = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=False)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps * 3, end_id=0)
    for i, p in enumerate(token_workload(6, vocab, [context] * batch)):
        engine.add_request(f"r{i}", p, params)
    while any(r.num_output == 0 for r in engine.requests.values()):
        engine.step()
    engine_times, bare_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        engine_times.append(time.perf_counter() - t0)
        bare_times.append(_bare_forward_time(engine))
    e, b = statistics.median(engine_times), statistics.median(bare_times)
    return {"batch": batch, "engine_step_ms": e * 1e3, "bare_forward_ms": b * 1e3, "ratio": e / b}


def _bare_forward_time(engine: LLMEngine) -> float:
    """Time the model alone on the decode batch the engine just ran.

    Rewrites the same K/V values into the same slots, so engine state is untouched.
    """
    from trtprompt.engine.attention import SeqSlice

    reqs = list(engine.requests.values())
    ids = torch.tensor([r.all_token_ids[-2] for r in reqs])
    pos = torch.tensor([r.num_tokens - 2 for r in reqs])
    slices = [SeqSlice(r.num_tokens - 2, 1, engine.kv.block_ids(r.request_id)) for r in reqs]
    rows = torch.arange(len(slices))
    with torch.inference_mode():
        t0 = time.perf_counter()
        meta = engine.runner.metadata(slices)
        engine.runner.model(ids, pos, meta, engine.runner.kv_caches, rows)
        return time.perf_counter() - t0
