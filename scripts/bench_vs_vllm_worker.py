#!/usr/bin/env python3
"""One side of scripts/bench_vs_vllm.py, run as a subprocess in that side's own venv.

    python bench_vs_vllm_worker.py offline --side vllm|trtprompt --prompts P.json --out R.json
        [--checkpoint DIR --dtype float32|bfloat16] [--engine DIR] [--threads N]
    python bench_vs_vllm_worker.py client ARGS...   # vLLM's serving benchmark client

`offline` runs the in-process workloads of P.json (token ids, written by the
orchestrator, so both sides get the same prompts token for token): a full-size
warm-up of every workload first, then each rep, with the CPU time the process
tree spent in it (cores_busy = CPU s / wall s: the check that a side used every
core it was given). The orchestrator uses run_workloads for llama.cpp too. `client` is
`vllm.benchmarks.serve` (which has no `__main__` of its own in vLLM 0.32).
Only the standard library is imported at the top: the vLLM venv has no
trtprompt and the project venv has no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

Prompts = list[list[int]]
# (prompts, max_tokens) -> {"wall_s", "output_tokens", "mean_ttft_s", "tokens": [[ids], ...]}
RunFn = Callable[[Prompts, int], dict[str, Any]]


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of a process and its live descendants (all their threads), from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, [root]
    while frontier:
        kids = [pid for pid, pp in parent.items() if pp == frontier[-1] and pid not in tree]
        frontier.pop()
        tree.update(kids)
        frontier.extend(kids)
    return sum(cpu.get(pid, 0.0) for pid in tree)


def vllm_runner(checkpoint: str, dtype: str, max_num_tokens: int, max_batch: int,
                max_len: int) -> tuple[RunFn, Callable[[], None]]:
    """vLLM's LLM with prefix caching and chunked prefill on, greedy, EOS ignored."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, tokenizer=checkpoint, dtype=dtype, seed=0, max_model_len=max_len,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=max_num_tokens,
              max_num_seqs=max_batch, disable_log_stats=False)  # stats on: first_token_latency is filled

    def run(prompts: Prompts, max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        return {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
                "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                "tokens": [list(o.outputs[0].token_ids) for o in outs]}

    return run, llm.reset_prefix_cache


def trtprompt_runner(engine_dir: str, compute_dtype: str | None) -> tuple[RunFn, Callable[[], None]]:
    """trtprompt's LLMEngine in process, block reuse on, greedy, exactly max_tokens tokens.
    compute_dtype: the serve knob (None: the engine's rule, engine/compute_dtype.py)."""
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.request import SamplingParams

    engine = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=True, compute_dtype=compute_dtype)
    counter = iter(range(1 << 62))

    def run(prompts: Prompts, max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
        t0 = time.perf_counter()
        ids = [f"r{next(counter)}" for _ in prompts]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        finals = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    finals.append(o)
        wall = time.perf_counter() - t0
        ttft = [(o.stats.first_token_time_ns - o.stats.arrival_time_ns) / 1e9 for o in finals]
        return {"wall_s": wall, "output_tokens": sum(len(t) for t in tokens.values()),
                "mean_ttft_s": statistics.fmean(ttft),
                "cached_prompt_tokens": sum(o.stats.kv_cache_reused_blocks for o in finals)
                * engine.kv.tokens_per_block,
                "tokens": [tokens[rid] for rid in ids]}

    # Nothing to reset: every rep of the prefix workload has a prefix new to the cache.
    return run, lambda: None


def run_workloads(run: RunFn, reset: Callable[[], None], spec: dict[str, Any], pid: int) -> dict[str, Any]:
    """Warm up on every workload at full size, then time each rep; the cache is reset before each.
    pid: the root of the processes doing the work (their CPU time is measured)."""
    t0 = time.perf_counter()
    for name, wl in spec["workloads"].items():
        reset()
        run(wl["warmup"], wl["max_tokens"])
    result: dict[str, Any] = {"warmup_s": time.perf_counter() - t0}
    for name, wl in spec["workloads"].items():
        reps = []
        for i, prompts in enumerate(wl["reps"]):
            reset()
            load, cpu0 = os.getloadavg()[0], tree_cpu_seconds(pid)
            r = run(prompts, wl["max_tokens"])
            r["cores_busy"] = (tree_cpu_seconds(pid) - cpu0) / r["wall_s"]
            r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
            r["loadavg_1m_before"] = load
            if i > 0:
                r.pop("tokens")  # keep the first rep's tokens for the greedy agreement check
            reps.append(r)
            print(f"{name} rep {i}: {r['wall_s']:.2f} s, {r['output_tok_s']:.1f} out tok/s, "
                  f"mean TTFT {r['mean_ttft_s']:.3f} s, {r['cores_busy']:.2f} cores busy (load {load:.2f})",
                  flush=True)
        result[name] = reps
    return result


def offline(args: argparse.Namespace) -> None:
    spec = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    if args.side == "vllm":
        run, reset = vllm_runner(args.checkpoint, args.dtype, spec["max_num_tokens"], spec["max_batch_size"],
                                 spec["max_seq_len"])
    else:
        import torch

        torch.set_num_threads(args.threads)
        run, reset = trtprompt_runner(args.engine, args.compute_dtype)
    init_s = time.perf_counter() - t0
    print(f"{args.side}: initialised in {init_s:.1f} s", flush=True)
    result = {"side": args.side, "init_s": init_s, **run_workloads(run, reset, spec, os.getpid())}
    result["versions"] = _versions(args.side)
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")


def _versions(side: str) -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if side == "vllm":
        import vllm

        out["vllm"] = vllm.__version__
    return out


def client(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser(prog="vllm.benchmarks.serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


def parse_offline(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="in-process workloads of one side")
    ap.add_argument("--side", choices=("vllm", "trtprompt"), required=True)
    ap.add_argument("--prompts", required=True, help="JSON written by bench_vs_vllm.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", help="HF checkpoint (vllm side)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="vllm side")
    ap.add_argument("--engine", help="engine directory (trtprompt side)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (trtprompt side)")
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"), help="trtprompt side (unset: the engine's "
                    "rule: a bf16 engine computes in float32 on a CPU without bf16 instructions)")
    args = ap.parse_args(argv)
    vllm = args.side == "vllm"
    if vllm != (args.checkpoint is not None) or (not vllm) != (args.engine is not None):
        ap.error("--side vllm takes --checkpoint; --side trtprompt takes --engine")
    return args


if __name__ == "__main__":  # vLLM's engine core starts processes that re-import this file
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "offline":
        offline(parse_offline(sys.argv[2:]))
    else:
        sys.exit(__doc__)
