"""The pool's listener hook (engine/pool_events.py): what KV events and write-back are built on."""

from __future__ import annotations

from trtprompt.engine.block_pool import Block, BlockHash
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.pool_events import BlockContent
from trtprompt.engine.request import Request, SamplingParams


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, BlockHash | None, BlockContent | None]] = []

    def stored(self, block: Block, block_hash: BlockHash, content: BlockContent | None) -> None:
        self.events.append(("stored", block.block_id, block_hash, content))

    def removed(self, block: Block, block_hash: BlockHash) -> None:
        assert block.block_hash == block_hash  # still the old content's while the listener runs
        self.events.append(("removed", block.block_id, block_hash, None))

    def cleared(self) -> None:
        self.events.append(("cleared", -1, None, None))


def _run(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    req = Request(request_id, tokens, SamplingParams(max_tokens=1), max_output_tokens=1, end_ids=frozenset(),
                  cache_salt=None, arrival_time_ns=0)
    assert kv.allocate(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_computed(req)
    kv.free(req)
    return req


def test_published_blocks_are_stored_with_parent_and_tokens_then_removed_when_reused() -> None:
    kv = KVCacheManager(num_blocks=3, tokens_per_block=4, enable_block_reuse=True, eviction_policy="lru")
    rec = Recorder()
    kv.pool.add_listener(rec)
    first = _run(kv, "a", list(range(9)))  # two full blocks published, the third partial
    stored = [e for e in rec.events if e[0] == "stored"]
    assert [(e[2], e[3]) for e in stored] == [
        (first.block_hashes[0], BlockContent(None, (0, 1, 2, 3))),
        (first.block_hashes[1], BlockContent(first.block_hashes[0], (4, 5, 6, 7))),
    ]
    rec.events.clear()
    _run(kv, "b", list(range(100, 112)))  # needs all 3 blocks: both cached ones are handed out again
    removed = {e[2] for e in rec.events if e[0] == "removed"}
    assert removed == set(first.block_hashes[:2])
    assert kv.pool.evicted_blocks == 2


def test_no_listener_means_no_content_is_built() -> None:
    kv = KVCacheManager(num_blocks=3, tokens_per_block=4, enable_block_reuse=True)
    req = _run(kv, "a", list(range(9)))
    assert kv.pool.lookup(req.block_hashes[0]) is not None
    assert kv.pool.listeners == []
