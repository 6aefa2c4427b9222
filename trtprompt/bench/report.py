"""Summaries, tables and plots of benchmark runs.

Percentiles interpolate linearly between closest ranks (numpy's default),
so p50 of [1, 2, 3, 4] is 2.5. Latencies are kept in seconds in JSON and
shown in milliseconds in tables. KV reuse comes from the per-request
`return_perf_metrics` outputs: a request's reusable prompt blocks are its
full blocks before the last prompt token (which is always recomputed), as
the engine counts hits and misses. Where the reused blocks came from (the
pool, or a tier below it: disk, redis) comes from the server's per-tier
counters on /metrics, before and after the measured window, and so do the
speculative decoding figures (draft and accepted tokens, acceptance rate and
length) when the server speculated.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from trtprompt.bench.runner import RequestRecord, RunResult
from trtprompt.serve import metrics_catalog as C

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float], qs: Iterable[int] = PERCENTILES) -> dict[str, float | None]:
    """{'mean', 'p50', ...}; None for every key when there are no values."""
    qs = tuple(qs)
    if not values:
        return {"mean": None, **{f"p{q}": None for q in qs}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in qs}}


def tpot(rec: RequestRecord) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
    if rec.ttft_s is None or rec.e2e_s is None or not rec.num_output_tokens or rec.num_output_tokens < 2:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.num_output_tokens - 1)


def kv_summary(records: Sequence[RequestRecord], tokens_per_block: int | None) -> dict[str, Any]:
    with_perf = [r for r in records if "kv_cache_reused_blocks" in r.perf]
    if not with_perf:  # in-process baselines report no KV figures
        return {"reused_blocks": None, "new_blocks": None, "total_blocks": None, "hit_rate": None,
                "prefill_tokens_computed": None, "prompt_tokens": None}
    reused = sum(r.perf["kv_cache_reused_blocks"] for r in with_perf)
    out: dict[str, Any] = {
        "reused_blocks": reused,
        "new_blocks": sum(r.perf.get("kv_cache_alloc_new_blocks", 0) for r in with_perf),
        "total_blocks": sum(r.perf.get("kv_cache_alloc_total_blocks", 0) for r in with_perf),
        "hit_rate": None, "prefill_tokens_computed": None, "prompt_tokens": None,
    }
    if tokens_per_block and with_perf:
        lens = [r.num_input_tokens or r.prompt_len for r in with_perf]
        reusable = sum((n - 1) // tokens_per_block for n in lens)
        out["hit_rate"] = reused / reusable if reusable else 0.0
        out["prompt_tokens"] = sum(lens)
        out["prefill_tokens_computed"] = sum(lens) - reused * tokens_per_block
    return out


def _labels(key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = key.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', rest))


def series_delta(result: RunResult, name: str, **labels: str) -> float | None:
    """Sum over the series of `name` whose labels include `labels`, after minus before."""
    total, found = 0.0, False
    for key, value in result.metrics_after.items():
        got_name, got = _labels(key)
        if got_name == name and all(got.get(k) == v for k, v in labels.items()):
            total += value - result.metrics_before.get(key, 0.0)
            found = True
    return total if found else None


def series_value(metrics: Mapping[str, float], name: str, **labels: str) -> float | None:
    for key, value in metrics.items():
        got_name, got = _labels(key)
        if got_name == name and all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


def server_summary(result: RunResult) -> dict[str, Any]:
    """What /metrics says about the measured window (deltas of cumulative series).

    The series are the server's own (serve/metrics_catalog.py), read by name: a
    histogram's mean is its _sum delta over its _count delta.
    """
    kv = C.KV_FAMILY
    reused = series_delta(result, kv, kv_cache_block_type="reused")
    missed = series_delta(result, kv, kv_cache_block_type="missed")
    out: dict[str, Any] = {"reused_blocks": reused, "missed_blocks": missed, "hit_rate": None,
                           "tokens_per_block": series_value(result.metrics_after, kv, kv_cache_block_type="tokens_per")}
    if reused is not None and missed is not None and reused + missed > 0:
        out["hit_rate"] = reused / (reused + missed)
    for h in C.HISTOGRAMS:
        total, count = series_delta(result, f"{h.name}_sum"), series_delta(result, f"{h.name}_count")
        out[f"{h.name.removeprefix('trtprompt_')}_mean"] = total / count if total is not None and count else None
    out["finished"] = {reason: series_delta(result, C.FINISHED, reason=reason) for reason in C.FINISH_REASONS}
    out["engine_restarts"] = series_delta(result, C.RESTARTS)
    out["tiers"] = tier_summary(result)
    hits = series_delta(result, C.PREFIX_HIT_BLOCKS)
    tier_hits = sum(t["hit_blocks"] for t in out["tiers"].values())
    out["pool_hit_blocks"] = None if hits is None else hits - tier_hits
    out["speculation"] = spec_summary(result)
    return out


def _positions(metrics: Mapping[str, float]) -> list[str]:
    """The draft positions the server exports an acceptance counter for, in order."""
    found = {_labels(k)[1].get(C.SPEC_POSITION_LABEL) for k in metrics if _labels(k)[0] == C.SPEC_ACCEPTED_PER_POS}
    return sorted((p for p in found if p is not None), key=int)


def spec_summary(result: RunResult) -> dict[str, Any] | None:
    """What speculative decoding did in the measured window, from the server's spec_decode counters: drafts
    (verifications), draft and accepted tokens, acceptance rate (accepted / draft tokens), mean accepted
    length (1 + accepted / drafts: tokens per verification, the model's own one included) and, per draft
    position, the share of drafts whose token there was accepted. None when the server exports no such series;
    the rates None when it drafted nothing.
    """
    drafts = series_delta(result, C.SPEC_DRAFTS)
    drafted = series_delta(result, C.SPEC_DRAFT_TOKENS)
    accepted = series_delta(result, C.SPEC_ACCEPTED_TOKENS)
    if drafts is None or drafted is None or accepted is None:
        return None
    per_pos = [series_delta(result, C.SPEC_ACCEPTED_PER_POS, position=p) or 0.0
               for p in _positions(result.metrics_after)]
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "accepted_per_position": [n / drafts for n in per_pos] if drafts else None}


def _tier_field(family: str) -> str:
    """trtprompt_kv_tier_hit_blocks_total -> hit_blocks."""
    return family.removeprefix("trtprompt_kv_tier_").removesuffix("_total")


def tier_summary(result: RunResult) -> dict[str, dict[str, float]]:
    """Per tier below the pool (disk, redis), what its counters did in the measured window: hit
    blocks (loaded and reused), misses, bytes read and written, dropped writes, evictions, errors.

    A tier appears when any of its counters moved: the server exports every tier's series, at 0
    for one that is not configured (serve/metrics_catalog.py, TIER_COUNTERS).
    """
    out = {}
    for tier in C.TIERS:
        figures = {_tier_field(f): series_delta(result, f, tier=tier) for f in C.TIER_COUNTERS}
        if any(figures.values()):
            out[tier] = {k: v or 0.0 for k, v in figures.items()}
    return out


def summarize(result: RunResult, tokens_per_block: int | None = None) -> dict[str, Any]:
    recs = result.records
    ok = [r for r in recs if r.ok]
    wall = result.wall_s
    out_tokens = sum(r.num_output_tokens or 0 for r in ok)
    server = server_summary(result)
    # The server's own figure wins: a profile variant may use another block size than the engine given.
    tpb = int(server["tokens_per_block"]) if server["tokens_per_block"] else tokens_per_block
    summary: dict[str, Any] = {
        "load": result.load.label, "concurrency": result.load.concurrency, "rate": result.load.rate,
        "workload": result.workload, "requests": len(recs), "ok": len(ok), "errors": len(recs) - len(ok),
        "not_sent": result.not_sent, "duration_s": wall,
        "req_per_s": len(ok) / wall if wall > 0 else None,
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "input_tok_s": sum(r.num_input_tokens or r.prompt_len for r in ok) / wall if wall > 0 else None,
        "output_tokens": out_tokens,
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "itl_s": percentiles([g for r in ok for g in r.itl_s]),
        "tpot_s": percentiles([t for r in ok if (t := tpot(r)) is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "kv": kv_summary(ok, tpb), "server": server,
        "first_errors": sorted({r.error for r in recs if r.error})[:3],
    }
    tags = sorted({r.tag for r in ok})
    if len(tags) > 1:
        summary["by_tag"] = {t: {"requests": sum(r.tag == t for r in ok),
                                 "ttft_s": percentiles([r.ttft_s for r in ok if r.tag == t]),
                                 "e2e_s": percentiles([r.e2e_s for r in ok if r.tag == t])} for t in tags}
    return summary


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


ROWS: tuple[tuple[str, Any], ...] = (
    ("requests ok / sent", lambda s: f"{s['ok']} / {s['requests']}"),
    ("output tok/s", lambda s: _num(s["output_tok_s"])),
    ("requests/s", lambda s: _num(s["req_per_s"], "{:.2f}")),
    *[(f"TTFT {k} (ms)", (lambda k: lambda s: _ms(s["ttft_s"][k]))(k)) for k in ("p50", "p90", "p99")],
    ("TTFT in the engine, mean (ms)", lambda s: _ms(s["server"].get("time_to_first_token_seconds_mean"))),
    ("prefill in the engine, mean (ms)", lambda s: _ms(s["server"].get("prefill_time_seconds_mean"))),
    ("queue in the engine, mean (ms)", lambda s: _ms(s["server"].get("request_queue_time_seconds_mean"))),
    *[(f"ITL {k} (ms)", (lambda k: lambda s: _ms(s["itl_s"][k]))(k)) for k in ("p50", "p90", "p99")],
    ("TPOT p50 (ms)", lambda s: _ms(s["tpot_s"]["p50"])),
    *[(f"e2e {k} (ms)", (lambda k: lambda s: _ms(s["e2e_s"][k]))(k)) for k in ("p50", "p90", "p99")],
    ("KV reused blocks", lambda s: _num(s["kv"]["reused_blocks"], "{:.0f}")),
    ("KV hit rate", lambda s: _num(s["kv"]["hit_rate"], "{:.1%}")),
    ("prefill tokens computed", lambda s: _num(s["kv"]["prefill_tokens_computed"], "{:.0f}")),
)
# For ratios: which direction is better does not matter here; the ratio is B / A.
RATIO_KEYS = {"output tok/s": ("output_tok_s",), "requests/s": ("req_per_s",),
              "TTFT p50 (ms)": ("ttft_s", "p50"), "TTFT p99 (ms)": ("ttft_s", "p99"),
              "ITL p50 (ms)": ("itl_s", "p50"), "ITL p99 (ms)": ("itl_s", "p99"),
              "TPOT p50 (ms)": ("tpot_s", "p50"),
              "e2e p50 (ms)": ("e2e_s", "p50"), "prefill tokens computed": ("kv", "prefill_tokens_computed")}


def _tier(tier: str, field: str, fmt: str = "{:.0f}", scale: float = 1.0) -> Any:
    def cell(s: Mapping[str, Any]) -> str:
        figures = s["server"].get("tiers", {}).get(tier)
        return "–" if figures is None else _num(figures[field] * scale, fmt)
    return cell


def _spec(field: str, fmt: str) -> Any:
    def cell(s: Mapping[str, Any]) -> str:
        spec = s["server"].get("speculation")
        return "–" if spec is None else _num(spec[field], fmt)
    return cell


def _per_position(s: Mapping[str, Any]) -> str:
    rates = (s["server"].get("speculation") or {}).get("accepted_per_position")
    return " / ".join(f"{r:.0%}" for r in rates) if rates else "–"


def spec_rows(summaries: Iterable[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """Rows for speculative decoding, when any run drafted (from /metrics)."""
    if not any((s["server"].get("speculation") or {}).get("draft_tokens") for s in summaries):
        return []
    return [("draft tokens", _spec("draft_tokens", "{:.0f}")),
            ("accepted draft tokens", _spec("accepted_tokens", "{:.0f}")),
            ("draft acceptance rate", _spec("acceptance_rate", "{:.1%}")),
            ("mean accepted length (tokens / verification)", _spec("acceptance_length", "{:.2f}")),
            ("accepted by draft position", _per_position)]


def tier_rows(summaries: Iterable[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """Rows for the tiers below the pool, when any run used one: where the reused blocks came from
    (the pool or a tier, from /metrics) and what each tier did."""
    tiers = [t for t in C.TIERS if any(t in s["server"].get("tiers", {}) for s in summaries)]
    if not tiers:
        return []
    pool = ("KV blocks hit in the pool", lambda s: _num(s["server"].get("pool_hit_blocks"), "{:.0f}"))
    rows: list[tuple[str, Any]] = [pool]
    for t in tiers:
        rows += [(f"KV blocks hit on {t}", _tier(t, "hit_blocks")), (f"{t} misses", _tier(t, "misses")),
                 (f"{t} MB read", _tier(t, "read_bytes", "{:.1f}", 1e-6)),
                 (f"{t} MB written", _tier(t, "written_bytes", "{:.1f}", 1e-6)),
                 (f"{t} dropped writes", _tier(t, "dropped_writes")), (f"{t} errors", _tier(t, "errors"))]
    return rows


def _get(summary: Mapping[str, Any], path: Sequence[str]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def markdown_table(summaries: Mapping[str, Mapping[str, Any]], ratio: bool = True) -> str:
    """One column per run; with two or more runs a last column with each run over the first."""
    names = list(summaries)
    with_ratio = ratio and len(names) >= 2
    ratio_head = [f"{n} / {names[0]}" for n in names[1:]] if with_ratio else []
    lines = ["| metric | " + " | ".join(names + ratio_head) + " |",
             "| --- | " + " | ".join("---:" for _ in names + ratio_head) + " |"]
    for label, fn in (*ROWS, *tier_rows(summaries.values()), *spec_rows(summaries.values())):
        cells = [fn(summaries[n]) for n in names]
        if with_ratio:
            cells += [_ratio(summaries[names[0]], summaries[n], label) for n in names[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: Mapping[str, Any], b: Mapping[str, Any], label: str) -> str:
    path = RATIO_KEYS.get(label)
    if path is None:
        return ""
    va, vb = _get(a, path), _get(b, path)
    return f"{vb / va:.2f}×" if va and vb is not None else "–"


def tag_table(summary: Mapping[str, Any]) -> str | None:
    """TTFT and e2e by traffic class (long-context's long vs short requests)."""
    by_tag = summary.get("by_tag")
    if not by_tag:
        return None
    lines = ["| class | requests | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | e2e p99 (ms) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for tag, s in by_tag.items():
        lines.append(f"| {tag} | {s['requests']} | {_ms(s['ttft_s']['p50'])} | {_ms(s['ttft_s']['p99'])} | "
                     f"{_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p99'])} |")
    return "\n".join(lines)


def records_json(result: RunResult) -> list[dict[str, Any]]:
    return [vars(r) | {"ok": r.ok} for r in result.records]


def write_json(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    return path


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)
