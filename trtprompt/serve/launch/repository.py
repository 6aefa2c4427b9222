"""Write the Triton model repository.

Every config.pbtxt is built as a tritonclient `ModelConfig` protobuf message,
written with text_format and parsed back before anything starts, so no
file can hold a placeholder or a field Triton would reject. One function per
model config; a target adds its own variant (e.g. the tensorrtllm C++
backend for `tensorrt_llm`) next to the Python one here.

Layouts (docs/design.md, "Architecture"):
  fused    : ensemble (python, decoupled, text) + tensorrt_llm (python, decoupled, tokens)
  upstream : preprocessing -> tensorrt_llm -> postprocessing chained by a Triton
             `ensemble`, as tensorrtllm_backend lays it out for the GPU target.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtprompt import knobs
from trtprompt.engine.speculation.config import SPECULATION_KNOBS, SpeculationConfig
from trtprompt.interface import (
    GUIDE_INPUTS,
    PERF_FLAG,
    PERF_OUTPUTS,
    RETENTION_INPUTS,
    SPECULATION_INPUTS,
    TRITON_GUIDE_TYPES,
    Tensor,
)
from trtprompt.serve.launch.lora_modules import lora_parameters
from trtprompt.serve.launch.options import EngineInfo, ServeOptions
from trtprompt.serve.wire import requests as inputs
from trtprompt.serve.wire.model_config import check_config_text

MODELS_DIR = Path(__file__).resolve().parents[1] / "triton_models" / "models"  # files tritonserver loads
log = logging.getLogger("trtprompt.serve")

# (name, type, dims, optional); dims exclude the batch dimension.
# Inputs a TensorRT-LLM client may send that the torch target cannot honour;
# declared so the model can answer them with a clear INVALID_ARG (docs/triton-inputs.md).
UNSUPPORTED_INPUTS: tuple[Tensor, ...] = (
    ("prompt_embedding_table", "FP16", [-1, -1], True),
    ("prompt_vocab_size", "INT32", [1], True),
)
# tensorrtllm_backend's LoRA inputs, typed as its template declares them (serve/triton_models/lora_inputs.py,
# docs/lora.md): a task id, and the adapter's tensors the first time. Every model and layout takes them; the
# upstream ensemble hands them to its core as they are.
LORA_INPUTS: tuple[Tensor, ...] = (
    ("lora_task_id", "UINT64", [1], True),
    ("lora_weights", "FP16", [-1, -1], True),
    ("lora_config", "INT32", [-1, 3], True),
)
# Inputs and outputs the ensemble and the token model declare alike, in this order.
REQUEST_FLAGS: tuple[Tensor, ...] = (
    *((name, "BOOL", [1], True) for name in ("exclude_input_in_output", "return_log_probs", "return_perf_metrics",
                                              "return_num_input_tokens", "return_num_output_tokens")),
    ("cache_salt", "STRING", [1], True),
)
SEQUENCE_OUTPUTS: tuple[Tensor, ...] = (
    ("cum_log_probs", "FP32", [-1], False),
    ("output_log_probs", "FP32", [-1, -1], False),
    ("batch_index", "INT32", [1], False),
    ("sequence_index", "INT32", [1], False),
    ("num_input_tokens", "INT32", [1], False),
    ("num_output_tokens", "INT32", [1], False),
    ("prompt_truncated_tokens", "INT32", [1], False),
    ("dropped_turns", "INT32", [1], False),
)
# TensorRT-LLM's raw logits (tensorrtllm_backend's tensorrt_llm and ensemble configs): context_logits
# [prompt tokens, vocab] and generation_logits [beam, tokens, vocab], FP32 as the engine computes them.
# The torch core and the fused ensemble honour the flags (both models; the upstream ensemble hands them
# to the torch core, whose outputs it returns as they are).
LOGITS_INPUTS: tuple[Tensor, ...] = (
    ("return_context_logits", "BOOL", [1], True),
    ("return_generation_logits", "BOOL", [1], True),
)
LOGITS_OUTPUTS: tuple[Tensor, ...] = (
    ("context_logits", "FP32", [-1, -1], False),
    ("generation_logits", "FP32", [-1, -1, -1], False),
)
# Each returned sequence comes in its own responses, with its sequence_index (both models).
SEQUENCES_INPUT: Tensor = ("num_return_sequences", "INT32", [1], True)
# The ensemble's embedding bias: words, each with a weight added to its tokens' logits.
BIAS_WORD_INPUTS: tuple[Tensor, ...] = (
    ("embedding_bias_words", "STRING", [-1], True),
    ("embedding_bias_weights", "FP32", [-1], True),
)
# tensorrtllm_backend's guided decoding inputs (both models; serve/triton_models/guided.py). The upstream
# ensemble hands them to preprocessing, which checks them and answers the core's pair on every request
# (empty strings: no guide), so the trtllm target's C++ core never sees a guide it would drop silently.
PRE_GUIDE: tuple[Tensor, ...] = tuple((name.upper(), dtype, dims, True) for name, dtype, dims, _ in GUIDE_INPUTS)
# The guide types each target's core serves (preprocessing refuses the others, naming the input): the torch
# engine every tensorrtllm_backend type and structural_tag; the trtllm target's in trtllm_model_config.
TORCH_GUIDE_TYPES = TRITON_GUIDE_TYPES
# The torch target's tensorrt_llm model: llguidance serves every guide (xgrammar is accepted as a synonym).
GUIDED_DECODING_BACKEND = "llguidance"
# The fused ensemble's inputs the upstream layout's ensemble does not declare: its preprocessing and
# postprocessing (tensorrtllm_backend's contract) have no step that would take them.
# TensorRT-LLM's tensorrt_llm model takes early_stopping (BOOL) with beam_width; its ensemble does not.
EARLY_STOPPING_INPUT: Tensor = ("early_stopping", "BOOL", [1], True)
FUSED_ONLY_INPUTS: tuple[Tensor, ...] = (SEQUENCES_INPUT, *BIAS_WORD_INPUTS, EARLY_STOPPING_INPUT)
ENSEMBLE_INPUTS: tuple[Tensor, ...] = (
    ("text_input", "STRING", [1], False),
    ("max_tokens", "INT32", [1], False),
    ("bad_words", "STRING", [-1], True),
    ("stop_words", "STRING", [-1], True),
    ("end_id", "INT32", [1], True),
    ("pad_id", "INT32", [1], True),
    ("top_k", "INT32", [1], True),
    ("top_p", "FP32", [1], True),
    ("temperature", "FP32", [1], True),
    ("length_penalty", "FP32", [1], True),
    ("repetition_penalty", "FP32", [1], True),
    ("presence_penalty", "FP32", [1], True),
    ("frequency_penalty", "FP32", [1], True),
    ("min_tokens", "INT32", [1], True),
    ("min_length", "INT32", [1], True),  # name before TensorRT-LLM 0.19; genai-perf sends it
    ("seed", "UINT64", [1], True),
    ("random_seed", "UINT64", [1], True),  # name before 0.19
    ("beam_width", "INT32", [1], True),
    ("stream", "BOOL", [1], True),
    *REQUEST_FLAGS,
    # trtprompt's: perf outputs on the final response only (TensorRT-LLM attaches them to every
    # response); the OpenAI front end needs them once, for usage (docs/openai.md).
    ("perf_metrics_final_only", "BOOL", [1], True),
    ("overflow", "STRING", [1], True),  # a stricter overflow policy than the server's (issue 5)
    ("messages", "STRING", [1], True),  # JSON chat, used instead of text_input (send it empty)
    *RETENTION_INPUTS,  # TensorRT-LLM's names; the upstream layout hands them to the core as they are
    *FUSED_ONLY_INPUTS,
    *LOGITS_INPUTS,
    *GUIDE_INPUTS,
    *SPECULATION_INPUTS,  # the torch core's per-request opt-out (the upstream ensemble hands it to that core)
    *LORA_INPUTS,
) + UNSUPPORTED_INPUTS
ENSEMBLE_OUTPUTS: tuple[Tensor, ...] = (
    ("text_output", "STRING", [-1], False),
    *SEQUENCE_OUTPUTS,
    *LOGITS_OUTPUTS,
) + PERF_OUTPUTS
TOKEN_INPUTS: tuple[Tensor, ...] = (
    ("input_ids", "INT32", [-1], False),
    ("input_lengths", "INT32", [1], False),
    ("request_output_len", "INT32", [1], False),
    ("end_id", "INT32", [1], True),
    ("pad_id", "INT32", [1], True),
    ("streaming", "BOOL", [1], True),
    ("runtime_top_k", "INT32", [1], True),
    ("runtime_top_p", "FP32", [1], True),
    ("temperature", "FP32", [1], True),
    ("len_penalty", "FP32", [1], True),
    ("repetition_penalty", "FP32", [1], True),
    ("presence_penalty", "FP32", [1], True),
    ("frequency_penalty", "FP32", [1], True),
    ("min_tokens", "INT32", [1], True),
    ("min_length", "INT32", [1], True),
    ("random_seed", "UINT64", [1], True),
    ("seed", "UINT64", [1], True),
    ("beam_width", "INT32", [1], True),
    EARLY_STOPPING_INPUT,
    ("stop_words_list", "INT32", [2, -1], True),
    ("bad_words_list", "INT32", [2, -1], True),
    ("embedding_bias", "FP32", [-1], True),  # one bias per vocabulary entry
    SEQUENCES_INPUT,
    *REQUEST_FLAGS,
    # Echoed back on every response (token_model.ECHOED) for the upstream layout's ensemble.
    ("prompt_truncated_tokens", "INT32", [1], True),
    ("dropped_turns", "INT32", [1], True),
    *RETENTION_INPUTS,
    *LOGITS_INPUTS,
    *GUIDE_INPUTS,
    *SPECULATION_INPUTS,
    *LORA_INPUTS,
) + UNSUPPORTED_INPUTS
TOKEN_OUTPUTS: tuple[Tensor, ...] = (
    ("output_ids", "INT32", [-1, -1], False),
    ("sequence_length", "INT32", [-1], False),
    *SEQUENCE_OUTPUTS,
    *LOGITS_OUTPUTS,
) + PERF_OUTPUTS
PRE_INPUTS: tuple[Tensor, ...] = (
    ("QUERY", "STRING", [1], False),
    ("REQUEST_OUTPUT_LEN", "INT32", [1], False),
    ("BAD_WORDS_DICT", "STRING", [-1], True),
    ("STOP_WORDS_DICT", "STRING", [-1], True),
    ("END_ID", "INT32", [1], True),
    ("PAD_ID", "INT32", [1], True),
    # The same prompt inputs as the fused ensemble (one client interface on both layouts).
    ("MESSAGES", "STRING", [1], True),
    ("OVERFLOW", "STRING", [1], True),
    ("CACHE_SALT", "STRING", [1], True),
    *PRE_GUIDE,
)
PRE_OUTPUTS: tuple[Tensor, ...] = (
    ("INPUT_ID", "INT32", [-1], False),
    ("REQUEST_INPUT_LEN", "INT32", [1], False),
    ("REQUEST_OUTPUT_LEN", "INT32", [1], False),
    ("BAD_WORDS_IDS", "INT32", [2, -1], False),
    ("STOP_WORDS_IDS", "INT32", [2, -1], False),
    ("OUT_END_ID", "INT32", [1], False),
    ("OUT_PAD_ID", "INT32", [1], False),
    ("PROMPT_TRUNCATED_TOKENS", "INT32", [1], False),
    ("DROPPED_TURNS", "INT32", [1], False),
    *((name, dtype, dims, False) for name, dtype, dims, _ in PRE_GUIDE),  # checked, "" when none
)
# Only tensorrt_llm's outputs: Triton refuses a step after a decoupled model
# that also takes tensors of other origins ("inputs originated from
# different decoupled models"), so the stream is keyed by the request id.
# The prompt edge's counts: preprocessing computes them and, since a Triton ensemble refuses to
# mix its outputs with a decoupled model's ("inputs originated from different decoupled models"),
# the torch core echoes them (token_model.ECHOED). The tensorrtllm C++ backend cannot, so the
# trtllm target's ensemble does not declare them.
PROMPT_OUTPUTS: tuple[str, ...] = ("prompt_truncated_tokens", "dropped_turns")
# return_log_probs' outputs: the torch core's go straight to the upstream ensemble's outputs, as its counts
# do (tensorrtllm_backend routes the C++ core's through postprocessing, which this one does not take).
LOGPROB_OUTPUTS: tuple[str, ...] = ("cum_log_probs", "output_log_probs")
# Token counts: both cores answer them (return_num_input_tokens / return_num_output_tokens).
COUNT_OUTPUTS: tuple[str, ...] = ("num_input_tokens", "num_output_tokens")
POST_INPUTS: tuple[Tensor, ...] = (
    ("TOKENS_BATCH", "INT32", [-1, -1], False),
    ("SEQUENCE_LENGTH", "INT32", [-1], False),
)
POST_OUTPUTS: tuple[Tensor, ...] = (("OUTPUT", "STRING", [-1], False),)
# trtllm target only (docs/gpu.md, "Metrics"): the C++ core's perf outputs feed postprocessing's
# request metrics, so preprocessing asks for them on every request. A Triton ensemble holds no
# constants and refuses an input no step consumes, so the client's return_perf_metrics goes
# through preprocessing, which answers true whatever the client sent.
POST_PERF_INPUTS: tuple[Tensor, ...] = tuple((name.upper(), dtype, dims, True)
                                             for name, dtype, dims, _ in PERF_OUTPUTS)


@dataclass(frozen=True)
class RepoContext:
    """Everything a model config needs besides the runtime options."""

    engine: EngineInfo
    options: ServeOptions
    engine_socket: str

    @property
    def max_batch_size(self) -> int:
        return self.options.max_batch_size or int(self.engine.build_config["max_batch_size"])


def _names(tensors: Iterable[Tensor]) -> tuple[str, ...]:
    return tuple(name for name, *_ in tensors)


def _add_tensors(field, tensors: Iterable[Tensor]) -> None:  # type: ignore[no-untyped-def]
    for name, dtype, dims, optional in tensors:
        t = field.add(name=name, data_type=mc.DataType.Value(f"TYPE_{dtype}"), dims=list(dims))
        if optional:
            t.optional = True


def _base(name: str, max_batch_size: int, inputs: Iterable[Tensor], outputs: Iterable[Tensor],
          params: Mapping[str, object], backend: str | None = "python",
          decoupled: bool = False) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, max_batch_size=max_batch_size)
    if backend:
        cfg.backend = backend
    _add_tensors(cfg.input, inputs)
    _add_tensors(cfg.output, outputs)
    if decoupled:
        cfg.model_transaction_policy.decoupled = True
    if backend:
        cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for key, value in params.items():
        if value is None:
            continue  # unset: the backend's default applies (never a placeholder)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        cfg.parameters[key].string_value = text
    return cfg


def tier_parameters(o: ServeOptions) -> dict[str, object]:
    """The torch engine's KV tier settings (docs/prefix-pool.md), read by the engine process
    (engine_overrides); none at all when no tier is on. The password file's path is made absolute:
    the engine process may run in another directory."""
    if o.disk_cache_path is None and o.kv_remote_url is None:
        return {}
    password_file = None if o.kv_remote_password_file is None else str(Path(o.kv_remote_password_file).resolve())
    return {"disk_cache_path": o.disk_cache_path, "disk_cache_size": o.disk_cache_size,
            "kv_remote_url": o.kv_remote_url, "kv_remote_password_file": password_file,
            "kv_tier_write_policy": o.kv_tier_write_policy}


def kv_event_parameters(o: ServeOptions) -> dict[str, object]:
    """The torch engine's KV event settings (docs/kv-events.md), read by the engine process
    (engine_overrides); none at all when events are off."""
    if o.kv_events_endpoint is None:
        return {}
    return {"kv_events_endpoint": o.kv_events_endpoint, "kv_events_replay_endpoint": o.kv_events_replay_endpoint,
            "kv_events_topic": o.kv_events_topic, "kv_events_layout": o.kv_events_layout}


def speculation_parameters(o: ServeOptions) -> dict[str, object]:
    """The torch engine's speculative decoding settings (docs/speculative-decoding.md), read by the engine
    process (engine_overrides), every one written so the repository shows what runs. The draft engine's path
    is made absolute: the engine process may run in another directory."""
    params: dict[str, object] = {name: getattr(o, name) for name in SPECULATION_KNOBS}
    if o.speculative_model is not None:
        params["speculative_model"] = str(Path(o.speculative_model).resolve())
    # Refused here, naming the option, rather than by an engine process that would then restart in a loop.
    config = SpeculationConfig.from_knobs(params)
    if config is not None and config.mode == "draft_target" and config.draft_engine_dir is not None:
        draft = EngineInfo.read(config.draft_engine_dir)
        if draft.target != "torch":
            raise ValueError(f"speculative_model {draft.path} is a {draft.target} engine: speculative_decoding "
                             "draft_target drafts with an engine built for the torch target")
    return params


def runtime_parameters(ctx: RepoContext) -> dict[str, object]:
    """tensorrt_llm's parameters, named as the TensorRT-LLM backend names them."""
    o = ctx.options
    return {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(ctx.engine.path),
        "enable_kv_cache_reuse": o.enable_kv_cache_reuse,
        "enable_chunked_context": o.enable_chunked_context,
        "batch_scheduler_policy": o.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": o.kv_cache_free_gpu_mem_fraction,
        "max_tokens_in_paged_kv_cache": o.max_tokens_in_paged_kv_cache,
        "max_queue_size": o.max_queue_size,
        "max_beam_width": o.max_beam_width,
        "max_num_tokens": o.max_num_tokens,
        "exclude_input_in_output": o.exclude_input_in_output,
        "cancellation_check_period_ms": o.cancellation_check_period_ms,
        "stats_check_period_ms": o.stats_check_period_ms,
        "engine_threads": o.engine_threads,  # read by the engine process (serve/engine_process/server.py)
        "compute_dtype": o.compute_dtype,  # the engine process's (engine_overrides)
        **tier_parameters(o),
        **kv_event_parameters(o),
        "kv_cache_eviction_policy": o.kv_cache_eviction_policy,  # the engine process's pool (engine_overrides)
        "guided_jump_forward": o.guided_jump_forward,  # the engine process's (engine_overrides)
        **speculation_parameters(o),
        **lora_parameters(o),  # max_loras, max_cpu_loras, serve --lora-modules (serve/launch/lora_modules.py)
        "guided_decoding_backend": GUIDED_DECODING_BACKEND,  # checked when the model loads (guided.check_backend)
    }


