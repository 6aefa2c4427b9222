"""What `trtprompt serve` runs with: the engine's recorded runtime policy,
CLI overrides on top, checked against what the engine was built to allow.

Names are the TensorRT-LLM backend's config.pbtxt parameter names, so the
same values land in the model repository for either target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from trtprompt import knobs, rules
from trtprompt.client import API_KEY_ENV
from trtprompt.engine.compute_dtype import check_compute_dtype
from trtprompt.engine.engine_dir import EngineDir
from trtprompt.engine.kv_events import KV_EVENT_KNOBS, kv_events_config, offset_endpoint
from trtprompt.engine.request import MAX_SEQUENCES
from trtprompt.engine.tiers.redis_store import RedisTarget, remote_password
from trtprompt.interface import OPENAI_PORT
from trtprompt.secret_source import read_secret
from trtprompt.serve.openai import parser_options as PO
from trtprompt.targets import kv_offload

LAYOUTS = knobs.LAYOUTS
# "--disable-chunked-context", "--disable-kv-cache-reuse": the off half of each knob's flag.
DISABLE_FLAGS = {k: str(knobs.KNOBS[k].flag).split("/")[1] for k in ("enable_chunked_context", "enable_kv_cache_reuse")}


# The serve layer's name for an engine directory; read with EngineInfo.read(path, tokenizer=None),
# which is trtprompt.engine.engine_dir.read_engine_dir (one reader for every consumer).
EngineInfo = EngineDir


@knobs.knob_fields(knobs.SERVE_KEYS, runtime=True)
@dataclass(frozen=True)
class ServeOptions(knobs.BackendParams):
    """Runtime values for one server, one field per serve knob (trtprompt/knobs.py; knob_fields checks
    each field's type and default against it). max_batch_size and max_num_tokens: None means "the
    engine's build value".
    """

    max_batch_size: int | None = knobs.runtime_default("max_batch_size")
    max_num_tokens: int | None = knobs.runtime_default("max_num_tokens")
    engine_threads: int | None = knobs.runtime_default("engine_threads")
    compute_dtype: str | None = knobs.runtime_default("compute_dtype")  # the torch engine's (engine/compute_dtype.py)
    replicas: int = knobs.runtime_default("replicas")  # serve --replicas (serve/launch/replicas.py)
    # The torch engine's tiers below its KV pool (docs/prefix-pool.md).
    disk_cache_path: str | None = knobs.runtime_default("disk_cache_path")
    disk_cache_size: int = knobs.runtime_default("disk_cache_size")
    kv_remote_url: str | None = knobs.runtime_default("kv_remote_url")
    kv_remote_password_file: str | None = knobs.runtime_default("kv_remote_password_file")
    kv_tier_write_policy: str = knobs.runtime_default("kv_tier_write_policy")
    kv_cache_eviction_policy: str = knobs.runtime_default("kv_cache_eviction_policy")
    guided_jump_forward: bool = knobs.runtime_default("guided_jump_forward")  # the torch engine's (engine/guided.py)
    # Speculative decoding (engine/speculation/, docs/speculative-decoding.md): the torch engine's; the llmapi
    # target writes them as speculative_config.
    speculative_decoding: str = knobs.runtime_default("speculative_decoding")
    max_draft_len: int = knobs.runtime_default("max_draft_len")
    max_matching_ngram_size: int = knobs.runtime_default("max_matching_ngram_size")
    is_keep_all: bool = knobs.runtime_default("is_keep_all")
    is_use_oldest: bool = knobs.runtime_default("is_use_oldest")
    is_public_pool: bool = knobs.runtime_default("is_public_pool")
    speculation_max_concurrency: int | None = knobs.runtime_default("speculation_max_concurrency")
    speculative_model: str | None = knobs.runtime_default("speculative_model")
    # LoRA adapters held by the torch engine (engine/lora/manager.py; the llmapi target writes lora_config).
    max_loras: int = knobs.runtime_default("max_loras")
    max_cpu_loras: int = knobs.runtime_default("max_cpu_loras")
    # Not a knob: serve --lora-modules' adapters, (name, absolute directory) each (serve/launch/lora_modules.py).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # KV events for routers (trtprompt/engine/kv_events.py, docs/kv-events.md): read by the engine process.
    kv_events_endpoint: str | None = knobs.runtime_default("kv_events_endpoint")
    kv_events_replay_endpoint: str | None = knobs.runtime_default("kv_events_replay_endpoint")
    kv_events_topic: str | None = knobs.runtime_default("kv_events_topic")
    kv_events_layout: str = knobs.runtime_default("kv_events_layout")
    layout: str = knobs.runtime_default("layout")

    def __post_init__(self) -> None:
        knobs.check_all(self, knobs.SERVE_KEYS, runtime=True)


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


def kv_event_overrides(opts: ServeOptions) -> dict[str, Any]:
    """The KV event knobs as the engine takes them (engine/kv_events.kv_events_config)."""
    return {name: getattr(opts, name) for name in KV_EVENT_KNOBS}


def check_kv_event_endpoints(opts: ServeOptions) -> None:
    """A bad endpoint is refused now, naming it; replica i binds the endpoints offset by i
    (serve/launch/replicas.py): overlapping sets are refused too."""
    config = kv_events_config(kv_event_overrides(opts))
    if config is None or config.replay_endpoint is None:
        return
    pub = [offset_endpoint(config.endpoint, i) for i in range(opts.replicas)]
    replay = [offset_endpoint(config.replay_endpoint, i) for i in range(opts.replicas)]
    if set(pub) & set(replay):
        raise ValueError(f"with {opts.replicas} replicas the KV event endpoints {pub[0]}..{pub[-1]} and the "
                         f"replay endpoints {replay[0]}..{replay[-1]} overlap (replica i adds i to each port): "
                         "space kv_events_replay_endpoint further from kv_events_endpoint")


def check_engine_allows(engine: EngineInfo, opts: ServeOptions) -> None:
    """Refuse runtime flags the engine was not built for (TensorRT-LLM's rules)."""
    build = engine.build_config
    missing = rules.paged_context_missing(build)
    for flag in ("enable_chunked_context", "enable_kv_cache_reuse"):
        if getattr(opts, flag) and missing:
            raise ValueError(
                f"{flag} needs an engine built with plugin_config.{missing[0]}, and "
                f"{engine.path / 'config.json'} has it off: rebuild the engine or serve with "
                f"{DISABLE_FLAGS[flag]}")
    if opts.enable_kv_cache_reuse and build.get("gather_context_logits"):
        raise ValueError("enable_kv_cache_reuse cannot work with an engine built with "
                         "gather_context_logits; rebuild without it or serve with --disable-kv-cache-reuse")
    rules.check_not_raised({k: getattr(opts, k) for k in _build_bounds(engine)}, build)
    if engine.target != "torch" and opts.replicas != 1:
        raise ValueError(f"replicas runs several torch engine processes; this engine is for the {engine.target} "
                         "target: leave it at 1 (docs/replicas.md)")
    if engine.target != "torch" and opts.engine_threads is not None:
        raise ValueError("engine_threads sets the torch target's engine process threads; this engine is for "
                         f"the {engine.target} target, which has no such process: leave it unset")
    if opts.compute_dtype is not None:
        if engine.target != "torch":
            raise ValueError("compute_dtype sets the torch engine's arithmetic; this engine is for the "
                             f"{engine.target} target: leave it unset")
        check_compute_dtype(str(engine.pretrained_config.get("dtype", "float32")), opts.compute_dtype)
    if engine.target != "torch" and opts.kv_remote_url is not None:
        raise ValueError("kv_remote_url sets the torch engine's remote KV tier; this engine is for the "
                         f"{engine.target} target: leave it unset")
    offload = kv_offload.target_problem(engine.target, opts)  # host / disk tiers per target (docs/prefix-pool.md)
    if offload:
        raise ValueError(offload)
    if opts.kv_events_endpoint is not None or opts.kv_events_replay_endpoint is not None:
        if engine.target != "torch":
            raise ValueError("kv_events_endpoint publishes the torch engine's KV events; this engine is for the "
                             f"{engine.target} target: leave it unset")
        check_kv_event_endpoints(opts)
    if opts.kv_remote_url is not None:  # refused here, before the banner or a process could show a password
        RedisTarget.parse(opts.kv_remote_url)
        remote_password(opts.kv_remote_password_file)  # an unreadable or empty file: refused now, naming it
    _check_beam_width(engine, opts)


def _build_bounds(engine: EngineInfo) -> tuple[str, ...]:
    """The serve knobs bounded by the engine's build values. A torch engine compiles nothing per beam (its
    beams are sequences of the paged KV cache) and records max_beam_width 1: there it is a serve bound only."""
    if engine.target == "torch":
        return tuple(k for k in knobs.LOWERABLE_KEYS if k != "max_beam_width")
    return knobs.LOWERABLE_KEYS


def _check_beam_width(engine: EngineInfo, opts: ServeOptions) -> None:
    """The torch engine takes at most MAX_SEQUENCES sequences per request, its beams among them."""
    if engine.target == "torch" and opts.max_beam_width > MAX_SEQUENCES:
        raise ValueError(f"max_beam_width={opts.max_beam_width} exceeds the torch engine's {MAX_SEQUENCES} "
                         "sequences per request (each beam is one)")


@dataclass(frozen=True)
class OpenAIOptions:
    """The OpenAI-compatible front end `serve` runs beside tritonserver (trtprompt.serve.openai)."""

    port: int = OPENAI_PORT
    api_key: str | None = None  # None: no authentication
    # Largest request body (413 past it, before it is read); None: the front end sizes it from the
    # engine's max_input_len (trtprompt/serve/openai/http_limits.py).
    max_request_bytes: int | None = None
    # How tool calls and reasoning are parsed from chat answers (serve/openai/parser_options.py; "auto": the
    # chat template's family).
    tool_call_parser: str = PO.AUTO
    reasoning_parser: str = PO.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"openai port must be in [1, 65535], got {self.port!r}")
        PO.check_options(self.tool_call_parser, self.reasoning_parser)
        if self.max_request_bytes is not None and (isinstance(self.max_request_bytes, bool) or not isinstance(
                self.max_request_bytes, int) or self.max_request_bytes < 1):
            raise ValueError(f"max_request_bytes must be a positive integer, got {self.max_request_bytes!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")

    def check_ports(self, others: Mapping[str, int]) -> None:
        """Refuse a port that Triton already uses."""
        for name, port in others.items():
            if port == self.port:
                raise ValueError(f"--openai-port {self.port} is already the {name} port; pick another")


MAX_API_KEY_CHARS = 4096


@dataclass(frozen=True)
class ApiKey:
    """The one key of a server: Triton's HTTP and gRPC APIs (but health) and the OpenAI front end
    require it (docs/security.md). Never on a command line: read() takes a file or the environment."""

    value: str = field(repr=False)  # kept out of logs and tracebacks

    def __post_init__(self) -> None:
        if not 0 < len(self.value) <= MAX_API_KEY_CHARS:
            raise ValueError(f"the API key must be 1 to {MAX_API_KEY_CHARS} characters, got {len(self.value)}")
        # Visible ASCII only: it travels as an HTTP header and as gRPC metadata ("Bearer KEY").
        if not all("!" <= c <= "~" for c in self.value):
            raise ValueError("the API key must be printable ASCII without spaces (it is sent as a header)")

    @classmethod
    def read(cls, path: Path | None, env: Mapping[str, str]) -> "ApiKey | None":
        """The key in path (surrounding whitespace dropped), else env's TRTPROMPT_API_KEY; None: no key
        (an empty variable counts as unset; an empty file is refused)."""
        value = read_secret(path, env, API_KEY_ENV, "API key")
        return None if value is None else cls(value)
