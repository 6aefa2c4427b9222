"""N-gram lookup: where each short run of tokens was followed by more, over token sequences.

One structure serves both n-gram drafters (TensorRT-LLM's NGram knobs, trtprompt/knobs.py):
- a request's own prompt and output (prompt lookup): one live sequence, indexed as it grows;
- the public pool over recent requests (is_public_pool): finished sequences, bounded in tokens,
  the oldest leaving first. Keys carry the request's cache_salt, so a request only ever drafts
  from requests with the same salt (docs/security.md, "Speculative drafts").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# (cache_salt, run of tokens): a run is looked up only among sequences of the same salt.
Key = tuple[str | None, tuple[int, ...]]


@dataclass(frozen=True)
class Match:
    """A draft and the length of the run it continues (a longer run is the better guess)."""

    run: int
    tokens: list[int]


class NgramIndex:
    """Runs of 1..max_n tokens -> (sequence, position the run was followed from), oldest first.

    keep_all False keeps only the newest position of each run; use_oldest drafts from the
    oldest one kept, else the newest. capacity bounds the tokens held (None: unbounded, for
    one request's own tokens). Each position is indexed once; eviction pops the evicted
    sequence's entries from the front of their runs (it is the oldest), so nothing scans.
    """

    def __init__(self, max_n: int, keep_all: bool, use_oldest: bool, capacity: int | None = None) -> None:
        self.max_n = max_n
        self.keep_all = keep_all
        self.use_oldest = use_oldest
        self.capacity = capacity
        self._seqs: dict[int, tuple[list[int], str | None]] = {}  # oldest first (dicts keep insertion order)
        self._indexed: dict[int, int] = {}  # sequence id -> positions indexed so far
        self._runs: dict[Key, deque[tuple[int, int]]] = {}
        self._next_id = 0
        self.num_tokens = 0

    def add(self, tokens: list[int], salt: str | None = None) -> int:
        """Index tokens as a new sequence (a live list keeps growing: extend() indexes the rest); its id."""
        if self.capacity is not None:
            tokens = tokens[-self.capacity:]
            while self._seqs and self.num_tokens + len(tokens) > self.capacity:
                self._evict_oldest()
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = (tokens, salt)
        self._indexed[sid] = 0
        self.extend(sid)
        return sid

    def extend(self, sid: int) -> None:
        """Index the positions sequence sid gained since the last call."""
        tokens, salt = self._seqs[sid]
        for e in range(max(self._indexed[sid], 1), len(tokens)):  # position 0 follows no run
            for n in range(1, min(self.max_n, e) + 1):
                self._record((salt, tuple(tokens[e - n:e])), (sid, e))
        self.num_tokens += len(tokens) - self._indexed[sid]
        self._indexed[sid] = max(self._indexed[sid], len(tokens))

    def _record(self, key: Key, entry: tuple[int, int]) -> None:
        entries = self._runs.get(key)
        if entries is None:
            self._runs[key] = deque((entry,))
        elif self.keep_all:
            entries.append(entry)
        else:
            entries.clear()
            entries.append(entry)

    def _evict_oldest(self) -> None:
        sid = next(iter(self._seqs))
        tokens, salt = self._seqs.pop(sid)
        for e in range(1, self._indexed.pop(sid)):
            for n in range(1, min(self.max_n, e) + 1):
                key = (salt, tuple(tokens[e - n:e]))
                entries = self._runs.get(key)
                while entries and entries[0][0] == sid:
                    entries.popleft()
                if entries is not None and not entries:
                    del self._runs[key]
        self.num_tokens -= len(tokens)

    def propose(self, tokens: list[int], k: int, salt: str | None = None) -> Match | None:
        """Up to k tokens that followed the longest run ending tokens (max_n down to 1 tokens), or None."""
        for n in range(min(self.max_n, len(tokens)), 0, -1):
            entries = self._runs.get((salt, tuple(tokens[len(tokens) - n:])))
            if not entries:
                continue
            sid, e = entries[0] if self.use_oldest else entries[-1]
            follow = self._seqs[sid][0][e:e + k]
            if follow:
                return Match(n, follow)
        return None
