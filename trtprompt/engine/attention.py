"""Paged attention over packed tokens: the KV cache, one step's metadata, dispatch.

A step's batch is the concatenation of each sequence's new tokens. Their K/V
are written into the paged cache at their slots, then every new token attends
to its own sequence's cached tokens plus the new ones up to itself.

The cache is head-major, [blocks, kv_heads, tokens_per_block, head_size] per
layer for K and for V, so one (block, kv head) is a contiguous run of rows.
Index tensors a step needs are built once in `build_attention_metadata` and
shared by every layer. Two implementations sit behind it (what they share,
types and index helpers, is in attention_common.py):

- attention_paged.py (default): decode reads blocks in place (compiled kernel,
  or a pure-torch fallback), prefill chunks attend to their cached context and
  their own tokens separately, and sequences sharing cached prefix blocks
  attend to them once together (cascade); partial results merge exactly by
  log-sum-exp.
- attention_reference.py: gathers each sequence's blocks into a contiguous
  copy and runs one masked SDPA per plan; the simple path tests compare with.

Design and measurements: docs/design.md, "Attention".
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch

from trtprompt.engine import attention_paged, attention_reference, kernels
from trtprompt.engine.attention_common import AttentionMetadata, KvCache, SeqSlice
from trtprompt.engine.attention_int8 import (
    Int8KvCache,
    allocate_int8,
    check_kv_cache_dtype,
    dequantize_rows,
    fill_scratch,
    write_rows,
)
from trtprompt.engine.config import ATTENTION_BACKENDS, ModelConfig

# The attention interface the model and the runner use: the shared types live in
# attention_common.py (so the backends need not import this module), named here too.
__all__ = ["AttentionMetadata", "KvCache", "SeqSlice", "allocate_kv_cache", "build_attention_metadata",
           "check_slice", "decode_attention", "log_attention_backend", "paged_attention", "resolve_attention_backend",
           "write_kv"]

log = logging.getLogger(__name__)


def check_slice(i: int, seq: SeqSlice, tokens_per_block: int) -> None:
    if seq.context_len < 0:
        raise ValueError(f"seqs[{i}].context_len must be >= 0, got {seq.context_len}")
    if seq.num_new_tokens < 1:
        raise ValueError(f"seqs[{i}].num_new_tokens must be >= 1, got {seq.num_new_tokens}")
    needed = seq.context_len + seq.num_new_tokens
    if len(seq.block_table) * tokens_per_block < needed:
        raise ValueError(
            f"seqs[{i}].block_table has {len(seq.block_table)} blocks of {tokens_per_block} tokens, "
            f"fewer than the {needed} tokens it must hold"
        )


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: torch.dtype, device: torch.device,
    kv_cache_dtype: str = "auto",
) -> list[KvCache]:
    """Per layer (K, V), each [num_blocks, num_kv_heads, tokens_per_block, head_size] of dtype;
    kv_cache_dtype int8: int8 rows with their scale (attention_int8.py)."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    shape = (num_blocks, cfg.num_key_value_heads, tokens_per_block, cfg.head_size)
    if check_kv_cache_dtype(kv_cache_dtype) == "int8":
        return list(allocate_int8(cfg.num_hidden_layers, shape, dtype, device))
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]


