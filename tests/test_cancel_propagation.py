"""A client that cancels or disconnects stops its request at once, on both interfaces (issue 22, item 8).

Measured with the engine's own counts, not with sleeps: its finished requests by reason (none of
the cancelled ones may end by `length`), the tokens it generated for them beyond those their
client had seen, its blocks in use and requests in flight (back to 0), and tritonserver's thread
count (flat over the rounds after a warm-up).

What was found: the stub's reader relayed the engine's step frames one at a time, each token an
IPC send, and under 64 streams on 2 cores it fell seconds behind the engine, so a client that
cancelled after the tokens it had seen cancelled a request the engine had run much further, or
to max_tokens (0-4 of 25 per round at max_tokens 400; 150 tokens per cancelled request beyond
those its client saw at max_tokens 1200). The reader now merges the frames it reads together
when it is behind (serve/wire/engine_client.py, `coalesce`): 9-40 tokens per cancelled request,
which is the client's own lag plus a step or two.

The cancelled requests ask for LONG tokens, far more than any lag of the client (it runs on the
same loaded cores) can hide: one that still ends by `length` was not stopped by its cancel.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import make_engine, make_hf_model
from serve_fixtures import Served

from trtprompt.client import aio_channel, stream_request, text_inputs
from trtprompt.engine.loop import EngineLoop
from trtprompt.engine.request import SamplingParams
from trtprompt.serve.engine_process.server import EngineService, _Server
from trtprompt.serve.launch.process_group import descendants
from trtprompt.serve.wire.engine_client import BEHIND_S, EngineClient
from trtprompt.serve.wire.requests import TokenRequest

STREAMS = 64
ROUNDS = 4
LONG = 1200  # the cancelled requests' max_tokens = min_tokens: they cannot end by themselves in time
SHORT = 200  # the others run to the end (so the engine is busy all along)
CANCEL_AFTER = (0, 1, 4, 16, 60)  # output tokens seen before cancelling; 0: before any response
# Tokens a cancelled request makes beyond those its client saw, in the median round: one engine
# step plus the fixture's 20 ms check period is a few; the rest is how far the client's view lags
# the engine (the relay's lag, bounded by coalescing, and the client's own on shared cores).
# Measured on 2 loaded cores: 9-67 per round with coalescing, 19-151 (mean 96) without (Xeon); on a
# Zen 3 EPYC 13-65 per round with one round in four sometimes at 116-182 (the host stalls), so a
# mean over 4 rounds failed CI once (51, 56, 61, 116); without coalescing there 35-354 a round. The
# median round is the client's usual lag: a bound against a gross lag, not the regression's detector
# (it caught one of three runs without coalescing); the mechanisms are pinned exactly by the two tests
# at the end of this file.
MEDIAN_EXTRA_TOKENS = 100
IDLE_DEADLINE_S = 20.0
WARMUP_ROUNDS = 1
CANCEL_STEPS = 8  # engine steps from a cancellation to its abort, reader held (measured: 2-3)


@dataclass
class Tally:
    """One round's client side: what each kind of request did and the tokens its client saw."""

    normal: int = 0
    cancelled: int = 0
    seen_by_cancelled: int = 0
    errors: list[str] = field(default_factory=list)


def _kind(i: int) -> str:
    if i % 16 == 1:
        return "drop"  # the client closes its channel under the stream
    return "cancel" if i % 3 == 0 else "normal"


def _last_count(response: Any) -> int | None:
    for out in response.infer_response.outputs:
        if out.name == "num_output_tokens":
            from tritonclient.grpc import InferResult

            return int(InferResult(response.infer_response).as_numpy("num_output_tokens").reshape(-1)[0])
    return None


