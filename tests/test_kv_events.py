"""KV events (engine/kv_events.py, docs/kv-events.md): the tiny engine's pool changes, received on a
real ZMQ SUB socket and decoded, and read by a real consumer, Dynamo's standalone KV indexer (PyPI
ai-dynamo-runtime), whose overlap for each prompt must equal the engine's own prefix lookup."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import torch
import zmq
from engine_helpers import EOS, make_engine, make_hf_model, run_to_completion

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.engine.kv_cache import extend_block_hashes
from trtprompt.engine.kv_events import (
    END_SEQ,
    KvEventsConfig,
    external_hash,
    kv_events_config,
    offset_endpoint,
    parse_endpoint,
)
from trtprompt.engine.model import load_model_from_safetensors
from trtprompt.engine.request import SamplingParams
from trtprompt.report import inspect_data, inspect_text
from trtprompt.serve.engine_process.server import engine_overrides
from trtprompt.serve.launch.options import ServeOptions, check_engine_allows
from trtprompt.serve.launch.repository import kv_event_parameters

TPB = 4
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(path: Path, events: KvEventsConfig, kv_tokens: int) -> LLMEngine:
    """The tiny engine of engine_helpers.make_engine, publishing KV events."""
    base = make_engine(path, kv_tokens=kv_tokens, tokens_per_block=TPB, max_batch_size=2,
                       eviction_policy="lru", attention_backend="torch")
    base.close()
    config = dataclasses.replace(base.config, kv_events=events)
    model = load_model_from_safetensors(path / "model.safetensors", config.model, torch.float32,
                                        torch.device("cpu"), config.linear_backend)
    return LLMEngine(config, model, [EOS])


def _engine_prefix(engine: LLMEngine, tokens: list[int]) -> int:
    """The engine's own lookup: leading full blocks of tokens whose hash the pool holds."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, TPB, None, len(tokens) // TPB)
    n = 0
    while n < len(hashes) and engine.kv.pool.lookup(hashes[n]) is not None:
        n += 1
    return n


def _poll(check: Callable[[], Any], what: str, deadline_s: float = 15.0) -> Any:
    """check()'s first truthy value, polled to a generous deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = check()
        if value or time.monotonic() > end:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.02)


def _prompts(seed: int, n: int, shared: int) -> dict[str, list[int]]:
    """n prompts of 3-4 blocks and 1-3 extra tokens, the first `shared` blocks common to all."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 250, (shared * TPB,), generator=g).tolist()
    out = {}
    for i in range(n):
        tail = torch.randint(3, 250, ((3 + i % 2 - shared) * TPB + 1 + i % 3,), generator=g).tolist()
        out[f"s{seed}-{i}"] = head + tail
    return out


def test_hash_mapping_endpoints_and_knobs() -> None:
    digest = bytes(range(16))
    assert external_hash(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)  # vLLM's rule
    assert parse_endpoint("5557") == "tcp://127.0.0.1:5557"
    assert parse_endpoint("tcp://*:5557") == "tcp://*:5557" and parse_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    for bad in ("tcp://host", "http://h:1", "70000", "tcp://:5557"):
        with pytest.raises(ValueError, match="kv events"):
            parse_endpoint(bad)
    assert kv_events_config({}) is None
    cfg = kv_events_config({"kv_events_endpoint": "5557", "kv_events_layout": "array"})
    assert cfg == KvEventsConfig("tcp://127.0.0.1:5557", layout="array")
    with pytest.raises(ValueError, match="kv_events_layout must be one of map, array"):
        KvEventsConfig("5557", layout="json")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        kv_events_config({"kv_events_replay_endpoint": "5558"})


