"""Chaos against a real `trtprompt serve` on the tiny test engine (issue 11), loopback only.

Parts (all bounded):
  bad-inputs  every row of docs/bad-inputs.md, then a healthy request
  poison      innocent greedy streams beside requests with NaN/inf sampling values: the innocent
              ones must finish with exactly the tokens they get alone
  big-ids     a tensorrt_llm request of 17M ids (68 MB): a clear INVALID_ARG naming input_ids
  hol         one stream's largest gap between tokens, alone and while a max-size prompt and
              a 4 MB text (refused before tokenizing) arrive
  shutdown    streams cancelled at their end, then SIGINT: serve exits 0, no process of its
              tree and no /dev/shm region is left (repeated --stops times, a server each)
  soak        --rounds rounds of mixed load; the engine process's RSS after each

One summary line; exit 1 when anything was lost, hung, leaked, an innocent request failed, or
a check did not hold.

    .venv/bin/python -m trtprompt.bench.scenarios.chaos                 # all but soak, on a tiny engine it builds
    .venv/bin/python -m trtprompt.bench.scenarios.chaos --only soak --rounds 12
"""

from __future__ import annotations

import functools
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click
import numpy as np

from trtprompt.bench.machine import ROOT
from trtprompt.bench.scenarios._serve import serve_argv, start_serve
from trtprompt.client import LLMClient, StreamResult, make_input, text_inputs
from trtprompt.serve.bad_inputs import CASES, ask, limits_of
from trtprompt.serve.launch.process_group import group_members
from trtprompt.serve.ports import free_ports
from trtprompt.serve.wire import protocol as P
from trtprompt.tokenizer import Tokenizer

PARTS = ("bad-inputs", "poison", "big-ids", "hol", "shutdown", "soak")
INNOCENT = ("The quick brown fox", "Once upon a time", "In the beginning", "Hello there, friend")


@dataclass
class Report:
    """What a chaos run found: failed checks, and notes printed with the summary."""

    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


