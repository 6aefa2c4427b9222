"""The per-LoRA-adapter series on Triton's /metrics (metrics_catalog: LORA_FINISHED, LORA_TOKENS, LORA_INFO).

Part of the publisher (metrics_publisher.MetricsPublisher), apart because its series come and go: an
adapter's counters are made when the stats reply first lists the adapter and removed when it no longer
does (unloaded and idle, engine_process/counters.AdapterCounters). The Python backend's metrics API
removes a series only with its whole family (a MetricFamily's destructor deletes every metric it made;
a Metric has no delete of its own), so dropping an adapter drops the counter families and makes the
other adapters' series again at the values they showed: a scrape between the two may miss them once,
and none goes down. Counters advance by what the engine's cumulative counts grew, as the publisher's
own do, so they stay monotonic across engine restarts.
"""

from __future__ import annotations

from typing import Any, Mapping

from trtprompt.serve import metrics_catalog as C

Key = tuple[str, str, str]  # (family, adapter, reason or "")


def _help(family: str) -> str:
    return C.LORA_FINISHED_HELP if family == C.LORA_FINISHED else C.LORA_TOKENS[family][0]


class LoraMetrics:
    """pb: the Python backend's pb_utils (its MetricFamily)."""

    def __init__(self, pb: Any) -> None:
        self._pb = pb
        self._families: dict[str, Any] = {}
        self._counters: dict[Key, Any] = {}
        self._shown: dict[Key, float] = {}  # what each counter shows (kept across engine restarts)
        self._counted: dict[Key, float] = {}  # the engine's counts when last advanced (since its process started)
        self._info_labels: dict[str, str] | None = None
        self._info: Any = None

    def new_engine(self) -> None:
        """A new engine process: its counts start again from zero."""
        self._counted.clear()

    def publish(self, stats: Mapping[str, Any], now: float) -> None:
        """Advance every adapter's counters, drop the series of adapters the reply no longer lists, and set
        the info gauge to now (Unix seconds)."""
        values = C.lora_counter_values(stats)
        gone = [k for k in self._shown if k not in values]
        if gone:
            self._drop(gone)
        for key, value in values.items():
            metric = self._counters.get(key) or self._counter(key)
            grown = value - self._counted.get(key, 0.0)
            if grown > 0:
                metric.increment(grown)
                self._counted[key] = value
                self._shown[key] += grown
        self._set_info(C.lora_info_labels(stats), now)

    def _family(self, name: str, help_text: str, kind: str) -> Any:
        family = self._families.get(name)
        if family is None:
            family = self._pb.MetricFamily(name=name, description=help_text, kind=getattr(self._pb.MetricFamily, kind))
            self._families[name] = family
        return family

    def _counter(self, key: Key) -> Any:
        family, adapter, reason = key
        labels = {C.LORA_LABEL: adapter, **({"reason": reason} if reason else {})}
        metric = self._counters[key] = self._family(family, _help(family), "COUNTER").Metric(labels=labels)
        self._shown.setdefault(key, 0.0)
        return metric

    def _drop(self, gone: list[Key]) -> None:
        """Remove the gone series: every counter family goes, then the others' series come back as they were."""
        for key in gone:
            del self._shown[key]
            self._counted.pop(key, None)
        self._counters.clear()  # metrics before their families (metrics_publisher's docstring)
        for name in [n for n in self._families if n != C.LORA_INFO]:
            del self._families[name]
        for key, shown in self._shown.items():
            metric = self._counter(key)
            if shown > 0:
                metric.increment(shown)

    def _set_info(self, labels: dict[str, str], now: float) -> None:
        if labels != self._info_labels:  # one series at a time, as vLLM shows it: the old one's family goes
            self._info = None
            self._families.pop(C.LORA_INFO, None)
            self._info = self._family(C.LORA_INFO, C.LORA_INFO_HELP, "GAUGE").Metric(labels=labels)
            self._info_labels = labels
        self._info.set(now)

    def release(self) -> None:
        """Destroy every series and family now (before the stub's teardown: metrics_publisher's docstring)."""
        self._counters.clear()
        self._info = None
        self._families.clear()