def tensorrt_llm_python_config(ctx: RepoContext) -> mc.ModelConfig:
    """Torch target: a thin decoupled model over the engine process."""
    params = runtime_parameters(ctx) | {"engine_socket": ctx.engine_socket,
                                        "triton_max_batch_size": ctx.max_batch_size}
    cfg = _base("tensorrt_llm", ctx.max_batch_size, TOKEN_INPUTS, TOKEN_OUTPUTS, params,
                decoupled=True)
    cfg.input[0].allow_ragged_batch = True
    return cfg


def fused_ensemble_config(ctx: RepoContext) -> mc.ModelConfig:
    """Torch target's `ensemble`: tokenize, submit, detokenize, cancel, in one model."""
    params = {
        "tokenizer_dir": str(ctx.engine.tokenizer_dir),
        "engine_socket": ctx.engine_socket,
        "gpt_model_path": str(ctx.engine.path),
        "exclude_input_in_output": ctx.options.exclude_input_in_output,
        "max_beam_width": ctx.options.max_beam_width,  # a request's beam_width is refused past it (inputs.py)
        "cancellation_check_period_ms": ctx.options.cancellation_check_period_ms,
        "add_special_tokens": inputs.ADD_SPECIAL_TOKENS,
        "skip_special_tokens": inputs.SKIP_SPECIAL_TOKENS,
    }
    return _base("ensemble", ctx.max_batch_size, ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, params,
                 decoupled=True)


