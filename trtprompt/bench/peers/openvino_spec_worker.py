"""OpenVINO GenAI's side of spec_peers.py, run by path by the OpenVINO venv's python (not the project's).

    PEERS/ov-venv/bin/python trtprompt/bench/peers/openvino_spec_worker.py --model OV_DIR --jobs JOBS.json \
        --out OUT.json

JOBS.json: {"prompts": {name: [token ids]}, "rounds", "max_tokens", "draft_len", "max_ngram", "threads",
"precision" (f32|bf16), "kv_precision", "order": [[workload, variant], ...]}. Two LLMPipelines in this process:
"none" (plain) and "ngram" (prompt_lookup=True: drafts from the prompt and the output so far, GenerationConfig
num_assistant_tokens / max_ngram_size). Each job runs alone, greedy; a streamer times every write() (token ids,
one or several at a time). Writes the raw records; spec_peers.py computes the figures with the engine bench's
own functions. Standard library, numpy and openvino only (the venv has no trtprompt).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


class TimedStreamer(ov_genai.StreamerBase):  # type: ignore[misc]
    """Records (perf_counter, tokens) at each write: the moment the pipeline hands tokens out."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[tuple[float, int]] = []
        self.tokens: list[int] = []

    def write(self, token: Any) -> Any:
        now = time.perf_counter()
        new = [int(token)] if isinstance(token, int) else [int(t) for t in token]
        self.arrivals.append((now, len(new)))
        self.tokens += new
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


def pipelines(model: Path, jobs: dict[str, Any]) -> dict[str, Any]:
    props = {"INFERENCE_NUM_THREADS": jobs["threads"], "INFERENCE_PRECISION_HINT": jobs["precision"],
             "KV_CACHE_PRECISION": jobs["kv_precision"]}
    return {"none": ov_genai.LLMPipeline(str(model), "CPU", **props),
            "ngram": ov_genai.LLMPipeline(str(model), "CPU", prompt_lookup=True, **props)}


def config(jobs: dict[str, Any], variant: str, max_tokens: int) -> Any:
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = max_tokens
    cfg.do_sample = False
    if variant == "ngram":
        cfg.num_assistant_tokens = jobs["draft_len"]
        cfg.max_ngram_size = jobs["max_ngram"]
    return cfg


def one(pipe: Any, prompt: list[int], cfg: Any) -> dict[str, Any]:
    streamer = TimedStreamer()
    ids = ov.Tensor(np.array([prompt], dtype=np.int64))
    mask = ov.Tensor(np.ones((1, len(prompt)), dtype=np.int64))
    start = time.perf_counter()
    result = pipe.generate(ov_genai.TokenizedInputs(ids, mask), cfg, streamer)
    tokens = [int(t) for t in result.tokens[0]]
    if tokens != streamer.tokens:  # the streamer saw every token the result holds, in order
        raise RuntimeError(f"streamed {len(streamer.tokens)} tokens, result holds {len(tokens)}")
    # No draft counts: prompt lookup leaves extended_perf_metrics unset (2026.4); tokens per write show the gain.
    return {"start": start, "arrivals": streamer.arrivals, "tokens": tokens, "finish_reason": None, "spec": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--jobs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    jobs = json.loads(args.jobs.read_text(encoding="utf-8"))
    pipes = pipelines(args.model, jobs)
    first = next(iter(jobs["prompts"].values()))
    for name, pipe in pipes.items():  # warm-up, outside the rounds
        one(pipe, first, config(jobs, name, 8))
    records: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for workload, variant in jobs["order"]:
        rec = one(pipes[variant], jobs["prompts"][workload], config(jobs, variant, jobs["max_tokens"]))
        records.setdefault(workload, {}).setdefault(variant, []).append(rec)
    args.out.write_text(json.dumps({"records": records, "openvino_genai": ov_genai.__version__}), encoding="utf-8")


if __name__ == "__main__":
    main()
