"""Seeded benchmark workloads whose prompt lengths are exact with the engine's tokenizer.

A prompt is built from a pool of words that are each exactly one token (a
leading space plus letters, e.g. " moment"): the byte-level pre-tokenizer
splits at those spaces, so a run of n such words encodes to exactly n ids
and a shared part (system prompt, template, conversation history) encodes
to the same ids in every prompt that starts with it, which is what makes
KV-cache blocks reusable. Every prompt is re-encoded to check this; when a
tokenizer does not compose that way the tail is adjusted word by word until
the length is right, or a ValueError says why it could not be.

Lengths count what the engine receives: the ensemble tokenizes `text_input`
with the tokenizer's special tokens (the BOS), so `prompt_len` includes them.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from trtprompt.tokenizer import Tokenizer

KINDS = ("random", "shared-prefix", "multi-turn", "long-context", "template", "file")
_WORD = re.compile(r" [a-z]{2,12}")
MIN_POOL = 64
_ADJUST_TRIES = 64


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    index: int
    prompt: str
    prompt_len: int  # tokens the engine sees, special tokens included
    max_tokens: int
    tag: str = "default"  # a traffic class the report breaks out (e.g. "long" / "short")
    group: str | None = None  # the shared prefix or conversation it belongs to
    after: int | None = None  # index of the request that must finish first (multi-turn)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Lengths are in tokens, special tokens included in prompt lengths."""

    kind: str
    num_requests: int = 64
    seed: int = 0
    output_len: int = 32
    input_len: int = 128  # random, long-context's short requests
    input_spread: float = 0.0  # random: lengths uniform in input_len * [1 - s, 1 + s]
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    prefix_len: int = 512  # shared-prefix system prompt; template's fixed header
    suffix_len: int = 64  # shared-prefix: unique user part
    turns: int = 4  # multi-turn: turns per conversation
    user_len: int = 64  # multi-turn: each user message
    answer_len: int | None = None  # multi-turn: each (synthetic) assistant answer; None: output_len
    long_len: int = 1536  # long-context: the long prompts
    long_fraction: float = 0.125  # long-context: share of requests that are long
    num_fields: int = 3  # template: variable fields
    field_len: int = 16  # template: tokens per field value
    path: Path | None = None  # file: JSONL of {"prompt": ...} or {"messages": [...]}

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("num_requests", "output_len", "input_len", "num_prefixes", "prefix_len",
                     "suffix_len", "turns", "user_len", "long_len", "num_fields", "field_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.input_spread < 1.0:
            raise ValueError(f"input_spread must be in [0, 1), got {self.input_spread}")
        if not 0.0 < self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in (0, 1], got {self.long_fraction}")
        if self.answer_len is not None and self.answer_len < 1:
            raise ValueError(f"answer_len must be >= 1, got {self.answer_len}")
        if self.kind == "file" and self.path is None:
            raise ValueError("path is required for the file workload")


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.kind

    def describe(self) -> dict[str, Any]:
        lens = [r.prompt_len for r in self.requests]
        return {"kind": self.spec.kind, "seed": self.spec.seed, "num_requests": len(self.requests),
                "prompt_len_min": min(lens), "prompt_len_max": max(lens),
                "prompt_len_mean": sum(lens) / len(lens), "output_len": self.spec.output_len}


class WordPool:
    """Single-token words of a tokenizer, and exact-length prompt text built from them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if _WORD.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        if len(words) < MIN_POOL:
            raise ValueError(f"the tokenizer has {len(words)} single-token words of the form ' word' "
                             f"(need >= {MIN_POOL}) to build exact-length prompts")
        self.words = words
        # Fills for exact(): each verified to be one token on its own.
        self._unit = tuple(words)
        probe = " " + words[0].strip()
        # What encode() adds around the text (the BOS), counted in every prompt length.
        self.special_len = len(tokenizer.encode(probe)) - len(tokenizer.encode(probe, add_special_tokens=False))

    def text(self, rng: random.Random, n: int) -> str:
        return "".join(rng.choice(self.words) for _ in range(n))

    def exact(self, parts: Sequence[str], target: int, rng: random.Random) -> str:
        """Join parts; adjust the last part's tail until encode() gives exactly target tokens:
        drop its last word while too long, append one-token words while too short."""
        head, tail = "".join(parts[:-1]), parts[-1]
        for _ in range(_ADJUST_TRIES):
            n = len(self.tokenizer.encode(head + tail))
            if n == target:
                return head + tail
            if n < target:
                tail += "".join(rng.choice(self._unit) for _ in range(target - n))
            elif tail:
                tail = _drop_words(tail, 1)
            else:
                break
        raise ValueError(f"could not build a prompt of exactly {target} tokens with this tokenizer "
                         f"(last try: {len(self.tokenizer.encode(head + tail))})")

    def words_for(self, prompt_len: int, what: str) -> int:
        n = prompt_len - self.special_len
        if n < 1:
            raise ValueError(f"{what} ({prompt_len}) must exceed the tokenizer's {self.special_len} "
                             "special token(s)")
        return n


def _drop_words(text: str, k: int) -> str:
    """text without its last k space-led words."""
    cuts = [m.start() for m in re.finditer(" ", text)]
    if not cuts:
        return ""
    return text[:cuts[max(0, len(cuts) - k)]]


def _rng(spec: WorkloadSpec, *salt: object) -> random.Random:
    # Seeding with a string is stable across runs and Python versions (sha512).
    return random.Random(":".join(map(str, (spec.kind, spec.seed, *salt))))


def _random(spec: WorkloadSpec, pool: WordPool) -> Iterator[BenchRequest]:
    rng = _rng(spec)
    lo = max(pool.special_len + 1, math.floor(spec.input_len * (1 - spec.input_spread)))
    hi = max(lo, math.ceil(spec.input_len * (1 + spec.input_spread)))
    for i in range(spec.num_requests):
        n = rng.randint(lo, hi)
        yield BenchRequest(i, pool.exact([pool.text(rng, n - pool.special_len)], n, rng), n, spec.output_len)


def _shared_prefix(spec: WorkloadSpec, pool: WordPool) -> Iterator[BenchRequest]:
    prefix_rng = _rng(spec, "prefix")
    prefixes = [pool.text(prefix_rng, pool.words_for(spec.prefix_len, "prefix_len"))
                for _ in range(spec.num_prefixes)]
    rng = _rng(spec, "users")
    n = spec.prefix_len + spec.suffix_len
    for i in range(spec.num_requests):
        p = rng.randrange(spec.num_prefixes)
        text = pool.exact([prefixes[p], pool.text(rng, spec.suffix_len)], n, rng)
        yield BenchRequest(i, text, n, spec.output_len, group=f"prefix{p}")


def _multi_turn(spec: WorkloadSpec, pool: WordPool) -> Iterator[BenchRequest]:
    """Turn-major order (every conversation's turn t before any turn t+1); answers are
    synthetic, seeded text of answer_len tokens, so every length is known up front."""
    conversations = math.ceil(spec.num_requests / spec.turns)
    answer_len = spec.answer_len or spec.output_len
    rngs = [_rng(spec, "conv", c) for c in range(conversations)]
    history = [""] * conversations
    index_of: dict[tuple[int, int], int] = {}
    i = 0
    for t in range(spec.turns):
        for c in range(conversations):
            if i == spec.num_requests:
                return
            user = pool.text(rngs[c], spec.user_len)
            n = pool.special_len + t * (spec.user_len + answer_len) + spec.user_len
            text = pool.exact([history[c], user], n, rngs[c])
            index_of[(c, t)] = i
            yield BenchRequest(i, text, n, spec.output_len, group=f"conv{c}", after=index_of.get((c, t - 1)))
            history[c] = text + pool.text(rngs[c], answer_len)
            i += 1


def _long_context(spec: WorkloadSpec, pool: WordPool) -> Iterator[BenchRequest]:
    rng = _rng(spec)
    n_long = max(1, round(spec.num_requests * spec.long_fraction))
    long_at = set(rng.sample(range(spec.num_requests), n_long))
    for i in range(spec.num_requests):
        n, tag = (spec.long_len, "long") if i in long_at else (spec.input_len, "short")
        yield BenchRequest(i, pool.exact([pool.text(rng, n - pool.special_len)], n, rng), n,
                           spec.output_len, tag=tag)


_LABEL_LEN = 2  # tokens of each field's fixed label in the template


def _template(spec: WorkloadSpec, pool: WordPool) -> Iterator[BenchRequest]:
    """One fixed template: a header of prefix_len tokens, then num_fields (label, value) pairs
    whose labels are fixed and whose values vary per request."""
    fixed = _rng(spec, "template")
    header = pool.text(fixed, pool.words_for(spec.prefix_len, "prefix_len"))
    labels = [pool.text(fixed, _LABEL_LEN) for _ in range(spec.num_fields)]
    rng = _rng(spec, "fields")
    n = spec.prefix_len + spec.num_fields * (_LABEL_LEN + spec.field_len)
    for i in range(spec.num_requests):
        body = "".join(label + pool.text(rng, spec.field_len) for label in labels)
        yield BenchRequest(i, pool.exact([header, body], n, rng), n, spec.output_len, group="template")


def _file(spec: WorkloadSpec, tokenizer: Tokenizer) -> Iterator[BenchRequest]:
    """JSONL lines {"prompt": str} or {"messages": [...]} (rendered with the chat template),
    optionally with "max_tokens"; taken in order, from the start again if there are fewer."""
    assert spec.path is not None  # checked in WorkloadSpec
    prompts = [_file_prompt(json.loads(line), tokenizer, spec, no)
               for no, line in enumerate(Path(spec.path).read_text(encoding="utf-8").splitlines(), 1)
               if line.strip()]
    if not prompts:
        raise ValueError(f"{spec.path} holds no prompts")
    for i in range(spec.num_requests):
        text, max_tokens = prompts[i % len(prompts)]
        yield BenchRequest(i, text, len(tokenizer.encode(text)), max_tokens)


def _file_prompt(row: Any, tokenizer: Tokenizer, spec: WorkloadSpec, line_no: int) -> tuple[str, int]:
    where = f"{spec.path}:{line_no}"
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise ValueError(f"{where}: each line must be an object with either 'prompt' or 'messages'")
    max_tokens = int(row.get("max_tokens", spec.output_len))
    if max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be >= 1, got {max_tokens}")
    if "prompt" in row:
        return str(row["prompt"]), max_tokens
    text = tokenizer.apply_chat_template(row["messages"])
    # The template writes the BOS itself and the server adds one: keep only the server's.
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        text = text[len(tokenizer.bos_token):]
    return text, max_tokens


_GENERATORS: dict[str, Callable[[WorkloadSpec, WordPool], Iterator[BenchRequest]]] = {
    "random": _random, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn,
    "long-context": _long_context, "template": _template,
}


def make_workload(spec: WorkloadSpec, tokenizer: Tokenizer, max_input_len: int | None = None) -> Workload:
    """Generate spec's requests; refuses prompts longer than max_input_len, naming both numbers."""
    if spec.kind == "file":
        requests = list(_file(spec, tokenizer))
    else:
        requests = list(_GENERATORS[spec.kind](spec, WordPool(tokenizer)))
    if max_input_len is not None:
        longest = max(requests, key=lambda r: r.prompt_len)
        if longest.prompt_len > max_input_len:
            raise ValueError(f"workload {spec.kind!r}: prompt {longest.index} has {longest.prompt_len} tokens, "
                             f"over the engine's maximum input length ({max_input_len})")
    return Workload(spec, requests)
