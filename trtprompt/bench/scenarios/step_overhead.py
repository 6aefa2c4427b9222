"""Where an engine step's time goes: kernels vs everything between them (issue 26 item 5).

    python -m trtprompt.bench.scenarios.step_overhead ENGINE_DIR [--batches 1,8,32] [--steps 20] [--profile]
        [--compare-fused] [--compare-layers] [--compare-head]

For each batch size, B requests of --prompt random tokens are prefilled, then --steps decode
steps are timed, each split by wall clock into schedule / prepare (input tensors and attention
metadata) / forward / sample / update (stop checks, outputs). A mixed step (one chunk of
--chunk prefill tokens beside B-1 decodes) is timed the same way. Forward is split again, by wall
clock, into the layers' linears, lm_head and attention (KV writes included), and forward_rest (norms,
rotary, residual adds, views and the Python between them); a decode step whose layers run as one compiled call
(engine/decode_layers.py) has them all in `fused_layers` instead. With --profile, torch.profiler
sums the ops' self CPU time per class over the decode steps (linears, attention, row-wise ops,
other small ops); the rest of the step is Python between ops. With --compare-fused, blocks of decode steps
alternate with and without the fused decode attention, in this process; with --compare-layers, with the layers
in one compiled call and with the layer loop (its fused decode attention kept), before any part is timed (the
timer's wrappers would slow the loop only); with --compare-head, with lm_head's int8 screen for greedy rows and with
the float head. Prints JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from trtprompt.bench import machine
from trtprompt.engine import engine as engine_module
from trtprompt.engine import model as model_module
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams

PARTS = ("schedule", "prepare", "forward", "sample", "update")
# Inside forward, by wall clock too (no profiler, whose per-op cost would swamp the small ops): the
# layers' linears, the output projection, attention (KV write included), the layers of a step run as one call;
# forward_rest is the rest.
FORWARD_PARTS = ("linears", "lm_head", "attention", "fused_layers")
# Op name fragments -> class, first match wins (profiler keys of the ops the model runs).
OP_CLASSES = (("linear", ("_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "w8a8", "int8",
                         "panel_linear", "few_rows_linear", "amx_linear")),
              ("attention", ("paged", "attention", "sdpa", "flash")),
              ("rowwise", ("rms_norm", "silu_and_mul", "rotary", "aten::rsqrt", "aten::silu")))


class PartTimer:
    """Wall time of the engine's step parts, by wrapping the callables the step calls."""

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[name] += time.perf_counter() - t0
        return timed

    def install(self, engine: LLMEngine) -> None:
        engine.scheduler.schedule = self.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
        runner = engine.runner
        self.install_forward_parts(runner.model)
        runner.prepare = self.wrap("prepare", runner.prepare)  # type: ignore[method-assign]
        runner.model.forward = self.wrap("forward", runner.model.forward)  # type: ignore[method-assign]
        engine._update = self.wrap("update", engine._update)  # type: ignore[method-assign]
        engine_module.sample = self.wrap("sample", engine_module.sample)

    def install_forward_parts(self, model: Any) -> None:
        """linears, lm_head and attention inside the model's forward, timed apart."""
        for layer in model.layers:
            for lin in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
                lin.forward = self.wrap("linears", lin.forward)
        model.lm_head.forward = self.wrap("lm_head", model.lm_head.forward)
        model_module.paged_attention = self.wrap("attention", model_module.paged_attention)
        model_module.decode_attention = self.wrap("attention", model_module.decode_attention)
        if model.decode_layers is not None:
            model.decode_layers.run = self.wrap("fused_layers", model.decode_layers.run)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n seeded random prompts of `length` tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def start_batch(engine: LLMEngine, batch: int, prompt: int, tag: str) -> None:
    """`batch` requests prefilled, each with its first token: from here every step is a decode step."""
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    for i, p in enumerate(prompts(batch, prompt, engine.model_config.vocab_size, batch)):
        engine.add_request(f"{tag}{i}", p, params)
    while any(r.num_output == 0 for r in engine.requests.values()):
        engine.step()


