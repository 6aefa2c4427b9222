"""The offline loop of every side: a full-size warm-up of each workload, then the timed reps, with the CPU the
process tree spent in each (cores_busy = CPU s / wall s: the check that a side used every core it was given).

Standard library only: the vLLM and OpenVINO workers (vllm_worker.py, openvino_worker.py) run by path in their
own venvs, which have no trtprompt, and import this file from beside them.

A side's runner is `run(prompts, max_tokens) -> dict` that generates every prompt (all in flight at once),
greedy, exactly max_tokens tokens each, and returns:

- wall_s, output_tokens, mean_ttft_s (None where the side cannot tell), tokens: [[ids] per prompt]
- ms_per_token: per prompt, (time of its last token - time of its first) / (tokens - 1) in ms, None where the
  side cannot tell or for a single token

A workload with "one_at_a_time" sends its prompts one by one: run([p], max_tokens) for each p.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

Prompts = list[list[int]]
RunFn = Callable[[Prompts, int], dict[str, Any]]


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of a process and its live descendants (all their threads), from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, [root]
    while frontier:
        kids = [pid for pid, pp in parent.items() if pp == frontier[-1] and pid not in tree]
        frontier.pop()
        tree.update(kids)
        frontier.extend(kids)
    return sum(cpu.get(pid, 0.0) for pid in tree)


def ms_per_token(first_s: float | None, last_s: float | None, tokens: int) -> float | None:
    """Mean time between a request's tokens after the first (its inter-token latency), in ms."""
    if first_s is None or last_s is None or tokens < 2:
        return None
    return (last_s - first_s) / (tokens - 1) * 1e3


def one_at_a_time(run: RunFn, prompts: Prompts, max_tokens: int) -> dict[str, Any]:
    """Each prompt alone, one after the other; the figures of the whole sequence."""
    t0 = time.perf_counter()
    outs = [run([p], max_tokens) for p in prompts]
    ttft = [o["mean_ttft_s"] for o in outs if o.get("mean_ttft_s") is not None]
    return {"wall_s": time.perf_counter() - t0, "output_tokens": sum(o["output_tokens"] for o in outs),
            "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
            "tokens": [t for o in outs for t in o["tokens"]],
            "ms_per_token": [m for o in outs for m in o.get("ms_per_token") or [None]]}


def _median(values: list[float | None] | None) -> float | None:
    present = [v for v in values or [] if v is not None]
    return statistics.median(present) if present else None


def _run(run: RunFn, wl: dict[str, Any], prompts: Prompts) -> dict[str, Any]:
    if wl.get("one_at_a_time"):
        return one_at_a_time(run, prompts, wl["max_tokens"])
    return run(prompts, wl["max_tokens"])


def _summary_line(name: str, i: int, r: dict[str, Any], load: float) -> str:
    ttft = "—" if r["mean_ttft_s"] is None else f"{r['mean_ttft_s']:.3f} s"
    itl = "" if r["median_ms_per_token"] is None else f", {r['median_ms_per_token']:.2f} ms/token after the first"
    return (f"{name} rep {i}: {r['wall_s']:.2f} s, {r['output_tok_s']:.1f} out tok/s, mean TTFT {ttft}{itl}, "
            f"{r['cores_busy']:.2f} cores busy (load {load:.2f})")


def run_workloads(run: RunFn, reset: Callable[[], None], spec: dict[str, Any], pid: int) -> dict[str, Any]:
    """Warm up on every workload at full size, then time each rep; the cache is reset before each.
    pid: the root of the processes doing the work (their CPU time is measured)."""
    t0 = time.perf_counter()
    for wl in spec["workloads"].values():
        reset()
        _run(run, wl, wl["warmup"])
    result: dict[str, Any] = {"warmup_s": time.perf_counter() - t0}
    for name, wl in spec["workloads"].items():
        reps = []
        for i, prompts in enumerate(wl["reps"]):
            reset()
            load, cpu0 = os.getloadavg()[0], tree_cpu_seconds(pid)
            r = _run(run, wl, prompts)
            r["cores_busy"] = (tree_cpu_seconds(pid) - cpu0) / r["wall_s"]
            r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
            r["median_ms_per_token"] = _median(r.get("ms_per_token"))
            r["loadavg_1m_before"] = load
            if i > 0:
                r.pop("tokens")  # keep the first rep's tokens for the greedy agreement check
            reps.append(r)
            print(_summary_line(name, i, r, load), flush=True)
        result[name] = reps
    return result


def worker_parser(description: str) -> argparse.ArgumentParser:
    """The options every offline worker takes; each adds its side's own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--prompts", required=True, help="the workloads' JSON (workloads.py's offline_spec)")
    ap.add_argument("--out", required=True, help="where the result JSON goes")
    return ap


def run_and_write(side: str, make: Callable[[dict[str, Any]], tuple[RunFn, Callable[[], None]]],
                  prompts: str, out: str, versions: Callable[[], dict[str, str]]) -> None:
    """Initialise the side (make(spec) -> run, reset), run every workload, write the result JSON."""
    spec = json.loads(Path(prompts).read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    run, reset = make(spec)
    init_s = time.perf_counter() - t0
    print(f"{side}: initialised in {init_s:.1f} s", flush=True)
    result = {"side": side, "init_s": init_s, **run_workloads(run, reset, spec, os.getpid()), "versions": versions()}
    Path(out).write_text(json.dumps(result, indent=1), encoding="utf-8")
