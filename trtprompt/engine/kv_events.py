"""KV events: the pool's block stored / removed / cleared changes, published in vLLM's wire format.

A KV-aware router (Dynamo's KV indexer, llm-d's precise prefix scorer) subscribes to each engine's
ZMQ PUB socket and keeps its own index of which blocks each engine holds. The format, the hash
mapping and how to point a router at it: docs/kv-events.md.

The step loop never does socket I/O: the recorder (a pool listener, engine/pool_events.py) appends
plain tuples while the pool changes, the engine hands one batch per step to a bounded queue, and a
publisher thread encodes and sends it. A full queue drops the batch (counted) and the next batch
starts with AllBlocksCleared, so a consumer that missed events forgets this engine's blocks rather
than keep ones the pool no longer has. pyzmq and msgpack are imported only when events are on.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.engine.eviction import Block, BlockHash
from trtprompt.engine.pool_events import BlockContent
from trtprompt.knobs import KNOBS

log = logging.getLogger(__name__)

__all__ = ["KV_EVENT_COUNTS", "KV_EVENT_KNOBS", "KvEventRecorder", "KvEventsConfig", "KvEventPublisher", "encode_batch",
           "external_hash", "kv_events_config", "lora_id", "offset_endpoint", "parse_endpoint"]

KV_EVENT_KNOBS: tuple[str, ...] = ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic",
                                   "kv_events_layout")
LAYOUTS: tuple[str, ...] = tuple(KNOBS["kv_events_layout"].choices or ())
# vLLM's medium for the engine's own KV pool (its "CPU" means an offload tier to consumers: Dynamo
# files it as host memory). This pool is the engine's primary one, wherever its memory lives.
MEDIUM = "GPU"
# What counts() reports (each `kv_events_` + name in the engine's stats reply; 0 with events off).
KV_EVENT_COUNTS: tuple[str, ...] = ("published_batches", "published_events", "dropped_batches", "dropped_events",
                                    "replay_requests")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay marker (vLLM's)

# One pending event: ("stored", hashes, parent, token_ids, salt, lora_name) | ("removed", hashes) | ("cleared",).
Event = tuple[Any, ...]


def lora_id(name: str | None) -> int | None:
    """A BlockStored's lora_id for the adapter `name` (None: the base model): a positive int32 from the name's
    blake2b digest, the same in every process and replica. vLLM sends its own LoRARequest's integer id there
    (positive, chosen per server), which trtprompt adapters do not have: they are known by name, and
    lora_name carries it (docs/kv-events.md, "LoRA adapters")."""
    if name is None:
        return None
    value = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=4).digest(), "big") & 0x7FFFFFFF
    return value or 1


def external_hash(block_hash: BlockHash) -> int:
    """A block hash as the events carry it: its last 8 bytes, big-endian, unsigned 64-bit.

    vLLM's own rule for its byte hashes (maybe_convert_block_hash); the pool's 16-byte chained,
    salted blake2b digests (block_pool.hash_block) keep 64 of their bits."""
    return int.from_bytes(block_hash[-8:], "big")


def first_sequence() -> int:
    """The first batch's sequence number: this process's start in microseconds since the epoch.

    Consumers drop a batch numbered at or below the last one they saw (Dynamo's indexer does), so a
    restarted engine process must go on above its predecessor rather than start again at 0."""
    return time.time_ns() // 1000


def parse_endpoint(value: str) -> str:
    """A ZMQ endpoint to bind: tcp://HOST:PORT or ipc://PATH; a bare port is tcp://127.0.0.1:PORT."""
    text = value.strip()
    if text.isdigit():
        port = int(text)
        if not 0 < port < 65536:
            raise ValueError(f"kv events port must be in [1, 65535], got {port}")
        return f"tcp://127.0.0.1:{port}"
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    host, sep, port_text = text.removeprefix("tcp://").rpartition(":")
    if not text.startswith("tcp://") or not sep or not host or not port_text.isdigit() \
            or not 0 < int(port_text) < 65536:
        raise ValueError(f"kv events endpoint must be tcp://HOST:PORT, ipc://PATH or a port, got {value!r}")
    return text


def offset_endpoint(endpoint: str, index: int) -> str:
    """The endpoint of replica index: the tcp port plus index, or the ipc path with a suffix
    (vLLM offsets its data-parallel ranks' endpoints the same way)."""
    endpoint = parse_endpoint(endpoint)  # a bare port too: it has no "host:" to keep
    if index == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_{index}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + index}"


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""  # the kv_events_topic knob unset: vLLM's default topic
    layout: str = KNOBS["kv_events_layout"].default
    queue_batches: int = 1024  # steps of events waiting for the publisher thread; more are dropped
    replay_batches: int = 10_000  # batches the replay socket can send again
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        KNOBS["kv_events_topic"].check(self.topic)
        KNOBS["kv_events_layout"].check(self.layout)
        object.__setattr__(self, "endpoint", parse_endpoint(self.endpoint))
        if self.replay_endpoint is not None:
            object.__setattr__(self, "replay_endpoint", parse_endpoint(self.replay_endpoint))
            if self.replay_endpoint == self.endpoint:
                raise ValueError(f"kv_events_replay_endpoint must differ from kv_events_endpoint "
                                 f"({self.endpoint})")
        for name in ("queue_batches", "replay_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")