def core_takes_salt(ctx: RepoContext) -> bool:
    """The torch core takes `cache_salt`; Triton's tensorrtllm backend (TensorRT-LLM 1.2) reads no
    salt input, although its executor Request has a cacheSaltID (docs/gpu.md)."""
    if ctx.engine.target != "trtllm":
        return True
    if ctx.engine.prompt.get("require_cache_salt"):
        raise ValueError(f"{ctx.engine.path}: require_cache_salt = true cannot be served on the trtllm target: "
                         "Triton's tensorrtllm backend has no per-request cache salt input; rebuild with "
                         "require_cache_salt = false or serve with the torch target")
    return False


def core_takes_retention(ctx: RepoContext) -> bool:
    """The upstream ensemble hands the retention inputs to its core where that core declares them: the
    torch core does (TOKEN_INPUTS), and so does the trtllm target's tensorrtllm core, as tensorrtllm_backend's
    template declares them (trtllm_model_config.py; docs/prefix-pool.md, "TensorRT-LLM targets")."""
    return ctx.engine.target in ("torch", "trtllm")


def core_guide_types(ctx: RepoContext) -> tuple[str, ...]:
    """The guide types the upstream layout's core serves: the torch engine's, or the trtllm target's (none
    where its engine directory has no xgrammar tokenizer info: TensorRT-LLM then has guided decoding off)."""
    if ctx.engine.target != "trtllm":
        return TORCH_GUIDE_TYPES
    from trtprompt.serve.launch.trtllm_model_config import trtllm_guide_types

    return trtllm_guide_types(ctx.engine.path)


