"""Load generator over Triton gRPC streaming against the `ensemble` model.

Each worker thread sends one request at a time, each as its own gRPC stream
call over the phase's one channel (bench/triton_client.py), so every error
is pinned on its request. Fixed concurrency = that many workers pulling
requests; Poisson arrivals = a scheduler thread
releasing requests at seeded exponential gaps to a pool of workers. A
request that must follow another (multi-turn) waits for it to finish.
Warm-up requests run first and are left out of the records and of the
/metrics window. api="openai" sends the same requests as streamed
/v1/completions to an OpenAI-compatible server instead
(trtprompt.bench.openai_client), one keep-alive connection per worker.
"""

from __future__ import annotations

import queue
import random
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from trtprompt.bench.openai_client import OpenAIClient, served_model
from trtprompt.bench.triton_client import SharedTritonChannel
from trtprompt.bench.workloads import BenchRequest, Workload
from trtprompt.client import PERF_OUTPUTS, LLMClient, StreamResult, text_inputs

METRIC_PREFIXES = ("nv_trt_llm_", "trtprompt_", "nv_inference_")
APIS = ("triton", "openai")
_SERIES = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$")
# What the records read (_record): asking for these only keeps every streamed response small.
RECORDED_OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens", *PERF_OUTPUTS)


@dataclass(frozen=True)
class LoadSpec:
    """How to send a workload. concurrency and/or rate; count and/or duration bound it."""

    concurrency: int | None = 4
    rate: float | None = None  # requests/s, Poisson arrivals
    num_requests: int | None = None  # measured requests (None: the whole workload after warm-up)
    duration_s: float | None = None  # stop sending new requests after this long
    warmup: int = 2
    seed: int = 0
    timeout_s: float = 300.0
    ignore_eos: bool = True  # min_tokens = max_tokens: every request yields exactly max_tokens tokens
    max_inflight: int = 64  # worker pool for Poisson arrivals when concurrency is None

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None:
            raise ValueError("concurrency or rate is required")
        for name in ("concurrency", "num_requests", "max_inflight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("rate", "duration_s", "timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")

    @property
    def workers(self) -> int:
        return self.concurrency if self.concurrency is not None else self.max_inflight

    @property
    def label(self) -> str:
        if self.rate is None:
            return f"concurrency={self.concurrency}"
        cap = f" concurrency<={self.concurrency}" if self.concurrency is not None else ""
        return f"rate={self.rate:g}/s{cap}"


@dataclass
class RequestRecord:
    """What one measured request did, as the client saw it plus the server's perf outputs."""

    index: int
    tag: str
    prompt_len: int
    max_tokens: int
    start_s: float  # send time, from the start of the measured phase
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed responses
    e2e_s: float | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    perf: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


@dataclass
class RunResult:
    load: LoadSpec
    workload: dict[str, Any]
    records: list[RequestRecord]
    wall_s: float
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)
    not_sent: int = 0  # left unsent by the duration bound
    # What run_load's probe returned just before and just after the measured requests (replica counts).
    probe_before: Any = None
    probe_after: Any = None


def scrape_metrics(url: str | None, timeout_s: float = 5.0) -> dict[str, float]:
    """Triton's /metrics as {'name{labels}': value}, limited to the serving families."""
    if url is None:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8")
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1).startswith(METRIC_PREFIXES):
            out[m.group(1)] = float(m.group(2))
    return out


def _record(req: BenchRequest, start_s: float, result: StreamResult | None, error: str | None) -> RequestRecord:
    rec = RequestRecord(req.index, req.tag, req.prompt_len, req.max_tokens, start_s, error=error)
    if result is None:
        return rec
    rec.error = result.error
    if result.times:
        rec.ttft_s, rec.e2e_s = result.times[0], result.times[-1]
        rec.itl_s = [b - a for a, b in zip(result.times, result.times[1:])]
    rec.num_input_tokens = result.last("num_input_tokens")
    rec.num_output_tokens = result.last("num_output_tokens")
    rec.perf = {k: v for k in (*PERF_OUTPUTS, "cached_tokens") if (v := result.last(k)) is not None}
    return rec