def test_serve_options_reach_the_engine_as_its_config() -> None:
    """serve's options -> the tensorrt_llm model's parameters (strings) -> the engine process's overrides."""
    opts = ServeOptions(kv_events_endpoint="5557", kv_events_replay_endpoint="tcp://127.0.0.1:5558",
                        kv_events_topic="kv@pod@tiny")
    params = {k: str(v) for k, v in kv_event_parameters(opts).items() if v is not None}
    assert kv_events_config(engine_overrides(params)) == KvEventsConfig(
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", topic="kv@pod@tiny", layout="map")
    assert kv_event_parameters(ServeOptions()) == {}  # off by default


def test_inspect_shows_the_kv_event_options_and_the_router_block_size(tiny_engine_dir: Path) -> None:
    engine = read_engine_dir(tiny_engine_dir)
    shown = inspect_data(engine)["kv_events"]
    assert shown == {"kv_events_endpoint": None, "kv_events_replay_endpoint": None, "kv_events_topic": None,
                     "kv_events_layout": "map", "router_block_size": engine.tokens_per_block}
    assert "KV events (serve options, defaults)" in inspect_text(engine)
    port = _free_port()  # the engine process's path: its parameters become from_engine_dir's overrides
    loaded = LLMEngine.from_engine_dir(tiny_engine_dir, kv_events_endpoint=str(port), kv_events_layout="array")
    try:
        assert loaded.kv_events is not None and loaded.kv_events.config == KvEventsConfig(
            f"tcp://127.0.0.1:{port}", layout="array")
        assert loaded.kv.pool.listeners == [loaded.kv_events.recorder]
    finally:
        loaded.close()
    assert LLMEngine.from_engine_dir(tiny_engine_dir).kv_events is None  # off by default
    check_engine_allows(engine, ServeOptions(replicas=2, kv_events_endpoint="5557",
                                             kv_events_replay_endpoint="5567"))  # replica i: ports + i
    with pytest.raises(ValueError, match=r"with 2 replicas the KV event endpoints tcp://127.0.0.1:5557..tcp"
                                         r"://127.0.0.1:5558 and the replay endpoints .* overlap"):
        check_engine_allows(engine, ServeOptions(replicas=2, kv_events_endpoint="5557",
                                                 kv_events_replay_endpoint="5558"))
    with pytest.raises(ValueError, match="kv events endpoint must be"):
        check_engine_allows(engine, ServeOptions(kv_events_endpoint="localhost"))


def _recv(sub: zmq.Socket[bytes], timeout_ms: int) -> tuple[bytes, int, list[Any]] | None:
    if not sub.poll(timeout_ms):
        return None
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        out.append((int.from_bytes(seq, "big"), payload))
    dealer.close(0)
    return out


def test_sub_socket_decodes_vllm_batches_and_replay_resends_them(hf_path: Path) -> None:
    port = _free_port()
    cfg = KvEventsConfig(str(port), f"tcp://127.0.0.1:{_free_port()}", topic="kv@test@tiny")
    engine = _engine(hf_path, cfg, kv_tokens=12 * TPB)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(cfg.endpoint)
    try:
        # A subscription reaches the PUB socket some time after connect: serve until one batch arrives.
        warm = iter(_prompts(1, 40, 0).items())
        first = _poll(lambda: run_to_completion(engine, dict([next(warm)]), GREEDY) and _recv(sub, 100),
                      "the first batch on the SUB socket")
        live = {first[1]: first[2]}
        assert first[0] == b"kv@test@tiny"
        run_to_completion(engine, _prompts(2, 6, 2), GREEDY)  # fills the 12-block pool: evictions
        assert engine.kv_events is not None
        count = engine.kv_events.queued_batches
        _poll(lambda: engine.kv_events is not None and engine.kv_events.published_batches == count, "the publisher")
        replayed = _replay(ctx, str(cfg.replay_endpoint), 0)
        base = replayed[0][0]
        assert [s for s, _ in replayed] == list(range(base, base + count))  # numbered on from the first
        while base + count - 1 not in live:
            got = _poll(lambda: _recv(sub, 100), f"batch {base + count - 1}")
            live[got[1]] = got[2]
        batches = [msgpack.unpackb(p) for _, p in replayed]
        assert all(batches[s - base] == b for s, b in live.items())  # live and replayed frames agree
        held = _apply(batches)
        assert held == {external_hash(h) for h in engine.kv.pool.cached}
        assert batches[0][1][0] == {"type": "AllBlocksCleared"}  # a process starts by voiding its past
        kinds = {e["type"] for b in batches for e in b[1]}
        assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
        assert engine.kv_events is not None and engine.kv_events.dropped_batches == 0
    finally:
        sub.close(0)
        ctx.term()
        engine.close()


def _apply(batches: list[list[Any]]) -> set[int]:
    """A minimal consumer: check each batch's shape, track the hashes the engine holds."""
    held: set[int] = set()
    for ts, events, rank in batches:
        assert isinstance(ts, float) and rank == 0
        for e in events:
            if e["type"] == "BlockStored":
                assert e["block_size"] == TPB and e["medium"] == "GPU" and e["lora_id"] is None
                assert len(e["token_ids"]) == TPB * len(e["block_hashes"])
                assert e["parent_block_hash"] is None or e["parent_block_hash"] in held
                held.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                assert set(e["block_hashes"]) <= held
                held.difference_update(e["block_hashes"])
            else:
                held.clear()
    return held


class DynamoIndexer:
    """Dynamo's standalone KV indexer (python -m dynamo.indexer): it subscribes to a worker's ZMQ
    endpoint, asks its replay endpoint for what it missed, and answers /query with overlap scores."""

    def __init__(self) -> None:
        self.port = _free_port()
        env = dict(os.environ, DYN_LOG="warn")
        self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
                                      "--threads", "1"], env=env, stdout=subprocess.DEVNULL)
        _poll(self._healthy, "the Dynamo indexer's /health")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                return True
        except OSError:
            return False

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: {exc.code} {exc.read().decode()}") from exc
        return json.loads(text) if text else None

    def blocks(self, tokens: list[int], worker: int) -> int:
        """worker's overlap in blocks (the indexer scores matched tokens)."""
        scores = self.post("/query", {"model_name": "tiny", "token_ids": tokens})["scores"]
        return int(scores.get(str(worker), {}).get("0", 0)) // TPB


