"""Shared by the tier tests: engines over tiny HF models with tiers, and a store whose reads and
writes a test can hold (to order events by steps, never by time)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from engine_helpers import EOS, make_engine, model_config

from trtprompt.engine.block_pool import BlockHash
from trtprompt.engine.config import EngineConfig, KvCacheConfig, SchedulerConfig
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.kv_cache import extend_block_hashes
from trtprompt.engine.model import load_model_from_safetensors
from trtprompt.engine.request import SamplingParams
from trtprompt.engine.tiers.config import TierConfig
from trtprompt.engine.tiers.disk_store import DiskStore
from trtprompt.engine.tiers.fingerprint import fingerprint_engine_files
from trtprompt.engine.tiers.open import kv_layout
from trtprompt.engine.tiers.store import BlockStore, TierCounters

TPB = 8
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def fingerprint_of(path: Path) -> bytes:
    return fingerprint_engine_files(path / "model.safetensors", None, kv_layout(model_config(path), TPB,
                                                                                 torch.float32), "float32")


def tier_engine(path: Path, stores: list[BlockStore], fingerprint: bytes | None = None, *,
                kv_tokens: int = 2048, write_policy: str = "write_through", queue_blocks: int = 256,
                max_num_tokens: int = 256) -> LLMEngine:
    """An engine like engine_helpers.make_engine's, with the given stores below its pool."""
    mc = model_config(path)
    cfg = EngineConfig(
        model=mc,
        kv_cache=KvCacheConfig(tokens_per_block=TPB, enable_block_reuse=True, max_tokens_in_paged_kv_cache=kv_tokens),
        scheduler=SchedulerConfig(max_batch_size=8, max_num_tokens=max_num_tokens, max_seq_len=512,
                                  enable_chunked_context=True),
        linear_backend="reference",
        tiers=TierConfig(kv_tier_write_policy=write_policy, queue_blocks=queue_blocks),
    )
    model = load_model_from_safetensors(path / "model.safetensors", mc, torch.float32, torch.device("cpu"),
                                        "reference")
    return LLMEngine(cfg, model, [EOS], fingerprint or fingerprint_of(path), stores)


def plain_engine(path: Path) -> LLMEngine:
    return make_engine(path, tokens_per_block=TPB, kv_tokens=2048, max_seq_len=512)


def block_hashes(tokens: list[int], salt: str | None = None) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, TPB, salt, (len(tokens) - 1) // TPB)
    return hashes


def entry_path(store: DiskStore, fingerprint: bytes, block_hash: BlockHash) -> Path:
    name = (fingerprint + block_hash).hex()
    return store.root / name[-2:] / name


class GatedStore:
    """A real store behind two gates: get() and put() wait while their gate is closed."""

    def __init__(self, inner: DiskStore) -> None:
        self.inner = inner
        self.name = inner.name
        self.counters: TierCounters = inner.counters
        self.reads_open = threading.Event()
        self.writes_open = threading.Event()
        self.reads_open.set()
        self.writes_open.set()
        self.reads_started = threading.Event()

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def get(self, key: bytes) -> bytes | None:
        self.reads_started.set()
        self.reads_open.wait(60)
        return self.inner.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        self.writes_open.wait(60)
        return self.inner.put(key, value)

    def delete(self, key: bytes) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.reads_open.set()
        self.writes_open.set()
        self.inner.close()


def run_one(engine: LLMEngine, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    """Output tokens and reused blocks of one request run alone."""
    engine.add_request(rid, tokens, GREEDY)
    out: list[int] = []
    reused = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
            if o.finished:
                reused = o.stats.kv_cache_reused_blocks
    return out, reused
