"""TensorRT-LLM's rules relating the bounds, each written once (listed in docs/profiles.md, "Rules").

The engine, the build plan, `inspect`, the serve layer, `lint` and the bench
all call these, so what `inspect` shows is what runs. Standard library only.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from trtprompt.knobs import LOWERABLE_KEYS


def max_input_len(max_seq_len: int, max_num_tokens: int, enable_chunked_context: bool) -> int:
    """Longest prompt the runtime accepts: max_seq_len - 1 with chunked context, else
    min(max_seq_len - 1, max_num_tokens) (without chunking one step must hold the whole prompt)."""
    if enable_chunked_context:
        return max_seq_len - 1
    return min(max_seq_len - 1, max_num_tokens)


def raised_bounds(values: Mapping[str, Any], build: Mapping[str, Any],
                  keys: Iterable[str] = LOWERABLE_KEYS) -> list[str]:
    """Runtime values may lower build bounds (max_batch_size, max_num_tokens, max_beam_width), never
    raise them: one message per value that does."""
    problems = []
    for key in keys:
        value, bound = values.get(key), build.get(key)
        if value is not None and bound is not None and value > bound:
            problems.append(f"{key}={value} exceeds the engine's build-time {key} ({bound}); "
                            "runtime values may lower build bounds, never raise them")
    return problems


def check_not_raised(values: Mapping[str, Any], build: Mapping[str, Any],
                     keys: Iterable[str] = LOWERABLE_KEYS) -> None:
    problems = raised_bounds(values, build, keys)
    if problems:
        raise ValueError("; ".join(problems))


def kv_pool(bytes_per_token: int, tokens_per_block: int, max_tokens: int | None, free_mem_fraction: float,
            budget_bytes: int | None, max_batch_size: int | None = None,
            max_seq_len: int | None = None) -> tuple[int, int] | None:
    """(tokens, blocks) of the KV pool; None when neither a token cap nor a memory budget is known.

    The pool holds min(max_tokens, fraction x budget / bytes per token) tokens
    (TensorRT-LLM's rule), in whole blocks; given the scheduler's bounds, never
    more blocks than max_batch_size full-length sequences can use (more is waste).
    """
    caps = []
    if max_tokens is not None:
        caps.append(max_tokens)
    if budget_bytes is not None:
        caps.append(int(budget_bytes * free_mem_fraction) // bytes_per_token)
    if not caps:
        return None
    tokens = min(caps)
    blocks = tokens // tokens_per_block
    if max_batch_size is not None and max_seq_len is not None:
        useful = max_batch_size * math.ceil(max_seq_len / tokens_per_block)
        if blocks > useful:
            tokens, blocks = useful * tokens_per_block, useful
    return tokens, blocks


def paged_kv_cache(build: Mapping[str, Any]) -> bool:
    """Whether an engine's KV cache is paged: build_config.kv_cache_type decides (TensorRT-LLM 1.x);
    without it, the deprecated plugin_config.paged_kv_cache (on unless said otherwise)."""
    kind = build.get("kv_cache_type")
    if kind is not None:
        return str(kind).upper() == "PAGED"
    return bool((build.get("plugin_config") or {}).get("paged_kv_cache", True))


def paged_context_missing(build: Mapping[str, Any]) -> list[str]:
    """What an engine lacks for chunked context and KV block reuse, which both need paged context
    FMHA on a paged KV cache: a subset of ["use_paged_context_fmha", "paged_kv_cache"]."""
    present = {"use_paged_context_fmha": bool((build.get("plugin_config") or {}).get("use_paged_context_fmha")),
               "paged_kv_cache": paged_kv_cache(build)}
    return [need for need, ok in present.items() if not ok]


# The trtllm-build flag that puts back what paged_context_missing names (TensorRT-LLM 1.2 spellings).
REBUILD_FLAGS: dict[str, str] = {"use_paged_context_fmha": "--use_paged_context_fmha enable",
                                 "paged_kv_cache": "--kv_cache_type paged"}


def reuse_loss_warning(build: Mapping[str, Any]) -> str | None:
    """None when a TensorRT-LLM 1.2 engine can reuse KV blocks and chunk context; else one line naming
    what it lacks, what is therefore off (KV reuse, chunked context) and the build flag that fixes it,
    so no engine loses reuse silently."""
    missing = paged_context_missing(build)
    if not missing:
        return None
    flags = " ".join(REBUILD_FLAGS[m] for m in missing)
    return (f"engine built without {' and '.join(missing)}: KV-cache reuse and chunked context are off "
            f"(rebuild with trtllm-build {flags})")