@pytest.fixture(scope="module")
def indexer() -> Iterator[DynamoIndexer]:
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime (the dev extras) is not installed")
    idx = DynamoIndexer()
    yield idx
    idx.proc.terminate()
    idx.proc.wait(10)


def _agree(indexer: DynamoIndexer, worker: int, engine: LLMEngine, probes: dict[str, list[int]],
           seed: int) -> dict[str, int]:
    """Poll until the indexer's overlap equals the engine's prefix lookup for every probe.

    A SUB socket misses what is published before its subscription lands (a reconnect after an engine
    restart too); the indexer sees the gap at the next batch and asks the replay socket for the rest.
    So, as live traffic would, a new one-block request is served whenever the two disagree for 0.5 s."""
    nudges = iter(_prompts(seed, 100, 0).items())
    end = time.monotonic() + 15.0
    nudged = time.monotonic()
    while True:
        want = {rid: _engine_prefix(engine, p) for rid, p in probes.items()}
        got = {rid: indexer.blocks(p, worker) for rid, p in probes.items()}
        if got == want or time.monotonic() > end:
            assert got == want
            return want
        if time.monotonic() - nudged > 0.5:
            rid, prompt = next(nudges)
            run_to_completion(engine, {rid: prompt[:TPB + 1]}, GREEDY)
            probes[rid] = prompt
            nudged = time.monotonic()
        time.sleep(0.05)


@pytest.mark.parametrize("layout", ["map", "array"])
def test_dynamo_indexer_overlap_equals_engine_prefix_lookup(hf_path: Path, indexer: DynamoIndexer,
                                                            layout: str) -> None:
    cfg = KvEventsConfig(f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}", layout=layout)
    worker = 1 + ["map", "array"].index(layout)
    indexer.post("/register", {"instance_id": worker, "endpoint": cfg.endpoint, "replay_endpoint": cfg.replay_endpoint,
                               "model_name": "tiny", "block_size": TPB})
    engine = _engine(hf_path, cfg, kv_tokens=14 * TPB)
    first = _prompts(3, 3, 2)
    probes = {**first, "miss": [7] * (4 * TPB)}
    try:
        run_to_completion(engine, first, GREEDY)  # stored: three prompts sharing two blocks
        stored = _agree(indexer, worker, engine, dict(probes), 10)
        assert max(stored.values()) >= 3 and stored["miss"] == 0
        second = _prompts(4, 6, 1)
        run_to_completion(engine, second, GREEDY)  # removed: the 14-block pool evicts the first prompts'
        evicted = _agree(indexer, worker, engine, {**probes, **second}, 11)
        assert engine.kv.pool.evicted_blocks > 0 and any(evicted[r] < stored[r] for r in first)
    finally:
        engine.close()
    # cleared: the next process on the endpoint starts with AllBlocksCleared (a restarted engine).
    engine = _engine(hf_path, cfg, kv_tokens=14 * TPB)
    try:
        run_to_completion(engine, dict(list(first.items())[:1]), GREEDY)
        after = _agree(indexer, worker, engine, {**probes, **second}, 12)
        assert after[next(iter(first))] > 0 and not any(after[r] for r in second)  # the old pool is forgotten
    finally:
        engine.close()
        indexer.post("/unregister", {"instance_id": worker, "model_name": "tiny"})


def test_a_salted_chain_carries_its_salt_in_the_map_layout_only() -> None:
    from trtprompt.engine.eviction import Block
    from trtprompt.engine.kv_events import KvEventRecorder, encode_batch
    from trtprompt.engine.pool_events import BlockContent

    rec = KvEventRecorder()
    pool_block = Block(0)
    rec.stored(pool_block, b"a" * 16, BlockContent(None, (1, 2), "tenant-a"))
    rec.stored(pool_block, b"b" * 16, BlockContent(b"a" * 16, (3, 4), "tenant-a"))  # same chain: one event
    rec.stored(pool_block, b"c" * 16, BlockContent(None, (1, 2)))
    events = rec.take()
    [_, decoded, _] = msgpack.unpackb(encode_batch(0.0, events, 2, "map", 0))
    assert [(e["token_ids"], e.get("cache_salt")) for e in decoded] == [([1, 2, 3, 4], "tenant-a"), ([1, 2], None)]
    assert "cache_salt" not in decoded[1]
    [_, positional, _] = msgpack.unpackb(encode_batch(0.0, events, 2, "array", 0))
    assert [len(e) for e in positional] == [8, 8]  # vLLM's positional BlockStored has no salt field


