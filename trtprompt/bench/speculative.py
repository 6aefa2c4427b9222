"""In-process benchmark of speculative decoding (issue 39; docs/speculative-decoding.md, "Measuring").

    python -m trtprompt.bench.speculative ENGINE_DIR [--out FILE.json] [--max-tokens 128] [--rounds 3]
        [--draft-len 6[,4,...]] [--only latency,throughput]

- `latency`: the four input-grounded chat workloads of bench/spec_workloads.py, one request at a time,
  greedy, on an engine without speculation ("none") and one per --draft-len with n-gram speculation
  ("ngram", or "ngram-<len>" with several), in rounds whose order rotates. Per request: the inter-token
  latency from the times the engine's outputs arrive (a step that accepts drafts delivers several tokens
  at once: its gap is spread evenly over them), the mean ms per token after the first, tokens per step,
  the acceptance (EngineStats.spec_* deltas). The ratio ngram / none is paired by round. Greedy tokens
  must be identical across variants: the run writes its JSON and exits 1 when they are not.
- `throughput`: `--concurrency` random prompts (fixed seed) of --throughput-input tokens, all in flight,
  --throughput-output tokens each (EOS ignored), output tok/s with n-gram speculation on (its default
  speculation_max_concurrency: it pauses above that many running requests) vs none.

KV block reuse is off on every engine and each request carries its own cache_salt: a round's request
neither skips its prefill nor drafts from the public n-gram pool's copy of an earlier round's answer,
so the rounds measure the same work (and the peers, which have no such pool, the same kind of drafts).
scripts/bench_spec_peers.py writes the same JSON shape for vLLM, OpenVINO GenAI and llama.cpp.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from trtprompt.bench import spec_workloads

FAMILIES = ("latency", "throughput")
BASELINE = "none"
# Outputs arriving closer than this are one delivery: a streaming peer sends a step's accepted tokens as
# separate events microseconds apart, the engine as one output; both then count as one chunk.
COALESCE_S = 1e-3
Arrival = tuple[float, int]  # (perf_counter seconds, tokens delivered)


# ---- timing of one streamed request (shared with scripts/bench_spec_peers.py) ---------------------------------------

def chunks(arrivals: Iterable[Arrival], coalesce_s: float = COALESCE_S) -> list[Arrival]:
    """Deliveries with tokens, those within coalesce_s of the previous one merged (timed at their last)."""
    out: list[Arrival] = []
    for t, k in arrivals:
        if k <= 0:
            continue
        if out and t - out[-1][0] < coalesce_s:
            out[-1] = (t, out[-1][1] + k)
        else:
            out.append((t, k))
    return out


def timing(start: float, arrivals: Sequence[Arrival]) -> dict[str, Any]:
    """A request's latency figures from its deliveries; the first delivery's tokens are TTFT's, not ITL's."""
    cs = chunks(arrivals)
    total = sum(k for _, k in cs)
    if not cs:
        return {"output_tokens": 0, "ttft_ms": None, "ms_per_token": None, "median_itl_ms": None,
                "median_chunk_ms": None, "tokens_per_chunk": None}
    first_t, first_k = cs[0]
    gaps = [(t - prev, k) for (prev, _), (t, k) in zip(cs, cs[1:])]
    itl = [gap / k for gap, k in gaps for _ in range(k)]  # one value per token after the first delivery
    later = total - first_k
    return {"output_tokens": total, "ttft_ms": (first_t - start) * 1e3,
            "ms_per_token": (cs[-1][0] - first_t) / later * 1e3 if later else None,
            "median_itl_ms": statistics.median(itl) * 1e3 if itl else None,
            "median_chunk_ms": statistics.median(g for g, _ in gaps) * 1e3 if gaps else None,
            "tokens_per_chunk": later / len(gaps) if gaps else None}


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def acceptance(spec: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Summed speculation counts of a variant's requests (None where the side reports none)."""
    if not spec:
        return None
    # A peer may not report every count (llama.cpp: no number of drafts): None where any request lacks it.
    drafts, drafted, accepted = (None if any(s.get(k) is None for s in spec) else sum(s[k] for s in spec)
                                 for k in ("drafts", "draft_tokens", "accepted_tokens"))
    rows = [list(s.get("accepted_per_pos") or []) for s in spec]
    per_pos = [sum(r[i] for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
            "accepted_per_draft": accepted / drafts if drafts and accepted is not None else None,
            "accepted_per_pos": per_pos}


def variant_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One workload on one variant over its rounds: medians of the per-request figures."""
    per_round = [timing(r["start"], r["arrivals"]) for r in records]
    keys = ("ms_per_token", "median_itl_ms", "median_chunk_ms", "tokens_per_chunk", "ttft_ms")
    return {**{k: _median(t[k] for t in per_round) for k in keys},
            "output_tokens": per_round[0]["output_tokens"], "finish_reason": records[0].get("finish_reason"),
            "per_round": per_round,
            "acceptance": acceptance([r["spec"] for r in records if r.get("spec") is not None])}


def workload_summary(runs: Mapping[str, Sequence[Mapping[str, Any]]], decode: Any = None) -> dict[str, Any]:
    """runs: variant -> that variant's records, round by round. Ratios variant / none are paired by round."""
    runs = {name: runs[name] for name in sorted(runs, key=lambda n: n != BASELINE)}  # none first (a stable sort)
    variants = {name: variant_summary(recs) for name, recs in runs.items()}
    base = variants[BASELINE]["per_round"]
    out: dict[str, Any] = {"variants": variants, "ratios": {
        name: {key: _median(a[key] / b[key] for a, b in zip(v["per_round"], base) if a[key] is not None and b[key])
               for key in ("ms_per_token", "median_itl_ms")}
        for name, v in variants.items() if name != BASELINE}}
    reference = runs[BASELINE][0]["tokens"]
    out["tokens_identical"] = all(r["tokens"] == reference for recs in runs.values() for r in recs)
    if not out["tokens_identical"]:
        out["first_difference"] = first_difference(runs, reference)
    out["text"] = decode(reference)[:80] if decode is not None else None
    return out


def first_difference(runs: Mapping[str, Sequence[Mapping[str, Any]]], reference: list[int]) -> dict[str, Any]:
    """Where the first differing run leaves the baseline's first-round tokens."""
    for name, recs in runs.items():
        for i, r in enumerate(recs):
            if r["tokens"] != reference:
                at = next((j for j, (a, b) in enumerate(zip(r["tokens"], reference)) if a != b),
                          min(len(r["tokens"]), len(reference)))
                return {"variant": name, "round": i, "position": at, "lengths": [len(r["tokens"]), len(reference)]}
    return {}


def ratio_summary(latency: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per variant: the median over workloads of each workload's ms-per-token and ITL ratios."""
    names = {name for w in latency.values() for name in w["ratios"]}
    return {name: {key: _median(w["ratios"][name][key] for w in latency.values()) for key in
                   ("ms_per_token", "median_itl_ms")} for name in sorted(names)}


# ---- the machine -----------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_flags() -> list[str]:
    """The flags that decide which kernels run: AVX2, every AVX-512 and AMX flag, as /proc/cpuinfo names them."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return sorted(f for f in line.split(":", 1)[-1].split() if f == "avx2" or f.startswith(("avx512", "amx")))


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=spec_workloads.ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "loadavg_start": os.getloadavg(),
            "trtprompt_commit": commit or None, "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


# ---- the engine side -------------------------------------------------------------------------------------------------

def variant_names(draft_lens: Sequence[int]) -> dict[str, int | None]:
    """Variant name -> max_draft_len (None: no speculation)."""
    if len(draft_lens) == 1:
        return {BASELINE: None, "ngram": draft_lens[0]}
    return {BASELINE: None, **{f"ngram-{d}": d for d in draft_lens}}


def open_engines(engine_dir: Path, draft_lens: Sequence[int], max_ngram: int | None,
                 max_concurrency: int | None = None) -> dict[str, Any]:
    """max_concurrency: the ngram variants' speculation_max_concurrency (None: the knob's default; 0: never pause)."""
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.knobs import BIG

    engines = {}
    for name, draft in variant_names(draft_lens).items():
        if draft is None:
            engines[name] = LLMEngine.from_engine_dir(engine_dir, speculative_decoding="none",
                                                      enable_kv_cache_reuse=False)
        else:
            engines[name] = LLMEngine.from_engine_dir(engine_dir, speculative_decoding="ngram", max_draft_len=draft,
                                                      max_matching_ngram_size=max_ngram, enable_kv_cache_reuse=False,
                                                      speculation_max_concurrency=BIG if max_concurrency == 0
                                                      else max_concurrency)
    return engines


def spec_counts(engine: Any) -> dict[str, Any]:
    s = engine.stats()
    return {"drafts": s.spec_num_drafts, "draft_tokens": s.spec_num_draft_tokens,
            "accepted_tokens": s.spec_num_accepted_tokens, "accepted_per_pos": list(s.spec_accepted_per_pos)}


def spec_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
           for i, a in enumerate(after["accepted_per_pos"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")} | {"accepted_per_pos": pos}


def one_request(engine: Any, rid: str, prompt: list[int], params: Any, speculating: bool) -> dict[str, Any]:
    """One request alone on the engine, each output's arrival timed as it comes back from step()."""
    before = spec_counts(engine) if speculating else None
    start = time.perf_counter()
    engine.add_request(rid, prompt, params, cache_salt=rid)  # its own salt: no earlier round's drafts
    arrivals: list[Arrival] = []
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.error is not None:  # a failed request is a broken measurement, never a fast one
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            arrivals.append((now, len(out.new_token_ids)))
            tokens += out.new_token_ids
            reason = out.finish_reason.value if out.finished and out.finish_reason else reason
    spec = spec_delta(before, spec_counts(engine)) if before is not None else None
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "finish_reason": reason, "spec": spec}


