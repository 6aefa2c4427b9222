"""`trtprompt bench`: run one seeded workload against one or more server variants.

A variant is a set of serve overrides (`reuse=on,off`, `chunked=on,off`,
`policy=guaranteed_no_evict,max_utilization`), a build profile
(`profile=cpu-dev,chat`: an engine is built per profile from the engine's
source checkpoint), or how its server starts (`start=cold,warm,restart`:
bench/starts.py; restart goes through a disk KV tier). Variants run one
after another, each on a fresh server started through the serve launcher,
so each starts with a cold KV cache (but for start=warm and restart);
with --url a single variant runs against an already running server. Each
concurrency level gets its own seed (seed + level), so a later level never
hits the cache an earlier one filled, while every variant sees exactly the
same requests at the same level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from trtprompt import rules
from trtprompt.bench import report
from trtprompt.bench.replica_group import group_counts, read_group, replica_rows, replica_table
from trtprompt.bench.router_overhead import overhead_table, router_overhead
from trtprompt.bench.runner import LoadSpec, RunResult, resolve_model, run_load, send_once
from trtprompt.bench.starts import check_start, run_started
from trtprompt.bench.workloads import Workload, WorkloadSpec, make_workload
from trtprompt.serve.ports import free_ports

_BOOL = {"on": True, "off": False, "true": True, "false": False}
COMPARE_KEYS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "reuse": ("enable_kv_cache_reuse", lambda v: _BOOL[v]),
    "chunked": ("enable_chunked_context", lambda v: _BOOL[v]),
    "policy": ("batch_scheduler_policy", str),
    "max_num_tokens": ("max_num_tokens", int),
    "max_batch_size": ("max_batch_size", int),
    "profile": ("profile", str),
    "start": ("start", check_start),
}
_VALUES = {"reuse": "on/off", "chunked": "on/off", "start": "cold, warm or restart"}


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    profile: str | None = None
    start: str = "cold"  # bench/starts.py

    @property
    def serve_overrides(self) -> dict[str, Any]:
        return dict(self.overrides)


def parse_compare(spec: str | None) -> list[Variant]:
    """'reuse=on,off' -> two variants; 'reuse=on,off;chunked=on,off' -> their four combinations."""
    if not spec:
        return [Variant("default")]
    axes = []
    for part in (p.strip() for p in spec.split(";") if p.strip()):
        key, sep, values = part.partition("=")
        if not sep or key not in COMPARE_KEYS or not values:
            raise ValueError(f"--compare expects KEY=V1,V2 with KEY in {', '.join(COMPARE_KEYS)}, got {part!r}")
        name, cast = COMPARE_KEYS[key]
        try:
            axes.append([(key, name, v, cast(v)) for v in values.split(",")])
        except (KeyError, ValueError):
            raise ValueError(f"--compare {key}: values must be {_VALUES.get(key, 'valid')}, "
                             f"got {values!r}") from None
    variants = []
    for combo in itertools.product(*axes):
        label = " ".join(f"{k}={raw}" for k, _n, raw, _v in combo)
        profile = next((v for k, _n, _r, v in combo if k == "profile"), None)
        start = next((v for k, _n, _r, v in combo if k == "start"), "cold")
        overrides = tuple((n, v) for k, n, _r, v in combo if k not in ("profile", "start"))
        variants.append(Variant(label, overrides, profile, start))
    return variants


@contextlib.contextmanager
def served(engine_dir: Path, overrides: Mapping[str, Any], log: Callable[[str], None],
           ready_timeout_s: float = 180.0, api: str = "triton") -> Iterator[tuple[str, str]]:
    """A fresh server for engine_dir on free local ports; yields (url, metrics url): the gRPC
    address, or with api="openai" the OpenAI front end's base URL."""
    from trtprompt.serve.launch.launcher import Ports, Server
    from trtprompt.serve.launch.options import EngineInfo, OpenAIOptions, resolve_options

    engine = EngineInfo.read(engine_dir)
    options = resolve_options(engine, overrides)
    grpc, http, metrics, openai_port = free_ports(4)
    openai = OpenAIOptions(openai_port) if api == "openai" else None
    server = Server(engine, options, Ports("127.0.0.1", grpc, http, metrics), ready_timeout_s=ready_timeout_s,
                    restart_engine=False, log=log, openai=openai)
    server.start()
    url = f"http://127.0.0.1:{openai_port}/v1" if openai is not None else f"127.0.0.1:{grpc}"
    try:
        yield url, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        server.stop()


