"""Tier keys: the engine fingerprint followed by the pool's chained block hash.

The block hash (engine/block_pool.py: blake2b-128 chained over each full block's token ids,
the request's cache salt mixed into block 0) already names a block's content within one
engine; the fingerprint (fingerprint.py) names the engine. 16 + 16 bytes; stores spell them
as 64 hex characters. Layout: docs/prefix-pool.md ("Keys").
"""

from __future__ import annotations

from trtprompt.engine.tiers.fingerprint import FINGERPRINT_BYTES

BLOCK_HASH_BYTES = 16
KEY_BYTES = FINGERPRINT_BYTES + BLOCK_HASH_BYTES


def tier_key(fingerprint: bytes, block_hash: bytes) -> bytes:
    if len(fingerprint) != FINGERPRINT_BYTES or len(block_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"a tier key is a {FINGERPRINT_BYTES}-byte fingerprint and a {BLOCK_HASH_BYTES}-byte "
                         f"block hash, got {len(fingerprint)} and {len(block_hash)} bytes")
    return fingerprint + block_hash
