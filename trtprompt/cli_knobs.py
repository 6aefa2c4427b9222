"""Click options made from the knob registry (trtprompt/knobs.py): flag, type, choices and help in one place.

Every option defaults to None, "not given": `build` then takes the
profile's value, `serve` the engine's recorded one.
"""

from __future__ import annotations

from typing import Any, Callable

import click

from trtprompt.engine.speculation.config import SPECULATION_KNOBS
from trtprompt.knobs import KNOBS, Knob, in_section

# The runtime policy `build` records and `serve` overrides: what the embedded engine takes.
RUNTIME_POLICY: tuple[str, ...] = tuple(k for k in in_section("runtime") if KNOBS[k].engine)
BUILD_OPTIONS: tuple[str, ...] = (*in_section("build"), *RUNTIME_POLICY, "overflow")
SERVE_OPTIONS: tuple[str, ...] = (*RUNTIME_POLICY, "max_batch_size", "max_num_tokens", "max_beam_width",
                                  "exclude_input_in_output",
                                  "cancellation_check_period_ms", "stats_check_period_ms", "engine_threads",
                                  "compute_dtype",
                                  "layout",
                                  "disk_cache_path", "disk_cache_size", "kv_remote_url", "kv_remote_password_file",
                                  "kv_tier_write_policy", "replicas",
                                  "kv_cache_eviction_policy", "guided_jump_forward",
                                  *SPECULATION_KNOBS,
                                  "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks",
                                  "secondary_offload_min_priority", "cold_tier_offload_min_priority",
                                  "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic",
                                  "kv_events_layout")


def option_help(knob: Knob, serve: bool) -> str:
    """The knob's help plus where an unset value comes from."""
    if not serve:
        return f"{knob.help} [profile: {knob.section}.{knob.name}]"
    if knob.lowerable:
        return f"{knob.help} May lower the engine's bound, never raise it."
    if knob.section == "serve":
        return f"{knob.help} Default: {knob.default}."
    return f"{knob.help} Default: the engine's recorded value."


def knob_option(knob: Knob, serve: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    flag = knob.flag or "--" + knob.name.replace("_", "-")
    kind: Any = click.Choice(list(knob.choices)) if knob.choices else knob.kind
    if knob.kind is bool:
        return click.option(flag, knob.name, default=None, help=option_help(knob, serve))
    return click.option(flag, knob.name, type=kind, default=None, help=option_help(knob, serve))


def knob_options(names: tuple[str, ...], serve: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding one option per knob, in the order given."""
    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        for name in reversed(names):
            command = knob_option(KNOBS[name], serve)(command)
        return command
    return add