@dataclass
class Server:
    """A running `trtprompt serve` and how to reach it and its engine process."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    log: Path
    grpc: int
    http: int
    engine_dir: Path

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def info(self) -> dict[str, Any]:
        return P.call(str(self.run_dir / "engine.sock"), {"op": "info"})

    def stats(self) -> dict[str, Any]:
        return P.call(str(self.run_dir / "engine.sock"), {"op": "stats", "since": 1 << 62})


def start(engine_dir: Path, work: Path, timeout_s: float = 180.0) -> Server:
    """`trtprompt serve` on free loopback ports, Triton only, in its own session; returned once ready."""
    grpc, http, metrics = free_ports(3)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    log = run_dir.with_suffix(".log")
    argv = serve_argv(engine_dir, run_dir, (grpc, http, metrics), "--host", "127.0.0.1", "--no-openai",
                      "--cancellation-check-period-ms", "20")
    proc = start_serve(argv, log, timeout_s, new_session=True)
    return Server(proc, run_dir, log, grpc, http, engine_dir)


def stop(server: Server, report: Report) -> None:
    """SIGINT as Ctrl-C; check exit code, the process tree (every group it led) and /dev/shm."""
    groups = {int(line.split()[3]) for line in _stats_of_tree(server.proc.pid)} - {os.getpgrp()}
    # This server's python-backend regions (trtprompt.serve.launch.launcher names them by its run dir).
    mine = f"trtprompt_*_{server.run_dir.name.replace('-', '_')}_*"
    shm_before = {p.name for p in Path("/dev/shm").glob(mine)}
    server.proc.send_signal(signal.SIGINT)
    try:
        code = server.proc.wait(90)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = None
    left = [pid for g in groups for pid in group_members(g)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    report.check(code == 0, f"serve exited with {code}")
    report.check(not left, f"processes left after stop: {left}")
    shm_left = [n for n in shm_before if (Path("/dev/shm") / n).exists()]
    report.check(bool(shm_before), f"no /dev/shm region named {mine} while serving (prefix not applied?)")
    report.check(not shm_left, f"/dev/shm left after stop: {shm_left}")
    text = server.log.read_text(errors="replace")
    report.notes += [line for line in text.splitlines() if "stop:" in line or "exit timeout" in line]


def _stats_of_tree(pid: int) -> list[str]:
    """/proc/PID/stat lines (after the comm) of pid and its descendants."""
    out: list[str] = []
    todo = [pid]
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1]
            except OSError:
                continue
            children.setdefault(int(rest.split()[1]), []).append(int(entry.name))
    while todo:
        p = todo.pop()
        try:
            out.append(f"{p} " + Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1])
        except OSError:
            continue
        todo += children.get(p, [])
    return out


def greedy(server: Server, prompt: str, max_tokens: int = 16, **extra: Any) -> StreamResult:
    with LLMClient(server.url) as c:
        return c.infer("ensemble", text_inputs(prompt, max_tokens, True, temperature=0.0, **extra), 120)


def part_bad_inputs(server: Server, report: Report) -> None:
    limits = limits_of(server.info(), Tokenizer.from_dir(server.engine_dir / "tokenizer").max_token_bytes)
    for n, case in enumerate(CASES, 1):
        got = ask(case, limits, server.url, f"http://127.0.0.1:{server.http}")
        report.check(got.status == case.status and case.expected(limits) in got.message,
                     f"bad input #{n} ({case.what}): got {got.status}: {got.message[:200]}")
    report.check(greedy(server, "still fine", 4).error is None, "server unhealthy after bad inputs")


def _run_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as exc:  # noqa: BLE001 - recorded as the job's result
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def part_poison(server: Server, report: Report, rounds: int = 2) -> None:
    alone = {p: greedy(server, p, 24).text for p in INNOCENT}
    poisons: list[dict[str, float]] = [dict(temperature=math.nan, top_k=5), dict(temperature=math.inf, top_k=5),
                                       dict(presence_penalty=math.inf), dict(frequency_penalty=-math.inf),
                                       dict(repetition_penalty=math.nan), dict(top_p=math.nan)]
    for _ in range(rounds):
        jobs: list[Callable[[], Any]] = [functools.partial(greedy, server, p, 24) for p in INNOCENT]
        jobs += [functools.partial(_poisoned, server, kw) for kw in poisons]
        results = _run_threads(jobs)
        for p, r in zip(INNOCENT, results):
            report.check(not isinstance(r, Exception) and r.error is None and r.text == alone[p],
                         f"innocent request {p!r} hurt by poison: {getattr(r, 'error', r)}")
        for kw, r in zip(poisons, results[len(INNOCENT):]):
            report.check(not isinstance(r, Exception) and r.error is not None
                         and f"input '{next(iter(kw))}'" in r.error, f"poison {kw} not refused: {r}")


def _poisoned(server: Server, kw: dict[str, float]) -> StreamResult:
    with LLMClient(server.url) as c:
        return c.infer("ensemble", text_inputs("poison", 16, True, **kw), 120)


def part_big_ids(server: Server, report: Report, n: int = 17_000_000) -> None:
    ids = np.full((1, n), 5, dtype=np.int32)
    inputs = [make_input("input_ids", ids), make_input("input_lengths", n, np.int32),
              make_input("request_output_len", 4, np.int32)]
    with LLMClient(server.url) as c:
        r = c.infer("tensorrt_llm", inputs, 300)
    bound = server.info()["max_input_len"]
    report.check(r.error is not None and "input 'input_ids'" in r.error and f"({bound}," in r.error,
                 f"{n} ids: {r.error or 'accepted'}")
    report.check(greedy(server, "after big ids", 4).error is None, "server unhealthy after big input_ids")


def _stream_gaps(server: Server, during: Callable[[], Any] | None,
                 tokens: int = 96) -> tuple[float, tuple[StreamResult, Any]]:
    """Largest gap (s) between one greedy stream's responses, with `during` sent at its 5th."""
    times: list[float] = []
    side: list[Any] = []
    started = threading.Event()

    def on_response(_out: Any) -> None:
        times.append(time.perf_counter())
        if len(times) == 5 and during is not None:
            started.set()

    def side_job() -> None:
        started.wait(120)
        if during is not None:
            side.append(during())

    t = threading.Thread(target=side_job) if during is not None else None
    if t:
        t.start()
    with LLMClient(server.url) as c:
        r = c.infer("ensemble", text_inputs("Count with me:", tokens, True, temperature=0.0,
                                            min_tokens=tokens), 300, on_response=on_response)
    if t:
        started.set()
        t.join(300)
    gaps = [b - a for a, b in zip(times[4:], times[5:])]
    return (max(gaps) if gaps else math.inf), (r, side[0] if side else None)


