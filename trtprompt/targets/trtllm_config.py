"""Map a resolved BuildPlan to TensorRT-LLM 1.2.x build arguments, as plain data.

Nothing here imports TensorRT-LLM: the values are plain dicts so they can be
tested on any machine, printed as the equivalent `convert_checkpoint.py` +
`trtllm-build` command lines, and handed to the real API by trtllm_build.py.

Field names are TensorRT-LLM's: BuildConfig (max_batch_size, max_input_len,
max_seq_len, max_num_tokens, opt_num_tokens, max_beam_width, kv_cache_type,
gather_context_logits), PluginConfig (tokens_per_block, use_paged_context_fmha,
context_fmha, remove_input_padding, multiple_profiles, gemm_plugin), Mapping
(world_size, tp_size, pp_size), QuantConfig (quant_algo, kv_cache_quant_algo,
group_size) and LoraConfig (lora_dir, lora_ckpt_source, max_lora_rank,
lora_target_modules; with PluginConfig lora_plugin, trtllm-build's LoRA flags).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from trtprompt.lora_build import trtllm_lora_config
from trtprompt.plan import BuildPlan

# TensorRT-LLM's model class per Hugging Face architecture (tensorrt_llm.models).
MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "LLaMAForCausalLM",
    "MistralForCausalLM": "LLaMAForCausalLM",
    "Qwen2ForCausalLM": "QWenForCausalLM",
    "Qwen3ForCausalLM": "QWenForCausalLM",
}
# convert_checkpoint.py per architecture, relative to a TensorRT-LLM 1.2 checkout's examples/.
CONVERT_SCRIPTS: dict[str, str] = {
    "LlamaForCausalLM": "models/core/llama/convert_checkpoint.py",
    "MistralForCausalLM": "models/core/llama/convert_checkpoint.py",
    "Qwen2ForCausalLM": "models/core/qwen/convert_checkpoint.py",
    "Qwen3ForCausalLM": "models/core/qwen/convert_checkpoint.py",
}
QUANTIZE_SCRIPT = "quantization/quantize.py"
# quantize.py's --qformat for the quantizations that need ModelOpt calibration.
CALIBRATED_QFORMATS: dict[str, str] = {"fp8": "fp8", "int4_awq": "int4_awq"}
AWQ_GROUP_SIZE = 128
MAX_WORLD_SIZE = 64
GEMM_PLUGIN_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


@dataclass(frozen=True)
class Parallelism:
    """Tensor x pipeline parallel sizes; one engine file (rank<N>.engine) per rank."""

    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_WORLD_SIZE:
                raise ValueError(f"{name} must be an integer in [1, {MAX_WORLD_SIZE}], got {value!r}")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"tp_size x pp_size = {self.world_size} exceeds {MAX_WORLD_SIZE} ranks")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


@dataclass(frozen=True)
class TrtllmBuildArgs:
    """Everything the TensorRT-LLM API is called with, for one engine (all ranks)."""

    architecture: str
    model_class: str
    dtype: str
    quantization: str
    mapping: Mapping[str, int]  # Mapping(world_size, tp_size, pp_size); rank is set per call
    quant_config: Mapping[str, Any] | None  # QuantConfig(**quant_config); None: no quantization
    needs_calibration: bool  # fp8 / int4_awq go through <Arch>.quantize (ModelOpt), not from_hugging_face
    build_config: Mapping[str, Any]  # BuildConfig(**build_config), kv_cache_type as a KVCacheType name
    plugin_config: Mapping[str, Any]  # set one by one on build_config.plugin_config
    lora_config: Mapping[str, Any] | None = None  # LoraConfig(**lora_config) as build_config.lora_config; None: no LoRA

    @property
    def world_size(self) -> int:
        return int(self.mapping["world_size"])

    def mapping_for_rank(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size - 1}], got {rank}")
        return {**self.mapping, "rank": rank}


def quant_config(quantization: str, quant_algo: str | None) -> dict[str, Any] | None:
    """QuantConfig kwargs. The KV cache stays in the model dtype: an INT8 KV cache, or FP8 KV
    without FP8 weights, would make the builder switch paged context FMHA off (docs/design.md, "TensorRT-LLM rules reproduced")."""
    if quant_algo is None:
        return None
    config: dict[str, Any] = {"quant_algo": quant_algo, "kv_cache_quant_algo": None}
    if quantization == "int4_awq":
        config["group_size"] = AWQ_GROUP_SIZE
    return config


def build_config_values(plan: BuildPlan) -> dict[str, Any]:
    b = plan.bounds
    return {
        "max_batch_size": b.max_batch_size,
        "max_input_len": b.max_input_len,
        "max_seq_len": b.max_seq_len,
        "max_num_tokens": b.max_num_tokens,
        "opt_num_tokens": b.opt_num_tokens,
        "max_beam_width": b.max_beam_width,
        "kv_cache_type": "PAGED",
        # True would turn KV-cache reuse off at runtime.
        "gather_context_logits": False,
    }


def plugin_config_values(plan: BuildPlan) -> dict[str, Any]:
    values = {
        "tokens_per_block": plan.bounds.tokens_per_block,
        # Needed by both chunked context and KV-cache reuse; built in even when a profile
        # leaves them off, so the runtime flags can be switched on without a rebuild.
        "use_paged_context_fmha": True,
        "context_fmha": True,
        "remove_input_padding": True,
        "multiple_profiles": plan.bounds.multiple_profiles,
        "gemm_plugin": "auto" if plan.dtype in GEMM_PLUGIN_DTYPES else None,
    }
    if plan.lora.enabled:  # build --lora-dir / --lora-target-modules: the LoRA plugin in the model dtype
        values["lora_plugin"] = "auto"
    return values


def trtllm_build_args(plan: BuildPlan, architecture: str, parallel: Parallelism = Parallelism()) -> TrtllmBuildArgs:
    if plan.target != "trtllm":
        raise ValueError(f"plan is for the {plan.target} target, not trtllm")
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"architecture {architecture} has no TensorRT-LLM model class here; "
                         f"supported: {', '.join(MODEL_CLASSES)}")
    return TrtllmBuildArgs(
        architecture=architecture,
        model_class=MODEL_CLASSES[architecture],
        dtype=plan.dtype,
        quantization=plan.quantization,
        mapping={"world_size": parallel.world_size, "tp_size": parallel.tp_size, "pp_size": parallel.pp_size},
        quant_config=quant_config(plan.quantization, plan.quant_algo),
        needs_calibration=plan.quantization in CALIBRATED_QFORMATS,
        build_config=build_config_values(plan),
        plugin_config=plugin_config_values(plan),
        lora_config=trtllm_lora_config(plan.lora),
    )


def _enable(flag: bool) -> str:
    return "enable" if flag else "disable"


def convert_command(args: TrtllmBuildArgs, checkpoint: Path, trt_checkpoint: Path) -> list[str]:
    """The examples/ script that writes a TensorRT-LLM checkpoint (ModelOpt quantize.py when calibrated)."""
    common = ["--model_dir", str(checkpoint), "--output_dir", str(trt_checkpoint), "--dtype", args.dtype,
              "--tp_size", str(args.mapping["tp_size"]), "--pp_size", str(args.mapping["pp_size"])]
    if args.needs_calibration:
        cmd = ["python3", f"$TRTLLM_EXAMPLES/{QUANTIZE_SCRIPT}", *common,
               "--qformat", CALIBRATED_QFORMATS[args.quantization], "--calib_size", "512"]
        if args.quantization == "int4_awq":
            cmd += ["--awq_block_size", str(AWQ_GROUP_SIZE)]
        return cmd
    cmd = ["python3", f"$TRTLLM_EXAMPLES/{CONVERT_SCRIPTS[args.architecture]}", *common]
    if args.quantization == "int8_wo":
        cmd += ["--use_weight_only", "--weight_only_precision", "int8"]
    return cmd


def trtllm_build_command(args: TrtllmBuildArgs, trt_checkpoint: Path, out_dir: Path) -> list[str]:
    b, p = args.build_config, args.plugin_config
    cmd = ["trtllm-build", "--checkpoint_dir", str(trt_checkpoint), "--output_dir", str(out_dir)]
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "opt_num_tokens",
                "max_beam_width"):
        if b[key] is not None:
            cmd += [f"--{key}", str(b[key])]
    cmd += ["--kv_cache_type", str(b["kv_cache_type"]).lower(),
            "--tokens_per_block", str(p["tokens_per_block"]),
            "--use_paged_context_fmha", _enable(p["use_paged_context_fmha"]),
            "--context_fmha", _enable(p["context_fmha"]),
            "--remove_input_padding", _enable(p["remove_input_padding"]),
            "--multiple_profiles", _enable(p["multiple_profiles"]),
            "--gemm_plugin", p["gemm_plugin"] or "disable"]
    return cmd + lora_flags(args)


def lora_flags(args: TrtllmBuildArgs) -> list[str]:
    """trtllm-build's LoRA arguments (its --lora_dir and --lora_target_modules take several values each)."""
    lora = args.lora_config
    if lora is None:
        return []
    cmd = ["--lora_plugin", str(args.plugin_config["lora_plugin"])]
    if lora["lora_dir"]:
        cmd += ["--lora_dir", *lora["lora_dir"], "--lora_ckpt_source", str(lora["lora_ckpt_source"])]
    cmd += ["--max_lora_rank", str(lora["max_lora_rank"])]
    if lora["lora_target_modules"]:
        cmd += ["--lora_target_modules", *lora["lora_target_modules"]]
    return cmd