async def _stream(stub: Any, channel: Any, i: int, kind: str, tally: Tally) -> None:
    budget = SHORT if kind == "normal" else LONG
    inputs = text_inputs(f"stream {i} of the round " * 4, budget, True, min_tokens=budget,
                         return_num_output_tokens=True)
    request = stream_request("ensemble", inputs, f"c{i}", ["text_output", "num_output_tokens"])
    stop_after = CANCEL_AFTER[(i // 3) % len(CANCEL_AFTER)] if kind != "normal" else None
    done = asyncio.Event()

    async def requests() -> Any:
        yield request
        await done.wait()

    call = stub.ModelStreamInfer(requests())
    seen = 0
    try:
        if stop_after != 0:
            async for response in call:
                if response.error_message:
                    tally.errors.append(response.error_message)
                    break
                seen = _last_count(response) or seen
                final = response.infer_response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
                if stop_after is not None and seen >= stop_after:  # tokens, not responses: one may carry several
                    break
        if kind == "normal":
            tally.normal += 1
            return
        tally.cancelled += 1
        tally.seen_by_cancelled += seen
        if kind == "cancel":
            call.cancel()
        else:
            await channel.close(None)
    finally:
        done.set()


async def _round(url: str) -> Tally:
    tally = Tally()
    channel, stub = aio_channel(url)
    own = [aio_channel(url) if _kind(i) == "drop" else (channel, stub) for i in range(STREAMS)]
    await asyncio.gather(*(_stream(own[i][1], own[i][0], i, _kind(i), tally) for i in range(STREAMS)))
    await channel.close(None)
    return tally


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for pid {pid}")


def _tritonserver(served: Served) -> int:
    for pid in descendants(served.proc.pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver":
                return pid
        except OSError:
            continue
    raise AssertionError("no tritonserver among the server's processes")


def _idle(served: Served, deadline_s: float = IDLE_DEADLINE_S) -> dict[str, Any]:
    """The engine's stats once nothing is in flight and no block is held (polled to a deadline)."""
    t0 = time.monotonic()
    while True:
        stats = served.engine_stats()
        if stats["in_flight"] == 0 and stats["used_num_blocks"] == 0 and stats["active_requests"] == 0:
            return stats
        assert time.monotonic() - t0 < deadline_s, f"the engine did not go idle within {deadline_s}s: {stats}"
        time.sleep(0.02)


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    counts = {k: after["finished"][k] - before["finished"][k] for k in after["finished"]}
    counts["generation_tokens"] = after["generation_tokens"] - before["generation_tokens"]
    return counts


@pytest.mark.server
def test_grpc_cancels_and_disconnects_stop_their_requests(served: Served) -> None:
    triton = _tritonserver(served)
    threads, extras = [], []
    before = _idle(served)
    for _ in range(ROUNDS):
        tally = asyncio.run(_round(served.url))
        after = _idle(served)
        d = _delta(after, before)
        before = after
        assert not tally.errors, tally.errors
        # Every normal request ran to its end; no cancelled one did.
        assert d["length"] == tally.normal, (d, tally)
        assert d["aborted"] <= tally.cancelled and d["error"] == 0 and d["rejected_queue_full"] == 0, (d, tally)
        extra = d["generation_tokens"] - tally.normal * SHORT - tally.seen_by_cancelled
        extras.append(extra / tally.cancelled)
        threads.append(_threads(triton))
    median = sorted(extras)[len(extras) // 2]  # the upper median: two bad rounds of four fail
    assert median <= MEDIAN_EXTRA_TOKENS, f"tokens per cancelled request beyond those seen: {extras}"
    steady = threads[WARMUP_ROUNDS:]
    # Flat: the leak grew 3 threads per round (98 -> 101). gRPC may start one more pool thread late
    # (seen once: 98, 98, 98, 99), so one thread over the first steady round is allowed, no more.
    assert max(steady) - steady[0] <= 1, f"tritonserver's threads after each round: {threads}"
    served.assert_healthy()


async def _openai_stream(port: int, model: str, i: int, stop_after: int) -> None:
    """One streamed completion whose client reads stop_after events, then drops the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": model, "prompt": f"openai stream {i} " * 4, "max_tokens": LONG,
                       "min_tokens": LONG, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    events = 0
    while events < stop_after:
        line = await asyncio.wait_for(reader.readline(), 60)
        assert line, "the front end closed the stream"
        if line.startswith(b"data: {"):
            events += 1
    writer.close()  # the client goes away mid-stream
    await writer.wait_closed()


def _aborted(served: Served, before: dict[str, Any], n: int, deadline_s: float = IDLE_DEADLINE_S) -> None:
    """Polls until the engine has counted n more aborted requests (to a deadline)."""
    t0 = time.monotonic()
    while _delta(served.engine_stats(), before)["aborted"] < n:
        assert time.monotonic() - t0 < deadline_s, f"not {n} aborted within {deadline_s}s"
        time.sleep(0.005)


@pytest.mark.server
def test_openai_disconnects_stop_their_requests(served: Served) -> None:
    assert served.openai is not None
    n, stop_after = 16, 3
    before = _idle(served)

    async def run() -> None:
        await asyncio.gather(*(_openai_stream(served.openai, served.engine_dir.name, i, stop_after) for i in range(n)))

    asyncio.run(run())
    _aborted(served, before, n)
    d = _delta(_idle(served), before)
    assert d["length"] == 0 and d["aborted"] == n, d
    # Measured: 8-50 tokens per request (the 3 events' tokens and the front end's and client's lag).
    assert d["generation_tokens"] <= n * LONG // 2, d  # none ran far past the tokens it had sent
    served.assert_healthy()


def _relay(client: EngineClient, prompts: list[tuple[int, ...]], n: int,
           hold: Any = None) -> dict[int, list[dict[str, Any]]]:
    """Every request's handler calls; hold(): run inside the first call (holds the reader up)."""
    calls: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(prompts))}
    finals = threading.Semaphore(0)

    def handler(i: int, entry: dict[str, Any]) -> None:
        if hold is not None and not any(calls.values()):
            hold()
        calls[i].append(entry)
        if entry["finished"]:
            finals.release()

    for i, p in enumerate(prompts):
        client.submit(TokenRequest(p, SamplingParams(max_tokens=n, min_tokens=n), stream=True),
                      lambda e, i=i: handler(i, e))
    for _ in prompts:
        assert finals.acquire(timeout=IDLE_DEADLINE_S), "a request got no final entry"
    return calls


def test_a_reader_behind_the_engine_merges_its_frames_and_loses_no_token(tmp_path: Path) -> None:
    """The relay's fix, on a real engine: a reader held up (as a stub whose IPC sends are slow is)
    gets each request's piled-up tokens in one call, all of them, in order, the final entry last;
    the reference is the same requests read in step (one call per token)."""
    loop = EngineLoop(make_engine(make_hf_model(tmp_path / "hf", "llama"), max_batch_size=8))
    loop.start()
    server = _Server(str(tmp_path / "engine.sock"), EngineService(loop))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    prompts, n = [tuple(range(3 + i, 15 + i)) for i in range(4)], 40

    def hold() -> None:  # until every frame is queued, and older than BEHIND_S
        deadline = time.monotonic() + IDLE_DEADLINE_S
        while loop.num_in_flight():
            assert time.monotonic() < deadline, "the engine did not finish"
            time.sleep(0.01)
        time.sleep(2 * BEHIND_S)

    client = EngineClient(server.server_address)
    try:
        in_step = _relay(client, prompts, n)
        behind = _relay(client, prompts, n, hold)
    finally:
        client.close()
        server.shutdown()
        loop.stop()
        server.server_close()
    for i in range(len(prompts)):
        tokens = [t for e in behind[i] for t in e["new_token_ids"]]
        assert tokens == [t for e in in_step[i] for t in e["new_token_ids"]] and len(tokens) == n
        assert len(in_step[i]) == n  # in step: one call per token
        assert len(behind[i]) <= 3, f"request {i}: {len(behind[i])} calls for {n} tokens (merged: 1 or 2)"
        assert [e["finished"] for e in behind[i]] == [False] * (len(behind[i]) - 1) + [True]
        assert behind[i][-1]["num_output_tokens"] == n and behind[i][-1]["finish_reason"] == "length"
        assert "stats" in behind[i][-1]


class _Victim:
    """A Watched request whose client goes away when the test says so (as Job's sender would tell)."""

    def __init__(self, client: EngineClient) -> None:
        self.client, self.rid, self.gone = client, "", threading.Event()

    def is_cancelled(self) -> bool:
        return self.gone.is_set()

    def cancel(self) -> None:
        self.client.abort([self.rid])


def _engine_stats(service: EngineService) -> dict[str, Any]:
    return service.stats(1 << 62)


def _wait_steps(service: EngineService, since: int, n: int) -> int:
    """The engine's iteration counter once it has made n steps past `since` (polled to a deadline)."""
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while (now := _engine_stats(service)["iteration_counter"]) < since + n:
        assert time.monotonic() < deadline, f"the engine made no {n} steps within {IDLE_DEADLINE_S}s"
        time.sleep(0.001)
    return now


def test_a_cancel_is_aborted_within_steps_while_the_reader_is_behind(tmp_path: Path) -> None:
    """Issue 37, item 7: a stub's reader busy relaying a backlog (its IPC sends slow on loaded
    cores) reads no step frame for as long as that takes. The watcher paced its sweeps on frames
    READ, so every cancellation waited up to its idle bound (0.5 s, hundreds of steps; in the
    chaos run some requests ran on to max_tokens after their client left). Paced also on frames
    waiting unread, it aborts the request within a few engine steps of the cancellation. The
    reader is held inside a handler for the whole test, as a slow send holds it."""
    from trtprompt.serve.triton_models.cancel_watch import watch_client
    from trtprompt.serve.wire.process import prefer_quick_thread_switches

    switch = sys.getswitchinterval()
    prefer_quick_thread_switches()  # as the stub and the engine process run
    loop = EngineLoop(make_engine(make_hf_model(tmp_path / "hf", "llama"), max_batch_size=8, max_seq_len=512))
    loop.start()
    service = EngineService(loop)
    server = _Server(str(tmp_path / "engine.sock"), service)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client, release, held = EngineClient(server.server_address), threading.Event(), threading.Event()
    watcher = watch_client(0.001, client)  # period 1 ms: what is left to measure is the pacing
    try:
        steps = _cancel_while_held(client, watcher, service, release, held)
    finally:
        release.set()
        watcher.stop()
        client.close()
        server.shutdown()
        loop.stop()
        server.server_close()
        sys.setswitchinterval(switch)
    finished = _engine_stats(service)["finished"]
    assert finished["length"] == 0 and finished["aborted"] == 2, finished
    # A step or two once the watcher sees it; the rest is the 1 ms period and thread wake-ups.
    # Paced on frames read alone: 150-480 steps (the 0.5 s idle bound), or max_tokens.
    assert steps <= CANCEL_STEPS, f"aborted {steps} engine steps after its client went away"



def _cancel_while_held(client: EngineClient, watcher: Any, service: EngineService,
                       release: threading.Event, held: threading.Event) -> int:
    """Holds the reader in the blocker's first entry, cancels the victim meanwhile; the engine
    steps from that cancellation until the victim is aborted."""
    def blocker(entry: dict[str, Any]) -> None:
        if not held.is_set():
            held.set()
            release.wait(IDLE_DEADLINE_S)

    params = SamplingParams(max_tokens=480, min_tokens=480)
    victim = _Victim(client)
    victim.rid = client.submit(TokenRequest(tuple(range(3, 15)), params, stream=True), lambda e: None)
    watcher.add(victim)
    blocker_rid = client.submit(TokenRequest(tuple(range(20, 32)), params, stream=True), blocker)
    assert held.wait(IDLE_DEADLINE_S), "the blocker got no output"
    start = _wait_steps(service, _engine_stats(service)["iteration_counter"], 5)  # frames pile up unread
    assert client.behind(), "the held reader left no step frame unread"
    victim.gone.set()
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while sum((stats := _engine_stats(service))["finished"][k] for k in ("aborted", "length")) < 1:
        assert time.monotonic() < deadline, f"the victim did not end within {IDLE_DEADLINE_S}s: {stats}"
        time.sleep(0.0005)
    steps = int(stats["iteration_counter"]) - start
    client.abort([blocker_rid])
    # The abort is a message the engine takes on its own thread: stopping the loop before it lands left the
    # blocker unfinished in one run (finished aborted 1, not 2).
    while _engine_stats(service)["finished"]["aborted"] < 2:
        assert time.monotonic() < deadline, "the blocker's abort did not land"
        time.sleep(0.005)
    return steps
