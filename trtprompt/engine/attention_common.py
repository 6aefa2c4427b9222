"""What both attention backends share: a step's types and the block/row index helpers.

A module of its own so that attention.py, which dispatches to the backends,
imports them at module level while they import only this (no import circle).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

KvCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step."""

    context_len: int  # tokens of this sequence already in the KV cache (computed before this step)
    num_new_tokens: int  # tokens computed in this step (prefill chunk, or 1 for decode)
    block_table: Sequence[int]  # block ids covering at least context_len + num_new_tokens tokens


class AttentionMetadata(Protocol):
    """What every layer needs of a step; made once by attention.build_attention_metadata.

    Read-only members, so each backend's frozen dataclass satisfies it."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def slot_blocks(self) -> torch.Tensor: ...  # [T] block of each new token's cache slot

    @property
    def slot_offsets(self) -> torch.Tensor: ...  # [T] row of that slot inside its block

    @property
    def kv_blocks(self) -> torch.Tensor: ...  # every block the step reads, once (an int8 cache dequantizes them)

    @property
    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...  # a pure decode step's fused path

    @property
    def chunk_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...  # a step of whole chunks' (one call)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
               scale: float) -> torch.Tensor: ...


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


def step_blocks(seqs: Sequence[SeqSlice], tpb: int, device: torch.device) -> torch.Tensor:
    """The distinct blocks the step's sequences read (those holding their first context_len + new tokens)."""
    ids = {b for s in seqs for b in s.block_table[:-(-(s.context_len + s.num_new_tokens) // tpb)]}
    return torch.tensor(sorted(ids), dtype=torch.long, device=device)


@dataclass(frozen=True)
class StepReads:
    """What a step's metadata needs to list the blocks it reads, listed on first use only: an int8
    cache asks once per step (every layer shares the answer), and other caches never pay for it
    (about 170 us of Python a step at 32 sequences of 1,000 tokens)."""

    seqs: tuple[SeqSlice, ...]
    tokens_per_block: int
    device: torch.device

    @functools.cached_property
    def blocks(self) -> torch.Tensor:
        return step_blocks(self.seqs, self.tokens_per_block, self.device)


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
