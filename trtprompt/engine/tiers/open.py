"""Open the tiers a TierConfig names, over an engine's KV cache."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from trtprompt.engine.block_pool import BlockPool
from trtprompt.engine.config import KV_INT8_SCALE_BYTES, ModelConfig
from trtprompt.engine.tiers.config import TierConfig
from trtprompt.engine.tiers.disk_store import DiskStore
from trtprompt.engine.tiers.fingerprint import KvLayout
from trtprompt.engine.tiers.store import BlockStore
from trtprompt.engine.tiers.tiered import KvCache, KvTiers

log = logging.getLogger(__name__)


def kv_layout(model: ModelConfig, tokens_per_block: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KvLayout:
    """The pool's block layout; an int8 cache's rows are 1-byte values plus their float16 scale, and
    its dtype name differs, so its blocks never meet a float engine's (the fingerprint has it)."""
    if kv_cache_dtype == "int8":
        return KvLayout(model.num_hidden_layers, model.num_key_value_heads, model.head_size, tokens_per_block,
                        "int8", 1, KV_INT8_SCALE_BYTES)
    return KvLayout(model.num_hidden_layers, model.num_key_value_heads, model.head_size, tokens_per_block,
                    str(dtype).removeprefix("torch."), torch.finfo(dtype).bits // 8)


def open_stores(config: TierConfig) -> list[BlockStore]:
    """The disk tier first (cheaper to read), then the remote one."""
    stores: list[BlockStore] = []
    if config.disk_cache_path is not None:
        stores.append(DiskStore(Path(config.disk_cache_path), config.disk_cache_size))
    if config.kv_remote_url is not None:
        # Imported here: redis-py is needed only with a remote tier.
        from trtprompt.engine.tiers.redis_store import RedisStore, remote_password

        password = remote_password(config.kv_remote_password_file)
        stores.append(RedisStore.from_url(config.kv_remote_url, password=password))
    return stores


def open_tiers(stores: Sequence[BlockStore], fingerprint: bytes | None, layout: KvLayout, caches: list[KvCache],
               write_policy: str, queue_blocks: int, pool: BlockPool | None = None) -> KvTiers:
    """The tiers over caches; each store is probed once here, so a misconfigured tier (a Redis that does
    not answer or never evicts, a disk smaller than its budget) is said in the log at start, not at
    the first request that needs it. pool: the engine's (write_back listens to its evictions)."""
    if fingerprint is None:
        raise ValueError("KV tiers need the engine fingerprint (LLMEngine.from_engine_dir computes it)")
    tiers = KvTiers(stores, fingerprint, layout, caches, write_policy, queue_blocks, pool)
    log.info("KV tiers: %s; write policy %s; fingerprint %s; %d bytes per block",
             ", ".join(tiers.names), write_policy, fingerprint.hex(), layout.block_bytes)
    tiers.problems = probe_stores(stores)
    return tiers


def probe_stores(stores: Sequence[BlockStore]) -> dict[str, str]:
    """tier name -> what is wrong with it, for every store whose probe() finds a problem (each logs its own)."""
    problems = {}
    for store in stores:
        probe = getattr(store, "probe", None)  # a store a test wraps may not have one
        problem = probe() if probe is not None else None
        if problem is not None:
            problems[store.name] = problem
    return problems
