"""The scan workload of issue 24 and a pool-level simulation of it (scripts/bench_eviction.py, the tests).

Hot requests: one of a few system prompts plus a unique user tail. One-off
requests: long unique prompts whose blocks add up to a multiple of the pool.
A warm-up (each system prompt a few times, hot requests only) comes first and
is not counted. The hot-prefix hit rate is the share of the measured hot
requests' system-prompt blocks served from the cache; the target
(docs/prefix-pool.md, "Eviction") compares it with and without the one-off prompts.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.request import Request, SamplingParams

ARRANGEMENTS: tuple[str, ...] = ("interleaved", "burst")
TOKEN_RANGE = (10, 700)  # inside the tiny demo vocabulary, clear of its special tokens


@dataclass(frozen=True)
class ScanWorkload:
    num_blocks: int = 128  # the pool
    tokens_per_block: int = 32
    num_hot: int = 8  # system prompts
    hot_blocks: int = 4  # each system prompt's full blocks
    user_tokens: int = 40  # each hot request's unique tail
    one_off_blocks: int = 32  # each one-off prompt's full blocks: a quarter of the pool
    scan_volume: float = 3.0  # one-off blocks in all / pool blocks
    hot_share: float = 0.8  # of requests
    hot_skew: float = 0.0  # Zipf exponent of the system prompts' popularity (0: uniform)
    output_tokens: int = 4
    warmup: int = 2  # requests per system prompt before the measured phase
    arrangement: str = "interleaved"  # one-off prompts spread at random, or one contiguous burst mid-way
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        for name in ("num_blocks", "tokens_per_block", "num_hot", "hot_blocks", "user_tokens", "one_off_blocks",
                     "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.hot_share < 1.0:
            raise ValueError(f"hot_share must be in (0, 1), got {self.hot_share}")
        if self.scan_volume <= 0:
            raise ValueError(f"scan_volume must be > 0, got {self.scan_volume}")
        if self.arrangement not in ARRANGEMENTS:
            raise ValueError(f"arrangement must be one of {', '.join(ARRANGEMENTS)}, got {self.arrangement!r}")

    @property
    def num_one_off(self) -> int:
        return max(1, round(self.scan_volume * self.num_blocks / self.one_off_blocks))

    @property
    def num_hot_requests(self) -> int:
        return round(self.num_one_off * self.hot_share / (1.0 - self.hot_share))


@dataclass(frozen=True)
class SimRequest:
    tokens: tuple[int, ...]
    hot: int | None  # which system prompt; None: a one-off prompt
    measured: bool = True  # False: a warm-up request


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_RANGE) for _ in range(n))


def make_requests(w: ScanWorkload, with_scan: bool = True) -> list[SimRequest]:
    """The request sequence; without the scan, the same hot requests in the same order."""
    rng = random.Random(w.seed)
    systems = [_tokens(rng, w.hot_blocks * w.tokens_per_block) for _ in range(w.num_hot)]
    order = [k for k in range(w.num_hot) for _ in range(w.warmup)]
    rng.shuffle(order)
    warm = [SimRequest(systems[k] + _tokens(rng, w.user_tokens), k, measured=False) for k in order]
    weights = [1.0 / (k + 1) ** w.hot_skew for k in range(w.num_hot)]
    hot = []
    for k in rng.choices(range(w.num_hot), weights, k=w.num_hot_requests):
        hot.append(SimRequest(systems[k] + _tokens(rng, w.user_tokens), k))
    if not with_scan:
        return warm + hot
    # +1 token: the last token is always recomputed, so every block of the prompt is a full, cached one.
    one_offs = [SimRequest(_tokens(rng, w.one_off_blocks * w.tokens_per_block + 1), None)
                for _ in range(w.num_one_off)]
    if w.arrangement == "burst":
        half = len(hot) // 2
        return warm + hot[:half] + one_offs + hot[half:]
    slots = set(rng.sample(range(len(hot) + len(one_offs)), len(one_offs)))
    hot_it, off_it = iter(hot), iter(one_offs)
    return warm + [next(off_it) if i in slots else next(hot_it) for i in range(len(hot) + len(one_offs))]


@dataclass
class HitCounts:
    hot_hits: int = 0  # system-prompt blocks served from the cache
    hot_queried: int = 0  # system-prompt blocks asked for
    hits: int = 0  # every request's reused blocks
    evicted: int = 0

    @property
    def hot_hit_rate(self) -> float:
        return self.hot_hits / self.hot_queried if self.hot_queried else 0.0


def note_hits(counts: HitCounts, r: SimRequest, reused_blocks: int, hot_blocks: int) -> None:
    if not r.measured:
        return
    counts.hits += reused_blocks
    if r.hot is not None:
        counts.hot_hits += min(reused_blocks, hot_blocks)
        counts.hot_queried += hot_blocks


def run_pool(w: ScanWorkload, requests: list[SimRequest], policy: str, concurrency: int = 4) -> HitCounts:
    """Drive a KVCacheManager as the engine does (prefix lookup, prefill, decode), concurrency at a time."""
    kv = KVCacheManager(w.num_blocks, w.tokens_per_block, True, policy)
    counts = HitCounts()
    running: deque[Request] = deque()
    for i, r in enumerate(requests):
        if len(running) == concurrency:
            kv.free(running.popleft())
        req = Request(f"r{i}", list(r.tokens), SamplingParams(max_tokens=w.output_tokens), w.output_tokens,
                      frozenset(), None, 0)
        hits = kv.find_prefix(req)
        kv.record_lookup(req, len(hits))
        while not kv.allocate(req, req.num_tokens - len(hits) * w.tokens_per_block, hits):
            if not running:
                raise ValueError(f"a request of {req.num_tokens} tokens does not fit the pool of {w.num_blocks}")
            kv.free(running.popleft())
        note_hits(counts, r, len(hits), w.hot_blocks)
        req.num_computed_tokens = req.num_tokens
        kv.cache_computed(req)
        _decode(kv, req, w.output_tokens, running)
        running.append(req)
    while running:
        kv.free(running.popleft())
    counts.evicted = kv.pool.evicted_blocks
    return counts


def _decode(kv: KVCacheManager, req: Request, n: int, running: deque[Request]) -> None:
    for t in range(n):
        while not kv.allocate(req, 1):
            kv.free(running.popleft())  # the pool is never smaller than one request (run_pool checks)
        req.append_token(TOKEN_RANGE[0] + t)
        req.num_computed_tokens += 1
        kv.cache_computed(req)