def write_kv(kv_cache: KvCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the new tokens' k, v [T, kv_heads, head_size] at their slots."""
    k_cache, v_cache = kv_cache
    k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v


def build_attention_metadata(seqs: Sequence[SeqSlice], tokens_per_block: int, device: torch.device,
                             backend: str = "auto", dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    """Index tensors for one step; built once and shared by all layers.

    backend: "auto" (compiled kernel where it builds, else pure torch),
    "compiled", "torch" or "reference" (see resolve_attention_backend);
    dtype: the model's, for masks made ahead of the layers.
    """
    if not seqs:
        raise ValueError("seqs must hold at least one sequence")
    for i, seq in enumerate(seqs):
        check_slice(i, seq, tokens_per_block)
    if backend == "reference":
        return attention_reference.build(seqs, tokens_per_block, device)
    resolved = resolve_attention_backend(backend, device)  # loads the kernel once; cached after
    return attention_paged.build(seqs, tokens_per_block, device, dtype, compiled=resolved == "compiled")


def resolve_attention_backend(requested: str, device: torch.device, head_size: int | None = None,
                              tokens_per_block: int | None = None) -> str:
    """The backend that runs: "compiled", "torch" or "reference".

    "auto" picks the compiled kernel where it builds and fits the model, else
    pure torch; "compiled" asked for but unavailable is an error naming why.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    if requested in ("torch", "reference"):
        return requested
    misfit = kernels.kernel_fits(head_size or kernels.head_size_multiple(),
                                 tokens_per_block or kernels.TOKENS_PER_BLOCK_MULTIPLE, torch.device(device))
    ok, why = (False, misfit) if misfit else kernels.compiled_kernel_status()
    if requested == "compiled" and not ok:
        raise ValueError(f"attention_backend 'compiled' is unavailable: {why}")
    return "compiled" if ok else "torch"


@functools.lru_cache(maxsize=None)
def log_attention_backend(requested: str, resolved: str) -> None:
    """Say once per process which attention path runs, and why the kernel doesn't where it doesn't."""
    if resolved == "compiled":
        log.info("attention: compiled paged kernel, reads KV blocks in place (%s)", kernels.compiled_kernel_status()[1])
    elif resolved == "torch" and requested == "auto":
        log.warning("attention: pure-torch paged path; the compiled kernel is unavailable (%s)",
                    kernels.compiled_kernel_status()[1])
    else:
        log.info("attention: %s path, as configured", resolved)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] of the new tokens -> attention output [T, heads, d]."""
    if isinstance(kv_cache, Int8KvCache):
        k_rows = write_rows(kv_cache[0], meta.slot_blocks, meta.slot_offsets, k)
        v_rows = write_rows(kv_cache[1], meta.slot_blocks, meta.slot_offsets, v)
        if isinstance(meta, attention_paged.PagedMetadata) and meta.compiled:
            # Every kernel of the step reads the int8 rows in place, the new tokens' own among them
            # (written above; the compiled path never reads k and v): no scratch.
            return meta.attend(q, k, v, kv_cache, scale)
        # The torch and reference backends read the step's blocks dequantized (attention_int8.py), and
        # the new tokens' own K/V as stored.
        return meta.attend(q, dequantize_rows(k_rows, k.dtype), dequantize_rows(v_rows, v.dtype),
                           fill_scratch(kv_cache, meta.kv_blocks), scale)
    if isinstance(meta, attention_paged.PagedMetadata) and meta.compiled:
        # One compiled call for both caches (write_kv's two index assignments are ~20 torch ops a layer).
        torch.ops.trtprompt.write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_blocks, meta.slot_offsets)
    else:
        write_kv(kv_cache, k, v, meta)
    return meta.attend(q, k, v, kv_cache, scale)


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KvCache,
                     meta: AttentionMetadata, heads: int, scale: float,
                     qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor | None:
    """A pure decode step on the compiled kernel, one call a layer: q/k norms where given ((q weight, k weight,
    eps): Qwen3), rotary on q and k (cos/sin as CompiledOps.rotary_tables makes them), the K/V write, paged
    decode; qkv [S, (heads + 2 kv_heads) d] -> [S, heads d], the op-by-op path's result bit for bit
    (csrc/decode_attention.cpp). None where the step is not one, or the cache is int8: the caller takes the
    op-by-op path."""
    tables = meta.decode_tables
    if tables is None or isinstance(kv_cache, Int8KvCache):
        return None
    q_norm, k_norm, eps = qk_norms if qk_norms is not None else (None, None, 0.0)
    out: torch.Tensor = torch.ops.trtprompt.decode_attention(qkv, cos, sin, kv_cache[0], kv_cache[1],
                                                             meta.slot_blocks, meta.slot_offsets, *tables,
                                                             heads, scale, q_norm, k_norm, eps)
    return out
