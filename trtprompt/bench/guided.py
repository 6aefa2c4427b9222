"""In-process benchmarks of guided decoding against issue 38's targets (scripts/bench_engine.py --only guided,
or `python -m trtprompt.bench.guided ENGINE_DIR`; docs/structured-outputs.md, "Measuring"):

- `throughput`: the schema suite's prompts (chat template applied) at concurrency C (C requests in flight,
  a new one admitted as each finishes), greedy, each with its JSON schema, against the same requests
  unconstrained, and the guided requests again with jump-forward off (a second engine: the masking's own
  cost, forced tokens one model step each); output tok/s of each and the ratios. The variants run in
  rounds, their order rotating and reversing, and medians are reported: whole runs on these VMs vary by
  +-15 %.
- `compile`: a schema's first compile (a digest the cache has not seen) and a compile served from the
  cache (GuideCompiler.matcher, what admission pays), and the first mask of a fresh matcher (paid in the
  step loop), in ms, medians over the suite.
- `jump_forward`: the many-fixed-keys schemas, one request at a time, on two engines in this process,
  guided_jump_forward on and off, interleaved; latency per request and the ratio off / on.

The served side by side (any OpenAI-compatible server) is trtprompt/bench/guided_served.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from trtprompt.bench.schemas import FIXED_KEYS, SUITE, SchemaCase
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams

FAMILIES = ("throughput", "compile", "jump_forward")


@dataclass(frozen=True)
class Job:
    """One request of a run: its prompt's token ids, its parameters and the case it came from."""

    case: SchemaCase
    prompt: list[int]
    params: SamplingParams


def chat_prompts(engine: LLMEngine, cases: Sequence[SchemaCase]) -> list[list[int]]:
    """Each case's prompt as one user message through the engine's chat template (plain text without one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine.guides.tokenizer_dir), local_files_only=True)
    prompts = []
    for case in cases:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": case.prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(case.prompt))
    return prompts


def guided_params(case: SchemaCase, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, guide_type="json_schema", guide=case.schema_text)


def run_concurrent(engine: LLMEngine, jobs: Sequence[Job], concurrency: int, tag: str) -> dict[str, Any]:
    """Keep `concurrency` requests in flight until every job is done; output tok/s over the whole run."""
    waiting = deque(enumerate(jobs))
    started: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    latency: list[float] = []
    reasons: Counter[str] = Counter()

    def admit() -> None:
        i, job = waiting.popleft()
        rid = f"{tag}-{i}"
        started[rid] = time.perf_counter()
        engine.add_request(rid, job.prompt, job.params)

    t0 = time.perf_counter()
    while waiting and len(started) < concurrency:
        admit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:  # a failed request is a broken measurement, never a fast one
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                latency.append(time.perf_counter() - started[out.request_id])
                reasons[out.finish_reason.value if out.finish_reason else "none"] += 1
                if waiting:
                    admit()
    wall = time.perf_counter() - t0
    total = sum(len(t) for t in tokens.values())
    return {"wall_s": wall, "output_tokens": total, "output_tok_s": total / wall,
            "mean_output_tokens": total / len(jobs), "median_latency_s": statistics.median(latency),
            "finish_reasons": dict(reasons), "tokens": [tokens.get(f"{tag}-{i}", []) for i in range(len(jobs))]}


def finished_valid(engine: LLMEngine, jobs: Sequence[Job], tokens: Sequence[list[int]]) -> float | None:
    """Of the guided outputs that closed their JSON, the share that validates (None without jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine.guides.tokenizer_dir), local_files_only=True)
    checked = valid = 0
    for job, toks in zip(jobs, tokens):
        try:
            value = json.loads(tokenizer.decode(toks))
        except ValueError:
            continue  # truncated by max_tokens
        checked += 1
        valid += jsonschema.Draft202012Validator(job.case.schema).is_valid(value)
    return valid / checked if checked else None


