"""A stored block: a fixed header, then the block's KV bytes.

    magic      4 bytes   b"TPKV"
    version    u16       TIER_FORMAT_VERSION
    reserved   u16       0
    key        32 bytes  fingerprint (16) + block hash (16): the entry names what it holds
    length     u64       payload bytes
    checksum   u32       crc32 of the payload
    payload    length bytes (KvLayout: per layer K then V, native little-endian dtype)

decode() checks all of it against the key that was asked for and the expected length; any
mismatch raises CodecError, which the tier turns into a miss and a deletion (docs/prefix-pool.md,
"Faults"). crc32 rather than a cryptographic hash: it guards against torn and flipped bytes;
whoever can write the store can forge any entry whatever the checksum (the threat model is in
docs/security.md), and crc32 runs at memory speed where blake2b would halve the read rate.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np

from trtprompt.engine.tiers.fingerprint import TIER_FORMAT_VERSION
from trtprompt.engine.tiers.keys import KEY_BYTES

# One block's KV bytes as the tiers pass them around: a flat uint8 array (a private copy, or a view of a read).
Payload = np.ndarray[Any, np.dtype[np.uint8]]
MAGIC = b"TPKV"
_HEADER = struct.Struct(f"<4sHH{KEY_BYTES}sQI")
HEADER_BYTES = _HEADER.size


class CodecError(ValueError):
    """A stored entry that is not the block asked for: truncated, corrupt, foreign or of another format."""


def encode(key: bytes, payload: bytes | memoryview) -> bytes:
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, TIER_FORMAT_VERSION, 0, key, view.nbytes, zlib.crc32(view))
    return header + view


def decode(key: bytes, data: bytes, expected_len: int) -> memoryview:
    """The payload of data (a view into it), or CodecError saying what is wrong."""
    if len(data) < HEADER_BYTES:
        raise CodecError(f"entry is {len(data)} bytes, shorter than its {HEADER_BYTES}-byte header")
    magic, version, _reserved, stored_key, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError("entry does not start with the block magic")
    if version != TIER_FORMAT_VERSION:
        raise CodecError(f"entry has format {version}, this engine reads {TIER_FORMAT_VERSION}")
    if stored_key != key:
        raise CodecError("entry holds another key (foreign engine or block)")
    if length != expected_len or len(data) != HEADER_BYTES + length:
        raise CodecError(f"entry holds {len(data) - HEADER_BYTES} payload bytes, header says {length}, "
                         f"the layout needs {expected_len}")
    payload = memoryview(data)[HEADER_BYTES:]
    if zlib.crc32(payload) != checksum:
        raise CodecError("entry checksum does not match its payload")
    return payload
