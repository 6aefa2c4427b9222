"""Build plan: resolve the bounds from the model, the profile and CLI overrides, then size the memory.

Bounds follow TensorRT-LLM 1.x's build rules (docs/design.md): max_seq_len defaults
to max_position_embeddings x rope factor (no factor for su/longrope/llama3,
whose max_position_embeddings already is the extended length), max_input_len
is clipped to max_seq_len, max_num_tokens is capped at max_seq_len x
max_batch_size and raised to at least tokens_per_block, and opt_num_tokens
defaults to min(max_batch_size x max_beam_width, max_num_tokens).
Where TensorRT-LLM only warns about a bound the model cannot honour, the plan
refuses: a silently shrunk attention window is worse than an error.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from trtprompt import rules
from trtprompt.checkpoint import expected_weight_shapes, is_layer_linear
from trtprompt.engine.config import ModelConfig
from trtprompt.errors import PlanError
from trtprompt.knobs import DEFAULT_MAX_INPUT_LEN, DEFAULT_MAX_NUM_TOKENS, KNOBS
from trtprompt.lora_build import LoraPlan, LoraRequest, plan_lora
from trtprompt.profile import Profile

TARGETS: tuple[str, ...] = ("torch", "trtllm")
TARGET_DTYPES: dict[str, tuple[str, ...]] = {
    "torch": ("float32", "bfloat16", "float16"),
    "trtllm": ("float32", "bfloat16", "float16"),
}
TARGET_QUANTIZATIONS: dict[str, tuple[str, ...]] = {
    "torch": ("none", "int8_wo", "int8_w8a8", "int4_wo"),
    "trtllm": ("none", "int8_wo", "fp8", "int4_awq"),
}
QUANT_ALGOS: dict[str, str | None] = {"none": None, "int8_wo": "W8A16", "fp8": "FP8", "int4_awq": "W4A16_AWQ",
                                      "int8_w8a8": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "int4_wo": "W4A16"}
# The quantizations whose layer linears are stored int8 + a float32 scale per output row.
INT8_WEIGHT_QUANTIZATIONS: tuple[str, ...] = ("int8_wo", "int8_w8a8")
# int4_wo's layer linears: two int4 values per byte + a float32 scale and minimum per group of input columns
# (engine/quant_int4.py).
INT4_WEIGHT_QUANTIZATIONS: tuple[str, ...] = ("int4_wo",)
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
NO_FACTOR_ROPE_TYPES: tuple[str, ...] = ("su", "longrope", "llama3")
MAX_NUM_TOKENS_ADVISED = 16384


@dataclass(frozen=True)
class BuildBounds:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    opt_num_tokens: int | None
    max_beam_width: int
    tokens_per_block: int
    multiple_profiles: bool


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    kv_bytes_per_token: int
    bytes_per_block: int
    kv_budget_bytes: int | None  # memory the fraction applies to; None: not known at build time
    kv_budget_source: str
    kv_cache_tokens: int | None  # tokens the pool holds
    num_blocks: int | None
    blocks_per_sequence: int  # blocks one max_seq_len sequence needs
    full_length_sequences: int | None


@dataclass(frozen=True)
class BuildPlan:
    target: str
    dtype: str
    quantization: str
    quant_algo: str | None
    bounds: BuildBounds
    memory: MemoryPlan
    runtime_max_input_len: int  # what the engine will accept (TRT-LLM runtime rule)
    warnings: tuple[str, ...]
    kv_cache_dtype: str = "auto"  # knobs.KV_CACHE_DTYPES
    int4_group_size: int | None = None  # input columns per int4 scale (int4_wo only; None: no int4 weights)
    quantize_lm_head: bool = False  # lm_head int8 too (int8_wo on the torch target only)
    int8_group_size: int | None = None  # input columns per int8 scale (int8_wo only; None: a scale per row)
    # max_lora_rank, and the adapters build --lora-dir put in the engine, checked against the base (lora_build.py)
    lora: LoraPlan = LoraPlan(KNOBS["max_lora_rank"].default)

    @property
    def group_size(self) -> int | None:
        """Input columns per weight scale where the quantization groups them (int4_wo's or int8_wo's), else None."""
        return self.int4_group_size or self.int8_group_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_factor(rotary_scaling: Mapping[str, Any] | None) -> float:
    if not rotary_scaling:
        return 1.0
    kind = rotary_scaling.get("rope_type", rotary_scaling.get("type"))
    if kind in NO_FACTOR_ROPE_TYPES:
        return 1.0
    return float(rotary_scaling.get("factor", 1.0))


def model_max_seq_len(pc: Mapping[str, Any]) -> int:
    limit = math.ceil(pc["max_position_embeddings"] * rope_factor(pc.get("rotary_scaling")))
    window = pc.get("sliding_window")
    # The embedded engine has no sliding-window attention: stay inside the window.
    return min(limit, window) if window else limit


def _max_seq_len(pc: Mapping[str, Any], profile: Profile) -> int:
    limit = model_max_seq_len(pc)
    if profile.max_seq_len is None:
        return limit
    if profile.max_seq_len > limit:
        factor = rope_factor(pc.get("rotary_scaling"))
        window = pc.get("sliding_window")
        why = (f"sliding_window {window}" if window and window < pc["max_position_embeddings"] * factor
               else f"max_position_embeddings {pc['max_position_embeddings']} x rope factor {factor:g}")
        raise PlanError(f"max_seq_len {profile.max_seq_len} exceeds what the model's positions allow: "
                        f"{limit} ({why})")
    return profile.max_seq_len


def _max_input_len(profile: Profile, max_seq_len: int) -> int:
    if profile.max_input_len is None:
        return min(DEFAULT_MAX_INPUT_LEN, max_seq_len)
    if profile.max_input_len > max_seq_len:
        raise PlanError(f"max_input_len {profile.max_input_len} is larger than max_seq_len {max_seq_len}")
    return profile.max_input_len


def _num_tokens(profile: Profile, max_seq_len: int) -> tuple[int, int | None]:
    """(max_num_tokens, opt_num_tokens) in TensorRT-LLM's order of adjustments."""
    if profile.multiple_profiles and profile.opt_num_tokens is not None:
        raise PlanError(f"opt_num_tokens ({profile.opt_num_tokens}) must be unset with multiple_profiles")
    max_num = profile.max_num_tokens or DEFAULT_MAX_NUM_TOKENS
    opt = profile.opt_num_tokens
    if opt is None and not profile.multiple_profiles:
        opt = min(profile.max_batch_size * profile.max_beam_width, max_num)
    max_num = min(max_num, max_seq_len * profile.max_batch_size)
    max_num = max(max_num, profile.tokens_per_block)
    if opt is not None:
        opt = min(opt, max_num)
    return max_num, opt