def publishes_request_metrics(ctx: RepoContext) -> bool:
    """The trtllm target's postprocessing publishes request metrics from the core's perf outputs;
    the torch core's engine process publishes its own (the same families: do not count twice)."""
    return ctx.engine.target == "trtllm"


def preprocessing_config(ctx: RepoContext) -> mc.ModelConfig:
    perf = publishes_request_metrics(ctx)
    params = {"tokenizer_dir": str(ctx.engine.tokenizer_dir), "add_special_tokens": inputs.ADD_SPECIAL_TOKENS,
              "gpt_model_path": str(ctx.engine.path),  # its prompt policy and bounds (issue 5)
              "enable_chunked_context": ctx.options.enable_chunked_context,  # decides max_input_len
              "salt_reaches_core": core_takes_salt(ctx),
              "force_perf_metrics": True if perf else None,
              "guided_decoding_guide_types": ",".join(core_guide_types(ctx))}  # none: guided decoding is off
    flag_in, flag_out = ((PERF_FLAG, "BOOL", [1], True),), ((PERF_FLAG, "BOOL", [1], False),)
    return _base("preprocessing", ctx.max_batch_size, PRE_INPUTS + (flag_in if perf else ()),
                 PRE_OUTPUTS + (flag_out if perf else ()), params)


