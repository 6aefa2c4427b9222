"""Paged attention over packed tokens: the KV cache, one step's metadata, dispatch.

A step's batch is the concatenation of each sequence's new tokens. Their K/V
are written into the paged cache at their slots, then every new token attends
to its own sequence's cached tokens plus the new ones up to itself.

The cache is head-major, [blocks, kv_heads, tokens_per_block, head_size] per
layer for K and for V, so one (block, kv head) is a contiguous run of rows.
Index tensors a step needs are built once in `build_attention_metadata` and
shared by every layer. Two implementations sit behind it:

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
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from trtprompt.engine.config import ATTENTION_BACKENDS, ModelConfig

log = logging.getLogger(__name__)

KvCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step."""

    context_len: int  # tokens of this sequence already in the KV cache (computed before this step)
    num_new_tokens: int  # tokens computed in this step (prefill chunk, or 1 for decode)
    block_table: Sequence[int]  # block ids covering at least context_len + num_new_tokens tokens


class AttentionMetadata(Protocol):
    """What every layer needs of a step; made once by build_attention_metadata."""

    num_tokens: int
    slot_blocks: torch.Tensor  # [T] block of each new token's cache slot
    slot_offsets: torch.Tensor  # [T] row of that slot inside its block

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
               scale: float) -> torch.Tensor: ...


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


def slot_tensors(seqs: Sequence[SeqSlice], tpb: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of every new token's cache slot, in packed order."""
    blocks: list[int] = []
    offsets: list[int] = []
    for seq in seqs:
        for p in range(seq.context_len, seq.context_len + seq.num_new_tokens):
            blocks.append(seq.block_table[p // tpb])
            offsets.append(p % tpb)
    return (torch.tensor(blocks, dtype=torch.long, device=device),
            torch.tensor(offsets, dtype=torch.long, device=device))


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: torch.dtype, device: torch.device
) -> list[KvCache]:
    """Per layer (K, V), each [num_blocks, num_kv_heads, tokens_per_block, head_size]."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    shape = (num_blocks, cfg.num_key_value_heads, tokens_per_block, cfg.head_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]


def write_kv(kv_cache: KvCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the new tokens' k, v [T, kv_heads, head_size] at their slots."""
    k_cache, v_cache = kv_cache
    k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v


def gather_tables(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[S, kv_heads, max_blocks * tpb, d] copy of each block-table row's blocks, in order."""
    num_seqs, max_blocks = tables.shape
    _, kv_heads, tpb, d = cache.shape
    blocks = cache.index_select(0, tables.reshape(-1)).view(num_seqs, max_blocks, kv_heads, tpb, d)
    return blocks.transpose(1, 2).reshape(num_seqs, kv_heads, max_blocks * tpb, d)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[kv_heads, len(block_ids) * tokens_per_block, head_size] copy of the listed blocks, in order."""
    return gather_tables(cache, block_ids.reshape(1, -1))[0]


def contiguous_start(rows: list[int]) -> int | None:
    """rows[0] when rows are consecutive (a slice can select them), else None."""
    return rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None


def take_rows(x: torch.Tensor, rows: torch.Tensor, rows_start: int | None) -> torch.Tensor:
    """x's packed rows: a slice where they are consecutive, a gather otherwise."""
    if rows_start is not None:
        return x[rows_start:rows_start + rows.shape[0]]
    return x.index_select(0, rows)


def put_rows(dst: torch.Tensor, rows: torch.Tensor, rows_start: int | None, src: torch.Tensor) -> None:
    """Write src into dst's packed rows: a slice copy where they are consecutive."""
    if rows_start is not None:
        dst[rows_start:rows_start + rows.shape[0]] = src
    else:
        dst.index_copy_(0, rows, src)


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where keep, -inf elsewhere: the mask form the CPU flash kernel takes (of the query's dtype)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def build_attention_metadata(seqs: Sequence[SeqSlice], tokens_per_block: int, device: torch.device,
                             backend: str = "auto", dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    """Index tensors for one step; built once and shared by all layers.

    backend: "auto" (compiled kernel where it builds, else pure torch),
    "compiled", "torch" or "reference" (see resolve_attention_backend);
    dtype: the model's, for masks made ahead of the layers.
    """
    from trtprompt.engine import attention_paged, attention_reference

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
    from trtprompt.engine import kernels

    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    if requested in ("torch", "reference"):
        return requested
    misfit = kernels.kernel_fits(head_size or kernels.HEAD_SIZE_MULTIPLE,
                                 tokens_per_block or kernels.TOKENS_PER_BLOCK_MULTIPLE, torch.device(device))
    ok, why = (False, misfit) if misfit else kernels.compiled_kernel_status()
    if requested == "compiled" and not ok:
        raise ValueError(f"attention_backend 'compiled' is unavailable: {why}")
    return "compiled" if ok else "torch"


@functools.lru_cache(maxsize=None)
def log_attention_backend(requested: str, resolved: str) -> None:
    """Say once per process which attention path runs, and why the kernel doesn't where it doesn't."""
    from trtprompt.engine import kernels

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
    write_kv(kv_cache, k, v, meta)
    return meta.attend(q, k, v, kv_cache, scale)
