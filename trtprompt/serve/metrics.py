"""Engine statistics on Triton's /metrics, named like the TensorRT-LLM backend.

One model (tensorrt_llm) polls the engine process every
stats_check_period_ms and publishes gauges through the Python backend's
metrics API; finished requests' TTFT and prefill time go into histograms.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from trtprompt.serve import protocol as P

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

# family -> (label name, {label value: engine stats key or callable})
GAUGES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type", {
        "max": "max_num_blocks", "free": "free_num_blocks", "used": "used_num_blocks",
        "tokens_per": "tokens_per_block", "reused": "reused_blocks", "missed": "missed_blocks",
        "fraction": lambda s: s["used_num_blocks"] / s["max_num_blocks"] if s["max_num_blocks"] else 0.0,
        "cache_hit_rate": "cache_hit_rate",
    }),
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type", {
        "active": "active_requests", "max": "max_batch_size", "scheduled": "scheduled_requests",
        "context": "context_requests", "waiting": "waiting_requests",
    }),
    "nv_trt_llm_inflight_batcher_metrics": ("TRT LLM inflight_batcher-specific metrics",
                                            "inflight_batcher_specific_metric", {
        "total_context_tokens": "total_context_tokens", "generation_requests": "generation_requests",
        "paused_requests": "paused_requests",
    }),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type", {
        "timestamp": lambda s: s["timestamp_ns"] // 1000, "iteration_counter": "iteration_counter",
    }),
}
HISTOGRAMS = {
    "ttft_s": ("trtprompt_time_to_first_token_seconds",
               "Time from a request's arrival at the engine to its first output token"),
    "prefill_s": ("trtprompt_prefill_time_seconds",
                  "Time from a request's first scheduling to its first output token"),
}


def gauge_values(stats: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(family, label value) -> value, from one engine stats reply."""
    out = {}
    for family, (_desc, _label, items) in GAUGES.items():
        for label, source in items.items():
            out[(family, label)] = float(source(stats) if callable(source) else stats[source])
    return out


class MetricsPublisher:
    """Polls the engine's stats in a thread and publishes them (pb_utils metrics)."""

    def __init__(self, pb_utils: Any, socket_path: str, period_s: float) -> None:
        self._log = pb_utils.Logger.log_warn
        self._socket, self._period = socket_path, period_s
        self._stop = threading.Event()
        self._since = 0
        # The families must outlive their metrics (the stub refuses a metric
        # whose family was garbage-collected).
        self._families = []
        self._gauges = {}
        for family, (desc, label, items) in GAUGES.items():
            fam = pb_utils.MetricFamily(name=family, description=desc, kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(fam)
            for value in items:
                self._gauges[(family, value)] = fam.Metric(labels={label: value})
        self._histograms = {}
        for key, (name, desc) in HISTOGRAMS.items():
            fam = pb_utils.MetricFamily(name=name, description=desc, kind=pb_utils.MetricFamily.HISTOGRAM)
            self._families.append(fam)
            self._histograms[key] = fam.Metric(labels={}, buckets=LATENCY_BUCKETS)
        self._thread = threading.Thread(target=self._run, name="trtprompt-metrics", daemon=True)

    def start(self) -> "MetricsPublisher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def poll_once(self) -> None:
        stats = P.call(self._socket, {"op": "stats", "since": self._since}, timeout=2.0)
        if stats["seq"] < self._since:  # the engine process restarted: its counters did too
            self._since = 0
            return
        for key, value in gauge_values(stats).items():
            self._gauges[key].set(value)
        for timing in stats["timings"]:
            for key, metric in self._histograms.items():
                metric.observe(timing[key])
        self._since = stats["seq"]

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.poll_once()
            except (P.EngineUnavailableError, P.EngineError, OSError):
                continue  # engine down or restarting: keep the last values
            except Exception as exc:  # noqa: BLE001 - metrics must never stop the model
                self._log(f"trtprompt metrics: poll failed: {type(exc).__name__}: {exc}")
