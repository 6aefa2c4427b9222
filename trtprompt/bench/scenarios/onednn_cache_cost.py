"""What bounding the per-shape caches costs: RSS growth and linear time, per pair of capacities.

oneDNN keeps one compiled primitive per distinct input shape and ideep an LRU of per-shape
computations above it; the engine's token count changes every step, so the defaults (1,024
each) made the engine's RSS climb for many rounds (issue 11). trtprompt caps both
(trtprompt/engine/linear.py). This scenario
runs the demo `small` model's linears (hidden 512, intermediate 1376, 8 layers, vocab 4,000)
through prepacked oneDNN, in a fresh process per pair because the capacities are read once,
and reports per pair (oneDNN primitives / ideep LRU entries):

- RSS after `--rounds` rounds of a mixed load (decode at batch 1-64 plus prefill chunks of
  random sizes up to 512 tokens), first and last round;
- decode time: a full decode step's linears at batch sizes that drift one by one, as a
  continuously batched engine's do (ms per step).

    .venv/bin/python -m trtprompt.bench.scenarios.onednn_cache_cost --caps 256/64,1024/1024 --rounds 3
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Callable

import click

from trtprompt.bench import machine

MODULE = "trtprompt.bench.scenarios.onednn_cache_cost"  # each pair runs `python -m MODULE --child 1`
HIDDEN, INTER, LAYERS, VOCAB, KV = 512, 1376, 8, 4000, 256


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _step_fn() -> Callable[[int], None]:
    """A step of the small model's linears (every layer's qkv, o, gate_up, down, then lm_head) at m tokens."""
    import torch

    from trtprompt.engine.linear import OneDnnLinear

    torch.manual_seed(0)
    shapes = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    layers = [[OneDnnLinear(torch.randn(o, i) * 0.02, None) for o, i in shapes] for _ in range(LAYERS)]
    head = OneDnnLinear(torch.randn(VOCAB, HIDDEN) * 0.02, None)

    def step(m: int) -> None:
        x = torch.randn(m, HIDDEN)
        for qkv, o, up, down in layers:
            qkv(x)
            o(x)
            down(up(x)[:, :INTER].contiguous())
        head(x[-min(m, 64):])

    return step


def _child(rounds: int, seed: int) -> dict[str, Any]:
    import torch

    step = _step_fn()
    rng = random.Random(seed)
    rss = []
    with torch.inference_mode():
        for _ in range(rounds):
            for m in list(range(1, 65)) + [rng.randint(65, 512) for _ in range(16)]:
                step(m)
            rss.append(round(_rss_mib(), 1))
        batch, t0, n = 32, time.perf_counter(), 0
        for _ in range(200):  # decode: batch drifts by one as requests come and go
            batch = min(64, max(1, batch + rng.choice((-1, 0, 1))))
            step(batch)
            n += 1
        decode_ms = (time.perf_counter() - t0) * 1000 / n
    return {"rss_first_mib": rss[0], "rss_last_mib": rss[-1], "rss_by_round": rss,
            "decode_step_ms": round(decode_ms, 2)}


@click.command()
@click.option("--caps", default="256/64,1024/1024", show_default=True,
              help="ONEDNN_PRIMITIVE_CACHE_CAPACITY/LRU_CACHE_CAPACITY pairs to compare")
@click.option("--rounds", default=10, show_default=True)
@click.option("--child", type=int, default=None, hidden=True)
def main(caps: str, rounds: int, child: int | None) -> None:
    """RSS growth and decode time of the small model's linears per pair of per-shape cache capacities."""
    if child is not None:
        print(json.dumps(_child(rounds, seed=1)))
        return
    print(f"machine: {machine.one_line()}")
    for pair in caps.split(","):
        onednn, ideep = pair.split("/")
        env = dict(os.environ, ONEDNN_PRIMITIVE_CACHE_CAPACITY=onednn, LRU_CACHE_CAPACITY=ideep,
                   OMP_NUM_THREADS="2")
        out = subprocess.run([sys.executable, "-m", MODULE, "--rounds", str(rounds), "--child", "1"],
                             env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"capacities {pair:>9}: RSS {r['rss_first_mib']:.0f} -> {r['rss_last_mib']:.0f} MiB over "
              f"{rounds} rounds {r['rss_by_round']}; decode step linears {r['decode_step_ms']:.2f} ms")


if __name__ == "__main__":
    main()