def resolve_bounds(pc: Mapping[str, Any], profile: Profile) -> BuildBounds:
    max_seq_len = _max_seq_len(pc, profile)
    max_num, opt = _num_tokens(profile, max_seq_len)
    return BuildBounds(
        max_batch_size=profile.max_batch_size,
        max_input_len=_max_input_len(profile, max_seq_len),
        max_seq_len=max_seq_len,
        max_num_tokens=max_num,
        opt_num_tokens=opt,
        max_beam_width=profile.max_beam_width,
        tokens_per_block=profile.tokens_per_block,
        multiple_profiles=profile.multiple_profiles,
    )


def weight_bytes(pc: Mapping[str, Any], dtype: str, quantization: str, int4_group_size: int | None = None,
                 quantize_lm_head: bool = False, int8_group_size: int | None = None) -> int:
    """Bytes of the engine's weights: int8 + a float32 scale per row (or per group of int8_group_size) for int8
    linears, half a byte per weight + a float32 scale and minimum per group of int4_group_size for int4 ones;
    with quantize_lm_head, lm_head's int8 copy (beside the embedding it may be tied to)."""
    vocab, hidden = pc["vocab_size"], pc["hidden_size"]

    def int8_scale_bytes(out_f: int, in_f: int) -> int:  # float32 scales: one per row, or per group of a row
        return 4 * out_f * (in_f // int8_group_size if int8_group_size else 1)

    total = vocab * hidden + int8_scale_bytes(vocab, hidden) if quantize_lm_head else 0
    for name, shape in expected_weight_shapes(pc).items():
        count = math.prod(shape)
        if quantize_lm_head and name == "lm_head.weight":
            continue  # counted above
        if quantization in INT8_WEIGHT_QUANTIZATIONS and is_layer_linear(name):
            total += count + int8_scale_bytes(shape[0], shape[1])
        elif quantization in INT4_WEIGHT_QUANTIZATIONS and is_layer_linear(name) and int4_group_size:
            total += count // 2 + 2 * 4 * shape[0] * (shape[1] // int4_group_size)
        else:
            total += count * DTYPE_BYTES[dtype]
    return total


def int4_group_size(profile: Profile) -> int | None:
    """The group size int4 weights are built with; None when the quantization stores no int4 weights (the knob
    keeps its default then, and nothing records it)."""
    return profile.int4_group_size if profile.quantization in INT4_WEIGHT_QUANTIZATIONS else None


def int8_group_size(profile: Profile) -> int | None:
    """The group size int8_wo's weights are built with; None: a scale per row (the plan refuses the knob with
    any other quantization)."""
    return profile.int8_group_size if profile.quantization == "int8_wo" else None


def resolve_dtype(profile: Profile, source_dtype: str, target: str) -> str:
    auto = profile.dtype in (None, "auto")
    dtype = source_dtype if auto else str(profile.dtype)
    allowed = TARGET_DTYPES[target]
    if dtype not in allowed:
        origin = "the checkpoint's dtype" if auto else "profile/--dtype"
        raise PlanError(f"dtype {dtype} ({origin}) cannot run on the {target} target; "
                        f"choose one of {', '.join(allowed)}")
    return dtype


def _check_target(profile: Profile, target: str) -> None:
    if target not in TARGETS:
        raise PlanError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    allowed = TARGET_QUANTIZATIONS[target]
    if profile.quantization == "int4_wo" and target != "torch":
        raise PlanError(f"quantization int4_wo (int4 weights in groups, rounded to nearest) is available on the torch "
                        f"target only; on the {target} target use int4_awq, TensorRT-LLM's grouped int4 weights "
                        "with AWQ calibration")
    if profile.quantization not in allowed:
        raise PlanError(f"quantization {profile.quantization} is not available on the {target} target; "
                        f"choose one of {', '.join(allowed)}")
    if profile.quantize_lm_head and (profile.quantization != "int8_wo" or target != "torch"):
        raise PlanError(f"quantize_lm_head quantizes lm_head as int8_wo does the layer linears: it needs quantization "
                        f"int8_wo on the torch target (got quantization {profile.quantization} on the {target} target)")
    if profile.int8_group_size is not None and (profile.quantization != "int8_wo" or target != "torch"):
        raise PlanError(f"int8_group_size {profile.int8_group_size} groups int8_wo's scales: it needs quantization "
                        f"int8_wo on the torch target (got quantization {profile.quantization} on the {target} "
                        "target)")
    if target != "torch" and profile.kv_cache_dtype != "auto":
        raise PlanError(f"kv_cache_dtype {profile.kv_cache_dtype} is available on the torch target only; "
                        f"the {target} target keeps the KV cache in the engine dtype (kv_cache_dtype auto)")
    if target == "torch" and profile.max_beam_width != 1:
        raise PlanError(f"max_beam_width {profile.max_beam_width}: the torch target does greedy and "
                        "sampled decoding only; max_beam_width must be 1")


def memory_plan(pc: Mapping[str, Any], profile: Profile, bounds: BuildBounds, dtype: str,
                kv_budget_bytes: int | None, budget_source: str) -> MemoryPlan:
    """The KV pool the engine will allocate (rules.kv_pool_blocks, the engine's own rule)."""
    per_token = ModelConfig.from_pretrained_config(pc).kv_bytes_per_token(DTYPE_BYTES[dtype], profile.kv_cache_dtype)
    tpb = bounds.tokens_per_block
    pool = rules.kv_pool(per_token, tpb, profile.max_tokens_in_paged_kv_cache, profile.kv_cache_free_gpu_mem_fraction,
                         kv_budget_bytes, bounds.max_batch_size, bounds.max_seq_len)
    tokens, blocks = pool if pool is not None else (None, None)
    per_seq = math.ceil(bounds.max_seq_len / tpb)
    return MemoryPlan(
        weight_bytes=weight_bytes(pc, dtype, profile.quantization, int4_group_size(profile), profile.quantize_lm_head,
                                  int8_group_size(profile)),
        kv_bytes_per_token=per_token, bytes_per_block=per_token * tpb,
        kv_budget_bytes=kv_budget_bytes, kv_budget_source=budget_source,
        kv_cache_tokens=tokens, num_blocks=blocks, blocks_per_sequence=per_seq,
        full_length_sequences=blocks // per_seq if blocks is not None else None,
    )


def _check_memory(mem: MemoryPlan, bounds: BuildBounds) -> None:
    if mem.full_length_sequences is None or mem.full_length_sequences >= 1:
        return
    raise PlanError(
        f"the KV cache budget holds {mem.num_blocks} blocks ({mem.kv_cache_tokens} tokens at "
        f"{mem.kv_bytes_per_token} bytes per token, budget from {mem.kv_budget_source}) but one "
        f"max_seq_len {bounds.max_seq_len} sequence needs {mem.blocks_per_sequence} blocks of "
        f"{bounds.tokens_per_block} tokens; raise max_tokens_in_paged_kv_cache or the KV budget, "
        "or lower max_seq_len")


def _warnings(profile: Profile, bounds: BuildBounds, dtype: str, target: str) -> tuple[str, ...]:
    notes = []
    if bounds.max_num_tokens > MAX_NUM_TOKENS_ADVISED:
        notes.append(f"max_num_tokens {bounds.max_num_tokens} is above {MAX_NUM_TOKENS_ADVISED}; "
                     "TensorRT-LLM advises against it")
    if target == "torch" and dtype == "float16":
        notes.append("float16 runs slowly on CPU; float32 (or bfloat16) is faster there")
    return tuple(notes)


def make_plan(pc: Mapping[str, Any], profile: Profile, target: str, source_dtype: str,
              kv_budget_bytes: int | None = None, budget_source: str = "not set",
              lora: LoraRequest | None = None) -> BuildPlan:
    _check_target(profile, target)
    try:
        ModelConfig.from_pretrained_config(pc)
    except ValueError as exc:
        raise PlanError(f"model: {exc}") from exc
    dtype = resolve_dtype(profile, source_dtype, target)
    bounds = resolve_bounds(pc, profile)
    mem = memory_plan(pc, profile, bounds, dtype, kv_budget_bytes, budget_source)
    _check_memory(mem, bounds)
    runtime_input = rules.max_input_len(bounds.max_seq_len, bounds.max_num_tokens, profile.enable_chunked_context)
    return BuildPlan(target, dtype, profile.quantization, QUANT_ALGOS[profile.quantization], bounds, mem,
                     runtime_input, _warnings(profile, bounds, dtype, target), profile.kv_cache_dtype,
                     int4_group_size(profile), profile.quantize_lm_head, int8_group_size(profile),
                     plan_lora(lora, pc, profile.max_lora_rank))
