"""The tiers as the KV manager sees them: save published blocks, load a waiting request's prefix.

Write path (off the step's critical path but for one copy): blocks the policy picks (every
newly published full block for write_through, a block at its first reuse for selective, a
block the pool evicts for write_back) are gathered once per step out of the pool into a private
buffer, so the pool may hand the block out again at once, and offered to each tier's writer
(writer.py), which drops what its bounded queue cannot hold. write_back hears evictions through
the pool's listener hook (engine/pool_events.py): the pool tells it before it hands the block
out, and the copy is taken before anything writes the block again (the step's flush runs
between scheduling and the forward pass; place() flushes before it fills fresh blocks). At a
clean close, write_back also writes the blocks still cached in the pool (docs/prefix-pool.md,
"Writes").

Read path: when a request's prefix stops at a pool miss, its next block keys go to the loader
thread (loader.py); the request waits outside the scheduler's queue while others step. The
verified blocks are then copied into freshly allocated pool blocks and published there, so the
scheduler's next lookup finds them as ordinary cached blocks: cached_tokens and the per-request
KV statistics count them as reused. `TierStats` splits those hits by tier.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from trtprompt.engine.block_pool import Block, BlockPool
from trtprompt.engine.eviction import BlockHash
from trtprompt.engine.pool_events import BlockContent
from trtprompt.engine.tiers.codec import Payload
from trtprompt.engine.tiers.fingerprint import KvLayout
from trtprompt.engine.tiers.keys import tier_key
from trtprompt.engine.tiers.loader import LoadJob, LoadResult, TierLoader
from trtprompt.engine.tiers.store import BlockStore
from trtprompt.engine.tiers.writer import DEFAULT_QUEUE_BLOCKS, TierWriter

log = logging.getLogger(__name__)

KvCache = tuple[torch.Tensor, torch.Tensor]
# Keys written (or queued) recently, so a block is not written twice; bounded, oldest forgotten first.
SAVED_KEYS_KEPT = 1 << 16
# write_back at a clean close: the pool's cached blocks are copied out this many at a time (bounds the
# copies' memory) and queued until this deadline; the engine process gets 10 s to stop (serve/launch).
CLOSE_CHUNK_BLOCKS = 64
CLOSE_WRITE_S = 5.0


@dataclass(frozen=True)
class TierSnapshot:
    """One tier's figures for the engine's statistics (docs/prefix-pool.md, "What users see")."""

    name: str
    hit_blocks: int  # blocks loaded from this tier into the pool and then reused by a request
    loaded_blocks: int  # blocks loaded from this tier into the pool
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    drops: int  # writes not done: queue full, store full or down
    evictions: int
    errors: int
    corrupt: int  # entries that failed verification (each also a miss, and reclaimed)


@dataclass
class _Loading:
    """A request waiting for its blocks, with where its prefix stood when it left the queue."""

    num_hits: int
    hashes: list[bytes]


@dataclass
class TierStats:
    hit_blocks: dict[str, int] = field(default_factory=dict)
    loaded_blocks: dict[str, int] = field(default_factory=dict)
    load_seconds: list[float] = field(default_factory=list)  # recent loads' latency (kept bounded)


class KvTiers:
    """The tiers of one engine: their writers, the loader, and the copies in and out of the pool."""

    def __init__(self, stores: Sequence[BlockStore], fingerprint: bytes, layout: KvLayout,
                 caches: list[KvCache], write_policy: str = "write_through",
                 queue_blocks: int = DEFAULT_QUEUE_BLOCKS, pool: BlockPool | None = None) -> None:
        """pool: the engine's, needed by write_back (its evictions, and what it holds at close)."""
        if not stores:
            raise ValueError("KvTiers needs at least one store")
        if any(k.device.type != "cpu" for kv in caches for k in kv):
            raise ValueError("the KV tiers need the KV cache in host memory (device cpu)")
        self.stores = list(stores)
        self.fingerprint = fingerprint
        self.layout = layout
        if write_policy == "write_back" and pool is None:
            raise ValueError("write_policy write_back needs the pool, whose evictions it writes")
        self.write_policy = write_policy
        self._pool = pool
        # uint8 views of each layer's K and V, [blocks, kv_heads, tokens_per_block, head_size * dtype bytes]
        self._bytes = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in caches]
        self.writers = [TierWriter(s, queue_blocks) for s in self.stores]
        self.loader = TierLoader(self.stores, layout.block_bytes)
        self.stats = TierStats(dict.fromkeys(self.names, 0), dict.fromkeys(self.names, 0))
        self._pending: list[tuple[int, bytes]] = []  # (block id, block hash) to save after this step
        self._saved: OrderedDict[bytes, None] = OrderedDict()
        self._loading: dict[str, _Loading] = {}
        self._fresh: dict[int, tuple[str, bytes]] = {}  # block id -> (tier, hash): loaded, not reused yet
        self.problems: dict[str, str] = {}  # tier -> what its probe at start found wrong (open.py)
        if pool is not None and write_policy == "write_back":
            pool.add_listener(self)  # other policies leave the pool's listener list alone: no cost

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stores]

    def key(self, block_hash: bytes) -> bytes:
        return tier_key(self.fingerprint, block_hash)

    # -- write path -------------------------------------------------------------------

    def published(self, block: Block) -> None:
        """A block of KV just computed and published in the pool."""
        if self.write_policy == "write_through":
            self._want(block)

    def reused(self, blocks: Sequence[Block]) -> None:
        """Blocks a request is about to reuse from the pool."""
        for block in blocks:
            fresh = self._fresh.pop(block.block_id, None)
            if fresh is not None and fresh[1] == block.block_hash:
                self.stats.hit_blocks[fresh[0]] += 1
            if self.write_policy == "selective":
                self._want(block)

    def _want(self, block: Block) -> None:
        if block.block_hash is not None:
            self._want_hash(block.block_id, block.block_hash)

    def _want_hash(self, block_id: int, h: BlockHash) -> None:
        if h in self._saved:
            return
        self._remember(h)
        self._pending.append((block_id, h))

    # PoolListener (engine/pool_events.py), registered for write_back only.
    def stored(self, block: Block, block_hash: BlockHash, content: BlockContent | None) -> None:
        """Nothing: write_back waits for the eviction."""

    def removed(self, block: Block, block_hash: BlockHash) -> None:
        """The pool evicts block: save its bytes (still block_hash's) before the block is written again."""
        self._want_hash(block.block_id, block_hash)

    def cleared(self) -> None:
        """Nothing: the pool does not clear its KV bytes, and the tiers keep their copies."""

    def _remember(self, block_hash: bytes) -> None:
        self._saved[block_hash] = None
        if len(self._saved) > SAVED_KEYS_KEPT:
            self._saved.popitem(last=False)

    def flush(self) -> None:
        """Copy this step's blocks to save out of the pool (one gather per layer) and queue them."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        payloads = self.copy_out([bid for bid, _ in pending])
        for (_bid, h), payload in zip(pending, payloads):
            key = self.key(h)
            for writer in self.writers:
                if not _holds(writer.store, key):  # a block read from disk is not written back
                    writer.offer(key, payload)

    def copy_out(self, block_ids: list[int]) -> list[Payload]:
        """Each block's KV bytes, in payload order (layer 0 K, layer 0 V, layer 1 K, ...), as private copies."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        first = self._bytes[0][0]
        buf = torch.empty((len(block_ids), 2 * len(self._bytes), *first.shape[1:]), dtype=torch.uint8)
        for j, t in enumerate(t for kv in self._bytes for t in kv):
            torch.index_select(t, 0, ids, out=buf[:, j])  # straight into place: one copy, no stack
        flat = buf.reshape(len(block_ids), -1).numpy()
        return [flat[i] for i in range(len(block_ids))]

    # -- read path ---------------------------------------------------------------------

    def may_have(self, block_hash: bytes) -> bool:
        """Whether some tier may hold the block; False only when every tier's own index says no."""
        key = self.key(block_hash)
        for store in self.stores:
            contains = getattr(store, "contains", None)
            if contains is None or contains(key):
                return True
        return False

    def start_load(self, request_id: str, num_hits: int, hashes: list[bytes]) -> bool:
        """Hand a request's next blocks to the loader; False when no tier can have the first one."""
        if not hashes or not self.may_have(hashes[0]):
            return False
        self._loading[request_id] = _Loading(num_hits, hashes)
        self.loader.submit(LoadJob(request_id, tuple(self.key(h) for h in hashes)))
        return True

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def finished_loads(self) -> list[tuple[str, list[bytes], LoadResult]]:
        """(request id, hashes of the blocks found, result) of every load done since the last call."""
        out = []
        for result in self.loader.done():
            self.stats.load_seconds.append(result.seconds)
            loading = self._loading.pop(result.request_id, None)
            if loading is not None:
                out.append((result.request_id, loading.hashes[:len(result.blocks)], result))
        del self.stats.load_seconds[:-1024]
        return out

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def place(self, pool: BlockPool, hits: list[Block], hashes: list[bytes], result: LoadResult,
              contents: list[BlockContent] | None = None) -> int:
        """Copy loaded blocks into fresh pool blocks and publish them after hits; the blocks placed.

        hits (the request's pool prefix) are held meanwhile, so allocating cannot evict them.
        contents, parallel to hashes, is what the pool's listeners hear (None: they hear none)."""
        given = contents if contents is not None else [None] * len(hashes)
        blocks = [(h, tier, payload, c) for h, (tier, payload), c in zip(hashes, result.blocks, given)
                  if pool.lookup(h) is None]
        n = min(len(blocks), pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0))
        if n <= 0:
            return 0
        pool.touch(hits)
        fresh = pool.allocate(n)
        self.flush()  # write_back: the blocks allocate() just evicted, before _fill overwrites them
        for block, (h, tier, payload, content) in zip(fresh, blocks):
            self._fill(block.block_id, payload)
            pool.cache(block, h, content)
            self._fresh[block.block_id] = (tier, h)
            self._remember(h)
            self.stats.loaded_blocks[tier] += 1
        pool.free(reversed(fresh))
        pool.free(hits)
        return n

    def _fill(self, block_id: int, payload: Payload) -> None:
        parts = payload.reshape(2 * len(self._bytes), -1)
        for layer, (k, v) in enumerate(self._bytes):
            k[block_id].numpy().reshape(-1)[:] = parts[2 * layer]
            v[block_id].numpy().reshape(-1)[:] = parts[2 * layer + 1]

    # -- figures, shutdown ---------------------------------------------------------------

    def snapshot(self) -> list[TierSnapshot]:
        out = []
        for store, writer in zip(self.stores, self.writers):
            c = store.counters.as_dict()  # one consistent reading while other threads add
            out.append(TierSnapshot(store.name, self.stats.hit_blocks[store.name],
                                    self.stats.loaded_blocks[store.name], c["misses"], c["bytes_read"],
                                    c["bytes_written"], c["writes"], c["drops"] + writer.queue_drops,
                                    c["evictions"], c["errors"], self.loader.corrupt[store.name]))
        return out

    def join_writes(self) -> None:
        for writer in self.writers:
            writer.join()

    def close(self) -> None:
        """Stop the threads; write_back first queues the pool's cached blocks (CLOSE_WRITE_S in all)."""
        deadline = time.monotonic() + CLOSE_WRITE_S
        self.loader.close()
        if self._pool is not None and self.write_policy == "write_back":
            self.flush()
            self._write_back_pool(self._pool, deadline)
        for writer in self.writers:
            writer.close(max(deadline - time.monotonic(), 1.0))
        for store in self.stores:
            store.close()

    def _write_back_pool(self, pool: BlockPool, deadline: float) -> None:
        """Queue every block cached in the pool that no tier got yet, oldest published first (a prefix's
        head before its tail), waiting for room in the writers' queues until deadline."""
        todo = [(b.block_id, h) for h, b in pool.cached.items() if h not in self._saved]
        for start in range(0, len(todo), CLOSE_CHUNK_BLOCKS):
            if time.monotonic() >= deadline:
                for writer in self.writers:
                    writer.queue_drops += len(todo) - start
                log.warning("KV tiers: %d of the pool's %d blocks not written back by the close deadline (%gs)",
                            len(todo) - start, len(todo), CLOSE_WRITE_S)
                return
            chunk = todo[start:start + CLOSE_CHUNK_BLOCKS]
            for (_bid, h), payload in zip(chunk, self.copy_out([bid for bid, _ in chunk])):
                self._remember(h)
                key = self.key(h)
                for writer in self.writers:
                    if not _holds(writer.store, key):
                        writer.offer_waiting(key, payload, deadline - time.monotonic())
        if todo:
            log.info("KV tiers: %d blocks of the pool queued for write-back at close", len(todo))


def _holds(store: BlockStore, key: bytes) -> bool:
    """Whether the store's own index says it holds key (False for a store without one: write it)."""
    contains = getattr(store, "contains", None)
    return contains is not None and bool(contains(key))
