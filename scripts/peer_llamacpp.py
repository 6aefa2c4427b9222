#!/usr/bin/env python3
"""llama.cpp as a peer of scripts/bench_vs_vllm.py: build its C++ server, convert a checkpoint, run it.

    python scripts/peer_llamacpp.py build   --peers-dir /work/peers
    python scripts/peer_llamacpp.py convert --peers-dir /work/peers --checkpoint DIR --dtype fp32|bf16|int8

The server is `llama-server` from llama-cpp-python 0.3.36's sdist (the pip package's own Python
server has no parallel slots), built natively; GGUF files come from `convert_hf_to_gguf.py` of the
same sources (F32 / BF16 / Q8_0). `offline_run` drives the server's native /completion endpoint
with token-id prompts, all in flight at once, streamed (TTFT from the first token). Standard
library only: it runs in the project's venv and needs nothing from llama.cpp's Python side.
See docs/peer-llamacpp.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}"
# Precision names of the side-by-side -> convert_hf_to_gguf.py --outtype (int8: Q8_0, weight blocks of
# 32 int8 with one scale; ggml quantizes the activations to Q8 for the dot products too).
OUTTYPE = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}
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


def log(msg: str) -> None:
    print(f"[peer-llamacpp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_checked(cmd: Sequence[Any], **kwargs: Any) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def cmake_configure_cmd(paths: LlamaPaths) -> list[str]:
    """Native build of the server alone, static, no network client (nothing to download at run time)."""
    return ["cmake", "-S", str(paths.source), "-B", str(paths.root / "build"), "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF"]


def build(paths: LlamaPaths, jobs: int = 2) -> Path:
    """Download the sdist, configure and build llama-server; each step only when its output is missing."""
    if paths.server.exists():
        log(f"llama-server already built: {paths.server}")
        return paths.server
    paths.root.mkdir(parents=True, exist_ok=True)
    tarball = paths.root / f"{SDIST}.tar.gz"
    if not tarball.exists():
        run_checked([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     f"llama-cpp-python=={VERSION}", "-d", paths.root])
    if not paths.source.exists():
        run_checked(["tar", "xzf", tarball, "-C", paths.root])
    run_checked(["nice", "-n", "10", *cmake_configure_cmd(paths)])
    run_checked(["nice", "-n", "10", "cmake", "--build", paths.root / "build", "--target", "llama-server",
                 f"-j{jobs}"])
    return paths.server


def ensure_venv(paths: LlamaPaths) -> Path:
    python = paths.venv / "bin" / "python"
    stamp = paths.venv / ".convert-packages"
    if not stamp.exists():
        run_checked([sys.executable, "-m", "venv", paths.venv])
        run_checked([python, "-m", "pip", "install", "-q", *CONVERT_PACKAGES])
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
    run_checked(convert_cmd(paths, ensure_venv(paths), checkpoint, dtype), env=env)
    return out


def context_tokens(per_sequence: int, slots: int = SERVER_SLOTS) -> int:
    """-c is split evenly over the slots: each must hold the longest sequence, in 256-token steps."""
    return slots * (-(-per_sequence // 256) * 256)


def server_cmd(paths: LlamaPaths, gguf: Path, port: int, threads: int, per_sequence: int) -> list[str]:
    """-t/-tb: threads for decode and for prompt batches (both cores); -np slots, -cb continuous batching."""
    return [str(paths.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(SERVER_SLOTS), "-cb",
            "-c", str(context_tokens(per_sequence)), "--cache-reuse", str(CACHE_REUSE), "--seed", "0"]


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
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    try:
        conn.request("POST", "/completion", json.dumps(completion_body(prompt, max_tokens)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
        tokens: list[int] = []
        first: float | None = None
        event: dict[str, Any] = {}
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("tokens"):
                first = time.perf_counter() if first is None else first
                tokens = merge_tokens(tokens, event)
        return {"tokens": tokens, "ttft_s": None if first is None else first - t0,
                "cached": event.get("tokens_cached"), "done": time.perf_counter() - t0}
    finally:
        conn.close()


def offline_run(port: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Every prompt in flight at once (the server queues past its slots), as the offline engines get them."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(lambda p: one_completion(port, p, max_tokens, t0), prompts))
    wall = time.perf_counter() - t0
    ttft = [o["ttft_s"] for o in outs if o["ttft_s"] is not None]
    return {"wall_s": wall, "output_tokens": sum(len(o["tokens"]) for o in outs),
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "tokens": [o["tokens"] for o in outs]}


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
