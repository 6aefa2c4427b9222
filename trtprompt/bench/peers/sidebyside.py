"""trtprompt side by side with vLLM's CPU build, llama.cpp's server and OpenVINO GenAI, on the same token ids.

    .venv/bin/python -m trtprompt.bench.peers [--install-peers] [--model peer|smollm2] [--dtype fp32|bf16|int8]
        [--sides vllm,trtprompt,llamacpp,openvino] [--reps 3] [--only throughput,prefix,latency,served]

1. throughput: N x (128 in, 64 out), offline, greedy, every request in flight -> output tok/s
2. prefix:     64 x (1,024-token shared prefix + 32 unique) -> 16, prefix caching on,
               a prefix new to the cache in every rep -> wall time and mean TTFT
3. latency:    one request at a time, 128 -> 128 -> ms per token after the first (not in the default --only)
4. served:     random 128 -> 64 at concurrency 32; every server driven by the same client and protocol:
               vLLM's own `vllm.benchmarks.serve`, "openai" backend, streaming /v1/completions, against
               vLLM's OpenAI server, `trtprompt serve`'s OpenAI front end and llama-server. OpenVINO: none
               (OpenVINO Model Server is not installable from the package registries here).

Makes the checkpoint (`--model peer`: the demo checkpoint of the peer's shape; `--model smollm2`: `make
real-model`) and builds the trtprompt engine at `--dtype` under build/ when missing. Each side runs in a process
of its own, the peers in their own venvs (PEERS = --peers-dir): vLLM (PEERS/vllm-venv, docs/peer-vllm.md),
llama.cpp's llama-server (PEERS/llamacpp, docs/peer-llamacpp.md; its offline workloads go through the server,
every request in flight at once), OpenVINO GenAI's ContinuousBatchingPipeline (PEERS/ov-venv, the model exported
on first use under PEERS/openvino, docs/peer-openvino.md). `--install-peers` installs what is missing. Offline
prompts are token ids in one JSON file every side reads. The offline reps run in rounds: in each, every side
runs that rep (after its own warm-up), the sides' order alternating from round to round. trtprompt decodes
plainly (`--speculative-decoding none`: the peers do not speculate). Prints the machine (CPU model,
family/model, kernel flags), each side's precision and command line, a Markdown table of medians and ratios
(trtprompt / peer), the cores each side kept busy and the host's FMA and memory read rates before each round
(bench/host_speed.py: a shared host's speed moves within minutes), and writes everything to OUT/results.json.
Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench import host_speed, machine
from trtprompt.bench.peers import (
    llamacpp_side,
    openvino_side,
    report,
    served,
    servers,
    trtprompt_side,
    vllm_side,
    workloads,
)
from trtprompt.bench.peers.servers import ROOT
from trtprompt.knobs import INT4_GROUP_SIZES

MODELS = ("peer", "smollm2")
DTYPES = ("fp32", "bf16", "int8")
# The --dtype values each side can run (what each runs for one: report's "precision" line).
SUPPORTED = {"trtprompt": trtprompt_side.PRECISION, "vllm": vllm_side.PRECISION,
             "llamacpp": llamacpp_side.PRECISION, "openvino": openvino_side.WEIGHT_FORMAT}
OFFLINE_WORKERS = {"trtprompt": (trtprompt_side.offline_cmd, trtprompt_side.env),
                   "vllm": (vllm_side.offline_cmd, vllm_side.env),
                   "openvino": (openvino_side.offline_cmd, openvino_side.env)}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _side_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--install-peers", "--install-vllm", action="store_true",
                    help="install vLLM / OpenVINO GenAI, build llama.cpp under --peers-dir where missing")
    ap.add_argument("--peers-dir", type=Path, default=ROOT.parent / "peers", help="peers' venvs and builds")
    ap.add_argument("--vllm-venv", type=Path, help="default: PEERS/vllm-venv")
    ap.add_argument("--ov-venv", type=Path, help="OpenVINO GenAI's venv (default: PEERS/ov-venv)")
    ap.add_argument("--ov-model-dir", type=Path, help="where the OpenVINO exports are (made on first use as "
                    "<checkpoint>-fp32 / <checkpoint>-int8; default: PEERS/openvino)")
    ap.add_argument("--ov-kv-precision", choices=tuple(openvino_side.KV_BYTES),
                    help="OpenVINO's KV_CACHE_PRECISION (default: its precision hint's)")
    ap.add_argument("--ov-cache-gb", type=positive, help="OpenVINO's SchedulerConfig.cache_size (default: room for "
                    "the prefix workload unshared, at most half the memory)")
    ap.add_argument("--int8-quantization", choices=trtprompt_side.INT8_QUANTIZATIONS, default="int8_w8a8",
                    help="trtprompt's engine for --dtype int8 (bfloat16 around it where the CPU has bf16 instructions)")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="--dtype int8 with int8_wo: lm_head in int8 too (build knob quantize_lm_head), as OpenVINO's "
                         "int8 export does; the engine is build/<model>-engine-int8_wo-head")
    ap.add_argument("--int8-group-size", type=int, choices=INT4_GROUP_SIZES,
                    help="--dtype int8 with int8_wo: a scale per group of this many input columns (build knob "
                         "int8_group_size); the engine is build/<model>-engine-int8_wo-gN[-head]")
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                    help="trtprompt's compute_dtype (serve knob; unset: a bf16 engine computes in float32 on a CPU "
                         "without bf16 instructions, engine/compute_dtype.py)")
    ap.add_argument("--speculative-decoding", choices=("none", "ngram"), default="none",
                    help="trtprompt's speculation (the peers run none)")


def _workload_options(ap: argparse.ArgumentParser) -> None:
    for name, default in (("throughput-requests", 32), ("throughput-input", 128), ("throughput-output", 64),
                          ("prefix-requests", 64), ("prefix-len", 1024), ("prefix-unique", 32),
                          ("prefix-output", 16), ("latency-requests", 4), ("latency-input", 128),
                          ("latency-output", 128)):
        ap.add_argument(f"--{name}", type=positive, default=default)
    ap.add_argument("--served-requests", type=positive, default=128, help="measured requests per rep")
    ap.add_argument("--served-warmup", type=positive, default=32, help="requests of the untimed warm-up run")
    for name, default in (("served-concurrency", 32), ("served-input", 128), ("served-output", 64)):
        ap.add_argument(f"--{name}", type=positive, default=default)
    ap.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to be ready")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trtprompt.bench.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="peer",
                    help="peer: the 27M demo checkpoint; smollm2: SmolLM2-135M-Instruct (make real-model)")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32", help="precision every side runs (docs/peer-*.md)")
    ap.add_argument("--checkpoint", type=Path, help="default: the --model's checkpoint")
    ap.add_argument("--engine", type=Path, help="default: build/<model>-engine-<dtype>")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the engine even if it exists")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "build/bench-vs-vllm")
    ap.add_argument("--only", default=",".join(workloads.DEFAULT_WORKLOADS),
                    help="comma list of " + ", ".join(workloads.WORKLOADS))
    ap.add_argument("--sides", default="vllm,trtprompt", help="comma list of " + ", ".join(report.SIDES))
    ap.add_argument("--reps", type=positive, default=3, help="timed reps per workload (medians reported)")
    ap.add_argument("--threads", type=positive, default=2, help="cores each side uses (vLLM binds 0..N-1)")
    _side_options(ap)
    _workload_options(ap)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    fill_paths(args)
    for name in ("peers_dir", "vllm_venv", "ov_venv", "ov_model_dir", "checkpoint", "engine", "out_dir"):
        setattr(args, name, getattr(args, name).resolve())  # subprocesses run in the repository root
    for name, allowed in (("only", workloads.WORKLOADS), ("sides", report.SIDES)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            ap.error(f"--{name}: unknown or empty {unknown or chosen}; choose from {', '.join(allowed)}")
        setattr(args, name, chosen)
    if args.prefix_len + args.prefix_unique + args.prefix_output > workloads.MAX_SEQ_LEN:
        ap.error(f"prefix workload exceeds max_seq_len {workloads.MAX_SEQ_LEN}")
    if args.latency_input + args.latency_output > workloads.MAX_SEQ_LEN:
        ap.error(f"latency workload exceeds max_seq_len {workloads.MAX_SEQ_LEN}")
    missing = [side for side in args.sides if args.dtype not in SUPPORTED[side]]
    if missing:
        ap.error(f"--dtype {args.dtype}: {', '.join(missing)} has no such precision here; drop it from --sides")
    if "trtprompt" not in args.sides:
        ap.error("--sides: trtprompt is what the others are compared with")
    return args


def fill_paths(args: argparse.Namespace) -> None:
    """Defaults that follow --model, --dtype and --peers-dir."""
    for given, flag in ((args.quantize_lm_head, "--quantize-lm-head"), (args.int8_group_size, "--int8-group-size")):
        if given and (args.dtype != "int8" or args.int8_quantization != "int8_wo"):
            sys.exit(f"{flag} goes with --dtype int8 --int8-quantization int8_wo (the build knob needs int8_wo)")
    args.vllm_venv = args.vllm_venv or args.peers_dir / "vllm-venv"
    args.ov_venv = args.ov_venv or args.peers_dir / "ov-venv"
    args.ov_model_dir = args.ov_model_dir or args.peers_dir / "openvino"
    if args.checkpoint is None:
        args.checkpoint = ROOT / ("build/peer-checkpoint" if args.model == "peer" else "build/smollm2")
    if args.engine is None:
        # The fp32 peer engine keeps its old name, so an existing build is reused.
        plain = args.model == "peer" and args.dtype == "fp32"
        kind = args.int8_quantization if args.dtype == "int8" else args.dtype
        kind += f"-g{args.int8_group_size}" if args.int8_group_size else ""
        kind += "-head" if args.quantize_lm_head else ""
        args.engine = ROOT / ("build/peer-engine" if plain else f"build/{args.model}-engine-{kind}")


# ---- running -----------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.install_peers and "vllm" in args.sides:
        vllm_side.install(args.vllm_venv)
    needs_vllm = "vllm" in args.sides or "served" in args.only  # the served workload's client is vLLM's
    if needs_vllm and not vllm_side.installed(args.vllm_venv):
        sys.exit(f"vLLM is not installed in {args.vllm_venv}: rerun with --install-peers (docs/peer-vllm.md)")
    trtprompt_side.prepare_checkpoint(args.checkpoint, args.model)
    trtprompt_side.build_engine(args)
    if "llamacpp" in args.sides:
        llamacpp_side.prepare(args)
    if "openvino" in args.sides:
        openvino_side.prepare(args)


def run_offline(args: argparse.Namespace, side: str, prompts: Path) -> dict[str, Any]:
    """A side's offline workloads in a process of its own; its result JSON."""
    if side == "llamacpp":
        return llamacpp_side.run_offline(args, prompts)
    make_cmd, make_env = OFFLINE_WORKERS[side]
    out = args.out_dir / f"offline-{side}.json"
    servers.log(f"offline workloads on {side}")
    servers.run_checked(make_cmd(args, prompts, out), env=make_env(args), cwd=ROOT)
    text = out.read_text(encoding="utf-8")
    return openvino_side.parse_result(text) if side == "openvino" else dict(json.loads(text))


