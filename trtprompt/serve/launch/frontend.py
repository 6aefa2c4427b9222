"""Start the front end as its own process for `trtprompt serve`, and say how to reach it.

The launcher hands in its own spawn function (same environment, process
group and parent-death signal as tritonserver), so the front end is stopped
exactly like the other children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from trtprompt.serve.launch.options import OpenAIOptions
from trtprompt.serve.ports import http_ok

Spawn = Callable[[Sequence[str], Path], subprocess.Popen[bytes]]


class FrontendError(RuntimeError):
    """The front end did not come up; the message carries its log."""


KEY_FILE = "openai.key"


def _write_key(run_dir: Path, key: str) -> Path:
    """The key for the front end's --api-key-file (never its command line): 0600 in the 0700 run dir,
    removed once the front end has read it (remove_key)."""
    path = run_dir / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key)
    return path


def remove_key(run_dir: Path) -> None:
    """Unlink the key file, if any: the front end reads it once, before it answers /health."""
    (run_dir / KEY_FILE).unlink(missing_ok=True)


@dataclass(frozen=True)
class DirectEngine:
    """The torch target's engine process, which the front end then talks to instead of Triton."""

    socket: str
    tokenizer_dir: Path


def frontend_command(opts: OpenAIOptions, engine_dir: Path, grpc_url: str, host: str,
                     key_file: Path | None, direct: DirectEngine | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "trtprompt.serve.openai", str(engine_dir), "--grpc-url", grpc_url,
           "--host", host, "--port", str(opts.port)]
    if direct is not None:
        cmd += ["--engine-socket", direct.socket, "--tokenizer-dir", str(direct.tokenizer_dir)]
    if opts.max_request_bytes is not None:
        cmd += ["--max-request-bytes", str(opts.max_request_bytes)]
    cmd += ["--tool-call-parser", opts.tool_call_parser, "--reasoning-parser", opts.reasoning_parser]
    return cmd + (["--api-key-file", str(key_file)] if key_file is not None else [])


def start_frontend(opts: OpenAIOptions, engine_dir: Path, host: str, local_host: str, grpc_port: int,
                   run_dir: Path, spawn: Spawn, timeout_s: float,
                   direct: DirectEngine | None = None) -> subprocess.Popen[bytes]:
    """Spawn the front end and wait until /health answers 200 (tritonserver or the engine must be ready)."""
    key_file = _write_key(run_dir, opts.api_key) if opts.api_key is not None else None
    log = run_dir / "openai.log"
    proc = spawn(frontend_command(opts, engine_dir, f"{local_host}:{grpc_port}", host, key_file, direct), log)
    try:
        _wait_healthy(proc, opts.port, local_host, log, timeout_s)
    except FrontendError:
        _kill(proc)
        raise
    finally:
        remove_key(run_dir)  # read (or never to be read): a key on disk only while it must be
    return proc


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # spawned as its own process group
        except ProcessLookupError:
            pass
        proc.wait(10)


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, local_host: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.is_file() else ""
            raise FrontendError(f"the OpenAI front end exited with code {proc.returncode} (port {port} "
                                f"taken? --openai-port or --no-openai); {log}:\n{text}")
        if http_ok(f"http://{local_host}:{port}/health"):
            return
        time.sleep(0.1)
    raise FrontendError(f"the OpenAI front end did not answer /health within {timeout_s:.0f}s; see {log}")


def banner(opts: OpenAIOptions, local_host: str, model: str) -> str:
    """The ready message's OpenAI lines: address, a curl and an openai-client example."""
    base = f"http://{local_host}:{opts.port}/v1"
    auth = ' -H "Authorization: Bearer $TRTPROMPT_API_KEY"' if opts.api_key else ""
    key = "os.environ['TRTPROMPT_API_KEY']" if opts.api_key else "'unused'"
    return (f"  OpenAI  {base}  (model {model!r}{', bearer key required' if opts.api_key else ''})\n"
            f"  curl:   curl {base}/chat/completions{auth} -H 'Content-Type: application/json' -d "
            f"'{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
            f"\"What is the capital of France?\"}}], \"max_tokens\": 64, \"temperature\": 0}}'\n"
            f"  python: openai.OpenAI(base_url='{base}', api_key={key}).completions.create("
            f"model='{model}', prompt='Hello', max_tokens=16)")