class _Phase:
    """One batch of requests sent under one LoadSpec; workers share it."""

    def __init__(self, url: str, model: str, load: LoadSpec, requests: Sequence[BenchRequest],
                 done: dict[int, threading.Event], on_done: Callable[[], None], api: str = "triton") -> None:
        self.url, self.model, self.load, self.requests, self.api = url, model, load, requests, api
        self.done, self.on_done = done, on_done
        self.jobs: queue.Queue[BenchRequest | None] = queue.Queue()
        self.records: list[RequestRecord] = []
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.deadline = None if load.duration_s is None else self.t0 + load.duration_s
        self.not_sent = 0
        self.channel: SharedTritonChannel | None = None  # api="triton": opened by run()
        # The records read the final perf values only: where the ensemble can, per-token responses skip them.
        declared_inputs, declared_outputs = _declared(url, model) if api == "triton" else (set(), set())
        self.perf_final_only = "perf_metrics_final_only" in declared_inputs
        self.outputs = [name for name in RECORDED_OUTPUTS if name in declared_outputs] or None

    def inputs(self, req: BenchRequest) -> list[Any]:
        return text_inputs(req.prompt, req.max_tokens, stream=True, temperature=0.0,
                           min_tokens=req.max_tokens if self.load.ignore_eos else None,
                           exclude_input_in_output=True, return_perf_metrics=True,
                           return_num_input_tokens=True, return_num_output_tokens=True,
                           perf_metrics_final_only=True if self.perf_final_only else None)

    def new_client(self) -> Any:
        if self.api == "openai":
            return OpenAIClient(self.url, self.model, self.load.timeout_s)
        return _ChannelUser(self.channel)

    def send(self, client: Any, req: BenchRequest) -> tuple[Any, RequestRecord]:
        start = time.perf_counter() - self.t0
        try:
            if self.api == "openai":
                result = client.infer(req, self.load.ignore_eos)
            else:
                result = client.infer(self.model, self.inputs(req), self.load.timeout_s,
                                      request_id=uuid.uuid4().hex, outputs=self.outputs)
            return client, _record(req, start, result, None)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
            # Late responses of this request would confuse the next one on this stream.
            client.close(cancel=True)
            return self.new_client(), _record(req, start, None, f"{type(exc).__name__}: {exc}")

    def worker(self, client: Any) -> None:
        try:
            while (req := self.jobs.get()) is not None:
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    with self.lock:
                        self.not_sent += 1
                    self.done[req.index].set()
                    continue
                if req.after is not None:
                    self.done[req.after].wait()
                client, rec = self.send(client, req)
                with self.lock:
                    self.records.append(rec)
                self.done[req.index].set()
                self.on_done()
        finally:
            client.close()

    def feed(self) -> None:
        """Release requests: all at once (concurrency) or at Poisson arrival times (rate)."""
        rng = random.Random(f"arrivals:{self.load.seed}")
        at = 0.0
        for req in self.requests:
            if self.load.rate is not None:
                at += rng.expovariate(self.load.rate)
                delay = self.t0 + at - time.perf_counter()
                if self.deadline is not None and self.t0 + at > self.deadline:
                    with self.lock:
                        self.not_sent += 1
                    self.done[req.index].set()
                    continue
                if delay > 0:
                    time.sleep(delay)
            self.jobs.put(req)
        for _ in range(self.load.workers):
            self.jobs.put(None)

    def run(self) -> float:
        self.channel = SharedTritonChannel(self.url) if self.api == "triton" else None
        try:
            return self._run()
        finally:
            if self.channel is not None:
                self.channel.close()

    def _run(self) -> float:
        # Connections are opened before the clock starts: connecting is not part of the load.
        clients = [self.new_client() for _ in range(min(self.load.workers, max(1, len(self.requests))))]
        workers = [threading.Thread(target=self.worker, args=(c,), name=f"bench-worker-{i}", daemon=True)
                   for i, c in enumerate(clients)]
        self.t0 = time.perf_counter()
        if self.load.duration_s is not None:
            self.deadline = self.t0 + self.load.duration_s
        for w in workers:
            w.start()
        self.feed()
        for w in workers:
            w.join()
        return time.perf_counter() - self.t0


