"""Block pool and KV-cache manager: LRU order, revival, hashing, salts, ref counts."""

from __future__ import annotations

import pytest

from trtprompt.engine.block_pool import BlockPool, FreeBlockQueue, Block, hash_block
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.request import Request, SamplingParams


def make_req(rid: str, tokens: list[int], salt: str | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(), salt, 0)


def test_free_queue_is_fifo_with_o1_remove():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.size == 5
    with pytest.raises(RuntimeError):
        q.remove(Block(99))


def test_hash_chains_parent_tokens_and_salt():
    a = hash_block(None, [1, 2, 3, 4], None)
    assert a == hash_block(None, [1, 2, 3, 4], None)
    assert a != hash_block(None, [1, 2, 3, 5], None)
    assert a != hash_block(None, [1, 2, 3, 4], "tenant-a")
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != hash_block(None, [1, 2, 3, 4], "tenant-b")
    # The same block content under different parents is a different block.
    assert hash_block(a, [9, 9, 9, 9], None) != hash_block(None, [9, 9, 9, 9], None)


def test_lru_eviction_and_revival():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]) * 16)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    assert pool.num_cached_free == 3
    # Revival: a hit on a free cached block takes it out of the queue with its KV intact.
    hit = pool.lookup(bytes([0]) * 16)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2 and pool.num_cached_free == 2
    # Eviction takes the least recently freed block first and drops its hash.
    (new,) = pool.allocate(1)
    assert new is blocks[2]
    assert pool.lookup(bytes([2]) * 16) is None and new.block_hash is None
    assert pool.num_cached_free == 1


def test_uncached_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a" * 16)
    pool.free([a])
    pool.free([b])  # no hash: goes to the front
    assert pool.allocate(1)[0] is b
    assert pool.lookup(b"a" * 16) is a


def test_double_free_is_an_error():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_prefix_reuse_full_blocks_only_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4, enable_block_reuse=True)
    first = make_req("a", list(range(10)))
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_computed(first)  # blocks [0..3], [4..7] are full; [8, 9] is partial
    kv.free(first)

    same = make_req("b", list(range(10)))
    hits = kv.find_prefix(same)
    assert len(hits) == 2
    # A prompt that ends exactly on a block boundary still recomputes its last token.
    exact = make_req("c", list(range(8)))
    assert len(kv.find_prefix(exact)) == 1
    other_salt = make_req("d", list(range(10)), salt="t1")
    assert kv.find_prefix(other_salt) == []


def test_allocate_with_hits_counts_reused_and_new_blocks():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=True)
    a = make_req("a", list(range(9)))
    assert kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed(a)
    b = make_req("b", list(range(8)) + [100, 101, 102])
    hits = kv.find_prefix(b)
    assert kv.allocate(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8
    assert (b.stats.kv_cache_reused_blocks, b.stats.kv_cache_alloc_new_blocks,
            b.stats.kv_cache_alloc_total_blocks) == (2, 1, 3)
    # Shared blocks carry one reference per holder.
    assert [blk.ref_cnt for blk in kv.block_tables["a"][:2]] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.num_used_blocks() == 0


def test_allocate_refuses_without_partial_change():
    kv = KVCacheManager(num_blocks=2, tokens_per_block=4, enable_block_reuse=False)
    r = make_req("r", list(range(12)))
    assert not kv.allocate(r, 12)
    assert kv.num_free_blocks == 2 and "r" not in kv.block_tables
