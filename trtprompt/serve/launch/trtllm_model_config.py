"""config.pbtxt of the `tensorrt_llm` model for a TensorRT-LLM engine (Triton's tensorrtllm C++ backend).

The file is built as a tritonclient `ModelConfig` protobuf and printed with
text_format, so every value is written explicitly and nothing like an
unfilled `${...}` can remain. Tensor names and parameter names are those of
tensorrtllm_backend's inflight_batcher_llm/tensorrt_llm model (TensorRT-LLM
1.2.x): clients and ensembles written for it work unchanged.

Guided decoding: `guided_decoding_backend: xgrammar` always, and `xgrammar_tokenizer_info_path` where the
engine directory holds the tokenizer info TensorRT-LLM's C++ backend needs (made by TensorRT-LLM's own
examples/generate_xgrammar_tokenizer_info.py; docs/gpu.md, "Guided decoding"): without that file the
backend leaves guided decoding off, so preprocessing refuses a guided request instead of letting it pass.

One parameter is left out when unset on purpose: `max_tokens_in_paged_kv_cache`
("no cap" has no value; the pool is then sized by kv_cache_free_gpu_mem_fraction). The host tier's parameters
(kv_cache_host_memory_bytes, kv_cache_onboard_blocks) and the six retention inputs:
docs/prefix-pool.md, "TensorRT-LLM targets".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtprompt import knobs
from trtprompt.interface import GUIDE_INPUTS, PERF_OUTPUTS, RETENTION_INPUTS, Tensor

MODEL_NAME = "tensorrt_llm"
BACKEND = "tensorrtllm"
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
TRITON_DTYPES: dict[str, str] = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}

# (name, type, dims, optional); scalar [1] inputs are reshaped to [] as the backend expects.
SCALAR_INPUTS: tuple[tuple[str, str], ...] = (
    ("end_id", "INT32"), ("pad_id", "INT32"), ("beam_width", "INT32"), ("temperature", "FP32"),
    ("runtime_top_k", "INT32"), ("runtime_top_p", "FP32"), ("runtime_top_p_min", "FP32"),
    ("runtime_top_p_decay", "FP32"), ("runtime_top_p_reset_ids", "INT32"), ("len_penalty", "FP32"),
    ("early_stopping", "BOOL"), ("repetition_penalty", "FP32"), ("min_tokens", "INT32"),
    ("beam_search_diversity_rate", "FP32"), ("presence_penalty", "FP32"), ("frequency_penalty", "FP32"),
    ("seed", "UINT64"), ("return_log_probs", "BOOL"), ("return_perf_metrics", "BOOL"),
    ("return_num_input_tokens", "BOOL"), ("return_num_output_tokens", "BOOL"),
    ("exclude_input_in_output", "BOOL"), ("stop", "BOOL"), ("streaming", "BOOL"),
    ("num_return_sequences", "INT32"), ("prompt_vocab_size", "INT32"), ("lora_task_id", "UINT64"),
)
# The C++ backend's guided decoding (tensorrtllm_backend 1.2's utils map these four guide types; it drops any
# other silently, so preprocessing refuses them first) and the file its xgrammar backend reads the
# tokenizer from, in the engine directory.
GUIDED_DECODING_BACKEND = "xgrammar"  # the only value the 1.2 C++ backend accepts
XGRAMMAR_TOKENIZER_INFO = "xgrammar_tokenizer_info.json"  # the name generate_xgrammar_tokenizer_info.py writes
TRTLLM_GUIDE_TYPES: tuple[str, ...] = ("json", "json_schema", "regex", "ebnf_grammar")
RAGGED_INPUTS: tuple[Tensor, ...] = (
    ("stop_words_list", "INT32", [2, -1], True),
    ("bad_words_list", "INT32", [2, -1], True),
    ("embedding_bias", "FP32", [-1], True),
    ("lora_weights", "FP16", [-1, -1], True),
    ("lora_config", "INT32", [-1, 3], True),
    *GUIDE_INPUTS,  # declared as the template declares them (ragged, no reshape)
)
OUTPUTS: tuple[Tensor, ...] = (
    ("output_ids", "INT32", [-1, -1], False),
    ("sequence_length", "INT32", [-1], False),
    ("cum_log_probs", "FP32", [-1], False),
    ("output_log_probs", "FP32", [-1, -1], False),
    ("batch_index", "INT32", [1], False),
    ("sequence_index", "INT32", [1], False),
    *PERF_OUTPUTS,  # the speculative decoding ones (acceptance_rate, ...) included
    ("num_input_tokens", "INT32", [1], False),
    ("num_output_tokens", "INT32", [1], False),
)

# Build flag -> (request flag, output, dims): the backend fills an output only where the engine computes it
# (TensorRT-LLM refuses return_context_logits on an engine built without gather_context_logits), so both are
# declared only then; their type is the engine's logits dtype (the template's ${logits_datatype}).
LOGITS: dict[str, tuple[str, str, list[int]]] = {
    "gather_context_logits": ("return_context_logits", "context_logits", [-1, -1]),
    "gather_generation_logits": ("return_generation_logits", "generation_logits", [-1, -1, -1]),
}


# The knobs this model's config.pbtxt carries (typed, defaulted and checked by trtprompt/knobs.py).
MODEL_KNOBS: tuple[str, ...] = (
    "enable_kv_cache_reuse", "enable_chunked_context", "batch_scheduler_policy", "kv_cache_free_gpu_mem_fraction",
    "max_tokens_in_paged_kv_cache", "max_beam_width", "max_queue_size", "max_queue_delay_microseconds",
    "exclude_input_in_output", "cancellation_check_period_ms", "stats_check_period_ms",
    "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks")
# Triton's own queue settings (dynamic_batching), not backend parameters.
QUEUE_KNOBS: tuple[str, ...] = ("max_queue_size", "max_queue_delay_microseconds")


@knobs.knob_fields(MODEL_KNOBS)
@dataclass(frozen=True)
class TrtllmModelParams(knobs.BackendParams):
    """Every value the `tensorrt_llm` model's config.pbtxt carries."""

    engine_dir: Path
    dtype: str  # engine dtype: the prompt-embedding table's type
    max_attention_window_size: int  # the engine's max_seq_len: full attention, never a silent window
    triton_max_batch_size: int
    iter_stats_max_iterations: int = 1000
    request_stats_max_iterations: int = 0
    normalize_log_probs: bool = True
    decoupled: bool = True
    # The engine's build flags and logits dtype: which logits outputs exist, and their Triton type.
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    logits_dtype: str = "float32"
    # The C++ backend's xgrammar tokenizer info (None: guided decoding stays off in TensorRT-LLM).
    xgrammar_tokenizer_info_path: Path | None = None
    # The backend's LoRA cache (None: the backend's default; all None for an engine built without the lora plugin).
    lora_cache_optimal_adapter_size: int | None = None
    lora_cache_max_adapter_size: int | None = None
    lora_cache_host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("dtype", "logits_dtype"):
            if getattr(self, name) not in TRITON_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(TRITON_DTYPES)}, got {getattr(self, name)!r}")
        knobs.check_all(self, MODEL_KNOBS)
        for name in ("max_attention_window_size", "triton_max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("iter_stats_max_iterations", "request_stats_max_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in LORA_CACHE_FIELDS:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_engine(cls, engine_dir: Path, pretrained_config: Mapping[str, Any], build_config: Mapping[str, Any],
                    runtime: Mapping[str, Any]) -> "TrtllmModelParams":
        """Engine bounds plus runtime values named as config.pbtxt names them (None: default)."""
        fields = cls.__dataclass_fields__
        given = {k: v for k, v in runtime.items() if k in fields and v is not None}
        given.setdefault("triton_max_batch_size", int(runtime.get("max_batch_size") or build_config["max_batch_size"]))
        given["max_beam_width"] = beam_width(build_config, given.get("max_beam_width"))
        given |= lora_cache(pretrained_config, build_config, runtime.get("max_cpu_loras"))
        return cls(engine_dir=Path(engine_dir), dtype=str(pretrained_config["dtype"]),
                   max_attention_window_size=int(build_config["max_seq_len"]),
                   gather_context_logits=bool(build_config.get("gather_context_logits")),
                   gather_generation_logits=bool(build_config.get("gather_generation_logits")),
                   logits_dtype=str(pretrained_config.get("logits_dtype") or "float32"),
                   xgrammar_tokenizer_info_path=tokenizer_info(Path(engine_dir)), **given)

    def logits(self) -> list[tuple[str, str, list[int]]]:
        """(request flag, output, dims) of each logits output this engine computes."""
        return [entry for flag, entry in LOGITS.items() if getattr(self, flag)]

    def parameters(self) -> dict[str, str]:
        """The backend's parameters, as the strings config.pbtxt holds."""
        params: dict[str, Any] = {
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": str(self.engine_dir),
            "max_attention_window_size": self.max_attention_window_size,
            **{str(knobs.KNOBS[k].trtllm): getattr(self, k) for k in MODEL_KNOBS if k not in QUEUE_KNOBS},
            "iter_stats_max_iterations": self.iter_stats_max_iterations,
            "request_stats_max_iterations": self.request_stats_max_iterations,
            "normalize_log_probs": self.normalize_log_probs,
            "decoding_mode": "top_k_top_p" if self.max_beam_width == 1 else "beam_search",
            "multi_block_mode": True,
            "enable_context_fmha_fp32_acc": False,
            "cuda_graph_mode": False,
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
            "executor_worker_path": EXECUTOR_WORKER,
            "guided_decoding_backend": GUIDED_DECODING_BACKEND,
            "xgrammar_tokenizer_info_path": self.xgrammar_tokenizer_info_path,  # left out when absent: off
            **{name: getattr(self, name) for name in LORA_CACHE_FIELDS},  # left out when None
        }
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in params.items() if v is not None}


