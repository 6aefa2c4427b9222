"""What the engine process counts for /metrics beyond the engine's own stats.

Finished requests by reason and their timings (for the histograms of
metrics_catalog), requests refused before they became engine requests, its
own CPU and memory, and the configuration labels of trtprompt_engine_info.
The serving models' publisher (serve/triton_models/metrics_publisher.py) reads it all through the
`stats` and `info` ops; the names and reasons are in metrics_catalog.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from trtprompt.engine.kv_events import KV_EVENT_COUNTS
from trtprompt.engine.request import FinishReason, RequestOutput
from trtprompt.error_codes import ErrorCode
from trtprompt.serve.metrics_catalog import FINISH_REASONS
from trtprompt.serve.wire.refusals import error_reason

# Finished-request timings kept for the publisher's histograms (it polls every
# stats_check_period_ms, so only a burst larger than this between polls loses some).
TIMINGS_KEPT = 8192
def finish_label(out: RequestOutput, code: ErrorCode | None = None) -> str:
    """The `reason` label of a final output (code: its error code, if it is an error)."""
    if out.error is not None:
        return error_reason(code)
    if out.finish_reason is FinishReason.STOP:
        return "end_id" if out.stopped_by_end_id else "stop"
    return out.finish_reason.value if out.finish_reason else "error"


def timing_entry(out: RequestOutput, tokens_per_block: int) -> dict[str, float] | None:
    """One finished request's observations (seconds; cached prompt tokens); None if it never ran."""
    s = out.stats
    if s.first_scheduled_time_ns is None:
        return None
    entry = {"queue_s": (s.first_scheduled_time_ns - s.arrival_time_ns) / 1e9,
             "cached_tokens": float(s.kv_cache_reused_blocks * tokens_per_block)}
    if s.first_token_time_ns is not None:
        last = s.last_token_time_ns or s.first_token_time_ns
        entry["ttft_s"] = (s.first_token_time_ns - s.arrival_time_ns) / 1e9
        entry["prefill_s"] = (s.first_token_time_ns - s.first_scheduled_time_ns) / 1e9
        entry["e2e_s"] = (last - s.arrival_time_ns) / 1e9
        if out.num_output_tokens >= 2:
            entry["itl_s"] = (last - s.first_token_time_ns) / 1e9 / (out.num_output_tokens - 1)
    return entry


def drain_tier_loads(engine: Any) -> list[tuple[str, float]]:  # engine: LLMEngine
    """(tier, seconds) of every block read from a tier since the last drain (none without tiers)."""
    tiers = engine.kv.tiers
    return tiers.loader.latencies.drain() if tiers is not None else []


def kv_event_counts(engine: Any) -> dict[str, int]:  # engine: LLMEngine
    """The KV event publisher's counts (metrics_catalog.KV_EVENT_COUNTERS); zeros with events off."""
    publisher = engine.kv_events
    return publisher.counts() if publisher is not None else {f"kv_events_{n}": 0 for n in KV_EVENT_COUNTS}


class RequestCounters:
    """Finished/refused counts by reason, recent timings and tier block reads; thread-safe."""

    def __init__(self, tokens_per_block: int) -> None:
        self._tpb = tokens_per_block
        self._lock = threading.Lock()
        self._timings: deque[dict[str, float]] = deque(maxlen=TIMINGS_KEPT)
        # (seq, tier, seconds) of block reads for trtprompt_kv_tier_load_seconds; apart from the
        # request timings, so a long prefix's many reads never push those out.
        self._tier_loads: deque[tuple[int, str, float]] = deque(maxlen=TIMINGS_KEPT)
        self._seq = 0
        self._finished = dict.fromkeys(FINISH_REASONS, 0)
        self._tokens = {"prompt_tokens": 0, "generation_tokens": 0}  # of finished requests

    def record(self, out: RequestOutput, code: ErrorCode | None = None) -> None:
        entry = timing_entry(out, self._tpb)
        with self._lock:
            self._finished[finish_label(out, code)] += 1
            self._tokens["prompt_tokens"] += out.num_input_tokens
            self._tokens["generation_tokens"] += out.num_output_tokens
            if entry is not None:
                self._seq += 1
                self._timings.append({"seq": self._seq, **entry})

    def refused(self, reason: str) -> None:
        """A request refused before it reached the engine loop (reason: a FINISH_REASONS label)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {FINISH_REASONS}, got {reason!r}")
        with self._lock:
            self._finished[reason] += 1

    def record_tier_loads(self, loads: list[tuple[str, float]]) -> None:
        """Keep block reads (tier, seconds) for the tier-load histogram, in the timings' sequence."""
        with self._lock:
            for tier, seconds in loads:
                self._seq += 1
                self._tier_loads.append((self._seq, tier, seconds))

    def snapshot(self, since: int) -> dict[str, Any]:
        """seq, the timings and tier loads newer than `since`, the finished counts and their tokens."""
        with self._lock:
            return {"seq": self._seq, "timings": [t for t in self._timings if t["seq"] > since],
                    "tier_loads": [[tier, s] for seq, tier, s in self._tier_loads if seq > since],
                    "finished": dict(self._finished), **self._tokens}


