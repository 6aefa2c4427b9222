"""The LLM API arguments (TensorRT-LLM 1.3+, PyTorch backend) of one build, as plain data and as model.yaml.

Nothing here imports TensorRT-LLM: the arguments are a dict whose keys are
the registry's LLM API names (trtprompt/knobs.py `Knob.llmapi`, dotted into
`kv_cache_config` / `scheduler_config`), so the same values that a 1.2 engine
gets as BuildConfig fields and config.pbtxt parameters land here under the
LLM API's names. One `model.yaml` carries them all: the tensorrtllm_backend
llmapi model (`all_models/llmapi/tensorrt_llm/1/model.py`) reads it beside
itself, and `trtllm-serve MODEL --extra_llm_api_options model.yaml` takes the
same file (its `triton_config` section is the Triton model's, not an LLM API
argument, and is dropped before validation).

Where TensorRT-LLM is installed, the arguments are validated with its own
argument class before anything is written (validate_llm_args); where it is
not, the caller says so once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from trtprompt.knobs import KNOBS, LLMAPI_DECODING_TYPES, NO_DRAFT_MODEL
from trtprompt.plan import BuildPlan

BACKEND = "pytorch"
# The llmapi Triton model's own section: batching is the LLM API's (0), streaming needs decoupled.
TRITON_CONFIG: Mapping[str, Any] = MappingProxyType({"max_batch_size": 0, "decoupled": True})
NOT_LLM_ARGS: tuple[str, ...] = ("triton_config",)
# TensorRT-LLM leaves guided decoding off unless the LLM args name a backend (and then ignores an OpenAI
# response_format): xgrammar, which both of its backends implement and the only one with structural tags.
GUIDED_DECODING_BACKEND = "xgrammar"
# The runtime knobs model.yaml carries (their LLM API names come from the registry).
RUNTIME_KNOBS: tuple[str, ...] = ("enable_chunked_context", "enable_kv_cache_reuse", "batch_scheduler_policy",
                                  "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache",
                                  "kv_cache_host_memory_bytes")
BOUND_KNOBS: tuple[str, ...] = ("max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len", "max_beam_width",
                                "tokens_per_block")
# The speculation knobs each speculative_decoding mode writes into speculative_config (under their LLM API
# names, tests/fixtures/trtllm_names.json): NGramDecodingConfig's, and DraftTargetDecodingConfig's; the
# decoding_type of each is knobs.LLMAPI_DECODING_TYPES'.
SPECULATION_KNOBS_OF: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "ngram": ("max_draft_len", "max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool",
              "speculation_max_concurrency"),
    "draft_target": ("max_draft_len", "speculative_model", "speculation_max_concurrency")})
# The LLM API's CapacitySchedulerPolicy members are the upper-case names of the 1.2 values.
ARG_CLASSES: tuple[tuple[str, str], ...] = (("tensorrt_llm.llmapi", "TorchLlmArgs"), ("tensorrt_llm.llmapi", "LlmArgs"))


@dataclass(frozen=True)
class LlmapiPaths:
    """Where the LLM API finds the model and tokenizer (absolute: model.yaml is read from elsewhere)."""

    model: Path
    tokenizer: Path

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):
            if not Path(getattr(self, name)).is_absolute():
                raise ValueError(f"{name} must be an absolute path, got {getattr(self, name)}")


def put_arg(args: dict[str, Any], dotted: str, value: Any) -> None:
    """args["a"]["b"] = value for dotted "a.b"."""
    *parents, leaf = dotted.split(".")
    node = args
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def llmapi_value(name: str, value: Any) -> Any:
    if name == "batch_scheduler_policy":
        return str(value).upper()
    if name == "kv_cache_host_memory_bytes" and not value:
        return None  # 0 means no host tier: leave the LLM API's default (None) in place
    return value


def speculative_config(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """model.yaml's speculative_config from the speculation knobs' values (absent or None: the knob's default;
    an unset one stays out), decoding_type first; None for speculative_decoding none (no speculative_config)."""
    def value(name: str) -> Any:
        given = values.get(name)
        return KNOBS[name].default if given is None else given

    mode = value("speculative_decoding")
    KNOBS["speculative_decoding"].check(mode)
    if mode == "none":
        return None
    if mode == "draft_target" and value("speculative_model") is None:
        raise ValueError(NO_DRAFT_MODEL)
    args: dict[str, Any] = {}
    put_arg(args, str(KNOBS["speculative_decoding"].llmapi), LLMAPI_DECODING_TYPES[mode])
    for name in SPECULATION_KNOBS_OF[mode]:
        if value(name) is not None:
            put_arg(args, str(KNOBS[name].llmapi), KNOBS[name].check(value(name)))
    return dict(args["speculative_config"])


def llm_args(plan: BuildPlan, runtime: Mapping[str, Any], paths: LlmapiPaths, tp_size: int = 1,
             pp_size: int = 1) -> dict[str, Any]:
    """model.yaml's content: bounds from the plan, runtime policy from the profile, under LLM API names."""
    args: dict[str, Any] = {"model": str(paths.model), "tokenizer": str(paths.tokenizer), "backend": BACKEND,
                            "tensor_parallel_size": tp_size, "pipeline_parallel_size": pp_size, "dtype": plan.dtype,
                            "guided_decoding_backend": GUIDED_DECODING_BACKEND}
    bounds = vars(plan.bounds)
    values = {**{k: bounds.get(k) for k in BOUND_KNOBS},
              **{k: runtime.get(k, KNOBS[k].default) for k in RUNTIME_KNOBS}}
    for name, value in values.items():
        value = llmapi_value(name, value)
        if value is not None:
            put_arg(args, str(KNOBS[name].llmapi), value)
    args["triton_config"] = dict(TRITON_CONFIG)
    return args


def to_yaml(args: Mapping[str, Any]) -> str:
    """YAML text of the arguments, key order kept. PyYAML is there wherever transformers is (it depends
    on it), so it is imported here rather than declared a dependency of its own."""
    import yaml

    return yaml.safe_dump(dict(args), sort_keys=False, default_flow_style=False)


def from_yaml(text: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("model.yaml must hold a mapping of LLM API arguments")
    return data


def _arg_class() -> Any | None:
    """TensorRT-LLM's own argument class, or None where TensorRT-LLM is not installed."""
    for module, name in ARG_CLASSES:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def validate_llm_args(args: Mapping[str, Any]) -> str | None:
    """Validate with TensorRT-LLM's TorchLlmArgs (LlmArgs in older releases): its class name, or None
    where TensorRT-LLM is not installed. ValueError (naming the class) when it refuses them."""
    cls = _arg_class()
    if cls is None:
        return None
    given = {k: v for k, v in args.items() if k not in NOT_LLM_ARGS}
    try:
        cls(**given)
    except Exception as exc:  # pydantic's ValidationError and the validators' own errors
        raise ValueError(f"TensorRT-LLM's {cls.__name__} refuses the model.yaml arguments: {exc}") from exc
    return str(cls.__name__)
