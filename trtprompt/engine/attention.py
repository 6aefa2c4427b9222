"""Paged attention over packed tokens.

A step's batch is the concatenation of each sequence's new tokens. Their
K/V are written into the paged cache at their slots, then every new token
attends to its own sequence's cached tokens plus the new ones up to itself.

All index tensors a step needs are built once in `build_attention_metadata`
and shared by every layer. Decodes (one new token) run as ONE batched
scaled_dot_product_attention over whole KV blocks gathered by block table,
with a length mask; prefill chunks run one SDPA each (they are big, so the
per-sequence call costs nothing next to their GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from trtprompt.engine.config import ModelConfig

KvCache = tuple[torch.Tensor, torch.Tensor]

# Bounds on per-layer temporaries: a decode group gathers at most this many
# (padded) blocks; a masked prefill attends at most this many query rows at once
# (SDPA turns a bool mask into a float one of [rows, keys]).
MAX_DECODE_GROUP_BLOCKS = 2048
PREFILL_QUERY_CHUNK = 1024


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step."""

    context_len: int  # tokens of this sequence already in the KV cache (computed before this step)
    num_new_tokens: int  # tokens computed in this step (prefill chunk, or 1 for decode)
    block_table: Sequence[int]  # block ids covering at least context_len + num_new_tokens tokens


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
class AttentionMetadata:
    num_tokens: int
    tokens_per_block: int
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    prefills: tuple[PrefillPlan, ...]
    decodes: tuple[DecodePlan, ...]


def _check_slice(i: int, seq: SeqSlice, tokens_per_block: int) -> None:
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


def _slots(seq: SeqSlice, tokens_per_block: int) -> list[int]:
    table = seq.block_table
    return [
        table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
        for p in range(seq.context_len, seq.context_len + seq.num_new_tokens)
    ]


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
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodePlan(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        rows_start=rows[0] if contiguous else None,
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        mask=mask[:, None, None, :],
    )


def _decode_groups(rows: list[int], seqs: list[SeqSlice], tpb: int) -> list[list[int]]:
    """Indices into rows/seqs, split so no group gathers more than MAX_DECODE_GROUP_BLOCKS blocks.

    One group in the common case; otherwise sequences are sorted by length so
    each group pads to lengths close to its own.
    """
    blocks = [-(-(s.context_len + 1) // tpb) for s in seqs]
    if len(seqs) * max(blocks) <= MAX_DECODE_GROUP_BLOCKS:
        return [list(range(len(seqs)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(seqs)), key=lambda j: -blocks[j]):
        if groups and (len(groups[-1]) + 1) * blocks[groups[-1][0]] <= MAX_DECODE_GROUP_BLOCKS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_plans(rows: list[int], seqs: list[SeqSlice], tpb: int, device: torch.device) -> tuple[DecodePlan, ...]:
    if not seqs:
        return ()
    return tuple(_decode_plan([rows[i] for i in g], [seqs[i] for i in g], tpb, device)
                 for g in _decode_groups(rows, seqs, tpb))


def build_attention_metadata(
    seqs: Sequence[SeqSlice], tokens_per_block: int, device: torch.device
) -> AttentionMetadata:
    """Index tensors for one step; built once and shared by all layers."""
    if not seqs:
        raise ValueError("seqs must hold at least one sequence")
    slots: list[int] = []
    prefills: list[PrefillPlan] = []
    decode_rows: list[int] = []
    decode_seqs: list[SeqSlice] = []
    for i, seq in enumerate(seqs):
        _check_slice(i, seq, tokens_per_block)
        start = len(slots)
        slots.extend(_slots(seq, tokens_per_block))
        if seq.num_new_tokens == 1:
            decode_rows.append(start)
            decode_seqs.append(seq)
        else:
            prefills.append(_prefill_plan(start, seq, tokens_per_block, device))
    return AttentionMetadata(
        num_tokens=len(slots),
        tokens_per_block=tokens_per_block,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        prefills=tuple(prefills),
        decodes=_decode_plans(decode_rows, decode_seqs, tokens_per_block, device),
    )


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: torch.dtype, device: torch.device
) -> list[KvCache]:
    """Per layer (K, V), each [num_blocks, tokens_per_block, num_kv_heads, head_size]."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    shape = (num_blocks, tokens_per_block, cfg.num_key_value_heads, cfg.head_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]


def write_kv(kv_cache: KvCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' k, v [T, kv_heads, head_size] at their slots."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * tokens_per_block, kv_heads, head_size] copy of the listed blocks."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(-1, *cache.shape[2:])


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
    kh = _gather_blocks(kv_cache[0], plan.block_ids)[:total].transpose(0, 1).unsqueeze(0)
    vh = _gather_blocks(kv_cache[1], plan.block_ids)[:total].transpose(0, 1).unsqueeze(0)
    parts = [
        F.scaled_dot_product_attention(qh[:, :, i:i + PREFILL_QUERY_CHUNK], kh, vh, scale=scale, enable_gqa=True,
                                       attn_mask=plan.mask[i:i + PREFILL_QUERY_CHUNK])
        for i in range(0, plan.num_new_tokens, PREFILL_QUERY_CHUNK)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out[0].transpose(0, 1)  # [n, heads, d]


def _decode_attention(q: torch.Tensor, kv_cache: KvCache, plan: DecodePlan, scale: float) -> torch.Tensor:
    num_seqs = plan.block_tables.shape[0]
    if plan.rows_start is not None:
        qd = q[plan.rows_start:plan.rows_start + num_seqs]
    else:
        qd = q.index_select(0, plan.rows)
    kv_heads, head_size = kv_cache[0].shape[2:]
    # Grouped heads become the query-length axis of their kv head: no K/V repeat needed.
    qg = qd.view(num_seqs, kv_heads, -1, head_size)
    kd = _gather_blocks(kv_cache[0], plan.block_tables).view(num_seqs, -1, kv_heads, head_size)
    vd = _gather_blocks(kv_cache[1], plan.block_tables).view(num_seqs, -1, kv_heads, head_size)
    out = F.scaled_dot_product_attention(qg, kd.transpose(1, 2), vd.transpose(1, 2),
                                         attn_mask=plan.mask, scale=scale)
    return out.reshape(num_seqs, -1, head_size)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] of the new tokens -> attention output [T, heads, d]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    if not meta.prefills and len(meta.decodes) == 1 and meta.decodes[0].rows_start == 0:
        return _decode_attention(q, kv_cache, meta.decodes[0], scale)  # a pure decode step
    out = torch.empty_like(q)
    for plan in meta.prefills:
        out[plan.start:plan.start + plan.num_new_tokens] = _prefill_attention(q, k, v, kv_cache, plan, scale)
    for dec in meta.decodes:
        res = _decode_attention(q, kv_cache, dec, scale)
        if dec.rows_start is not None:
            out[dec.rows_start:dec.rows_start + res.shape[0]] = res
        else:
            out.index_copy_(0, dec.rows, res)
    return out
