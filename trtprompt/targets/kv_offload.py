"""What the host and disk offload serve knobs mean on each target, and which TensorRT-LLM release takes them.

One place for the rules (docs/prefix-pool.md, "TensorRT-LLM targets"):

  torch   its KV pool already lives in host memory: a host tier would be a second copy in the same
          memory, so kv_cache_host_memory_bytes, kv_cache_onboard_blocks = false and the two priority
          thresholds are refused; its tiers below the pool are disk_cache_path and kv_remote_url.
  trtllm  TensorRT-LLM 1.2 engines: tensorrtllm_backend's tensorrt_llm model parameters
          kv_cache_host_memory_bytes and kv_cache_onboard_blocks (trtllm_model_config.py writes them);
          1.2's backend reads no offload priority and has no disk tier.
  llmapi  TensorRT-LLM 1.3+: KvCacheConfig fields in model.yaml, each only where the release has it
          (LLMAPI_FIELDS_SINCE); a field the release lacks is refused naming the knob and the release.

Standard library plus `packaging` (a transformers dependency, there wherever trtprompt runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from packaging.version import InvalidVersion, Version

from trtprompt.knobs import KNOBS

# The knobs this module rules on (trtprompt/knobs.py), with the "off" value of each.
OFFLOAD_OFF: Mapping[str, Any] = {"kv_cache_host_memory_bytes": 0, "kv_cache_onboard_blocks": True,
                                  "secondary_offload_min_priority": None, "cold_tier_offload_min_priority": None}
# KvCacheConfig field -> the first release whose reference we read it in ("1.3.0rc0": every LLM API release
# this project serves). Read in TensorRT-LLM's versioned API reference (1.3.0rc27, 1.4.0rc4) and source;
# tests/fixtures/trtllm_offload_names.json records where. onboard_blocks is in none of them.
LLMAPI_FIELDS_SINCE: Mapping[str, str] = {
    "host_cache_size": "1.3.0rc0",
    "secondary_offload_min_priority": "1.3.0rc0",
    "disk_cache_path": "1.3.0rc27",
    "disk_cache_size": "1.3.0rc27",
    "use_kv_cache_manager_v2": "1.3.0rc27",
    "disk_write_through": "1.4.0rc4",
    "cold_tier_offload_min_priority": "1.4.0rc4",
}
NEWEST_READ = "1.4.0rc4"  # the release assumed where TensorRT-LLM is not installed (`serve --repo-only` here)
DOC = "docs/prefix-pool.md, \"TensorRT-LLM targets\""


def _set(opts: Any, name: str) -> bool:
    return bool(getattr(opts, name) != OFFLOAD_OFF[name])


def _torch_problem(opts: Any) -> str | None:
    if opts.kv_cache_host_memory_bytes:
        return ("kv_cache_host_memory_bytes sets TensorRT-LLM's host tier below its GPU pool; the torch target's "
                "KV pool already lives in host memory, so a host tier would be a second copy in the same memory: "
                "leave it 0 and use --disk-cache-path or --kv-remote-url for tiers below the pool")
    for name in ("kv_cache_onboard_blocks", "secondary_offload_min_priority", "cold_tier_offload_min_priority"):
        if _set(opts, name):
            return (f"{name} is a TensorRT-LLM host/disk tier setting; the torch target has no such tier (its "
                    f"pool is in host memory; its write policy is kv_tier_write_policy): leave it unset ({DOC})")
    return None


def _trtllm_problem(opts: Any) -> str | None:
    if opts.disk_cache_path is not None or opts.cold_tier_offload_min_priority is not None:
        return ("disk_cache_path and cold_tier_offload_min_priority set a disk KV tier, which TensorRT-LLM 1.2 "
                "engines (the trtllm target) do not have: leave them unset, or build for the LLM API "
                f"(--trtllm-api llmapi, TensorRT-LLM >= 1.3) ({DOC})")
    if opts.secondary_offload_min_priority is not None:
        return ("secondary_offload_min_priority is not read by TensorRT-LLM 1.2's tensorrtllm backend (its "
                "tensorrt_llm model passes no offload priority to the executor): leave it unset, or build for "
                f"the LLM API (--trtllm-api llmapi) ({DOC})")
    return _needs_host_tier(opts)


def _needs_host_tier(opts: Any) -> str | None:
    if opts.kv_cache_host_memory_bytes:
        return None
    for name in ("secondary_offload_min_priority", "kv_cache_onboard_blocks"):
        if _set(opts, name):
            return f"{name} applies to the host tier: set --kv-cache-host-memory-bytes too"
    return None


def _llmapi_problem(opts: Any) -> str | None:
    if not opts.kv_cache_onboard_blocks:
        return ("kv_cache_onboard_blocks = false has no LLM API equivalent: TensorRT-LLM 1.3+'s KvCacheConfig has "
                "no onboard_blocks field (host-tier blocks are always brought back to the GPU): leave it on")
    if opts.disk_cache_path is None and opts.cold_tier_offload_min_priority is not None:
        return "cold_tier_offload_min_priority applies to the disk tier: set --disk-cache-path too"
    if opts.disk_cache_path is not None and opts.kv_tier_write_policy == "selective":
        return ("kv_tier_write_policy = selective has no TensorRT-LLM equivalent (its disk tier takes "
                "disk_write_through, on or off): use write_through or write_back, and "
                "--cold-tier-offload-min-priority to keep only prioritized blocks")
    return _needs_host_tier(opts)


def target_problem(target: str, opts: Any) -> str | None:
    """Why these serve options cannot run on this target (one sentence naming the knob), or None.
    Release-dependent fields are checked when model.yaml is written (llmapi_offload_args)."""
    if target == "torch":
        return _torch_problem(opts)
    if target == "trtllm":
        return _trtllm_problem(opts)
    return _llmapi_problem(opts)


def parse_release(version: str | None) -> Version:
    """The release to check fields against: the installed one, else NEWEST_READ."""
    try:
        return Version(version or NEWEST_READ)
    except InvalidVersion as exc:
        raise ValueError(f"cannot read TensorRT-LLM's version {version!r}: {exc}") from exc


def _require(field: str, knob: str, release: Version, instead: str = "") -> None:
    since = Version(LLMAPI_FIELDS_SINCE[field])
    if release < since:
        raise ValueError(f"{knob} needs KvCacheConfig.{field}, which TensorRT-LLM {release} does not have (first "
                         f"read in {since}): {instead or f'leave {knob} unset'}, or serve with a newer release "
                         f"({DOC})")


def _disk_args(opts: Any, release: Version) -> dict[str, Any]:
    _require("disk_cache_path", "disk_cache_path", release)
    # TensorRT-LLM uses the disk tier only with KV cache manager v2 ("auto" may pick v1, leaving it unused).
    # Absolute: TensorRT-LLM checks the directory exists from the Triton model's working directory.
    args: dict[str, Any] = {"disk_cache_path": str(Path(opts.disk_cache_path).expanduser().absolute()),
                            "disk_cache_size": opts.disk_cache_size, "use_kv_cache_manager_v2": True}
    if release >= Version(LLMAPI_FIELDS_SINCE["disk_write_through"]):
        args["disk_write_through"] = opts.kv_tier_write_policy == "write_through"
    elif opts.kv_tier_write_policy != "write_back":  # a release without the field cannot be asked to write through
        _require("disk_write_through", f"kv_tier_write_policy = {opts.kv_tier_write_policy}", release,
                 "serve with --kv-tier-write-policy write_back (the disk tier then takes what the release gives it)")
    if opts.cold_tier_offload_min_priority is not None:
        _require("cold_tier_offload_min_priority", "cold_tier_offload_min_priority", release)
        args["cold_tier_offload_min_priority"] = opts.cold_tier_offload_min_priority
    return args


def llmapi_offload_args(opts: Any, version: str | None) -> dict[str, Any]:
    """The kv_cache_config fields model.yaml gets for these serve options on this release (target_problem
    has already passed them); nothing when every offload knob is off."""
    release = parse_release(version)
    args: dict[str, Any] = {}
    if opts.kv_cache_host_memory_bytes:
        args["host_cache_size"] = opts.kv_cache_host_memory_bytes
    if opts.secondary_offload_min_priority is not None:
        args["secondary_offload_min_priority"] = opts.secondary_offload_min_priority
    if opts.disk_cache_path is not None:
        args |= _disk_args(opts, release)
    return args


def _where(target: str, name: str) -> str:
    knob = KNOBS[name]
    if target == "torch":
        return "refused: the torch pool is already in host memory"
    if target == "trtllm":
        if knob.trtllm is None:
            return "refused: TensorRT-LLM 1.2's backend does not read it"
        return f"tensorrt_llm parameter {knob.trtllm or name}"
    if knob.llmapi is None:
        return "refused when off: the LLM API has no such field"
    field = str(knob.llmapi).split(".")[-1]
    return f"model.yaml {knob.llmapi} (TensorRT-LLM >= {LLMAPI_FIELDS_SINCE[field]})"


def inspect_rows(target: str) -> dict[str, str]:
    """What `inspect` shows: each offload knob's default and where `serve` puts it on this target."""
    return {name: f"{KNOBS[name].default} -> {_where(target, name)}" for name in OFFLOAD_OFF}
