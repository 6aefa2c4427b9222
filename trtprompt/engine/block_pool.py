"""KV blocks: ref counts, content hashes, and the free blocks a policy evicts from.

A free block keeps its hash (and so its KV) until it is handed out again,
so a later request with the same prefix can revive it. Which cached block
is handed out first is the eviction policy's choice (engine/eviction.py,
docs/prefix-pool.md "Eviction"), within retention priorities.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from typing import Callable, Iterable, Sequence

from trtprompt.engine.eviction import (
    DEFAULT_PRIORITY,
    FREQ_CAP,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Block,
    BlockHash,
    FreeBlockQueue,
    FreeBlocks,
)
from trtprompt.engine.pool_events import BlockContent, PoolListener
from trtprompt.knobs import KNOBS

__all__ = ["Block", "BlockHash", "BlockPool", "FreeBlockQueue", "hash_block"]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None,
               lora: str | None = None) -> BlockHash:
    """Content hash of one full block, chained to its parent (the salt and the LoRA adapter's cache key seed
    the first block: the same tokens under two adapters are two different KV, engine/lora/).

    A cryptographic hash: with tenant salts, a crafted collision would let one
    tenant read another's KV, so Python's hash() is not enough.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    if parent is None and salt is not None:
        h.update(b"salt:" + salt.encode("utf-8", "surrogatepass"))
    if parent is None and lora is not None:
        h.update(b"lora:" + lora.encode("utf-8", "surrogatepass"))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool,
                 eviction_policy: str = KNOBS["kv_cache_eviction_policy"].default,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks = FreeBlocks(num_blocks, eviction_policy, clock)
        for b in reversed(self.blocks):  # hash-less blocks join at the front: block 0 is handed out first
            self.free_blocks.add(b)
        self.cached: dict[BlockHash, Block] = {}
        self.evicted_blocks = 0  # reusable blocks whose hash was dropped to hand them out again
        self.listeners: list[PoolListener] = []  # engine/pool_events.py; empty costs one truth test

    def add_listener(self, listener: PoolListener) -> None:
        self.listeners.append(listener)

    @property
    def eviction_policy(self) -> str:
        return self.free_blocks.policy

    @property
    def num_free_blocks(self) -> int:
        return self.free_blocks.size

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a reusable hash."""
        return self.free_blocks.num_cached

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits, reviving those sitting in the free queues; count the hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_blocks.remove(block)
            block.ref_cnt += 1
            block.freq = min(block.freq + 1, FREQ_CAP)

    def allocate(self, n: int) -> list[Block]:
        if n > self.free_blocks.size:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.free_blocks.size} free")
        out = []
        for _ in range(n):
            block = self.free_blocks.pop()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        """Forget what a block held: its hash, hits and retention."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.evicted_blocks += 1
                for listener in self.listeners:
                    listener.removed(block, block.block_hash)
            block.block_hash = None
        block.freq = 0
        block.priority, block.duration_s, block.expires_at = DEFAULT_PRIORITY, None, None

    def cache(self, block: Block, block_hash: BlockHash, content: BlockContent | None = None) -> None:
        """Publish a block whose KV is fully computed. First writer wins.

        content (parent hash and tokens) is for listeners; callers build it only when there are any."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # same content computed twice at once; the first copy serves hits
        block.block_hash = block_hash
        self.cached[block_hash] = block
        for listener in self.listeners:
            listener.stored(block, block_hash, content)

    def set_retention(self, block: Block, priority: int, duration_ms: int | None) -> None:
        """A held block's retention priority, lasting duration_ms after each release (None: until evicted).

        Set by the request claiming the block (TensorRT-LLM's claimBlock): the latest
        request that gives a priority for it wins.
        """
        if block.queue is not None:
            raise RuntimeError(f"block {block.block_id} is free: retention is set on held blocks")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}")
        block.priority = priority
        block.duration_s = None if duration_ms is None else duration_ms / 1000.0
        block.expires_at = None

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queues in this order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_blocks.add(block)