# The tensorrt_llm model's LoRA cache parameters (tensorrtllm_backend docs/lora.md, "LoRA Cache"). The GPU
# cache is a fraction of free memory (lora_cache_gpu_memory_fraction): no knob maps to it, so it stays the
# backend's default (0.05), and max_loras (adapters laid out per step) has no 1.2 parameter.
LORA_CACHE_FIELDS: tuple[str, ...] = ("lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size",
                                      "lora_cache_host_memory_bytes")
OPTIMAL_ADAPTER_SIZE = 8  # the backend's default page-sizing rank, lowered to max_lora_rank where that is less
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


def _module_dims(pretrained: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each TensorRT-LLM LoRA module of a decoder (LoraModule's dims, tensor parallelism 1)."""
    h = int(pretrained["hidden_size"])
    heads = int(pretrained["num_attention_heads"])
    d = int(pretrained.get("head_size") or h // heads)
    q, kv = heads * d, int(pretrained.get("num_key_value_heads") or heads) * d
    i = int(pretrained.get("intermediate_size") or 4 * h)
    return {"attn_qkv": (h, q + 2 * kv), "attn_q": (h, q), "attn_k": (h, kv), "attn_v": (h, kv),
            "attn_dense": (q, h), "mlp_h_to_4h": (h, i), "mlp_gate": (h, i), "mlp_4h_to_h": (i, h)}


def lora_cache(pretrained: Mapping[str, Any], build: Mapping[str, Any], max_cpu_loras: int | None) -> dict[str, int]:
    """The LoRA cache parameters of an engine built with the lora plugin (none otherwise): pages sized for its
    max_lora_rank, and a host cache holding max_cpu_loras adapters of the largest size it takes (max_lora_rank
    on every target module of every layer)."""
    lora = build.get("lora_config") or {}
    modules = [m for m in lora.get("lora_target_modules") or [] if m in _module_dims(pretrained)]
    if not (build.get("plugin_config") or {}).get("lora_plugin") or not modules:
        return {}
    rank = int(lora.get("max_lora_rank") or knobs.default("max_lora_rank"))
    dims = _module_dims(pretrained)
    per_adapter = int(pretrained["num_hidden_layers"]) * sum(rank * sum(dims[m]) for m in modules) \
        * DTYPE_BYTES.get(str(pretrained.get("dtype")), 4)
    cpu = knobs.default("max_cpu_loras") if max_cpu_loras is None else int(max_cpu_loras)
    return {"lora_cache_optimal_adapter_size": min(OPTIMAL_ADAPTER_SIZE, rank), "lora_cache_max_adapter_size": rank,
            "lora_cache_host_memory_bytes": cpu * per_adapter}


def tokenizer_info(engine_dir: Path) -> Path | None:
    """The engine directory's xgrammar tokenizer info, or None where it has none."""
    path = Path(engine_dir) / XGRAMMAR_TOKENIZER_INFO
    return path.resolve() if path.is_file() else None


def trtllm_guide_types(engine_dir: Path) -> tuple[str, ...]:
    """The guide types the C++ backend serves for this engine directory: none without the tokenizer info."""
    return TRTLLM_GUIDE_TYPES if tokenizer_info(engine_dir) is not None else ()


def beam_width(build_config: Mapping[str, Any], serve_value: int | None) -> int:
    """max_beam_width for the executor: the engine's, unless serve lowered it. ServeOptions holds the
    knob's default (1) when nothing was given, so 1 reads as "not given": a beam engine keeps its beams
    (serving it greedy-only is asking for beam_width 1 per request, which every engine takes)."""
    built = int(build_config.get("max_beam_width") or 1)
    if serve_value is None or serve_value == knobs.default("max_beam_width"):
        return built
    return int(serve_value)


def _add(field: Any, name: str, dtype: str, dims: Sequence[int], optional: bool,
         reshape: bool = False, ragged: bool = False) -> None:
    t = field.add(name=name, data_type=mc.DataType.Value(f"TYPE_{dtype}"), dims=list(dims))
    if optional:
        t.optional = True
    if reshape:
        t.reshape.SetInParent()  # shape [] : a scalar per request
    if ragged:
        t.allow_ragged_batch = True


def _inputs(cfg: mc.ModelConfig, dtype: str) -> None:
    _add(cfg.input, "input_ids", "INT32", [-1], False, ragged=True)
    _add(cfg.input, "input_lengths", "INT32", [1], False, reshape=True)
    _add(cfg.input, "request_output_len", "INT32", [1], False, reshape=True)
    for name, kind in SCALAR_INPUTS:
        _add(cfg.input, name, kind, [1], True, reshape=True)
    for name, kind, dims, optional in RAGGED_INPUTS:
        _add(cfg.input, name, kind, dims, optional, ragged=True)
    # KvCacheRetentionConfig per request, declared as the backend's template declares them (ragged, no reshape).
    for name, kind, dims, optional in RETENTION_INPUTS:
        _add(cfg.input, name, kind, dims, optional, ragged=True)
    _add(cfg.input, "prompt_embedding_table", TRITON_DTYPES[dtype], [-1, -1], True, ragged=True)


def _logits(cfg: mc.ModelConfig, p: TrtllmModelParams) -> None:
    """The logits flags and outputs of the engine's gather_* build flags (none on a default build)."""
    for flag, output, dims in p.logits():
        _add(cfg.input, flag, "BOOL", [1], True, reshape=True)
        _add(cfg.output, output, TRITON_DTYPES[p.logits_dtype], dims, False)


def tensorrt_llm_model_config(p: TrtllmModelParams) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=MODEL_NAME, backend=BACKEND, max_batch_size=p.triton_max_batch_size)
    cfg.model_transaction_policy.decoupled = p.decoupled
    batching = cfg.dynamic_batching
    batching.preferred_batch_size.append(p.triton_max_batch_size)
    batching.max_queue_delay_microseconds = p.max_queue_delay_microseconds
    batching.default_queue_policy.max_queue_size = p.max_queue_size or 0  # Triton: 0 means no limit
    _inputs(cfg, p.dtype)
    for name, kind, dims, optional in OUTPUTS:
        _add(cfg.output, name, kind, dims, optional)
    _logits(cfg, p)
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for key, value in p.parameters().items():
        cfg.parameters[key].string_value = value
    return cfg


def parse_config_text(text: str) -> mc.ModelConfig:
    """Parse config.pbtxt text with Triton's ModelConfig schema; refuses any placeholder."""
    if "${" in text:
        raise ValueError("config.pbtxt holds an unfilled ${...} placeholder")
    return text_format.Parse(text, mc.ModelConfig())


def config_text(p: TrtllmModelParams) -> str:
    """The complete config.pbtxt, checked to parse back to the same message."""
    cfg = tensorrt_llm_model_config(p)
    text = text_format.MessageToString(cfg)
    if parse_config_text(text) != cfg:
        raise RuntimeError("tensorrt_llm/config.pbtxt does not round-trip through Triton's schema")
    return str(text)


def write_model(repo: str | Path, p: TrtllmModelParams) -> Path:
    """Write <repo>/tensorrt_llm/config.pbtxt (and the empty version folder the backend expects)."""
    model_dir = Path(repo) / MODEL_NAME
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(config_text(p), encoding="utf-8")
    return path


def params_for(ctx: Any) -> TrtllmModelParams:
    """Params from a serve RepoContext (engine info + resolved ServeOptions)."""
    return TrtllmModelParams.from_engine(ctx.engine.path, ctx.engine.pretrained_config, ctx.engine.build_config,
                                         asdict(ctx.options))


# tensorrtllm_backend 1.2's preprocessing turns the ensemble's embedding bias words and weights into the core's
# embedding_bias (one value per vocabulary entry); names, types and dims as its templates declare them.
PRE_BIAS_INPUTS: tuple[Tensor, ...] = (("EMBEDDING_BIAS_WORDS", "STRING", [-1], True),
                                       ("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], True))
PRE_BIAS_OUTPUT: Tensor = ("EMBEDDING_BIAS", "FP32", [-1], False)
# What the 1.2 ensemble template declares beyond repository.upstream_ensemble_config: sequences and the bias
# in, the core's log probabilities and indices out (straight from the core, as that template maps them).
ENSEMBLE_EXTRA_INPUTS: tuple[Tensor, ...] = (("num_return_sequences", "INT32", [1], True),
                                             ("embedding_bias_words", "STRING", [-1], True),
                                             ("embedding_bias_weights", "FP32", [-1], True))
ENSEMBLE_EXTRA_OUTPUTS: tuple[Tensor, ...] = (("cum_log_probs", "FP32", [-1], False),
                                              ("output_log_probs", "FP32", [-1, -1], False),
                                              ("batch_index", "INT32", [1], False),
                                              ("sequence_index", "INT32", [1], False))
# Not in the 1.2 postprocessing template (it decodes every chunk on its own): ours streams one detokenizer per
# request id, and with num_return_sequences > 1 the core interleaves the sequences' chunks, told apart only by
# sequence_index (which the backend sends only then: optional, and a response without it still reaches the step).
POST_SEQUENCE_INPUT: Tensor = ("SEQUENCE_INDEX", "INT32", [1], True)


def _tensors(field: Any, tensors: Sequence[Tensor]) -> None:
    for name, dtype, dims, optional in tensors:
        _add(field, name, dtype, dims, optional)


def _copy(base: mc.ModelConfig) -> mc.ModelConfig:
    cfg = mc.ModelConfig()
    cfg.CopyFrom(base)
    return cfg


def trtllm_preprocessing_config(base: mc.ModelConfig) -> mc.ModelConfig:
    """repository.preprocessing_config's message plus the embedding bias tensors of the 1.2 template.
    (The shared configs come in as arguments: repository imports this module, so it may not import back.)"""
    cfg = _copy(base)
    _tensors(cfg.input, PRE_BIAS_INPUTS)
    _tensors(cfg.output, (PRE_BIAS_OUTPUT,))
    return cfg


def trtllm_postprocessing_config(base: mc.ModelConfig) -> mc.ModelConfig:
    """repository.postprocessing_config's message plus the sequence index that keys its detokenizers."""
    cfg = _copy(base)
    _tensors(cfg.input, (POST_SEQUENCE_INPUT,))
    return cfg


def trtllm_ensemble_config(base: mc.ModelConfig, p: TrtllmModelParams) -> mc.ModelConfig:
    """repository.upstream_ensemble_config's message plus what the 1.2 ensemble template routes for issue 37:
    sequences, the embedding bias (through preprocessing), log probabilities, indices and the engine's logits."""
    cfg = _copy(base)
    logits = p.logits()
    _tensors(cfg.input, ENSEMBLE_EXTRA_INPUTS + tuple((flag, "BOOL", [1], True) for flag, _, _ in logits))
    _tensors(cfg.output, ENSEMBLE_EXTRA_OUTPUTS)
    for _, output, dims in logits:
        _add(cfg.output, output, TRITON_DTYPES[p.logits_dtype], dims, False)
    steps = {s.model_name: s for s in cfg.ensemble_scheduling.step}
    pre, core = steps["preprocessing"], steps[MODEL_NAME]
    pre.input_map.update({"EMBEDDING_BIAS_WORDS": "embedding_bias_words",
                          "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights"})
    pre.output_map["EMBEDDING_BIAS"] = "_EMBEDDING_BIAS"
    core.input_map.update({"embedding_bias": "_EMBEDDING_BIAS", "num_return_sequences": "num_return_sequences",
                           **{flag: flag for flag, _, _ in logits}})
    core.output_map.update({name: name for name, *_ in ENSEMBLE_EXTRA_OUTPUTS})
    core.output_map.update({output: output for _, output, _ in logits})
    steps["postprocessing"].input_map[POST_SEQUENCE_INPUT[0]] = "sequence_index"  # also an ensemble output
    return cfg


def trtllm_model_configs(p: TrtllmModelParams, pre: mc.ModelConfig, post: mc.ModelConfig,
                         ensemble: mc.ModelConfig) -> list[tuple[mc.ModelConfig, str | None]]:
    """The trtllm target's four models as tensorrtllm_backend 1.2 lays them out, issue 37's tensors included,
    from repository's preprocessing / postprocessing / upstream ensemble configs (repository.model_configs
    writes these). Preprocessing (serve/triton_models/pre_post.py) answers EMBEDDING_BIAS on every request
    and postprocessing keeps one detokenizer per (request id, sequence_index).
    """
    return [(trtllm_preprocessing_config(pre), "preprocessing.py"), (tensorrt_llm_model_config(p), None),
            (trtllm_postprocessing_config(post), "postprocessing.py"), (trtllm_ensemble_config(ensemble, p), None)]
