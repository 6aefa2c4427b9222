"""Per-request block tables over the block pool: prefix lookup, allocation, release."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from trtprompt.engine.block_pool import Block, BlockHash, BlockPool, hash_block
from trtprompt.engine.pool_events import BlockContent, content_of
from trtprompt.engine.request import Request

if TYPE_CHECKING:  # the tiers need torch; the prompt linter imports this module without it
    from trtprompt.engine.tiers.tiered import KvTiers
from trtprompt.knobs import KNOBS


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], tokens_per_block: int,
                        salt: str | None, num_full: int, lora: str | None = None) -> None:
    """Extend the chained hashes of token_ids' full blocks up to num_full (the salt and the LoRA adapter's
    cache key seed block 0).

    The one hash chain: the engine (incrementally, per request) and prompt/reuse.py (lint's
    estimate) both use it, so the estimate names the blocks the engine caches.
    """
    while len(hashes) < num_full:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * tokens_per_block:(i + 1) * tokens_per_block], salt, lora))


class KVCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool,
                 eviction_policy: str = KNOBS["kv_cache_eviction_policy"].default) -> None:
        self.pool = BlockPool(num_blocks, enable_block_reuse, eviction_policy)
        self.tokens_per_block = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.block_tables: dict[str, list[Block]] = {}
        # Blocks of each request already published, so publishing stays O(new blocks).
        self._num_published: dict[str, int] = {}
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.queried_tokens = 0  # prompt tokens of every lookup (hits are reused_blocks * tokens_per_block)
        # Prompt blocks a running request has yet to compute, by hash -> that request,
        # so a later request with the same prefix waits for them instead of computing
        # them a second time (TensorRT-LLM and vLLM compute them twice).
        self._in_flight: dict[bytes, str] = {}
        self._in_flight_of: dict[str, list[bytes]] = {}
        # Kept as tables change, not recounted (statistics read them after every step): the
        # blocks of all tables (a shared block once per table holding it), and the computed
        # tokens of the requests holding them, as allocate and cache_computed last saw them.
        self.num_held_blocks = 0
        self.num_computed_held = 0
        self._computed_of: dict[str, int] = {}
        # Tiers below the pool (disk, remote), set by the engine when configured (docs/prefix-pool.md).
        self.tiers: KvTiers | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.tokens_per_block)

    def _update_hashes(self, req: Request, upto_tokens: int) -> None:
        """Extend req.block_hashes over every full block within the first upto_tokens tokens."""
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.tokens_per_block, req.cache_salt,
                            upto_tokens // self.tokens_per_block, None if req.lora is None else req.lora.cache_key)

    def find_prefix(self, req: Request) -> list[Block]:
        """Longest run of cached full blocks for req, never covering its last token.

        The last token is always recomputed: its logits are needed to sample.
        """
        if not self.enable_block_reuse or not req.reuses_prefix:
            return []
        limit = req.num_tokens - 1
        self._update_hashes(req, limit)
        hits: list[Block] = []
        for block_hash in req.block_hashes[: limit // self.tokens_per_block]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def fork_source(self, req: Request) -> tuple[list[Block], Block] | None:
        """The blocks a forked sequence takes from req.fork_of: the full blocks before its last prompt
        token, shared, and the block holding that token, to be copied (None: the parent no longer
        holds its computed prompt, and req is admitted as any request is)."""
        parent = req.fork_of
        table = self.block_tables.get(parent.request_id) if parent is not None else None
        if parent is None or table is None or parent.num_computed_tokens < req.num_prompt_tokens:
            return None
        shared = (req.num_prompt_tokens - 1) // self.tokens_per_block
        return table[:shared], table[shared]

    def fork(self, req: Request, shared: list[Block]) -> int:
        """Give req the shared blocks and one new block for its last prompt token (the copy of its
        parent's), leaving that token to compute: its logits are needed to sample. Returns the new
        block's id. The caller checked that the blocks fit (allocate would say so)."""
        if not self.allocate(req, req.num_tokens - len(shared) * self.tokens_per_block, shared, shared=True):
            raise RuntimeError(f"fork of request {req.request_id}: no free block for its copy")
        req.num_computed_tokens = req.num_tokens - 1
        self._note_computed(req)
        return self.block_tables[req.request_id][len(shared)].block_id

    def reseat(self, req: Request, parent: Request) -> tuple[int, int] | None:
        """req (holding no blocks, or its own to drop) takes over parent's computed KV: full blocks
        shared, a partial last block copied into a new one. Returns that copy (source id, new id),
        None when parent's computed tokens end on a block boundary. Raises RuntimeError when no block
        is free for the copy."""
        self.free(req)
        req.num_computed_tokens = 0
        upto = parent.num_computed_tokens
        full, partial = divmod(upto, self.tokens_per_block)
        table = self.block_tables[parent.request_id]
        if not self.allocate(req, partial, table[:full], shared=True):
            raise RuntimeError(f"request {req.request_id}: no free KV block for a beam's copy")
        req.num_computed_tokens = upto
        req.block_hashes = list(parent.block_hashes)
        self._num_published[req.request_id] = min(self._num_published.get(parent.request_id, 0), full)
        self._note_computed(req)
        return (table[full].block_id, self.block_tables[req.request_id][full].block_id) if partial else None

    def free_blocks_needed(self, hits: list[Block], num_new_blocks: int) -> int:
        """Free-queue blocks consumed: new blocks plus hits revived from the free queue."""
        return num_new_blocks + sum(1 for b in hits if b.ref_cnt == 0)

    def allocate(self, req: Request, num_new_tokens: int, hits: list[Block] | None = None,
                 shared: bool = False) -> bool:
        """Give req blocks for num_new_tokens more tokens; False (and no change) if they don't fit.

        hits: cached blocks req starts with; shared: they are another sequence's of the same request
        (a fork, a beam), taken by reference and not counted as prefix-cache hits."""
        table = self.block_tables.get(req.request_id, [])
        held = len(table)
        hits = hits or []
        computed = req.num_computed_tokens + len(hits) * self.tokens_per_block
        n_new = self.blocks_for(computed + num_new_tokens) - len(table) - len(hits)
        if self.free_blocks_needed(hits, max(n_new, 0)) > self.pool.num_free_blocks:
            return False
        if hits:
            if self.tiers is not None and not shared:
                self.tiers.reused(hits)
            self.pool.touch(hits)
            table = table + hits
            req.num_computed_tokens = computed
            if not shared:
                self.reused_blocks += len(hits)
                req.stats.kv_cache_reused_blocks += len(hits)
        if n_new > 0:
            table = table + self.pool.allocate(n_new)
            req.stats.kv_cache_alloc_new_blocks += n_new
        self.num_held_blocks += len(table) - held
        self.block_tables[req.request_id] = table
        if req.retention is not None:
            self._claim(req, table, held)
        req.stats.kv_cache_alloc_total_blocks = len(table)
        self._note_computed(req)
        return True

    def _claim(self, req: Request, table: list[Block], start: int) -> None:
        """Apply req's retention to the blocks it just took (hits and new ones), as TensorRT-LLM's
        claimBlock does: the latest request giving a priority for a block sets it."""
        assert req.retention is not None
        for i in range(start, len(table)):
            retention = req.retention.for_block(i, self.tokens_per_block, req.num_prompt_tokens)
            if retention is not None:
                self.pool.set_retention(table[i], *retention)

    def _note_computed(self, req: Request) -> None:
        """Bring num_computed_held up to date with req's computed tokens (req holds a table)."""
        rid = req.request_id
        self.num_computed_held += req.num_computed_tokens - self._computed_of.get(rid, 0)
        self._computed_of[rid] = req.num_computed_tokens

    @property
    def num_empty_slots(self) -> int:
        """Slots of held blocks that hold no computed token: the unwritten tail of each table."""
        return self.num_held_blocks * self.tokens_per_block - self.num_computed_held

    def mark_in_flight(self, req: Request, num_hits: int) -> None:
        """Register the full prompt blocks req will compute itself (after its num_hits cached ones)."""
        if not self.enable_block_reuse:
            return
        owned = [h for h in req.block_hashes[num_hits:] if h not in self._in_flight]
        for h in owned:
            self._in_flight[h] = req.request_id
        self._in_flight_of[req.request_id] = owned

    def next_block_in_flight(self, req: Request, num_hits: int) -> bool:
        """True when the next block req would compute is being computed by a running request.

        Checked after find_prefix, so req.block_hashes covers its reusable blocks.
        """
        if not self.enable_block_reuse or not req.reuses_prefix:
            return False
        limit = (req.num_tokens - 1) // self.tokens_per_block
        return num_hits < limit and req.block_hashes[num_hits] in self._in_flight

    def _settle_in_flight(self, request_id: str, hashes: list[bytes]) -> None:
        for h in hashes:
            if self._in_flight.get(h) == request_id:
                del self._in_flight[h]

    def record_lookup(self, req: Request, num_hits: int) -> None:
        """Count the prompt's full blocks that missed the cache (for the hit rate)."""
        full = (req.num_tokens - 1) // self.tokens_per_block
        self.missed_blocks += max(full - num_hits, 0)
        self.queried_tokens += req.num_tokens

    def cache_computed(self, req: Request) -> None:
        """Count req's newly computed tokens and publish its full blocks now computed (early reuse)."""
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        self._note_computed(req)
        if not self.enable_block_reuse:
            return
        self._update_hashes(req, req.num_computed_tokens)
        n_full = req.num_computed_tokens // self.tokens_per_block
        start = self._num_published.get(req.request_id, 0)
        listened = bool(self.pool.listeners)
        for i in range(start, n_full):
            content = (content_of(req.all_token_ids, req.block_hashes, i, self.tokens_per_block, req.cache_salt,
                                  req.lora_name) if listened else None)
            self.pool.cache(table[i], req.block_hashes[i], content)
            if self.tiers is not None and self.pool.lookup(req.block_hashes[i]) is table[i]:
                self.tiers.published(table[i])
        self._settle_in_flight(req.request_id, req.block_hashes[start:n_full])
        self._num_published[req.request_id] = max(start, n_full)

    def start_tier_load(self, req: Request, num_hits: int) -> bool:
        """Send req's full prompt blocks past its num_hits pool hits to the tiers' loader.

        True when req must wait for the load (it leaves the queue until finish_tier_loads hands
        it back); False when no tier may hold its next block, or there are no tiers."""
        if self.tiers is None or not self.enable_block_reuse or self.tiers.is_loading(req.request_id):
            return False
        limit = (req.num_tokens - 1) // self.tokens_per_block
        return self.tiers.start_load(req.request_id, num_hits, req.block_hashes[num_hits:limit])

    def finish_tier_loads(self, loading: dict[str, Request]) -> list[Request]:
        """Requests of loading whose loads are done, their blocks now in the pool (those that fit)."""
        if self.tiers is None:
            return []
        out = []
        for request_id, hashes, result in self.tiers.finished_loads():
            req = loading.get(request_id)
            if req is None:
                continue
            if result.blocks and not req.is_finished:
                self.tiers.place(self.pool, self.find_prefix(req), hashes, result, self._contents(req, hashes))
            out.append(req)
        return out

    def _contents(self, req: Request, hashes: list[bytes]) -> list[BlockContent] | None:
        """The contents of hashes, a run of req's prompt block hashes, for the pool's listeners (None without any)."""
        if not self.pool.listeners or not hashes:
            return None
        first = req.block_hashes.index(hashes[0])
        return [content_of(req.all_token_ids, req.block_hashes, first + j, self.tokens_per_block, req.cache_salt,
                           req.lora_name) for j in range(len(hashes))]

    def trim(self, req: Request) -> None:
        """Free req's blocks past those its tokens need (speculative decoding: blocks only rejected drafts
        were written to). They were never published: only computed full blocks are."""
        table = self.block_tables.get(req.request_id)
        keep = self.blocks_for(req.num_tokens)
        if not table or len(table) <= keep:
            return
        freed = table[keep:]
        del table[keep:]
        self.num_held_blocks -= len(freed)
        req.stats.kv_cache_alloc_total_blocks = len(table)
        self.pool.free(reversed(freed))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def free(self, req: Request) -> None:
        table = self.block_tables.pop(req.request_id, None)
        self._num_published.pop(req.request_id, None)
        self.num_held_blocks -= len(table or ())
        self.num_computed_held -= self._computed_of.pop(req.request_id, 0)
        self._settle_in_flight(req.request_id, self._in_flight_of.pop(req.request_id, []))
        if table:
            # Tail blocks are the least likely to be shared: let them be evicted first.
            self.pool.free(reversed(table))

    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks
