"""llama.cpp as a side (docs/peer-llamacpp.md): build its C++ server, convert a checkpoint, run the workloads.

    .venv/bin/python -m trtprompt.bench.peers.llamacpp_side build   --peers-dir /work/peers
    .venv/bin/python -m trtprompt.bench.peers.llamacpp_side convert --peers-dir /work/peers --checkpoint DIR
        --dtype fp32|bf16|int8

The server is `llama-server` from llama-cpp-python 0.3.36's sdist (the pip package's own Python server has no
parallel slots), built natively; GGUF files come from `convert_hf_to_gguf.py` of the same sources (F32 / BF16 /
Q8_0). It has no in-process batch engine: the offline workloads go through its native /completion endpoint with
token-id prompts, every prompt in flight at once, streamed (TTFT and inter-token times from the tokens' arrival).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench.peers import http_stream, offline_loop, servers

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}"
# Precision names of the side-by-side -> convert_hf_to_gguf.py --outtype (int8: Q8_0, weight blocks of
# 32 int8 with one scale; ggml quantizes the activations to Q8 for the dot products too).
OUTTYPE = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}
PRECISION = {d: t.upper() for d, t in OUTTYPE.items()}
# What the converter imports beyond the standard library (the GGUF writer itself is gguf-py from
# the same sources, put on PYTHONPATH). torch comes from the machine's CPU wheel (pip's find-links).
CONVERT_PACKAGES = ("torch==2.13.0", "numpy<2", "transformers", "sentencepiece", "safetensors", "protobuf")
SERVER_SLOTS = 32
CACHE_REUSE = 256  # --cache-reuse: smallest chunk of a slot's cache reused by KV shifting


@dataclass(frozen=True)
class LlamaPaths:
    """Where the peer lives under --peers-dir."""

    peers_dir: Path

    @property
    def root(self) -> Path:
        return self.peers_dir / "llamacpp"

    @property
    def source(self) -> Path:
        return self.root / SDIST / "vendor" / "llama.cpp"

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def venv(self) -> Path:
        return self.peers_dir / "llamacpp-venv"

    def gguf(self, checkpoint: Path, dtype: str) -> Path:
        return self.root / "gguf" / f"{checkpoint.name}-{OUTTYPE[dtype]}.gguf"


def cmake_configure_cmd(paths: LlamaPaths) -> list[str]:
    """Native build of the server alone, static, no network client (nothing to download at run time)."""
    return ["cmake", "-S", str(paths.source), "-B", str(paths.root / "build"), "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF"]


def build(paths: LlamaPaths, jobs: int = 2) -> Path:
    """Download the sdist, configure and build llama-server; each step only when its output is missing."""
    if paths.server.exists():
        servers.log(f"llama-server already built: {paths.server}")
        return paths.server
    paths.root.mkdir(parents=True, exist_ok=True)
    tarball = paths.root / f"{SDIST}.tar.gz"
    if not tarball.exists():
        servers.run_checked([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                             f"llama-cpp-python=={VERSION}", "-d", paths.root])
    if not paths.source.exists():
        servers.run_checked(["tar", "xzf", tarball, "-C", paths.root])
    servers.run_checked(["nice", "-n", "10", *cmake_configure_cmd(paths)])
    servers.run_checked(["nice", "-n", "10", "cmake", "--build", paths.root / "build", "--target", "llama-server",
                         f"-j{jobs}"])
    return paths.server


def ensure_venv(paths: LlamaPaths) -> Path:
    python = paths.venv / "bin" / "python"
    stamp = paths.venv / ".convert-packages"
    if not stamp.exists():
        servers.run_checked([sys.executable, "-m", "venv", paths.venv])
        servers.run_checked([python, "-m", "pip", "install", "-q", *CONVERT_PACKAGES])
        stamp.write_text("\n".join(CONVERT_PACKAGES) + "\n", encoding="utf-8")
    return python


def convert_cmd(paths: LlamaPaths, python: Path, checkpoint: Path, dtype: str) -> list[str]:
    return [str(python), str(paths.source / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype",
            OUTTYPE[dtype], "--outfile", str(paths.gguf(checkpoint, dtype))]


def convert(paths: LlamaPaths, checkpoint: Path, dtype: str) -> Path:
    """HF checkpoint -> GGUF at the precision asked, once."""
    out = paths.gguf(checkpoint, dtype)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(paths.source / "gguf-py"), "OMP_NUM_THREADS": "2"}
    servers.run_checked(convert_cmd(paths, ensure_venv(paths), checkpoint, dtype), env=env)
    return out


def context_tokens(per_sequence: int, slots: int = SERVER_SLOTS) -> int:
    """-c is split evenly over the slots: each must hold the longest sequence, in 256-token steps."""
    return slots * (-(-per_sequence // 256) * 256)


def server_cmd(paths: LlamaPaths, gguf: Path, port: int, threads: int, per_sequence: int) -> list[str]:
    """-t/-tb: threads for decode and for prompt batches (both cores); -np slots, -cb continuous batching."""
    return [str(paths.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(SERVER_SLOTS), "-cb",
            "-c", str(context_tokens(per_sequence)), "--cache-reuse", str(CACHE_REUSE), "--seed", "0"]


def side_server_cmd(args: argparse.Namespace, port: int) -> list[str]:
    """The side-by-side's server: slots long enough for the longest sequence of any workload."""
    longest = max(args.throughput_input + args.throughput_output, args.served_input + args.served_output,
                  args.latency_input + args.latency_output, args.prefix_len + args.prefix_unique + args.prefix_output)
    paths = LlamaPaths(args.peers_dir)
    return server_cmd(paths, paths.gguf(args.checkpoint, args.dtype), port, args.threads, longest)


# ---- offline workloads through the server ------------------------------------------------

def completion_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, EOS ignored (exactly max_tokens out), prompt caching on, token ids back."""
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "cache_prompt": True, "stream": True, "return_tokens": True, "seed": 0}


def merge_tokens(so_far: list[int], event: dict[str, Any]) -> list[int]:
    """Partial events carry their new tokens; the final one (stop) may repeat them all: its
    tokens_predicted says which."""
    new = list(event["tokens"])
    if event.get("stop") and so_far and len(new) == event.get("tokens_predicted"):
        return new
    return so_far + new


def one_completion(port: int, prompt: list[int], max_tokens: int, t0: float) -> dict[str, Any]:
    """One streamed request; times relative to t0 (the batch's start)."""
    tokens: list[int] = []
    first = last = None
    event: dict[str, Any] = {}
    for now, event in http_stream.stream(port, "/completion", completion_body(prompt, max_tokens)):
        if event.get("tokens"):
            before = len(tokens)
            tokens = merge_tokens(tokens, event)
            if len(tokens) > before:
                first, last = (now if first is None else first), now
    return {"tokens": tokens, "ttft_s": None if first is None else first - t0, "cached": event.get("tokens_cached"),
            "ms_per_token": offline_loop.ms_per_token(first, last, len(tokens))}


def offline_run(port: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Every prompt in flight at once (the server queues past its slots), as the offline engines get them."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(lambda p: one_completion(port, p, max_tokens, t0), prompts))
    wall = time.perf_counter() - t0
    ttft = [o["ttft_s"] for o in outs if o["ttft_s"] is not None]
    return {"wall_s": wall, "output_tokens": sum(len(o["tokens"]) for o in outs),
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "tokens": [o["tokens"] for o in outs],
            "ms_per_token": [o["ms_per_token"] for o in outs]}


def run_offline(args: argparse.Namespace, prompts: Path) -> dict[str, Any]:
    """The offline workloads of the prompts file through one llama-server."""
    spec = json.loads(prompts.read_text(encoding="utf-8"))
    port = servers.free_port()
    ready = f"http://127.0.0.1:{port}/health"
    servers.log("offline workloads on llamacpp (through its server, every request in flight at once)")
    log_path = args.out_dir / "server-llamacpp-offline.log"
    with servers.server(side_server_cmd(args, port), dict(os.environ), ready, log_path, args.server_timeout) as proc:
        run = lambda p, n: offline_run(port, p, n)  # noqa: E731
        # Nothing to reset: every rep's prompts are new to the slots' caches.
        return {"side": "llamacpp", **offline_loop.run_workloads(run, lambda: None, spec, proc.pid)}


def prepare(args: argparse.Namespace) -> None:
    """The server built and the checkpoint converted at --dtype, where missing (building needs --install-peers)."""
    paths = LlamaPaths(args.peers_dir)
    if not paths.server.exists() and not args.install_peers:
        sys.exit(f"llama-server is not built in {paths.root}: rerun with --install-peers")
    build(paths)
    convert(paths, args.checkpoint, args.dtype)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("build", "convert"))
    ap.add_argument("--peers-dir", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--dtype", choices=tuple(OUTTYPE), default="fp32")
    args = ap.parse_args(argv)
    paths = LlamaPaths(args.peers_dir.resolve())
    if args.action == "build":
        print(build(paths))
    elif args.checkpoint is None:
        ap.error("convert takes --checkpoint")
    else:
        print(convert(paths, args.checkpoint.resolve(), args.dtype))


if __name__ == "__main__":
    main()
