"""In-process `transformers` baselines on the same workload as the server run.

Sequential `generate` (one request at a time, a streamer timestamps each
token) and continuous batching `generate_batch` (every request submitted at
once, per-token timestamps recorded by transformers). Both greedy, with
min_new_tokens = max_new_tokens so they produce as many tokens as the
server run does. Their records have the server run's shape, so the same
report summarizes them; they have no KV or /metrics figures.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench.runner import LoadSpec, RequestRecord, RunResult
from trtprompt.bench.workloads import BenchRequest, Workload
from trtprompt.tokenizer import Tokenizer

PAGE_SIZE = 32


class _TokenClock:
    """A transformers streamer that only notes when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _record(req: BenchRequest, start_s: float, t_send: float, times: Sequence[float], prompt_len: int,
            num_output: int) -> RequestRecord:
    rel = [t - t_send for t in times]
    return RequestRecord(req.index, req.tag, req.prompt_len, req.max_tokens, start_s,
                         ttft_s=rel[0] if rel else None, itl_s=[b - a for a, b in zip(rel, rel[1:])],
                         e2e_s=rel[-1] if rel else None, num_input_tokens=prompt_len,
                         num_output_tokens=num_output)


def load_model(checkpoint: Path) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, local_files_only=True, dtype=torch.float32).eval()


def _config(max_tokens: int) -> Any:
    import transformers

    return transformers.GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)


def sequential(model: Any, ids: Sequence[list[int]], requests: Sequence[BenchRequest]) -> list[RequestRecord]:
    import torch

    records = []
    with torch.no_grad():
        t0 = time.perf_counter()
        for req, prompt in zip(requests, ids):
            clock = _TokenClock()
            t_send = time.perf_counter()
            out = model.generate(torch.tensor([prompt]), generation_config=_config(req.max_tokens), streamer=clock)
            records.append(_record(req, t_send - t0, t_send, clock.times, len(prompt), out.shape[1] - len(prompt)))
    return records


def continuous_batching_config(ids: Sequence[list[int]], max_tokens: int, max_batch_tokens: int) -> Any:
    """generate_batch's cache sized to the workload.

    Left unset, transformers sizes the cache from host memory and spends seconds
    allocating it on every call (measured: ~6 s for 3 tiny requests vs ~0.7 s).
    """
    import transformers

    num_blocks = sum(-(-(len(p) + max_tokens) // PAGE_SIZE) for p in ids) + len(ids)
    return transformers.ContinuousBatchingConfig(page_size=PAGE_SIZE, max_batch_tokens=max_batch_tokens,
                                                 num_blocks=num_blocks)


def generate_batch(model: Any, ids: Sequence[list[int]], requests: Sequence[BenchRequest],
                   max_batch_tokens: int) -> list[RequestRecord]:
    import torch

    max_tokens = max(r.max_tokens for r in requests)
    cb = continuous_batching_config(ids, max_tokens, max_batch_tokens)
    with torch.no_grad():
        t0 = time.perf_counter()
        res = model.generate_batch(list(ids), generation_config=_config(max_tokens), continuous_batching_config=cb,
                                   record_timestamps=True, warmup=False)
    outputs = sorted(res.values(), key=lambda g: int(g.request_id.rsplit("_", 1)[-1]))
    return [_record(req, 0.0, t0, out.timestamps or [], len(prompt), len(out.generated_tokens))
            for req, prompt, out in zip(requests, ids, outputs)]


def run_baselines(checkpoint: Path, tokenizer: Tokenizer, workload: Workload, measured: Sequence[BenchRequest],
                  max_batch_tokens: int = 2048, warm: bool = True) -> dict[str, RunResult]:
    """{'transformers-sequential': ..., 'transformers-generate_batch': ...}.

    warm: one short call of each first, so first-call initialisation stays out of the timings.
    """
    import torch

    model = load_model(checkpoint)
    ids = [tokenizer.encode(r.prompt) for r in measured]
    if warm:
        with torch.no_grad():
            model.generate(torch.tensor([ids[0]]), generation_config=_config(2))
            generate_batch(model, ids[:1], [measured[0]], max_batch_tokens)
    results = {}
    for name, fn in (("transformers-sequential", lambda: sequential(model, ids, measured)),
                     ("transformers-generate_batch", lambda: generate_batch(model, ids, measured, max_batch_tokens))):
        t0 = time.perf_counter()
        records = fn()
        wall = time.perf_counter() - t0
        load = LoadSpec(concurrency=1 if name.endswith("sequential") else len(measured), warmup=0)
        results[name] = RunResult(load, workload.describe(), records, wall)
    return results
