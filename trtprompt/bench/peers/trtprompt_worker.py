"""trtprompt's side of the side-by-side's offline workloads, run by the project's python:

    .venv/bin/python -m trtprompt.bench.peers.trtprompt_worker --prompts P.json --out R.json --engine DIR
        [--threads N] [--compute-dtype float32|bfloat16] [--speculative-decoding none|ngram]

The engine in process (LLMEngine), block reuse on, greedy, exactly max_tokens tokens per request, stepped
until every request finishes; offline_loop.py times it. A process of its own, as each peer has.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Sequence

from trtprompt.bench.peers import offline_loop


def _seconds(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9


def trtprompt_runner(engine_dir: str, compute_dtype: str | None,
                     speculative_decoding: str) -> tuple[offline_loop.RunFn, Callable[[], None]]:
    """compute_dtype: the serve knob (None: the engine's rule, engine/compute_dtype.py)."""
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.request import SamplingParams

    engine = LLMEngine.from_engine_dir(engine_dir, enable_kv_cache_reuse=True, compute_dtype=compute_dtype,
                                       speculative_decoding=speculative_decoding)
    counter = iter(range(1 << 62))

    def run(prompts: offline_loop.Prompts, max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
        t0 = time.perf_counter()
        ids = [f"r{next(counter)}" for _ in prompts]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        finals = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    finals[o.request_id] = o
        wall = time.perf_counter() - t0
        stats = [finals[rid].stats for rid in ids]
        ttft = [(s.first_token_time_ns - s.arrival_time_ns) / 1e9 for s in stats if s.first_token_time_ns is not None]
        return {"wall_s": wall, "output_tokens": sum(len(t) for t in tokens.values()),
                "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
                "cached_prompt_tokens": sum(s.kv_cache_reused_blocks for s in stats) * engine.kv.tokens_per_block,
                "tokens": [tokens[rid] for rid in ids],
                "ms_per_token": [offline_loop.ms_per_token(_seconds(s.first_token_time_ns),
                                                           _seconds(s.last_token_time_ns), len(tokens[rid]))
                                 for rid, s in zip(ids, stats)]}

    # Nothing to reset: every rep's prompts (and the prefix) are new to the cache.
    return run, lambda: None


def versions() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "python": sys.version.split()[0]}


def main(argv: Sequence[str] | None = None) -> None:
    ap = offline_loop.worker_parser("trtprompt's offline workloads")
    ap.add_argument("--engine", required=True, help="engine directory")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"), help="unset: the engine's rule (a bf16 "
                    "engine computes in float32 on a CPU without bf16 instructions)")
    ap.add_argument("--speculative-decoding", choices=("none", "ngram"), default="none")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    make = lambda spec: trtprompt_runner(args.engine, args.compute_dtype, args.speculative_decoding)  # noqa: E731
    offline_loop.run_and_write("trtprompt", make, args.prompts, args.out, versions)


if __name__ == "__main__":
    main()
