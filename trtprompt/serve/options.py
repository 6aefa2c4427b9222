"""What `trtprompt serve` runs with: the engine's recorded runtime policy,
CLI overrides on top, checked against what the engine was built to allow.

Names are the TensorRT-LLM backend's config.pbtxt parameter names, so the
same values land in the model repository for either target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.engine.config import check_runtime_policy
from trtprompt.engine_dir import EngineDir

LAYOUTS = ("fused", "upstream")
DISABLE_FLAGS = {"enable_chunked_context": "--disable-chunked-context",
                 "enable_kv_cache_reuse": "--disable-kv-cache-reuse"}


# The serve layer's name for an engine directory; read with EngineInfo.read(path, tokenizer=None),
# which is trtprompt.engine_dir.read_engine_dir (one reader for every consumer).
EngineInfo = EngineDir


@dataclass(frozen=True)
class ServeOptions:
    """Runtime values for one server; None means "the engine's default"."""

    enable_chunked_context: bool = False
    enable_kv_cache_reuse: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_tokens_in_paged_kv_cache: int | None = None
    max_queue_size: int | None = None
    max_queue_delay_microseconds: int | None = None
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_beam_width: int = 1
    exclude_input_in_output: bool = False
    cancellation_check_period_ms: int = 50
    stats_check_period_ms: int = 100
    layout: str = "fused"

    def __post_init__(self) -> None:
        check_runtime_policy(self.batch_scheduler_policy, self.kv_cache_free_gpu_mem_fraction)
        for name in ("max_tokens_in_paged_kv_cache", "max_queue_size", "max_batch_size",
                     "max_num_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_queue_delay_microseconds is not None and self.max_queue_delay_microseconds < 0:
            raise ValueError("max_queue_delay_microseconds must be >= 0, "
                             f"got {self.max_queue_delay_microseconds}")
        for name in ("cancellation_check_period_ms", "stats_check_period_ms", "max_beam_width"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    def engine_overrides(self) -> dict[str, Any]:
        """The keyword arguments LLMEngine.from_engine_dir takes."""
        keys = ("enable_chunked_context", "enable_kv_cache_reuse", "batch_scheduler_policy",
                "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache", "max_queue_size",
                "max_batch_size", "max_num_tokens")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def resolve_options(engine: EngineInfo, overrides: Mapping[str, Any]) -> ServeOptions:
    """Engine's recorded runtime policy, then CLI overrides (None = not given)."""
    fields = ServeOptions.__dataclass_fields__
    values = {k: v for k, v in engine.runtime.items() if k in fields and v is not None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown serve option(s): {', '.join(unknown)}")
    opts = ServeOptions(**values)
    check_engine_allows(engine, opts)
    return opts


def check_engine_allows(engine: EngineInfo, opts: ServeOptions) -> None:
    """Refuse runtime flags the engine was not built for (TensorRT-LLM's rules)."""
    build, plugin = engine.build_config, engine.plugin_config
    paged_kv = bool(plugin.get("paged_kv_cache", True)) and build.get("kv_cache_type", "PAGED") == "PAGED"
    needs = {"use_paged_context_fmha": bool(plugin.get("use_paged_context_fmha")),
             "paged_kv_cache": paged_kv}
    for flag in ("enable_chunked_context", "enable_kv_cache_reuse"):
        if not getattr(opts, flag):
            continue
        for need, present in needs.items():
            if not present:
                raise ValueError(
                    f"{flag} needs an engine built with plugin_config.{need}, and "
                    f"{engine.path / 'config.json'} has it off: rebuild the engine or serve with "
                    f"{DISABLE_FLAGS[flag]}")
    if opts.enable_kv_cache_reuse and build.get("gather_context_logits"):
        raise ValueError("enable_kv_cache_reuse cannot work with an engine built with "
                         "gather_context_logits; rebuild without it or serve with --disable-kv-cache-reuse")
    for key in ("max_batch_size", "max_num_tokens"):
        value, bound = getattr(opts, key), build.get(key)
        if value is not None and bound is not None and value > bound:
            raise ValueError(f"{key}={value} exceeds the engine's build-time {key} ({bound}); "
                             "runtime values may lower build bounds, never raise them")
    beam = build.get("max_beam_width", 1)
    if opts.max_beam_width > beam:
        raise ValueError(f"max_beam_width={opts.max_beam_width} exceeds the engine's build-time "
                         f"max_beam_width ({beam})")
    if engine.target == "torch" and opts.max_beam_width != 1:
        raise ValueError("max_beam_width must be 1 for the torch target (no beam search)")


DEFAULT_OPENAI_PORT = 8003  # next to Triton's 8000 (HTTP), 8001 (gRPC), 8002 (metrics)


@dataclass(frozen=True)
class OpenAIOptions:
    """The OpenAI-compatible front end `serve` runs beside tritonserver (trtprompt.serve.openai)."""

    port: int = DEFAULT_OPENAI_PORT
    api_key: str | None = None  # None: no authentication

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"openai port must be in [1, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")

    def check_ports(self, others: Mapping[str, int]) -> None:
        """Refuse a port that Triton already uses."""
        for name, port in others.items():
            if port == self.port:
                raise ValueError(f"--openai-port {self.port} is already the {name} port; pick another")
