"""Serving overhead: TTFT and inter-token latency through Triton vs the in-process engine.

Same engine directory, same prompts (distinct, so no prefix reuse), same
max_tokens (min_tokens = max_tokens, so every request makes the same number
of tokens), on an in-process LLMEngine + EngineLoop and through `trtprompt
serve` (real tritonserver, `ensemble` model, gRPC streaming). Both are up
for the whole run but never busy at the same time; rounds alternate.

    python -m trtprompt.bench.scenarios.serve_overhead engines/demo --requests 16 --concurrency 1,8
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from trtprompt.bench import machine
from trtprompt.client import LLMClient, text_inputs
from trtprompt.serve.ports import free_ports
from trtprompt.tokenizer import Tokenizer

WORDS = ("the cache keeps blocks of keys and values so a shared prefix is computed once while "
         "the scheduler packs context chunks and generation steps under a token budget").split()


def make_prompts(tok: Tokenizer, n: int, prompt_tokens: int) -> list[str]:
    prompts = []
    for i in range(n):
        words = [f"Request {i}:"]
        k = i
        while len(tok.encode(" ".join(words))) < prompt_tokens:
            words.append(WORDS[k % len(WORDS)])
            k = k * 7 + 3
        prompts.append(" ".join(words))
    return prompts


def summarize(samples: list[tuple[float, float]], max_tokens: int) -> dict[str, float]:
    """samples: (first, last token arrival s) per request -> ms statistics.

    Inter-token latency is (last - first) / (max_tokens - 1) per request: a
    streamed response may carry several tokens (a held-back partial
    character), so gaps between responses would not compare.
    """
    ttfts = sorted(first for first, _ in samples)
    itls = sorted((last - first) / (max_tokens - 1) for first, last in samples)
    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000

    return {"ttft_p50_ms": q(ttfts, 0.5), "ttft_p90_ms": q(ttfts, 0.9),
            "ttft_mean_ms": statistics.mean(ttfts) * 1000,
            "itl_mean_ms": statistics.mean(itls) * 1000, "itl_p90_ms": q(itls, 0.9)}


def run_pool(pool: ThreadPoolExecutor, n: int, one: Callable[[int], Any]) -> list[Any]:
    """n requests, at most pool._max_workers at a time (threads persist across rounds)."""
    return list(pool.map(one, range(n)))


class InProcess:
    """LLMEngine + EngineLoop in this process."""

    def __init__(self, engine_dir: Path, max_tokens: int) -> None:
        from trtprompt.engine.engine import LLMEngine
        from trtprompt.engine.loop import EngineLoop
        from trtprompt.engine.request import SamplingParams

        self.tok = Tokenizer.from_dir(engine_dir / "tokenizer")
        self.loop = EngineLoop(LLMEngine.from_engine_dir(engine_dir)).start()
        self.params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)

    def one(self, text: str) -> tuple[float, float]:
        ids = self.tok.encode(text)
        t0 = time.perf_counter()
        times = [time.perf_counter() - t0 for o in self.loop.submit(text, ids, self.params) if o.new_token_ids]
        return times[0], times[-1]

    def close(self) -> None:
        self.loop.stop()


class ThroughTriton:
    """`trtprompt serve` (real tritonserver), the `ensemble` model over gRPC streaming."""

    def __init__(self, engine_dir: Path, max_tokens: int) -> None:
        from trtprompt.serve.launch.launcher import Ports, Server
        from trtprompt.serve.launch.options import EngineInfo, resolve_options

        engine = EngineInfo.read(engine_dir)
        self.max_tokens = max_tokens
        self.local = threading.local()
        self.clients: list[LLMClient] = []
        self.split: list[tuple[float, float]] = []
        http, grpc, metrics = free_ports(3)
        self.url = f"127.0.0.1:{grpc}"
        self.server = Server(engine, resolve_options(engine, {}), Ports(grpc=grpc, http=http, metrics=metrics),
                             log=lambda m: None)
        self.server.start()

    def one(self, text: str) -> tuple[float, float]:
        # One connection per client thread, kept open, as load generators do.
        client: LLMClient | None = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = LLMClient(self.url)
            self.clients.append(client)
        sent_ns = time.time_ns()
        r = client.infer("ensemble", text_inputs(text, self.max_tokens, True, min_tokens=self.max_tokens,
                                                 temperature=0.0, return_perf_metrics=True))
        if r.error:
            raise RuntimeError(r.error)
        # Where the time goes, from the engine's own timestamps (same clock):
        # client send -> engine arrival, and the token that completed the
        # first response -> its arrival at the client.
        first = r.responses[0]
        self.split.append(((first["arrival_time_ns"].item() - sent_ns) / 1e6,
                           (sent_ns + r.times[0] * 1e9 - first["last_token_time_ns"].item()) / 1e6))
        return r.times[0], r.times[-1]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.stop()


def rounds_of(paths: dict[str, Any], prompts: list[str], levels: list[int], rounds: int,
              pools: dict[int, ThreadPoolExecutor]) -> tuple[dict[str, dict[str, list[tuple[float, float]]]],
                                                            dict[str, list[tuple[float, float]]]]:
    """Every path at every level per round (round -1 warms up); samples per path and level, Triton's splits."""
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {name: {f"c{c}": [] for c in levels} for name in paths}
    splits: dict[str, list[tuple[float, float]]] = {f"c{c}": [] for c in levels}
    for r in range(-1, rounds):  # round -1 warms up threads, connections and caches
        for level in levels:
            for name, path in paths.items():
                tag = f"r{r}c{level}{name}"
                paths["triton"].split.clear()
                got = run_pool(pools[level], len(prompts), functools.partial(_tagged, path, tag, prompts))
                if r >= 0:
                    samples[name][f"c{level}"] += got
                    splits[f"c{level}"] += paths["triton"].split
    return samples, splits


