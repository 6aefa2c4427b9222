"""The engine fingerprint: one digest of everything that changes a KV block's bytes.

A tier key is this fingerprint followed by the pool's chained block hash (keys.py), so two
servers of the same engine on two machines compute the same keys, and an engine rebuilt with
other weights, another tokenizer, dtype, block size or KV layout never reads the old blocks.
The key format is documented in docs/prefix-pool.md ("Keys").

Hashing the weights' content costs a read of the whole file (about a second per GB here), so
the digest is cached beside the weights, keyed by the file's size, mtime and inode, and
recomputed whenever one of them changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

# Bump when the codec's payload layout or the key derivation changes: old entries become misses.
TIER_FORMAT_VERSION = 1
FINGERPRINT_BYTES = 16
DIGEST_CACHE = ".trtprompt-weights-digest.json"
_CHUNK = 1 << 22


@dataclass(frozen=True)
class KvLayout:
    """What one block's KV bytes are: per layer K then V, each [kv_heads, tokens_per_block, head_size]."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_block: int
    dtype: str  # the KV cache's torch dtype name, e.g. "float32"
    dtype_bytes: int
    row_scale_bytes: int = 0  # int8 KV: each row's scale, stored after its values (engine/attention_int8.py)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "tokens_per_block", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KvLayout.{name} must be a positive integer, got {value!r}")

    @property
    def block_bytes(self) -> int:
        row = self.head_size * self.dtype_bytes + self.row_scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.tokens_per_block * row

    def describe(self) -> str:
        return (f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_size={self.head_size} "
                f"tokens_per_block={self.tokens_per_block} dtype={self.dtype}"
                + (f" row_scale_bytes={self.row_scale_bytes}" if self.row_scale_bytes else ""))


def file_digest(path: Path) -> str:
    """blake2b-256 of a file's content, hex."""
    h = hashlib.blake2b(digest_size=32)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def weights_digest(path: Path) -> str:
    """file_digest of the weights, read from (or written to) the cache file beside them when still valid."""
    cache = path.parent / DIGEST_CACHE
    key = _stat_key(path)
    try:
        saved = json.loads(cache.read_text(encoding="utf-8"))
        if saved.get("file") == path.name and saved.get("stat") == key and isinstance(saved.get("digest"), str):
            return str(saved["digest"])
    except (OSError, ValueError, AttributeError):
        pass
    digest = file_digest(path)
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:  # a read-only engine directory just recomputes at every load
        tmp.write_text(json.dumps({"file": path.name, "stat": key, "digest": digest}), encoding="utf-8")
        os.replace(tmp, cache)
    except OSError as exc:
        log.info("weights digest not cached in %s: %s", path.parent, exc)
    return digest


def tokenizer_digests(tokenizer_dir: Path | None) -> list[tuple[str, str]]:
    """(name, digest) of every regular file of the tokenizer directory, sorted by name."""
    if tokenizer_dir is None or not tokenizer_dir.is_dir():
        return []
    return [(p.name, file_digest(p)) for p in sorted(tokenizer_dir.iterdir()) if p.is_file()]


def engine_fingerprint(weights: Iterable[str], tokenizer: Iterable[tuple[str, str]], layout: KvLayout,
                       model_dtype: str) -> bytes:
    """FINGERPRINT_BYTES of blake2b over the format version, weight and tokenizer digests, dtype and layout."""
    doc = {"format": TIER_FORMAT_VERSION, "weights": list(weights), "tokenizer": [list(t) for t in tokenizer],
           "dtype": model_dtype, "layout": layout.describe()}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=FINGERPRINT_BYTES).digest()


def fingerprint_engine_files(weights_path: Path, tokenizer_dir: Path | None, layout: KvLayout,
                             model_dtype: str) -> bytes:
    """The fingerprint of an engine on disk (weights file and tokenizer directory)."""
    return engine_fingerprint([weights_digest(weights_path)], tokenizer_digests(tokenizer_dir), layout, model_dtype)