def engine_for_profile(engine_dir: Path, profile: str, work_dir: Path) -> Path:
    """Build the engine's source checkpoint with another profile (torch target)."""
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.engine.engine_dir import read_engine_dir

    source = read_engine_dir(engine_dir).meta.get("source", {}).get("path")
    if not source or not Path(source).is_dir():
        raise ValueError(f"profile=...: {engine_dir} does not record a source checkpoint that exists "
                         f"(got {source!r}); build the profiles' engines and bench them one by one")
    out = work_dir / "engines" / f"{engine_dir.name}-{report.safe_name(profile)}"
    path = run_build(BuildRequest(Path(source), out, profile, force=True, progress=False))
    assert path is not None  # not a dry run
    return path


@dataclass(frozen=True)
class BenchPlan:
    engine_dir: Path
    workload: WorkloadSpec
    loads: Sequence[LoadSpec]
    variants: Sequence[Variant] = (Variant("default"),)
    out_dir: Path = Path("bench-results")
    url: str | None = None  # a running server (single variant only)
    metrics_url: str | None = None
    baseline: bool = False
    hf_checkpoint: Path | None = None
    progress: bool = True
    plots: bool = True
    model: str = "ensemble"
    api: str = "triton"  # or "openai": the OpenAI-compatible endpoint (trtprompt.bench.openai_client)
    # A `serve --replicas` group's RUN_DIR/replicas.json: per-replica rows and the router's added TTFT.
    replicas_file: Path | None = None
    overhead_requests: int = 20  # short prompts each way (direct, through the router) for the added TTFT

    def __post_init__(self) -> None:
        if not self.loads:
            raise ValueError("loads must not be empty")
        if self.overhead_requests < 1:
            raise ValueError(f"overhead_requests must be >= 1, got {self.overhead_requests}")
        if self.replicas_file is not None and (self.url is None or self.api != "openai"):
            raise ValueError("replicas_file benches the group through its router: url must be the router's "
                             "OpenAI endpoint (api openai)")
        if self.url is not None and (len(self.variants) != 1 or self.variants[0].name != "default"):
            raise ValueError("--url runs against one running server: --compare needs bench to start the servers")


@dataclass
class BenchOutcome:
    plan: BenchPlan
    summaries: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # level -> run -> summary
    runs: dict[str, dict[str, RunResult]] = field(default_factory=dict)  # level -> run -> result
    files: list[Path] = field(default_factory=list)


def level_workload(plan: BenchPlan, level: int, tokenizer: Any, max_input_len: int | None) -> Workload:
    load = plan.loads[level]
    n = load.warmup + (load.num_requests or plan.workload.num_requests)
    spec = dataclasses.replace(plan.workload, seed=plan.workload.seed + level, num_requests=n)
    return make_workload(spec, tokenizer, max_input_len)


def max_input_len(build: Mapping[str, Any], chunked: bool, max_num_tokens: int | None = None) -> int | None:
    """TensorRT-LLM's rule (rules.max_input_len); None when the build records no max_seq_len."""
    max_seq = build.get("max_seq_len")
    if max_seq is None:
        return None
    return rules.max_input_len(max_seq, max_num_tokens or build["max_num_tokens"], chunked)