def round_spec(spec: dict[str, Any], rep: int) -> dict[str, Any]:
    """The offline workloads with rep `rep`'s prompts only: one round of the side-by-side."""
    return {**spec, "workloads": {name: {**wl, "reps": [wl["reps"][rep]]} for name, wl in spec["workloads"].items()}}


def merge_round(into: dict[str, Any], result: dict[str, Any], workloads: Sequence[str]) -> None:
    """A side's result of one round appended to its earlier rounds' (reps in order; the rest kept from the first)."""
    for key, value in result.items():
        if key in workloads:
            into.setdefault(key, []).extend(value)
        else:
            into.setdefault(key, value)


def round_order(sides: Sequence[str], rep: int) -> list[str]:
    """Sides in order on even rounds, reversed on odd ones: a drift in the machine's speed (other tenants of a
    shared host) falls on every side alike instead of on whoever ran last."""
    return list(sides) if rep % 2 == 0 else list(reversed(sides))


def run_all(args: argparse.Namespace,
            spec: dict[str, Any] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each rep is a round in which every side runs it in a process of its own (after its own warm-up), the
    order alternating between rounds; then the served runs. Returns the sides' results and the host's speed
    before each round (host_speed.probe)."""
    results: dict[str, Any] = {side: {} for side in args.sides}
    host_rounds: list[dict[str, Any]] = []
    if spec is not None:
        (args.out_dir / "offline-prompts.json").write_text(json.dumps(spec), encoding="utf-8")
        for rep in range(args.reps):
            prompts = args.out_dir / f"offline-prompts-rep{rep}.json"
            prompts.write_text(json.dumps(round_spec(spec, rep)), encoding="utf-8")
            probe = host_speed.probe()  # between rounds, no side running
            servers.log(f"round {rep}: host {host_speed.one_line(probe)}")
            host_rounds.append(probe)
            for side in round_order(args.sides, rep):
                merge_round(results[side], run_offline(args, side, prompts), list(spec["workloads"]))
    if "served" in args.only:
        for side in args.sides:
            if side in served.SERVED_SIDES:
                results[side]["served"] = served.run_served(args, side)
            else:
                servers.log(openvino_side.OVMS_NOTE)
    return results, host_rounds


# ---- the report --------------------------------------------------------------------------

def commands(args: argparse.Namespace) -> dict[str, str]:
    """Each side's command line (ports are placeholders) and how it runs."""
    out = {"trtprompt build": servers.show(trtprompt_side.build_cmd(args)),
           "trtprompt offline": servers.show(trtprompt_side.offline_cmd(args, Path("P.json"), Path("R.json"))),
           "trtprompt serve": servers.show(trtprompt_side.server_cmd(args, 0))}
    if "vllm" in args.sides:
        env = vllm_side.env(args)
        binds = " ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"))
        out["vllm serve"] = f"{binds} {servers.show(vllm_side.server_cmd(args, 0))}"
    if "llamacpp" in args.sides:
        out["llamacpp serve"] = servers.show(llamacpp_side.side_server_cmd(args, 0))
    if "openvino" in args.sides:
        out["openvino offline"] = openvino_side.command(args)
    return out


