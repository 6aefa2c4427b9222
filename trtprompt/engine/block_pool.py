"""KV blocks: ref counts, content hashes, and an O(1) LRU queue of free blocks.

A free block keeps its hash (and so its KV) until it is handed out again,
so a later request with the same prefix can revive it. Eviction takes the
least recently freed block first.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None) -> BlockHash:
    """Content hash of one full block, chained to its parent.

    A cryptographic hash: with tenant salts, a crafted collision would let one
    tenant read another's KV, so Python's hash() is not enough.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    if parent is None and salt is not None:
        h.update(b"salt:" + salt.encode("utf-8", "surrogatepass"))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; None when the block is not in it.
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop-front, append and remove."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, node: Block | None, block: Block) -> None:
        assert node is not None and node.next is not None
        block.prev = node
        block.next = node.next
        node.next.prev = block
        node.next = block
        self.size += 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise RuntimeError("no free KV block left")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1

    def __iter__(self) -> Iterable[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.num_cached_free = 0  # free blocks still holding a reusable hash
        self.evicted_blocks = 0  # reusable blocks whose hash was dropped to hand them out again

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits, reviving those sitting in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= 1
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        if n > self.free_queue.size:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_cached_free -= 1
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.evicted_blocks += 1
            block.block_hash = None

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Publish a block whose KV is fully computed. First writer wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # same content computed twice at once; the first copy serves hits
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching zero join the LRU tail."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Holds nothing reusable: hand it out before any cached block.
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    self.num_cached_free += 1
