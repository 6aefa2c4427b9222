#!/usr/bin/env python3
"""What a decode step's linears cost on this CPU, apart from the engine (issue 26 items 5 and 6).

    python -m trtprompt.bench.scenarios.decode_linears ENGINE_DIR [--tokens 32,2048] [--reps 8] [--threads 2]

From the engine's config.json it makes random fp32 weights of every layer linear (qkv, o_proj,
gate_up, down) and of lm_head, prepacked for oneDNN as the engine does (engine/linear.py), and
times, for each token count M:
- hot: one layer's four linears, repeated, so their weights stay in cache (the GEMM alone);
- streamed: every layer's own four linears in turn, as a step runs them (weights from DRAM once
  the model outgrows the last-level cache);
- lm_head: the [M x hidden] x [hidden x vocab] output projection.
Prints the minimum and median over reps in ms and the GFLOP/s of each, as JSON, with the machine
(trtprompt/bench/machine.py: CPU, its kernel flags, cores, load, commit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trtprompt.bench import machine
from trtprompt.engine.linear import ONEDNN_BATCH_HINT


def packed(out_features: int, in_features: int) -> torch.Tensor:
    """A random weight prepacked for oneDNN as engine/linear.py packs it."""
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    prepacked: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
    return prepacked


def layer_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of qkv, o_proj, gate_up, down."""
    h, d = cfg["hidden_size"], cfg["head_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    inter = cfg["intermediate_size"]
    return [(h, qkv), (cfg["num_attention_heads"] * d, h), (h, 2 * inter), (inter, h)]


def timed(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """Minimum and median ms over reps, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"min_ms": min(times), "median_ms": statistics.median(times)}


def with_rate(res: dict[str, float], flops: float) -> dict[str, float]:
    """res with the GFLOP/s its minimum reaches."""
    return {**res, "gflops_at_min": flops / res["min_ms"] / 1e6}


def measure(cfg: dict[str, Any], m: int, reps: int) -> dict[str, Any]:
    """hot, streamed and lm_head at M tokens (see the module's docstring)."""
    shapes = layer_shapes(cfg)
    layers = [[packed(n, k) for k, n in shapes] for _ in range(cfg["num_hidden_layers"])]
    inputs = {k: torch.randn(m, k) for k, _ in shapes}
    lm_head = packed(cfg["vocab_size"], cfg["hidden_size"])

    def run(weights: list[torch.Tensor]) -> None:
        for (k, _), w in zip(shapes, weights):
            torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")

    n_layers = cfg["num_hidden_layers"]

    def hot_layers() -> None:  # one layer's weights n_layers times: they stay in cache
        for _ in range(n_layers):
            run(layers[0])

    def streamed_layers() -> None:  # every layer's own weights, as a step runs them
        for w in layers:
            run(w)

    layer_flops = 2.0 * m * sum(k * n for k, n in shapes)
    hot = timed(hot_layers, reps)
    streamed = timed(streamed_layers, reps)
    x = torch.randn(m, cfg["hidden_size"])
    head = timed(lambda: torch.ops.mkldnn._linear_pointwise(x, lm_head, None, "none", [], ""), reps)
    return {"hot": with_rate(hot, layer_flops * n_layers), "streamed": with_rate(streamed, layer_flops * n_layers),
            "lm_head": with_rate(head, 2.0 * m * cfg["hidden_size"] * cfg["vocab_size"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path, help="an engine built by trtprompt build (its config.json is read)")
    ap.add_argument("--tokens", default="32,2048", help="comma list of token counts M")
    ap.add_argument("--reps", type=int, default=8, help="timed repetitions of each case")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.loads((args.engine_dir / "config.json").read_text(encoding="utf-8"))["pretrained_config"]
    info = machine.describe()
    res = {"engine": str(args.engine_dir), "cpu_flags": info["flags"], "machine": info, "threads": args.threads,
           "tokens": {m: measure(cfg, m, args.reps) for m in (int(t) for t in args.tokens.split(","))},
           "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
