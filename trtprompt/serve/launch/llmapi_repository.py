"""The Triton repository of an llmapi engine directory (TensorRT-LLM 1.3+, PyTorch backend).

Models:
  ensemble      this project's decoupled Python model (models/llmapi_ensemble.py): the client
                interface of every layout (`text_input`, `max_tokens`, `stream`, `stop_words`,
                `messages`, `overflow`, `cache_salt`, ... -> `text_output`), the prompt edge
                (bounds with the same error wording, overflow policy, chat window, cache-salt
                refusal), then TensorRT-LLM's model through BLS.
  tensorrt_llm  TensorRT-LLM's own llmapi model: its `model.py` (and `helpers.py`) from the
                installed tensorrtllm backend models, never a copy of ours, found when the
                repository is written (find_llmapi_model); `1/model.yaml` is the engine
                directory's, with its paths pointing at the engine directory where it is now
                and the serve options applied under their LLM API names
                (speculative_config from the speculation options, none where speculative_decoding is none;
                lora_config from the engine's adapters and max_loras / max_cpu_loras, lora_config()).

Where TensorRT-LLM's model is not installed (any machine but the GPU container), the repository
is still written, with `tensorrt_llm/1/MODEL_PY_FROM_CONTAINER.txt` saying where model.py comes
from, and `serve` (not `--repo-only`) stops with a message naming the container.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtprompt.engine.engine_dir import LLMAPI_TARGET
from trtprompt.engine.lora.adapter import CONFIG_FILE as ADAPTER_CONFIG
from trtprompt.engine.lora.engine_dir import lora_dirs
from trtprompt.engine.lora.modules import TRTLLM_NAMES
from trtprompt.engine.speculation.config import SPECULATION_KNOBS
from trtprompt.errors import TargetUnavailableError
from trtprompt.interface import PERF_OUTPUTS, RETENTION_INPUTS, Tensor
from trtprompt.knobs import KNOBS
from trtprompt.serve.launch.options import EngineInfo, ServeOptions
from trtprompt.serve.launch.repository import ENSEMBLE_INPUTS, _base, _write_model
from trtprompt.serve.wire import requests as wire
from trtprompt.targets.kv_offload import llmapi_offload_args
from trtprompt.targets.llmapi_build import CHECKPOINT_DIR, MODEL_YAML
from trtprompt.targets.llmapi_config import (
    GUIDED_DECODING_BACKEND,
    TRITON_CONFIG,
    from_yaml,
    llmapi_value,
    put_arg,
    speculative_config,
    to_yaml,
)

MODEL_DIR_ENV = "TRTPROMPT_LLMAPI_MODEL_DIR"  # a folder holding config.pbtxt and 1/model.py
LLMAPI_MODEL = Path("all_models") / "llmapi" / "tensorrt_llm"
# Where a TensorRT-LLM checkout or container keeps the backend's models (tensorrtllm_backend's layout
# before 1.0, triton_backend/ inside TensorRT-LLM since). Which of these a given NGC tag fills is not
# verified here (no GPU container): MODEL_DIR_ENV names it exactly.
SEARCH_ROOTS: tuple[Path, ...] = (Path("/app"), Path("/opt/tritonserver/tensorrtllm_backend"),
                                  Path("/workspace/TensorRT-LLM/triton_backend"),
                                  Path("/opt/TensorRT-LLM/triton_backend"))
LLMAPI_CONTAINER = ("an nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 container with TensorRT-LLM >= 1.3 "
                    "(a tag newer than 26.05, which ships 1.2.1)")
PLACEHOLDER = "MODEL_PY_FROM_CONTAINER.txt"
MODEL_FILES: tuple[str, ...] = ("model.py", "helpers.py")
# The llmapi model's inputs and outputs as TensorRT-LLM's all_models/llmapi config.pbtxt declares them
# (names read from the source, tests/fixtures/trtllm_names.json); used only where that file is absent.
CORE_INPUTS: tuple[Tensor, ...] = (
    ("text_input", "STRING", [-1], False), ("streaming", "BOOL", [1], True),
    ("sampling_param_temperature", "FP32", [1], True), ("sampling_param_top_k", "INT32", [1], True),
    ("sampling_param_top_p", "FP32", [1], True), ("sampling_param_frequency_penalty", "FP32", [1], True),
    ("sampling_param_presence_penalty", "FP32", [1], True), ("sampling_param_max_tokens", "INT32", [1], True),
    ("sampling_param_stop", "STRING", [-1], True), ("sampling_param_seed", "UINT64", [1], True),
    ("sampling_param_exclude_input_from_output", "BOOL", [1], True),
    ("sampling_param_return_perf_metrics", "BOOL", [1], True), ("return_cumulative_logprob", "BOOL", [1], True))
CORE_OUTPUTS: tuple[Tensor, ...] = (
    ("text_output", "STRING", [-1], False), ("kv_cache_reused_block", "INT32", [-1], False),
    ("kv_cache_alloc_new_blocks", "INT32", [-1], False), ("kv_cache_alloc_total_blocks", "INT32", [-1], False),
    ("arrival_time_ns", "INT64", [1], False), ("first_scheduled_time_ns", "INT64", [1], False),
    ("first_token_time_ns", "INT64", [1], False), ("last_token_time_ns", "INT64", [1], False),
    ("cumulative_logprob", "FP32", [-1], False))
# The client inputs the llmapi ensemble declares (the others of ENSEMBLE_INPUTS have no llmapi input);
# What TensorRT-LLM's llmapi model cannot carry (launch/ does not import triton_models/, so the names are
# repeated from llmapi_edge.UNCARRIED; tests/test_llmapi_repository.py keeps the two equal).
UNCARRIED_INPUTS: tuple[str, ...] = ("num_return_sequences", "beam_width", "bad_words", "embedding_bias_words",
                                     "embedding_bias_weights", "return_context_logits", "return_generation_logits",
                                     "guided_decoding_guide_type", "guided_decoding_guide")
# cache_salt, the retention inputs and the uncarried ones are declared so the edge can refuse them clearly.
EDGE_INPUTS: tuple[str, ...] = ("text_input", "max_tokens", "stop_words", "temperature", "top_k", "top_p",
                                "presence_penalty", "frequency_penalty", "seed", "stream", "exclude_input_in_output",
                                "return_perf_metrics", "return_log_probs", "cache_salt", "overflow", "messages",
                                *(name for name, *_ in RETENTION_INPUTS), *UNCARRIED_INPUTS)
# return_log_probs' output on this layout: the sum only (the llmapi model returns no per-token values).
LOGPROB_OUTPUT: Tensor = ("cum_log_probs", "FP32", [-1], False)
# Serve options model.yaml takes (their LLM API names come from the registry).
YAML_OPTIONS: tuple[str, ...] = ("enable_chunked_context", "enable_kv_cache_reuse", "batch_scheduler_policy",
                                 "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache", "max_batch_size",
                                 "max_num_tokens")


def find_llmapi_model(env: Mapping[str, str] = os.environ, roots: Iterable[Path] = SEARCH_ROOTS) -> Path | None:
    """The installed llmapi model folder (config.pbtxt + 1/model.py), or None."""
    given = env.get(MODEL_DIR_ENV)
    candidates = [Path(given)] if given else [root / LLMAPI_MODEL for root in roots]
    return next((c for c in candidates if (c / "1" / "model.py").is_file()), None)


def draft_model(value: str) -> str:
    """speculative_model as TensorRT-LLM loads it: an llmapi engine directory's checkpoint/ (a Hugging Face
    checkpoint), any other existing directory as an absolute path (model.yaml is read from elsewhere), and a
    name that is no path here as it is (a Hugging Face Hub id, which TensorRT-LLM downloads)."""
    path = Path(value).expanduser()
    if not path.exists():
        return value
    path = path.resolve()
    if (path / MODEL_YAML).is_file() and (path / CHECKPOINT_DIR).is_dir():
        return str(path / CHECKPOINT_DIR)
    return str(path)


def speculation_values(options: ServeOptions) -> dict[str, Any]:
    """The speculation knobs' serve values, speculative_model as TensorRT-LLM loads it."""
    values = {name: getattr(options, name) for name in SPECULATION_KNOBS}
    if options.speculative_model is not None:
        values["speculative_model"] = draft_model(options.speculative_model)
    return values


