"""The series routers read from a TensorRT-LLM server, on a real `trtprompt serve` (torch target).

llm-d's endpoint picker (its `triton-tensorrt-llm` engine config) reads queue depth from
`nv_trt_llm_request_metrics{request_type=waiting}`, running requests from `{request_type=scheduled}`,
KV usage from `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}`, and the block size and
pool size from `{kv_cache_block_type=tokens_per}` and `{kv_cache_block_type=max}`
(docs/monitoring/README.md, "What routers read"). These tests scrape /metrics as such a router does and
check the names, the labels (the backend's `model` and `version` besides the category label), the
type, and that the values follow the engine: idle, and with more requests than the batch holds.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from serve_fixtures import Served, wait_for

from trtprompt.serve import metrics_catalog as C

# What the TensorRT-LLM backend's reporter creates (label values per family), all of which trtprompt exports
# except the runtime memory's `gpu` and `pinned` (no counterpart in the engine: docs/monitoring/README.md).
BACKEND_LABELS = {
    "nv_trt_llm_request_metrics": ("request_type", {"active", "max", "scheduled", "context", "waiting"}),
    "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type",
                                          {"max", "free", "used", "tokens_per", "reused", "fraction"}),
    "nv_trt_llm_inflight_batcher_metrics": ("inflight_batcher_specific_metric",
                                            {"total_context_tokens", "generation_requests", "micro_batch_id",
                                             "paused_requests"}),
    "nv_trt_llm_general_metrics": ("general_type", {"timestamp", "iteration_counter"}),
    "nv_trt_llm_runtime_memory_metrics": ("memory_type", {"cpu"}),
}
Series = list[tuple[str, dict[str, str], float]]  # (name, labels, value) of one scrape
_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\}\s+(\S+)$")


def exposition(served: Served) -> tuple[dict[str, str], Series]:
    """(family -> TYPE, [(name, labels, value)]) of every nv_trt_llm_* series."""
    types: dict[str, str] = {}
    series: Series = []
    for line in served.metrics_text().splitlines():
        if line.startswith("# TYPE nv_trt_llm_"):
            _, _, name, kind = line.split()
            types[name] = kind
        elif (m := _LINE.match(line)) and m.group(1).startswith("nv_trt_llm_"):
            series.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))))
    return types, series


def router_read(scrape: Series, spec: str) -> float:
    """A router's metric spec `name{label=value}`: the one series of `name` carrying that label."""
    m = re.fullmatch(r"(\w+)\{(\w+)=(\w+)\}", spec)
    assert m is not None, spec
    name, label, value = m.groups()
    found = [v for n, labels, v in scrape if n == name and labels.get(label) == value]
    assert len(found) == 1, f"{spec}: {len(found)} series"
    return found[0]


def read(served: Served, spec: str) -> float:
    return router_read(exposition(served)[1], spec)


def test_families_labels_and_types_are_the_backends(served: Served) -> None:
    types, series = exposition(served)
    for family, (label, values) in BACKEND_LABELS.items():
        assert types.get(family) == "gauge", family
        got = [labels for name, labels, _ in series if name == family]
        assert {labels[label] for labels in got} >= values, family
        for labels in got:  # exactly the backend's labels: model, version and the category
            assert labels == {"model": "tensorrt_llm", "version": "1", label: labels[label]}, labels
    assert set(C.BACKEND_GAUGES) == set(BACKEND_LABELS)


def _kv_scrape(served: Served) -> dict[str, float]:
    scrape = exposition(served)[1]
    return {k: router_read(scrape, f"nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type={k}}}")
            for k in ("max", "free", "used", "fraction", "tokens_per")}


def _agree(kv: dict[str, float]) -> bool:
    return kv["used"] + kv["free"] == kv["max"] and kv["fraction"] == pytest.approx(kv["used"] / kv["max"],
                                                                                      rel=1e-6)


def _kv_consistent(served: Served) -> dict[str, float]:
    """KV gauges of one scrape in which they agree with each other (polled to a deadline). They come from one
    stats reply, but the Python backend's metric API sets each gauge by its own message to tritonserver, so a
    scrape under load may fall between two of them (seen once: used 80 + free 928 against max 1,024)."""
    last: dict[str, dict[str, float]] = {}

    def agreeing() -> bool:
        last["kv"] = _kv_scrape(served)
        return _agree(last["kv"])

    wait_for(agreeing, lambda: f"KV gauges that agree (last scrape: {last.get('kv')})", timeout_s=20)
    return last["kv"]


def test_idle_values_follow_the_engine(served: Served) -> None:
    wait_for(lambda: read(served, "nv_trt_llm_request_metrics{request_type=active}") == 0,
             "no request left running")
    stats = served.engine_stats()
    kv = _kv_consistent(served)
    assert kv["max"] == stats["max_num_blocks"] and kv["tokens_per"] == 32
    assert kv["used"] == 0 and kv["fraction"] == 0.0
    for kind in ("waiting", "scheduled"):
        assert read(served, f"nv_trt_llm_request_metrics{{request_type={kind}}}") == 0, kind
    assert read(served, "nv_trt_llm_request_metrics{request_type=max}") == 16
    assert read(served, "nv_trt_llm_runtime_memory_metrics{memory_type=cpu}") > 10 << 20  # resident bytes


def test_queue_depth_running_and_kv_usage_under_load(served: Served) -> None:
    """More requests than max_batch_size (16): a router sees 16 scheduled, the rest waiting, KV in use.

    The 16 that fill the batch are long and all running before the extra ones are sent, so the window in
    which some wait lasts most of their 600 steps however fast the machine (CI once finished a wave of
    300-token requests before a scrape saw it)."""
    extra = 3
    results: list[Any] = []

    def send(i: int) -> None:
        results.append(served.text(f"Router load {i}: count on", 600, temperature=0.0, min_tokens=600))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16 + extra)]
    seen: dict[str, float] = {}

    def loaded() -> bool:
        scrape = exposition(served)[1]
        seen["waiting"] = router_read(scrape, "nv_trt_llm_request_metrics{request_type=waiting}")
        seen["scheduled"] = router_read(scrape, "nv_trt_llm_request_metrics{request_type=scheduled}")
        return seen["waiting"] >= 1 and seen["scheduled"] == 16

    try:
        for t in threads[:16]:
            t.start()
        wait_for(lambda: served.engine_stats()["active_requests"] == 16, "the first 16 requests running")
        for t in threads[16:]:
            t.start()
        wait_for(loaded, lambda: f"16 scheduled and some waiting (last seen {seen})")
        kv = _kv_consistent(served)
        assert kv["used"] >= 16 and 0 < kv["fraction"] < 1  # each running request holds at least one block
        assert seen["waiting"] <= extra
    finally:
        for t in threads:
            if t.is_alive():
                t.join(180)
    assert len(results) == 16 + extra and all(r.error is None for r in results)