def throughput(engine_dir: Path, requests: int = 64, concurrency: int = 16, max_tokens: int = 128,
               reps: int = 3) -> dict[str, Any]:
    """JSON-schema requests vs the same requests unconstrained, `reps` rounds, medians and the ratios.

    Forced tokens count as output (they are), so with jump-forward on the guided variant can pass the
    unconstrained one; `json_schema_no_jump_forward` (a second engine, guided_jump_forward off) is the
    masking's own cost, one model step per token as unconstrained decoding."""
    engines = {"on": LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=False),
               "off": LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=False, guided_jump_forward=False)}
    cases = [SUITE[i % len(SUITE)] for i in range(requests)]
    prompts = chat_prompts(engines["on"], cases)
    guided_jobs = [Job(c, p, guided_params(c, max_tokens)) for c, p in zip(cases, prompts)]
    variants: dict[str, tuple[LLMEngine, list[Job]]] = {
        "json_schema": (engines["on"], guided_jobs),
        "unconstrained": (engines["on"], [Job(c, p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
                                          for c, p in zip(cases, prompts)]),
        "json_schema_no_jump_forward": (engines["off"], guided_jobs),
    }
    # Warm-up, outside the rounds: the grammars compile (measured apart: `compile`) and llguidance builds its
    # lexer states lazily, on the first masks of each grammar, kept by the cached matcher every request of
    # the schema copies. The first guided run pays that and is reported alone as `cold`.
    cold = run_concurrent(engines["on"], guided_jobs, concurrency, "cold")
    run_concurrent(engines["off"], guided_jobs, concurrency, "cold")
    run_concurrent(engines["on"], variants["unconstrained"][1][:concurrency], concurrency, "warm")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):  # the order rotates and reverses (A B C, C B A, B C A, ...): drift hits all alike
        order = names[rep % 3:] + names[:rep % 3]
        for name in order if rep % 2 == 0 else reversed(order):
            engine, jobs = variants[name]
            runs[name].append(run_concurrent(engine, jobs, concurrency, f"{name}-{rep}"))
    result: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens}
    for name, rs in runs.items():
        result[name] = summary(rs)
    for name in ("json_schema", "json_schema_no_jump_forward"):
        ratios = sorted(g["output_tok_s"] / u["output_tok_s"] for g, u in zip(runs[name], runs["unconstrained"]))
        result[name]["finished_valid"] = finished_valid(engines["on"], guided_jobs, runs[name][-1]["tokens"])
        result[name]["ratio_to_unconstrained"] = statistics.median(ratios)
        result[name]["ratios"] = ratios
    result["json_schema"]["cold_output_tok_s"] = cold["output_tok_s"]
    return result


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"median_output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
            "output_tok_s": [r["output_tok_s"] for r in runs],
            "mean_output_tokens": statistics.fmean(r["mean_output_tokens"] for r in runs),
            "median_latency_s": statistics.median(r["median_latency_s"] for r in runs),
            "finish_reasons": runs[-1]["finish_reasons"]}


