"""What `trtprompt bench` does with its options; cli.py only declares them."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Mapping

from trtprompt.bench.compare import BenchOutcome, BenchPlan, parse_compare, run_bench
from trtprompt.bench.replica_group import read_group
from trtprompt.bench.runner import LoadSpec
from trtprompt.bench.workloads import WorkloadSpec
from trtprompt.interface import METRICS_PORT

WORKLOAD_OPTIONS = ("num_requests", "seed", "output_len", "input_len", "input_spread", "num_prefixes",
                    "prefix_len", "suffix_len", "turns", "user_len", "answer_len", "long_len", "long_fraction",
                    "num_fields", "field_len")


def parse_levels(text: str | None) -> list[int | None]:
    """'1,4,8' -> [1, 4, 8]; None -> [None]."""
    if text is None:
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency expects integers separated by commas, got {text!r}") from None
    if not levels:
        raise ValueError("--concurrency is empty")
    return levels


def bench_api(api: str | None, url: str | None) -> str:
    """--api, else from --url: an http(s):// URL is an OpenAI-compatible endpoint, host:port is Triton gRPC."""
    by_url = "openai" if url is not None and url.startswith(("http://", "https://")) else None
    if api is None:
        return by_url or "triton"
    if api == "triton" and by_url == "openai":
        raise ValueError(f"--api triton takes a gRPC host:port --url, got {url!r}")
    if api == "openai" and url is not None and by_url is None:
        raise ValueError(f"--api openai takes an http(s):// --url (e.g. http://127.0.0.1:8003/v1), got {url!r}")
    return api


def make_plan(engine_dir: Path, workload: str, options: Mapping[str, Any]) -> BenchPlan:
    wl_kwargs = {k: options[k] for k in WORKLOAD_OPTIONS if options.get(k) is not None}
    spec = WorkloadSpec(workload, path=options.get("file"), **wl_kwargs)
    rate = options.get("rate")
    conc_text = options.get("concurrency")
    if conc_text is None and rate is None:
        conc_text = "4"
    loads = [LoadSpec(concurrency=c, rate=rate, num_requests=spec.num_requests, duration_s=options.get("duration"),
                      warmup=options.get("warmup", 2), seed=spec.seed, timeout_s=options.get("timeout", 300.0),
                      ignore_eos=not options.get("allow_eos", False))
             for c in parse_levels(conc_text)]
    url, replicas_file = options.get("url"), options.get("replicas_file")
    if replicas_file is not None and url is None:
        url = read_group(Path(replicas_file)).router  # the group's one OpenAI port
    api = bench_api(options.get("api"), url)
    metrics_url = options.get("metrics_url")
    if url is not None and metrics_url is None and replicas_file is None:
        host = urllib.parse.urlsplit(url).hostname if api == "openai" else url.rsplit(":", 1)[0]
        metrics_url = f"http://{host}:{METRICS_PORT}/metrics"
    out = options.get("out") or Path("bench-results") / workload
    return BenchPlan(Path(engine_dir), spec, loads, parse_compare(options.get("compare")), Path(out), url,
                     metrics_url, options.get("baseline") == "transformers", options.get("hf_checkpoint"),
                     not options.get("no_progress", False), not options.get("no_plots", False), api=api,
                     replicas_file=None if replicas_file is None else Path(replicas_file),
                     overhead_requests=options.get("overhead_requests") or 20)


def run_bench_command(engine_dir: Path, workload: str, options: Mapping[str, Any],
                      echo: Callable[[str], None], as_json: bool = False) -> BenchOutcome:
    plan = make_plan(engine_dir, workload, options)
    outcome = run_bench(plan, echo=lambda m: echo(m) if not as_json else None)
    if as_json:
        print(json.dumps(outcome.summaries, indent=2, default=str))
    else:
        print((plan.out_dir / "report.md").read_text(encoding="utf-8"))
        echo(f"bench: results in {plan.out_dir} ({len(outcome.files)} files: results.json, report.md, "
             f"records/, PNG plots)")
    return outcome
