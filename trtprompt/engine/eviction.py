"""The free KV blocks and which one to evict next (docs/prefix-pool.md, "Eviction").

Blocks are kept in one pair of queues per retention priority (0-100): every
block of a lower priority is evicted before any of a higher one (TensorRT-LLM's
rule), and the lowest non-empty level is the lowest set bit of one integer, so
finding it costs O(1) whatever the number of levels. Within a level:

- "lru": one queue, least recently freed first (the reference policy).
- "2q": blocks never hit since they were computed wait in a small FIFO (10 % of
  the pool); blocks hit at least once, or recomputed soon after their eviction
  from the small FIFO (a ghost list of hashes remembers them), live in the main
  queue, evicted least recently freed first. A scan of one-off prompts only
  cycles through the small FIFO.
- "s3fifo": as 2q, but a main-queue block that was hit gets a second chance per
  hit (its count, capped at FREQ_CAP, drops by one and it goes to the back), so
  the blocks hit most stay longest (S3-FIFO's lazy promotion).

Free blocks holding no hash are handed out before any cached one. Each queue
operation is O(1) (s3fifo's second chances: amortized, each paid by an earlier hit).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

from trtprompt.knobs import EVICTION_POLICIES

DEFAULT_PRIORITY = 35  # TensorRT-LLM's kDefaultRetentionPriority
MIN_PRIORITY = 0
MAX_PRIORITY = 100
FREQ_CAP = 3  # hits remembered per block (S3-FIFO's two bits)
SMALL_SHARE = 0.1  # the small FIFO's share of the pool (S3-FIFO's 10 %)

BlockHash = bytes


class Block:
    """One KV block: its references, content hash and eviction state."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "queue", "freq", "priority",
                 "duration_s", "expires_at", "in_heap")

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: BlockHash | None = None) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash = block_hash
        # Links of the free queue holding the block; all None when it is in none.
        self.prev: Block | None = None
        self.next: Block | None = None
        self.queue: FreeBlockQueue | None = None
        self.freq = 0  # hits while cached, capped at FREQ_CAP
        self.priority = DEFAULT_PRIORITY
        self.duration_s: float | None = None  # the priority lasts this long after a release; None: forever
        self.expires_at: float | None = None  # when the priority reverts (set on release)
        self.in_heap = False  # an entry of FreeBlocks' expiry heap points at it

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt}, priority={self.priority}, freq={self.freq})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop-front, append and remove."""

    def __init__(self, blocks: Sequence[Block] = (), level: int | None = None) -> None:
        self.level = level  # the priority level it belongs to; None: the hash-less queue
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
        if block.queue is not None:
            raise RuntimeError(f"block {block.block_id} is already in a free queue")
        assert node is not None and node.next is not None
        block.prev = node
        block.next = node.next
        node.next.prev = block
        node.next = block
        block.queue = self
        self.size += 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise RuntimeError("no free KV block left")
        block = self._head.next
        after = block.next if block is not None else None
        assert block is not None and after is not None
        self._head.next = after  # unlinked here, not through remove(): the hot path of every eviction
        after.prev = self._head
        block.prev = block.next = None
        block.queue = None
        self.size -= 1
        return block

    def remove(self, block: Block) -> None:
        if block.queue is not self or block.prev is None or block.next is None:
            raise RuntimeError(f"block {block.block_id} is not in this free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        block.queue = None
        self.size -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class FreeBlocks:
    """Every free block, in the queue its policy and priority put it in."""

    def __init__(self, num_blocks: int, policy: str, clock: Callable[[], float]) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"kv_cache_eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.clock = clock
        self.empty = FreeBlockQueue()  # free blocks holding no hash: handed out first
        levels = range(MIN_PRIORITY, MAX_PRIORITY + 1)
        self._small = [FreeBlockQueue(level=p) for p in levels]
        self._main = [FreeBlockQueue(level=p) for p in levels]
        self._nonempty = 0  # bit p set: level p holds a cached free block
        self._small_cap = max(1, int(num_blocks * SMALL_SHARE))
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()  # hashes evicted from a small FIFO
        self._ghost_cap = num_blocks
        # (expires_at, seq, block): at most one entry per block (Block.in_heap), so at most num_blocks.
        self._expiring: list[tuple[float, int, Block]] = []
        self._seq = 0
        self.num_cached = 0  # free blocks still holding a hash

    @property
    def size(self) -> int:
        return self.empty.size + self.num_cached

    def add(self, block: Block) -> None:
        """A block whose last reference was dropped joins the back of its queue."""
        if block.block_hash is None:
            self.empty.appendleft(block)
            return
        if block.priority != DEFAULT_PRIORITY and block.duration_s is not None:
            block.expires_at = self.clock() + block.duration_s
            self._push_expiry(block)
        self._enqueue(block, self._goes_to_main(block))
        self.num_cached += 1

    def _goes_to_main(self, block: Block) -> bool:
        if self.policy == "lru" or block.freq > 0:
            return True
        assert block.block_hash is not None
        if block.block_hash in self._ghost:
            del self._ghost[block.block_hash]  # recomputed soon after its eviction: it recurs
            return True
        return False

    def _enqueue(self, block: Block, main: bool) -> None:
        (self._main if main else self._small)[block.priority].append(block)
        self._nonempty |= 1 << block.priority

    def remove(self, block: Block) -> None:
        """Take a free block out of its queue (a cache hit revives it)."""
        queue = block.queue
        if queue is None:
            raise RuntimeError(f"block {block.block_id} is not free")
        queue.remove(block)
        if queue.level is not None:
            self.num_cached -= 1
            self._note_removed(queue.level)

    def _note_removed(self, level: int) -> None:
        if self._small[level].size == 0 and self._main[level].size == 0:
            self._nonempty &= ~(1 << level)

    def pop(self) -> Block:
        """The block to hand out next: a hash-less one, else the victim of the lowest priority level."""
        self._expire()
        if self.empty.size:
            return self.empty.popleft()
        if self.num_cached == 0:
            raise RuntimeError("no free KV block left")
        level = (self._nonempty & -self._nonempty).bit_length() - 1
        small, main = self._small[level], self._main[level]
        if self.policy == "lru":
            block = main.popleft()
        elif main.size == 0 or small.size > self._small_cap:
            block = small.popleft()
            self._remember(block)
        else:
            block = self._pop_main(main)
        self.num_cached -= 1
        if small.size == 0 and main.size == 0:
            self._nonempty &= ~(1 << level)
        return block

    def _pop_main(self, main: FreeBlockQueue) -> Block:
        while True:
            block = main.popleft()
            if self.policy == "2q" or block.freq == 0:
                return block
            block.freq -= 1  # s3fifo: one second chance per remembered hit
            main.append(block)

    def _remember(self, block: Block) -> None:
        ghost, h = self._ghost, block.block_hash
        assert h is not None
        if h in ghost:
            ghost.move_to_end(h)
            return
        ghost[h] = None
        if len(ghost) > self._ghost_cap:
            ghost.popitem(last=False)

    def _push_expiry(self, block: Block) -> None:
        if block.in_heap:
            return  # its entry fires earlier and re-pushes the later deadline
        assert block.expires_at is not None
        self._seq += 1
        heapq.heappush(self._expiring, (block.expires_at, self._seq, block))
        block.in_heap = True

    def _expire(self) -> None:
        """Priorities whose duration ran out revert to the default (O(log n) per expiry)."""
        if not self._expiring:
            return  # the common case: no timed priority, not even a clock read
        now = self.clock()
        while self._expiring and self._expiring[0][0] <= now:
            _, _, block = heapq.heappop(self._expiring)
            block.in_heap = False
            if block.expires_at is None:
                continue  # claimed again since: its new retention holds
            if block.expires_at > now:
                self._push_expiry(block)  # released again since: a later deadline
                continue
            self._revert(block)

    def _revert(self, block: Block) -> None:
        queue = block.queue
        block.priority, block.duration_s, block.expires_at = DEFAULT_PRIORITY, None, None
        if queue is None or queue.level is None or queue.level == DEFAULT_PRIORITY:
            return
        main = queue is self._main[queue.level]
        queue.remove(block)
        self._note_removed(queue.level)
        self._enqueue(block, main)

    def queues(self) -> Iterator[FreeBlockQueue]:
        """Every queue (for tests and recounts, never in a hot path)."""
        yield self.empty
        yield from self._small
        yield from self._main

    def ghost_size(self) -> int:
        return len(self._ghost)