def timed_steps(engine: LLMEngine, timer: PartTimer, steps: int) -> dict[str, float]:
    """Median and minimum over steps of the step and of each part (the minimum: the least disturbed
    by other processes on a shared machine)."""
    per_step: list[dict[str, float]] = []
    for _ in range(steps):
        timer.times.clear()
        t0 = time.perf_counter()
        engine.step()
        parts = {p: timer.times[p] * 1e3 for p in PARTS + FORWARD_PARTS}
        parts["step"] = (time.perf_counter() - t0) * 1e3
        parts["other"] = parts["step"] - sum(parts[p] for p in PARTS)
        parts["forward_rest"] = parts["forward"] - sum(parts[p] for p in FORWARD_PARTS)
        per_step.append(parts)
    res: dict[str, float] = {}
    for key in ("step", *PARTS, "other", *FORWARD_PARTS, "forward_rest"):
        vals = [s[key] for s in per_step]
        res[f"{key}_ms_median"], res[f"{key}_ms_min"] = statistics.median(vals), min(vals)
    return res


def op_class(key: str) -> str:
    """The class (OP_CLASSES) a profiler op name falls in; small_ops when none."""
    low = key.lower()
    for cls, frags in OP_CLASSES:
        if any(f in low for f in frags):
            return cls
    return "small_ops"


def profile_steps(engine: LLMEngine, steps: int) -> dict[str, Any]:
    """Self CPU time per op class over decode steps, and the share of the step it covers."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall_us = (time.perf_counter() - t0) * 1e6
    per_class: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    top: list[tuple[float, str, int]] = []
    for ev in prof.key_averages():
        per_class[op_class(ev.key)] += ev.self_cpu_time_total
        counts[op_class(ev.key)] += ev.count
        top.append((ev.self_cpu_time_total, ev.key, ev.count))
    top.sort(reverse=True)
    in_ops = sum(per_class.values())
    return {"wall_ms_per_step_profiled": wall_us / steps / 1e3,
            "ms_per_step": {k: v / steps / 1e3 for k, v in sorted(per_class.items())},
            "ops_per_step": {k: v / steps for k, v in sorted(counts.items())},
            "between_ops_ms_per_step": (wall_us - in_ops) / steps / 1e3,
            "top_ops": [(k, round(t / steps / 1e3, 3), c // steps) for t, k, c in top[:15]]}


def mixed_step(engine: LLMEngine, timer: PartTimer, chunk: int, steps: int) -> dict[str, float]:
    """One request's prefill chunks beside the running decodes (chunked context)."""
    rng = random.Random(7)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    results = []
    for k in range(steps):
        prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(chunk)]
        engine.add_request(f"mix{k}", prompt, params)
        results.append(timed_steps(engine, timer, 1))
        while f"mix{k}" in engine.requests:  # its first token, if the chunk did not finish it
            engine.step()
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def alternate(engine: LLMEngine, rounds: int, block: int, switch: Callable[[bool], None]) -> dict[str, float]:
    """Decode steps in blocks of `block`, switch(True) and switch(False) alternating `rounds` times in this process:
    median and minimum step of each (keys `on_` / `off_`), and their ratios."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            switch(on)
            for _ in range(block):
                t0 = time.perf_counter()
                engine.step()
                times[on].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    return {"on_ms_median": med[True], "off_ms_median": med[False], "ratio_median": med[True] / med[False],
            "on_ms_min": low[True], "off_ms_min": low[False], "ratio_min": low[True] / low[False]}


def fused_ab(engine: LLMEngine, rounds: int, block: int = 6) -> dict[str, float]:
    """The fused decode attention (attention.decode_attention, and with it the one-call layers) against the
    op-by-op path: the layer ops' fuses_decode switched."""
    ops = engine.runner.ops

    def switch(on: bool) -> None:
        ops.fuses_decode = on

    try:
        got = alternate(engine, rounds, block, switch)
    finally:
        ops.fuses_decode = type(ops).fuses_decode
    return {k.replace("on_", "fused_").replace("off_", "op_by_op_"): v for k, v in got.items()}


