#!/usr/bin/env python3
"""What a decode step's linears cost on this CPU, apart from the engine (issue 26 items 5 and 6).

    python -m trtprompt.bench.scenarios.decode_linears ENGINE_DIR [--tokens 32,2048] [--reps 8] [--threads 2]
        [--paths engine,onednn] [--dtype float32|bfloat16]

From the engine's config.json it makes random weights in --dtype of every layer linear (qkv, o_proj,
gate_up, down) and of lm_head, as each path holds them: `engine`, what engine/linear.py's make_linear
builds on this CPU (the panel kernel to engine/panel_linear.py's PANEL_ROWS, oneDNN above and on other
variants; its summary line is printed), `onednn`, oneDNN's prepacked GEMM alone, `panel`, the panel kernel
alone on whichever kernel variant this CPU runs (how PANEL_ROWS was set; bf16 panels for bfloat16, where the CPU
has avx512_bf16), and `few`, the few-rows kernel to DENSE_FEW_ROWS_MAX rows with oneDNN above. The paths
alternate rep by rep, and for each token count M each times:
- hot: one layer's four linears, repeated, so their weights stay in cache (the GEMM alone);
- streamed: every layer's own four linears in turn, as a step runs them (weights from DRAM once
  the model outgrows the last-level cache);
- lm_head: the [M x hidden] x [hidden x vocab] output projection.
Prints the minimum and median over reps in ms and the GFLOP/s of each path, as JSON, with the machine
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
from trtprompt.engine import kernels
from trtprompt.engine.linear import (
    DENSE_FEW_ROWS_MAX,
    DenseFewRowsLinear,
    OneDnnLinear,
    linear_summary,
    make_linear,
    resolve_backend,
)
from trtprompt.engine.panel_linear import PanelLinear

PATHS = ("engine", "onednn", "panel", "few")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Linear = Callable[[torch.Tensor], torch.Tensor]


def linear(out_features: int, in_features: int, path: str, dtype: torch.dtype, head: bool = False) -> Linear:
    """A random weight in `dtype` as `path` holds it (see the module's docstring)."""
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(dtype)
    if path == "onednn":
        return OneDnnLinear(weight, None)
    if path == "panel":  # the panel kernel on any variant, also past PANEL_ROWS or where it has none
        return PanelLinear(weight, None, int(torch.ops.trtprompt.panel_width()))
    if path == "few":
        return DenseFewRowsLinear(weight, None, DENSE_FEW_ROWS_MAX[dtype])
    backend = resolve_backend("onednn", dtype, torch.device("cpu"))
    return make_linear(weight, None, backend, dtype, few_rows=not head)


def layer_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of qkv, o_proj, gate_up, down."""
    h, d = cfg["hidden_size"], cfg["head_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    inter = cfg["intermediate_size"]
    return [(h, qkv), (cfg["num_attention_heads"] * d, h), (h, 2 * inter), (inter, h)]


def timed(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, dict[str, float]]:
    """Minimum and median ms over reps of each fn, after one untimed call each, the fns alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: {"min_ms": min(t), "median_ms": statistics.median(t)} for name, t in times.items()}


def with_rate(res: dict[str, float], flops: float) -> dict[str, float]:
    """res with the GFLOP/s its minimum reaches."""
    return {**res, "gflops_at_min": flops / res["min_ms"] / 1e6}


def measure(cfg: dict[str, Any], m: int, reps: int, paths: list[str], dtype: torch.dtype) -> dict[str, Any]:
    """hot, streamed and lm_head at M tokens for each path (see the module's docstring)."""
    shapes, n_layers = layer_shapes(cfg), cfg["num_hidden_layers"]
    layers = {p: [[linear(n, k, p, dtype) for k, n in shapes] for _ in range(n_layers)] for p in paths}
    heads = {p: linear(cfg["vocab_size"], cfg["hidden_size"], p, dtype, head=True) for p in paths}
    inputs = {k: torch.randn(m, k).to(dtype) for k, _ in shapes}
    x = torch.randn(m, cfg["hidden_size"]).to(dtype)

    def run(linears: list[Linear]) -> None:
        for (k, _), lin in zip(shapes, linears):
            lin(inputs[k])

    def hot(p: str) -> Callable[[], None]:
        def go() -> None:  # one layer's weights n_layers times: they stay in cache
            for _ in range(n_layers):
                run(layers[p][0])
        return go

    def streamed(p: str) -> Callable[[], None]:
        def go() -> None:  # every layer's own weights, as a step runs them
            for w in layers[p]:
                run(w)
        return go

    def head(p: str) -> Callable[[], None]:
        def go() -> None:
            heads[p](x)
        return go

    layer_flops = 2.0 * m * sum(k * n for k, n in shapes) * n_layers
    head_flops = 2.0 * m * cfg["hidden_size"] * cfg["vocab_size"]
    cases = {"hot": (hot, layer_flops), "streamed": (streamed, layer_flops),
             "lm_head": (head, head_flops)}
    out: dict[str, Any] = {p: {} for p in paths}
    for case, (make, flops) in cases.items():
        for p, res in timed({p: make(p) for p in paths}, reps).items():
            out[p][case] = with_rate(res, flops)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path, help="an engine built by trtprompt build (its config.json is read)")
    ap.add_argument("--tokens", default="32,2048", help="comma list of token counts M")
    ap.add_argument("--reps", type=int, default=8, help="timed repetitions of each case")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--paths", default="engine,onednn,panel", help=f"comma list of {', '.join(PATHS)}")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the weights' and inputs' dtype")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: {args.paths!r}: a comma list of {', '.join(PATHS)}")
    torch.set_num_threads(args.threads)
    if {"panel", "few"} & set(paths) and not kernels.compiled_kernel_status()[0]:
        ap.error("--paths panel / few: the compiled kernels are not available here")
    dtype = DTYPES[args.dtype]
    cfg = json.loads((args.engine_dir / "config.json").read_text(encoding="utf-8"))["pretrained_config"]
    info = machine.describe()
    shapes = layer_shapes(cfg)
    summary = linear_summary([linear(n, k, "engine", dtype) for k, n in shapes]
                             + [linear(cfg["vocab_size"], cfg["hidden_size"], "engine", dtype, head=True)], dtype)
    res = {"engine": str(args.engine_dir), "cpu_flags": info["flags"], "machine": info, "threads": args.threads,
           "dtype": args.dtype, "engine_linears": summary,
           "tokens": {m: measure(cfg, m, args.reps, paths, dtype) for m in (int(t) for t in args.tokens.split(","))},
           "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
