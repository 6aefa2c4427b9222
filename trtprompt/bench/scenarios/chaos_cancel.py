"""Cancels on the gRPC path under chaos (issue 37, item 7): rounds of 64 streams to `ensemble`,
a third cancelled mid-stream, some on channels closed under them, some whose client PROCESS is
killed (SIGKILL) mid-stream; every one of them must be aborted in the engine, none may run on to
its max_tokens.

Measured with the engine process's own counts (its `stats` op): per round, its finished requests
by reason (`length` must equal the streams that were left alone; every other request is
`aborted`), the tokens it made for the abandoned requests beyond those their clients saw, and its
blocks in use afterwards (0). The abandoned requests ask for LONG tokens, far more than any lag
can hide, so one that ends by `length` was not stopped by its client's going away.

    .venv/bin/python -m trtprompt.bench.scenarios.chaos_cancel                   # 4 rounds on the tiny engine
    .venv/bin/python -m trtprompt.bench.scenarios.chaos_cancel --rounds 8 --streams 64

Exit 1 when a round lost a cancel (a `length` too many), an error came back, or the engine did
not go idle.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import click

from trtprompt.bench.machine import ROOT
from trtprompt.bench.scenarios import chaos
from trtprompt.client import aio_channel, stream_request, text_inputs

MODULE = "trtprompt.bench.scenarios.chaos_cancel"  # the killed client runs as `python -m MODULE --child`

LONG = 1500  # an abandoned request's max_tokens = min_tokens: it cannot end by itself in time
SHORT = 200  # the others run to their end, so the engine is busy all along
CANCEL_AFTER = (0, 1, 4, 16, 60)  # output tokens a client sees before it goes; 0: before any
IDLE_DEADLINE_S = 60.0
OUTPUTS = ["text_output", "num_output_tokens"]


@dataclass
class Tally:
    """One round's client side."""

    normal: int = 0
    left: dict[str, int] = field(default_factory=dict)  # kind -> requests whose client went away
    seen_by_left: int = 0  # output tokens those clients saw
    errors: list[str] = field(default_factory=list)


def kind_of(i: int) -> str:
    if i % 16 == 1:
        return "kill"  # the client process is SIGKILLed mid-stream
    if i % 16 == 9:
        return "drop"  # the client closes its channel under the stream
    return "cancel" if i % 3 == 0 else "normal"