def precision(args: argparse.Namespace) -> dict[str, str]:
    """What each side runs for --dtype."""
    labels = {"trtprompt": trtprompt_side.precision, "openvino": openvino_side.precision}
    return {side: labels[side](args) if side in labels else SUPPORTED[side][args.dtype] for side in args.sides}


def notes(args: argparse.Namespace, results: dict[str, Any], spec: dict[str, Any] | None) -> list[str]:
    """Greedy agreement with each peer, OVMS's absence, outputs of the wrong length."""
    lines = [f"greedy agreement with {p} (first throughput rep): {report.greedy_agreement(results, p)}"
             for p in args.sides if p in report.PEERS]
    if "openvino" in args.sides and "served" in args.only:
        lines.append(openvino_side.OVMS_NOTE)
    problems = report.length_problems(results, spec) if spec is not None else []
    lines += [f"WRONG OUTPUT LENGTH: {p}" for p in problems]
    return lines


def host_lines(host_rounds: list[dict[str, Any]]) -> list[str]:
    """The host's speed before each round, to read the rounds' ratios by (host_speed.py)."""
    return [f"host before round {i}: {host_speed.one_line(p)}" for i, p in enumerate(host_rounds)]


def report_text(args: argparse.Namespace, info: dict[str, Any], table: list[dict[str, Any]],
                extra: list[str]) -> str:
    lines = [f"machine: {machine.one_line(info)}",
             f"model {args.model}, dtype {args.dtype}: " + "; ".join(f"{s} runs {p}" for s, p in
                                                                     precision(args).items()),
             f"{args.threads} threads per side, medians of {args.reps} reps (one round each, sides alternating), "
             f"trtprompt {info['trtprompt_commit']}, "
             f"{info['time_utc']} UTC, load average at start {info['loadavg_start'][0]:.2f}; served: "
             "vllm.benchmarks.serve, streamed /v1/completions, every side with a server", "",
             *(f"{name}: {cmd}" for name, cmd in commands(args).items()), "",
             report.markdown(table, args.sides), "", report.cores_line(table, args.sides, args.threads), *extra]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a running server is stopped by its context manager.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    prepare(args)
    info = machine.describe()
    servers.log(f"machine: {machine.one_line(info)}; {args.threads} threads per side")
    offline = [w for w in workloads.OFFLINE if w in args.only]
    spec = workloads.offline_spec(args, workloads.token_range(args.checkpoint)) if offline else None
    results, host_rounds = run_all(args, spec)
    table = report.rows(args, results)
    extra = notes(args, results, spec)
    info["loadavg_end"] = list(os.getloadavg())
    out = args.out_dir / "results.json"
    agreement = {p: report.greedy_agreement(results, p) for p in args.sides if p in report.PEERS}
    out.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                               "precision": precision(args), "commands": commands(args), "table": table,
                               "greedy_agreement": agreement, "notes": extra, "host_rounds": host_rounds,
                               "results": results},
                              indent=1, default=str), encoding="utf-8")
    print("\n" + report_text(args, info, table, extra + host_lines(host_rounds))
          + f"\nload average at end {info['loadavg_end'][0]:.2f}"
          f"\nJSON: {out}")
