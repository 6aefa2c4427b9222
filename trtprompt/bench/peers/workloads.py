"""The side-by-side's workloads, as token ids every side reads from one JSON file (the same prompts token for token).

- throughput: N x (128 in, 64 out), every request in flight at once -> output tok/s
- prefix:     64 x (1,024-token shared prefix + 32 unique) -> 16, a prefix new to the cache in every rep
              -> wall time and mean TTFT
- latency:    one request at a time, 128 in -> 128 out -> ms per token after the first (inter-token latency)
- served:     random 128 -> 64 through each side's OpenAI server (served.py; vLLM's client makes its prompts)

Every request is greedy and yields exactly its output length (EOS ignored), so every side does the same work.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

# The engine bounds of the comparison (issue 10), the same on every side.
MAX_BATCH, MAX_NUM_TOKENS, MAX_SEQ_LEN, TOKENS_PER_BLOCK = 64, 2048, 2048, 32
OFFLINE = ("throughput", "prefix", "latency")  # in the order they run
WORKLOADS = (*OFFLINE, "served")
DEFAULT_WORKLOADS = ("throughput", "prefix", "served")
# The warm-up's seed; rep r uses seed + 1 + r, so no rep's prompts (nor the prefix) were seen before.
SEEDS = {"throughput": 100, "prefix": 200, "latency": 300}


def token_range(checkpoint: Path) -> tuple[int, int]:
    """Ids past the special tokens, below the vocabulary size."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    specials = [t["id"] for t in tok.get("added_tokens", [])]
    vocab = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    return int(max(specials, default=-1)) + 1, int(vocab)


def random_prompts(seed: int, n: int, length: int, ids: tuple[int, int], prefix_len: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(*ids) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(*ids) for _ in range(length)] for _ in range(n)]


def kv_pool_tokens(args: argparse.Namespace) -> int:
    """Room for every prefix-workload sequence in full, unshared, whole blocks each; at least one sequence of
    MAX_SEQ_LEN (what an engine must hold, however small the workloads of a smoke run)."""
    per_seq: int = args.prefix_len + args.prefix_unique + args.prefix_output
    pool: int = args.prefix_requests * -(-per_seq // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    return max(MAX_SEQ_LEN, pool)


def kv_bytes_per_token(checkpoint: Path, bytes_per_value: int) -> int:
    """K and V of every layer for one token, from the checkpoint's config."""
    cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return int(2 * cfg["num_hidden_layers"] * kv_heads * head_dim * bytes_per_value)


def kv_pool_gib(args: argparse.Namespace, bytes_per_value: int, at_least: int) -> int:
    """Whole GiB holding the prefix workload unshared (the pool trtprompt gets), at least `at_least`."""
    nbytes = kv_bytes_per_token(args.checkpoint, bytes_per_value) * kv_pool_tokens(args)
    return max(at_least, -(-nbytes // (1 << 30)))


def _workload(args: argparse.Namespace, name: str, ids: tuple[int, int]) -> dict[str, Any]:
    """One workload's warm-up and per-rep prompts and its output length."""
    if name == "throughput":
        n, length, prefix, out = args.throughput_requests, args.throughput_input, 0, args.throughput_output
    elif name == "prefix":
        n, length, prefix, out = args.prefix_requests, args.prefix_unique, args.prefix_len, args.prefix_output
    else:
        n, length, prefix, out = args.latency_requests, args.latency_input, 0, args.latency_output
    seed = SEEDS[name]

    def make(s: int, count: int) -> list[list[int]]:
        return random_prompts(s, count, length, ids, prefix)

    one_at_a_time = name == "latency"
    # The latency workload warms up on one request: it runs them one by one anyway.
    return {"max_tokens": out, "one_at_a_time": one_at_a_time, "warmup": make(seed, 1 if one_at_a_time else n),
            "reps": [make(seed + 1 + r, n) for r in range(args.reps)]}


def offline_spec(args: argparse.Namespace, ids: tuple[int, int]) -> dict[str, Any]:
    """The offline workloads asked for (--only), in run order, with the engine bounds every side uses."""
    workloads = {name: _workload(args, name, ids) for name in OFFLINE if name in args.only}
    return {"max_num_tokens": MAX_NUM_TOKENS, "max_batch_size": MAX_BATCH, "max_seq_len": MAX_SEQ_LEN,
            "workloads": workloads}


def expected_tokens(spec: dict[str, Any], workload: str, rep: int) -> int:
    """Output tokens a rep must yield: every request exactly its max_tokens."""
    wl = spec["workloads"][workload]
    return int(len(wl["reps"][rep]) * wl["max_tokens"])
