"""Engine statistics on Triton's /metrics (the series of metrics_catalog).

One model (tensorrt_llm, on both layouts of the torch target) polls the
engine process every stats_check_period_ms over ONE kept connection and
publishes through the Python backend's metrics API (pb_utils.MetricFamily):
gauges are set, counters advance by what the engine's cumulative counts
grew since the last poll (so they stay monotonic when the engine process
restarts and its counts start again from zero), and finished requests'
timings are observed into histograms. Values that did not change are not
sent again: every metric call is a message to tritonserver.

The pb_utils metric objects must be destroyed before finalize() returns: their
destructors send a delete message through the stub, and a Metric or
MetricFamily that lives on into the stub's own teardown (the model object is
destroyed in Stub::~Stub, after the stub's shared-memory pool is gone)
dereferences a null pool: the SIGSEGV at address 0x60 every stop used to
leave in the kernel log (core dump: Metric::SaveToSharedMemory <- Metric::Clear
<- MetricFamily::~MetricFamily <- Stub::~Stub; docs/design.md, "Stopping").
`MetricsPublisher.stop()` therefore joins the thread and then releases them,
metrics before their families.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Mapping

from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.triton_models.lora_metrics import LoraMetrics
from trtprompt.serve.wire import protocol as P


def gauge_values(stats: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(family, label value) -> value of the TensorRT-LLM backend's gauges, from one stats reply."""
    return {(family, label): source(stats)
            for family, (_help, _label, items) in C.BACKEND_GAUGES.items() for label, source in items.items()}


