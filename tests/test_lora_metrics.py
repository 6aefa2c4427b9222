"""Per-LoRA-adapter series on /metrics (metrics_catalog's LORA_*, docs/monitoring/README.md "LoRA adapters"):
the session's real `trtprompt serve` loads two PEFT adapters through the engine process's lora_load op, serves
requests under each and the base model over the engine socket (the submit frame's `lora`), and its /metrics,
read as Prometheus text and linted by promtool, counts each adapter's requests and tokens exactly; an
unloaded adapter's series leave /metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from lora_adapters import make_peft_adapter
from serve_fixtures import Served, wait_for

from trtprompt.engine.request import SamplingParams
from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.engine_client import EngineClient
from trtprompt.serve.wire.frames import StepEntry
from trtprompt.serve.wire.requests import TokenRequest

pytestmark = pytest.mark.server

A, B = "metrics-a", "metrics-b"  # names of this module's own: other tests may load adapters into the server


class Final:
    """A request's output entries; `done` is set by its last."""

    def __init__(self) -> None:
        self.entries: list[StepEntry] = []
        self.done = threading.Event()
        self.rid = ""  # the client's id of the request

    def __call__(self, entry: StepEntry) -> None:
        self.entries.append(entry)
        if entry["finished"]:
            self.done.set()

    def last(self) -> StepEntry:
        assert self.done.wait(60), "the request did not finish within 60 s"
        return self.entries[-1]


def _submit(client: EngineClient, ids: list[int], max_tokens: int, lora: str | None, **sampling: Any) -> Final:
    final = Final()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    final.rid = client.submit(TokenRequest(tuple(ids), params, stream=True, lora=lora), final)
    return final


def _series(served: Served, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every series of a family on /metrics: sorted labels -> value."""
    out = {}
    for line in served.metrics_text().splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)$", line)
        if m and m.group(1) == family:
            out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(3) or "")))] = float(m.group(4))
    return out


def _adapter(served: Served, family: str, name: str, **labels: str) -> float | None:
    return served.metric(family, **{C.LORA_LABEL: name}, **labels)


@pytest.fixture(scope="module")
def adapters(served: Served, tiny_checkpoint_factory: Callable[..., Path],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-metrics")
    made = {A: make_peft_adapter(tiny_checkpoint_factory("llama"), root / "a", 4, ("q_proj", "v_proj"), seed=1),
            B: make_peft_adapter(tiny_checkpoint_factory("llama"), root / "b", 2, ("o_proj",), seed=2)}
    for name, path in made.items():
        P.call(served.socket_path, {"op": "lora_load", "name": name, "path": str(path)})
    yield made
    for name in made:
        try:
            P.call(served.socket_path, {"op": "lora_unload", "name": name})
        except P.EngineError:
            pass  # the test unloaded it


def test_each_adapters_requests_and_tokens_are_counted_and_an_unloaded_one_leaves(
        served: Served, adapters: dict[str, Path]) -> None:
    # A loaded adapter has its series at 0 before its first request (rate() then sees the first one).
    wait_for(lambda: _adapter(served, C.LORA_FINISHED, B, reason="length") == 0.0, f"{B}'s series at 0")
    base_before = served.metric(C.FINISHED, reason="length") or 0.0
    client = EngineClient(served.socket_path)
    try:
        runs = {A: [_submit(client, list(range(5, 5 + n)), 3 + n, A, ignore_eos=True) for n in (7, 11)],
                B: [_submit(client, list(range(9, 30)), 4, B, ignore_eos=True)],
                None: [_submit(client, list(range(5, 12)), 3, None, ignore_eos=True)]}
        finals = {k: [r.last() for r in v] for k, v in runs.items()}
        unknown = _submit(client, [5, 6, 7], 2, "metrics-never-loaded").last()
    finally:
        client.close()
    assert "metrics-never-loaded" in unknown["error"]  # refused: counted unlabelled, never as a label value
    assert all(f["finish_reason"] == "length" for fs in finals.values() for f in fs)
    for name in (A, B):
        want = {"length": float(len(finals[name])),
                "prompt": float(sum(f["num_input_tokens"] for f in finals[name])),
                "generation": float(sum(f["num_output_tokens"] for f in finals[name]))}

        def seen(name: str = name) -> dict[str, float | None]:
            return {"length": _adapter(served, C.LORA_FINISHED, name, reason="length"),
                    "prompt": _adapter(served, "trtprompt_lora_prompt_tokens_total", name),
                    "generation": _adapter(served, "trtprompt_lora_generation_tokens_total", name)}

        wait_for(lambda: seen() == want, lambda: f"{name}: /metrics shows {seen()}, not {want}")
        assert _adapter(served, C.LORA_FINISHED, name, reason="aborted") == 0.0
    # The base model's request is in the unlabelled totals only; no series is labelled with an unknown name.
    assert (served.metric(C.FINISHED, reason="length") or 0.0) - base_before >= 4
    assert {v for labels in _series(served, C.LORA_FINISHED) for k, v in labels if k == C.LORA_LABEL} >= {A, B}
    assert not any("metrics-never-loaded" in line for line in served.metrics_text().splitlines())
    _lint(served)
    P.call(served.socket_path, {"op": "lora_unload", "name": B})
    wait_for(lambda: not any(dict(labels).get(C.LORA_LABEL) == B for family in C.lora_families()
                             for labels in _series(served, family)), f"{B}'s series gone from /metrics")
    assert _adapter(served, C.LORA_FINISHED, A, reason="length") == 2.0  # the other adapter's stay


def test_the_info_gauge_names_the_adapters_with_requests_running(served: Served, adapters: dict[str, Path]) -> None:
    """vLLM's vllm:lora_requests_info labels: max_lora, and the adapters with requests running / waiting."""
    def info() -> dict[str, str]:
        series = _series(served, C.LORA_INFO)
        assert len(series) == 1, series  # one series at a time: the previous label values' is removed
        return dict(next(iter(series)))

    max_lora = str(served.engine_stats()["lora"]["max_lora"])
    wait_for(lambda: info() == {"max_lora": max_lora, "running_lora_adapters": "", "waiting_lora_adapters": ""},
             lambda: f"an idle engine's info labels, not {info()}")
    client = EngineClient(served.socket_path)
    try:
        long = _submit(client, list(range(5, 40)), 1500, A, ignore_eos=True)  # runs until aborted
        wait_for(lambda: info()["running_lora_adapters"] == A, lambda: f"{A} running, not {info()}")
        client.abort([long.rid])
        assert long.last()["finish_reason"] == "aborted"
    finally:
        client.close()
    wait_for(lambda: info()["running_lora_adapters"] == "", lambda: f"nothing running, not {info()}")
    wait_for(lambda: _adapter(served, C.LORA_FINISHED, A, reason="aborted") == 1.0, f"{A}'s abort counted")


def _lint(served: Served) -> None:
    """promtool check metrics on the LoRA families as /metrics serves them."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # Debian's prometheus package (make install) is not here: the exposition is read above all the same
    ours = [line for line in served.metrics_text().splitlines()
            if any(f in line for f in C.lora_families())]
    lint = subprocess.run([promtool, "check", "metrics"], input="\n".join(ours) + "\n", capture_output=True, text=True)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