def serve_model_yaml(engine: EngineInfo, options: ServeOptions, trtllm_version: str | None = None) -> dict[str, Any]:
    """The engine's model.yaml, its paths at the engine's current place, the serve options applied; the host
    and disk tier fields only where TensorRT-LLM trtllm_version (None: the newest release read) has them."""
    args = from_yaml((engine.path / "model.yaml").read_text(encoding="utf-8"))
    args["model"], args["tokenizer"] = str(engine.path / "checkpoint"), str(engine.tokenizer_dir)
    args.setdefault("guided_decoding_backend", GUIDED_DECODING_BACKEND)  # a directory built before it was written
    for name in YAML_OPTIONS:
        value = llmapi_value(name, getattr(options, name))
        if value is not None:
            put_arg(args, str(KNOBS[name].llmapi), value)
    for field, value in llmapi_offload_args(options, trtllm_version).items():
        put_arg(args, f"kv_cache_config.{field}", value)
    args.pop("speculative_config", None)  # the serve options decide, none included (no speculative_config)
    spec = speculative_config(speculation_values(options))
    if spec is not None:
        args["speculative_config"] = spec
    lora = lora_config(engine, options, args.get("lora_config"))
    if lora is not None:
        args["lora_config"] = lora
    args["triton_config"] = {**dict(args.get("triton_config") or {}), **TRITON_CONFIG}
    return args