def postprocessing_config(ctx: RepoContext) -> mc.ModelConfig:
    perf = publishes_request_metrics(ctx)
    params = {"tokenizer_dir": str(ctx.engine.tokenizer_dir), "skip_special_tokens": inputs.SKIP_SPECIAL_TOKENS,
              "max_open_streams": 4096, "stream_idle_timeout_s": 600,
              "publish_request_metrics": True if perf else None,
              "gpt_model_path": str(ctx.engine.path) if perf else None}  # its tokens_per_block
    # ONE instance: the streaming detokenizer state lives in it, and two
    # instances could reorder a stream's chunks (docs/design.md, "Triton facts").
    return _base("postprocessing", ctx.max_batch_size, POST_INPUTS + (POST_PERF_INPUTS if perf else ()),
                 POST_OUTPUTS, params)


def _step(cfg: mc.ModelConfig, model: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> None:
    step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
    for key, value in inputs.items():
        step.input_map[key] = value
    for key, value in outputs.items():
        step.output_map[key] = value


def _preprocessing_step(cfg: mc.ModelConfig, ctx: RepoContext) -> None:
    inputs = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
              "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
              "MESSAGES": "messages", "OVERFLOW": "overflow", "CACHE_SALT": "cache_salt",
              **{pre: name for (name, *_), (pre, *_) in zip(GUIDE_INPUTS, PRE_GUIDE)}}
    outputs = {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
               "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
               "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "OUT_END_ID": "_PREPROCESSOR_END_ID",
               "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID", **{pre: f"_{pre}" for pre, *_ in PRE_GUIDE}}
    if ctx.engine.target != "trtllm":  # the torch core echoes the prompt edge's counts
        outputs |= {name.upper(): f"_{name}" for name in PROMPT_OUTPUTS}
    if publishes_request_metrics(ctx):
        inputs[PERF_FLAG] = "return_perf_metrics"
        outputs[PERF_FLAG] = f"_{PERF_FLAG}"
    _step(cfg, "preprocessing", inputs, outputs)


