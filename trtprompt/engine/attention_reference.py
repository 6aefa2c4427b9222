"""Reference paged attention: gather each sequence's blocks, then one masked SDPA per plan.

The simple path the fast one (attention_paged.py) is tested against. Decodes
run as one batched SDPA over whole blocks gathered by block table, with a
length mask; prefill chunks run one SDPA each over their gathered context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from trtprompt.engine.attention_common import (
    KvCache,
    SeqSlice,
    StepReads,
    contiguous_start,
    gather_blocks,
    gather_tables,
    slot_tensors,
    take_rows,
)

# Bounds on per-layer temporaries: a decode group gathers at most this many
# (padded) blocks; a masked prefill attends at most this many query rows at once
# (SDPA turns a bool mask into a float one of [rows, keys]).
MAX_DECODE_GROUP_BLOCKS = 2048
PREFILL_QUERY_CHUNK = 1024


@dataclass(frozen=True)
class PrefillPlan:
    """A sequence with several new tokens: rows [start, start + num_new_tokens) of the batch."""

    start: int
    num_new_tokens: int
    context_len: int
    # Blocks holding tokens [0, context_len + num_new_tokens); None when there is
    # no cached context, so the fresh K/V are used directly with a causal mask.
    block_ids: torch.Tensor | None
    # [num_new_tokens, context_len + num_new_tokens] bool, True = attend; None when causal suffices.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodePlan:
    """One-token sequences attended as one padded batch (one group per bounded gather)."""

    rows: torch.Tensor  # [S] packed rows of the decode tokens
    rows_start: int | None  # set when rows are contiguous: rows == arange(start, start + S)
    block_tables: torch.Tensor  # [S, max_blocks], padded with block 0 (masked out)
    mask: torch.Tensor  # [S, 1, 1, max_blocks * tokens_per_block] bool, True = attend


@dataclass(frozen=True)
class ReferenceMetadata:
    num_tokens: int
    tokens_per_block: int
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    reads: StepReads  # kv_blocks, listed when an int8 cache asks
    prefills: tuple[PrefillPlan, ...]
    decodes: tuple[DecodePlan, ...]
    decode_tables: None = None  # the fused decode path is the compiled kernel's, never the reference's
    chunk_tables: None = None  # so is the one-call chunk step's

    @property
    def kv_blocks(self) -> torch.Tensor:
        """Every block the step reads, once (attention_common.StepReads)."""
        return self.reads.blocks

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
               scale: float) -> torch.Tensor:
        if not self.prefills and len(self.decodes) == 1 and self.decodes[0].rows_start == 0:
            return _decode_attention(q, kv_cache, self.decodes[0], scale)  # a pure decode step
        out = torch.empty_like(q)
        for plan in self.prefills:
            out[plan.start:plan.start + plan.num_new_tokens] = _prefill_attention(q, k, v, kv_cache, plan, scale)
        for dec in self.decodes:
            res = _decode_attention(q, kv_cache, dec, scale)
            if dec.rows_start is not None:
                out[dec.rows_start:dec.rows_start + res.shape[0]] = res
            else:
                out.index_copy_(0, dec.rows, res)
        return out


def _prefill_plan(start: int, seq: SeqSlice, tpb: int, device: torch.device) -> PrefillPlan:
    n, ctx = seq.num_new_tokens, seq.context_len
    if ctx == 0:
        return PrefillPlan(start, n, 0, None, None)
    total = ctx + n
    num_blocks = -(-total // tpb)
    block_ids = torch.tensor(list(seq.block_table[:num_blocks]), dtype=torch.long, device=device)
    # Row i (position ctx + i) sees keys 0 .. ctx + i.
    keys = torch.arange(total, device=device)
    mask = keys[None, :] <= (torch.arange(n, device=device) + ctx)[:, None]
    return PrefillPlan(start, n, ctx, block_ids, mask)


def _decode_plan(rows: list[int], seqs: list[SeqSlice], tpb: int, device: torch.device) -> DecodePlan:
    lengths = [s.context_len + 1 for s in seqs]
    max_blocks = -(-max(lengths) // tpb)
    tables = [list(s.block_table[:max_blocks]) + [0] * (max_blocks - min(max_blocks, len(s.block_table)))
              for s in seqs]
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    mask = torch.arange(max_blocks * tpb, device=device)[None, :] < lens[:, None]
    return DecodePlan(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        rows_start=contiguous_start(rows),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        mask=mask[:, None, None, :],
    )


def decode_groups(lengths: Sequence[int], tpb: int, max_group_blocks: int) -> list[list[int]]:
    """Indices of the sequences, split so no group gathers more than max_group_blocks blocks.

    One group in the common case; otherwise sequences are sorted by length so
    each group pads to lengths close to its own.
    """
    blocks = [-(-n // tpb) for n in lengths]
    if len(blocks) * max(blocks) <= max_group_blocks:
        return [list(range(len(blocks)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(blocks)), key=lambda j: -blocks[j]):
        if groups and (len(groups[-1]) + 1) * blocks[groups[-1][0]] <= max_group_blocks:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build(seqs: Sequence[SeqSlice], tpb: int, device: torch.device) -> ReferenceMetadata:
    prefills: list[PrefillPlan] = []
    decode_rows: list[int] = []
    decode_seqs: list[SeqSlice] = []
    start = 0
    for seq in seqs:
        if seq.num_new_tokens == 1:
            decode_rows.append(start)
            decode_seqs.append(seq)
        else:
            prefills.append(_prefill_plan(start, seq, tpb, device))
        start += seq.num_new_tokens
    groups = decode_groups([s.context_len + 1 for s in decode_seqs], tpb, MAX_DECODE_GROUP_BLOCKS) \
        if decode_seqs else []
    decodes = tuple(_decode_plan([decode_rows[i] for i in g], [decode_seqs[i] for i in g], tpb, device)
                    for g in groups)
    blocks, offsets = slot_tensors(seqs, tpb, device)
    return ReferenceMetadata(start, tpb, blocks, offsets, StepReads(tuple(seqs), tpb, device), tuple(prefills), decodes)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
                       plan: PrefillPlan, scale: float) -> torch.Tensor:
    rows = slice(plan.start, plan.start + plan.num_new_tokens)
    qh = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    if plan.block_ids is None or plan.mask is None:
        kh = k[rows].transpose(0, 1).unsqueeze(0)
        vh = v[rows].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # [n, heads, d]
    total = plan.context_len + plan.num_new_tokens
    kh = gather_blocks(kv_cache[0], plan.block_ids)[:, :total].unsqueeze(0)
    vh = gather_blocks(kv_cache[1], plan.block_ids)[:, :total].unsqueeze(0)
    parts = [
        F.scaled_dot_product_attention(qh[:, :, i:i + PREFILL_QUERY_CHUNK], kh, vh, scale=scale, enable_gqa=True,
                                       attn_mask=plan.mask[i:i + PREFILL_QUERY_CHUNK])
        for i in range(0, plan.num_new_tokens, PREFILL_QUERY_CHUNK)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out[0].transpose(0, 1)  # [n, heads, d]


def _decode_attention(q: torch.Tensor, kv_cache: KvCache, plan: DecodePlan, scale: float) -> torch.Tensor:
    num_seqs = plan.block_tables.shape[0]
    qd = take_rows(q, plan.rows, plan.rows_start)
    kv_heads, head_size = kv_cache[0].shape[1], kv_cache[0].shape[3]
    # Grouped heads become the query-length axis of their kv head: no K/V repeat needed.
    qg = qd.view(num_seqs, kv_heads, -1, head_size)
    kd = gather_tables(kv_cache[0], plan.block_tables)
    vd = gather_tables(kv_cache[1], plan.block_tables)
    out = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=plan.mask, scale=scale)
    return out.reshape(num_seqs, -1, head_size)