def lora_config(engine: EngineInfo, options: ServeOptions, built: Any) -> dict[str, Any] | None:
    """model.yaml's lora_config (TensorRT-LLM's LoraConfig: names in tests/fixtures/trtllm_names.json): the
    engine directory's adapters (lora/NAME/, trtprompt build --lora-dir) as lora_dir, their modules under
    TensorRT-LLM's names, max_lora_rank as built (the knob's default where the build recorded none) and the
    serve options max_loras / max_cpu_loras. None where the engine has no adapters and its model.yaml no
    lora_config: TensorRT-LLM refuses a lora_config without lora_dir or lora_target_modules."""
    dirs = list(lora_dirs(engine.path, None).values())
    given = dict(built) if isinstance(built, dict) else {}
    if not dirs and not given:
        return None
    modules = set(given.get("lora_target_modules") or ())
    for path in dirs:
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        targets = config.get("target_modules") or ()
        modules |= {TRTLLM_NAMES[m] for m in ([targets] if isinstance(targets, str) else targets) if m in TRTLLM_NAMES}
    out = given | {"lora_dir": dirs or list(given.get("lora_dir") or []), "lora_target_modules": sorted(modules)}
    out.setdefault("max_lora_rank", KNOBS["max_lora_rank"].default)
    for name in ("max_loras", "max_cpu_loras"):
        put_arg(out, str(KNOBS[name].llmapi).split(".", 1)[1], getattr(options, name))
    return out


def _core_config(found: Path | None) -> mc.ModelConfig:
    """TensorRT-LLM's config.pbtxt where installed (its inputs match its model.py), else one written from the
    names read from its source; either way decoupled with max_batch_size 0, as model.yaml's triton_config says
    (the launch disables Triton's auto-complete, which is where model.py would apply them)."""
    if found is not None and (found / "config.pbtxt").is_file():
        try:
            cfg = text_format.Parse((found / "config.pbtxt").read_text(encoding="utf-8"), mc.ModelConfig())
        except text_format.ParseError as exc:
            raise ValueError(f"{found / 'config.pbtxt'} (TensorRT-LLM's llmapi model) does not parse with "
                             f"Triton's ModelConfig schema: {exc}") from exc
    else:
        cfg = _base("tensorrt_llm", 0, CORE_INPUTS, CORE_OUTPUTS, {})
    cfg.max_batch_size = 0
    cfg.model_transaction_policy.decoupled = True
    return cfg