def compile_times(engine_dir: Path, reps: int = 3) -> dict[str, Any]:
    """First compile (an unseen digest), from the cache, and a fresh matcher's first mask, in ms."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    engine = LLMEngine.from_engine_dir(engine_dir)
    vocab = engine.guides.tokenizer().vocab_size  # made once, as on a server's first guided request
    first: dict[str, list[float]] = {c.name: [] for c in SUITE}
    cached, masks = [], []
    nonce = time.time_ns()
    for rep in range(reps):
        for case in SUITE:
            # A comment makes a digest the cache has not seen; the grammar is the case's own.
            params = guided_params(SchemaCase(case.name, {**case.schema, "$comment": f"{nonce}-{rep}"},
                                              case.prompt), 16)
            first[case.name].append(_ms(lambda: engine.guides.matcher(params)))
            cached.append(_ms(lambda: engine.guides.matcher(params)))
            matcher = engine.guides.matcher(params)
            mask = allocate_token_bitmask(1, vocab)
            masks.append(_ms(lambda: fill_next_token_bitmask(matcher, mask)))
    per_case = {name: statistics.median(v) for name, v in first.items()}
    slowest = max(per_case, key=per_case.__getitem__)
    return {"schemas": len(SUITE), "reps": reps,
            "first_ms": {**spread(list(per_case.values())), "slowest_case": slowest},
            # per case as [name, ms] pairs: a list, which the Markdown tables leave to the JSON
            "cached_ms": spread(cached), "first_mask_ms": spread(masks), "first_ms_per_case": list(per_case.items())}


def _ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def spread(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1]}


def jump_forward(engine_dir: Path, reps: int = 3, max_tokens: int = 384) -> dict[str, Any]:
    """Each many-fixed-keys request alone on an engine with jump-forward on and one with it off."""
    engines = {"on": LLMEngine.from_engine_dir(engine_dir, guided_jump_forward=True),
               "off": LLMEngine.from_engine_dir(engine_dir, guided_jump_forward=False)}
    prompts = chat_prompts(engines["on"], FIXED_KEYS)
    jobs = [Job(c, p, guided_params(c, max_tokens)) for c, p in zip(FIXED_KEYS, prompts)]
    for engine in engines.values():
        run_concurrent(engine, jobs[:1], 1, "warm")  # compiles its grammar, warms the engine
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {c.name: [] for c in FIXED_KEYS} for k in engines}
    for rep in range(reps):
        for i, job in enumerate(jobs):
            order = ["on", "off"] if (rep + i) % 2 == 0 else ["off", "on"]
            for name in order:
                runs[name][job.case.name].append(_alone(engines[name], job, f"{name}-{rep}-{i}"))
    result: dict[str, Any] = {"reps": reps, "max_tokens": max_tokens}
    ratios = []
    for name in engines:
        result[name] = {"median_latency_s": statistics.median(r["latency_s"] for rs in runs[name].values()
                                                             for r in rs),
                        "mean_steps": statistics.fmean(r["steps"] for rs in runs[name].values() for r in rs),
                        "mean_output_tokens": statistics.fmean(r["output_tokens"] for rs in runs[name].values()
                                                               for r in rs)}
    for case in FIXED_KEYS:
        on, off = runs["on"][case.name], runs["off"][case.name]
        ratios += [b["latency_s"] / a["latency_s"] for a, b in zip(on, off)]
        result[case.name] = {"on_latency_s": statistics.median(r["latency_s"] for r in on),
                             "off_latency_s": statistics.median(r["latency_s"] for r in off),
                             "same_text": on[0]["tokens"] == off[0]["tokens"],
                             "finish_reason": on[0]["finish_reason"]}
    result["speedup"] = {"median": statistics.median(ratios), "all": sorted(ratios)}
    return result


def _alone(engine: LLMEngine, job: Job, rid: str) -> dict[str, Any]:
    steps = engine.iteration_counter
    t0 = time.perf_counter()
    engine.add_request(rid, job.prompt, job.params)
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason.value if out.finished and out.finish_reason else reason
    return {"latency_s": time.perf_counter() - t0, "steps": engine.iteration_counter - steps,
            "output_tokens": len(tokens), "tokens": tokens, "finish_reason": reason}


def run(engine_dir: Path, families: Sequence[str] = FAMILIES, requests: int = 64, concurrency: int = 16,
        max_tokens: int = 128, reps: int = 3, fixed_keys_max_tokens: int = 384) -> dict[str, Any]:
    """What scripts/bench_engine.py --only guided reports: the families asked for, flat enough for its table."""
    results: dict[str, Any] = {}
    if "throughput" in families:
        t = throughput(engine_dir, requests, concurrency, max_tokens, reps)
        results.update({"throughput_json_schema": t["json_schema"], "throughput_unconstrained": t["unconstrained"],
                        "throughput_json_schema_no_jump_forward": t["json_schema_no_jump_forward"],
                        "throughput_ratio": t["json_schema"]["ratio_to_unconstrained"],
                        "throughput_setup": {k: t[k] for k in ("requests", "concurrency", "max_tokens")}})
    if "compile" in families:
        c = compile_times(engine_dir, reps)
        results.update({"compile_first_ms": c["first_ms"], "compile_cached_ms": c["cached_ms"],
                        "compile_first_mask_ms": c["first_mask_ms"],
                        "compile_first_ms_per_case": c["first_ms_per_case"]})
    if "jump_forward" in families:
        j = jump_forward(engine_dir, reps, fixed_keys_max_tokens)
        results.update({"jump_forward_on": j["on"], "jump_forward_off": j["off"],
                        "jump_forward_speedup": j["speedup"]["median"], "jump_forward_speedups": j["speedup"]["all"],
                        "jump_forward_cases": {c.name: j[c.name] for c in FIXED_KEYS}})
    return results


def markdown(results: dict[str, Any]) -> str:
    """| measure | metric | value | for each number (one level of nesting), lists and strings left to the JSON."""
    lines = ["| measure | metric | value |", "| --- | --- | --- |"]
    for key, value in results.items():
        if isinstance(value, dict):
            lines += [f"| {key} | {k} | {v:.4g} |" for k, v in value.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            lines.append(f"| {key} | | {value:.4g} |")
    return "\n".join(lines)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path, nargs="?", default=Path("engines/smollm2"),
                    help="default engines/smollm2 (`make real-engine` builds it)")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated: {', '.join(FAMILIES)}")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fixed-keys-max-tokens", type=int, default=384,
                    help="jump_forward's max_tokens (the many-fixed-keys outputs are ~100-250 tokens)")
    ap.add_argument("--reps", type=int, default=3, help="rounds (throughput), repeats (compile, jump_forward)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-results/guided.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    families = args.only.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; families are {', '.join(FAMILIES)}")
    results = run(args.engine_dir, families, args.requests, args.concurrency, args.max_tokens, args.reps,
                  args.fixed_keys_max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    print(markdown(results))


if __name__ == "__main__":
    main()
