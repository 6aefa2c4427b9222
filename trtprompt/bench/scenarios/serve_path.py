"""Served vs in-process throughput, and CPU seconds per output token of every process.

One run, same machine state: for each code checkout given with --code (e.g.
an old commit unpacked under build/ and this tree), start `trtprompt serve`
from that checkout, drive the seeded `random` workload through the
`ensemble` model at a fixed concurrency (this process is the client, as
`trtprompt bench` would be), and read the CPU time (utime + stime from
/proc/<pid>/stat) that the engine process, each Python-backend stub,
tritonserver and the client spent during the measured phase. Between the
served runs the same requests run in process (LLMEngine + EngineLoop, the
same closed loop of `concurrency` submitters). CPU seconds per output token
do not depend on how busy the shared machine was; wall-clock throughput
does, hence the back-to-back in-process run.

    .venv/bin/python -m trtprompt.bench.scenarios.serve_path build/h2-engine --code build/h2-base --code .
    .venv/bin/python -m trtprompt.bench.scenarios.serve_path build/h2-engine --engine-threads 1   # a core to the relay

Prints one JSON object; not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench import machine
from trtprompt.bench.machine import ROOT
from trtprompt.bench.runner import LoadSpec, RunResult, run_load
from trtprompt.bench.scenarios._serve import serve_argv, start_serve
from trtprompt.bench.workloads import Workload, WorkloadSpec, make_workload
from trtprompt.serve.launch.process_group import descendants
from trtprompt.serve.ports import free_ports
from trtprompt.tokenizer import Tokenizer

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def role(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    if "trtprompt.serve.engine_process" in cmd or "engine_server" in cmd:  # its module name since issue 21, and before
        return "engine process"
    if "triton_python_backend_stub" in cmd:
        model = re.search(r"/([^/ ]+)/\d+/model\.py", cmd)
        return f"stub {model.group(1) if model else pid}"
    if "trtprompt.serve.openai" in cmd:
        return "openai front end"
    if "tritonserver" in cmd:
        return "tritonserver"
    return f"other {cmd[:40]}"


def serve_from(code: Path, engine_dir: Path, run_dir: Path, ports: Sequence[int],
               extra: list[str]) -> subprocess.Popen[bytes]:
    """`trtprompt serve` from the checkout `code` (its own package first on the path), ready."""
    env = dict(os.environ, PYTHONPATH=str(code.resolve()))
    argv = serve_argv(engine_dir.resolve(), run_dir, ports, *extra)
    return start_serve(argv, run_dir.with_suffix(".log"), 180, cwd=code, env=env)


def measured_load(url: str, api: str, pids: dict[int, str], work: Workload,
                  concurrency: int) -> tuple[RunResult, float, dict[int, float], dict[str, int]]:
    """The measured run: its result, the client's CPU seconds, each server process's, and peak threads."""
    threads = _ThreadPeak(pids).start()
    before = {pid: cpu_s(pid) for pid in pids}
    client0 = time.process_time()
    result = run_load(url, work, LoadSpec(concurrency=concurrency, warmup=0), progress=False, api=api)
    client = time.process_time() - client0
    used = {pid: cpu_s(pid) - before[pid] for pid in pids}
    return result, client, used, threads.stop()


def served(code: Path, engine_dir: Path, work: Workload, warm: Workload, concurrency: int,
           run_dir: Path, extra: list[str], api: str = "triton") -> dict[str, Any]:
    ports = free_ports(4)
    proc = serve_from(code, engine_dir, run_dir, ports[:3], extra + ["--openai-port", str(ports[3])])
    url = f"127.0.0.1:{ports[0]}" if api == "triton" else f"http://127.0.0.1:{ports[3]}"
    try:
        run_load(url, warm, LoadSpec(concurrency=len(warm.requests), warmup=0), progress=False, api=api)
        pids = {pid: role(pid) for pid in descendants(proc.pid)}
        torch_threads = _info(run_dir).get("torch_threads")
        result, client, used, peak = measured_load(url, api, pids, work, concurrency)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    cpu: dict[str, float] = {"client": client}
    for pid, name in pids.items():
        cpu[name] = cpu.get(name, 0.0) + used[pid]
    return served_row(code, api, result, cpu, peak, torch_threads)


def served_row(code: Path, api: str, result: RunResult, cpu: dict[str, float], peak: dict[str, int],
               torch_threads: Any) -> dict[str, Any]:
    tokens = sum(r.num_output_tokens or 0 for r in result.records)
    errors = [r.error for r in result.records if r.error]
    return {"code": str(code), "api": api, "wall_s": result.wall_s, "output_tokens": tokens,
            "output_tok_s": tokens / result.wall_s, "errors": errors[:3], "num_errors": len(errors),
            "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
            "cpu_ms_per_token": {k: round(1000 * v / tokens, 3) for k, v in cpu.items()},
            "engine_cores_used": round(cpu.get("engine process", 0.0) / result.wall_s, 2),
            "peak_threads": peak, "engine_torch_threads": torch_threads}


def _info(run_dir: Path) -> dict[str, Any]:
    from trtprompt.serve.wire import protocol as P

    return P.call(str(run_dir / "engine.sock"), {"op": "info"})


class _ThreadPeak:
    """Most threads each server process had at once during the run (sampled every 0.2 s)."""

    def __init__(self, pids: dict[int, str]) -> None:
        self.pids, self.peak = pids, {name: 0 for name in pids.values()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "_ThreadPeak":
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for pid, name in self.pids.items():
                try:
                    self.peak[name] = max(self.peak[name], len(os.listdir(f"/proc/{pid}/task")))
                except OSError:
                    pass


def closed_loop(loop: Any, prompts: list[list[int]], params: list[Any], concurrency: int) -> int:
    """`concurrency` submitter threads, each taking the next request when its last one ends; tokens made."""
    todo = list(range(len(prompts)))
    lock = threading.Lock()
    counted = [0]

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            n = sum(len(o.new_token_ids) for o in loop.submit(f"r{i}", prompts[i], params[i]))
            with lock:
                counted[0] += n

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counted[0]


def in_process(engine_dir: Path, work: Workload, tok: Tokenizer, concurrency: int) -> dict[str, Any]:
    import torch

    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.loop import EngineLoop
    from trtprompt.engine.request import SamplingParams

    loop = EngineLoop(LLMEngine.from_engine_dir(engine_dir)).start()
    prompts = [tok.encode(r.prompt) for r in work.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, temperature=0.0)
              for r in work.requests]
    list(loop.submit("warm", prompts[0], params[0]))
    cpu0, t0 = time.process_time(), time.perf_counter()
    tokens = closed_loop(loop, prompts, params, concurrency)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    loop.stop()
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "cpu_s": round(cpu, 2), "cpu_ms_per_token": round(1000 * cpu / tokens, 3),
            "torch_threads": torch.get_num_threads()}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--code", type=Path, action="append", help="checkout to serve from (repeatable)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--run-dir", type=Path, default=ROOT / "build" / "bench-serve-path")
    ap.add_argument("--serve-args", default="", help="extra `trtprompt serve` options, space-separated")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--api", choices=("triton", "openai", "both"), default="triton",
                    help="served through Triton gRPC (`ensemble`), the OpenAI endpoint, or each in turn")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="torch threads of the engine on both paths (`serve --engine-threads`; default: one per core)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    tok = Tokenizer.from_dir(args.engine_dir / "tokenizer")
    spec = WorkloadSpec("random", num_requests=args.num_requests, output_len=args.output_len,
                        input_len=args.input_len)
    work = make_workload(spec, tok)
    warm = Workload(spec, work.requests[:2])
    args.run_dir.mkdir(parents=True, exist_ok=True)
    info = machine.describe()
    report: dict[str, Any] = {"cpu": machine.one_line(info), "machine": info, "load_before": os.getloadavg(),
                              "runs": []}
    serve_args = args.serve_args.split()
    if args.engine_threads is not None:
        import torch

        torch.set_num_threads(args.engine_threads)  # the in-process engine's, as the served engine's below
        serve_args += ["--engine-threads", str(args.engine_threads)]
    apis = ("triton", "openai") if args.api == "both" else (args.api,)
    for i, code in enumerate(args.code or [ROOT]):
        for api in apis:
            report["runs"].append(served(code, args.engine_dir, work, warm, args.concurrency,
                                         args.run_dir / f"serve{i}-{api}", serve_args, api))
        if i == 0 and not args.skip_in_process:
            report["in_process"] = in_process(args.engine_dir, work, tok, args.concurrency)
    for run in report["runs"]:
        if "in_process" in report:
            run["ratio_to_in_process"] = round(run["output_tok_s"] / report["in_process"]["output_tok_s"], 3)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