def rotated(names: Sequence[str], shift: int) -> list[str]:
    shift %= len(names)
    return list(names[shift:]) + list(names[:shift])


def latency(engines: Mapping[str, Any], prompts: Mapping[str, list[int]], rounds: int, max_tokens: int,
            decode: Any = None) -> dict[str, Any]:
    """Every workload on every variant, one request at a time, the variants' order rotating by round and workload."""
    from trtprompt.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    first = next(iter(prompts.values()))
    for name, engine in engines.items():  # warm-up, outside the rounds
        one_request(engine, f"warm-{name}", first, SamplingParams(max_tokens=8, temperature=0.0), False)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {v: [] for v in engines} for w in prompts}
    names = list(engines)
    for r in range(rounds):
        for i, (workload, prompt) in enumerate(prompts.items()):
            for name in rotated(names, r + i):
                runs[workload][name].append(one_request(engines[name], f"{workload}-{name}-{r}", prompt, params,
                                                        name != BASELINE))
    return {w: {"prompt_tokens": len(prompts[w]), "prompt_digest": spec_workloads.digest([prompts[w]]),
                **workload_summary(runs[w], decode)} for w in prompts}


def batch_run(engine: Any, prompts: Sequence[list[int]], params: Any, tag: str) -> dict[str, Any]:
    """Every prompt in flight at once; output tok/s over the whole run."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):  # a salt each: no request drafts from another's answer
        engine.add_request(f"{tag}-{i}", prompt, params, cache_salt=f"{tag}-{i}")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    wall = time.perf_counter() - start
    total = sum(len(t) for t in tokens.values())
    return {"wall_s": wall, "output_tokens": total, "output_tok_s": total / wall,
            "tokens": [tokens.get(f"{tag}-{i}", []) for i in range(len(prompts))]}


def throughput(engines: Mapping[str, Any], prompts: Sequence[list[int]], rounds: int, output_len: int,
               speculating: str, ignore_eos: bool = True) -> dict[str, Any]:
    """`speculating` vs none on the same prompts, all in flight, rounds alternating which goes first."""
    from trtprompt.engine.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos)
    pair = {BASELINE: engines[BASELINE], speculating: engines[speculating]}
    for name, engine in pair.items():  # warm-up: the batch's shapes, a few tokens
        batch_run(engine, prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), f"warm-{name}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in pair}
    for r in range(rounds):
        for name in rotated(list(pair), r):
            before = spec_counts(pair[name])
            run = batch_run(pair[name], prompts, params, f"tp-{name}-{r}")
            runs[name].append({**run, "spec": spec_delta(before, spec_counts(pair[name]))})
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[speculating], runs[BASELINE])]
    return {"requests": len(prompts), "input_tokens": len(prompts[0]), "output_tokens": output_len,
            "prompt_digest": spec_workloads.digest(prompts), "speculating_variant": speculating,
            **{name: {"median_output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                      "output_tok_s": [r["output_tok_s"] for r in rs], "spec": rs[-1]["spec"]}
               for name, rs in runs.items()},
            "ratio": statistics.median(ratios), "ratios": ratios,
            "tokens_identical": runs[speculating][0]["tokens"] == runs[BASELINE][0]["tokens"]}


# ---- report ----------------------------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def table(result: Mapping[str, Any]) -> str:
    """| workload | variant | ms/token | median ITL ms | tokens/step | acceptance | ratio to none |"""
    lines = ["| workload | variant | ms/token | median ITL ms | tokens/step | acceptance | ms/token vs none |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for workload, w in result.get("latency", {}).items():
        for name, v in w["variants"].items():
            acc = (v["acceptance"] or {}).get("acceptance_rate")
            ratio = w["ratios"].get(name, {}).get("ms_per_token")
            lines.append(f"| {workload} | {name} | {_fmt(v['ms_per_token'])} | {_fmt(v['median_itl_ms'])} | "
                         f"{_fmt(v['tokens_per_chunk'])} | {_fmt(acc)} | {_fmt(ratio)} |")
    tp = result.get("throughput")
    if tp:
        lines.append("")
        lines.append(f"throughput, {tp['requests']} x ({tp['input_tokens']} -> {tp['output_tokens']}): "
                     f"none {tp[BASELINE]['median_output_tok_s']:.1f} tok/s, {tp['speculating_variant']} "
                     f"{tp[tp['speculating_variant']]['median_output_tok_s']:.1f} tok/s, ratio {tp['ratio']:.3f}")
    return "\n".join(lines)


def tokens_identical(result: Mapping[str, Any]) -> bool:
    return all(w["tokens_identical"] for w in result.get("latency", {}).values())


def header(result: Mapping[str, Any]) -> str:
    m = result["machine"]
    return (f"{result['side']}: CPU {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}; "
            f"load {m['loadavg_start'][0]:.2f}; {result['setup']}")


# ---- main ------------------------------------------------------------------------------------------------------------

def positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from trtprompt.knobs import KNOBS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench-results/speculative.json"))
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--workloads", default=",".join(spec_workloads.WORKLOAD_NAMES), help="comma list")
    ap.add_argument("--max-tokens", type=int, default=128, help="latency: output tokens at most (greedy, EOS stops)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-len", type=positive_ints, default=[KNOBS["max_draft_len"].default],
                    help="max_draft_len of the ngram variant; a comma list makes one variant per value")
    ap.add_argument("--max-ngram", type=int, default=None, help="max_matching_ngram_size (unset: the knob's default)")
    ap.add_argument("--concurrency", type=int, default=32, help="throughput: requests, all in flight")
    ap.add_argument("--throughput-input", type=int, default=128)
    ap.add_argument("--throughput-output", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="throughput: the random prompts' seed")
    ap.add_argument("--throughput-prompts", choices=("random", "workloads"), default="random",
                    help="throughput: random token prompts (EOS ignored), or the latency workloads in turn (greedy, "
                         "EOS stops: the answers that copy their prompt)")
    ap.add_argument("--spec-max-concurrency", type=int, default=None,
                    help="speculation_max_concurrency of the ngram variants (unset: the knob's default; 0: never "
                         "pause): find where speculation stops paying")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    args.workloads = [x for x in args.workloads.split(",") if x]
    for name, chosen, allowed in (("only", args.only, FAMILIES),
                                  ("workloads", args.workloads, spec_workloads.WORKLOAD_NAMES)):
        if not chosen or set(chosen) - set(allowed):
            ap.error(f"--{name}: choose from {', '.join(allowed)}, got {chosen}")
    for name in ("max_tokens", "rounds", "concurrency", "throughput_input", "throughput_output", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = open_engines(args.engine_dir, args.draft_len, args.max_ngram, args.spec_max_concurrency)
    some = next(iter(engines.values()))
    tokenizer_dir = Path(some.guides.tokenizer_dir)
    setup = {"engine_dir": str(args.engine_dir), "max_tokens": args.max_tokens, "rounds": args.rounds,
             "variants": variant_names(args.draft_len), "max_matching_ngram_size": args.max_ngram,
             "threads": args.threads, "greedy": True, "kv_cache_reuse": False, "cache_salt": "one per request",
             "speculation": {name: dataclasses.asdict(e.config.speculation) for name, e in engines.items()
                             if e.config.speculation is not None}}
    result: dict[str, Any] = {"side": "trtprompt", "machine": machine(), "setup": setup}
    tokenizer = spec_workloads.load_tokenizer(tokenizer_dir)
    if "latency" in args.only:
        prompts = {w.name: spec_workloads.chat_token_ids(tokenizer, w) for w in spec_workloads.workloads()
                   if w.name in args.workloads}
        result["latency"] = latency(engines, prompts, args.rounds, args.max_tokens, tokenizer.decode)
        result["latency_ratios"] = ratio_summary(result["latency"])
    if "throughput" in args.only:
        batch = some.scheduler_config.max_batch_size
        setup["max_batch_size"] = batch
        if batch < args.concurrency:  # the rest would queue: a smaller batch than the peers run
            print(f"WARNING: the engine's max_batch_size {batch} < --concurrency {args.concurrency}: build one with "
                  f"--max-batch-size {args.concurrency} or more (docs/speculative-decoding.md, \"Measuring\")")
        if args.throughput_prompts == "random":
            prompts_tp = spec_workloads.random_prompts(tokenizer, args.concurrency, args.throughput_input, args.seed)
        else:
            grounded = [spec_workloads.chat_token_ids(tokenizer, w) for w in spec_workloads.workloads()]
            prompts_tp = [grounded[i % len(grounded)] for i in range(args.concurrency)]
        result["throughput"] = throughput(engines, prompts_tp, args.rounds, args.throughput_output,
                                          next(n for n in engines if n != BASELINE),
                                          ignore_eos=args.throughput_prompts == "random")
        result["throughput"]["prompts"] = args.throughput_prompts
    result["tokens_identical"] = tokens_identical(result)
    result["machine"]["loadavg_end"] = os.getloadavg()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(header(result))
    print(table(result))
    print(f"JSON: {args.out}")
    if not result["tokens_identical"]:
        bad = {w: v.get("first_difference") for w, v in result["latency"].items() if not v["tokens_identical"]}
        raise SystemExit(f"GREEDY TOKENS DIFFER between variants (they must be identical): {bad}")


if __name__ == "__main__":
    main()