def _write_core(root: Path, engine: EngineInfo, options: ServeOptions, found: Path | None,
                trtllm_version: str | None) -> None:
    _write_model(root, _core_config(found), None)
    version = root / "tensorrt_llm" / "1"
    args = serve_model_yaml(engine, options, trtllm_version)
    disk = args.get("kv_cache_config", {}).get("disk_cache_path")
    if disk:  # TensorRT-LLM refuses a disk_cache_path that is not an existing directory
        Path(disk).mkdir(parents=True, exist_ok=True)
    (version / "model.yaml").write_text(to_yaml(args), encoding="utf-8")
    if found is None:
        (version / PLACEHOLDER).write_text(
            f"model.py is TensorRT-LLM's own llmapi Triton model ({LLMAPI_MODEL}/1/model.py and helpers.py),\n"
            f"not part of trtprompt. It was not found here (set {MODEL_DIR_ENV} to its folder, or write the\n"
            f"repository inside {LLMAPI_CONTAINER}); `trtprompt serve` copies it in there.\n", encoding="utf-8")
        return
    for name in MODEL_FILES:
        if (found / "1" / name).is_file():
            shutil.copyfile(found / "1" / name, version / name)


def _ensemble_config(engine: EngineInfo, options: ServeOptions) -> mc.ModelConfig:
    tensors = [t for t in ENSEMBLE_INPUTS if t[0] in EDGE_INPUTS]
    tensors += [t for t in RETENTION_INPUTS if t[0] not in {n for n, *_ in tensors}]
    outputs: list[Tensor] = [("text_output", "STRING", [-1], False), LOGPROB_OUTPUT, *PERF_OUTPUTS]
    params = {"tokenizer_dir": str(engine.tokenizer_dir), "gpt_model_path": str(engine.path),
              "add_special_tokens": wire.ADD_SPECIAL_TOKENS,
              "enable_chunked_context": options.enable_chunked_context}  # decides max_input_len
    batch = options.max_batch_size or int(engine.build_config["max_batch_size"])
    return _base("ensemble", batch, tensors, outputs, params, decoupled=True)


def check_salt_policy(engine: EngineInfo) -> None:
    if engine.prompt.get("require_cache_salt"):
        raise ValueError(f"{engine.path}: require_cache_salt = true cannot be served on the llmapi layout: "
                         "TensorRT-LLM's llmapi Triton model has no per-request cache salt input; rebuild with "
                         "require_cache_salt = false or serve with the torch target")


def write_llmapi_repository(root: str | Path, engine: EngineInfo, options: ServeOptions,
                            found: Path | None = None, trtllm_version: str | None = None) -> Path:
    """Write (replace) the llmapi repository at root; found: TensorRT-LLM's llmapi model folder, if any;
    trtllm_version: the release model.yaml is for (None: the newest release read, targets/kv_offload.py)."""
    if engine.target != LLMAPI_TARGET:
        raise ValueError(f"{engine.path} is a {engine.target} engine, not an llmapi one")
    check_salt_policy(engine)
    root = Path(root)
    for child in (root.iterdir() if root.exists() else ()):
        if (child / "config.pbtxt").is_file():
            shutil.rmtree(child)
    root.mkdir(parents=True, exist_ok=True)
    _write_core(root, engine, options, found, trtllm_version)
    _write_model(root, _ensemble_config(engine, options), "llmapi_ensemble.py")
    return root


def require_llmapi_model(found: Path | None) -> Path:
    """serve (not --repo-only) needs TensorRT-LLM's model.py: the message names where it comes from."""
    if found is None:
        raise TargetUnavailableError(
            f"TensorRT-LLM's llmapi Triton model ({LLMAPI_MODEL}/1/model.py) is not installed here, so this "
            f"llmapi engine directory cannot be served. Serve it inside {LLMAPI_CONTAINER}, or set "
            f"{MODEL_DIR_ENV} to that folder of a TensorRT-LLM checkout; `--repo-only DIR` writes the "
            "repository without it.")
    return found