def kv_events_config(overrides: Mapping[str, Any]) -> KvEventsConfig | None:
    """The engine's KV event settings from its runtime overrides (the knobs); None: events off."""
    endpoint = overrides.get("kv_events_endpoint")
    if endpoint is None:
        if overrides.get("kv_events_replay_endpoint") is not None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        return None
    return KvEventsConfig(endpoint, overrides.get("kv_events_replay_endpoint"),
                          overrides.get("kv_events_topic") or "",
                          overrides.get("kv_events_layout") or KNOBS["kv_events_layout"].default)


class KvEventRecorder:
    """The pool listener: what changed since the last take(), runs of one chain coalesced.

    Called inside the pool's operations (engine thread): list appends only."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self.skipped_blocks = 0  # stored without tokens: no consumer could index them

    def stored(self, block: Block, block_hash: BlockHash, content: BlockContent | None) -> None:
        if content is None:
            self.skipped_blocks += 1
            return
        h = external_hash(block_hash)
        parent = None if content.parent is None else external_hash(content.parent)
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "stored" and parent is not None and last[1][-1] == parent:
            last[1].append(h)  # the next block of the same chain: one BlockStored, as vLLM sends
            last[3].extend(content.token_ids)
        else:
            self._events.append(("stored", [h], parent, list(content.token_ids), content.salt, content.lora_name))

    def removed(self, block: Block, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "removed":
            last[1].append(external_hash(block_hash))
        else:
            self._events.append(("removed", [external_hash(block_hash)]))

    def cleared(self) -> None:
        self._events = [("cleared",)]  # what came before is void for every consumer

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def _event_map(event: Event, block_size: int) -> dict[str, Any]:
    """vLLM's tagged-map layout (vLLM since its PR 42892): fields by name, tag under "type"."""
    if event[0] == "stored":
        stored = {"type": "BlockStored", "block_hashes": event[1], "parent_block_hash": event[2],
                  "token_ids": event[3], "block_size": block_size, "lora_id": lora_id(event[5]), "medium": MEDIUM,
                  "lora_name": event[5]}
        if event[4] is not None:  # Dynamo's indexer keys salted chains apart by it; vLLM's decoder skips it
            stored["cache_salt"] = event[4]
        return stored
    if event[0] == "removed":
        return {"type": "BlockRemoved", "block_hashes": event[1], "medium": MEDIUM}
    return {"type": "AllBlocksCleared"}


