"""The knob registry: every layer derives from it, and the derived forms agree with it."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import click
import pytest

from trtprompt import knobs, rules
from trtprompt.cli import main
from trtprompt.cli_knobs import BUILD_OPTIONS, SERVE_OPTIONS
from trtprompt.engine.config import KvCacheConfig, SchedulerConfig
from trtprompt.engine.loader import LOWERABLE_BOUNDS, RUNTIME_KEYS
from trtprompt.knobs import KNOBS
from trtprompt.knobs_doc import DOC_PATH, reference
from trtprompt.profile import Profile
from trtprompt.serve.engine_process.server import engine_overrides
from trtprompt.serve.launch.options import ServeOptions
from trtprompt.serve.launch.trtllm_model_config import MODEL_KNOBS, TrtllmModelParams


def _options(command: click.Command, path: str) -> Iterator[tuple[str, click.Option]]:
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _options(sub, f"{path} {name}")
    for param in command.params:
        if isinstance(param, click.Option):
            yield path, param


def test_every_cli_option_of_every_command_has_help() -> None:
    options = list(_options(main, "trtprompt"))
    assert len(options) > 90  # every command's, not a few
    missing = [f"{path} {'/'.join(opt.opts)}" for path, opt in options if not (opt.help or "").strip()]
    assert missing == []


def test_committed_profile_reference_is_the_generated_one() -> None:
    # Regenerate with `python -m trtprompt.knobs_doc` after changing trtprompt/knobs.py.
    assert DOC_PATH.read_text(encoding="utf-8") == reference()


@pytest.mark.parametrize("name", list(KNOBS))
def test_each_default_passes_its_own_bounds(name: str) -> None:
    knob = KNOBS[name]
    assert knob.section in knobs.STAGES and knob.help.strip()
    assert knob.check(knob.default) == knob.default


def test_bounds_and_their_messages() -> None:
    fraction = KNOBS["kv_cache_free_gpu_mem_fraction"]
    assert fraction.check(1) == 1.0 and isinstance(fraction.check(1), float)
    for bad in (0, 0.0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=r"kv_cache_free_gpu_mem_fraction must be a number in \(0, 1\]"):
            fraction.check(bad)
    with pytest.raises(ValueError, match=r"^build.tokens_per_block must be a power of two in \[1, 1024\], got 48$"):
        KNOBS["tokens_per_block"].check(48, qualified=True)
    with pytest.raises(ValueError, match=r"max_queue_size must be a positive integer \(or unset\), got 0"):
        KNOBS["max_queue_size"].check(0)
    assert KNOBS["max_queue_size"].check(None) is None
    with pytest.raises(ValueError, match="max_batch_size must be an integer in"):
        KNOBS["max_batch_size"].check(None)
    assert KNOBS["max_batch_size"].check(None, runtime=True) is None  # at runtime: the engine's value
    with pytest.raises(ValueError, match="knob x: declare low and high together"):
        knobs.Knob("x", "build", int, 1, "An example.", low=1)


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_profile_and_serve_options_are_the_registry() -> None:
    assert _defaults(Profile) == {**{n: KNOBS[n].default for n in knobs.PROFILE_KEYS},
                                  "name": "default", "description": ""}
    # lora_modules (serve --lora-modules NAME=DIR, repeatable) is the one serve option that is not a knob.
    assert {f: d for f, d in _defaults(ServeOptions).items() if f != "lora_modules"} == \
        {n: KNOBS[n].runtime_default for n in knobs.SERVE_KEYS}
    assert ServeOptions().max_batch_size is None and ServeOptions().cancellation_check_period_ms == 100
    params = _defaults(TrtllmModelParams)
    assert {n: params[n] for n in MODEL_KNOBS} == {n: KNOBS[n].default for n in MODEL_KNOBS}
    with pytest.raises(ValueError, match="stats_check_period_ms must be a positive integer, got 0"):
        ServeOptions(stats_check_period_ms=0)


def test_engine_keys_come_from_the_registry() -> None:
    assert set(RUNTIME_KEYS) == {"enable_chunked_context", "enable_kv_cache_reuse", "batch_scheduler_policy",
                                 "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache",
                                 "max_queue_size"}
    assert set(LOWERABLE_BOUNDS) == {"max_batch_size", "max_num_tokens"}
    assert set(BUILD_OPTIONS) <= set(knobs.PROFILE_KEYS) and set(SERVE_OPTIONS) <= set(knobs.SERVE_KEYS)
    assert KvCacheConfig(max_tokens_in_paged_kv_cache=64).kv_cache_free_gpu_mem_fraction == 0.9
    assert SchedulerConfig(4, 64, 128).batch_scheduler_policy == KNOBS["batch_scheduler_policy"].default


def test_engine_process_reads_back_what_the_parameters_say() -> None:
    params = {"enable_kv_cache_reuse": "false", "enable_chunked_context": "true", "triton_max_batch_size": "16",
              "max_num_tokens": "512", "max_queue_size": "", "kv_cache_free_gpu_mem_fraction": "0.5",
              "max_tokens_in_paged_kv_cache": "32768", "batch_scheduler_policy": "max_utilization",
              "cancellation_check_period_ms": "100"}
    assert engine_overrides(params) == {
        "enable_kv_cache_reuse": False, "enable_chunked_context": True, "max_batch_size": 16,
        "max_num_tokens": 512, "kv_cache_free_gpu_mem_fraction": 0.5, "max_tokens_in_paged_kv_cache": 32768,
        "batch_scheduler_policy": "max_utilization"}


def test_max_input_len_rule() -> None:
    assert rules.max_input_len(2048, 512, False) == 512
    assert rules.max_input_len(2048, 512, True) == 2047
    assert rules.max_input_len(2048, 4096, False) == 2047


def test_runtime_may_lower_a_build_bound_never_raise_it() -> None:
    build = {"max_batch_size": 16, "max_num_tokens": 512, "max_beam_width": 1}
    assert rules.raised_bounds({"max_batch_size": 16, "max_num_tokens": 8, "max_beam_width": None}, build) == []
    assert rules.raised_bounds({"max_batch_size": 17, "max_beam_width": 2}, build) == [
        "max_batch_size=17 exceeds the engine's build-time max_batch_size (16); runtime values may lower "
        "build bounds, never raise them",
        "max_beam_width=2 exceeds the engine's build-time max_beam_width (1); runtime values may lower "
        "build bounds, never raise them"]


def test_kv_pool_rule() -> None:
    # 1000 tokens of 32 -> 31 blocks; a 1 MiB budget at 0.5 and 1 KiB per token -> 512 tokens.
    assert rules.kv_pool(1024, 32, 1000, 0.9, None) == (1000, 31)
    assert rules.kv_pool(1024, 32, None, 0.5, 1 << 20) == (512, 16)
    assert rules.kv_pool(1024, 32, None, 0.9, None) is None
    # 2 sequences of 100 tokens use at most 2 x 4 blocks: more would be waste.
    assert rules.kv_pool(1024, 32, 1000, 0.9, None, max_batch_size=2, max_seq_len=100) == (256, 8)


def test_paged_context_rule() -> None:
    full = {"kv_cache_type": "PAGED", "plugin_config": {"use_paged_context_fmha": True, "paged_kv_cache": True}}
    assert rules.paged_context_missing(full) == []
    assert rules.paged_context_missing({"plugin_config": {"use_paged_context_fmha": True}}) == []
    assert rules.paged_context_missing({**full, "kv_cache_type": "CONTINUOUS"}) == ["paged_kv_cache"]
    assert rules.paged_context_missing({"plugin_config": {"paged_kv_cache": False}}) == [
        "use_paged_context_fmha", "paged_kv_cache"]


def test_a_knob_field_that_drifts_from_the_registry_is_refused_at_import() -> None:
    with pytest.raises(TypeError, match=r"Bad\.max_queue_size must be declared `int \| None = None`"):
        @knobs.knob_fields(("max_queue_size",))
        @dataclasses.dataclass(frozen=True)
        class Bad:
            max_queue_size: int | None = 7
    with pytest.raises(TypeError, match=r"Missing\.max_queue_size must be declared .* got missing"):
        @knobs.knob_fields(("max_queue_size",))
        @dataclasses.dataclass(frozen=True)
        class Missing:
            other: int = 1
