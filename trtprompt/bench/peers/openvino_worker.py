"""OpenVINO GenAI's side of the side-by-side, run by path by the OpenVINO venv's own python (openvino_side.py
builds the command):

    OV_VENV/bin/python trtprompt/bench/peers/openvino_worker.py --prompts P.json --out R.json --model OV_DIR
        [--threads 2] [--precision-hint f32|bf16] [--kv-precision f32|bf16|u8] [--cache-gb N]

`openvino_genai.ContinuousBatchingPipeline` on the CPU. SchedulerConfig: max_num_batched_tokens and max_num_seqs
from P.json's engine bounds (2,048 and 64, as every side), enable_prefix_caching and dynamic_split_fuse on,
cache_size N GB. Properties: INFERENCE_NUM_THREADS, INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION (OpenVINO's x86
default is u8, which changes greedy tokens; the side-by-side keeps the KV at the compute precision, as the other
sides do). A batch is added with add_request and stepped until every request finishes (the loop generate() runs
inside), every handle read after each step: that gives each request's first- and last-token times, where
generate()'s perf metrics are the whole batch's. Greedy, EOS ignored, min_new_tokens = max_new_tokens: exactly
the asked length. The OpenVINO venv has no trtprompt: this file imports the standard library, numpy, OpenVINO
(inside functions, so its pure parts load anywhere) and offline_loop.py beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

if __package__:  # imported as part of trtprompt
    from trtprompt.bench.peers import offline_loop
else:  # run by path: this file's directory is sys.path[0]
    import offline_loop  # type: ignore[no-redef]

PRECISIONS = ("f32", "bf16")
KV_PRECISIONS = ("f32", "bf16", "f16", "u8")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = offline_loop.worker_parser("OpenVINO GenAI's offline workloads (ContinuousBatchingPipeline)")
    ap.add_argument("--model", required=True, help="the optimum-cli export (openvino_model.xml and tokenizer)")
    ap.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS")
    ap.add_argument("--precision-hint", choices=PRECISIONS, default="f32", help="INFERENCE_PRECISION_HINT")
    ap.add_argument("--kv-precision", choices=KV_PRECISIONS, help="KV_CACHE_PRECISION (default: the hint's)")
    ap.add_argument("--cache-gb", type=int, default=2, help="SchedulerConfig.cache_size: GB of KV cache")
    args = ap.parse_args(argv)
    for name in ("threads", "cache_gb"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.kv_precision = args.kv_precision or args.precision_hint
    return args


def scheduler_settings(spec: dict[str, Any], cache_gb: int) -> dict[str, Any]:
    """SchedulerConfig's fields: the engine bounds every side gets, prefix caching and split-fuse on."""
    return {"max_num_batched_tokens": spec["max_num_tokens"], "max_num_seqs": spec["max_batch_size"],
            "enable_prefix_caching": True, "dynamic_split_fuse": True, "cache_size": cache_gb}


def properties(args: argparse.Namespace) -> dict[str, Any]:
    return {"INFERENCE_NUM_THREADS": args.threads, "INFERENCE_PRECISION_HINT": args.precision_hint,
            "KV_CACHE_PRECISION": args.kv_precision}


@dataclass
class Track:
    """One request's tokens and the times (relative to the batch's start) its first and last arrived."""

    tokens: list[int] = field(default_factory=list)
    first_s: float | None = None
    last_s: float | None = None

    def add(self, new: Sequence[int], at: float) -> None:
        if not new:
            return
        self.tokens += [int(t) for t in new]
        self.first_s = at if self.first_s is None else self.first_s
        self.last_s = at


def summarise(tracks: Sequence[Track], wall_s: float) -> dict[str, Any]:
    """offline_loop's run result from the requests' tracks."""
    ttft = [t.first_s for t in tracks if t.first_s is not None]
    return {"wall_s": wall_s, "output_tokens": sum(len(t.tokens) for t in tracks),
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "tokens": [t.tokens for t in tracks],
            "ms_per_token": [offline_loop.ms_per_token(t.first_s, t.last_s, len(t.tokens)) for t in tracks]}


def make_pipeline(args: argparse.Namespace, spec: dict[str, Any]) -> Any:
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    for name, value in scheduler_settings(spec, args.cache_gb).items():
        setattr(sched, name, value)
    return ov_genai.ContinuousBatchingPipeline(args.model, sched, "CPU", properties(args))


def generation_config(max_tokens: int) -> Any:
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = max_tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


def runner(pipe: Any) -> offline_loop.RunFn:
    import numpy as np
    import openvino as ov

    counter = iter(range(1 << 62))

    def run(prompts: offline_loop.Prompts, max_tokens: int) -> dict[str, Any]:
        cfg = generation_config(max_tokens)
        tensors = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        t0 = time.perf_counter()
        handles = [pipe.add_request(next(counter), t, cfg) for t in tensors]
        tracks = [Track() for _ in prompts]
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter() - t0
            for handle, track in zip(handles, tracks):
                if handle.can_read():
                    for out in handle.read().values():  # one sequence per request (greedy)
                        track.add(out.generated_ids, now)
        return summarise(tracks, time.perf_counter() - t0)

    return run


def versions() -> dict[str, str]:
    import openvino as ov
    import openvino_genai as ov_genai

    return {"openvino_genai": ov_genai.__version__, "openvino": ov.get_version(), "python": sys.version.split()[0]}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)

    def make(spec: dict[str, Any]) -> tuple[offline_loop.RunFn, Callable[[], None]]:
        # Nothing to reset: every rep's prompts (and the prefix) are new to the cache.
        return runner(make_pipeline(args, spec)), lambda: None

    offline_loop.run_and_write("openvino", make, args.prompts, args.out, versions)


if __name__ == "__main__":
    main()
