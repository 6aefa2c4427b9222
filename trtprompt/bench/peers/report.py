"""The side-by-side's report: one row per (workload, metric) with each side's median and trtprompt / each peer,
the cores each side kept busy, greedy agreement and exact output lengths."""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Sequence

from trtprompt.bench.peers import workloads

SIDES = ("vllm", "trtprompt", "llamacpp", "openvino")
PEERS = ("vllm", "llamacpp", "openvino")  # the sides trtprompt is compared with
NAMES = {"vllm": "vLLM CPU", "llamacpp": "llama.cpp", "openvino": "OpenVINO GenAI", "trtprompt": "trtprompt"}


def median_of(reps: list[dict[str, Any]] | None, key: str) -> float | None:
    vals = [r[key] for r in reps or [] if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def row_specs(args: argparse.Namespace) -> list[tuple[str, str, str, str, str]]:
    """(workload, label, key, metric, which is better) of every row the table can have."""
    return [("throughput", f"{args.throughput_requests} x ({args.throughput_input} in, "
             f"{args.throughput_output} out), offline, greedy", "output_tok_s", "output tok/s", "higher"),
            ("prefix", f"{args.prefix_requests} x ({args.prefix_len} shared + {args.prefix_unique}) -> "
             f"{args.prefix_output}, reuse on, new prefix", "wall_s", "wall s", "lower"),
            ("prefix", "same", "mean_ttft_s", "mean TTFT s", "lower"),
            ("latency", f"one request at a time, {args.latency_input} -> {args.latency_output}, greedy",
             "median_ms_per_token", "ms per token after the first", "lower"),
            ("served", f"served, random {args.served_input} -> {args.served_output}, concurrency "
             f"{args.served_concurrency}", "output_tok_s", "output tok/s", "higher"),
            ("served", "same", "mean_ttft_s", "mean TTFT s", "lower")]


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def round_ratios(ours: list[dict[str, Any]] | None, theirs: list[dict[str, Any]] | None, key: str) -> list[float]:
    """trtprompt / peer of each round (rep i of both sides ran back to back, sidebyside.run_all): on a shared host
    whose speed drifts, the spread of these says how far the medians' ratio can be trusted."""
    pairs = zip(ours or [], theirs or [])
    return [r for r in (_ratio(a.get(key), b.get(key)) for a, b in pairs) if r is not None]


def rows(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, metric): medians of each side and trtprompt / each peer."""
    out = []
    for workload, label, key, metric, better in row_specs(args):
        if workload not in args.only:
            continue
        vals = {side: median_of(results.get(side, {}).get(workload), key) for side in args.sides}
        cores = {side: median_of(results.get(side, {}).get(workload), "cores_busy") for side in args.sides}
        peers = [peer for peer in args.sides if peer in PEERS]
        ratios = {peer: _ratio(vals["trtprompt"], vals[peer]) for peer in peers}
        rounds = {peer: round_ratios(results.get("trtprompt", {}).get(workload), results.get(peer, {}).get(workload),
                                     key) for peer in peers}
        out.append({"workload": label, "metric": metric, "better": better, **vals, "ratios": ratios,
                    "round_ratios": rounds, "cores_busy": cores})
    return out


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _rounds_text(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return ""
    return f"; rounds {min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}"


def markdown(table: list[dict[str, Any]], sides: Sequence[str]) -> str:
    peers = [s for s in sides if s in PEERS]
    head = ["workload", "metric", *(NAMES[s] for s in sides), *(f"trtprompt / {NAMES[p]}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in table:
        ratios = ["—" if r["ratios"][p] is None else f"{r['ratios'][p]:.2f}× ({r['better']} is better"
                  f"{_rounds_text(r.get('round_ratios', {}).get(p, []))})" for p in peers]
        lines.append("| " + " | ".join([r["workload"], r["metric"], *(_fmt(r[s]) for s in sides), *ratios]) + " |")
    return "\n".join(lines)


def cores_line(table: list[dict[str, Any]], sides: Sequence[str], threads: int) -> str:
    """Median cores each side kept busy per workload; a side under 75 % of --threads is flagged."""
    parts = []
    for r in table:
        if r["workload"] == "same":
            continue
        busy = {s: r["cores_busy"][s] for s in sides if r["cores_busy"].get(s) is not None}
        low = [s for s, v in busy.items() if v < 0.75 * threads]
        parts.append(f"{r['workload'].split(',')[0]}: " + ", ".join(f"{s} {v:.2f}" for s, v in busy.items())
                     + (f" (UNDER {threads} CORES: {', '.join(low)})" if low else ""))
    return "cores busy (CPU s / wall s, process tree, median): " + "; ".join(parts)


def greedy_agreement(results: dict[str, Any], peer: str) -> dict[str, Any] | None:
    """Share of the first throughput rep's sequences whose greedy tokens match trtprompt's and peer's."""
    try:
        a, b = (results[s]["throughput"][0]["tokens"] for s in ("trtprompt", peer))
    except (KeyError, IndexError, TypeError):
        return None
    return {"sequences": len(a), "identical": sum(x == y for x, y in zip(a, b)),
            "tokens_equal": sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)),
            "tokens": sum(len(x) for x in a)}


def length_problems(results: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """Every offline rep whose output tokens differ from requests x max_tokens (each side must yield exactly
    the asked lengths, or the sides did different work)."""
    problems = []
    for side, res in results.items():
        for name in spec["workloads"]:
            for i, rep in enumerate(res.get(name) or []):
                want = workloads.expected_tokens(spec, name, i)
                if rep.get("output_tokens") != want:
                    problems.append(f"{side} {name} rep {i}: {rep.get('output_tokens')} output tokens, "
                                    f"expected {want}")
    return problems