def test_an_adapters_chain_carries_its_name_and_a_stable_id_in_both_layouts() -> None:
    from trtprompt.engine.eviction import Block
    from trtprompt.engine.kv_events import KvEventRecorder, encode_batch, lora_id
    from trtprompt.engine.pool_events import BlockContent

    rec = KvEventRecorder()
    rec.stored(Block(0), b"a" * 16, BlockContent(None, (1, 2), lora_name="sql"))
    rec.stored(Block(0), b"b" * 16, BlockContent(b"a" * 16, (3, 4), lora_name="sql"))  # same chain: one event
    rec.stored(Block(0), b"c" * 16, BlockContent(None, (1, 2)))
    events = rec.take()
    [_, decoded, _] = msgpack.unpackb(encode_batch(0.0, events, 2, "map", 0))
    sql_id = lora_id("sql")
    assert [(e["token_ids"], e["lora_name"], e["lora_id"]) for e in decoded] == [([1, 2, 3, 4], "sql", sql_id),
                                                                                  ([1, 2], None, None)]
    [_, positional, _] = msgpack.unpackb(encode_batch(0.0, events, 2, "array", 0))
    assert [(e[5], e[7]) for e in positional] == [(sql_id, "sql"), (None, None)]  # lora_id, lora_name
    assert sql_id is not None and 0 < sql_id < 2**31 and lora_id("sql") == sql_id != lora_id("sql2")


@pytest.mark.parametrize("layout", ["map", "array"])
def test_dynamo_indexer_keeps_one_prompts_chains_under_two_adapters_apart(
        hf_path: Path, indexer: DynamoIndexer, layout: str, tmp_path: Path) -> None:
    """Dynamo's indexer hashes lora_name into its own block keys: a prompt served under adapter a overlaps
    for a only, not for b nor the base model, until each has served it too."""
    from lora_adapters import make_peft_adapter

    cfg = KvEventsConfig(f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}", layout=layout)
    worker = 3 + ["map", "array"].index(layout)
    indexer.post("/register", {"instance_id": worker, "endpoint": cfg.endpoint, "replay_endpoint": cfg.replay_endpoint,
                               "model_name": "tiny", "block_size": TPB})
    engine = _engine(hf_path, cfg, kv_tokens=40 * TPB)
    for name, seed in (("a", 1), ("b", 2)):
        engine.lora.load_dir(name, make_peft_adapter(hf_path, tmp_path / name, 4, ("q_proj", "v_proj"), seed))
    prompt = _prompts(20 + worker, 1, 0)["s" + str(20 + worker) + "-0"]
    full = len(prompt) // TPB

    def overlaps() -> dict[str | None, int]:
        return {lora: int(indexer.post("/query", {"model_name": "tiny", "token_ids": prompt, "lora_name": lora})[
            "scores"].get(str(worker), {}).get("0", 0)) // TPB for lora in ("a", "b", None)}

    def serve(rid: str, lora: str | None) -> None:
        engine.add_request(rid, prompt, GREEDY, None, lora=lora)
        while engine.has_unfinished_requests():
            engine.step()

    try:
        warm = _prompts(40 + worker, 1, 0)
        run_to_completion(engine, warm, GREEDY)
        _agree(indexer, worker, engine, dict(warm), 30 + worker)  # the subscription is live: later events arrive
        serve("under-a", "a")
        _poll(lambda: overlaps() == {"a": full, "b": 0, None: 0}, f"a's {full} blocks alone: {overlaps()}")
        serve("under-b", "b")
        serve("base", None)
        _poll(lambda: overlaps() == {"a": full, "b": full, None: full}, f"three chains: {overlaps()}")
        held = {external_hash(h) for h in engine.kv.pool.cached}
        chains = [[external_hash(h) for h in _hashes(prompt, lora, engine)] for lora in ("a", "b", None)]
        assert all(set(c) <= held for c in chains) and len(set().union(*map(set, chains))) == 3 * full
    finally:
        engine.close()
        indexer.post("/unregister", {"instance_id": worker, "model_name": "tiny"})


def _hashes(tokens: list[int], lora: str | None, engine: LLMEngine) -> list[bytes]:
    """The engine's own block hashes of tokens under an adapter (its cache key seeds the chain) or none."""
    hashes: list[bytes] = []
    key = None if lora is None else engine.lora.get(lora).cache_key
    extend_block_hashes(hashes, tokens, TPB, None, len(tokens) // TPB, key)
    return hashes
