"""trtprompt's side: its checkpoint and engine (built with the comparison's bounds), its offline worker's and its
server's command lines, and the precision it runs for a --dtype."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from trtprompt.bench.peers import servers, workloads
from trtprompt.bench.peers.servers import ROOT

# `trtprompt build` flags per --dtype; int8's quantization is --int8-quantization, its dtype int8_dtype().
PRECISION = {"fp32": "--dtype float32", "bf16": "--dtype bfloat16", "int8": "--quantization int8_w8a8"}
INT8_QUANTIZATIONS = ("int8_w8a8", "int8_wo", "int4_wo")


def int8_dtype() -> str:
    """What an int8 engine keeps in floating point (norms, embeddings, activations, KV): bfloat16 where the CPU
    has bf16 instructions (the issue's "int8 combined with bf16 for the rest of the step"), else float32."""
    from trtprompt.engine import isa

    return "float32" if isa.bf16_problem(isa.cpu_flags()) else "bfloat16"


def precision_flags(args: argparse.Namespace) -> list[str]:
    if args.dtype != "int8":
        return PRECISION[args.dtype].split()
    head = ["--quantize-lm-head"] if getattr(args, "quantize_lm_head", False) else []
    group = getattr(args, "int8_group_size", None)
    head += ["--int8-group-size", str(group)] if group else []
    return ["--dtype", int8_dtype(), "--quantization", getattr(args, "int8_quantization", "int8_w8a8"), *head]


def trtprompt_bin() -> Path:
    return Path(sys.executable).parent / "trtprompt"


def prepare_checkpoint(path: Path, model: str) -> None:
    """`--model smollm2`: `make real-model`; `--model peer`: the demo checkpoint of the peer's shape."""
    if (path / "config.json").exists():
        return
    if model == "smollm2":
        if path != ROOT / "build/smollm2":
            sys.exit(f"no checkpoint in {path}: `make real-model` makes build/smollm2")
        servers.run_checked(["make", "real-model"], cwd=ROOT)
        return
    from trtprompt.checkpoint_maker import DemoSpec, make_demo_checkpoint

    servers.log(f"making the peer checkpoint in {path}")
    make_demo_checkpoint(path, DemoSpec(size="peer"))


def build_cmd(args: argparse.Namespace) -> list[Any]:
    return [trtprompt_bin(), "build", args.checkpoint, "-o", args.engine, "--profile", "cpu-dev",
            *precision_flags(args),
            "--max-batch-size", workloads.MAX_BATCH, "--max-num-tokens", workloads.MAX_NUM_TOKENS,
            "--max-seq-len", workloads.MAX_SEQ_LEN, "--tokens-per-block", workloads.TOKENS_PER_BLOCK,
            "--enable-chunked-context", "--max-tokens-in-paged-kv-cache", workloads.kv_pool_tokens(args),
            "--force", "--no-progress"]


def build_engine(args: argparse.Namespace) -> None:
    if (args.engine / "config.json").exists() and not args.rebuild:
        return
    servers.run_checked(build_cmd(args))


def env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)}


def _knobs(args: argparse.Namespace) -> list[Any]:
    """The serve knobs the side-by-side sets: plain decoding unless asked (the peers do not speculate)."""
    return [*(["--compute-dtype", args.compute_dtype] if args.compute_dtype else []),
            "--speculative-decoding", args.speculative_decoding]


def offline_cmd(args: argparse.Namespace, prompts: Path, out: Path) -> list[Any]:
    return [sys.executable, "-m", "trtprompt.bench.peers.trtprompt_worker", "--prompts", prompts, "--out", out,
            "--engine", args.engine, "--threads", args.threads, *_knobs(args)]


def server_cmd(args: argparse.Namespace, openai_port: int) -> list[Any]:
    return [trtprompt_bin(), "serve", args.engine, "--host", "127.0.0.1",
            "--openai-port", openai_port, "--http-port", servers.free_port(), "--grpc-port", servers.free_port(),
            "--metrics-port", servers.free_port(), "--run-dir", args.out_dir / "trtprompt-serve", *_knobs(args)]


def precision(args: argparse.Namespace) -> str:
    """The build flags and the dtype the engine computes in (engine/compute_dtype.py)."""
    from trtprompt.engine.compute_dtype import resolve_compute_dtype

    flags = precision_flags(args)
    stored = flags[flags.index("--dtype") + 1] if "--dtype" in flags else "float32"
    computed = resolve_compute_dtype(stored, args.compute_dtype, "cpu").dtype
    return f"{' '.join(flags)}, computed in {computed}, speculative decoding {args.speculative_decoding}"
