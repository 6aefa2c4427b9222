"""Tier keys, the fingerprint and the codec: what makes two engines share blocks or not."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest

from trtprompt.engine.tiers.codec import HEADER_BYTES, CodecError, decode, encode
from trtprompt.engine.tiers.fingerprint import (
    DIGEST_CACHE,
    TIER_FORMAT_VERSION,
    KvLayout,
    engine_fingerprint,
    file_digest,
    fingerprint_engine_files,
    weights_digest,
)
from trtprompt.engine.tiers.keys import KEY_BYTES, tier_key
from trtprompt.serve.engine_process.server import engine_overrides

LAYOUT = KvLayout(2, 2, 16, 8, "float32", 4)


def test_every_input_of_the_fingerprint_changes_it() -> None:
    base = engine_fingerprint(["w"], [("tokenizer.json", "t")], LAYOUT, "float32")
    assert len(base) == 16 and base == engine_fingerprint(["w"], [("tokenizer.json", "t")], LAYOUT, "float32")
    variants = [
        engine_fingerprint(["w2"], [("tokenizer.json", "t")], LAYOUT, "float32"),
        engine_fingerprint(["w"], [("tokenizer.json", "t2")], LAYOUT, "float32"),
        engine_fingerprint(["w"], [("tokenizer.json", "t")], LAYOUT, "bfloat16"),
        engine_fingerprint(["w"], [("tokenizer.json", "t")], KvLayout(2, 2, 16, 16, "float32", 4), "float32"),
        engine_fingerprint(["w"], [("tokenizer.json", "t")], KvLayout(3, 2, 16, 8, "float32", 4), "float32"),
        engine_fingerprint(["w"], [("tokenizer.json", "t")], KvLayout(2, 1, 16, 8, "float32", 4), "float32"),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_the_weights_digest_is_cached_beside_them_and_follows_their_content(tmp_path: Path) -> None:
    w = tmp_path / "rank0.safetensors"
    w.write_bytes(b"a" * 1000)
    first = weights_digest(w)
    assert first == file_digest(w)
    assert json.loads((tmp_path / DIGEST_CACHE).read_text())["digest"] == first
    w.write_bytes(b"b" * 1000)  # same size, new content (and mtime): recomputed
    second = weights_digest(w)
    assert second != first and second == file_digest(w)


def test_engines_on_two_machines_agree_and_other_tokenizers_do_not(tmp_path: Path) -> None:
    for machine in ("one", "two"):
        (tmp_path / machine / "tokenizer").mkdir(parents=True)
        (tmp_path / machine / "w.safetensors").write_bytes(b"weights")
        (tmp_path / machine / "tokenizer" / "tokenizer.json").write_text("{}")
    def of(machine: str) -> bytes:
        root = tmp_path / machine
        return fingerprint_engine_files(root / "w.safetensors", root / "tokenizer", LAYOUT, "float32")

    assert of("one") == of("two")  # the paths and machines differ, the content does not
    (tmp_path / "two" / "tokenizer" / "tokenizer.json").write_text('{"x": 1}')
    assert of("two") != of("one")


def test_a_tier_key_is_the_fingerprint_then_the_block_hash() -> None:
    key = tier_key(b"f" * 16, b"h" * 16)
    assert key == b"f" * 16 + b"h" * 16 and len(key) == KEY_BYTES
    with pytest.raises(ValueError, match="16-byte fingerprint"):
        tier_key(b"f" * 15, b"h" * 16)


def test_the_codec_round_trips_and_refuses_every_damage() -> None:
    key, other = b"k" * KEY_BYTES, b"o" * KEY_BYTES
    payload = bytes(range(256)) * 4
    data = encode(key, payload)
    assert len(data) == HEADER_BYTES + len(payload) and bytes(decode(key, data, len(payload))) == payload
    assert data[:4] == b"TPKV" and int.from_bytes(data[4:6], "little") == TIER_FORMAT_VERSION
    assert int.from_bytes(data[-len(payload) - 4:-len(payload)], "little") == zlib.crc32(payload)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    cases = {
        "checksum": bytes(flipped),
        "shorter": data[:-1],
        "header": data[:10],
        "another key": encode(other, payload),
        "magic": b"XXXX" + data[4:],
        "format": data[:4] + (TIER_FORMAT_VERSION + 1).to_bytes(2, "little") + data[6:],
    }
    for what, bad in cases.items():
        with pytest.raises(CodecError):
            decode(key, bad, len(payload))
    with pytest.raises(CodecError, match="layout needs"):
        decode(key, data, len(payload) + 4)  # another KV layout's block size


def test_the_engine_process_reads_the_tier_knobs_from_its_parameters() -> None:
    params = {"disk_cache_path": "/var/cache/kv", "disk_cache_size": "2097152",
              "kv_remote_url": "redis://127.0.0.1:6379/0", "kv_tier_write_policy": "selective"}
    assert engine_overrides(params) == {"disk_cache_path": "/var/cache/kv", "disk_cache_size": 2097152,
                                        "kv_remote_url": "redis://127.0.0.1:6379/0",
                                        "kv_tier_write_policy": "selective"}


def test_an_engine_dir_engine_opens_its_disk_tier_from_the_knobs(tiny_engine_dir: Path, tmp_path: Path) -> None:
    from trtprompt.engine.engine import LLMEngine

    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine_dir)  # the digest cache is written beside the weights
    engine = LLMEngine.from_engine_dir(engine_dir, disk_cache_path=str(tmp_path / "disk"),
                                       disk_cache_size=1 << 20, max_tokens_in_paged_kv_cache=4096)
    tiers = engine.kv.tiers
    assert tiers is not None and tiers.names == ["disk"] and tiers.write_policy == "write_through"
    assert tiers.stores[0].capacity == 1 << 20  # type: ignore[attr-defined]
    assert (engine_dir / DIGEST_CACHE).is_file()
    again = LLMEngine.from_engine_dir(engine_dir, disk_cache_path=str(tmp_path / "disk"),
                                      max_tokens_in_paged_kv_cache=4096)
    assert again.kv.tiers is not None and again.kv.tiers.fingerprint == tiers.fingerprint
    engine.close()
    again.close()