def _engine_limits(plan: BenchPlan) -> tuple[Any, int | None, int | None]:
    """Tokenizer, the tightest maximum input length over the variants, tokens per block."""
    from trtprompt.serve.launch.options import EngineInfo
    from trtprompt.tokenizer import Tokenizer

    info = EngineInfo.read(plan.engine_dir)
    limits = []
    for v in plan.variants:
        if v.profile is not None:
            continue  # another build: its own bounds, checked by its server
        over = v.serve_overrides
        chunked = over.get("enable_chunked_context", info.runtime.get("enable_chunked_context"))
        limits.append(max_input_len(info.build_config, bool(chunked), over.get("max_num_tokens")))
    known = [x for x in limits if x is not None]
    tpb = (info.build_config.get("plugin_config") or {}).get("tokens_per_block")
    return Tokenizer.from_dir(info.tokenizer_dir), min(known) if known else None, tpb


def run_bench(plan: BenchPlan, echo: Callable[[str], None] = print) -> BenchOutcome:
    tokenizer, max_input, tpb = _engine_limits(plan)
    try:
        workloads = [level_workload(plan, i, tokenizer, max_input) for i in range(len(plan.loads))]
    except ValueError as exc:
        if len(plan.variants) > 1:
            raise ValueError(f"{exc}, for the variant with the tightest bound (without chunked context "
                             "the maximum input length is min(max_seq_len - 1, max_num_tokens))") from None
        raise
    outcome = BenchOutcome(plan)
    for variant in plan.variants:
        for label, result in _run_variant(plan, variant, workloads, echo).items():
            outcome.runs.setdefault(label, {})[variant.name] = result
    if plan.baseline:
        _run_baselines(plan, tokenizer, workloads, outcome, echo)
    for label, runs in outcome.runs.items():
        outcome.summaries[label] = {name: report.summarize(r, tpb) for name, r in runs.items()}
    if plan.replicas_file is not None:
        _add_replica_figures(plan, outcome, echo)
    outcome.files = write_outputs(outcome)
    return outcome


def _add_replica_figures(plan: BenchPlan, outcome: BenchOutcome, echo: Callable[[str], None]) -> None:
    """Each run's per-replica rows (from the probe's counts), then the router's added TTFT, measured once
    after every level and kept with the last level's run."""
    group = read_group(plan.replicas_file) if plan.replicas_file is not None else None
    if group is None:
        return
    for label, runs in outcome.runs.items():
        for name, r in runs.items():
            if r.probe_before is not None:
                outcome.summaries[label][name]["replicas"] = replica_rows(r.probe_before, r.probe_after)
    echo(f"bench: router added TTFT, {plan.overhead_requests} short prompts each way")
    last = outcome.summaries[list(outcome.summaries)[-1]]
    last[next(iter(last))]["router_overhead"] = router_overhead(group, plan.overhead_requests)


def _run_variant(plan: BenchPlan, variant: Variant, workloads: Sequence[Workload],
                 echo: Callable[[str], None]) -> dict[str, RunResult]:
    group = read_group(plan.replicas_file) if plan.replicas_file is not None else None

    def run_all(url: str, metrics_url: str | None) -> dict[str, RunResult]:
        out = {}
        probe = (lambda: group_counts(group)) if group is not None else None
        for load, workload in zip(plan.loads, workloads):
            echo(f"bench: {variant.name}: {workload.name}, {load.label}")
            out[load.label] = run_load(url, workload, load, metrics_url, plan.model, plan.progress,
                                       api=plan.api, probe=probe)
        return out

    if plan.url is not None:
        return run_all(plan.url, plan.metrics_url)
    engine_dir = plan.engine_dir
    if variant.profile is not None:
        echo(f"bench: building {engine_dir.name} with profile {variant.profile}")
        engine_dir = engine_for_profile(plan.engine_dir, variant.profile, plan.out_dir)

    def serve(overrides: Mapping[str, Any]) -> contextlib.AbstractContextManager[tuple[str, str]]:
        echo(f"bench: starting a server for {variant.name}")
        return served(engine_dir, overrides, log=lambda m: None, api=plan.api)

    if variant.start != "cold":
        return run_started(variant.start, plan.loads, workloads, variant.serve_overrides, serve,
                           lambda url, wl, load: _prime(plan, url, wl, load),
                           lambda url, murl, wl, load: run_load(url, wl, load, murl, plan.model, plan.progress,
                                                                api=plan.api), plan.out_dir, echo)
    with serve(variant.serve_overrides) as (url, metrics_url):
        return run_all(url, metrics_url)


