"""What block reuse saves on a sequence of prompts, computed as the engine computes it.

The engine's rule (trtprompt/engine/kv_cache.py): a request reuses the
longest run of cached full blocks of its prompt that does not cover the
prompt's last token (its logits are needed, so it is always recomputed);
once its prefill is done, every full block of the prompt is published.
Blocks are identified by the same chained hash (with the cache salt on
block 0), so the estimate below equals the engine's `kv_cache_reused_blocks`
for prompts run one after another (each prefilled before the next is
scheduled) with `max_tokens=1` (longer outputs also publish blocks of
generated text) and a cache large enough that nothing is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from trtprompt.engine.block_pool import BlockHash
from trtprompt.engine.kv_cache import extend_block_hashes


def block_hashes(ids: Sequence[int], tokens_per_block: int, salt: str | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of ids (the engine's chain)."""
    out: list[BlockHash] = []
    extend_block_hashes(out, ids, tokens_per_block, salt, len(ids) // tokens_per_block)
    return out


@dataclass(frozen=True)
class PromptReuse:
    num_tokens: int
    reused_blocks: int
    tokens_per_block: int

    @property
    def reused_tokens(self) -> int:
        return self.reused_blocks * self.tokens_per_block

    @property
    def prefill_tokens(self) -> int:
        return self.num_tokens - self.reused_tokens


@dataclass
class ReuseEstimate:
    tokens_per_block: int
    prompts: list[PromptReuse] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prompts)

    @property
    def reused_tokens(self) -> int:
        return sum(p.reused_tokens for p in self.prompts)

    @property
    def reused_blocks(self) -> int:
        return sum(p.reused_blocks for p in self.prompts)

    @property
    def prefill_tokens(self) -> int:
        return self.total_tokens - self.reused_tokens

    @property
    def reusable_fraction(self) -> float:
        """Fraction of prompt tokens whose prefill reuse skips."""
        return self.reused_tokens / self.total_tokens if self.total_tokens else 0.0


def walk_reuse(prompts: Iterable[Sequence[int]], tokens_per_block: int,
               salts: Iterable[str | None] | None = None,
               cached: set[BlockHash] | None = None) -> Iterator[tuple[list[BlockHash], int]]:
    """Per prompt, in order: the hashes of its full blocks and how many of them the engine reuses.

    cached: blocks already cached before the first prompt (e.g. those a tier kept over a restart);
    updated in place with every prompt's blocks, as the pool publishes them.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    salt_list = list(salts) if salts is not None else None
    seen: set[BlockHash] = set() if cached is None else cached
    for i, ids in enumerate(prompts):
        salt = salt_list[i] if salt_list is not None else None
        hashes = block_hashes(ids, tokens_per_block, salt)
        lookable = max(len(ids) - 1, 0) // tokens_per_block
        hits = 0
        while hits < lookable and hashes[hits] in seen:
            hits += 1
        seen.update(hashes)
        yield hashes, hits


def estimate_reuse(prompts: Iterable[Sequence[int]], tokens_per_block: int,
                   salts: Iterable[str | None] | None = None,
                   cached: set[BlockHash] | None = None) -> ReuseEstimate:
    """Reused blocks per prompt, in order, as the engine would count them (cached: walk_reuse's)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    ids_list = [list(ids) for ids in prompts]
    est = ReuseEstimate(tokens_per_block)
    for ids, (_hashes, hits) in zip(ids_list, walk_reuse(ids_list, tokens_per_block, salts, cached)):
        est.prompts.append(PromptReuse(len(ids), hits, tokens_per_block))
    return est
