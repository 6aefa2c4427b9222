"""Every build, runtime, prompt and serve knob, declared once.

Each knob has its name (TensorRT-LLM's spelling where TensorRT-LLM has
one), type, default (None: unset), bounds, one-line help, its TensorRT-LLM
name and the stage it belongs to. Profiles (profile.py), serve options
(serve/launch/options.py), the tensorrt_llm model's parameters
(serve/launch/trtllm_model_config.py), the engine's configuration (engine/config.py,
engine/loader.py), the engine process (serve/engine_process/server.py), the CLI
options (cli.py) and docs/profiles.md are all derived from this table.

Standard library only: the engine core, the serve layer and the CLI all
import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

BIG = 1 << 30  # "no practical upper bound" for token counts
STAGES: tuple[str, ...] = ("build", "runtime", "prompt", "serve")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# int8_w8a8: int8 weights per channel and activations per token (torch target; TensorRT-LLM's quant_algo
# W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN, unsmoothed). docs/quantization.md.
# int4_wo: int4 weights in groups of int4_group_size input columns, a float32 scale per group (torch target;
# TensorRT-LLM's quant_algo W4A16 with a group_size). docs/quantization.md, "int4_wo: the format".
QUANTIZATIONS: tuple[str, ...] = ("none", "int8_wo", "int8_w8a8", "int4_wo", "fp8", "int4_awq")
# The int4_wo group sizes the engine's kernel unpacks (multiples of 2 x 16 lanes). Declared here, not imported
# from engine/quant_int4.py, because this module is standard library only (the CLI and the Triton stubs import
# it without torch); tests/test_build_int4.py checks the two tuples are equal. int8_group_size takes the same
# sizes (the kernels' group loops step by whole vectors).
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
# auto: the engine's dtype; int8: int8 K/V with a float16 scale per (token, kv head) (torch target;
# TensorRT-LLM's kv_cache_quant_algo INT8, vLLM's --kv-cache-dtype). docs/quantization.md, "KV cache int8".
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8")
# config.json names each as TensorRT-LLM does (quantization.kv_cache_quant_algo): the build writes, the engine reads.
KV_CACHE_QUANT_ALGOS: dict[str, str | None] = {"auto": None, "int8": "INT8"}
# The torch target's speculative decoding (engine/speculation/): the llmapi target's decoding_type of each.
SPECULATIVE_MODES: tuple[str, ...] = ("none", "ngram", "draft_target")
LLMAPI_DECODING_TYPES: dict[str, str] = {"ngram": "NGram", "draft_target": "DraftTarget"}
# Above this many running requests speculation pauses (measured: docs/speculative-decoding.md, "Where it pauses").
SPECULATION_MAX_CONCURRENCY = 8
# The refusal of draft_target without its draft engine (the engine, serve and the llmapi target say the same).
NO_DRAFT_MODEL = "speculative_decoding draft_target needs speculative_model: the draft engine's directory"
CAPACITY_POLICIES: tuple[str, ...] = ("guaranteed_no_evict", "max_utilization")
# Strictest first (trtprompt/prompt/budget.py: a request may move left of its profile's policy, never right).
OVERFLOW_POLICIES: tuple[str, ...] = ("reject", "truncate_middle", "truncate_left")
LAYOUTS: tuple[str, ...] = ("fused", "upstream")
# Which cached free KV block the torch engine evicts first (trtprompt/engine/eviction.py; "lru": the reference).
EVICTION_POLICIES: tuple[str, ...] = ("lru", "2q", "s3fifo")
# What the build plan puts in place of an unset max_input_len / max_num_tokens (TensorRT-LLM's BuildConfig).
DEFAULT_MAX_INPUT_LEN = 1024
DEFAULT_MAX_NUM_TOKENS = 8192


def _power_of_two(value: Any) -> bool:
    return bool(value > 0 and value & (value - 1) == 0)


@dataclass(frozen=True)
class Knob:
    """One knob: what it is, what it may be, and who reads it."""

    name: str
    section: str  # one of STAGES: where the knob is set (a profile section, or `serve` only)
    kind: type  # bool, int, float or str
    default: Any  # None: unset
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, high] instead of [low, high]
    choices: tuple[Any, ...] | None = None  # values of `kind` (str, or int for int4_group_size)
    nullable: bool = False
    power_of_two: bool = False
    trtllm: str | None = None  # TensorRT-LLM's name: BuildConfig field, or tensorrt_llm config.pbtxt parameter
    # The LLM API's name (TensorRT-LLM 1.3+, PyTorch backend): a TorchLlmArgs field, dotted into its
    # nested configs (kv_cache_config.*, scheduler_config.*); tests/fixtures/trtllm_names.json records
    # where each was read.
    llmapi: str | None = None
    lowerable: bool = False  # a build bound a runtime value may lower, never raise
    runtime_unset: bool = False  # at runtime, unset (None) means "the engine's build value"
    engine: bool = False  # LLMEngine.from_engine_dir takes it as a runtime override
    serve: bool = False  # `trtprompt serve` takes it
    flag: str | None = None  # click spelling when not --name-with-dashes (booleans: "--on/--off")

    def __post_init__(self) -> None:
        if (self.low is None) != (self.high is None):
            raise ValueError(f"knob {self.name}: declare low and high together")

    @property
    def runtime_default(self) -> Any:
        return None if self.runtime_unset else self.default

    def allowed(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(map(str, self.choices))
        elif self.kind is bool:
            text = "true or false"
        elif self.kind is str:
            text = "a string"
        elif self.kind is float:
            text = f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        elif self.power_of_two:
            text = f"a power of two in [{int(self.low or 0)}, {int(self.high or 0)}]"
        elif self.low == 1 and self.high == BIG:
            text = "a positive integer"
        elif self.low == 0 and self.high == BIG:
            text = "a non-negative integer"
        else:
            text = f"an integer in [{int(self.low or 0)}, {int(self.high or 0)}]"
        return text + (" (or unset)" if self.nullable else "")

    def problem(self, value: Any) -> str | None:
        """None when value is acceptable, else what is wrong with it ("must be ..., got ...")."""
        if value is None:
            return None if self.nullable else f"must be {self.allowed()}, got None"
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            return f"must be {self.allowed()}, got {value!r} ({type(value).__name__})"
        if self.choices and value not in self.choices:
            return f"must be {self.allowed()}, got {value!r}"
        if not self._in_range(value) or (self.power_of_two and not _power_of_two(value)):
            return f"must be {self.allowed()}, got {value!r}"
        return None

    def _in_range(self, value: Any) -> bool:
        if self.low is None or self.high is None:
            return True
        above = self.low < value if self.low_open else self.low <= value
        return bool(above and value <= self.high)

    def check(self, value: Any, qualified: bool = False, runtime: bool = False) -> Any:
        """value (an int given for a float knob becomes a float), or ValueError naming the knob."""
        if value is None and runtime and self.runtime_unset:
            return None
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{self.section + '.' if qualified else ''}{self.name} {problem}")
        return float(value) if self.kind is float and value is not None else value

    def parse(self, text: str) -> Any:
        """A value as config.pbtxt holds it (a string), or None for an empty string."""
        if self.kind is bool:
            return text.strip().lower() == "true"
        if not text:
            return None
        return self.kind(text)


def _k(name: str, section: str, kind: type, default: Any, help: str, **more: Any) -> Knob:
    return Knob(name, section, kind, default, help, **more)


_TOKENS = dict(low=1, high=BIG, nullable=True)
KNOBS: dict[str, Knob] = {k.name: k for k in (
    # build bounds: TensorRT-LLM BuildConfig fields (trtllm-build flags)
    _k("max_batch_size", "build", int, 2048, "Most requests in one batch.", low=1, high=65536,
       trtllm="max_batch_size", llmapi="max_batch_size", lowerable=True, runtime_unset=True, engine=True, serve=True),
    _k("max_input_len", "build", int, None,
       f"Longest prompt the build allows (unset: min({DEFAULT_MAX_INPUT_LEN}, max_seq_len)).",
       trtllm="max_input_len", llmapi="max_input_len", **_TOKENS),
    _k("max_seq_len", "build", int, None, "Longest prompt + output (unset: the model's positions x rope factor).",
       low=2, high=BIG, nullable=True, trtllm="max_seq_len", llmapi="max_seq_len"),
    _k("max_num_tokens", "build", int, None,
       f"Most tokens in one engine step (unset: {DEFAULT_MAX_NUM_TOKENS}, capped by the plan).",
       trtllm="max_num_tokens", llmapi="max_num_tokens", lowerable=True, runtime_unset=True, engine=True, serve=True,
       **_TOKENS),
    _k("opt_num_tokens", "build", int, None, "Token count TensorRT tunes for (unset: max_batch_size x beam width).",
       trtllm="opt_num_tokens", **_TOKENS),
    _k("max_beam_width", "build", int, 1, ("Most beams per request (the torch target: set by serve, at most 128 "
       "sequences per request; its engines record 1)."), low=1, high=1024,
       trtllm="max_beam_width", llmapi="max_beam_width", lowerable=True, serve=True),
    _k("tokens_per_block", "build", int, 32, "Tokens per KV-cache block.", low=1, high=1024, power_of_two=True,
       trtllm="plugin_config.tokens_per_block", llmapi="kv_cache_config.tokens_per_block"),
    _k("multiple_profiles", "build", bool, False, "Build several TensorRT optimization profiles.",
       trtllm="multiple_profiles", flag="--multiple-profiles/--no-multiple-profiles"),
    _k("dtype", "build", str, None, "Engine dtype (unset or auto: the checkpoint's).", choices=DTYPES,
       nullable=True, trtllm="dtype", llmapi="dtype"),
    _k("quantization", "build", str, "none", "Weight quantization (int8_w8a8: int8 activations too; int4_wo: "
       "int4 weights in groups of int4_group_size, torch target).", choices=QUANTIZATIONS,
       trtllm="quantization.quant_algo"),
    # TensorRT-LLM's QuantConfig.group_size; the engine reads it back from config.json (engine/quant_int4.py).
    _k("int4_group_size", "build", int, 32, "int4_wo only: the int4_wo group size, TensorRT-LLM's group_size "
       "(input columns sharing one scale); smaller groups keep more quality and cost one float32 scale per group.",
       choices=INT4_GROUP_SIZES),
    # GGUF's Q8_0 layout with 32: int8 symmetric in groups of input columns. Recorded in config.json as
    # quantization.group_size beside quant_algo W8A16 (engine/quant_w8a8.py, quantize_int8_groups).
    _k("int8_group_size", "build", int, None, "int8_wo only: a float32 scale per group of this many input "
       "columns instead of one per output row (32: GGUF's Q8_0 layout); finer rounding for 4 / size bytes more "
       "per weight, 12.5 % with 32 (docs/quantization.md, 'int8 in groups'). Unset: a scale per row.",
       choices=INT4_GROUP_SIZES, nullable=True),
    # TensorRT-LLM's quantize_and_export(quantize_lm_head=...); OpenVINO's int8 export compresses lm_head too.
    _k("quantize_lm_head", "build", bool, False, "int8_wo only: lm_head in int8 as well, a scale per vocabulary "
       "row (a tied checkpoint keeps its float embedding beside the int8 copy): a one-request step reads ~a fifth "
       "fewer bytes on SmolLM2 float32, at a quality cost (docs/quantization.md, 'lm_head and embeddings').",
       flag="--quantize-lm-head/--no-quantize-lm-head"),
    # SmoothQuant's migration strength (targets/smoothquant.py, docs/quantization.md "SmoothQuant"): 0 puts all of
    # an outlier channel's range on the activations, 1 all of it on the weights.
    _k("smoothquant_alpha", "build", float, None, "int8_w8a8 only: SmoothQuant strength alpha, factors "
       "max|X|^alpha / max|W|^(1-alpha) per input channel from a calibration pass over shipped text (unset: "
       "searched per layer and linear).", low=0.0, high=1.0, nullable=True),
    # LoRA (engine/lora/, docs/lora.md): TensorRT-LLM's BuildConfig lora_config.max_lora_rank and the LLM API's
    # LoraConfig; the torch engine checks every adapter's rank against it.
    _k("max_lora_rank", "build", int, 64, "Largest LoRA rank an adapter of this engine may have.", low=1, high=1024,
       trtllm="lora_config.max_lora_rank", llmapi="lora_config.max_lora_rank"),
    _k("kv_cache_dtype", "build", str, "auto", "KV cache storage (int8: ~1.9x the tokens of bf16, ~3.9x of "
       "fp32 in one budget; torch target).", choices=KV_CACHE_DTYPES),
    # runtime policy: tensorrt_llm config.pbtxt parameters
    _k("enable_chunked_context", "runtime", bool, False, "Split long prompts over several steps.",
       trtllm="enable_chunked_context", llmapi="enable_chunked_prefill", engine=True, serve=True,
       flag="--enable-chunked-context/--disable-chunked-context"),
    _k("enable_kv_cache_reuse", "runtime", bool, True, "Reuse cached KV blocks of shared prompt prefixes.",
       trtllm="enable_kv_cache_reuse", llmapi="kv_cache_config.enable_block_reuse", engine=True, serve=True,
       flag="--enable-kv-cache-reuse/--disable-kv-cache-reuse"),
    _k("batch_scheduler_policy", "runtime", str, "guaranteed_no_evict", "Capacity policy of the scheduler.",
       choices=CAPACITY_POLICIES, trtllm="batch_scheduler_policy",
       llmapi="scheduler_config.capacity_scheduler_policy", engine=True, serve=True),
    # TensorRT-LLM's KvCacheConfig allows [0, 1]; 0 leaves no KV cache, which no engine can run with.
    _k("kv_cache_free_gpu_mem_fraction", "runtime", float, 0.9,
       "Share of the memory left after the weights that the KV cache may use.", low=0.0, high=1.0,
       low_open=True, trtllm="kv_cache_free_gpu_mem_fraction",
       llmapi="kv_cache_config.free_gpu_memory_fraction", engine=True, serve=True),
    _k("max_tokens_in_paged_kv_cache", "runtime", int, None,
       "Cap on the KV cache in tokens (with the fraction: the smaller wins).",
       trtllm="max_tokens_in_paged_kv_cache", llmapi="kv_cache_config.max_tokens", engine=True, serve=True, **_TOKENS),
    _k("max_queue_size", "runtime", int, None, "Most requests waiting beyond those running (unset: no limit).",
       trtllm="max_queue_size", engine=True, serve=True, **_TOKENS),
    _k("max_queue_delay_microseconds", "runtime", int, 0, "How long Triton may hold a request to batch it.",
       low=0, high=60_000_000, trtllm="max_queue_delay_microseconds", serve=True),
    # prompt policy: what the serve edge does with a prompt that does not fit
    _k("overflow", "prompt", str, "reject", "What to do with a prompt longer than the maximum input length.",
       choices=OVERFLOW_POLICIES),
    _k("keep_turns", "prompt", int, None, "Chat truncation keeps at least this many last turns.", low=1,
       high=1_000_000, nullable=True),
    _k("truncate_separator", "prompt", str, "\n...\n", "Text put where truncate_middle cut the prompt."),
    _k("output_reserve", "prompt", int, None,
       "Tokens kept free for the answer when truncating (unset: the request's max_tokens).", low=0, high=BIG,
       nullable=True),
    _k("require_cache_salt", "prompt", bool, False, "Refuse requests without a cache_salt (tenant isolation)."),
    # serve only: the tensorrt_llm model's parameters and the model layout
    _k("exclude_input_in_output", "serve", bool, False, "Leave the prompt out of the output (requests may say).",
       trtllm="exclude_input_in_output", serve=True,
       flag="--exclude-input-in-output/--include-input-in-output"),
    # TensorRT-LLM's host tier below the GPU pool (the trtllm and llmapi targets; the torch target's pool is
    # already in host memory and refuses them). What each maps to, per release: docs/prefix-pool.md,
    # "TensorRT-LLM targets"; the rules: trtprompt/targets/kv_offload.py.
    _k("kv_cache_host_memory_bytes", "serve", int, 0, "Host memory for KV blocks offloaded from the GPU (0: none; "
       "TensorRT-LLM targets).", low=0, high=1 << 50, trtllm="kv_cache_host_memory_bytes",
       llmapi="kv_cache_config.host_cache_size", serve=True),
    _k("kv_cache_onboard_blocks", "serve", bool, True, "Copy host-tier KV blocks back to the GPU before reuse "
       "(TensorRT-LLM 1.2 engines; the LLM API has no off switch).", trtllm="kv_cache_onboard_blocks", serve=True,
       flag="--kv-cache-onboard-blocks/--no-kv-cache-onboard-blocks"),
    _k("secondary_offload_min_priority", "serve", int, None, "Only KV blocks with a retention priority above this "
       "go to the host tier (unset: TensorRT-LLM's default; TensorRT-LLM targets).", low=0, high=100,
       nullable=True, llmapi="kv_cache_config.secondary_offload_min_priority", serve=True),
    _k("cold_tier_offload_min_priority", "serve", int, None, "Only KV blocks with a retention priority above this "
       "go to the disk tier (unset: TensorRT-LLM's default; llmapi target, TensorRT-LLM >= 1.4).", low=0,
       high=100, nullable=True, llmapi="kv_cache_config.cold_tier_offload_min_priority", serve=True),
    # The torch target's pool only (TensorRT-LLM's is prioritized LRU); docs/prefix-pool.md, "Eviction".
    _k("kv_cache_eviction_policy", "serve", str, "s3fifo",
       "Which cached KV block the torch engine evicts first: lru, or scan-resistant 2q / s3fifo.",
       choices=EVICTION_POLICIES, engine=True, serve=True),
    # The torch target's guided decoding (engine/guided.py, docs/structured-outputs.md "Jump-forward").
    _k("guided_jump_forward", "serve", bool, True, "Append the tokens a guided request's grammar forces (keys, "
       "punctuation, enum tails) as one chunk instead of one model step each (torch target).", engine=True,
       serve=True, flag="--guided-jump-forward/--no-guided-jump-forward"),
    # The torch target's speculative decoding (engine/speculation/, docs/speculative-decoding.md); TensorRT-LLM's
    # NGramDecodingConfig names where it has them (the llmapi target writes speculative_config from these).
    _k("speculative_decoding", "serve", str, "ngram", "Speculative decoding: ngram (drafts from the request's own "
       "prompt and output, and from recent requests with the same cache_salt), draft_target (a smaller engine, "
       "--speculative-model, drafts) or none. Greedy tokens are unchanged; sampled ones keep their distribution.",
       choices=SPECULATIVE_MODES, llmapi="speculative_config.decoding_type", engine=True, serve=True),
    _k("max_draft_len", "serve", int, 16, "Most draft tokens verified per request and step (each request adapts "
       "its own below this from its recent acceptance).", low=1, high=64,
       llmapi="speculative_config.max_draft_len", engine=True, serve=True),
    _k("max_matching_ngram_size", "serve", int, 3, "ngram: the longest run of last tokens looked up; shorter runs "
       "are tried down to one token.", low=1, high=32, llmapi="speculative_config.max_matching_ngram_size",
       engine=True, serve=True),
    _k("is_keep_all", "serve", bool, True, "ngram: keep every earlier continuation of a run of tokens (false: "
       "only the newest).", llmapi="speculative_config.is_keep_all", engine=True, serve=True,
       flag="--is-keep-all/--no-is-keep-all"),
    _k("is_use_oldest", "serve", bool, True, "ngram: draft the oldest continuation kept (false: the newest).",
       llmapi="speculative_config.is_use_oldest", engine=True, serve=True,
       flag="--is-use-oldest/--no-is-use-oldest"),
    _k("is_public_pool", "serve", bool, True, "ngram: also draft from recent requests' prompts and outputs, only "
       "those with the same cache_salt (false: each request's own tokens only).",
       llmapi="speculative_config.is_public_pool", engine=True, serve=True,
       flag="--is-public-pool/--no-is-public-pool"),
    _k("speculation_max_concurrency", "serve", int, SPECULATION_MAX_CONCURRENCY, "Speculation pauses while more "
       "requests than this run: the batch is then compute-bound and verifying drafts costs more than it saves "
       "(measured: docs/speculative-decoding.md).", low=1, high=BIG, nullable=True,
       llmapi="speculative_config.max_concurrency", engine=True, serve=True),
    _k("speculative_model", "serve", str, None, "draft_target: the draft engine's directory, a trtprompt engine "
       "with the same tokenizer (unset: none).", nullable=True, llmapi="speculative_config.speculative_model",
       engine=True, serve=True),
    # LoRA adapters in memory (engine/lora/manager.py): the LLM API's LoraConfig names.
    _k("max_loras", "serve", int, 8, "LoRA adapters the torch engine keeps laid out for its steps (least recently "
       "used goes first); a batch mixes at most this many, requests of others wait.", low=1, high=1024,
       llmapi="lora_config.max_loras", engine=True, serve=True),
    _k("max_cpu_loras", "serve", int, 32, "LoRA adapters kept read in host memory (least recently used goes first; "
       "one loaded from a directory is read again when asked for, one sent as Triton lora_weights must be sent "
       "again).", low=1, high=65536, llmapi="lora_config.max_cpu_loras", engine=True, serve=True),
    _k("cancellation_check_period_ms", "serve", int, 100, "How often cancelled requests are looked for.",
       low=1, high=BIG, trtllm="cancellation_check_period_ms", serve=True),
    _k("stats_check_period_ms", "serve", int, 100, "How often engine statistics are published.", low=1,
       high=BIG, trtllm="stats_check_period_ms", serve=True),
    # The torch target's engine process only (docs/design.md, "Serving path": on a machine whose cores the
    # engine shares with tritonserver and the front end, their work stalls its barrier-synchronized threads).
    _k("engine_threads", "serve", int, None, "Intra-op threads of the torch engine process (unset: one per "
       "core); fewer leave cores to tritonserver and the front end.", low=1, high=4096, nullable=True, serve=True),
    # The torch engine's arithmetic (engine/compute_dtype.py, docs/quantization.md "bf16 on a CPU without bf16
    # instructions"): unset widens a bf16 engine to float32 on a CPU that would emulate bf16.
    _k("compute_dtype", "serve", str, None, "What the torch engine computes in: float32 or the engine's own "
       "dtype (unset: its own, except that a bfloat16 engine on a CPU without avx512_bf16 or amx_bf16 computes "
       "in float32, several times faster there, at twice the memory).", choices=("float32", "bfloat16", "float16"),
       nullable=True, engine=True, serve=True),
    # serve --replicas (docs/replicas.md): N complete servers on disjoint cores behind sglang-router.
    _k("replicas", "serve", int, 1, "Engine processes, each with its own KV pool, cores and tritonserver, behind "
       "the one OpenAI port, routed by sglang-router's cache-aware policy (torch target).", low=1, high=1024,
       serve=True),
    # Tiers below the torch engine's KV pool (docs/prefix-pool.md): read by the engine process.
    _k("disk_cache_path", "serve", str, None, "Directory of the disk KV tier, kept across restarts (unset: none).",
       nullable=True, engine=True, serve=True, llmapi="kv_cache_config.disk_cache_path"),
    _k("disk_cache_size", "serve", int, 4 << 30, "Byte budget of the disk KV tier (least recently used go first).",
       low=1 << 20, high=1 << 50, engine=True, serve=True, llmapi="kv_cache_config.disk_cache_size"),
    _k("kv_remote_url", "serve", str, None, "Remote KV tier shared by servers, redis://HOST:PORT/DB or rediss:// "
       "(never a password in it; unset: none).", nullable=True, engine=True, serve=True),
    _k("kv_remote_password_file", "serve", str, None, "File holding the remote KV tier's password (unset: "
       "TRTPROMPT_KV_REMOTE_PASSWORD, else none).", nullable=True, engine=True, serve=True),
    _k("kv_tier_write_policy", "serve", str, "write_through", "Which blocks go to the KV tiers: every computed "
       "full block (write_through), only blocks reused once in the pool (selective), or blocks the pool evicts "
       "plus, at a clean stop, those it still holds (write_back).",
       choices=("write_through", "selective", "write_back"), engine=True, serve=True),
    # KV events for KV-aware routers, vLLM's ZMQ/msgpack format (engine/kv_events.py, docs/kv-events.md).
    _k("kv_events_endpoint", "serve", str, None, "ZMQ endpoint the torch engine binds to publish KV block "
       "stored/removed/cleared events in vLLM's format: tcp://HOST:PORT, ipc://PATH, or a port for "
       "tcp://127.0.0.1:PORT (unset: no events).", nullable=True, engine=True, serve=True),
    _k("kv_events_replay_endpoint", "serve", str, None, "ZMQ ROUTER endpoint that resends recent KV event "
       "batches from a sequence number, as vLLM's replay socket (unset: none).", nullable=True, engine=True,
       serve=True),
    _k("kv_events_topic", "serve", str, None, "ZMQ topic of the KV event messages, e.g. kv@POD@MODEL as llm-d "
       "reads it (unset: the empty topic, as vLLM's default).", nullable=True, engine=True, serve=True),
    _k("kv_events_layout", "serve", str, "map", "KV event encoding: vLLM's current tagged maps, or the "
       "positional arrays older vLLM releases sent (for consumers that read only those).",
       choices=("map", "array"), engine=True, serve=True),
    _k("layout", "serve", str, "fused", "Model repository layout (fused stubs or TensorRT-LLM's upstream models).",
       choices=LAYOUTS, serve=True),
)}


def in_section(section: str) -> tuple[str, ...]:
    return tuple(name for name, k in KNOBS.items() if k.section == section)


PROFILE_SECTIONS: tuple[str, ...] = ("build", "runtime", "prompt")
PROFILE_KEYS: tuple[str, ...] = tuple(n for n, k in KNOBS.items() if k.section in PROFILE_SECTIONS)
SERVE_KEYS: tuple[str, ...] = tuple(n for n, k in KNOBS.items() if k.serve)
ENGINE_KEYS: tuple[str, ...] = tuple(n for n, k in KNOBS.items() if k.engine)
LOWERABLE_KEYS: tuple[str, ...] = tuple(n for n, k in KNOBS.items() if k.lowerable)


def check_all(obj: Any, names: Iterable[str], qualified: bool = False, runtime: bool = False) -> None:
    """Check each knob field of a frozen dataclass (ints given for floats become floats)."""
    for name in names:
        value = KNOBS[name].check(getattr(obj, name), qualified, runtime)
        if value is not getattr(obj, name):
            object.__setattr__(obj, name, value)


T = TypeVar("T")


def default(name: str) -> Any:
    """A knob's default, for the field that holds it."""
    return KNOBS[name].default