def part_hol(server: Server, report: Report) -> None:
    info = server.info()
    tok = Tokenizer.from_dir(server.engine_dir / "tokenizer")
    bound = info["max_input_len"] * tok.max_token_bytes
    big = "lorem ipsum " * (4_000_000 // 12)  # 4 MB: refused before tokenizing
    fitting = _max_fitting_text(tok, info["max_input_len"] - 1)
    base, _ = _stream_gaps(server, None)
    with_big, (r1, side1) = _stream_gaps(server, lambda: greedy(server, big, 4))
    with_max, (r2, side2) = _stream_gaps(server, lambda: greedy(server, fitting, 4))
    report.check(r1.error is None and r2.error is None, "the streaming request failed beside a long prompt")
    report.check(side1 is not None and side1.error is not None and f"more than the {bound} bytes" in side1.error,
                 f"4 MB text not refused by the byte bound: {getattr(side1, 'error', side1)}")
    report.check(side2 is not None and side2.error is None, f"max-size prompt failed: {getattr(side2, 'error', side2)}")
    report.notes.append(f"hol: stream's max inter-token gap {base * 1e3:.0f} ms alone, {with_big * 1e3:.0f} ms "
                        f"while a 4 MB text arrived (refused), {with_max * 1e3:.0f} ms while a "
                        f"{len(fitting.encode())}-byte max_input_len prompt was tokenized and prefilled")


def _max_fitting_text(tok: Tokenizer, max_tokens: int) -> str:
    text = "lorem ipsum dolor sit amet " * (max_tokens // 2)
    ids = tok.encode(text)[:max_tokens]
    return tok.decode(ids[1:] if ids and ids[0] == tok.bos_token_id else ids)


def part_shutdown(engine_dir: Path, work: Path, report: Report, stops: int) -> None:
    for _ in range(stops):
        server = start(engine_dir, work)
        for _ in range(6):  # streams cancelled at their end, as the client did
            c = LLMClient(server.url)
            r = c.infer("ensemble", text_inputs("bye", 8, True, temperature=0.0), 120)
            c.close(cancel=True)
            report.check(r.error is None, f"stream before stop failed: {r.error}")
        stop(server, report)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def part_soak(server: Server, report: Report, rounds: int) -> list[float]:
    """Each round: 48 prompts of lengths drawn anew (seeded by the round) up to ~700 tokens, so
    every round brings token counts not seen before; greedy and sampled; 8 at a time."""
    pid = server.info()["pid"]
    rss: list[float] = []
    for r in range(rounds):
        rng = random.Random(r)
        jobs: list[Callable[[], Any]] = [
            functools.partial(greedy, server, "soak " * rng.randint(1, 350), 8 + n % 24,
                              **({"top_k": 5, "seed": n} if n % 3 else {}))
            for n in range(1, 49)]
        for i in range(0, len(jobs), 8):
            for res in _run_threads(jobs[i:i + 8]):
                report.check(not isinstance(res, Exception) and res.error is None, f"soak request failed: {res}")
        rss.append(round(_rss_mib(pid), 1))
    report.notes.append(f"soak: engine RSS MiB by round {rss}")
    stats = server.stats()
    report.check(stats["in_flight"] == 0 and stats["used_num_blocks"] == 0, f"soak leaked: {stats}")
    return rss


def tiny_engine(work: Path) -> Path:
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.checkpoint_maker import DemoSpec, make_demo_checkpoint

    out = work / "tiny-engine"
    if not (out / "config.json").exists():
        ckpt = make_demo_checkpoint(work / "tiny-ckpt", DemoSpec(arch="llama", seed=0))
        run_build(BuildRequest(ckpt, out, "cpu-dev", progress=False, force=True))
    return out


def run_on_one_server(engine_dir: Path, work: Path, parts: tuple[str, ...], rounds: int,
                      report: Report) -> None:
    """Every part but shutdown, on one server, stopped (and checked) at the end."""
    server = start(engine_dir, work)
    try:
        for name, fn in (("bad-inputs", part_bad_inputs), ("poison", part_poison),
                         ("big-ids", part_big_ids), ("hol", part_hol)):
            if name in parts:
                fn(server, report)
        if "soak" in parts:
            part_soak(server, report, rounds)
    finally:
        stop(server, report)


def print_report(report: Report, parts: tuple[str, ...], seconds: float) -> None:
    for note in report.notes:
        print(f"  {note}")
    for failure in report.failures:
        print(f"  FAIL {failure}")
    verdict = "ok" if not report.failures else f"{len(report.failures)} FAILED"
    print(f"chaos: {verdict}: {', '.join(parts)} in {seconds:.0f}s")


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path), default=None,
              help="engine dir (default: build the tiny test engine under --work)")
@click.option("--work", type=click.Path(path_type=Path), default=ROOT / "build" / "chaos", show_default=True)
@click.option("--only", multiple=True, type=click.Choice(PARTS), help="parts to run (default: all but soak)")
@click.option("--rounds", default=12, show_default=True, help="soak rounds")
@click.option("--stops", default=3, show_default=True, help="shutdown: servers started and stopped")
def main(engine_dir: Path | None, work: Path, only: tuple[str, ...], rounds: int, stops: int) -> None:
    """Chaos against a real `trtprompt serve` (issue 11): bad inputs, poison, big ids, head-of-line, shutdown, soak."""
    work.mkdir(parents=True, exist_ok=True)
    engine_dir = engine_dir or tiny_engine(work)
    parts = only or tuple(p for p in PARTS if p != "soak")
    report = Report()
    t0 = time.monotonic()
    if any(p != "shutdown" for p in parts):
        run_on_one_server(engine_dir, work, parts, rounds, report)
    if "shutdown" in parts:
        part_shutdown(engine_dir, work, report, stops)
    print_report(report, parts, time.monotonic() - t0)
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
