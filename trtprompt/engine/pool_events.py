"""What the block pool tells its listeners: a block published, a cached block dropped, the cache cleared.

Listeners are the KV-event publisher (routers read these, docs/replicas.md) and the tiers' write-back
writer (docs/prefix-pool.md "Writes"). The pool calls them synchronously inside its own operations, so
a listener must be quick and must not call back into the pool; one that raises is a bug in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from trtprompt.engine.eviction import Block, BlockHash

__all__ = ["BlockContent", "PoolListener"]


@dataclass(frozen=True)
class BlockContent:
    """What a published block holds: its parent in the hash chain (None for a prompt's first block), its
    tokens, and the request's cache salt. The salt is already inside the chain (block_pool.hash_block);
    it is repeated here for consumers that key on it themselves (Dynamo's indexer, docs/kv-events.md)."""

    parent: BlockHash | None
    token_ids: tuple[int, ...]
    salt: str | None = None
    lora_name: str | None = None  # the request's LoRA adapter (its cache key is inside the chain too)


class PoolListener(Protocol):
    def stored(self, block: Block, block_hash: BlockHash, content: BlockContent | None) -> None:
        """block now serves hits for block_hash. content is None only where the caller has no tokens."""

    def removed(self, block: Block, block_hash: BlockHash) -> None:
        """block_hash no longer has a block in the pool. Called before the block is handed out
        again, so its KV bytes are still block_hash's while this runs (write-back copies them here)."""

    def cleared(self) -> None:
        """Every cached hash was dropped at once."""


def content_of(token_ids: Sequence[int], hashes: Sequence[BlockHash], index: int,
               tokens_per_block: int, salt: str | None = None, lora_name: str | None = None) -> BlockContent:
    """The content of a prompt's block index, from its tokens, its chain of hashes and its salt."""
    start = index * tokens_per_block
    return BlockContent(hashes[index - 1] if index else None,
                        tuple(token_ids[start:start + tokens_per_block]), salt, lora_name)