def runtime_default(name: str) -> Any:
    """A knob's default at runtime: None for a lowerable build bound ("the engine's build value")."""
    return KNOBS[name].runtime_default


def annotation(name: str, runtime: bool = False) -> str:
    """The type a field holding this knob is declared with (as `from __future__ import annotations` keeps it)."""
    knob = KNOBS[name]
    value = knob.runtime_default if runtime else knob.default
    kind = knob.kind.__name__
    return f"{kind} | None" if knob.nullable or value is None else kind


def knob_fields(names: Iterable[str], runtime: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator, applied under @dataclass: checks (at import) that the class declares one
    field per knob with the knob's type and default, so a plain dataclass that a type checker
    reads can never drift from this table. runtime: defaults are runtime_default's."""
    def check(cls: type[T]) -> type[T]:
        fields = getattr(cls, "__dataclass_fields__")
        for name in names:
            expected = runtime_default(name) if runtime else default(name)
            field = fields.get(name)
            if field is None or field.default != expected or field.type != annotation(name, runtime):
                got = "missing" if field is None else f"{field.type} = {field.default!r}"
                raise TypeError(f"{cls.__name__}.{name} must be declared `{annotation(name, runtime)} = "
                                f"{expected!r}` (trtprompt/knobs.py), got {got}")
        return cls
    return check


def from_parameters(params: Mapping[str, str], names: Iterable[str]) -> dict[str, Any]:
    """Knob values from config.pbtxt parameters (by TensorRT-LLM name); absent or empty: left out.

    The Triton-level max_batch_size travels as `triton_max_batch_size`, as in
    tensorrtllm_backend's templates.
    """
    out: dict[str, Any] = {}
    for name in names:
        knob = KNOBS[name]
        key = "triton_max_batch_size" if name == "max_batch_size" else knob.trtllm or name
        if key in params:
            value = knob.parse(params[key])
            if value is not None:
                out[name] = value
    return out


@dataclass(frozen=True, kw_only=True)
class RuntimePolicy:
    """The runtime knobs a profile records and every server runs with (keyword-only, so classes
    that add required fields can build on it). Subclasses are checked with knob_fields."""

    enable_chunked_context: bool = default("enable_chunked_context")
    enable_kv_cache_reuse: bool = default("enable_kv_cache_reuse")
    batch_scheduler_policy: str = default("batch_scheduler_policy")
    kv_cache_free_gpu_mem_fraction: float = default("kv_cache_free_gpu_mem_fraction")
    max_tokens_in_paged_kv_cache: int | None = default("max_tokens_in_paged_kv_cache")
    max_queue_size: int | None = default("max_queue_size")
    max_queue_delay_microseconds: int = default("max_queue_delay_microseconds")


@dataclass(frozen=True, kw_only=True)
class BackendParams(RuntimePolicy):
    """RuntimePolicy plus what the `tensorrt_llm` model's parameters carry on either target."""

    max_beam_width: int = default("max_beam_width")
    exclude_input_in_output: bool = default("exclude_input_in_output")
    cancellation_check_period_ms: int = default("cancellation_check_period_ms")
    stats_check_period_ms: int = default("stats_check_period_ms")
    # TensorRT-LLM's host tier (trtprompt/targets/kv_offload.py says what each target does with them).
    kv_cache_host_memory_bytes: int = default("kv_cache_host_memory_bytes")
    kv_cache_onboard_blocks: bool = default("kv_cache_onboard_blocks")
    secondary_offload_min_priority: int | None = default("secondary_offload_min_priority")
    cold_tier_offload_min_priority: int | None = default("cold_tier_offload_min_priority")