def _tagged(path: Any, tag: str, prompts: list[str], i: int) -> tuple[float, float]:
    """Prompt i through path, tagged so no two rounds or paths share a prefix."""
    result: tuple[float, float] = path.one(f"[{tag}] " + prompts[i])
    return result


def bench(engine_dir: Path, prompts: list[str], max_tokens: int, levels: list[int], rounds: int) -> dict[str, Any]:
    """Rounds alternate between the two paths, so machine-load drift hits both alike."""
    paths: dict[str, Any] = {"in_process": InProcess(engine_dir, max_tokens),
                             "triton": ThroughTriton(engine_dir, max_tokens)}
    pools = {level: ThreadPoolExecutor(max_workers=level) for level in levels}
    try:
        samples, splits = rounds_of(paths, prompts, levels, rounds, pools)
    finally:
        for pool in pools.values():
            pool.shutdown()
        for path in paths.values():
            path.close()
    out = {name: {c: summarize(s, max_tokens) for c, s in per.items()} for name, per in samples.items()}
    for c, pairs in splits.items():
        out["triton"][c]["inbound_p50_ms"] = statistics.median(a for a, _ in pairs)
        out["triton"][c]["outbound_p50_ms"] = statistics.median(b for _, b in pairs)
    return out


def print_table(result: dict[str, Any], levels: list[int]) -> None:
    print("| concurrency | path | TTFT p50 ms | TTFT p90 ms | ITL mean ms | ITL p90 ms | in / out p50 ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for level in levels:
        for path in ("in_process", "triton"):
            s = result[path][f"c{level}"]
            split = f"{s['inbound_p50_ms']:.1f} / {s['outbound_p50_ms']:.1f}" if "inbound_p50_ms" in s else ""
            print(f"| {level} | {path} | {s['ttft_p50_ms']:.1f} | {s['ttft_p90_ms']:.1f} | "
                  f"{s['itl_mean_ms']:.2f} | {s['itl_p90_ms']:.2f} | {split} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-results/serve_overhead.json"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tok = Tokenizer.from_dir(args.engine_dir / "tokenizer")
    prompts = make_prompts(tok, args.requests, args.prompt_tokens)
    result = {"engine": str(args.engine_dir), "requests_per_round": args.requests, "rounds": args.rounds,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "machine": machine.describe(),
              **bench(args.engine_dir, prompts, args.max_tokens, levels, args.rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result, levels)


if __name__ == "__main__":
    main()