def _shell(cmd: list[str]) -> str:
    # $TRTLLM_EXAMPLES must stay expandable; everything else is quoted.
    lines: list[list[str]] = []
    for c in cmd:
        if not lines or c.startswith("--"):  # one option (and its value) per line
            lines.append([])
        lines[-1].append(f'"{c}"' if c.startswith("$TRTLLM_EXAMPLES/") else shlex.quote(c))
    return " \\\n    ".join(" ".join(line) for line in lines)


def format_commands(args: TrtllmBuildArgs, checkpoint: Path, out_dir: Path,
                    tokenizer_files: Sequence[Path] = ()) -> str:
    """Shell lines equivalent to `trtprompt build --target trtllm` (TensorRT-LLM 1.2.x CLI)."""
    trt_ckpt = out_dir.parent / f"{out_dir.name}.trtllm-checkpoint"
    tok = out_dir / "tokenizer"
    copy = " ".join(shlex.quote(str(f)) for f in tokenizer_files) or shlex.quote(f"{checkpoint}/tokenizer.json")
    lines = [
        "# Inside nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3 (TensorRT-LLM 1.2.1).",
        "# TRTLLM_EXAMPLES: the examples/ folder of a TensorRT-LLM v1.2.1 checkout.",
        _shell(convert_command(args, checkpoint, trt_ckpt)),
        _shell(trtllm_build_command(args, trt_ckpt, out_dir)),
        f"mkdir -p {shlex.quote(str(tok))} && cp {copy} {shlex.quote(str(tok))}/",
        "# `trtprompt serve` takes this directory as is (TensorRT-LLM's defaults, reuse on where the",
        "# engine allows it); `trtprompt build --target trtllm` also records the profile's policies.",
    ]
    return "\n".join(lines) + "\n"


def commands_for_plan(checkpoint: Path, architecture: str, tokenizer_files: Sequence[Path], plan: BuildPlan,
                      out_dir: Path, parallel: Parallelism = Parallelism()) -> str:
    """`trtprompt build --target trtllm --print-commands`: the plan as TensorRT-LLM CLI lines."""
    args = trtllm_build_args(plan, architecture, parallel)
    return format_commands(args, Path(checkpoint).absolute(), Path(out_dir).absolute(), tokenizer_files)