def model_ab(engine: LLMEngine, attr: str, names: tuple[str, str], rounds: int, block: int) -> dict[str, float]:
    """alternate with the model's `attr` as loaded (keys named names[0]) and set to None (names[1]); put back."""
    model = engine.runner.model
    kept = getattr(model, attr)

    def switch(on: bool) -> None:
        setattr(model, attr, kept if on else None)

    try:
        got = alternate(engine, rounds, block, switch)
    finally:
        setattr(model, attr, kept)
    return {k.replace("on_", names[0]).replace("off_", names[1]): v for k, v in got.items()}


def layers_ab(engine: LLMEngine, rounds: int, block: int = 8) -> dict[str, float]:
    """The layers in one compiled call (engine/decode_layers.py) against the layer loop, whose layers keep the
    fused decode attention."""
    return model_ab(engine, "decode_layers", ("one_call_", "loop_"), rounds, block)


def head_ab(engine: LLMEngine, rounds: int, block: int = 8) -> dict[str, float]:
    """lm_head's int8 screen for greedy rows (engine/greedy_head.py) against the float head."""
    if engine.runner.model.greedy_head is None:
        raise ValueError("--compare-head: this engine has no greedy head (docs/design.md, \"Greedy head\")")
    return model_ab(engine, "greedy_head", ("screened_", "float_head_"), rounds, block)


def compare_each_batch(engine: LLMEngine, args: argparse.Namespace,
                       ab: Callable[[LLMEngine, int], dict[str, float]]) -> dict[int, dict[str, float]]:
    """An A/B (layers_ab, head_ab) at each batch size, on an engine no timer wraps."""
    out: dict[int, dict[str, float]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        start_batch(engine, batch, args.prompt, f"l{batch}-")
        out[batch] = ab(engine, max(4, args.steps // 4))
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine.from_engine_dir(args.engine_dir, enable_kv_cache_reuse=False, speculative_decoding="none")
    layers = compare_each_batch(engine, args, layers_ab) if args.compare_layers else None
    head = compare_each_batch(engine, args, head_ab) if args.compare_head else None
    timer = PartTimer()
    timer.install(engine)
    out: dict[str, Any] = {"engine": str(args.engine_dir), "layers": engine.model_config.num_hidden_layers,
                           "attention_backend": engine.attention_backend, "batches": {}}
    if layers is not None:
        out["one_call_layers"] = layers
    if head is not None:
        out["greedy_head"] = head
    for batch in (int(b) for b in args.batches.split(",")):
        start_batch(engine, batch, args.prompt, f"b{batch}-")
        timed_steps(engine, timer, 3)  # warm-up
        res: dict[str, Any] = {"decode": timed_steps(engine, timer, args.steps)}
        if args.profile:
            res["profile"] = profile_steps(engine, max(3, args.steps // 4))
        if args.compare_fused:
            res["fused_decode"] = fused_ab(engine, max(4, args.steps // 2))
        if batch > 1 and args.chunk:
            res["mixed"] = mixed_step(engine, timer, args.chunk, max(3, args.steps // 4))
        out["batches"][batch] = res
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()
    engine.close()
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=128, help="prefill tokens of the mixed step (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compare-fused", action="store_true", help="also alternate decode steps with and without "
                    "the fused decode attention (docs/design.md, \"Fused layer ops\") and report both")
    ap.add_argument("--compare-layers", action="store_true", help="first alternate decode steps with the layers "
                    "in one compiled call and with the layer loop (engine/decode_layers.py) and report both")
    ap.add_argument("--compare-head", action="store_true", help="first alternate decode steps with lm_head's "
                    "int8 screen for greedy rows and with the float head (engine/greedy_head.py) and report both")
    ap.add_argument("--out", type=Path)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    res = run(args)
    res["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    machine.print_and_write(res, args.out)


if __name__ == "__main__":
    main()