class _ChannelUser:
    """A worker's handle on the phase's one Triton channel (bench/triton_client.py): closing it,
    as a worker does after a failed request, leaves the channel to the other workers."""

    def __init__(self, channel: SharedTritonChannel) -> None:
        self.infer = channel.infer

    def close(self, cancel: bool = False) -> None:
        """Nothing to close: a failed request's call was cancelled by the channel itself."""


def _declared(url: str, model: str) -> tuple[set[str], set[str]]:
    """The Triton model's input and output names (empty when the server cannot be asked)."""
    try:
        with LLMClient(url) as client:
            return client.declared_names(model)
    except Exception:  # noqa: BLE001 - an unreachable server fails the requests themselves, with reasons
        return set(), set()


def resolve_model(url: str, model: str, api: str) -> str:
    """The model to address: with api="openai", "ensemble" means the first model /v1/models lists."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    return served_model(url) if api == "openai" and model == "ensemble" else model


def send_once(url: str, requests: Sequence[BenchRequest], load: LoadSpec, model: str = "ensemble",
              api: str = "triton") -> list[RequestRecord]:
    """Send requests once, unmeasured (warm-up, priming a cache), with load's timeout and EOS rule at
    up to load's workers in flight; model as resolve_model gives it. The records say which failed."""
    spec = LoadSpec(concurrency=max(1, min(load.workers, len(requests))), warmup=0, timeout_s=load.timeout_s,
                    ignore_eos=load.ignore_eos)
    done = {r.index: threading.Event() for r in requests}
    phase = _Phase(url, model, spec, requests, done, lambda: None, api)
    phase.run()
    return phase.records


def run_load(url: str, workload: Workload, load: LoadSpec, metrics_url: str | None = None,
             model: str = "ensemble", progress: bool = True, settle_s: float = 0.35,
             api: str = "triton", probe: Callable[[], Any] | None = None) -> RunResult:
    """Warm up, scrape /metrics, send the measured requests, scrape again.

    probe: called right before and right after the measured requests (bench/replica_group.py's
    per-replica engine counts), its results kept in the RunResult.

    api: "triton" (gRPC streaming to `model`) or "openai" (url is an OpenAI-compatible
    endpoint; model "ensemble" means the first model its /v1/models lists).

    settle_s: the server publishes engine stats every stats_check_period_ms
    (100 ms by default); waiting a few periods lets /metrics catch up.
    """
    from tqdm import tqdm

    warm = workload.requests[:load.warmup]
    rest = workload.requests[load.warmup:]
    measured = rest if load.num_requests is None else rest[:load.num_requests]
    if not measured:
        raise ValueError(f"the workload has {len(workload.requests)} requests: none left after "
                         f"{load.warmup} warm-up request(s)")
    model = resolve_model(url, model, api)
    done = {r.index: threading.Event() for r in workload.requests}
    if warm:
        send_once(url, warm, load, model, api)
        for r in warm:
            done[r.index].set()  # a measured request may follow a warm-up one (multi-turn)
    if metrics_url is not None:
        time.sleep(settle_s)
    before = scrape_metrics(metrics_url)
    probe_before = probe() if probe is not None else None
    bar = tqdm(total=len(measured), desc=f"{workload.name} {load.label}", unit="req",
               disable=not progress, leave=False)
    phase = _Phase(url, model, load, measured, done, lambda: bar.update(1), api)
    wall = phase.run()
    bar.close()
    probe_after = probe() if probe is not None else None
    if metrics_url is not None:
        time.sleep(settle_s)
    after = scrape_metrics(metrics_url)
    records = sorted(phase.records, key=lambda r: r.index)
    return RunResult(load, workload.describe(), records, wall, before, after, phase.not_sent, probe_before,
                     probe_after)