class AdapterCounters:
    """Per-LoRA-adapter counts for /metrics (docs/monitoring/README.md, "LoRA adapters"); thread-safe.

    Base-model requests are not counted here: the unlabelled totals count every request. An adapter's
    counts live while the engine knows it or a request of it is in flight, so the series on /metrics
    stay bounded by the adapters the engine holds, however many names come and go over time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[str, str] = {}  # engine request id -> adapter name, while in flight
        self._started: set[str] = set()  # of those, the ones that have produced an output
        self._counts: dict[str, dict[str, Any]] = {}

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self._counts.get(name)
        if entry is None:
            entry = {"finished": dict.fromkeys(FINISH_REASONS, 0), "prompt_tokens": 0, "generation_tokens": 0}
            self._counts[name] = entry
        return entry

    def submitted(self, rid: str, name: str) -> None:
        """Before the loop takes the request, so that even its earliest output finds its adapter."""
        with self._lock:
            self._of[rid] = name

    def withdrawn(self, rid: str) -> None:
        """The loop refused the request: it never ran, and its refusal is counted unlabelled only."""
        with self._lock:
            self._of.pop(rid, None)

    def outputs(self, outs: list[RequestOutput]) -> None:
        """One step's outputs of a connection: mark started requests, count finished ones."""
        with self._lock:
            for out in outs:
                name = self._of.get(out.request_id)
                if name is None:
                    continue
                if not out.finished:
                    self._started.add(out.request_id)
                    continue
                del self._of[out.request_id]
                self._started.discard(out.request_id)
                entry = self._entry(name)
                entry["finished"][finish_label(out, out.error_code)] += 1
                entry["prompt_tokens"] += out.num_input_tokens
                entry["generation_tokens"] += out.num_output_tokens

    def snapshot(self, known: list[str], max_lora: int) -> dict[str, Any]:
        """The stats reply's `lora`: counts of every known or busy adapter (zeros for a known one that ran
        nothing yet), which have requests started / not yet started, and max_lora. Counts of adapters
        neither known nor busy are dropped here, for good."""
        with self._lock:
            busy = set(self._of.values())
            for name in [n for n in self._counts if n not in busy and n not in known]:  # unloaded, idle
                del self._counts[name]
            for name in known:
                self._entry(name)
            # Only adapters that exist: a name the loop is about to refuse never reaches a label.
            named = set(known) | set(self._counts)
            running = {self._of[rid] for rid in self._started} & named
            waiting = {name for rid, name in self._of.items() if rid not in self._started} & named
            return {"adapters": {n: {**c, "finished": dict(c["finished"])} for n, c in self._counts.items()},
                    "running": sorted(running), "waiting": sorted(waiting), "max_lora": max_lora}


def process_usage() -> dict[str, float]:
    """This process's CPU seconds (all threads, user + system) and resident bytes."""
    with open("/proc/self/statm", encoding="ascii") as f:
        resident_pages = int(f.read().split()[1])
    return {"process_cpu_seconds": time.process_time(),
            "process_resident_memory_bytes": float(resident_pages * os.sysconf("SC_PAGE_SIZE"))}


def engine_id(engine_dir: str | Path) -> str:
    """A short content id of the engine: its config.json (build configuration) hashed."""
    data = (Path(engine_dir) / "config.json").read_bytes()
    return hashlib.sha256(data).hexdigest()[:12]


def config_labels(engine: Any) -> dict[str, str]:  # engine: LLMEngine
    """trtprompt_engine_info's labels for the running engine."""
    sched = engine.scheduler_config
    files = getattr(engine, "files", None)
    profile = ((files.meta.get("profile") or {}).get("name") if files is not None else None) or "none"
    return {"engine_id": engine_id(files.path) if files is not None else "none", "profile": str(profile),
            "policy": sched.batch_scheduler_policy, "max_seq_len": str(sched.max_seq_len),
            "max_num_tokens": str(sched.max_num_tokens), "tokens_per_block": str(engine.kv.tokens_per_block)}
