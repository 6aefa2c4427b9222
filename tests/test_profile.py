"""Profiles load from TOML; every bad key, type or range is an error naming file, key and range."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtprompt.errors import ProfileError
from trtprompt.profile import KEYS, Profile, load_profile, shipped_profiles


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_profiles_load() -> None:
    assert shipped_profiles() == ["chat", "code-complete", "cpu-dev", "offline-batch", "rag-long"]
    for name in shipped_profiles():
        profile = load_profile(name)
        assert profile.name == name and profile.description


def test_cpu_dev_values() -> None:
    p = load_profile("cpu-dev")
    assert (p.max_batch_size, p.max_seq_len, p.max_num_tokens, p.tokens_per_block) == (16, 2048, 512, 32)
    assert p.enable_chunked_context and p.enable_kv_cache_reuse
    assert p.batch_scheduler_policy == "guaranteed_no_evict"
    assert (p.max_tokens_in_paged_kv_cache, p.max_queue_size, p.dtype) == (32768, 64, "float32")
    assert p.max_input_len is None and p.opt_num_tokens is None  # unset bounds are None


def test_defaults_are_trtllm_defaults() -> None:
    p = Profile()
    assert (p.max_batch_size, p.max_beam_width, p.tokens_per_block, p.kv_cache_free_gpu_mem_fraction) == (
        2048, 1, 32, 0.9)
    assert not p.enable_chunked_context and p.enable_kv_cache_reuse and not p.multiple_profiles
    assert (p.overflow, p.keep_turns, p.output_reserve, p.require_cache_salt) == ("reject", None, None, False)


def test_load_by_path_and_sections(tmp_path: Path) -> None:
    path = _write(tmp_path, 'description = "x"\n[build]\nmax_batch_size = 3\n'
                            '[runtime]\nkv_cache_free_gpu_mem_fraction = 1\n[prompt]\noverflow = "truncate_middle"\n')
    p = load_profile(str(path))
    assert (p.max_batch_size, p.kv_cache_free_gpu_mem_fraction, p.overflow, p.name) == (
        3, 1.0, "truncate_middle", "p")
    assert isinstance(p.kv_cache_free_gpu_mem_fraction, float)


@pytest.mark.parametrize("text, expected", [
    ("[build]\nmax_batch_sise = 4\n", "unknown key build.max_batch_sise"),
    ("[runtime]\nmax_batch_size = 4\n", "unknown key runtime.max_batch_size"),
    ("[engine]\nx = 1\n", "unknown key 'engine'"),
    ("[build]\nmax_batch_size = 0\n", "build.max_batch_size must be an integer in [1, 65536], got 0"),
    ("[build]\nmax_batch_size = \"8\"\n", "build.max_batch_size must be an integer in [1, 65536], got '8' (str)"),
    ("[build]\nmax_batch_size = true\n", "build.max_batch_size must be an integer"),
    ("[build]\nmax_seq_len = 1\n", "build.max_seq_len must be an integer in [2, 1073741824] (or unset), got 1"),
    ("[build]\ntokens_per_block = 48\n", "build.tokens_per_block must be a power of two in [1, 1024], got 48"),
    ("[build]\ndtype = \"float64\"\n", "build.dtype must be one of auto, float32, bfloat16, float16 (or unset)"),
    ("[runtime]\nkv_cache_free_gpu_mem_fraction = 1.5\n",
     "runtime.kv_cache_free_gpu_mem_fraction must be a number in (0, 1], got 1.5"),
    ("[runtime]\nenable_chunked_context = 1\n", "runtime.enable_chunked_context must be true or false"),
    ("[prompt]\noverflow = \"drop\"\n",
     "prompt.overflow must be one of reject, truncate_middle, truncate_left, got 'drop'"),
    ("[build\n", "not valid TOML"),
])
def test_bad_profiles_name_file_key_and_range(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_unknown_name_lists_shipped() -> None:
    with pytest.raises(ProfileError, match="unknown profile 'nope'; shipped profiles: chat, code-complete"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile("/no/such/profile.toml")


def test_overrides_win_and_are_checked() -> None:
    p = load_profile("cpu-dev").with_overrides(max_seq_len=1024, max_batch_size=None, dtype="bfloat16")
    assert (p.max_seq_len, p.max_batch_size, p.dtype) == (1024, 16, "bfloat16")
    with pytest.raises(ProfileError, match="command-line option: build.tokens_per_block must be a power of two"):
        p.with_overrides(tokens_per_block=24)
    with pytest.raises(ProfileError, match="unknown profile key"):
        p.with_overrides(nonsense=1)


def test_every_key_is_a_field_and_serialised() -> None:
    d = Profile().to_dict()
    assert set(KEYS) <= set(d) and d["name"] == "default"
    assert set(Profile().section("runtime")) == {
        "enable_chunked_context", "enable_kv_cache_reuse", "batch_scheduler_policy",
        "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache", "max_queue_size",
        "max_queue_delay_microseconds"}