def _event_array(event: Event, block_size: int) -> list[Any]:
    """vLLM's legacy positional layout (msgspec array_like): the tag, then the fields in order."""
    if event[0] == "stored":
        return ["BlockStored", event[1], event[2], event[3], block_size, lora_id(event[5]), MEDIUM, event[5]]
    if event[0] == "removed":
        return ["BlockRemoved", event[1], MEDIUM]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[Event], block_size: int, layout: str, rank: int) -> bytes:
    """One KVEventBatch: the positional [ts, events, data_parallel_rank] in either event layout."""
    import msgpack  # type: ignore[import-untyped]  # only with events on

    encode = _event_map if layout == "map" else _event_array
    return bytes(msgpack.packb([ts, [encode(e, block_size) for e in events], rank]))


class KvEventPublisher:
    """The recorder, the bounded queue and the publisher thread of one engine."""

    def __init__(self, config: KvEventsConfig, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self.recorder = KvEventRecorder()
        self._queue: queue.Queue[tuple[float, list[Event]] | None] = queue.Queue(config.queue_batches)
        self._must_clear = True  # every process starts with AllBlocksCleared: its predecessor's blocks are gone
        # Counted since this process started (the publisher thread writes published_* and replay_requests,
        # the engine thread the rest; each count has one writer). counts() reports them for /metrics.
        self.queued_batches = 0  # handed to the publisher thread; published_batches: sent by it
        self.published_batches = 0
        self.published_events = 0
        self.dropped_batches = 0
        self.dropped_events = 0
        self.replay_requests = 0
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._started.wait(10.0)
        if self._error is not None:
            raise ValueError(f"kv events: cannot bind {config.endpoint}: {self._error}") from self._error

    def flush(self) -> None:
        """Engine thread, once per step: queue what the pool did, never wait."""
        events = self.recorder.take()
        if not events:
            return
        if self._must_clear and events[0][0] != "cleared":
            events.insert(0, ("cleared",))
        try:
            self._queue.put_nowait((time.time(), events))
            self.queued_batches += 1
            self._must_clear = False
        except queue.Full:
            if not self.dropped_batches:
                log.warning("kv events: the publisher fell behind; dropping events (consumers get "
                            "AllBlocksCleared next)")
            self.dropped_batches += 1
            self.dropped_events += len(events)
            self._must_clear = True

    def counts(self) -> dict[str, int]:
        """The counters under their stats keys (metrics_catalog's KV_EVENT_COUNTERS read them)."""
        return {f"kv_events_{name}": getattr(self, name) for name in KV_EVENT_COUNTS}

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to timeout), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 500)
            pub.bind(self.config.endpoint)
            replay = None
            if self.config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._started.set()
            ctx.destroy(linger=0)
            return
        self._started.set()
        try:
            self._serve(pub, replay)
        finally:
            ctx.destroy(linger=500)

    def _serve(self, pub: Any, replay: Any) -> None:
        """Publish each batch as [topic, seq (8 bytes, big-endian), payload]; answer replays between."""
        topic = self.config.topic.encode("utf-8")
        sent: deque[tuple[int, bytes]] = deque(maxlen=self.config.replay_batches)
        seq = first_sequence()
        while True:
            if replay is not None and replay.poll(0):
                self._replay(replay, sent)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            payload = encode_batch(item[0], item[1], self.block_size, self.config.layout,
                                   self.config.data_parallel_rank)
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            sent.append((seq, payload))
            seq += 1
            self.published_batches += 1
            self.published_events += len(item[1])

    def _replay(self, replay: Any, sent: deque[tuple[int, bytes]]) -> None:
        """A replay request [identity, "", start seq]: every kept batch from start on, then END_SEQ."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: ignoring a malformed replay request of %d frame(s)", len(frames))
            return
        self.replay_requests += 1
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in sent:
            if seq >= start:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_SEQ, b""))