def _core_step(cfg: mc.ModelConfig, ctx: RepoContext) -> None:
    inputs = {
        "input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
        "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
        "pad_id": "_PREPROCESSOR_PAD_ID", "stop_words_list": "_STOP_WORDS_IDS",
        "bad_words_list": "_BAD_WORDS_IDS", "streaming": "stream", "runtime_top_k": "top_k",
        "runtime_top_p": "top_p", "temperature": "temperature", "len_penalty": "length_penalty",
        "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty", "min_tokens": "min_tokens", "seed": "seed",
        "beam_width": "beam_width", "exclude_input_in_output": "exclude_input_in_output",
        "return_log_probs": "return_log_probs", "return_perf_metrics": "return_perf_metrics",
    } | {f"return_{name}": f"return_{name}" for name in COUNT_OUTPUTS}
    inputs |= {name: f"_{pre}" for (name, *_), (pre, *_) in zip(GUIDE_INPUTS, PRE_GUIDE)}  # as preprocessing checked
    if publishes_request_metrics(ctx):
        inputs["return_perf_metrics"] = f"_{PERF_FLAG}"
    if core_takes_salt(ctx):
        inputs["cache_salt"] = "cache_salt"
    if core_takes_retention(ctx):  # ranges over the prompt preprocessing fitted, as on TensorRT-LLM
        inputs |= {name: name for name, *_ in RETENTION_INPUTS}
    inputs |= {name: name for name, *_ in LORA_INPUTS}  # either core takes them, as tensorrtllm_backend's does
    outputs = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
    outputs |= {name: name for name, *_ in PERF_OUTPUTS} | {name: name for name in COUNT_OUTPUTS}
    if ctx.engine.target != "trtllm":  # preprocessing's counts, handed back by the core on every response
        inputs |= {name: f"_{name}" for name in PROMPT_OUTPUTS} | {name: name for name, *_ in LOGITS_INPUTS}
        inputs |= {name: name for name, *_ in SPECULATION_INPUTS}  # the torch core's opt-out, as sent
        outputs |= {name: name for name in PROMPT_OUTPUTS + LOGPROB_OUTPUTS + _names(LOGITS_OUTPUTS)}
    _step(cfg, "tensorrt_llm", inputs, outputs)