def counter_values(stats: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(family, label value) -> cumulative count since the engine process started."""
    out = {(s.name, ""): s.source(stats) for s in C.SERIES if s.kind == "counter"}
    out.update({(C.FINISHED, reason): float(stats["finished"].get(reason, 0)) for reason in C.FINISH_REASONS})
    out.update(C.tier_counter_values(stats))
    out.update(C.spec_position_values(stats))
    return out


class _Families:
    """The pb_utils families and metrics; the families must outlive their metrics."""

    def __init__(self, pb: Any, model_labels: Mapping[str, str]) -> None:
        self.pb = pb
        self.families: dict[str, Any] = {}
        self.gauges: dict[tuple[str, str], Any] = {}
        self.counters: dict[tuple[str, str], Any] = {}
        self.histograms = {h.timing_key: self._histogram(h) for h in C.HISTOGRAMS}
        for family, (help_text, label, items) in C.BACKEND_GAUGES.items():
            for value in items:
                self.gauges[(family, value)] = self.metric(family, help_text, "GAUGE",
                                                           {label: value, **model_labels})
        for s in C.SERIES:
            target = self.gauges if s.kind == "gauge" else self.counters
            target[(s.name, "")] = self.metric(s.name, s.help, s.kind.upper(), {})
        for reason in C.FINISH_REASONS:
            self.counters[(C.FINISHED, reason)] = self.metric(C.FINISHED, C.FINISHED_HELP, "COUNTER",
                                                              {"reason": reason})
        for family, (help_text, _field) in C.TIER_COUNTERS.items():
            for tier in C.TIERS:
                self.counters[(family, tier)] = self.metric(family, help_text, "COUNTER", {"tier": tier})
        self.tier_loads = self._tier_histograms(C.TIER_LOAD)

    def spec_positions(self, count: int) -> None:
        """Have a per-position acceptance counter for draft positions 0 .. count - 1: the engine's max_draft_len,
        known from its first stats reply (0 without speculation: no position series)."""
        for position in map(str, range(count)):
            if (C.SPEC_ACCEPTED_PER_POS, position) not in self.counters:
                self.counters[(C.SPEC_ACCEPTED_PER_POS, position)] = self.metric(
                    C.SPEC_ACCEPTED_PER_POS, C.SPEC_ACCEPTED_PER_POS_HELP, "COUNTER",
                    {C.SPEC_POSITION_LABEL: position})

    def metric(self, name: str, help_text: str, kind: str, labels: dict[str, str]) -> Any:
        family = self.families.get(name)
        if family is None:
            family = self.pb.MetricFamily(name=name, description=help_text,
                                          kind=getattr(self.pb.MetricFamily, kind))
            self.families[name] = family
        return family.Metric(labels=labels)

    def _histogram(self, h: C.Histogram) -> Any:
        family = self.pb.MetricFamily(name=h.name, description=h.help, kind=self.pb.MetricFamily.HISTOGRAM)
        self.families[h.name] = family
        return family.Metric(labels={}, buckets=list(h.buckets))

    def _tier_histograms(self, h: C.Histogram) -> dict[str, Any]:
        family = self.pb.MetricFamily(name=h.name, description=h.help, kind=self.pb.MetricFamily.HISTOGRAM)
        self.families[h.name] = family
        return {tier: family.Metric(labels={"tier": tier}, buckets=list(h.buckets)) for tier in C.TIERS}

    def release(self) -> None:
        """Destroy every metric, then every family, now (while the stub can still send the deletes)."""
        for metrics in (self.histograms, self.tier_loads, self.gauges, self.counters):
            metrics.clear()
        self.families.clear()


class _StatsConnection:
    """One kept connection to the engine process for the stats and info ops."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._sock: socket.socket | None = None
        self._reader = P.FrameReader()

    def call(self, message: Mapping[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            self._sock = P.connect(self.path, self.timeout_s)
            self._sock.settimeout(self.timeout_s)
            self._reader = P.FrameReader()
        try:
            P.send_frame(self._sock, message)
            reply = P.recv_frame(self._sock, self._reader)
        except (OSError, P.EngineUnavailableError, ValueError):
            self.close()  # the next call reconnects (e.g. to a restarted engine process)
            raise
        if reply.get("type") == "error":
            raise P.EngineError(reply.get("code", P.INTERNAL), reply.get("message", "engine error"))
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def interrupt(self) -> None:
        """Wake a call blocked in recv() (another thread's), so stop() need not wait for its timeout."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class MetricsPublisher:
    """Polls the engine's stats in a thread and publishes them.

    model_labels: the `model` and `version` labels of the nv_trt_llm_* gauges (the publishing model's
    name and version, as the TensorRT-LLM backend labels its own).
    """

    def __init__(self, pb_utils: Any, socket_path: str, period_s: float,
                 model_labels: Mapping[str, str] | None = None) -> None:
        self._log = pb_utils.Logger.log_warn
        self._conn = _StatsConnection(socket_path, timeout_s=2.0)
        self._period = period_s
        self._stop = threading.Event()
        self._m = _Families(pb_utils, model_labels or {})
        self._lora = LoraMetrics(pb_utils)  # per-adapter series, made and dropped as adapters come and go
        self._pid: int | None = None
        self._since = 0
        self._counted: dict[tuple[str, str], float] = {}
        self._sent: dict[tuple[str, str], float] = {}
        self._info: dict[tuple[str, ...], Any] = {}  # label values -> metric, the running one at 1
        self._thread = threading.Thread(target=self._run, name="trtprompt-metrics", daemon=True)

    def start(self) -> "MetricsPublisher":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the poll thread, then destroy the pb_utils metrics (module docstring: why both, in this order)."""
        self._stop.set()
        self._conn.interrupt()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        if self._thread.is_alive():  # still inside a metric call: releasing now would race with it
            self._log("trtprompt metrics: the poll thread did not stop; metrics left to the stub's teardown")
            return
        self._conn.close()
        self._info.clear()
        self._lora.release()
        self._m.release()

    def poll_once(self) -> None:
        stats = self._conn.call({"op": "stats", "since": self._since})
        if stats["pid"] != self._pid:  # the first poll, or a restarted engine: its counts start at 0
            self._on_new_engine(stats["pid"])
            stats = self._conn.call({"op": "stats", "since": 0})
        self._set_gauges(stats)
        self._advance_counters(stats)
        self._lora.publish(stats, time.time())
        for timing in stats["timings"]:
            for key, metric in self._m.histograms.items():
                if key in timing:
                    metric.observe(timing[key])
        for tier, seconds in stats.get("tier_loads", ()):
            if tier in self._m.tier_loads:
                self._m.tier_loads[tier].observe(seconds)
        self._since = stats["seq"]

    def _on_new_engine(self, pid: int) -> None:
        # Every count restarts with the process except the launcher's restart count.
        restarts = (C.RESTARTS, "")
        self._counted = {restarts: self._counted[restarts]} if restarts in self._counted else {}
        self._pid, self._since = pid, 0
        self._lora.new_engine()
        labels = self._conn.call({"op": "info"})["config_labels"]
        values = tuple(str(labels[k]) for k in C.INFO_LABELS)
        for other, metric in self._info.items():
            if other != values:
                metric.set(0.0)  # a configuration that no longer runs
        if values not in self._info:
            self._info[values] = self._m.metric(C.INFO, C.INFO_HELP, "GAUGE", dict(zip(C.INFO_LABELS, values)))
        self._info[values].set(1.0)

    def _set_gauges(self, stats: Mapping[str, Any]) -> None:
        values = gauge_values(stats)
        values.update({(s.name, ""): s.source(stats) for s in C.SERIES if s.kind == "gauge"})
        for key, value in values.items():
            if self._sent.get(key) != value:
                self._m.gauges[key].set(value)
                self._sent[key] = value

    def _advance_counters(self, stats: Mapping[str, Any]) -> None:
        self._m.spec_positions(len(stats["spec_accepted_per_pos"]))
        for key, value in counter_values(stats).items():
            grown = value - self._counted.get(key, 0.0)
            if grown > 0:
                self._m.counters[key].increment(grown)
                self._counted[key] = value

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.poll_once()
            except (P.EngineUnavailableError, P.EngineError, OSError):
                continue  # engine down or restarting: keep the last values
            except Exception as exc:  # noqa: BLE001 - metrics must never stop the model
                self._log(f"trtprompt metrics: poll failed: {type(exc).__name__}: {exc}")
