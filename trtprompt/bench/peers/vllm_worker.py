"""vLLM's side of the side-by-side, run by path by the vLLM venv's own python (vllm_side.py builds the commands).

    VLLM_VENV/bin/python trtprompt/bench/peers/vllm_worker.py offline --prompts P.json --out R.json
        --checkpoint DIR --dtype float32|bfloat16
    VLLM_VENV/bin/python trtprompt/bench/peers/vllm_worker.py client ARGS...   # vLLM's serving benchmark client

`offline` runs the workloads of P.json through offline_loop.py with vLLM's `LLM` (prefix caching and chunked
prefill on, greedy, EOS ignored). `client` is `vllm.benchmarks.serve` (no `__main__` of its own in vLLM 0.32).
The vLLM venv has no trtprompt: this file imports the standard library, vLLM and offline_loop.py beside it.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

if __package__:  # imported as part of trtprompt
    from trtprompt.bench.peers import offline_loop
else:  # run by path: this file's directory is sys.path[0]
    import offline_loop  # type: ignore[no-redef]


def _ms_per_token(out: Any) -> float | None:
    """From vLLM's per-request stats (engine core times of the first and the last token)."""
    m = out.metrics
    if m is None or not m.first_token_ts:
        return None
    return offline_loop.ms_per_token(m.first_token_ts, m.last_token_ts, len(out.outputs[0].token_ids))


def vllm_runner(checkpoint: str, dtype: str, max_num_tokens: int, max_batch: int,
                max_len: int) -> tuple[offline_loop.RunFn, Callable[[], None]]:
    """vLLM's LLM with prefix caching and chunked prefill on, greedy, EOS ignored."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, tokenizer=checkpoint, dtype=dtype, seed=0, max_model_len=max_len,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=max_num_tokens,
              max_num_seqs=max_batch, disable_log_stats=False)  # stats on: the per-request times are filled

    def run(prompts: offline_loop.Prompts, max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        return {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
                "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "ms_per_token": [_ms_per_token(o) for o in outs]}

    return run, llm.reset_prefix_cache


def versions() -> dict[str, str]:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}


def offline(argv: list[str]) -> None:
    ap = offline_loop.worker_parser("vLLM's offline workloads")
    ap.add_argument("--checkpoint", required=True, help="the HF checkpoint")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)

    def make(spec: dict[str, Any]) -> tuple[offline_loop.RunFn, Callable[[], None]]:
        return vllm_runner(args.checkpoint, args.dtype, spec["max_num_tokens"], spec["max_batch_size"],
                           spec["max_seq_len"])

    offline_loop.run_and_write("vllm", make, args.prompts, args.out, versions)


def client(argv: list[str]) -> None:
    import argparse

    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser(prog="vllm.benchmarks.serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":  # vLLM's engine core starts processes that re-import this file
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "offline":
        offline(sys.argv[2:])
    else:
        sys.exit(__doc__)