def stop_after_of(i: int) -> int:
    return CANCEL_AFTER[(i // 3) % len(CANCEL_AFTER)]


def _count(response: Any) -> int | None:
    from tritonclient.grpc import InferResult

    if not any(out.name == "num_output_tokens" for out in response.infer_response.outputs):
        return None
    return int(InferResult(response.infer_response).as_numpy("num_output_tokens").reshape(-1)[0])


def _request(i: int, budget: int, tag: str) -> Any:
    inputs = text_inputs(f"chaos stream {i} of the round " * 4, budget, True, min_tokens=budget,
                         return_num_output_tokens=True)
    return stream_request("ensemble", inputs, f"{tag}{i}", OUTPUTS)


async def _read(call: Any, stop_after: int | None, tally: Tally) -> int:
    """Reads the stream until its final response, an error, or stop_after tokens; returns those seen."""
    seen = 0
    async for response in call:
        if response.error_message:
            tally.errors.append(response.error_message)
            break
        seen = _count(response) or seen
        final = response.infer_response.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
        if stop_after is not None and seen >= stop_after:
            break
    return seen


async def in_process_stream(url: str, shared: tuple[Any, Any], i: int, kind: str, tally: Tally) -> None:
    """normal / cancel (call.cancel()) / drop (its own channel closed under the stream)."""
    channel, stub = aio_channel(url) if kind == "drop" else shared
    request = _request(i, SHORT if kind == "normal" else LONG, kind[0])
    done = asyncio.Event()

    async def requests() -> AsyncIterator[Any]:
        yield request
        await done.wait()

    call = stub.ModelStreamInfer(requests())
    try:
        stop_after = None if kind == "normal" else stop_after_of(i)
        seen = await _read(call, stop_after, tally) if stop_after != 0 else 0
        if kind == "normal":
            tally.normal += 1
            return
        tally.left[kind] = tally.left.get(kind, 0) + 1
        tally.seen_by_left += seen
        if kind == "cancel":
            call.cancel()
        else:
            await channel.close(None)
    finally:
        done.set()


async def killed_stream(url: str, i: int, tally: Tally) -> None:
    """A client process that prints each token count it sees; SIGKILLed once it has seen enough."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", MODULE, "--child", url, "--child-index", str(i),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    if proc.stdout is None:
        raise RuntimeError("the kill client's stdout is not a pipe")
    stop_after, seen = stop_after_of(i), 0
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), IDLE_DEADLINE_S)
            if not line:
                tally.errors.append(f"kill client {i} exited before it was killed")
                return
            word, _, value = line.decode().partition(" ")
            if word == "error":
                tally.errors.append(value.strip())
                return
            seen = int(value) if word == "seen" else seen
            if word in ("sent", "seen") and seen >= stop_after:
                break
        tally.left["kill"] = tally.left.get("kill", 0) + 1
        tally.seen_by_left += seen
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()


def child(url: str, i: int) -> None:
    """The killed client: one tritonclient.grpc stream; prints `sent`, then `seen N` per response."""
    import tritonclient.grpc as grpcclient

    def on_response(result: Any, error: Any) -> None:
        if error is not None:
            print(f"error {error}", flush=True)
        elif result is not None and result.as_numpy("num_output_tokens") is not None:
            print(f"seen {int(result.as_numpy('num_output_tokens').reshape(-1)[0])}", flush=True)

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    outputs = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]
    inputs = text_inputs(f"chaos stream {i} of the round " * 4, LONG, True, min_tokens=LONG,
                         return_num_output_tokens=True)
    client.async_stream_infer("ensemble", inputs, request_id=f"k{i}", outputs=outputs,
                              enable_empty_final_response=True)
    print("sent", flush=True)
    time.sleep(IDLE_DEADLINE_S * 10)  # until killed


async def one_round(url: str, streams: int) -> Tally:
    tally = Tally()
    shared = aio_channel(url)
    jobs = [killed_stream(url, i, tally) if kind_of(i) == "kill" else
            in_process_stream(url, shared, i, kind_of(i), tally) for i in range(streams)]
    await asyncio.gather(*jobs)
    await shared[0].close(None)
    return tally


def idle_stats(engine_stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The engine's stats once nothing is in flight and no block is held (polled to a deadline)."""
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while True:
        stats = engine_stats()
        if stats["in_flight"] == 0 and stats["used_num_blocks"] == 0 and stats["active_requests"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not go idle within {IDLE_DEADLINE_S}s: {stats}")
        time.sleep(0.05)


def round_line(n: int, tally: Tally, before: dict[str, Any], after: dict[str, Any]) -> tuple[str, bool]:
    d = {k: after["finished"][k] - before["finished"][k] for k in after["finished"]}
    gen = after["generation_tokens"] - before["generation_tokens"]
    left = sum(tally.left.values())
    ran_on = d["length"] - tally.normal  # abandoned requests that ran to their max_tokens
    extra = (gen - tally.normal * SHORT - tally.seen_by_left) / max(1, left)
    steps = after["iteration_counter"] - before["iteration_counter"]
    ok = ran_on == 0 and not tally.errors and d["error"] == 0
    line = (f"round {n}: {left} left ({tally.left}), {ran_on} ran on to max_tokens, "
            f"aborted {d['aborted']}, length {d['length']} (normal {tally.normal}), "
            f"{extra:.0f} tokens/left request beyond those seen, {steps} steps, errors {len(tally.errors)}")
    return line, ok


def run_rounds(server: chaos.Server, rounds: int, streams: int) -> int:
    """Each round's line printed; the number of rounds that failed."""
    failed = 0
    before = idle_stats(server.stats)
    for n in range(1, rounds + 1):
        tally = asyncio.run(one_round(server.url, streams))
        after = idle_stats(server.stats)
        line, ok = round_line(n, tally, before, after)
        print(line + ("" if ok else f"  FAIL {tally.errors[:3]}"), flush=True)
        failed += not ok
        before = after
    return failed


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path), default=None,
              help="engine dir (default: build the tiny test engine under --work)")
@click.option("--work", type=click.Path(path_type=Path), default=ROOT / "build" / "chaos", show_default=True)
@click.option("--rounds", default=4, show_default=True)
@click.option("--streams", default=64, show_default=True)
@click.option("--child", "child_url", default=None, hidden=True)
@click.option("--child-index", default=0, hidden=True)
def main(engine_dir: Path | None, work: Path, rounds: int, streams: int, child_url: str | None,
         child_index: int) -> None:
    """Cancels on the gRPC path under chaos (issue 37, item 7): every abandoned stream aborted in the engine."""
    if child_url is not None:
        child(child_url, child_index)
        return
    work.mkdir(parents=True, exist_ok=True)
    server = chaos.start(engine_dir or chaos.tiny_engine(work), work)
    failed = rounds
    try:
        failed = run_rounds(server, rounds, streams)
    finally:
        chaos.stop(server, chaos.Report())
        print(f"server log: {server.log}")
    print(f"chaos_cancel: {'ok' if not failed else f'{failed} of {rounds} rounds FAILED'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
