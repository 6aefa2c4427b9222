"""What one step's adapter products cost on each LoraStep path (masked, runs, kernel), without the model.

    python -m trtprompt.bench.scenarios.lora_paths ENGINE_DIR [--adapters 8] [--rows 32] [--rank 16] [--reps 5]
        [--out FILE]

ENGINE_DIR gives the shapes (its pretrained config). --adapters random adapters of rank --rank on all seven
linears; --rows rows spread evenly over them, packed by adapter as the runner packs them. For float32 and
bf16 activations, each path's products for every layer's four fused linears, as one step adds them: the
best of --reps, in ms per step. The layers are visited in order, so each layer's adapter weights come from
memory as they do in a real step. Prints JSON with the machine. docs/lora.md, "Batched products".
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from trtprompt.bench import machine
from trtprompt.engine import kernels
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.engine.lora.adapter import LoraAdapter, ModuleLora
from trtprompt.engine.lora.modules import GROUPS, MODULES, module_shapes
from trtprompt.engine.lora.stacks import LoraPath, LoraStacks, LoraStep

PATHS: tuple[LoraPath, ...] = ("masked", "runs", "kernel")


def random_adapter(cfg: ModelConfig, name: str, rank: int, gen: torch.Generator) -> LoraAdapter:
    shapes = module_shapes(cfg)
    pairs = {(layer, m): ModuleLora(torch.randn(rank, shapes[m].in_features, generator=gen) * 0.05,
                                    torch.randn(shapes[m].out_features, rank, generator=gen) * 0.05)
             for layer in range(cfg.num_hidden_layers) for m in MODULES}
    return LoraAdapter(name, name, rank, MODULES, pairs)


def step_ms(step: LoraStep, cfg: ModelConfig, dtype: torch.dtype, rows: int, reps: int) -> float:
    """Best of reps: every layer's four fused linears, in order."""
    shapes, gen = module_shapes(cfg), torch.Generator().manual_seed(1)
    xs = {g: torch.randn(rows, shapes[m[0]].in_features, generator=gen).to(dtype) for g, m in GROUPS.items()}
    ys = {g: torch.zeros(rows, sum(shapes[n].out_features for n in m), dtype=dtype) for g, m in GROUPS.items()}
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        started = time.perf_counter()
        for layer in range(cfg.num_hidden_layers):
            for group in GROUPS:
                step.apply(ys[group], xs[group], layer, group)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path, help="a torch-target engine directory (its shapes)")
    ap.add_argument("--adapters", type=int, default=8, help="adapters in the batch")
    ap.add_argument("--rows", type=int, default=32, help="rows in the step, spread evenly over the adapters")
    ap.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per path (best taken)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if not kernels.compiled_kernel_status()[0]:
        raise SystemExit(f"the kernel path needs the compiled kernels: {kernels.compiled_kernel_status()[1]}")
    cfg = read_engine_dir(args.engine).model_config()
    gen = torch.Generator().manual_seed(0)
    stacks = LoraStacks(cfg, [random_adapter(cfg, f"a{i}", args.rank, gen) for i in range(args.adapters)],
                        torch.float32, torch.device("cpu"))
    row_slot = sorted(i % args.adapters for i in range(args.rows))
    ms: dict[str, dict[str, float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        ms[str(dtype).removeprefix("torch.")] = {
            path: step_ms(LoraStep(stacks, row_slot, torch.device("cpu"), path,
                                   kernels.variant().lanes if path == "kernel" else None),
                          cfg, dtype, args.rows, args.reps)
            for path in PATHS}
    machine.print_and_write({"ms_per_step": ms, "args": {k: str(v) for k, v in vars(args).items()}}, args.out)


if __name__ == "__main__":
    main()