def upstream_ensemble_config(ctx: RepoContext) -> mc.ModelConfig:
    """tensorrtllm_backend's ensemble: preprocessing -> tensorrt_llm -> postprocessing.

    Client cancellation does not cross a Triton ensemble (docs/design.md, "Triton facts"); this
    layout exists for the GPU target, whose core is the C++ backend.
    """
    torch_core = ctx.engine.target != "trtllm"  # the C++ backend cannot hand the counts back
    supported = [t for t in ENSEMBLE_INPUTS if t not in UNSUPPORTED_INPUTS + FUSED_ONLY_INPUTS and t[0] not in
                 ("min_length", "random_seed", "perf_metrics_final_only")
                 and (core_takes_retention(ctx) or t not in RETENTION_INPUTS)
                 and (torch_core or t not in LOGITS_INPUTS)  # the C++ core's logits: its engine's build flags
                 and (torch_core or t not in SPECULATION_INPUTS)]  # and its speculation: its engine's build
    from_core = PROMPT_OUTPUTS + LOGPROB_OUTPUTS + _names(LOGITS_OUTPUTS)  # the torch core's, as they are
    outputs = [t for t in ENSEMBLE_OUTPUTS if t[0] in ("text_output", *COUNT_OUTPUTS)
               or (torch_core and t[0] in from_core)] + list(PERF_OUTPUTS)
    cfg = _base("ensemble", ctx.max_batch_size, supported, outputs, {}, backend=None)
    cfg.platform = "ensemble"
    _preprocessing_step(cfg, ctx)
    _core_step(cfg, ctx)
    post_inputs = {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"}
    if publishes_request_metrics(ctx):  # the core's own outputs: allowed after a decoupled step
        post_inputs |= {name.upper(): name for name, *_ in PERF_OUTPUTS}
    _step(cfg, "postprocessing", post_inputs, {"OUTPUT": "text_output"})
    return cfg


def _write_model(root: Path, cfg: mc.ModelConfig, source: str | None) -> None:
    model_dir = root / cfg.name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    text = text_format.MessageToString(cfg)
    if check_config_text(text) != cfg:
        raise RuntimeError(f"{cfg.name}/config.pbtxt does not round-trip through the schema")
    (model_dir / "config.pbtxt").write_text(text, encoding="utf-8")
    if source is not None:
        shutil.copyfile(MODELS_DIR / source, model_dir / "1" / "model.py")


def untaken_speculation(o: ServeOptions) -> tuple[int, str] | None:
    """The trtllm target's (log level, line) about the torch engine's speculation options, which its
    TensorRT-LLM 1.2 engine cannot act on (not refused: speculative_decoding's default is ngram); a warning
    naming the options given (those off their defaults), a note for the defaults alone; None for
    speculative_decoding none, which is what runs there."""
    if o.speculative_decoding == "none":
        return None
    given = [f"{name}={getattr(o, name)}" for name in SPECULATION_KNOBS
             if getattr(o, name) != knobs.runtime_default(name)]
    what = f"the option(s) {', '.join(given)} are" if given else \
        f"speculative_decoding (default {o.speculative_decoding}) is"
    return (logging.WARNING if given else logging.INFO,
            f"trtprompt serve: {what} not applied on the trtllm target: a TensorRT-LLM 1.2 engine speculates only "
            "when built for it (trtllm-build --speculative_decoding_mode), and its tensorrtllm backend takes no "
            "such serve option; the torch target speculates (docs/speculative-decoding.md)")


def model_configs(ctx: RepoContext) -> list[tuple[mc.ModelConfig, str | None]]:
    """(config, python model file or None) for every model of the layout."""
    if ctx.engine.target == "trtllm":  # upstream layout around the tensorrtllm C++ backend, 1.2's tensors added
        from trtprompt.serve.launch.trtllm_model_config import params_for, trtllm_model_configs

        note = untaken_speculation(ctx.options)
        if note is not None:
            log.log(*note)
        return trtllm_model_configs(params_for(ctx), preprocessing_config(ctx), postprocessing_config(ctx),
                                    upstream_ensemble_config(ctx))
    core = (tensorrt_llm_python_config(ctx), "tensorrt_llm.py")
    if ctx.options.layout == "fused":
        return [core, (fused_ensemble_config(ctx), "ensemble.py")]
    return [(preprocessing_config(ctx), "preprocessing.py"), core,
            (postprocessing_config(ctx), "postprocessing.py"), (upstream_ensemble_config(ctx), None)]


def write_repository(root: str | Path, ctx: RepoContext) -> Path:
    """Write (replace) the model repository at root; returns root."""
    root = Path(root)
    if root.exists():
        for child in root.iterdir():
            if (child / "config.pbtxt").is_file():
                shutil.rmtree(child)
    root.mkdir(parents=True, exist_ok=True)
    for cfg, source in model_configs(ctx):
        _write_model(root, cfg, source)
    return root