def _prime(plan: BenchPlan, url: str, workload: Workload, load: LoadSpec) -> int:
    """Every request of the workload once, unmeasured; the count that failed."""
    records = send_once(url, workload.requests, load, resolve_model(url, plan.model, plan.api), plan.api)
    return sum(not r.ok for r in records)


def _run_baselines(plan: BenchPlan, tokenizer: Any, workloads: Sequence[Workload], outcome: BenchOutcome,
                   echo: Callable[[str], None]) -> None:
    from trtprompt.bench.baselines import run_baselines
    from trtprompt.engine.engine_dir import read_engine_dir

    checkpoint = plan.hf_checkpoint or read_engine_dir(plan.engine_dir).meta.get("source", {}).get("path")
    if not checkpoint or not Path(checkpoint).is_dir():
        raise ValueError(f"--baseline transformers needs the Hugging Face checkpoint: {plan.engine_dir} records "
                         f"{checkpoint!r}; pass --hf-checkpoint")
    # In process there is no concurrency to vary: one run, on the last (busiest) level's requests.
    load, workload = plan.loads[-1], workloads[-1]
    echo(f"bench: transformers baselines on the {load.label} requests")
    measured = workload.requests[load.warmup:]
    for name, result in run_baselines(Path(checkpoint), tokenizer, workload, measured).items():
        outcome.runs[load.label][name] = result


def write_outputs(outcome: BenchOutcome) -> list[Path]:
    out = Path(outcome.plan.out_dir)
    files = [report.write_json(out / "results.json", results_payload(outcome))]
    for label, runs in outcome.runs.items():
        for name, result in runs.items():
            files.append(report.write_json(out / "records" / report.safe_name(f"{name}__{label}.json"),
                                           report.records_json(result)))
    (out / "report.md").write_text(markdown_report(outcome), encoding="utf-8")
    files.append(out / "report.md")
    if outcome.plan.plots:
        from trtprompt.bench import plots

        files += plots.write_plots(outcome.runs, outcome.summaries, out)
    return files


def results_payload(outcome: BenchOutcome) -> dict[str, Any]:
    plan = outcome.plan
    return {"engine_dir": str(plan.engine_dir), "workload": dataclasses.asdict(plan.workload),
            "loads": [dataclasses.asdict(x) for x in plan.loads],
            "variants": [v.name for v in plan.variants], "url": plan.url, "api": plan.api,
            "summaries": outcome.summaries,
            "metrics": {label: {name: {"before": r.metrics_before, "after": r.metrics_after}
                                for name, r in runs.items()} for label, runs in outcome.runs.items()}}


def markdown_report(outcome: BenchOutcome) -> str:
    parts = []
    for label, summaries in outcome.summaries.items():
        first = next(iter(summaries.values()))
        wl = first["workload"]
        parts.append(f"### {wl['kind']}, {label} ({first['requests']} measured requests, prompts "
                     f"{wl['prompt_len_min']}-{wl['prompt_len_max']} tokens, {wl['output_len']} output tokens)\n")
        parts.append(report.markdown_table(summaries) + "\n")
        for name, s in summaries.items():
            table = report.tag_table(s)
            if table:
                parts.append(f"By request class ({name}):\n\n{table}\n")
            if "replicas" in s:
                parts.append(f"Per replica ({name}; measured requests; hit rate = hit / queried prompt tokens, "
                             f"the engines' own counts):\n\n{replica_table(s['replicas'])}\n")
            if "router_overhead" in s:
                parts.append(overhead_table(s["router_overhead"]) + "\n")
    return "\n".join(parts)
