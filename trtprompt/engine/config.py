"""Frozen configuration of the embedded engine.

User-facing names follow TensorRT-LLM (max_num_tokens, tokens_per_block,
enable_chunked_context, batch_scheduler_policy, ...); every bound is checked
when the object is made, so a bad value fails with the field's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from trtprompt import rules
from trtprompt.engine.kv_events import KvEventsConfig
from trtprompt.engine.lora.config import LoraConfig
from trtprompt.engine.speculation.config import SpeculationConfig
from trtprompt.engine.tiers.config import TierConfig
from trtprompt.knobs import CAPACITY_POLICIES, KNOBS

# An int8 KV row's float16 scale, stored after its head_size values (engine/attention_int8.py).
KV_INT8_SCALE_BYTES = 2

# Every architecture the engine runs, with the Hugging Face `model_type` that names it in a config.json
# without `architectures`: the one list (checkpoints, demo checkpoints and the trtllm target read it).
MODEL_TYPES: Mapping[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
})
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_TYPES.values())
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "compiled", "torch", "reference")
# The one default (EngineConfig, the engine-dir loader, tests): the compiled in-place kernel
# where it builds, else pure torch (attention.resolve_attention_backend).
DEFAULT_ATTENTION_BACKEND = "auto"


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = ["CAPACITY_POLICIES", "ATTENTION_BACKENDS", "DEFAULT_ATTENTION_BACKEND", "SUPPORTED_ARCHITECTURES",
           "ModelConfig", "KvCacheConfig", "SchedulerConfig", "EngineConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape, read from the engine's `pretrained_config`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    max_position_embeddings: int
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None.
    rotary_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    attn_bias: bool = False
    qk_layernorm: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_size",
                     "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")

    @classmethod
    def from_pretrained_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: cfg[k] for k in names if k in cfg})

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token in every layer: head_size values of dtype_bytes per kv head, or with
        kv_cache_dtype int8 one byte each plus a 2-byte scale (engine/attention_int8.py)."""
        row = self.head_size + KV_INT8_SCALE_BYTES if kv_cache_dtype == "int8" else self.head_size * dtype_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * row


@dataclass(frozen=True)
class KvCacheConfig:
    """Size and reuse of the paged KV cache.

    The pool holds `max_tokens_in_paged_kv_cache` tokens when set, else
    `kv_cache_free_gpu_mem_fraction` of `memory_budget_bytes`; with both,
    the smaller wins (TensorRT-LLM's rule).
    """

    tokens_per_block: int = KNOBS["tokens_per_block"].default
    enable_block_reuse: bool = KNOBS["enable_kv_cache_reuse"].default
    max_tokens_in_paged_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float = KNOBS["kv_cache_free_gpu_mem_fraction"].default
    memory_budget_bytes: int | None = None
    eviction_policy: str = KNOBS["kv_cache_eviction_policy"].default
    kv_cache_dtype: str = KNOBS["kv_cache_dtype"].default  # "int8": engine/attention_int8.py

    def __post_init__(self) -> None:
        KNOBS["kv_cache_eviction_policy"].check(self.eviction_policy)
        KNOBS["kv_cache_dtype"].check(self.kv_cache_dtype)
        for name in ("tokens_per_block", "max_tokens_in_paged_kv_cache", "kv_cache_free_gpu_mem_fraction"):
            KNOBS[name].check(getattr(self, name))
        _positive("memory_budget_bytes", self.memory_budget_bytes, allow_none=True)
        if self.max_tokens_in_paged_kv_cache is None and self.memory_budget_bytes is None:
            raise ValueError("set max_tokens_in_paged_kv_cache or memory_budget_bytes")

    def num_blocks(self, bytes_per_token: int, max_batch_size: int | None = None,
                   max_seq_len: int | None = None) -> int:
        """The pool's blocks (rules.kv_pool; given the scheduler's bounds, capped by them)."""
        pool = rules.kv_pool(bytes_per_token, self.tokens_per_block, self.max_tokens_in_paged_kv_cache,
                             self.kv_cache_free_gpu_mem_fraction, self.memory_budget_bytes, max_batch_size, max_seq_len)
        assert pool is not None  # __post_init__ requires a token cap or a budget
        return pool[1]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    enable_chunked_context: bool = KNOBS["enable_chunked_context"].default
    batch_scheduler_policy: str = KNOBS["batch_scheduler_policy"].default
    # None: unbounded. Counts requests accepted but not yet finished
    # beyond those running, as TensorRT-LLM's executor does.
    max_queue_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "batch_scheduler_policy",
                     "max_queue_size"):
            KNOBS[name].check(getattr(self, name))
        if self.max_seq_len is None or self.max_num_tokens is None:
            raise ValueError("the engine needs max_seq_len and max_num_tokens")

    @property
    def max_input_len(self) -> int:
        return rules.max_input_len(self.max_seq_len, self.max_num_tokens, self.enable_chunked_context)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    kv_cache: KvCacheConfig
    scheduler: SchedulerConfig
    dtype: str = "float32"
    device: str = "cpu"
    # "onednn" (prepacked weights, fast on CPU) or "reference" (plain F.linear).
    linear_backend: str = "onednn"
    # One of ATTENTION_BACKENDS; "reference" is the gather path tests compare with.
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    # Disk and remote tiers below the KV pool (engine/tiers/, docs/prefix-pool.md); default: none.
    tiers: TierConfig = field(default_factory=TierConfig)
    # KV events for routers (engine/kv_events.py, docs/kv-events.md); None: off.
    kv_events: KvEventsConfig | None = None
    # Guided decoding's jump-forward (engine/guided.py): tokens a grammar forces are appended and computed as
    # one chunk. False: one step per token, as the peers do (the benchmark's baseline).
    guided_jump_forward: bool = True
    # Speculative decoding (engine/speculation/, docs/speculative-decoding.md); None: off.
    speculation: SpeculationConfig | None = None
    # LoRA adapters held and laid out (engine/lora/, docs/lora.md).
    lora: LoraConfig = field(default_factory=LoraConfig)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def kv_num_blocks(self, bytes_per_token: int) -> int:
        """The pool the engine allocates: the KV config's, capped by what the scheduler can use."""
        sched = self.scheduler
        return self.kv_cache.num_blocks(bytes_per_token, sched.max_batch_size, sched.max_seq_len)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.linear_backend not in ("onednn", "reference"):
            raise ValueError(f"linear_backend must be onednn or reference, got {self.linear_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
